"""One search: ask Optuna for configs, claim them, run them where a crash costs one trial, record them.

`tune_problem` (autotile.tune.driver) runs one `_Search` per device (a process
each for `--gpus`, autotile.tune.processes); several hosts with one storage run one each. They
coordinate through the study itself (autotile.tune.cluster): claims before a
config runs, counts taken from autotile's trial rows.
"""
from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable
import logging
from dataclasses import dataclass, field

import numpy as np
import optuna

from autotile.bench import Status, TrialOutcome, cuda_context_alive
from autotile.device import DeviceInfo
from autotile.errors import AutotileError
from autotile.families.base import Family
from autotile.space import Config, Space
from autotile.store.repo import Store
from autotile.tune import sampling
from autotile.tune.cluster import (
    CLAIM_ATTR, OWNER_ATTR, Heartbeat, census, fail_stale_trials, new_owner,
)
from autotile.tune.compile_ahead import DEFAULT_COMPILE_PROCESSES, NoCompileAhead, start_compile_ahead
from autotile.tune.session import TuneSession
from autotile.tune.workers import InProcessEvaluator, WorkerSetupError

log = logging.getLogger("autotile.tune")

# TPE explores this many random configs before it models the space (Optuna's default is 10).
TPE_STARTUP_TRIALS = 8
# The sampler gives up proposing new configs after this many repeats in a row: the space is exhausted.
_MAX_REPEATS_IN_A_ROW = 60
MAX_REPEATS_IN_A_ROW = _MAX_REPEATS_IN_A_ROW
# Early stop: a trial improves on the best so far only when faster by more than this fraction (repeated
# timings of one kernel differ by a percent or two).
MIN_IMPROVEMENT = 0.01
# Early stop: the vendor op "cannot be beaten" when it runs within this fraction of the pruning model's floor
# (the lower bound on every config of the space).
VENDOR_AT_FLOOR = 0.05
# Early stop: with the vendor op ahead (and not at the floor), the search stops after this many times the
# patience without improvement: the vendor serves the problem either way.
VENDOR_AHEAD_PATIENCE = 2
# Asked trials compiled ahead of the one running (besides the enqueued configs, which are compiled from the start).
# NOTE: 4 even with 8 compile processes: a 10-trial study asking 8 ahead proposes nearly all its configs before
# the first results are in. On the H200 (benchmarks/study_length.py, results/study_length_2026-12-01c.md and _d.md)
# 8 ahead left a short study's gate_up winner 3.6% behind a 5x longer study's (another config); 4 ahead found the
# long study's config there, and its one miss was a config both studies chose, timed 3.5% apart.
DEFAULT_LOOKAHEAD = 4
# Seconds between looks for trials that killed processes left running.
_STALE_CHECK_S = 10.0
# A search that finds the rest of the target claimed by others waits this long between looks.
_WAIT_FOR_OTHERS_S = (0.5, 1.5)
# After withdrawing a claim that raced another search's, a search pauses this long (random, to break ties).
_RETRY_AFTER_RACE_S = (0.05, 0.5)
# Sampler seeds of parallel searches differ by this step, so they do not propose the same configs.
_SEED_STEP = 7919


@dataclass
class Progress:
    """What the driver reports after every trial; the CLI draws it as a progress bar."""

    evaluated: int
    target: int
    best_ms: float | None
    last_status: str
    last_config: Config | None = None


class TuneError(AutotileError):
    """The study could not run at all (bad problem, unusable storage)."""


def make_sampler(seed: int) -> optuna.samplers.TPESampler:
    """The tuner's sampler: TPE over each axis on its own, with constant_liar so that concurrent searches (and a
    search's own compile-ahead queue) do not propose configs already running.

    NOTE: univariate, not multivariate: replayed on the H200 flash table of issue 15 (20 seeds, ordinal axes
    and the step-distance replacement of autotile.tune.sampling both in), multivariate TPE reached 98% of the
    table's best in a median 57 evaluations (8 of 20 searches missed it within 30% of the table), univariate
    in 11-20 (1 missed; 0 of 40 on other seeds). The GEMM tables kept their warm-start results (1, 2, 6);
    without a warm start 3000x5000x1536 took 27 evaluations, against 16 before
    (benchmarks/results/search_efficiency_2026-12-01b.md)."""
    return optuna.samplers.TPESampler(seed=seed % 2**32, n_startup_trials=TPE_STARTUP_TRIALS, multivariate=False,
                                      constant_liar=True)


