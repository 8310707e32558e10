"""`autotile bench`: the config autotile would serve for a problem, timed beside its baseline on this device.

Nothing is tuned here: the config comes from the usual dispatch (user database,
shipped database, default), is checked against the reference on fresh inputs,
then timed in interleaved rounds with the family's baseline (cuBLAS, SDPA,
torch.compile, ...) on the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

from autotile.bench import Status, Timing, retime_interleaved, run_checked
from autotile.device import DeviceInfo
from autotile.families.base import Family
from autotile.runtime.dispatch import Resolution, resolve


@dataclass(frozen=True)
class BenchRow:
    problem: object
    resolution: Resolution
    status: Status
    error: str = ""
    ours: Timing | None = None
    baseline_name: str = ""
    baseline: Timing | None = None
    flops: float = 0.0
    bytes: float = 0.0

    @property
    def speedup(self) -> float | None:
        if self.ours and self.baseline:
            return self.baseline.median_ms / self.ours.median_ms
        return None


def bench_problem(family: Family, problem, device: DeviceInfo, rounds: int = 5, seed: int = 0) -> BenchRow:
    """Check the served config for `problem`, then time it and the baseline in `rounds` interleaved rounds.

    >>> from autotile.families.gemm import FAMILY, contiguous_problem
    >>> from autotile.device import interpret_device
    >>> row = bench_problem(FAMILY, contiguous_problem(16, 32, 32, "fp32", "fp32"), interpret_device(), rounds=1)
    >>> row.status.value, row.resolution.source in ("user-db", "shipped-db", "default")
    ('ok', True)
    """
    resolution = resolve(family, problem, device)
    cost = family.cost(problem)
    outcome, inputs = run_checked(family, problem, resolution.config, device, seed)
    if outcome.status is not Status.OK:
        return BenchRow(problem, resolution, outcome.status, outcome.error, flops=cost.flops, bytes=cost.bytes)
    outputs = family.allocate_outputs(problem, inputs)
    fns = {"autotile": family.timed_call(problem, resolution.config, inputs, outputs)}
    baseline = family.baseline(problem, inputs)
    if baseline is not None:
        fns["baseline"] = baseline.run
    timings = retime_interleaved(fns, device, rounds=rounds)
    return BenchRow(problem, resolution, Status.OK, ours=timings["autotile"],
                    baseline_name=baseline.name if baseline else "", baseline=timings.get("baseline"),
                    flops=cost.flops, bytes=cost.bytes)
