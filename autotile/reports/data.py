"""The report model: everything a report shows, gathered from one autotile database and nothing else.

`build_report(db_url)` reads the winners, every recorded trial and its status,
and (when the Optuna study lives in a reachable storage) the parameter
importance of each study. The writers (html, markdown, csv, json) only format
this model; they never touch the database.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import warnings
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from autotile.device import PROFILES
from autotile.families.base import is_vendor, vendor_label
from autotile.store.db import default_db_url, normalise_url, open_engine, reading, safe_url
from autotile.store.marks import winner_mark
from autotile.store.models import Device, Problem, Trial
from autotile.store.repo import Store, WinnerView

# Version of the report's JSON format (autotile/reports/report.schema.json).
REPORT_FORMAT_VERSION = 1
# Distinct configs listed per problem in the "top configs" table.
TOP_CONFIGS = 5
# Parameter importance is fitted to the passing trials; with ~11 axes and timings that repeat within
# ~9% (DESIGN.md), a handful of trials gives numbers fitted to noise. PED-ANOVA compares the top 10% of
# trials with the rest, so 20 passing trials are the fewest that put two trials in that top group.
MIN_TRIALS_FOR_IMPORTANCE = 20
INTERPRET_KEY = "interpret"


@dataclass(frozen=True)
class Ceilings:
    """What the device can do, from its GPU profile (autotile.device.PROFILES)."""

    profile: str
    peak_tflops: dict[str, float]
    copy_tbps: float
    note: str


@dataclass(frozen=True)
class DeviceSummary:
    key: str
    name: str
    interpret: bool
    ceilings: Ceilings | None  # None for the interpreter and for GPUs without a profile


@dataclass(frozen=True)
class Performance:
    """The winner against the roofline: work from Family.cost(problem), time from the winner's median."""

    flops: float
    bytes: float
    intensity: float  # FLOPs per byte
    tflops: float
    tbps: float
    peak_dtype: str | None  # the problem's dtype whose compute peak applies; None when the profile has none
    peak_tflops: float | None
    copy_tbps: float | None
    attainable_tflops: float | None  # min(peak, intensity x copy bandwidth), or the bandwidth roof alone
    pct_peak_compute: float | None
    pct_copy_bandwidth: float | None
    pct_roofline: float | None


@dataclass(frozen=True)
class TopConfig:
    config: dict
    median_ms: float
    pct_of_best: float  # best median / this median x 100
    winner: bool = False  # the stored winner (listed first, whatever its trial median)


@dataclass(frozen=True)
class ConvergencePoint:
    number: int  # Optuna's trial number (pruned proposals take numbers too, so they have gaps)
    status: str
    median_ms: float | None
    best_so_far_ms: float | None
    evaluated: int = 0  # trials evaluated up to and including this one: the plots' x-axis


@dataclass(frozen=True)
class Importance:
    evaluator: str
    params: dict[str, float]  # parameter -> share of importance (sums to 1), most important first
    note: str = ""  # why there are no numbers, when there are none


@dataclass(frozen=True)
class Winner:
    config: dict
    median_ms: float
    q20_ms: float
    q80_ms: float
    spread_pct: float  # (q80 - q20) / median x 100
    margin_pct: float | None  # runner-up over winner, in percent
    provenance: str
    toolchain: dict
    created_at: str
    vendor: str | None = None  # the library call when the vendor op won (cuBLAS, SDPA), else None
    verified_range: dict | None = None  # {serving field: [lo, hi]} the winner was verified to serve
    mark: str = ""  # what db verify, tune --stale or a toolchain change found on it (autotile.store.marks); '' for none


@dataclass(frozen=True)
class Baseline:
    name: str
    median_ms: float
    speedup: float  # baseline time / winner time


@dataclass(frozen=True)
class ProblemReport:
    family: str
    device_key: str
    problem_key: str
    params: dict
    label: str
    interpreted: bool
    winner: Winner | None  # None when no trial passed the correctness check
    baseline: Baseline | None
    performance: Performance | None
    trials_total: int
    statuses: dict[str, int]
    top_configs: list[TopConfig]
    convergence: list[ConvergencePoint]
    importance: Importance
    study: str