class _ConfigSource:
    """Turns Optuna's per-axis suggestions into feasible configs.

    TPE suggests each axis independently; a combination that breaks a named
    constraint is told to Optuna as pruned (it never reaches the compiler) and
    the nearest feasible config, by values shared, is enqueued in its place.
    """

    def __init__(self, space: Space, candidates: list[Config] | None = None):
        self.space = space
        self._candidates = candidates
        self._feasible: list[Config] | None = None
        self._codes: np.ndarray | None = None  # (feasible config, axis) -> index of its value in the axis' choices
        self._index_of: dict[str, int] = {}  # config hash -> row
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def prepare_in_background(self) -> None:
        """Enumerate the feasible configs in a thread (a second or so) while the trial worker starts."""
        self._thread = threading.Thread(target=self._table, name="autotile-feasible", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Wait for the background enumeration.

        NOTE: a daemon thread still running at interpreter exit is stopped inside whatever C++ code it is in
        (numpy's array building here), and the process aborts ("terminate called without an active exception").
        """
        if self._thread is not None:
            self._thread.join()

    def feasible_ready(self) -> bool:
        """Whether feasible() returns without waiting for the background enumeration."""
        return self._feasible is not None or self._thread is None or not self._thread.is_alive()

    def feasible(self) -> list[Config]:
        with self._lock:
            if self._feasible is None and self._candidates is not None:
                # Only these can be feasible (a simulation's table): no need to walk the whole grid.
                keep = [c for c in map(self.space.admit, self._candidates) if c is not None]
                self._feasible = sorted(keep, key=self._grid_position)  # the order space.feasible() yields
            elif self._feasible is None:
                self._feasible = list(self.space.feasible())
            return self._feasible

    def _grid_position(self, config: Config) -> tuple:
        return tuple(axis.choices.index(config[axis.name]) for axis in self.space.axes)

    def _table(self) -> np.ndarray:
        # NOTE: a feasible set has 10^3-10^4 configs; scoring them in Python cost ~0.5 s per replaced
        # suggestion, as much as a GPU trial. As a table of value codes it is one comparison.
        configs = self.feasible()
        with self._lock:
            if self._codes is None:
                self._codes = self._codes_of(configs)
                self._index_of = {config.hash: row for row, config in enumerate(configs)}
            return self._codes

    def _codes_of(self, configs: list[Config]) -> np.ndarray:
        axes = self.space.axes
        choice_index = [{value: i for i, value in enumerate(axis.choices)} for axis in axes]
        return np.array([[index[config[axis.name]] for axis, index in zip(axes, choice_index)]
                         for config in configs], dtype=np.int16).reshape(len(configs), len(axes))

    def nearest_feasible(self, wanted: dict, exclude: set[str], allowed: np.ndarray | None = None) -> Config | None:
        """The feasible config nearest to `wanted` (steps along ordinal axes, mismatches on the others; a tie
        broken at random, seeded by the proposal: autotile.tune.sampling), not in `exclude`.

        `allowed` (a mask over `feasible()`, e.g. the configs the pruning model keeps) leaves out the others.
        """
        codes = self._table()
        if not len(codes):
            return None
        target = np.array([_code(axis.choices, wanted.get(axis.name)) for axis in self.space.axes], dtype=np.int16)
        distance = sampling.step_distance(self.space, codes, target)
        open_rows = np.ones(len(codes), dtype=bool)
        open_rows[[self._index_of[h] for h in exclude if h in self._index_of]] = False
        if allowed is not None:
            open_rows &= allowed
        if not open_rows.any():
            return None
        nearest = np.flatnonzero(open_rows & (distance == distance[open_rows].min()))
        return self.feasible()[sampling.tie_break(wanted, len(exclude), nearest)]

    def suggest(self, trial: optuna.trial.Trial) -> dict:
        return sampling.suggest(trial, self.space)


def _code(choices: tuple, value) -> int:
    """The index of `value` among an axis' choices; -1 (matching nothing) for a value outside them."""
    for i, choice in enumerate(choices):
        if choice == value and type(choice) is type(value):
            return i
    return -1


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
    try:
        trial.set_user_attr("status", outcome.status.value)
        trial.set_user_attr("config_hash", config.hash)
        if outcome.status is Status.OK:
            study.tell(trial, outcome.timing.median_ms)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        # Another search took this trial for stale and failed it (a machine so loaded that its heartbeat
        # lapsed). The row above is what counts; Optuna's sampler only loses this one observation.
        log.warning("trial %d of %s was finished by another search before it was told", trial.number, name)


def vendor_study(name: str) -> str:
    """The study name under which the vendor op's trial rows are kept (apart from the search's own count)."""
    return f"{name}:vendor"


def next_vendor_number(store: Store, name: str) -> int:
    """The trial number the next vendor row of study `name` takes (rows of earlier timings and runs are kept)."""
    return max(store.recorded_trial_numbers(vendor_study(name)), default=-1) + 1


def trial_history(engine, name: str) -> list[float | None]:
    """The median time of every evaluated trial of study `name` in the order they were recorded (None: failed)."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from autotile.store.models import Trial

    with Session(engine) as session:
        rows = session.execute(select(Trial.status, Trial.median_ms).where(Trial.study == name)
                               .order_by(Trial.id)).all()
    return [ms if status == Status.OK.value else None for status, ms in rows]


def stagnation(times: list[float | None], min_improvement: float = MIN_IMPROVEMENT) -> tuple[float | None, int]:
    """(best time, evaluated trials since the last one that improved on the best by more than `min_improvement`).

    >>> stagnation([None, 2.0, 1.5, 1.495, 1.6, None])
    (1.495, 3)
    """
    best, mark, since = None, None, 0
    for ms in times:
        since += 1
        if ms is None:
            continue
        if mark is None or ms < mark * (1.0 - min_improvement):
            mark, since = ms, 0
        best = ms if best is None else min(best, ms)
    return best, since


@dataclass
class _SearchPlan:
    """What every search of one tune_problem call shares."""

    family: Family
    problem: object
    space: Space
    engine: object
    store: Store
    storage: optuna.storages.BaseStorage
    name: str
    ids: tuple[int, int, int]  # problem, device, toolchain
    trials: int
    deadline: float | None
    timeout: float | None
    seed: int
    isolate: bool
    trial_timeout: float
    compile_ahead: bool
    lookahead: int | None
    distributed: bool
    rows_complete: bool  # the study lives in the rows' database: rows alone count the evaluated trials
    progress: Callable[[Progress], None] | None
    prune: bool = False  # drop configs the roofline model rules out (autotile.tune.prune)
    patience: int | None = None  # early stop after this many evaluated trials without improvement
    vendor_ms: float | None = None  # the vendor op's time (early stop): timed before the first trial, or a table's
    table: object = None  # a simulate.TimingTable: trials return its stored outcomes instead of running
    first_configs: tuple = ()  # the configs this run enqueued (default, warm start, seeds): compiled from the start


@dataclass
class _SharedState:
    """What the searches of one call report back (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    this_run: int = 0
    best: float | None = None
    stopped: str = ""
    context_lost: bool = False
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    pruned: int = 0  # proposals the pruning model dropped before compiling
    never_measured: int = 0  # simulation: proposals the table holds no timing of


def best_recorded(plan: "_SearchPlan") -> float | None:
    """The best time among the study's recorded trials: where "best so far" starts for a resumed run."""
    rows = plan.store.best_configs(plan.ids[0], None, 1, study=plan.name)
    return rows[0][1] if rows else None


class _Search:
    """One device's search loop on the shared study."""

    def __init__(self, plan: _SearchPlan, slot: int, gpu: int | None, device: DeviceInfo, shared: _SharedState,
                 session: TuneSession | None = None):
        self.plan, self.slot, self.gpu, self.device, self.shared = plan, slot, gpu, device, shared
        self.session = session  # lends the trial worker and compile pool; None: a private one for this search
        self.owner = new_owner()
        table = plan.table
        self.source = _ConfigSource(plan.space, None if table is None else [r.config for r in table.rows.values()])
        sampler_seed = plan.seed + _SEED_STEP * slot
        if plan.distributed:
            # Hosts run the same command (same --seed): their samplers must still differ.
            sampler_seed += random.SystemRandom().randrange(1, 2**20) * _SEED_STEP
        sampler_seed %= 2**32
        self.study = optuna.load_study(study_name=plan.name, storage=plan.storage, sampler=make_sampler(sampler_seed))
        self.queue: collections.deque = collections.deque()  # (trial, config dict) asked but not run yet
        self._next_stale_check = time.monotonic() + _STALE_CHECK_S
        self._rng = random.Random(sampler_seed)
        self._pruner = None  # built on first use, once the feasible configs are enumerated
        self._pruner_built = False
        self._recorded = 0  # evaluated trials of the study at the last census
        # The first search times the vendor op beside its first trial; the others read its rows (early stop).
        self._vendor_timed = slot != 0 or plan.table is not None
        self._vendor_confirmed = False  # timed again before the search stops on having beaten it

    def run(self) -> None:
        session = self.session if self.session is not None else TuneSession()
        try:
            self._run(session)
        finally:
            if self.session is None:
                session.close()

    def _run(self, session: TuneSession) -> None:
        plan = self.plan
        if plan.table is not None:
            from autotile.tune.simulate import SimulatedEvaluator

            evaluator = SimulatedEvaluator(plan.table)
        elif plan.isolate:
            evaluator = session.trial_evaluator(plan.family, plan.problem, self.device, plan.seed,
                                                plan.trial_timeout, gpu=self.gpu)
        else:
            evaluator = InProcessEvaluator(plan.family, plan.problem, self.device, plan.seed)
        evaluator.prestart()
        self.source.prepare_in_background()
        try:
            compiler = session.compile_pool(plan.family, plan.problem, self.device, plan.seed,
                                            plan.compile_ahead and plan.table is None, gpu=self.gpu,
                                            start=start_compile_ahead)
        except BaseException as exc:  # noqa: BLE001 - as an error of the loop: nothing started is left running
            session.give_back(evaluator)
            self.source.close()
            with self.shared.lock:
                self.shared.error = self.shared.error or exc
            self.shared.stop.set()
            return
        # The enqueued configs are known now: the pool compiles them while the first trials run, however far
        # ahead the loop asks.
        compiler.submit(config for config in plan.first_configs if plan.space.is_feasible(config))
        if plan.lookahead is not None:
            ahead = plan.lookahead
        else:  # with nothing compiling ahead, ask one trial at a time
            ahead = 0 if isinstance(compiler, NoCompileAhead) else min(DEFAULT_LOOKAHEAD, DEFAULT_COMPILE_PROCESSES)
        try:
            with Heartbeat(self.study) as heartbeat:
                self._loop(evaluator, compiler, heartbeat, 1 + ahead)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            with self.shared.lock:
                self.shared.error = self.shared.error or exc
            self.shared.stop.set()
        finally:
            self._release_queue("not needed: the search stopped")
            session.give_back(evaluator)
            session.give_back(compiler)
            self.source.close()

    # --- the loop -------------------------------------------------------------------------------
    def _loop(self, evaluator, compiler, heartbeat: Heartbeat, queue_length: int) -> None:
        plan = self.plan
        while not self.shared.stop.is_set():
            if plan.deadline is not None and time.monotonic() > plan.deadline:
                self._stop(f"timeout after {plan.timeout:.0f} s")
                return
            self._fail_stale_now_and_then()
            recorded, claims = census(plan.engine, self.study, plan.name, self.owner, plan.rows_complete)
            self._recorded = len(recorded)
            if len(recorded) >= plan.trials:
                return
            if len(recorded) + len(claims) >= plan.trials:
                time.sleep(self._rng.uniform(*_WAIT_FOR_OTHERS_S))  # the others' trials finish the target
                continue
            taken = set(recorded.values()) | set(claims.values())
            candidate = self._next_candidate(taken, heartbeat, queue_length)
            if candidate is None:
                pruning = plan.prune and self.pruner() is not None and self.pruner().active
                self._stop("every config the pruning model keeps has been evaluated" if pruning
                           else "every feasible config has been evaluated")
                return
            trial, config = candidate
            if not self._claim(trial, config, heartbeat):
                time.sleep(self._rng.uniform(*_RETRY_AFTER_RACE_S))
                continue
            compiler.submit(Config(wanted) for _, wanted in self.queue if plan.space.is_feasible(wanted))
            try:
                if not self._vendor_timed:
                    self._time_vendor(evaluator)
                compiler.wait_for(config, plan.trial_timeout)
                outcome = evaluator.evaluate(trial.number, config)
            except BaseException as exc:
                # Not the config's outcome (the machine's setup, an interrupt): its claim is withdrawn, so that a
                # search resumed in this process does not wait on it as another search's trial in flight.
                heartbeat.release(trial)
                self._release(trial, f"not run: {type(exc).__name__}")
                if isinstance(exc, WorkerSetupError):
                    raise TuneError(str(exc)) from exc
                raise
            _record(plan.store, trial, self.study, outcome, config, plan.name, *plan.ids)
            heartbeat.release(trial)
            self._report(outcome, config, len(recorded) + 1)
            if outcome.status is Status.OK and self.pruner(wait=False) is not None:
                self.pruner().observe(config, outcome.timing.median_ms)
            if plan.patience:
                reason = self._early_stop_reason(evaluator)
                if reason:
                    self._stop(reason)
                    return
            if (outcome.status is Status.CRASH and not evaluator.isolated and not self.device.interpret
                    and plan.table is None and not cuda_context_alive()):
                with self.shared.lock:
                    self.shared.context_lost = True
                self._stop("a candidate crashed the CUDA context; every finished trial is stored - "
                           "run the same command again to resume")
                return

    def _next_candidate(self, taken: set[str], heartbeat: Heartbeat, queue_length: int):
        """The next asked config to run, pruning infeasible and repeated ones; None when the space is exhausted."""
        repeats = 0
        while True:
            while len(self.queue) < queue_length:
                trial = self.study.ask()
                trial.set_user_attr(OWNER_ATTR, self.owner)
                heartbeat.hold(trial)
                self.queue.append((trial, self.source.suggest(trial)))
            trial, wanted = self.queue.popleft()
            config = Config(wanted)
            queued = {Config(w).hash for _, w in self.queue}
            violations = self.plan.space.violations(config)
            dropped = "" if violations else self._dropped_by_model(config)
            if not violations and not dropped and config.hash not in taken and config.hash not in queued:
                return trial, config
            # Infeasible, ruled out by the model or already measured: prune without compiling and put a new
            # feasible config in its place.
            heartbeat.release(trial)
            trial.set_user_attr("pruned_because", violations[0] if violations else dropped or "already evaluated")
            self._count_pruned(violations, dropped)
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            repeats = repeats + 1 if not violations and not dropped else repeats
            allowed = self.pruner().alive() if self.plan.prune and self.pruner(wait=False) is not None else None
            replacement = self.source.nearest_feasible(wanted, exclude=taken | queued, allowed=allowed)
            if replacement is None or repeats > _MAX_REPEATS_IN_A_ROW:
                return None
            # NOTE: not skip_if_exists: Optuna's check compares the params of every trial of the study (~80 ms a
            # call at 60 trials); the replacement is neither evaluated nor queued, and a duplicate enqueued while
            # others wait ahead of it is pruned as "already evaluated" when its turn comes.
            self.study.enqueue_trial(dict(replacement))

    def _claim(self, trial, config: Config, heartbeat: Heartbeat) -> bool:
        """Claim `trial`; withdraw (and return False) when another search's claim makes it one too many or a repeat."""
        plan = self.plan
        trial.set_user_attr(CLAIM_ATTR, config.hash)
        recorded, others = census(plan.engine, self.study, plan.name, self.owner, plan.rows_complete)
        over = len(recorded) + len(others) >= plan.trials
        repeat = config.hash in set(others.values()) or config.hash in set(recorded.values())
        if not over and not repeat:
            return True
        heartbeat.release(trial)
        trial.set_user_attr("pruned_because", "claimed by another search" if repeat else "target reached by others")
        self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return False

    # --- the vendor op ----------------------------------------------------------------------------
    def _time_vendor(self, evaluator, when: str = "before the first trial") -> None:
        """Run each vendor config (cuBLAS, SDPA) as a trial before the first search trial, in the same worker,
        and store the outcomes as the vendor study's rows: the early stop knows from the first trial whether the
        vendor op is ahead, and a run shows from its start a candidate as fast as the vendor op. The final
        interleaved re-timing (driver._pick_winner) still decides the winner."""
        self._vendor_timed = True
        plan = self.plan
        configs = plan.family.vendor_configs(plan.problem, self.device)
        if not configs:
            return
        problem_id, device_id, toolchain_id = plan.ids
        first = next_vendor_number(plan.store, plan.name)
        best = None
        for index, config in enumerate(configs):
            # Input set 0, as the first search trial: the vendor op is checked on the same inputs.
            outcome = evaluator.evaluate(0, config)
            timing = outcome.timing
            plan.store.record_trial(
                problem_id=problem_id, device_id=device_id, toolchain_id=toolchain_id, study=vendor_study(plan.name),
                number=first + index, config=config.to_json(), config_hash=config.hash, status=outcome.status.value,
                median_ms=timing.median_ms if timing else None, q20_ms=timing.q20_ms if timing else None,
                q80_ms=timing.q80_ms if timing else None, interpreted=int(self.device.interpret),
                max_abs_error=outcome.max_abs_error, error=outcome.error)
            if outcome.status is Status.OK and (best is None or timing.median_ms < best):
                best = timing.median_ms
        if best is not None and (plan.vendor_ms is None or best < plan.vendor_ms):
            plan.vendor_ms = best
        log.info("%s: vendor op timed %s: %s", plan.name, when,
                 "no config passed" if best is None else f"{best:.4g} ms")

    def _vendor_ms(self) -> float | None:
        """The vendor op's best time: this run's early timing, else the study's vendor rows (another search's, or
        an earlier run's)."""
        plan = self.plan
        if plan.vendor_ms is not None or plan.table is not None:
            return plan.vendor_ms
        rows = plan.store.best_configs(plan.ids[0], None, 1, study=vendor_study(plan.name))  # any driver's
        return rows[0][1] if rows else None

    # --- pruning and early stop -------------------------------------------------------------------
    def pruner(self, wait: bool = True):
        """The roofline model of this problem (autotile.tune.prune), when the search prunes or stops early and the
        family and device have one; calibrated on the study's trials so far.

        With `wait` off, None while the study holds fewer than MIN_OBSERVED trials and the feasible configs are
        still being enumerated in the background: the model drops nothing before MIN_OBSERVED measured trials,
        and reads every stored trial when it is built, so waiting then would only hold up the first trials (the
        enumeration takes 0.4-0.9 s for LLM projections; a search in this process waited for it before its first
        trial)."""
        plan = self.plan
        if not self._pruner_built and (plan.prune or plan.patience):
            from autotile.tune.prune import MIN_OBSERVED, Pruner

            # (A simulation always waits: its replay must propose what this loop evaluates. So does the
            # interpreter, whose trials would only compete with the enumeration for the GIL.)
            if (not wait and plan.table is None and not self.device.interpret and self._recorded < MIN_OBSERVED
                    and not self.source.feasible_ready()):
                return None
            self._pruner_built = True
            self._pruner = Pruner.for_problem(plan.family, plan.problem, self.device, self.source.feasible())
            if self._pruner is not None:
                for text, ms in plan.store.best_configs(plan.ids[0], None, len(self.source.feasible()),
                                                        study=plan.name):
                    self._pruner.observe(Config.from_json(text), ms)
        return self._pruner

    def _dropped_by_model(self, config: Config) -> str:
        if not self.plan.prune or self.pruner(wait=False) is None:
            return ""
        return self.pruner().reason(config)

    def _count_pruned(self, violations: list[str], dropped: str) -> None:
        from autotile.tune.simulate import MEASURED

        with self.shared.lock:
            if dropped:
                self.shared.pruned += 1
            elif violations and violations[0].startswith(MEASURED + ":"):
                self.shared.never_measured += 1

    def _early_stop_reason(self, evaluator) -> str:
        """Why to stop now ('' to go on): no improvement for `patience` evaluated trials, and the vendor op beaten
        or out of reach."""
        plan = self.plan
        best, since = stagnation(trial_history(plan.engine, plan.name))
        if best is None or since < plan.patience:
            return ""
        quiet = f"no improvement in {since} trials (best {best:.4g} ms)"
        vendor = self._vendor_ms()
        if vendor is None:
            return quiet
        if best <= vendor and not self._vendor_confirmed and plan.table is None:
            # NOTE: a timing only ever comes out too slow, never too fast: a vendor op timed once, beside the first
            # compiles and process forks, measured 0.30 ms against 0.042 on the H200. Timed again before the search
            # stops on it, the faster of the timings counts.
            self._vendor_confirmed = True
            self._time_vendor(evaluator, when="again before stopping")
            vendor = self._vendor_ms()
        if best <= vendor:
            return f"{quiet}, faster than the vendor op ({vendor:.4g} ms)"
        pruner = self.pruner()
        if pruner is not None and vendor <= pruner.floor_ms() * (1.0 + VENDOR_AT_FLOOR):
            return (f"{quiet}; the vendor op ({vendor:.4g} ms) runs at the roofline floor of this space "
                    f"({pruner.floor_ms():.4g} ms): no config can beat it")
        if since >= VENDOR_AHEAD_PATIENCE * plan.patience:
            return f"{quiet}; the vendor op stays ahead ({vendor:.4g} ms) and will serve this problem"
        return ""

    # --- bookkeeping ------------------------------------------------------------------------------
    def _fail_stale_now_and_then(self) -> None:
        if time.monotonic() >= self._next_stale_check:
            fail_stale_trials(self.study)
            self._next_stale_check = time.monotonic() + _STALE_CHECK_S

    def _report(self, outcome: TrialOutcome, config: Config, evaluated: int) -> None:
        with self.shared.lock:
            self.shared.this_run += 1
            if outcome.status is Status.OK and (self.shared.best is None or outcome.timing.median_ms < self.shared.best):
                self.shared.best = outcome.timing.median_ms
            best = self.shared.best
        if self.plan.progress:
            self.plan.progress(Progress(evaluated, self.plan.trials, best, outcome.status.value, config))

    def _stop(self, reason: str) -> None:
        with self.shared.lock:
            self.shared.stopped = self.shared.stopped or reason
        self.shared.stop.set()

    def _release_queue(self, reason: str) -> None:
        """Tell Optuna the asked trials this search will not run (so they are not left RUNNING)."""
        while self.queue:
            trial, _ = self.queue.popleft()
            self._release(trial, reason)

    def _release(self, trial, reason: str) -> None:
        try:
            trial.set_user_attr("pruned_because", reason)
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED, skip_if_finished=True)
        except Exception:  # noqa: BLE001 - the storage is gone; a rerun fails these as stale
            log.debug("could not release trial %s", trial.number)
