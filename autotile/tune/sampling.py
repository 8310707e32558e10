"""How the search turns Optuna's proposals into configs: ordinal axes, and the nearest feasible config.

Block sizes, warps, stages and split counts are ordered: 32 key columns are
closer to 64 than to 256. Proposed as categories, TPE learns nothing about 32
from a good result at 64, and a replacement "sharing the most values" treats
every other value of an axis alike. Both stalled the flash search of issue 15
(benchmarks/search_efficiency.py, results/search_efficiency_2026-12-01b.md):
the two configs within 2% of the best (BLOCK_N 32 with TMA loads) were one
step along ordered axes from the seeds, and the search replaced infeasible
proposals by the first config of the grid in a tie, the same few each time.

So an ordinal axis (integers, at least three choices) is proposed as an
integer range (log-scaled when its choices span a factor of 4 or more) and
snapped to the nearest choice; the nearest feasible config counts steps along
ordinal axes and a mismatch on the others, and breaks ties at random (seeded
by the proposal, so a search replays the same way).

>>> from autotile.space import Axis, Space
>>> space = Space([Axis("BLOCK", (16, 32, 64, 128)), Axis("LOADS", ("pointer", "tma")), Axis("num_stages", (2, 3))])
>>> [is_ordinal(axis) for axis in space.axes]
[True, False, False]
>>> snap(space.axes[0], 45), snap(space.axes[0], 100)
(32, 128)
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from autotile.space import Axis, Space

# An ordinal axis whose choices span at least this factor is proposed on a log scale (16..256 blocks, 1..8 warps,
# split counts 1..16); a narrower one (2..4 stages) on a linear one.
LOG_SPAN = 4


def is_ordinal(axis: Axis) -> bool:
    """Whether the axis' choices are ordered numbers (integers, not booleans, three or more of them)."""
    first = axis.choices[0]
    return isinstance(first, int) and not isinstance(first, bool) and len(axis.choices) >= 3


def _log_scale(axis: Axis) -> bool:
    low, high = min(axis.choices), max(axis.choices)
    return low > 0 and high >= LOG_SPAN * low


def snap(axis: Axis, value: int):
    """The choice of an ordinal axis nearest to `value` (on the axis' scale; the smaller one in a tie)."""
    if _log_scale(axis):
        return min(axis.choices, key=lambda c: (abs(math.log(c) - math.log(max(value, 1))), c))
    return min(axis.choices, key=lambda c: (abs(c - value), c))


def suggest(trial, space: Space) -> dict:
    """One proposal of every axis of `space` from an Optuna trial (enqueued values come back as they were).

    NOTE: a study that an older autotile started holds categorical distributions for these names, and Optuna
    refuses another kind of distribution under a name; such an axis stays categorical in that study.
    """
    values = {}
    for axis in space.axes:
        if is_ordinal(axis):
            low, high = min(axis.choices), max(axis.choices)
            try:
                values[axis.name] = snap(axis, trial.suggest_int(axis.name, low, high, log=_log_scale(axis)))
                continue
            except ValueError:
                pass
        values[axis.name] = trial.suggest_categorical(axis.name, list(axis.choices))
    return values


def step_distance(space: Space, codes: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Distance of each row of `codes` (value indices, one column per axis) from `target`: steps along ordinal
    axes, 1 for any other value of another axis; a target index of -1 (a value outside the axis) matches nothing."""
    ordinal = np.array([is_ordinal(axis) for axis in space.axes], dtype=bool)
    codes = codes.astype(np.int32)
    target = target.astype(np.int32)
    unknown = target < 0
    steps = np.abs(codes - target)
    mismatch = (codes != target).astype(np.int32)
    # An unknown value is as far as the farthest choice of an ordinal axis.
    far = np.array([len(axis.choices) for axis in space.axes], dtype=np.int32)
    per_axis = np.where(ordinal & ~unknown, steps, np.where(ordinal & unknown, far, mismatch))
    return per_axis.sum(axis=1)


def tie_break(wanted: dict, salt: int, candidates: np.ndarray) -> int:
    """One of `candidates` picked at random, seeded by the proposal and `salt` (reproducible, not always the first)."""
    text = repr(sorted((str(k), repr(v)) for k, v in wanted.items())) + f"/{salt}"
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return int(candidates[np.random.default_rng(seed).integers(len(candidates))])
