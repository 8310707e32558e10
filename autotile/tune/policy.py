"""Tuning a policy, not a list: where the family's own default beats the vendor op across a range of shapes.

A served model runs shapes nobody tuned. For those the runtime calls the vendor op, unless a tuned policy
covers the call: a record that, for one set of fixed fields (dtype, layouts, epilogue) and one serving
bucket (gemm: an M bucket), the family's `default_config` was checked and re-timed beside the vendor op on
every sampled shape (each sample at both corners of the bucket) and won on all of them by at least
`margin`. Samples are grouped into regime cells (the M bucket, and power-of-two buckets of N and K); a
cell's policy serves any call whose shape fields lie in the cell's sampled ranges (M in the bucket, N and
K between the smallest and largest sampled in the cell). A cell where the default lost anywhere gets no
policy (and loses one it had): those calls keep the vendor op.

`autotile tune gemm --policy --model llama3-8b,qwen2.5-7b,phi3-mini --tokens 1,2,4,8,16` runs it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autotile.bench import Status, prepare, retime_interleaved, run_checked
from autotile.families.base import POLICY_DEFAULT, POLICY_KEY, Family, pow2_bucket, problem_to_dict
from autotile.space import Config
from autotile.store.db import open_engine
from autotile.store.repo import Store

# A policy must beat the vendor op by this much on every sample: interleaved medians of one kernel differ
# by a percent or two here, and the shapes between the samples are not timed.
POLICY_MARGIN = 0.03
POLICY_ROUNDS = 3
# A sample the vendor op runs in less than this is not evidence either way: an eager call that short is
# bound by host time, and timed as such it depends on the CPU more than on the kernel. Measured on the
# H200 machine (2026-12): F.linear costs 24-27 us of host time per call, and policy cells of 5-15 us
# kernels won and lost by +-50% between neighbouring M buckets. Such samples count as not won.
POLICY_MIN_VENDOR_MS = 0.030
POLICY_CONFIG = Config({POLICY_KEY: POLICY_DEFAULT})


@dataclass(frozen=True)
class PolicyOutcome:
    family: str
    params: dict  # the fixed fields
    verified_range: dict  # {field: [lo, hi]}
    samples: int
    min_ratio: float  # smallest vendor / default time over the samples (0 when a sample failed)
    geomean_ratio: float
    stored: bool
    worst: str  # the sample with the smallest ratio, or what failed

    def describe(self) -> str:
        verdict = "policy stored" if self.stored else "no policy (the vendor op serves)"
        rng = ", ".join(f"{k} {lo}..{hi}" for k, (lo, hi) in sorted(self.verified_range.items()))
        return (f"{self.family} {json.dumps(self.params, sort_keys=True)} [{rng}]: {self.samples} samples, min "
                f"{self.min_ratio:.3f}x, geomean {self.geomean_ratio:.3f}x of the vendor op: {verdict}; worst {self.worst}")


def _ranged_fields(family: Family) -> tuple[str, ...]:
    return tuple(dict.fromkeys(family.serving_fields + family.shape_fields))


def group_samples(family: Family, problems: Sequence) -> dict[tuple, list]:
    """Problems grouped by their fixed fields and the power-of-two bucket of every shape field (a regime cell).

    One policy per cell: its range spans the cell's serving bucket and, for the other shape fields, the
    sampled values (a policy never reaches beyond the shapes it was timed on, nor into another cell).
    """
    groups: dict[tuple, list] = {}
    ranged = _ranged_fields(family)
    for problem in problems:
        data = problem_to_dict(problem)
        fixed = tuple(sorted((k, v) for k, v in data.items() if k not in ranged))
        buckets = tuple(family.serving_bucket(name, data[name]) if name in family.serving_fields
                        else pow2_bucket(data[name]) for name in ranged)
        groups.setdefault((fixed, buckets), []).append(problem)
    return groups


def _corners(family: Family, problems: Sequence) -> list:
    """Each sample at every corner of its serving bucket, without repeats."""
    out = []
    for problem in problems:
        for corner in (0, 1):
            bounds = family.serving_range(problem)
            edge = dataclasses.replace(problem, **{name: b[corner] for name, b in bounds.items()})
            if edge not in out:
                out.append(edge)
    return out


def _time_sample(family: Family, problem, device, rounds: int, seed: int) -> tuple[float, str]:
    """vendor time / default-config time for one shape (0.0 when either fails its check), and a note."""
    vendor = family.vendor_configs(problem, device)
    if not vendor:
        return 0.0, "no vendor op"
    default = family.default_config(problem, device)
    prepared = prepare(family, problem, device, seed)
    for config in (default, vendor[0]):
        outcome, _ = run_checked(family, problem, config, device, seed, prepared)
        if outcome.status is not Status.OK:
            return 0.0, f"{config.to_json()}: {outcome.status.value}"
    inputs = prepared[0]
    outputs = {c.hash: family.allocate_outputs(problem, inputs) for c in (default, vendor[0])}
    fns = {c.hash: family.timed_call(problem, c, inputs, outputs[c.hash]) for c in (default, vendor[0])}
    timings = retime_interleaved(fns, device, rounds=rounds)
    ours, theirs = timings[default.hash].median_ms, timings[vendor[0].hash].median_ms
    if not device.interpret and theirs < POLICY_MIN_VENDOR_MS:
        return 0.0, f"host-bound: the vendor op takes {theirs * 1e3:.1f} us (< {POLICY_MIN_VENDOR_MS * 1e3:.0f} us)"
    return theirs / ours, f"{ours * 1e3:.1f} us vs {theirs * 1e3:.1f} us"


def tune_policy(family: Family, problems: Sequence, device, *, db_url: str | None, margin: float = POLICY_MARGIN,
                rounds: int = POLICY_ROUNDS, seed: int = 0,
                report: Callable[[str], None] = lambda line: None) -> list[PolicyOutcome]:
    """Verify the family's default against the vendor op per group of `problems`; store the groups it wins."""
    store = Store(open_engine(db_url, create=True))
    device_id, toolchain_id = store.ensure_device(device), store.ensure_toolchain()
    outcomes = []
    for (fixed, _), members in group_samples(family, problems).items():
        samples = _corners(family, members)
        ratios, worst, worst_ratio = [], "", math.inf
        for sample in samples:
            try:
                ratio, note = _time_sample(family, sample, device, rounds, seed)
            except Exception as exc:  # noqa: BLE001 - a sample that cannot run ends the group: no policy
                ratio, note = 0.0, f"{type(exc).__name__}: {exc}"[:200]
            ratios.append(ratio)
            if ratio < worst_ratio:
                worst_ratio, worst = ratio, f"{family.problem_key(sample)}: {note}"
            if ratio < 1.0 + margin:
                break  # one loss is enough: this group keeps the vendor op
        data = [problem_to_dict(s) for s in samples]
        verified_range = {name: [min(d[name] for d in data), max(d[name] for d in data)]
                          for name in _ranged_fields(family)}
        for name in family.serving_fields:
            verified_range[name] = list(family.serving_bucket(name, data[0][name]))
        params = dict(fixed)
        won = len(ratios) == len(samples) and min(ratios) >= 1.0 + margin
        positive = [r for r in ratios if r > 0]
        geomean = math.exp(sum(map(math.log, positive)) / len(positive)) if positive else 0.0
        if won:
            store.save_policy(family=family.name, device=device, device_id=device_id, toolchain_id=toolchain_id,
                              params=params, verified_range=verified_range, config=POLICY_CONFIG.to_json(),
                              samples=len(samples), min_ratio=min(ratios), geomean_ratio=geomean,
                              provenance=f"default config re-timed beside the vendor op on {len(samples)} shapes, "
                                         f"{rounds} interleaved rounds each; margin {margin:.0%}")
        else:
            store.delete_policy(family=family.name, device_key=device.key, params=params,
                                verified_range=verified_range)
        outcome = PolicyOutcome(family.name, params, verified_range, len(ratios), min(ratios) if ratios else 0.0,
                                geomean, won, worst)
        report(outcome.describe())
        outcomes.append(outcome)
    from autotile.runtime.dispatch import clear_cache

    clear_cache()
    return outcomes


__all__ = ["POLICY_MARGIN", "PolicyOutcome", "group_samples", "tune_policy"]
