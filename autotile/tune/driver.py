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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import optuna
from sqlalchemy.engine import make_url

from autotile.bench import Status, prepare, retime_interleaved, run_checked
from autotile.device import DeviceInfo, cuda_device
from autotile.errors import ShapeMismatchError
from autotile.families.base import Family, is_vendor, vendor_label
from autotile.space import Config
from autotile.store.db import default_db_url, normalise_url, open_engine
from autotile.store.repo import ANY_WINNER, Store
from autotile.store.staleness import mark_stale
from autotile.tune.cluster import evaluated_trials, fail_stale_trials
from autotile.tune.processes import CtrlC, run_search_processes
from autotile.tune.storage import (create_own_study, given_storage, is_journal, open_study, own_storage,
                                    study_journal)
from autotile.tune.retime import race
from autotile.tune.search import (  # noqa: F401 - re-exported
    Progress, TuneError, _Search, _SearchPlan, _SharedState, best_recorded, next_vendor_number, vendor_study,
)
from autotile.tune.session import TuneSession, current_session
from autotile.tune.workers import default_trial_timeout

log = logging.getLogger("autotile.tune")

# Configs re-timed, interleaved, before the winner is named: the best few by trial time.
DEFAULT_TOP_K = 3
# Rounds of the interleaved re-timing (each times every finalist still in the race once: autotile.tune.retime).
DEFAULT_RETIME_ROUNDS = 5
# Rounds of the re-timing beside the vendor op at each corner of a winner's serving bucket.
RANGE_ROUNDS = 3
# A stored winner is replaced only by a config faster than it by more than this fraction, in the same
# interleaved re-timing (repeated timings of one kernel differ by a percent or two there).
KEEP_STORED_MARGIN = 0.01


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
    verified_range: dict | None = None  # {serving field: [lo, hi]} the winner was verified over (None: its shape only)
    already_complete: bool = False  # the study held `trials` evaluated trials already: nothing was run
    interrupted: bool = False  # Ctrl-C stopped the search; the winner is the best of the trials run so far
    pruned: int = 0  # proposals the roofline model dropped before compiling (this run, this process)
    never_measured: int = 0  # simulation: proposals the table has no timing of (replaced by measured ones)
    warm_start: str = ""  # where the warm-start configs came from ('' when the study was not new)
    simulated: bool = False  # every trial was answered from a timing table

    @property
    def vendor_won(self) -> bool:
        return self.winner is not None and is_vendor(self.winner)

    @property
    def speedup(self) -> float | None:
        if self.winner_ms and self.baseline_ms:
            return self.baseline_ms / self.winner_ms
        return None


