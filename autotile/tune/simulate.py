"""Offline simulation: replay a problem's stored timings, so search strategies can be compared without a GPU.

As Kernel Tuner's simulation mode does, a search runs against a table of
configs measured before: a config in the table returns its stored time (or
its failure status) at once; nothing is rendered, compiled or run. A config
the table does not hold was never measured: the simulated space leaves it out
(a constraint named `measured`), so the search treats a proposal of it like
any infeasible one (told pruned, replaced by the nearest measured config) and
the result counts how often that happened.

A table comes from an autotile database (the trials of one problem on one
device key, best median per config; the vendor op's rows as its time), or from
a JSON-lines file as benchmarks/search_efficiency.py writes them: a header
line, then one line per measured config (the last line of a config wins;
`running` there means the measuring process died on it, filed as `crash`).

`autotile tune FAMILY ... --simulate DB` runs the tuner's own search loop on a
table (`tune_problem(..., simulate=table)`); `replay` runs the same sampler
and the same replacement rule in memory, thousands of times faster, for
comparing strategies over many seeds.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from autotile.bench import Status, Timing, TrialOutcome
from autotile.device import DeviceInfo
from autotile.errors import AutotileError
from autotile.families.base import VENDOR_KEY, Family, is_vendor
from autotile.space import Config, Constraint, Space

TABLE_KIND = "autotile-timing-table"
# Name of the constraint that keeps a simulated search inside its table.
MEASURED = "measured"
# The status a JSON-lines table gives a config whose measurement never finished.
RUNNING = "running"


class SimulationError(AutotileError):
    """The table cannot be found, read or matched to the problem."""


@dataclass(frozen=True)
class TableRow:
    config: Config
    status: str  # a bench.Status value
    median_ms: float | None = None
    q20_ms: float | None = None
    q80_ms: float | None = None
    error: str = ""


@dataclass
class TimingTable:
    """The measured configs of one problem on one device."""

    family: str
    problem: dict
    device: DeviceInfo
    rows: dict[str, TableRow]  # config hash -> row
    vendor_ms: dict[str, float] = field(default_factory=dict)  # vendor config JSON -> median ms
    space_size: int | None = None  # feasible configs of the whole space when the table was measured
    note: str = ""  # how the table was made (sampled? synthesised? interpreted?)
    source: str = ""  # the database, file or folder it was read from (warm starts read its other problems)
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # replay's enumerations, made once

    def lookup(self, config) -> TableRow | None:
        return self.rows.get(Config(config).hash)

    def ok_rows(self) -> list[TableRow]:
        return [r for r in self.rows.values() if r.status == Status.OK.value and r.median_ms is not None]

    @property
    def best_ms(self) -> float | None:
        ok = self.ok_rows()
        return min(r.median_ms for r in ok) if ok else None

    @property
    def best_vendor_ms(self) -> float | None:
        return min(self.vendor_ms.values()) if self.vendor_ms else None

    def __len__(self) -> int:
        return len(self.rows)


# --- reading and writing tables ---------------------------------------------------------------------
def device_from_dict(data: dict) -> DeviceInfo:
    cc = data["compute_capability"]
    if isinstance(cc, str):
        cc = tuple(int(x) for x in cc.split("."))
    return DeviceInfo(data["profile"], data["name"], tuple(cc), int(data["sm_count"]), int(data["memory_bytes"]),
                      int(data["smem_per_block"]), data.get("driver", ""), interpret=data["profile"] == "interpret")


def device_to_dict(device: DeviceInfo) -> dict:
    return {"profile": device.profile, "name": device.name, "compute_capability": list(device.compute_capability),
            "sm_count": device.sm_count, "memory_bytes": device.memory_bytes,
            "smem_per_block": device.smem_per_block, "driver": device.driver}


def table_header(family: Family, problem, device: DeviceInfo, space_size: int | None, note: str) -> dict:
    import dataclasses

    return {"kind": TABLE_KIND, "family": family.name, "problem": dataclasses.asdict(problem),
            "device": device_to_dict(device), "space_size": space_size, "note": note}


def row_record(config: Config, status: str, timing: Timing | None = None, error: str = "") -> dict:
    record = {"config": dict(config), "status": status}
    if timing is not None:
        record.update(median_ms=timing.median_ms, q20_ms=timing.q20_ms, q80_ms=timing.q80_ms)
    if error:
        record["error"] = error[:300]
    return record


def read_jsonl_table(path: Path) -> TimingTable:
    """A table from a JSON-lines file (header line, then one line per measurement)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise SimulationError(f"{path} is empty")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise SimulationError(f"{path}: the first line is not JSON ({exc})") from None
    if header.get("kind") != TABLE_KIND:
        raise SimulationError(f"{path} is not an autotile timing table (its first line has no kind {TABLE_KIND!r})")
    rows: dict[str, TableRow] = {}
    vendor: dict[str, float] = {}
    for number, line in enumerate(lines[1:], start=2):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # the last line of a killed writer may be cut short
            raise SimulationError(f"{path}:{number} is not JSON") from None
        config = Config(record["config"])
        status = record["status"]
        if is_vendor(config):
            if status == Status.OK.value:
                vendor[config.to_json()] = float(record["median_ms"])
            continue
        if status == RUNNING:
            rows[config.hash] = TableRow(config, Status.CRASH.value, error="the measuring process died on it")
            continue
        rows[config.hash] = TableRow(config, status, record.get("median_ms"), record.get("q20_ms"),
                                     record.get("q80_ms"), record.get("error", ""))
    return TimingTable(header["family"], header["problem"], device_from_dict(header["device"]), rows, vendor,
                       header.get("space_size"), header.get("note", ""))


