"""`AUTOTILE_RECORD=trace.jsonl`: which problems a process's ops served, and how often.

Each op keeps one counter per call signature (a one-element list registered here when the signature is
first seen); the hot path pays one increment. When the process exits (or `flush()` is called) the
counters are summed per problem and written as JSON lines (also every FLUSH_EVERY_S, and on SIGTERM where the
program left its default handler), merged with the counts already in the file,
so several runs (or ranks) of a model add up (`<name>.lock` beside the file serialises their flushes). `autotile tune --from-trace trace.jsonl --budget 10m`
tunes the recorded problems, most calls first.

The file: a header `{"format": "autotile-trace", "version": 1, ...}`, one line per problem
`{"family": "gemm", "device": "h200/sm90", "problem": {...}, "calls": 1234}`, and an end record
`{"record": "end", "count": N}`, so a cut file is recognised.

>>> import json, pathlib, tempfile
>>> path = pathlib.Path(tempfile.mkdtemp()) / "t.jsonl"
>>> write_trace(path, [TraceEntry("gemm", "interpret", {"m": 1, "n": 8, "k": 8}, 3)])
>>> [(e.family, e.calls) for e in read_trace(path)]
[('gemm', 3)]
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime as dt
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from autotile import switches
from autotile.errors import BadInputError
from autotile.locks import beside_lock
from autotile.paths import unused_name

FORMAT = "autotile-trace"
VERSION = 1
# A trace line is a small JSON object; anything longer is not one of ours.
_MAX_LINE = 65536

log = logging.getLogger("autotile.runtime")

_counters: dict[tuple[str, str, str], tuple[dict, list[list[int]]]] = {}
_lock = threading.RLock()  # RLock: the SIGTERM handler may flush while the main thread holds it
_registered_exit = False


class TraceFormatError(BadInputError):
    """A trace file that is malformed, cut short, or written by another version of autotile."""


@dataclass(frozen=True)
class TraceEntry:
    family: str
    device: str
    problem: dict
    calls: int

    @property
    def key(self) -> tuple[str, str, str]:
        return self.family, self.device, json.dumps(self.problem, sort_keys=True, separators=(",", ":"))


def recording_path() -> Path | None:
    """The trace file AUTOTILE_RECORD names, made absolute the first time it is read (a model that changes folders
    after its first call keeps one trace); None when unset, blank or an off switch (0, false, no, off). An on switch
    (1, true, yes, on) names no file: nothing is recorded, said once."""
    value = os.environ.get("AUTOTILE_RECORD", "").strip()
    if not value or value.lower() in switches.OFF:
        return None
    if value.lower() in switches.ON:
        if value not in _resolved:
            _resolved[value] = None
            log.warning("autotile: AUTOTILE_RECORD=%s names no trace file: nothing is recorded. Name one, e.g. "
                        "AUTOTILE_RECORD=trace.jsonl", value)
        return None
    path = _resolved.get(value)
    if path is None:
        path = _resolved[value] = Path(value).expanduser().absolute()
    return path


_resolved: dict[str, Path | None] = {}  # AUTOTILE_RECORD's values -> their files, as first resolved


def counter(family, problem, device) -> list[int]:
    """A new counter for one call signature of `problem`; its increments are recorded under the problem."""
    global _registered_exit
    count = [0]
    key = (family.name, device.key, family.problem_key(problem))
    with _lock:
        entry = _counters.get(key)
        if entry is None:
            entry = _counters[key] = (dataclasses.asdict(problem), [])
        entry[1].append(count)
        if not _registered_exit and recording_path() is not None:
            atexit.register(_flush_at_exit)
            _flush_on_sigterm()
            threading.Thread(target=_flush_every, args=(FLUSH_EVERY_S,), name="autotile-trace", daemon=True).start()
            _registered_exit = True
    return count


# A recording process also writes its counts this often (seconds): a server stopped by SIGKILL, or by an exit that
# skips atexit (os._exit), loses at most this much of its trace.
FLUSH_EVERY_S = 60.0


def _flush_every(seconds: float) -> None:
    while True:
        time.sleep(seconds)
        try:
            flush()
        except Exception as exc:  # noqa: BLE001 - a failed write keeps the counts for the next one; say why once
            log.warning("autotile: could not write the trace %s: %s", recording_path(), exc)
            return


def _flush_on_sigterm() -> None:
    """Write the trace when SIGTERM stops the process, as servers are stopped (Python's default handler exits
    without atexit). Only where SIGTERM still has its default handler, set from the main thread: a handler the
    program installed is left as it is (its own exit path runs atexit)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return

    def on_sigterm(signum, frame):
        _flush_at_exit()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # the default: the process ends as SIGTERM ends it

    signal.signal(signal.SIGTERM, on_sigterm)