def study_name(family: Family, problem, device: DeviceInfo) -> str:
    """One study per family, device, problem and template version.

    The template's hash is part of the name: after a template changes, the same command starts a new
    study, and the winner is picked from trials of the current kernels only (older trials stay stored).
    """
    from autotile.render import template_sha

    digest = hashlib.sha256(family.problem_key(problem).encode()).hexdigest()[:16]
    return f"autotile:{family.name}:{device.key}:{digest}:t{template_sha(family.template)}"


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
    gpus: Sequence[int] | None = None,
    isolate: bool | None = None,
    trial_timeout: float | None = None,
    compile_ahead: bool = True,
    lookahead: int | None = None,
    warm_start: bool = True,
    prune: bool = True,
    patience: int | None = None,
    simulate=None,
    session: TuneSession | None = None,
    _table=None,  # the rest are set by the simulation (_simulate) only
    _space=None,
    _warm_source: str | None = None,
    _vendor_ms: float | None = None,
) -> TuneResult:
    """Search `family`'s space for `problem` on `device` until the study holds `trials` evaluated trials.

    Resumes a study of the same name (trials a killed run left RUNNING are failed first); records every
    trial; re-times the best `top_k` configs interleaved with the baseline and stores the winner.

    `gpus` runs one search process per listed CUDA device on the same study (under the interpreter, as
    many search processes on the CPU; see autotile.tune.processes); several processes (hosts) with the same `storage_url` share one study the
    same way, and together stop at `trials`.
    `isolate` runs each trial in a worker process that a crash or a hang (past `trial_timeout`
    seconds) costs one trial; the default is on for GPUs and off under the interpreter.
    `compile_ahead` compiles the next `lookahead` asked configs in a pool of CPU processes while the
    GPU times the current one (a no-op under the interpreter).
    `warm_start` starts a new study from the winners and best configs of the nearest tuned problems in the
    database (autotile.tune.warmstart). `prune` skips configs the roofline model rules out once a few trials
    are in (autotile.tune.prune; GPUs with a profile only). `patience` stops the search after that many
    evaluated trials without improvement once the vendor op is beaten or out of reach.
    `simulate` (a simulate.TimingTable, or a database or table file holding one) replays stored timings
    instead of running anything (autotile.tune.simulate); the study then lives in a throwaway database.
    `session` (an autotile.tune.session.TuneSession; by default the one open in this thread, if any) lends the
    trial worker and compile-ahead pool, kept across the problems of a run; without one, the search starts
    its own and stops them when it ends.

    >>> from autotile.families.gemm import FAMILY, GemmProblem
    >>> from autotile.device import interpret_device
    >>> r = tune_problem(FAMILY, GemmProblem(16, 32, 32, "fp32", "fp32"), interpret_device(),
    ...                  trials=2, db_url="sqlite:////tmp/tuning.sqlite")  # doctest: +SKIP
    """
    _refuse_empty(family, problem)
    started = time.monotonic()
    table, space, warm_source, vendor_ms = _table, _space, _warm_source, _vendor_ms
    if simulate is not None:
        return _simulate(family, problem, device, simulate, trials=trials, timeout=timeout, seed=seed,
                         warm_start=warm_start, prune=prune, patience=patience, progress=progress)
    refusal = family.interpreter_refusal(problem) if device.interpret else None
    if refusal:
        raise TuneError(refusal)
    for url in (db_url, storage_url):
        if url and not is_journal(url) and _in_memory(url):
            raise TuneError(f"{url}: a study lives in a database its searches and reruns can reopen; give --db "
                            "(and --storage) a SQLite file or a server URL, not an in-memory database")
    isolate = (not device.interpret) if isolate is None else isolate
    session = session if session is not None else current_session()
    trial_timeout = trial_timeout or default_trial_timeout(device)
    # The trial worker (isolated trials) and the compile pool start first: the worker's start-up (spawn, imports,
    # CUDA context, inputs; ~11 s on the H200 machines) runs while this process opens the database and the study,
    # and the pool compiles the default config meanwhile.
    early = not gpus and table is None
    # Without a session, the search's worker and pool are this call's: they stop in the background while the
    # finalists are re-timed (an in-process search that stopped its own pool waited ~2 s for running compiles).
    private = TuneSession() if session is None and not gpus and table is None else None
    session = private or session
    default = family.default_config(problem, device)
    try:
        if early:
            session.prestart(family, problem, device, seed, trial_timeout, compile_ahead, first_configs=[default],
                             isolate=isolate)
        cuda_warm = _warm_cuda(device) if table is None and not device.interpret else None
        db_url = _given_url(db_url)
        engine = open_engine(db_url, create=True)
        name = study_name(family, problem, device)
        study_url, rows_complete = _study_url(storage_url, db_url, engine, name)
        store = Store(engine)
        storage = given_storage(study_url) if storage_url is not None else own_storage(study_url)
        device_id = store.ensure_device(device)
        toolchain_id = store.ensure_toolchain()
        problem_id = store.ensure_problem(family, problem)
        # This device's winners of another torch, Triton, CUDA or driver, of every family: marked stale (`autotile list`
        # shows it).
        mark_stale(store, device)

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        if storage_url is not None:
            study = open_study(storage, name)
        else:
            study, storage = create_own_study(storage, study_url, name)
        study.set_user_attr("family", family.name)
        study.set_user_attr("problem_key", family.problem_key(problem))
        space = space if space is not None else family.space(problem, device)
        warm = None
        enqueued: list[Config] = []
        if not study.trials:
            _number_after_recorded(study, store.recorded_trial_numbers(name))
            enqueued.append(default)
            if warm_start:
                warm = _warm_start(warm_source or engine, family, problem, device, space)
                enqueued.extend(warm.configs)
            enqueued.extend(family.seed_configs(problem, device))
            for config in enqueued:
                study.enqueue_trial(dict(config), skip_if_exists=True)
        failed = fail_stale_trials(study)
        if failed:
            log.info("%s: %d trials a stopped run left running were marked failed", name, len(failed))

        plan = _SearchPlan(
            family=family, problem=problem, space=space, engine=engine, store=store,
            storage=storage, name=name, ids=(problem_id, device_id, toolchain_id), trials=trials,
            deadline=None if timeout is None else started + timeout, timeout=timeout, seed=seed, isolate=isolate,
            trial_timeout=trial_timeout, compile_ahead=compile_ahead,
            lookahead=lookahead, distributed=storage_url is not None, progress=progress,
            rows_complete=rows_complete, prune=prune, patience=patience, vendor_ms=vendor_ms, table=table,
            first_configs=tuple(enqueued),
        )
        if not gpus:
            targets = [(None, device)]
        elif device.interpret:  # one search per listed index, all on the CPU: the multi-GPU path, testable anywhere
            targets = [(None, device) for _ in gpus]
        else:
            targets = [(g, _device_for_gpu(device, g)) for g in gpus]
        # A study that already holds the target runs no search (the worker started early stops unused): it only
        # re-times.
        already_complete = len(evaluated_trials(engine, study, name, plan.rows_complete)) >= trials
        # Ctrl-C, like --timeout, ends the search, not the run: the best of the trials so far is re-timed and stored.
        shared = _SharedState(best=best_recorded(plan))
        with CtrlC() as ctrl_c:
            ctrl_c.stops(shared.stop)
            if not already_complete and len(targets) == 1:
                _Search(plan, 0, *targets[0], shared, session=session).run()
            elif not already_complete:
                shared = run_search_processes(plan, targets, db_url, study_url, ctrl_c, session=session)
        if shared.error is not None:
            raise shared.error  # a second Ctrl-C raises its KeyboardInterrupt here: stop at once, store nothing
        interrupted = ctrl_c.pressed
    except BaseException:
        if private is not None:
            private.close()
        raise
    # The private worker and pool stop while the finalists are re-timed: a worker's exit took 1-3 s (the pool's
    # processes are terminated, compiles and all).
    closing = _close_in_background(private) if private is not None else None
    if cuda_warm is not None:
        cuda_warm.join()  # this process re-times the finalists next
    try:
        result = _pick_winner(family, problem, device, store, problem_id, device_id, toolchain_id, top_k,
                              retime_rounds, name, seed, crashed=shared.context_lost)
    finally:
        if closing is not None:
            closing.join()
    result.statuses = store.status_counts(name)
    result.trials_this_run = shared.this_run
    result.seconds = time.monotonic() - started
    result.stopped_early = "interrupted (Ctrl-C)" if interrupted else shared.stopped
    result.already_complete, result.interrupted = already_complete, interrupted
    result.pruned, result.never_measured = shared.pruned, shared.never_measured
    result.warm_start = warm.describe(family) if warm is not None else ""
    if shared.pruned:
        log.info("%s: the roofline model dropped %d proposals before compiling", name, shared.pruned)
    return result