def read_db_table(url: str, family: Family, problem, device_key: str | None = None) -> TimingTable:
    """A table from an autotile database: every trial of `problem` on one device key (best median per config)."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from autotile.store.db import open_engine
    from autotile.store.models import Device, Problem, Trial

    engine = open_engine(url, create=False)
    key = family.problem_key(problem)
    with Session(engine) as session:
        problem_id = session.execute(select(Problem.id).where(Problem.family == family.name, Problem.key == key)
                                     ).scalar_one_or_none()
        if problem_id is None:
            raise SimulationError(f"{url} holds no trials of {family.name} {key}")
        rows = session.execute(select(Trial, Device).join(Device, Trial.device_id == Device.id)
                               .where(Trial.problem_id == problem_id).order_by(Trial.id)).all()
    keys = sorted({d.key for _, d in rows})
    if device_key is None:
        real = [k for k in keys if k != "interpret"]
        if len(keys) > 1 and len(real) != 1:
            raise SimulationError(f"{url} holds trials of this problem on {', '.join(keys)}: pick one with --gpu")
        device_key = real[0] if real else keys[0]
    device_key = next((k for k in keys if _names_device(device_key, k)), device_key)
    if device_key not in keys:
        raise SimulationError(f"{url} holds no trials of {family.name} {key} on {device_key} "
                              f"(it has {', '.join(keys) or 'none'})")
    device_row = next(d for _, d in rows if d.key == device_key)
    device = device_from_dict({c.name: getattr(device_row, c.name) for c in Device.__table__.columns})
    table: dict[str, TableRow] = {}
    vendor: dict[str, float] = {}
    for trial, dev in rows:
        if dev.key != device_key:
            continue
        config = Config.from_json(trial.config)
        if is_vendor(config):
            if trial.status == Status.OK.value and trial.median_ms is not None:
                vendor[config.to_json()] = min(trial.median_ms, vendor.get(config.to_json(), math.inf))
            continue
        known = table.get(config.hash)
        if trial.status == Status.OK.value:
            if known is None or known.status != Status.OK.value or trial.median_ms < known.median_ms:
                table[config.hash] = TableRow(config, trial.status, trial.median_ms, trial.q20_ms, trial.q80_ms)
        elif known is None:
            table[config.hash] = TableRow(config, trial.status, error=trial.error or "")
    return TimingTable(family.name, dict(json.loads(key)), device, table, vendor,
                       note=f"trials stored in {url}", source=url)


def load_table(source: str | Path, family: Family, problem, device_key: str | None = None) -> TimingTable:
    """The timing table of `problem` from `source`: a JSON-lines table, a folder of them, or an autotile database.

    `device_key` (a key like 'h200/sm90' or a profile like 'h200') picks the device where the source holds several.

    >>> import tempfile
    >>> from autotile.device import interpret_device
    >>> from autotile.families.gemm import FAMILY, contiguous_problem
    >>> problem = contiguous_problem(24, 32, 64, "fp16", "fp16")
    >>> path = Path(tempfile.mkdtemp()) / "table.jsonl"
    >>> config = FAMILY.default_config(problem, interpret_device())
    >>> write_rows(path, table_header(FAMILY, problem, interpret_device(), None, "example"),
    ...            [row_record(config, "ok", Timing(1.0, 0.9, 1.1))])
    >>> load_table(path, FAMILY, problem).best_ms
    1.0
    """
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        return _table_in_folder(path, family, problem, device_key)
    if path.suffix in (".jsonl", ".json"):
        if not path.exists():
            raise SimulationError(f"{path}: no such table")
        table = read_jsonl_table(path)
        _check_match(table, family, problem, device_key, path)
        table.source = str(path)
        return table
    if "://" not in text and not path.exists():
        raise SimulationError(f"{text}: no such database or table")
    return read_db_table(text, family, problem, device_key)


def _check_match(table: TimingTable, family: Family, problem, device_key: str | None, where) -> None:
    from autotile.families.base import canonical_json

    try:
        key = family.problem_key(family.problem_from_dict(table.problem)) if table.family == family.name else None
    except Exception:  # noqa: BLE001 - a problem this version cannot read is not this problem
        key = None
    if key != family.problem_key(problem):
        raise SimulationError(f"{where} holds {table.family} {canonical_json(table.problem)}, not "
                              f"{family.name} {family.problem_key(problem)}")
    if device_key is not None and not _names_device(device_key, table.device.key):
        raise SimulationError(f"{where} was measured on {table.device.key}, not {device_key}")


def _names_device(wanted: str, key: str) -> bool:
    """Whether `wanted` (a device key like 'h200/sm90' or a profile like 'h200') names the device `key`."""
    return wanted == key or wanted == key.split("/")[0]


def _table_in_folder(folder: Path, family: Family, problem, device_key: str | None) -> TimingTable:
    for path in sorted(folder.glob("*.jsonl")):
        try:
            table = read_jsonl_table(path)
            _check_match(table, family, problem, device_key, path)
        except SimulationError:
            continue
        table.source = str(folder)
        return table
    raise SimulationError(f"{folder} holds no table of {family.name} {family.problem_key(problem)}")


def write_rows(path: Path, header: dict | None, records: Iterable[dict]) -> None:
    """Append measurement records to a JSON-lines table (with `header` first when the file is new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a") as handle:
        if new:
            if header is None:
                raise SimulationError(f"{path} is new: a header is needed")
            handle.write(json.dumps(header, sort_keys=True) + "\n")
        for record in records:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()


# --- synthesised tables ---------------------------------------------------------------------------------
# Spread of the per-axis-value factors (shared by every problem, and each problem's own) and of the
# per-config noise of a synthesised table (log-normal sigmas).
_SYNTHETIC_AXIS_SIGMA = 0.10
_SYNTHETIC_PROBLEM_AXIS_SIGMA = 0.08
_SYNTHETIC_NOISE_SIGMA = 0.04
# Share of configs a synthesised table files as failed to compile.
_SYNTHETIC_FAILURES = 0.02
SYNTHETIC_NOTE = ("SYNTHESISED, not measured: roofline lower bound x per-axis-value factors (partly shared by "
                  "every problem) x per-config noise; for testing the simulation only")


def synthetic_device() -> DeviceInfo:
    """An H200 as its profile describes it (132 SMs, 227 KiB of shared memory a block), for synthesised tables."""
    return DeviceInfo("h200", "NVIDIA H200 (synthetic)", (9, 0), 132, 150_000_000_000, 232448, "synthetic")


def synthetic_table(family: Family, problem, device: DeviceInfo | None = None, configs: Sequence[Config] | None = None,
                    seed: int = 0) -> TimingTable:
    """A table synthesised from the roofline model, clearly labelled (`note`), for tests and dry runs on a CPU.

    Each config's time is its roofline lower bound (autotile.tune.prune) times two slowdowns per axis value (one
    the same for every problem, so that what is good for one shape is somewhat good for its neighbours, and one
    of this problem's own) times a little noise; a few configs are filed as compile errors. It says nothing
    about a real GPU.

    >>> from autotile.families.gemm import FAMILY, contiguous_problem
    >>> table = synthetic_table(FAMILY, contiguous_problem(256, 512, 512))
    >>> len(table) > 1000 and table.best_ms > 0 and "SYNTHESISED" in table.note
    True
    """
    from autotile.tune.prune import bound_function

    device = device or synthetic_device()
    configs = list(configs) if configs is not None else list(family.space(problem, device).feasible())
    model = bound_function(family, problem, device)
    if model is None:
        raise SimulationError(f"no roofline model for {family.name} on {device.key}: cannot synthesise a table")
    fn, roof = model
    bounds = fn(problem, roof, configs)
    problem_key = family.problem_key(problem)
    rows = {}
    axis_factors: dict[str, tuple[float, float]] = {}  # an axis value's two slowdowns, hashed once, not per config
    for config, bound in zip(configs, bounds):
        factor = 1.0
        for name in sorted(config):
            value = f"{name}={config[name]!r}"
            if value not in axis_factors:
                axis_factors[value] = (_slowdown(f"{seed}:{value}", _SYNTHETIC_AXIS_SIGMA),
                                       _slowdown(f"{seed}:{problem_key}:{value}", _SYNTHETIC_PROBLEM_AXIS_SIGMA))
            shared, own = axis_factors[value]
            factor *= shared
            factor *= own
        noise = _slowdown(f"{seed}:{problem_key}:{config.hash}", _SYNTHETIC_NOISE_SIGMA)
        if _unit(f"{seed}:fail:{problem_key}:{config.hash}") < _SYNTHETIC_FAILURES:
            rows[config.hash] = TableRow(config, Status.COMPILE_ERROR.value, error="synthesised failure")
            continue
        ms = float(bound) * factor * noise
        rows[config.hash] = TableRow(config, Status.OK.value, ms, ms * 0.99, ms * 1.01)
    import dataclasses

    return TimingTable(family.name, dataclasses.asdict(problem), device, rows, {}, len(configs), SYNTHETIC_NOTE)


def _unit(text: str) -> float:
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def _slowdown(text: str, sigma: float) -> float:
    """exp(sigma |z|) for a normal deviate z drawn from `text` (Box-Muller): >= 1, so a synthesised time stays
    above the roofline bound, as a measured one does; no global RNG state involved."""
    u1, u2 = max(_unit(text + "/1"), 1e-12), _unit(text + "/2")
    return math.exp(sigma * abs(math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)))