@dataclass(frozen=True)
class Report:
    format_version: int
    generated_at: str
    database: str
    family_filter: str | None
    device_filter: str | None
    devices: list[DeviceSummary]
    problems: list[ProblemReport]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain JSON-ready data, in the shape report.schema.json documents."""
        return dataclasses.asdict(self)


def ceilings_for(device_key: str) -> Ceilings | None:
    """The GPU profile behind a device key ('h200/sm90' -> the h200 profile); None for the interpreter.

    >>> ceilings_for("h200/sm90").copy_tbps > 0
    True
    >>> ceilings_for("interpret") is None
    True
    """
    profile = PROFILES.get(device_key.split("/")[0])
    if profile is None or device_key == INTERPRET_KEY or not (profile.peak_tflops or profile.copy_tbps):
        return None
    return Ceilings(profile.name, dict(profile.peak_tflops), profile.copy_tbps, profile.note)


def performance(flops: float, moved_bytes: float, median_ms: float, dtype: str | None,
                ceilings: Ceilings | None) -> Performance:
    """Throughput of one timing and where it sits under the device's ceilings.

    >>> p = performance(2e12, 1e9, 10.0, "bf16", ceilings_for("h200/sm90"))
    >>> round(p.tflops), round(p.intensity), p.peak_dtype
    (200, 2000, 'bf16')
    """
    seconds = median_ms * 1e-3
    tflops = flops / seconds / 1e12
    tbps = moved_bytes / seconds / 1e12
    intensity = flops / moved_bytes if moved_bytes else float("inf")
    peak = ceilings.peak_tflops.get(dtype) if ceilings and dtype else None
    copy = ceilings.copy_tbps if ceilings and ceilings.copy_tbps else None
    roofs = [r for r in (peak, intensity * copy if copy else None) if r]
    attainable = min(roofs) if roofs else None
    return Performance(
        flops=flops, bytes=moved_bytes, intensity=intensity, tflops=tflops, tbps=tbps,
        peak_dtype=dtype if peak else None, peak_tflops=peak, copy_tbps=copy, attainable_tflops=attainable,
        pct_peak_compute=100.0 * tflops / peak if peak else None,
        pct_copy_bandwidth=100.0 * tbps / copy if copy else None,
        pct_roofline=100.0 * tflops / attainable if attainable else None,
    )


def convergence(trials: list[dict]) -> list[ConvergencePoint]:
    """Best median so far after each evaluated trial, in Optuna's trial order; failed trials keep the best so far.

    `evaluated` counts the trials themselves: Optuna's numbers also count proposals that were pruned before
    they ran (infeasible or repeated configs), which would stretch the x-axis with trials that never ran.

    >>> [(p.evaluated, p.best_so_far_ms) for p in convergence([
    ...     {"number": 4, "status": "ok", "median_ms": 2.0}, {"number": 0, "status": "ok", "median_ms": 3.0},
    ...     {"number": 9, "status": "crash", "median_ms": None}])]
    [(1, 3.0), (2, 2.0), (3, 2.0)]
    """
    points, best = [], None
    for evaluated, t in enumerate(sorted(trials, key=lambda t: t["number"]), start=1):
        ms = t["median_ms"] if t["status"] == "ok" else None
        if ms is not None and (best is None or ms < best):
            best = ms
        points.append(ConvergencePoint(t["number"], t["status"], ms, best, evaluated))
    return points


def top_configs(trials: list[dict], limit: int = TOP_CONFIGS, winner: tuple[dict, float] | None = None
                ) -> list[TopConfig]:
    """The fastest distinct configs that passed, each by its best trial median, with percent of the best.

    `winner` (its config, and its median for when no trial of it is among `trials`) is listed first: the
    re-timing that picked it may rank it above a config with a faster single trial.

    >>> [c.pct_of_best for c in top_configs([
    ...     {"status": "ok", "median_ms": 2.0, "config": {"B": 1}}, {"status": "ok", "median_ms": 1.0, "config": {"B": 2}},
    ...     {"status": "ok", "median_ms": 4.0, "config": {"B": 1}}])]
    [100.0, 50.0]
    >>> [(c.config, c.winner) for c in top_configs([{"status": "ok", "median_ms": 1.0, "config": {"B": 2}}],
    ...                                            winner=({"B": 1}, 1.5))]
    [({'B': 1}, True), ({'B': 2}, False)]
    """
    best: dict[str, tuple[float, dict]] = {}
    for t in trials:
        if t["status"] != "ok" or t["median_ms"] is None:
            continue
        key = json.dumps(t["config"], sort_keys=True)
        if key not in best or t["median_ms"] < best[key][0]:
            best[key] = (t["median_ms"], t["config"])
    ranked = sorted(best.values(), key=lambda item: item[0])
    first: list[tuple[float, dict, bool]] = []
    if winner is not None:
        key = json.dumps(winner[0], sort_keys=True)
        first = [(best[key][0] if key in best else winner[1], winner[0], True)]
        ranked = [item for item in ranked if json.dumps(item[1], sort_keys=True) != key]
    shown = (first + [(ms, config, False) for ms, config in ranked])[:limit]
    if not shown:
        return []
    fastest = min(ms for ms, _, _ in shown)
    return [TopConfig(config, ms, 100.0 * fastest / ms, won) for ms, config, won in shown]


def problem_labels(problems: list[tuple[str, dict]]) -> list[str]:
    """Short labels: per family its shape fields (m n k, seq lengths, ...), then the other fields whose values
    differ between its problems (all the set ones for a lone problem).

    >>> problem_labels([("gemm", {"m": 64, "n": 64, "k": 32, "dtype": "bf16"}),
    ...                 ("gemm", {"m": 128, "n": 64, "k": 32, "dtype": "fp16"})])
    ['m=64 n=64 k=32 dtype=bf16', 'm=128 n=64 k=32 dtype=fp16']
    """
    by_family: dict[str, list[dict]] = {}
    for family, params in problems:
        by_family.setdefault(family, []).append(params)
    shown: dict[str, list[str]] = {}
    for family, rows in by_family.items():
        keys = list(rows[0])
        shape = [k for k in _shape_fields(family) if k in keys]
        differ = [k for k in keys if k not in shape and len({json.dumps(r.get(k)) for r in rows}) > 1]
        if not differ and not shape:
            differ = [k for k in keys if rows[0][k] not in ("", None, False)]
        shown[family] = shape + differ
    return [" ".join(f"{k}={params.get(k)}" for k in shown[family]) for family, params in problems]


def _shape_fields(family: str) -> tuple[str, ...]:
    from autotile.families import family_names, get_family

    return get_family(family).shape_fields if family in family_names() else ()


class _ImportanceSource:
    """Parameter importance of stored Optuna studies, through Optuna's public API only."""

    EVALUATOR = "PED-ANOVA (optuna.importance.PedAnovaImportanceEvaluator)"

    def __init__(self, storage_url: str):
        self.storage_url = storage_url
        self._storage = None
        self._error = ""

    def _storage_of(self, study: str):
        """The study's own journal beside a SQLite database when there is one (autotile.tune.storage), else the
        storage at the URL (a database's Optuna tables, or a journal named with --storage)."""
        from autotile.tune.storage import is_journal, journal_path, journal_storage, study_journal

        if is_journal(self.storage_url):
            return journal_storage(self.storage_url) if journal_path(self.storage_url).exists() else None
        journal = study_journal(self.storage_url, study)
        if journal is not None and journal_path(journal).exists():
            return journal_storage(journal)
        return self._open()

    def _not_found(self, study: str) -> str:
        from autotile.tune.storage import is_journal

        if is_journal(self.storage_url):
            return f"skipped: study {study} is not in the journal {self.storage_url}"
        return (f"skipped: study {study} is neither in a journal beside this database (its .studies folder) nor "
                f"in the database itself (copied without that folder, or tuned with --storage elsewhere?)")

    def _open(self):
        if self._storage is None and not self._error:
            import optuna

            try:
                # skip_table_creation: a report never writes Optuna's tables into a database that lacks them.
                self._storage = optuna.storages.RDBStorage(self.storage_url, skip_table_creation=True)
            except Exception as exc:  # noqa: BLE001 - no Optuna tables there (or unreadable): a note in the report
                self._error = f"no Optuna storage readable at the database URL ({type(exc).__name__})"
        return self._storage

    def importance(self, study: str, completed: int) -> Importance:
        if completed < MIN_TRIALS_FOR_IMPORTANCE:
            return Importance(self.EVALUATOR, {}, f"hidden: {completed} trials passed; below "
                                                  f"{MIN_TRIALS_FOR_IMPORTANCE} the shares would be fitted to "
                                                  "timing noise")
        storage = self._storage_of(study)
        if storage is None:
            return Importance(self.EVALUATOR, {}, self._not_found(study))
        import optuna

        try:
            loaded = optuna.load_study(study_name=study, storage=storage)
            # NOTE: PED-ANOVA is marked experimental in Optuna; the warning says nothing the report should show.
            # It is used rather than Optuna's default fANOVA because that one needs scikit-learn.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                evaluator = optuna.importance.PedAnovaImportanceEvaluator()
                values = optuna.importance.get_param_importances(loaded, evaluator=evaluator)
        except KeyError:
            return Importance(self.EVALUATOR, {}, self._not_found(study))
        except Exception as exc:  # noqa: BLE001 - a study Optuna cannot evaluate still gets its report
            return Importance(self.EVALUATOR, {}, f"skipped: Optuna could not evaluate the study ({exc})")
        ranked = dict(sorted(values.items(), key=lambda kv: -kv[1]))
        return Importance(self.EVALUATOR, {k: float(v) for k, v in ranked.items()})