def _number_after_recorded(study: optuna.Study, recorded: set[int]) -> None:
    """A study that starts again while the database holds rows of its name (its journal was moved aside as damaged,
    or the database was copied without its journal): Optuna numbers its trials from 0 again, and a trial's number
    keys its row, so the new trials take numbers after the recorded ones. Failed placeholders fill the gap (the
    sampler skips them; the search knows the recorded configs from their rows, and does not run them again)."""
    if recorded:
        log.info("%s: the study starts again beside %d recorded trials; its trials are numbered after them",
                 study.study_name, len(recorded))
        study.add_trials([optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL)
                          for _ in range(max(recorded) + 1)])


def _refuse_empty(family: Family, problem) -> None:
    """A problem with a shape field below 1 (what a call on empty tensors runs) has nothing to time, and
    `autotile db import` refuses its winner: refuse it before a study or a row is made for it."""
    from autotile.tune.plan import empty_shape_fields

    empty = empty_shape_fields(family, problem)
    if empty:
        raise ShapeMismatchError(f"{family.name} problem with {', '.join(empty)}: nothing to time, so nothing to "
                                 "tune; give every shape field a value of 1 or more")


def _close_in_background(session: TuneSession):
    """Close `session` in a thread; returns the thread to join."""
    import threading

    def close() -> None:
        try:
            session.close()
        except Exception as exc:  # noqa: BLE001 - the winner does not depend on how its workers ended
            log.warning("stopping the trial worker or compile pool failed: %s", exc)

    thread = threading.Thread(target=close, name="autotile-session-close")
    thread.start()
    return thread


