"""`autotile export-kernel`: the tuned kernel as one standalone Triton module, without autotile at run time.

The module is the family's template rendered with the winner's switches, then
a small launcher with the winner's constexprs, num_warps and num_stages baked
in (autotile/export_launchers.py writes one per family). It imports torch and
triton only. gemm, elementwise and paged have launcher writers; flash has none
(see `export_not_supported_reason`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import autotile
from autotile.device import DeviceInfo
from autotile.errors import AutotileError, BadInputError, ConfigOutsideSpaceError, DatabaseError
from autotile.export_launchers import LAUNCHER_WRITERS
from autotile.families import get_family
from autotile.families.base import Family, is_vendor
from autotile.render import render_source
from autotile.space import Config
from autotile.store.marks import servable


class ExportNotSupportedError(AutotileError):
    """A family whose launch cannot be written out as a standalone launcher (yet)."""


# Why each family without a launcher writer has none.
_UNSUPPORTED = {
    "flash": "its public op is autograd: the forward and the backward (three kernels fed by the forward's LSE) "
             "are tuned as separate problems, so no one tuned config stands in for flash_attention",
}


def export_not_supported_reason(family_name: str) -> str | None:
    """None when `family_name` can be exported, else why not."""
    if family_name in LAUNCHER_WRITERS:
        return None
    why = _UNSUPPORTED.get(family_name, "it has no launcher writer")
    return (f"export-kernel writes standalone kernels for {', '.join(sorted(LAUNCHER_WRITERS))} only; "
            f"{family_name} is not supported because {why}")


@dataclass(frozen=True)
class ExportedKernel:
    family: str
    problem_key: str
    device_key: str
    config: Config
    entry_point: str  # the function of the written module to call, e.g. 'matmul'
    origin: str  # 'exact winner in <db>', 'nearest winner (...) in <db>', 'config given', 'default config'
    median_ms: float | None
    source: str


def _stored_winner(family: Family, problem, device: DeviceInfo, db_url: str | None,
                   passed_over: list[str]) -> tuple[Config, str, float] | None:
    """The winner for `problem` from the database (then the shipped one): exact problem, else the nearest tuned one.
    Why an exact winner was passed over is added to `passed_over`."""
    from autotile.resources import shipped_db_path
    from autotile.store.db import default_db_url, normalise_url, open_engine, read_only_url, sqlite_path
    from autotile.store.repo import Store

    sources = [db_url or default_db_url()]
    if shipped_db_path().exists():
        sources.append(read_only_url(shipped_db_path()))
    space = family.space(problem, device)
    key = family.problem_key(problem)
    for url in sources:
        try:
            winners = Store(open_engine(url, create=False, read_only=True)).winners(family.name, device.key)
        except DatabaseError:
            if url != db_url:
                continue
            path = sqlite_path(normalise_url(url))
            if path is None or path.exists():
                raise  # the database named (--db) is damaged or no database: never ship the default config quietly
            warnings.warn(f"autotile: no database at {path} (--db): the kernel comes from the shipped winners or the "
                          "family's default config", stacklevel=2)
            continue
        ranked = []
        for w in winners:
            if w.problem_key == key:
                ranked.append((-1.0, w))
                continue
            try:
                distance = family.distance(problem, family.problem_from_dict(w.params))
            except Exception:  # noqa: BLE001 - a row from another version of the family
                continue
            if distance is not None:
                ranked.append((distance, w))
        where = "shipped tuning_db" if "mode=ro" in url else _named(url)
        for distance, w in sorted(ranked, key=lambda r: r[0]):
            if not servable(w.verify_status):  # as the runtime: db verify found it failing here
                if distance < 0:
                    passed_over.append(f"the winner in {where} is not served: db verify found "
                                       f"{w.verify_status.replace('_', ' ')}")
                continue
            # A module holds a generated kernel: where the vendor op won, the fastest kernel kept beside it.
            text, ms, kept = w.config, w.median_ms, ""
            if is_vendor(Config.from_json(w.config)):
                if not w.kernel_config:
                    if distance < 0:
                        passed_over.append(f"the winner in {where} is the vendor op, with no generated kernel kept")
                    continue
                text, ms, kept = w.kernel_config, w.kernel_ms, " (the vendor op won there; its fastest kernel)"
            try:
                config = space.validate(Config.from_json(text))
            except ConfigOutsideSpaceError as exc:
                if distance < 0:
                    passed_over.append(f"the winner in {where} is no longer a config of the space: {exc}")
                continue
            origin = f"exact winner in {where}" if distance < 0 else f"nearest winner (tuned for {w.problem_key}) in {where}"
            return config, origin + kept, ms
    return None


def _named(url: str) -> str:
    """A database as a kernel's header names it: a SQLite file by its name (no home folder in a shared file)."""
    from autotile.store.db import normalise_url, safe_url, sqlite_path

    path = sqlite_path(normalise_url(url))
    return path.name if path is not None else safe_url(url)