def _trials_by_problem(engine, family: str | None, device_key: str | None) -> dict[tuple[str, str], list[dict]]:
    """Every recorded trial, keyed by (problem key, device key), each with its study and Optuna trial number."""
    query = (select(Trial, Problem.family, Problem.key, Problem.params, Device.key)
             .join(Problem, Trial.problem_id == Problem.id).join(Device, Trial.device_id == Device.id))
    if family:
        query = query.where(Problem.family == family)
    if device_key:
        query = query.where(Device.key == device_key)
    grouped: dict[tuple[str, str], list[dict]] = {}
    with Session(engine) as session:
        for trial, fam, key, params, dev in session.execute(query.order_by(Trial.study, Trial.number)).all():
            grouped.setdefault((key, dev), []).append({
                "id": trial.id, "family": fam, "params": dict(params), "study": trial.study, "number": trial.number,
                "config": json.loads(trial.config), "status": trial.status, "median_ms": trial.median_ms,
                "interpreted": bool(trial.interpreted),
            })
    return grouped


def _device_names(engine) -> dict[str, str]:
    with Session(engine) as session:
        return {key: name for key, name in session.execute(select(Device.key, Device.name)).all()}


def _cost(family_name: str, params: dict):
    from autotile.families import get_family

    family = get_family(family_name)
    return family.cost(family.problem_from_dict(params))


