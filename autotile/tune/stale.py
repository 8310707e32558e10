"""`autotile tune --stale`: re-validate stale winners cheaply, by re-timing their stored top few configs.

A winner goes stale when torch, Triton, CUDA or the GPU driver changed since it
was measured. Rather than a new search, the stored winner and the best few
other configs its study found (on any driver of the same device key) are each
checked against the reference again and re-timed interleaved with the
baseline; the fastest is stored as the winner, filed under the present
toolchain and driver.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from autotile.bench import Status, prepare, retime_interleaved, run_checked
from autotile.device import DeviceInfo
from autotile.errors import ConfigOutsideSpaceError
from autotile.families import get_family
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.store.staleness import STALENESS_FIELDS, stale_reasons
from autotile.tune.driver import DEFAULT_RETIME_ROUNDS, DEFAULT_TOP_K



@dataclass(frozen=True)
class RevalidationResult:
    family: str
    problem_key: str
    reasons: tuple[str, ...]  # why the winner was stale
    status: str  # 'revalidated'; 'failed' when no stored config passes the check any more; 'superseded' when a tune
    # stored a new winner while the old one was re-timed (the new one is kept)
    previous_config: str
    config: str | None  # the winner now (None when failed)
    previous_ms: float
    ms: float | None
    candidates: int  # stored configs re-checked
    detail: str = ""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def revalidate_stale(db_url: str | None, device: DeviceInfo, family: str | None = None, *, top_k: int = DEFAULT_TOP_K,
                     rounds: int = DEFAULT_RETIME_ROUNDS, seed: int = 0) -> list[RevalidationResult]:
    """Re-validate every stale winner filed under `device.key`; fresh winners are left alone.

    >>> from autotile.device import interpret_device
    >>> revalidate_stale("sqlite:////tmp/t.sqlite", interpret_device(), "gemm")  # doctest: +SKIP
    [RevalidationResult(family='gemm', ..., status='revalidated', ...)]
    """
    store = Store(open_engine(db_url, create=True))
    device_id = store.ensure_device(device)
    toolchain_id = store.ensure_toolchain()
    results = []
    for winner, problem_row, device_row, toolchain in store.winner_rows(family, device.key):
        versions = {name: getattr(toolchain, name) for name in STALENESS_FIELDS}
        reasons = tuple(stale_reasons(versions, device_row.driver, device))
        if not reasons:
            if winner.stale:
                store.update_winner(winner.id, stale=0)
            continue
        results.append(_revalidate_one(store, winner, problem_row, reasons, device, device_id, toolchain_id, top_k,
                                       rounds, seed))
    return results


def _revalidate_one(store: Store, winner, problem_row, reasons: tuple[str, ...], device: DeviceInfo, device_id: int,
                    toolchain_id: int, top_k: int, rounds: int, seed: int) -> RevalidationResult:
    def failed(detail: str, candidates: int = 0) -> RevalidationResult:
        store.update_winner(winner.id, config_hash=winner.config_hash, stale=1, verified_at=_now(), verified_ms=None,
                            verify_status="failed")
        return RevalidationResult(problem_row.family, problem_row.key, reasons, "failed", winner.config, None,
                                  winner.median_ms, None, candidates, detail)

    try:
        family = get_family(problem_row.family)
        problem = family.problem_from_dict(problem_row.params)
    except Exception as exc:  # noqa: BLE001 - a row this version of the family cannot read
        return failed(f"the stored problem does not rebuild: {exc}")
    texts = [winner.config] + [text for text, _ in store.best_configs_on_key(winner.problem_id, device.key, top_k)]
    configs: dict[str, Config] = {}
    for text in texts:
        try:
            config = family.validate_config(problem, device, Config.from_json(text))
        except ConfigOutsideSpaceError:
            continue
        configs.setdefault(config.hash, config)
        if len(configs) == top_k:
            break
    if not configs:
        return failed("no stored config is inside the family's space any more; run a new search")
    try:
        prepared = prepare(family, problem, device, seed)
    except Exception as exc:  # noqa: BLE001
        return failed(f"cannot build inputs and reference: {exc}", len(configs))
    passing, failures = [], []
    for config in configs.values():
        outcome, _ = run_checked(family, problem, config, device, seed, prepared)
        if outcome.status is Status.OK:
            passing.append(config)
        else:
            failures.append(f"{config.to_json()}: {outcome.status.value}")
    if not passing:
        return failed("no stored config passes the correctness check: " + "; ".join(failures), len(configs))

    inputs = prepared[0]
    outputs = {c.hash: family.allocate_outputs(problem, inputs) for c in passing}
    fns = {c.hash: family.timed_call(problem, c, inputs, outputs[c.hash]) for c in passing}
    baseline = family.baseline(problem, inputs)
    if baseline is not None:
        fns["baseline"] = baseline.run
    try:
        timings = retime_interleaved(fns, device, rounds=max(1, rounds))
    except Exception as exc:  # noqa: BLE001 - a config that passed once and fails on re-run
        return failed(f"re-timing failed: {type(exc).__name__}: {exc}", len(configs))
    ranked = sorted(passing, key=lambda c: timings[c.hash].median_ms)
    best = timings[ranked[0].hash]
    runner_up = timings[ranked[1].hash].median_ms if len(ranked) > 1 else None
    baseline_ms = timings["baseline"].median_ms if "baseline" in timings else None
    saved = store.save_winner(
        problem_id=winner.problem_id, device=device, device_id=device_id, toolchain_id=toolchain_id,
        replaces=winner.config_hash, config=ranked[0].to_json(), config_hash=ranked[0].hash,
        median_ms=best.median_ms, q20_ms=best.q20_ms, q80_ms=best.q80_ms, interpreted=int(device.interpret),
        runner_up_ms=runner_up,
        margin=(runner_up / best.median_ms - 1.0) if runner_up else None,
        baseline_name=baseline.name if baseline is not None else "", baseline_ms=baseline_ms,
        trials_run=winner.trials_run,
        provenance=(f"revalidated ({'; '.join(reasons)}): stored top {len(configs)} re-checked and re-timed over "
                    f"{max(1, rounds)} interleaved rounds; before: {winner.provenance}")[:4000],
        verified_at=_now(), verified_ms=best.median_ms, verify_status="ok",
    )
    if not saved:  # a tune stored a new winner while this re-timed the old one's configs: it stays
        return RevalidationResult(problem_row.family, problem_row.key, reasons, "superseded", winner.config, None,
                                  winner.median_ms, None, len(configs), "a tune stored a new winner meanwhile; kept")
    detail = "; ".join(failures) if failures else ""
    return RevalidationResult(problem_row.family, problem_row.key, reasons, "revalidated", winner.config,
                              ranked[0].to_json(), winner.median_ms, best.median_ms, len(configs), detail)


__all__ = ["revalidate_stale", "RevalidationResult"]