# --- the simulated space and evaluator ---------------------------------------------------------------
def simulated_space(space: Space, table: TimingTable) -> Space:
    """`space` restricted to the configs `table` holds (the extra constraint is named `measured`)."""
    hashes = set(table.rows)
    measured = Constraint(MEASURED, lambda c: Config(c).hash in hashes, "never measured in the simulation table")
    return Space(space.axes, tuple(space.constraints) + (measured,))


class SimulatedEvaluator:
    """Stands in for a trial worker: returns a config's stored outcome; never renders, compiles or runs it."""

    isolated = False

    def __init__(self, table: TimingTable):
        self.table = table
        self.calls = 0

    def prestart(self) -> None:
        pass

    def evaluate(self, number: int, config: Config) -> TrialOutcome:
        self.calls += 1
        row = self.table.lookup(config)
        if row is None:
            # The simulated space keeps these out; a caller that bypasses it learns why plainly.
            raise SimulationError(f"{config.to_json()} was never measured: the table cannot say how it runs")
        if row.status == Status.OK.value:
            median = row.median_ms
            timing = Timing(median, row.q20_ms if row.q20_ms is not None else median,
                            row.q80_ms if row.q80_ms is not None else median)
            return TrialOutcome(Status.OK, timing)
        return TrialOutcome(Status(row.status), error=row.error or f"{row.status} (stored)")

    def close(self) -> None:
        pass