def build_report(db_url: str | None = None, *, family: str | None = None, device: str | None = None,
                 storage_url: str | None = None, now: dt.datetime | None = None) -> Report:
    """Gather the report of one database (AUTOTILE_DB when `db_url` is None), optionally one family / device key.

    `storage_url` is where the Optuna studies live when they were tuned with `--storage`; by default the
    database itself.

    >>> report = build_report("sqlite:////tmp/tuning.sqlite", family="gemm")  # doctest: +SKIP
    >>> [(p.label, p.winner.median_ms) for p in report.problems]  # doctest: +SKIP
    [('m=512 n=512 k=512', 0.0123)]
    """
    engine = open_engine(db_url, create=False, read_only=True)
    url = normalise_url(db_url) if db_url else default_db_url()  # as given: rendering escapes '(' in paths
    with reading(url):
        winners: dict[tuple[str, str], WinnerView] = {
            (w.problem_key, w.device_key): w for w in Store(engine).winners(family, device)}
        trials = _trials_by_problem(engine, family, device)
        names = _device_names(engine)
    keys = sorted(set(winners) | set(trials), key=lambda k: (_family_of(k, winners, trials), k[1], k[0]))
    importance = _ImportanceSource(storage_url or url)
    notes: list[str] = []
    devices = {k[1]: DeviceSummary(k[1], names.get(k[1], k[1]), k[1] == INTERPRET_KEY, ceilings_for(k[1]))
               for k in keys}
    for summary in devices.values():
        if summary.interpret:
            notes.append("device 'interpret': timings are Triton CPU-interpreter timings, not GPU timings; "
                         "no ceilings apply")
        elif summary.ceilings is None:
            notes.append(f"device {summary.key}: no GPU profile with ceilings, so no roofline percentages")
    params_of = {k: (winners[k].params if k in winners else trials[k][0]["params"]) for k in keys}
    families = {k: _family_of(k, winners, trials) for k in keys}
    labels = problem_labels([(families[k], params_of[k]) for k in keys])
    problems = []
    for key, label in zip(keys, labels):
        rows = trials.get(key, [])
        problems.append(_problem_report(key, families[key], params_of[key], label, winners.get(key), rows,
                                        devices[key[1]], importance, notes))
    stamp = (now or dt.datetime.now(dt.timezone.utc)).isoformat(timespec="seconds")
    return Report(REPORT_FORMAT_VERSION, stamp, safe_url(url), family, device,
                  sorted(devices.values(), key=lambda d: d.key), problems, notes)


