"""`autotile db verify`: re-check stored winners on this GPU, for correctness and for time, and mark regressions.

Each winner filed under the present device's key is rebuilt from its row
(problem through the family, config validated against the family's space),
run once against the torch reference, then re-timed; a winner now slower than
its stored median by more than `threshold` is marked as a regression. The
results land in the winner's verification columns; the winner itself stays.
"""
from __future__ import annotations

import datetime as dt
import enum
import json
from dataclasses import dataclass

from autotile.bench import Status, retime_interleaved, run_checked
from autotile.device import DeviceInfo
from autotile.errors import AutotileError, ConfigOutsideSpaceError
from autotile.families import get_family
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store
from autotile.store.staleness import STALENESS_FIELDS, stale_reasons

# Repeated timings of one kernel on the lent H200 differ by up to ~9% (DESIGN.md, "One trial");
# a winner counts as regressed only when it is slower than that noise by a clear step more.
DEFAULT_REGRESSION_THRESHOLD = 0.15
# Interleaved rounds of the re-timing (each times the winner once).
DEFAULT_VERIFY_ROUNDS = 3


class VerifyStatus(str, enum.Enum):
    OK = "ok"
    REGRESSION = "regression"
    OUTSIDE_SPACE = "outside_space"  # the stored config is no longer a point of the family's space
    BAD_PROBLEM = "bad_problem"  # the stored problem does not rebuild with this version of the family
    WRONG_RESULT = Status.WRONG_RESULT.value
    COMPILE_ERROR = Status.COMPILE_ERROR.value
    OUT_OF_RESOURCES = Status.OUT_OF_RESOURCES.value
    TIMEOUT = Status.TIMEOUT.value
    CRASH = Status.CRASH.value


@dataclass(frozen=True)
class VerifyResult:
    family: str
    problem_key: str
    device_key: str
    status: VerifyStatus
    stored_ms: float
    verified_ms: float | None
    regression: float | None  # verified_ms / stored_ms - 1 when marked as a regression
    stale_reasons: tuple[str, ...]
    detail: str = ""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def rebuild(family_name: str, params: dict, config_json: str, device: DeviceInfo):
    """(family, problem, validated config) of a stored winner; raises AutotileError saying which part failed."""
    family = get_family(family_name)
    try:
        problem = family.problem_from_dict(params)
    except Exception as exc:  # noqa: BLE001 - any failure of a stored problem is reported, not raised
        raise _BadProblem(f"{family_name} problem {json.dumps(params, sort_keys=True)} does not rebuild: {exc}") from None
    config = family.validate_config(problem, device, Config.from_json(config_json))
    return family, problem, config


class _BadProblem(AutotileError):
    pass


def verify_winners(db_url: str | None, device: DeviceInfo, *, family: str | None = None,
                   threshold: float = DEFAULT_REGRESSION_THRESHOLD, rounds: int = DEFAULT_VERIFY_ROUNDS,
                   seed: int = 0) -> list[VerifyResult]:
    """Re-check every winner filed under `device.key` (optionally one family) and record the outcome.

    >>> from autotile.device import interpret_device
    >>> verify_winners("sqlite:////tmp/t.sqlite", interpret_device(), family="gemm")  # doctest: +SKIP
    [VerifyResult(family='gemm', ..., status=<VerifyStatus.OK: 'ok'>, ...)]
    """
    store = Store(open_engine(db_url, create=False))
    results = []
    for winner, problem_row, device_row, toolchain in store.winner_rows(family, device.key):
        versions = {name: getattr(toolchain, name) for name in STALENESS_FIELDS}
        reasons = tuple(stale_reasons(versions, device_row.driver, device))
        status, ms, detail = _check_one(problem_row.family, problem_row.params, winner.config, device, rounds, seed)
        regression = None
        if status is VerifyStatus.OK and ms is not None and ms > winner.median_ms * (1.0 + threshold):
            status, regression = VerifyStatus.REGRESSION, ms / winner.median_ms - 1.0
            detail = f"{ms:.4f} ms now vs {winner.median_ms:.4f} ms stored (+{regression:.0%})"
        store.update_winner(winner.id, verified_at=_now(), verified_ms=ms, verify_status=status.value,
                            regression=regression, stale=int(bool(reasons)))
        results.append(VerifyResult(problem_row.family, problem_row.key, winner.device_key, status, winner.median_ms,
                                    ms, regression, reasons, detail))
    return results


def _check_one(family_name: str, params: dict, config_json: str, device: DeviceInfo, rounds: int,
               seed: int) -> tuple[VerifyStatus, float | None, str]:
    try:
        family, problem, config = rebuild(family_name, params, config_json, device)
    except ConfigOutsideSpaceError as exc:
        return VerifyStatus.OUTSIDE_SPACE, None, str(exc)
    except AutotileError as exc:
        return VerifyStatus.BAD_PROBLEM, None, str(exc)
    outcome, inputs = run_checked(family, problem, config, device, seed)
    if outcome.status is not Status.OK:
        return VerifyStatus(outcome.status.value), None, outcome.error[:500]
    outputs = family.allocate_outputs(problem, inputs)
    try:
        timing = retime_interleaved({"winner": family.timed_call(problem, config, inputs, outputs)}, device,
                                    rounds=max(1, rounds))["winner"]
    except Exception as exc:  # noqa: BLE001 - a kernel that passed once and fails on re-run is a crash
        return VerifyStatus.CRASH, None, f"{type(exc).__name__}: {exc}"[:500]
    return VerifyStatus.OK, timing.median_ms, ""