# --- replaying searches in memory --------------------------------------------------------------------
class Strategy:
    RANDOM = "random"
    TPE = "tpe"
    TPE_WARM = "tpe+warm"


@dataclass
class Replay:
    """One simulated search: what it evaluated, in order."""

    strategy: str
    seed: int
    evaluated: list[str] = field(default_factory=list)  # config hashes
    times: list[float | None] = field(default_factory=list)  # ms, None for a failed config
    never_measured: int = 0  # proposals outside the table (replaced)
    pruned: set[str] = field(default_factory=set)  # proposals the model dropped (told pruned, replaced)
    model_dropped: set[str] = field(default_factory=set)  # every config the model ruled out before it was evaluated
    stopped: str = ""

    def best_so_far(self) -> list[float]:
        """Best time after each evaluation (inf until the first ok one)."""
        out, best = [], math.inf
        for ms in self.times:
            if ms is not None and ms < best:
                best = ms
            out.append(best)
        return out

    def evaluations_to(self, target_ms: float) -> int | None:
        """Evaluations until the best reached `target_ms` (None: never)."""
        for number, best in enumerate(self.best_so_far(), start=1):
            if best <= target_ms:
                return number
        return None


def initial_configs(family: Family, problem, device: DeviceInfo, space: Space,
                    warm: Sequence[Config] = ()) -> list[Config]:
    """What a fresh study is seeded with, in order (as tune_problem enqueues it): the default config, the warm
    start, the family's seed configs."""
    configs = [family.default_config(problem, device), *warm, *family.seed_configs(problem, device)]
    return list(dict.fromkeys(Config(c) for c in configs))


