"""The Optuna study driver: ask for a config, run one trial, record it, pick the winner.

The study lives in Optuna's own tables (same database URL by default, or
`storage_url` for a shared server), named after the family, device and
problem, so running the same command again resumes it. autotile's own tables
get one row per evaluated trial and one winner per (problem, device).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna

from autotile.bench import Status, TrialOutcome, cuda_context_alive, evaluate, prepare, retime_interleaved
from autotile.device import DeviceInfo
from autotile.errors import AutotileError
from autotile.families.base import Family
from autotile.space import Config, Space
from autotile.store.db import open_engine
from autotile.store.repo import Store

log = logging.getLogger("autotile.tune")

# Configs re-timed, interleaved, before the winner is named: the best few by trial time.
DEFAULT_TOP_K = 3
# Rounds of the interleaved re-timing (each times every finalist once).
DEFAULT_RETIME_ROUNDS = 5
# TPE explores this many random configs before it models the space (Optuna's default is 10).
_TPE_STARTUP_TRIALS = 8
# Input sets (with their references) the trials rotate through.
_INPUT_SETS = 2
# The sampler gives up proposing new configs after this many repeats in a row: the space is exhausted.
_MAX_REPEATS_IN_A_ROW = 60


@dataclass
class Progress:
    """What the driver reports after every trial; the CLI draws it as a progress bar."""

    evaluated: int
    target: int
    best_ms: float | None
    last_status: str
    last_config: Config | None = None


@dataclass
class TuneResult:
    family: str
    problem_key: str
    device_key: str
    study: str
    winner: Config | None
    winner_ms: float | None
    winner_q20_ms: float | None = None
    winner_q80_ms: float | None = None
    runner_up_ms: float | None = None
    baseline_name: str = ""
    baseline_ms: float | None = None
    statuses: dict[str, int] = field(default_factory=dict)
    trials_this_run: int = 0
    seconds: float = 0.0
    interpreted: bool = False
    stopped_early: str = ""

    @property
    def speedup(self) -> float | None:
        if self.winner_ms and self.baseline_ms:
            return self.baseline_ms / self.winner_ms
        return None


def study_name(family: Family, problem, device: DeviceInfo) -> str:
    digest = hashlib.sha256(family.problem_key(problem).encode()).hexdigest()[:16]
    return f"autotile:{family.name}:{device.key}:{digest}"


def _optuna_storage(url: str) -> optuna.storages.BaseStorage:
    engine_kwargs = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)


class _ConfigSource:
    """Turns Optuna's per-axis suggestions into feasible configs.

    TPE suggests each axis independently; a combination that breaks a named
    constraint is told to Optuna as pruned (it never reaches the compiler) and
    the nearest feasible config, by values shared, is enqueued in its place.
    """

    def __init__(self, space: Space):
        self.space = space
        self._feasible: list[Config] | None = None

    def feasible(self) -> list[Config]:
        if self._feasible is None:
            self._feasible = list(self.space.feasible())
        return self._feasible

    def nearest_feasible(self, wanted: dict, exclude: set[str]) -> Config | None:
        best, best_score = None, -1
        for config in self.feasible():
            if config.hash in exclude:
                continue
            score = sum(config[k] == wanted.get(k) for k in config)
            if score > best_score:
                best, best_score = config, score
        return best

    def suggest(self, trial: optuna.trial.Trial) -> dict:
        return {axis.name: trial.suggest_categorical(axis.name, list(axis.choices)) for axis in self.space.axes}


def _evaluated_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    return [t for t in study.get_trials(deepcopy=False, states=states) if "status" in t.user_attrs]


def tune_problem(
    family: Family,
    problem,
    device: DeviceInfo,
    *,
    trials: int = 30,
    timeout: float | None = None,
    db_url: str | None = None,
    storage_url: str | None = None,
    seed: int = 0,
    top_k: int = DEFAULT_TOP_K,
    retime_rounds: int = DEFAULT_RETIME_ROUNDS,
    progress: Callable[[Progress], None] | None = None,
) -> TuneResult:
    """Search `family`'s space for `problem` on `device` until the study holds `trials` evaluated trials.

    Resumes a study of the same name; records every trial; re-times the best
    `top_k` configs interleaved with the baseline and stores the winner.

    >>> from autotile.families.gemm import FAMILY, GemmProblem
    >>> from autotile.device import interpret_device
    >>> r = tune_problem(FAMILY, GemmProblem(16, 32, 32, "fp32", "fp32"), interpret_device(),
    ...                  trials=2, db_url="sqlite:///:memory:")  # doctest: +SKIP
    """
    started = time.monotonic()
    engine = open_engine(db_url, create=True)
    store = Store(engine)
    storage = _optuna_storage(storage_url or str(engine.url.render_as_string(hide_password=False)))
    device_id = store.ensure_device(device)
    toolchain_id = store.ensure_toolchain()
    problem_id = store.ensure_problem(family, problem)
    space = family.space(problem, device)
    source = _ConfigSource(space)
    name = study_name(family, problem, device)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=_TPE_STARTUP_TRIALS, multivariate=True,
                                         constant_liar=True)
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, direction="minimize",
                                load_if_exists=True)
    study.set_user_attr("family", family.name)
    study.set_user_attr("problem_key", family.problem_key(problem))
    if not study.trials:
        study.enqueue_trial(dict(family.default_config(problem, device)))
        for config in family.seed_configs(problem, device):
            study.enqueue_trial(dict(config), skip_if_exists=True)

    # Trials alternate between a few input sets, each with its reference computed once: a float64
    # reference of a large problem costs more than the candidate, and a kernel right on one random
    # set but wrong on another (a race, an indexing slip) still fails on the next set.
    input_sets: dict[int, tuple] = {}

    def prepared_for(number: int):
        slot = number % _INPUT_SETS
        if slot not in input_sets:
            input_sets[slot] = prepare(family, problem, device, seed + slot)
        return input_sets[slot]

    done = _evaluated_trials(study)
    seen: dict[str, float | None] = {t.user_attrs["config_hash"]: t.value for t in done}
    evaluated = len(done)
    this_run = 0
    repeats = 0
    stopped = ""
    best = min((v for v in seen.values() if v is not None), default=None)

    while evaluated < trials:
        if timeout is not None and time.monotonic() - started > timeout:
            stopped = f"timeout after {timeout:.0f} s"
            break
        trial = study.ask()
        wanted = source.suggest(trial)
        config = Config(wanted)
        violations = space.violations(config)
        if violations or config.hash in seen:
            # Infeasible or already measured: prune without compiling and put a new feasible config in its place.
            trial.set_user_attr("pruned_because", violations[0] if violations else "already evaluated")
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            repeats = repeats + 1 if not violations else repeats
            replacement = source.nearest_feasible(wanted, exclude=set(seen))
            if replacement is None or repeats > _MAX_REPEATS_IN_A_ROW:
                stopped = "every feasible config has been evaluated"
                break
            study.enqueue_trial(dict(replacement), skip_if_exists=True)
            continue
        repeats = 0
        try:
            prepared = prepared_for(trial.number)
        except Exception as exc:  # noqa: BLE001 - inputs or reference do not fit: nothing can be checked
            raise TuneError(f"{family.name}: cannot build inputs and reference for {problem}: {exc}") from exc
        outcome = evaluate(family, problem, config, device, seed=seed + trial.number, prepared=prepared)
        _record(store, trial, study, outcome, config, name, problem_id, device_id, toolchain_id)
        seen[config.hash] = outcome.timing.median_ms if outcome.status is Status.OK else None
        evaluated += 1
        this_run += 1
        if outcome.status is Status.OK and (best is None or outcome.timing.median_ms < best):
            best = outcome.timing.median_ms
        if progress:
            progress(Progress(evaluated, trials, best, outcome.status.value, config))
        if outcome.status is Status.CRASH and not device.interpret and not cuda_context_alive():
            stopped = ("a candidate crashed the CUDA context; every finished trial is stored - "
                       "run the same command again to resume")
            break

    result = _pick_winner(family, problem, device, store, problem_id, device_id, toolchain_id, top_k, retime_rounds,
                          name, seed, crashed=bool(stopped and "crashed" in stopped))
    result.statuses = store.status_counts(problem_id, device_id)
    result.trials_this_run = this_run
    result.seconds = time.monotonic() - started
    result.stopped_early = stopped
    return result


def _record(store: Store, trial, study, outcome: TrialOutcome, config: Config, name: str,
            problem_id: int, device_id: int, toolchain_id: int) -> None:
    timing = outcome.timing
    store.record_trial(
        problem_id=problem_id, device_id=device_id, toolchain_id=toolchain_id, study=name, number=trial.number,
        config=config.to_json(), config_hash=config.hash, status=outcome.status.value,
        median_ms=timing.median_ms if timing else None, q20_ms=timing.q20_ms if timing else None,
        q80_ms=timing.q80_ms if timing else None, interpreted=int(bool(timing and timing.interpreted)),
        max_abs_error=outcome.max_abs_error, error=outcome.error,
    )
    trial.set_user_attr("status", outcome.status.value)
    trial.set_user_attr("config_hash", config.hash)
    if outcome.status is Status.OK:
        study.tell(trial, outcome.timing.median_ms)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def _pick_winner(family: Family, problem, device: DeviceInfo, store: Store, problem_id: int, device_id: int,
                 toolchain_id: int, top_k: int, rounds: int, name: str, seed: int, crashed: bool) -> TuneResult:
    """Re-time the best few configs and the baseline in turns; the fastest median wins."""
    result = TuneResult(family.name, family.problem_key(problem), device.key, name, None, None,
                        interpreted=device.interpret)
    finalists = [Config(json.loads(text)) for text, _ in store.best_configs(problem_id, device_id, top_k)]
    if not finalists:
        return result
    if crashed:
        rounds = 0  # the CUDA context is gone; keep the trial timings
    timings = {}
    baseline_name = ""
    if rounds > 0:
        inputs = family.make_inputs(problem, device, seed=seed)
        outputs = {c.hash: family.allocate_outputs(problem, inputs) for c in finalists}
        fns = {c.hash: (lambda c=c: family.launch(problem, c, inputs, outputs[c.hash])) for c in finalists}
        baseline = family.baseline(problem, inputs)
        if baseline is not None:
            fns["baseline"] = baseline.run
            baseline_name = baseline.name
        try:
            timings = retime_interleaved(fns, device, rounds=rounds)
        except Exception as exc:  # noqa: BLE001 - a finalist or the baseline failed on re-run
            log.warning("interleaved re-timing failed (%s); using trial timings", exc)
            timings = {}
    if timings:
        ranked = sorted(finalists, key=lambda c: timings[c.hash].median_ms)
        win = timings[ranked[0].hash]
        runner_up = timings[ranked[1].hash].median_ms if len(ranked) > 1 else None
        baseline_ms = timings["baseline"].median_ms if "baseline" in timings else None
    else:
        trial_ms = dict(store.best_configs(problem_id, device_id, top_k))
        ranked = finalists
        ms = trial_ms[ranked[0].to_json()]
        from autotile.bench import Timing

        win = Timing(ms, ms, ms, device.interpret)
        runner_up = trial_ms.get(ranked[1].to_json()) if len(ranked) > 1 else None
        baseline_ms = None
    winner = ranked[0]
    total = sum(store.status_counts(problem_id, device_id).values())
    store.save_winner(
        problem_id=problem_id, device=device, device_id=device_id, toolchain_id=toolchain_id,
        config=winner.to_json(), config_hash=winner.hash, median_ms=win.median_ms, q20_ms=win.q20_ms,
        q80_ms=win.q80_ms, interpreted=int(device.interpret), runner_up_ms=runner_up,
        margin=(runner_up / win.median_ms - 1.0) if runner_up else None, baseline_name=baseline_name,
        baseline_ms=baseline_ms, trials_run=total,
        provenance=f"study {name}: {total} trials; best {len(finalists)} re-timed over {rounds} interleaved rounds",
    )
    result.winner, result.winner_ms = winner, win.median_ms
    result.winner_q20_ms, result.winner_q80_ms = win.q20_ms, win.q80_ms
    result.runner_up_ms, result.baseline_name, result.baseline_ms = runner_up, baseline_name, baseline_ms
    return result


class TuneError(AutotileError):
    """The study could not run at all (bad problem, unusable storage)."""