def _search_rows(rows: list[dict]) -> list[dict]:
    """The trials of the problem's latest search: the study of its newest trial, without the vendor op's rows.

    A problem keeps the trials of earlier template versions (each a study of its own) and of the vendor op
    (study `<name>:vendor`); the convergence and the top configs are those of one search.
    """
    searches = [r for r in rows if not r["study"].endswith(":vendor")]
    if not searches:
        return []
    latest = max(searches, key=lambda r: r["id"])["study"]
    return [r for r in searches if r["study"] == latest]


def _family_of(key, winners, trials) -> str:
    return winners[key].family if key in winners else trials[key][0]["family"]


def _problem_report(key, family: str, params: dict, label: str, win: WinnerView | None, rows: list[dict],
                    device: DeviceSummary, importance: _ImportanceSource, notes: list[str]) -> ProblemReport:
    problem_key, device_key = key
    statuses = dict(sorted(Counter(r["status"] for r in rows).items()))
    interpreted = device.interpret or bool(win and win.interpreted) or any(r["interpreted"] for r in rows)
    search = _search_rows(rows)
    study = search[0]["study"] if search else ""
    winner = baseline = perf = None
    if win is not None:
        config = json.loads(win.config)
        winner = Winner(
            config=config, median_ms=win.median_ms, q20_ms=win.q20_ms, q80_ms=win.q80_ms,
            spread_pct=100.0 * (win.q80_ms - win.q20_ms) / win.median_ms if win.median_ms else 0.0,
            margin_pct=100.0 * win.margin if win.margin is not None else None, provenance=win.provenance,
            toolchain=win.toolchain, created_at=win.created_at,
            vendor=vendor_label(config) if is_vendor(config) else None, verified_range=win.verified_range,
            mark=winner_mark(win.stale, win.verify_status, win.regression))
        if win.baseline_ms:
            baseline = Baseline(win.baseline_name, win.baseline_ms, win.baseline_ms / win.median_ms)
        try:
            cost = _cost(family, params)
        except Exception as exc:  # noqa: BLE001 - a family missing here or a changed problem type
            notes.append(f"{family} {label}: no cost model ({exc}); throughput left out")
        else:
            ceilings = None if interpreted else device.ceilings
            perf = performance(cost.flops, cost.bytes, win.median_ms, params.get("dtype"), ceilings)
    completed = statuses.get("ok", 0)
    return ProblemReport(
        family=family, device_key=device_key, problem_key=problem_key, params=params, label=label,
        interpreted=interpreted, winner=winner, baseline=baseline, performance=perf,
        trials_total=len(rows) if rows else (win.trials_run if win else 0), statuses=statuses,
        top_configs=top_configs(search, winner=(winner.config, winner.median_ms) if winner else None),
        convergence=convergence(search),
        importance=importance.importance(study, completed) if study else Importance(
            _ImportanceSource.EVALUATOR, {}, "skipped: no trials recorded"),
        study=study,
    )