def _warm_cuda(device: DeviceInfo):
    """Create this process's CUDA context and cuBLAS handle in a thread while the search runs (the final
    re-timing runs here, and its first CUDA call took ~1 s); returns the thread to join."""
    import threading

    def warm() -> None:
        try:
            import torch

            a = torch.ones(8, 8, device=torch.device("cuda", device.index or 0))
            (a @ a).sum().item()
        except Exception as exc:  # noqa: BLE001 - the re-timing meets the same error and reports it
            log.debug("warming CUDA up failed: %s", exc)

    thread = threading.Thread(target=warm, name="autotile-cuda-warm-up", daemon=True)
    thread.start()
    return thread


def _warm_start(source, family: Family, problem, device: DeviceInfo, space):
    """Warm-start configs from a database engine, or (simulation) from a table source."""
    from autotile.tune.warmstart import warm_start as from_database

    if isinstance(source, str):
        from autotile.tune.simulate import warm_start_from_tables

        return warm_start_from_tables(source, family, problem, device, space)
    return from_database(source, family, problem, device, space)


def _simulate(family: Family, problem, device: DeviceInfo, source, *, trials: int, timeout: float | None, seed: int,
              warm_start: bool, prune: bool, patience: int | None, progress) -> TuneResult:
    """tune_problem on a timing table: the same search, every trial answered from the table (see simulate.py)."""
    import tempfile

    from autotile.tune.simulate import TimingTable, load_table, simulated_space

    table = source if isinstance(source, TimingTable) else load_table(source, family, problem,
                                                                       None if device.interpret else device.key)
    warm_source = table.source or None
    device = table.device
    space = simulated_space(family.space(problem, device), table)
    with tempfile.TemporaryDirectory(prefix="autotile-simulate-") as scratch:
        result = tune_problem(
            family, problem, device, trials=trials, timeout=timeout, db_url=f"sqlite:///{scratch}/simulated.sqlite",
            seed=seed, retime_rounds=0, progress=progress, isolate=False, compile_ahead=False, lookahead=0,
            warm_start=warm_start and warm_source is not None, prune=prune, patience=patience,
            _table=table, _space=space, _warm_source=warm_source, _vendor_ms=table.best_vendor_ms)
    result.simulated = True
    return result


def _given_url(db_url: str | None) -> str:
    # The URL as given, not the engine's: rendering one escapes characters of file paths, e.g. '(' as %28.
    return normalise_url(db_url) if db_url else default_db_url()


def _study_url(storage_url: str | None, db_url: str, engine, name: str) -> tuple[str, bool]:
    """Where the Optuna study `name` lives, and whether the database's trial rows alone count its evaluated trials.

    `--storage` when given; else its own journal file beside a SQLite database (autotile.tune.storage says why),
    unless an older autotile kept this study in the database itself (its rerun resumes there); else the
    database (a server).
    """
    if storage_url is not None:
        return storage_url, normalise_url(storage_url) == db_url
    journal = study_journal(db_url, name)
    if journal is None or _study_in_database(engine, name):
        return db_url, True
    return journal, True


