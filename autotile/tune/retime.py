"""The final side-by-side re-timing of a study's finalists and the vendor op, as a race.

Every candidate is timed in turns (round-robin, so drift of the GPU's clocks hits them alike), as
`autotile.bench.retime_interleaved` does; after each round, a candidate whose median so far is slower than
the leader's by more than `DROP_MARGIN` leaves the race, since more rounds cannot change the order. The
close ones keep going for every round. On the H200 the final re-timing of 3 finalists and cuBLAS took 4.5
s of a 23 s run (5 rounds of 4 do_bench calls of ~0.15 s each, plus the checks), though the finalists
trailed cuBLAS by 30% after the first round.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping

from autotile.bench import Timing, time_fn
from autotile.device import DeviceInfo

# A candidate trailing the leader by more than this fraction after a round leaves the race. Repeated
# timings of one kernel on the lent H200 differ by up to ~9% (DESIGN.md); twice that is no noise.
DROP_MARGIN = 0.18


def race(fns: Mapping[str, Callable[[], object]], device: DeviceInfo, rounds: int = 5,
         drop_margin: float = DROP_MARGIN,
         time_one: Callable[[Callable[[], object], DeviceInfo], Timing] = time_fn) -> dict[str, Timing]:
    """Each callable's median over the rounds it ran, the callables timed in turns; clear losers stop early.

    The race ends after `rounds` rounds, or once a single callable is left. Every callable is in the result:
    the median of its round medians, with the 20th and 80th percentiles of those as quantiles (one that left
    early has fewer rounds); a callable timed in one round only keeps that timing, quantiles and all.

    >>> import itertools
    >>> from autotile.device import interpret_device
    >>> clock = {"fast": itertools.cycle([1.0, 1.1]), "slow": itertools.repeat(2.0)}
    >>> fake = lambda fn, device: Timing(next(clock[fn()]), 0.0, 0.0)
    >>> timed = race({"fast": lambda: "fast", "slow": lambda: "slow"}, interpret_device(), rounds=5, time_one=fake)
    >>> timed["fast"].median_ms, timed["slow"].median_ms  # 'slow' left after round 1, and the race with it
    (1.0, 2.0)
    """
    samples: dict[str, list[float]] = {name: [] for name in fns}
    first: dict[str, Timing] = {}
    running = list(fns)
    for _ in range(rounds):
        for name in running:
            timing = time_one(fns[name], device)
            first.setdefault(name, timing)
            samples[name].append(timing.median_ms)
        leader = min(statistics.median(samples[name]) for name in running)
        running = [name for name in running if statistics.median(samples[name]) <= leader * (1.0 + drop_margin)]
        if len(running) < 2:
            break
    # One round (the race ended after it): that timing's own quantiles, not a spread of one sample (which read 0%).
    return {name: first[name] if len(values) == 1 else _summary(values, device)
            for name, values in samples.items() if values}


def _summary(values: list[float], device: DeviceInfo) -> Timing:
    ordered = sorted(values)
    lo = ordered[max(0, round(0.2 * (len(ordered) - 1)))]
    hi = ordered[min(len(ordered) - 1, round(0.8 * (len(ordered) - 1)))]
    return Timing(statistics.median(ordered), lo, hi, interpreted=device.interpret)