def entries() -> list[TraceEntry]:
    """This process's problems with their call counts so far (problems never called are left out)."""
    with _lock:
        items = [(key, problem, sum(c[0] for c in counts)) for key, (problem, counts) in _counters.items()]
    return [TraceEntry(key[0], key[1], problem, calls) for key, problem, calls in items if calls > 0]


def flush(path: str | os.PathLike | None = None) -> Path | None:
    """Merge this process's counts into the trace file (AUTOTILE_RECORD, or `path`) and reset them.

    A trace there that cannot be read (damaged, another version's) is moved aside to `<name>.unreadable` (said
    once), and this process's counts start a new trace: no count is dropped, and nothing is overwritten. Anything
    else there (a folder, a file that is not a trace) is left alone: TraceFormatError, and nothing is written.
    The counts are reset only once they are written, so a failed write keeps them for the next flush.
    """
    target = Path(path) if path is not None else recording_path()
    if target is None:
        return None
    _refuse_foreign(target)
    with _lock:
        taken = [(key, problem, [(c, c[0]) for c in counts]) for key, (problem, counts) in _counters.items()]
    # NOTE: without POSIX locks (Windows), concurrent flushes into one file may lose one side's counts.
    with beside_lock(target):  # ranks of one job flush into one file at exit: each merge sees the last one's
        merged = {entry.key: entry for entry in _readable_entries(target)}
        for (family, device, _), problem, counts in taken:
            entry = TraceEntry(family, device, problem, sum(n for _, n in counts))
            if entry.calls <= 0:
                continue
            old = merged.get(entry.key)
            merged[entry.key] = dataclasses.replace(entry, calls=entry.calls + (old.calls if old else 0))
        write_trace(target, sorted(merged.values(), key=lambda e: (-e.calls, e.key)))
    with _lock:  # calls made while the file was written stay counted for the next flush
        for _, _, counts in taken:
            for c, n in counts:
                c[0] -= n
    return target


def _refuse_foreign(path: Path) -> None:
    """Raise TraceFormatError where `path` is something autotile did not write: a folder, a device, or a file whose
    first line is not a trace's header. Only a trace (damaged or not) is ever moved aside or replaced."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_file():
        raise TraceFormatError(f"AUTOTILE_RECORD={path} is not a file (a folder?): nothing was recorded; name a "
                               "trace file, e.g. AUTOTILE_RECORD=trace.jsonl")
    if path.stat().st_size and not _starts_as_trace(path):
        raise TraceFormatError(f"AUTOTILE_RECORD={path} names a file that is not an autotile trace: it was left as "
                               "it is and nothing was recorded; name a new file")


def _starts_as_trace(path: Path) -> bool:
    """Whether the first line that is not blank is a trace's header (of any version)."""
    try:
        with open(path, "rb") as handle:
            for line in iter(lambda: handle.readline(_MAX_LINE), b""):
                if line.strip():
                    record = json.loads(line)
                    return isinstance(record, dict) and record.get("format") == FORMAT
    except (OSError, ValueError):
        return False
    return True  # blank lines only: nothing to lose


def _readable_entries(path: Path) -> list[TraceEntry]:
    """The entries of the trace at `path` to merge into; a damaged trace, or another version's, is moved aside."""
    if not path.exists() or not path.stat().st_size:
        return []
    try:
        return read_trace(path)
    except TraceFormatError as exc:
        aside = unused_name(path.with_name(path.name + ".unreadable"))
        path.replace(aside)
        log.warning("autotile: %s; it was moved to %s and a new trace is started in its place", exc, aside)
        return []