def _study_in_database(engine, name: str) -> bool:
    """Whether Optuna's tables in autotile's database hold the study `name`."""
    from sqlalchemy import inspect, text

    if not inspect(engine).has_table("studies"):
        return False
    with engine.connect() as conn:
        return conn.execute(text("SELECT 1 FROM studies WHERE study_name = :name"), {"name": name}).first() is not None


def _in_memory(url: str) -> bool:
    parsed = make_url(normalise_url(url))
    if parsed.get_backend_name() != "sqlite":
        return False
    return parsed.database in (None, "", ":memory:") or "mode=memory" in url


def _device_for_gpu(device: DeviceInfo, gpu: int) -> DeviceInfo:
    """The DeviceInfo of CUDA device `gpu`; it must be the kind of GPU the results are filed under."""
    present = cuda_device(gpu)
    if present.key != device.key:
        raise TuneError(f"--gpus: GPU {gpu} is {present.name} ({present.key}), not {device.key}; "
                        "list only GPUs of one kind")
    return present


def _stored_config(store: Store, family: Family, problem, device: DeviceInfo, problem_id: int) -> Config | None:
    """The config of the winner already stored for this problem on this device key, if it is still valid."""
    key = family.problem_key(problem)
    for winner in store.winners(family.name, device.key):
        if winner.problem_key == key:
            try:
                return family.validate_config(problem, device, Config.from_json(winner.config))
            except Exception:  # noqa: BLE001 - a stored config this version cannot run is simply not a finalist
                return None
    return None


def _check_vendor(family: Family, problem, device: DeviceInfo, store: Store, ids: tuple[int, int, int], name: str,
                  prepared) -> list[Config]:
    """Run each vendor config through the correctness gate, as any candidate; record one row each; the passing ones."""
    problem_id, device_id, toolchain_id = ids
    passing = []
    first = next_vendor_number(store, name)  # after the rows of the timing before the first trial
    for number, config in enumerate(family.vendor_configs(problem, device), start=first):
        outcome, _ = run_checked(family, problem, config, device, seed=0, prepared=prepared)
        if outcome.status is Status.OK:
            passing.append(config)
        else:
            store.record_trial(problem_id=problem_id, device_id=device_id, toolchain_id=toolchain_id,
                               study=vendor_study(name), number=number, config=config.to_json(),
                               config_hash=config.hash, status=outcome.status.value, interpreted=int(device.interpret),
                               max_abs_error=outcome.max_abs_error, error=outcome.error)
    return passing


def _record_vendor_timings(family: Family, problem, device: DeviceInfo, store: Store, ids: tuple[int, int, int],
                           name: str, vendor: list[Config], timings: dict) -> None:
    problem_id, device_id, toolchain_id = ids
    first = next_vendor_number(store, name)
    for number, config in enumerate(family.vendor_configs(problem, device), start=first):
        timing = timings.get(config.hash)
        if config in vendor and timing is not None:
            store.record_trial(problem_id=problem_id, device_id=device_id, toolchain_id=toolchain_id,
                               study=vendor_study(name), number=number, config=config.to_json(),
                               config_hash=config.hash, status=Status.OK.value, median_ms=timing.median_ms,
                               q20_ms=timing.q20_ms, q80_ms=timing.q80_ms, interpreted=int(device.interpret))