def replay(family: Family, problem, table: TimingTable, strategy: str, seed: int, budget: int,
           warm: Sequence[Config] = (), prune: bool = False, margin: float | None = None) -> Replay:
    """Run one search on `table` in memory for `budget` evaluations (or until the table is exhausted).

    `random` draws measured configs uniformly without replacement. `tpe` and `tpe+warm` run the tuner's sampler
    (autotile.tune.search.make_sampler) with the tuner's rules: the study is seeded with `initial_configs`
    (`warm` only for `tpe+warm`), a proposal that is infeasible, outside the table, already evaluated or dropped
    by the model (`prune`) is told pruned and replaced by the nearest config still open.
    """
    import optuna

    from autotile.tune.prune import DEFAULT_MARGIN, Pruner
    from autotile.tune.search import _ConfigSource, make_sampler

    device = table.device
    if "source" not in table.memo:  # enumerating the space takes a second: once per table, not per replay
        space = simulated_space(family.space(problem, device), table)
        table.memo["source"] = _ConfigSource(space, [row.config for row in table.rows.values()])
        table.memo["pruner"] = Pruner.for_problem(family, problem, device, table.memo["source"].feasible())
    source = table.memo["source"]
    space = source.space
    result = Replay(strategy, seed)
    feasible = source.feasible()
    if not feasible:
        result.stopped = "the table holds no config of the space"
        return result
    pruner = None
    if prune and table.memo["pruner"] is not None:
        model = table.memo["pruner"]
        pruner = Pruner(model.configs, model.bounds, DEFAULT_MARGIN if margin is None else margin)

    evaluated = np.zeros(len(feasible), dtype=bool)
    ruled_out = np.zeros(len(feasible), dtype=bool)  # rows the model dropped at some point while unevaluated

    def run(config: Config) -> None:
        outcome = SimulatedEvaluator(table).evaluate(0, config)
        result.evaluated.append(config.hash)
        ok = outcome.status is Status.OK
        result.times.append(outcome.timing.median_ms if ok else None)
        if ok and pruner is not None:
            evaluated[pruner.index[config.hash]] = True
            pruner.observe(config, outcome.timing.median_ms)
            ruled_out[:] |= ~pruner.alive() & ~evaluated

    if strategy == Strategy.RANDOM:
        order = random.Random(seed).sample(range(len(feasible)), k=min(budget, len(feasible)))
        for row in order:
            run(feasible[row])
        return result
    if strategy not in (Strategy.TPE, Strategy.TPE_WARM):
        raise SimulationError(f"unknown strategy {strategy!r}: random, tpe or tpe+warm")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=make_sampler(seed))
    for config in initial_configs(family, problem, device, space, warm if strategy == Strategy.TPE_WARM else ()):
        study.enqueue_trial(dict(config), skip_if_exists=True)
    taken: set[str] = set()
    while len(result.evaluated) < budget:
        picked = _next_config(study, source, space, taken, pruner, result)
        if picked is None:
            result.stopped = "every config still open has been evaluated"
            break
        trial, config = picked
        run(config)
        taken.add(config.hash)
        if result.times[-1] is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, result.times[-1])
    if pruner is not None:
        result.model_dropped = {feasible[row].hash for row in np.flatnonzero(ruled_out)}
    return result