def _flush_at_exit() -> None:
    try:
        flush()
    except Exception as exc:  # noqa: BLE001 - never turn a model's clean exit into a crash
        import sys

        print(f"autotile: could not write the trace {recording_path()}: {exc}", file=sys.stderr)


def write_trace(path: Path, items: list[TraceEntry]) -> None:
    """Write a whole trace file (beside it first, then renamed into place: a reader never sees half)."""
    import autotile

    path = Path(path)
    header = {"format": FORMAT, "version": VERSION, "autotile": autotile.__version__,
              "written_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(header, sort_keys=True) + "\n")
            for e in items:
                handle.write(json.dumps({"family": e.family, "device": e.device, "problem": e.problem,
                                         "calls": e.calls}, sort_keys=True) + "\n")
            handle.write(json.dumps({"record": "end", "count": len(items)}) + "\n")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def read_trace(path: str | os.PathLike) -> list[TraceEntry]:
    """The entries of a trace file; TraceFormatError (naming the line) for anything that is not a whole trace."""
    path = Path(path)
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"cannot read the trace {path}: {exc.strerror}") from None
    try:
        with handle:
            return _read_lines(path, handle)
    except UnicodeDecodeError:
        raise TraceFormatError(f"{path} is not UTF-8 text: not an autotile trace; record one with "
                               "AUTOTILE_RECORD=FILE") from None


def _read_lines(path: Path, handle) -> list[TraceEntry]:
    items: list[TraceEntry] = []
    header = ended = False
    for number, line in enumerate(handle, start=1):
        if len(line) > _MAX_LINE:
            raise TraceFormatError(f"{path}:{number}: line longer than {_MAX_LINE} characters: not a trace")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}:{number}: not JSON ({exc.msg}); record a new trace with "
                                   "AUTOTILE_RECORD=FILE") from None
        if not isinstance(record, dict):
            raise TraceFormatError(f"{path}:{number}: a trace line must be a JSON object")
        if not header:  # the first line that is not blank
            _check_header(path, record)
            header = True
            continue
        if ended:
            raise TraceFormatError(f"{path}:{number}: lines after the end record")
        if record.get("record") == "end":
            if record.get("count") != len(items):
                raise TraceFormatError(f"{path}: the end record counts {record.get('count')!r} problems but "
                                       f"the file holds {len(items)}: it is damaged")
            ended = True
            continue
        items.append(_entry(path, number, record))
    if not header:
        raise TraceFormatError(f"{path} is empty: not an autotile trace")
    if not ended:
        raise TraceFormatError(f"{path} has no end record: it was cut short (the process was killed while writing?)")
    return items


def _check_header(path: Path, record: dict) -> None:
    if record.get("format") != FORMAT:
        raise TraceFormatError(f"{path} is not an autotile trace (its first line has no \"format\": \"{FORMAT}\")")
    version = record.get("version")
    if version != VERSION:
        if isinstance(version, int) and version > VERSION:
            raise TraceFormatError(f"{path} is a trace of format version {version}, newer than this autotile reads "
                                   f"({VERSION}): upgrade autotile (pip install -U autotile), or record it again "
                                   "with this one")
        what = "no format version (an older trace)" if version is None else f"format version {version!r}"
        raise TraceFormatError(f"{path} has {what}; this autotile reads version {VERSION}: record it again with "
                               "this autotile")


def _entry(path: Path, number: int, record: dict) -> TraceEntry:
    unknown = set(record) - {"family", "device", "problem", "calls"}
    if unknown:
        raise TraceFormatError(f"{path}:{number}: unknown fields {sorted(unknown)}")
    family, device, problem, calls = (record.get(k) for k in ("family", "device", "problem", "calls"))
    if not isinstance(family, str) or not isinstance(device, str) or not isinstance(problem, dict):
        raise TraceFormatError(f"{path}:{number}: needs a family and a device (strings) and a problem (object)")
    if isinstance(calls, bool) or not isinstance(calls, int) or not 0 < calls < 2**63:
        raise TraceFormatError(f"{path}:{number}: calls must be a positive integer, got {calls!r}")
    return TraceEntry(family, device, problem, calls)


__all__ = ["TraceEntry", "TraceFormatError", "counter", "entries", "flush", "read_trace", "write_trace"]