def verify_range(family: Family, problem, config: Config, vendor: Config, device: DeviceInfo,
                 rounds: int = RANGE_ROUNDS, seed: int = 0) -> tuple[dict | None, str]:
    """Re-time `config` beside the vendor op at the corners of `problem`'s serving bucket.

    Returns ({field: [lo, hi]}, note) when the config is correct and at least as fast as the vendor at every
    corner, else (None, why): the winner then serves its own shape only.
    """
    bounds = family.serving_range(problem)
    if not bounds:
        return None, "the family has no serving fields"
    for edge in family.range_edges(problem):
        try:
            edge_config = family.validate_config(edge, device, config)
        except Exception as exc:  # noqa: BLE001
            return None, f"not a config of {family.problem_key(edge)}: {exc}"
        try:
            inputs, expected = prepare(family, edge, device, seed)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory at the high corner
            return None, f"inputs at {family.problem_key(edge)}: {type(exc).__name__}: {exc}"
        for candidate in (edge_config, vendor):
            outcome, _ = run_checked(family, edge, candidate, device, seed, (inputs, expected))
            if outcome.status is not Status.OK:
                return None, f"{candidate.to_json()} at {family.problem_key(edge)}: {outcome.status.value}"
        outputs = {c.hash: family.allocate_outputs(edge, inputs) for c in (edge_config, vendor)}
        fns = {c.hash: family.timed_call(edge, c, inputs, outputs[c.hash]) for c in (edge_config, vendor)}
        try:
            timings = retime_interleaved(fns, device, rounds=rounds)
        except Exception as exc:  # noqa: BLE001
            return None, f"re-timing at {family.problem_key(edge)} failed: {exc}"
        ours, theirs = timings[edge_config.hash].median_ms, timings[vendor.hash].median_ms
        if ours > theirs:
            return None, f"{ours:.4g} ms against the vendor's {theirs:.4g} ms at {family.problem_key(edge)}"
    return {name: [lo, hi] for name, (lo, hi) in bounds.items()}, "faster than the vendor op at every corner"