def export_kernel(family_name: str, problem, device: DeviceInfo, *, db_url: str | None = None,
                  config: Config | dict | None = None) -> ExportedKernel:
    """The standalone module for `problem`: the given config, else the stored winner, else the default config.

    >>> from autotile.families.gemm import contiguous_problem
    >>> from autotile.device import interpret_device
    >>> kernel = export_kernel("gemm", contiguous_problem(64, 64, 64, "fp16", "fp16"), interpret_device())
    >>> "def matmul(" in kernel.source
    True
    """
    reason = export_not_supported_reason(family_name)
    if reason:
        raise ExportNotSupportedError(reason)
    family = get_family(family_name)
    space = family.space(problem, device)
    median_ms = None
    if config is not None:
        # Axes the config leaves out take the default config's values, as `autotile render --config` fills them.
        chosen = space.validate(space.filled(config, family.default_config(problem, device)))
        origin = "config given"
    else:
        passed_over: list[str] = []
        found = _stored_winner(family, problem, device, db_url, passed_over)
        if found is not None:
            chosen, origin, median_ms = found
        else:
            chosen = family.default_config(problem, device)
            origin = "default config (" + ("; ".join(passed_over) if passed_over else "no stored winner fits it") + ")"
    writer = LAUNCHER_WRITERS[family_name]
    chosen, changed = writer.exportable(problem, chosen, space)
    if changed:
        origin += f"; {changed}"
        median_ms = None  # the time measured was another config's
    switches = family.render_switches(problem, chosen)
    if device.interpret:
        switches.update(writer.interpreter_switches(problem))
    kernel = render_source(family.template, **switches)
    timing = f"; measured {median_ms:.4f} ms" if median_ms is not None else ""
    header = "\n".join([
        f"# Standalone {family_name} kernel written by autotile {autotile.__version__} `export-kernel`.",
        f"# problem: {family.problem_key(problem)}",
        f"# config:  {chosen.to_json()}",
        f"# from: {origin}; device {device.key}{timing}",
        "# Needs torch and triton only. The launcher at the end checks that its inputs match this problem.",
        "# CPU tensors run under Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported.",
        *(["# Rendered for the interpreter (dots in fp32: its bf16 dots are wrong): it runs on a GPU too, slower;",
           "# export with --gpu <the GPU's profile, e.g. h200> for a GPU's kernel."]
          if device.interpret and switches.get("UPCAST_DOTS") else []),
    ])
    launcher = writer.write(problem, chosen, switches)
    source = f"{header}\n{kernel.rstrip()}\n\n{launcher}"
    compile(source, f"<export-kernel {family_name}>", "exec")
    return ExportedKernel(family_name, family.problem_key(problem), device.key, chosen, writer.entry_point, origin,
                         median_ms, source)


def write_kernel(kernel: ExportedKernel, out: Path) -> Path:
    """Write the module to `out` (whole, then renamed into place)."""
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    try:
        partial.write_text(kernel.source, encoding="utf-8")
        partial.replace(out)
    except OSError as exc:
        if partial.parent.is_dir():
            partial.unlink(missing_ok=True)
        raise BadInputError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out