def _next_config(study, source, space: Space, taken: set[str], pruner, result: Replay):
    """The search's `_next_candidate` with one config asked at a time (compile-ahead off), in memory."""
    import optuna

    from autotile.tune.search import MAX_REPEATS_IN_A_ROW

    repeats = 0
    while True:
        trial = study.ask()
        wanted = source.suggest(trial)
        config = Config(wanted)
        violations = space.violations(config)
        dropped = "" if violations or pruner is None else pruner.reason(config)
        if not violations and not dropped and config.hash not in taken:
            return trial, config
        if violations and violations[0].startswith(MEASURED + ":"):
            result.never_measured += 1
        if dropped:
            result.pruned.add(config.hash)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        repeats = repeats + 1 if not violations and not dropped else repeats
        allowed = pruner.alive() if pruner is not None else None
        replacement = source.nearest_feasible(wanted, exclude=taken, allowed=allowed)
        if replacement is None or repeats > MAX_REPEATS_IN_A_ROW:
            return None
        study.enqueue_trial(dict(replacement))  # as the search does (see its NOTE)


def summarise(replays: Sequence[Replay], best_ms: float, levels: Sequence[float] = (0.95, 0.98, 0.99)) -> dict:
    """Evaluations to reach each fraction of the exhaustive best (time <= best / level): median and quartiles
    over the replays (a replay that never reached it counts as infinitely many), and how many missed it."""
    def quantile(values: np.ndarray, q: float) -> float:
        return float(np.quantile(values, q, method="inverted_cdf")) if len(values) else math.inf

    out = {}
    for level in levels:
        needed = [r.evaluations_to(best_ms / level) for r in replays]
        values = np.array([math.inf if n is None else n for n in needed], dtype=float)
        out[level] = {"median": float(np.median(values)) if len(values) else math.inf, "q25": quantile(values, 0.25),
                      "q75": quantile(values, 0.75), "missed": sum(n is None for n in needed)}
    return out


def table_configs_best_first(table: TimingTable) -> list[Config]:
    """The table's ok configs, fastest first."""
    return [r.config for r in sorted(table.ok_rows(), key=lambda r: r.median_ms)]


def read_tables(folder: Path) -> list[TimingTable]:
    """Every timing table in a folder (files that are not tables are skipped)."""
    tables = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        try:
            tables.append(read_jsonl_table(path))
        except (SimulationError, KeyError, ValueError):
            continue
    return tables


def warm_start_from_tables(source: str, family: Family, problem, device: DeviceInfo, space: Space):
    """Warm-start configs for a simulated study: from the other problems of the database (or the other tables of
    the folder) `source` names, as a real study takes them from its database."""
    from autotile.tune.warmstart import WarmStart, rank_neighbours, warm_configs

    path = Path(source).expanduser()
    if path.is_dir():
        tuned = [(family.problem_from_dict(t.problem), table_configs_best_first(t)) for t in read_tables(path)
                 if t.family == family.name and t.device.key == device.key]
        return warm_configs(space, rank_neighbours(family, problem, tuned))
    if path.suffix in (".jsonl", ".json"):
        return WarmStart((), ())  # one table: no neighbours
    from autotile.store.db import open_engine
    from autotile.tune.warmstart import warm_start

    return warm_start(open_engine(source, create=False), family, problem, device, space)


def vendor_label_of(table: TimingTable) -> str:
    if not table.vendor_ms:
        return ""
    best = min(table.vendor_ms, key=table.vendor_ms.get)
    return str(json.loads(best).get(VENDOR_KEY, ""))