def _pick_winner(family: Family, problem, device: DeviceInfo, store: Store, problem_id: int, device_id: int,
                 toolchain_id: int, top_k: int, rounds: int, name: str, seed: int, crashed: bool,
                 compare_again: int = 2) -> TuneResult:
    """Re-time the best few configs, the stored winner and the vendor op in turns; the fastest median wins.

    The re-timing is a race (autotile.tune.retime): a candidate far behind the leader after a round leaves it.

    The vendor op (cuBLAS, SDPA) is a candidate like any config: checked, timed, stored as the winner when it is
    fastest. A generated winner is then re-timed beside it at the corners of its serving bucket, and the range
    it held there is stored with it.

    Where another process stored a winner for the problem while this one compared (two tunes of one problem at
    once), the comparison runs again beside it (`compare_again` times; then this one's result is stored).
    """
    result = TuneResult(family.name, family.problem_key(problem), device.key, name, None, None,
                        interpreted=device.interpret)
    ids = (problem_id, device_id, toolchain_id)
    # The study's trials on every device row of its key (a driver update makes a new row mid-study).
    finalists = [Config(json.loads(text)) for text, _ in store.best_configs(problem_id, None, top_k, study=name)]
    if not finalists:
        return result
    # What this comparison is against: save_winner writes only if it is still what is stored.
    replaces = store.winner_hash(problem_id, device.key) if compare_again > 0 else ANY_WINNER
    stored = _stored_config(store, family, problem, device, problem_id)
    if crashed:
        rounds = 0  # the CUDA context is gone; keep the trial timings
    timings = {}
    baseline_name = ""
    vendor: list[Config] = []
    if rounds > 0:
        try:
            prepared = prepare(family, problem, device, seed)
            vendor = _check_vendor(family, problem, device, store, ids, name, prepared)
            candidates = list(dict.fromkeys(finalists + ([stored] if stored is not None else []) + vendor))
            inputs = prepared[0]
            outputs = {c.hash: family.allocate_outputs(problem, inputs) for c in candidates}
            fns = {c.hash: family.timed_call(problem, c, inputs, outputs[c.hash]) for c in candidates}
            baseline = None if vendor else family.baseline(problem, inputs)
            if baseline is not None:
                fns["baseline"] = baseline.run
                baseline_name = baseline.name
            timings = race(fns, device, rounds=rounds)
            _record_vendor_timings(family, problem, device, store, ids, name, vendor, timings)
        except Exception as exc:  # noqa: BLE001 - a finalist or the baseline failed on re-run
            log.warning("interleaved re-timing failed (%s); using trial timings", exc)
            timings, vendor = {}, []
    if timings:
        ranked = sorted((c for c in timings if c != "baseline"), key=lambda h: timings[h].median_ms)
        by_hash = {c.hash: c for c in finalists + vendor + ([stored] if stored is not None else [])}
        best = by_hash[ranked[0]]
        if stored is not None and best != stored and stored.hash in timings and \
                timings[best.hash].median_ms > timings[stored.hash].median_ms * (1.0 - KEEP_STORED_MARGIN):
            best = stored  # not faster beyond the noise: the stored winner stays
        win = timings[best.hash]
        others = [timings[h].median_ms for h in ranked if h != best.hash]
        runner_up = others[0] if others else None
        kernels = [h for h in ranked if not is_vendor(by_hash[h])]
        best_kernel = by_hash[kernels[0]] if kernels else None
        if vendor:
            fastest_vendor = min(vendor, key=lambda c: timings[c.hash].median_ms)
            baseline_ms = timings[fastest_vendor.hash].median_ms
            baseline_name = vendor_label(fastest_vendor)
        else:
            fastest_vendor = None
            baseline_ms = timings["baseline"].median_ms if "baseline" in timings else None
    else:
        trial_ms = dict(store.best_configs(problem_id, None, top_k, study=name))
        best = finalists[0]
        ms = trial_ms[best.to_json()]
        from autotile.bench import Timing

        win = Timing(ms, ms, ms, device.interpret)
        runner_up = trial_ms.get(finalists[1].to_json()) if len(finalists) > 1 else None
        baseline_ms, best_kernel, fastest_vendor = None, best, None

    verified_range, range_note = None, ""
    if fastest_vendor is not None:
        if is_vendor(best):
            verified_range = {k: list(v) for k, v in family.serving_range(problem).items()}
            range_note = "the vendor op serves its whole bucket"
        else:
            verified_range, range_note = verify_range(family, problem, best, fastest_vendor, device, seed=seed)
    total = sum(store.status_counts(name).values())
    kernel_values = {}
    if is_vendor(best) and best_kernel is not None:
        kernel_values = {"kernel_config": best_kernel.to_json(), "kernel_ms": timings[best_kernel.hash].median_ms}
    saved = store.save_winner(
        problem_id=problem_id, device=device, device_id=device_id, toolchain_id=toolchain_id, replaces=replaces,
        config=best.to_json(), config_hash=best.hash, median_ms=win.median_ms, q20_ms=win.q20_ms,
        q80_ms=win.q80_ms, interpreted=int(device.interpret), runner_up_ms=runner_up,
        margin=(runner_up / win.median_ms - 1.0) if runner_up else None, baseline_name=baseline_name,
        baseline_ms=baseline_ms, trials_run=total, verified_range=verified_range, **kernel_values,
        provenance=(f"study {name}: {total} trials; best {len(finalists)} re-timed with the vendor op and the stored "
                    f"winner over up to {rounds} interleaved rounds" + (f"; range: {range_note}" if range_note else "")),
    )
    if not saved:
        log.info("another tuner stored a winner for %s meanwhile: comparing again beside it", result.problem_key)
        return _pick_winner(family, problem, device, store, problem_id, device_id, toolchain_id, top_k, rounds, name,
                            seed, crashed, compare_again - 1)
    from autotile.runtime.dispatch import clear_cache

    clear_cache()  # explain() and the ops in this process see the new winner
    result.winner, result.winner_ms = best, win.median_ms
    result.winner_q20_ms, result.winner_q80_ms = win.q20_ms, win.q80_ms
    result.runner_up_ms, result.baseline_name, result.baseline_ms = runner_up, baseline_name, baseline_ms
    result.verified_range = verified_range
    return result
