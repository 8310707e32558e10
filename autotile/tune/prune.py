"""Pruning before compiling: a roofline lower bound per config drops those that cannot come close to the best.

For every feasible config of a problem a family model gives a lower bound on
its run time from what the config decides: how many tiles (CTAs) it launches
and so how many waves of them each SM runs, the work of the padded tiles, the
bytes each tile streams through L2, the bytes that must cross HBM (split-K's
workspace included). A config's time is at least the largest of

    (FLOPs of the padded tiles) / (peak FLOP/s)
    waves x (FLOPs of one tile) / (peak FLOP/s of one SM at the datasheet rate)
    (bytes the tiles stream from L2) / (L2 bandwidth)
    (bytes that cross HBM) / (HBM bandwidth)

The bound is calibrated on the trials measured so far: `scale` is the smallest
ratio of measured time to bound, so `scale x bound` stays below every measured
time (the absolute peaks do not matter, only how configs compare). Once
`MIN_OBSERVED` trials are in, a config whose calibrated bound exceeds the best
time so far by more than `margin` is dropped without compiling.

A bound can still be wrong for a config unlike any measured (its real
efficiency relative to the model beats every measured one): such a config is
dropped though it might have won. How often that happens is measured, not
assumed: benchmarks/search_efficiency.py counts it against tables of whole
spaces timed on the GPU.

Models exist for `gemm` and forward `flash`; other families, the interpreter
(whose timings have nothing to do with a GPU's) and GPUs without a profile
(no peak numbers) are not pruned.

>>> from autotile.device import DeviceInfo
>>> from autotile.families.gemm import FAMILY, contiguous_problem
>>> h200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448, "test")
>>> problem = contiguous_problem(4096, 4096, 4096, "bf16", "bf16")
>>> configs = list(FAMILY.space(problem, h200).feasible())
>>> model = Pruner.for_problem(FAMILY, problem, h200, configs)
>>> small = next(c for c in configs if c["BLOCK_M"] == 16 and c["BLOCK_N"] == 32)
>>> big = next(c for c in configs if c["BLOCK_M"] == 128 and c["BLOCK_N"] == 256 and c["SPLIT_K"] == 1)
>>> bool(model.bound_ms(small) > 3 * model.bound_ms(big))
True
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autotile.device import PROFILES, DeviceInfo
from autotile.dtypes import element_size
from autotile.space import Config

# A config is dropped when its calibrated bound exceeds the best time so far by more than this fraction.
# Repeated timings of one kernel on the H200 differ by up to ~9% (DESIGN.md); 0.3 leaves room for that and
# for model error before anything is dropped.
DEFAULT_MARGIN = 0.3
# Trials measured before the first config is dropped: the calibration needs a few points.
MIN_OBSERVED = 5
# L2 -> SM bandwidth as a multiple of the profile's HBM copy bandwidth.
# NOTE: assumed, not measured here: published microbenchmarks of Hopper put L2 read bandwidth at about
# 1.5-2.5x HBM; 3x keeps the bound below the real cost (a lower bound may only be too low).
L2_OVER_HBM = 3.0
# The busiest SM may run above the average rate the profile's peak stands for: that peak is the best
# cuBLAS rate measured on the H200 (717 TFLOP/s), the datasheet's dense rate is 989 (989 / 717 = 1.38).
# The per-SM (wave) term of the bound uses the datasheet rate; the whole-GPU term the measured one.
PER_SM_HEADROOM = 1.38
# A kernel may beat the best rate measured: a generated GEMM ran 2048 x 4096 x 14336 at 717.2 TFLOP/s (H200,
# 2026-12-01), above the profile's 717. The whole-GPU term keeps 5% of headroom so that it stays a lower bound.
MEASURED_PEAK_HEADROOM = 1.05
# The profile's copy rate counts bytes read plus written; a stream of reads alone can beat it: a decode GEMM read
# Llama-3-70B's gate_up weight (940 MB, 4 tokens) at 4.30 TB/s of reads alone (H200, 2026-12-02), level with
# the copy rate. The HBM term keeps the datasheet's headroom over the copy rate (H200: 4.8 / 4.30 = 1.12).
HBM_HEADROOM = 1.12
# The shortest time a launch is timed at by CUDA events (an empty kernel on an H100/H200: ~2-3 us).
# NOTE: a floor for configs so small that every other term vanishes; taken low on purpose.
LAUNCH_FLOOR_MS = 0.0015
# Split-K and stream-K contributors write fp32 partial tiles that the tile's last contributor reads back.
_FP32 = 4


@dataclass(frozen=True)
class Roofline:
    """The ceilings a bound is computed against, in FLOP/s and bytes/s."""

    sm_count: int
    flops: float  # peak for the problem's dtype, whole GPU
    hbm: float  # bytes/s read + written, with headroom over the measured copy rate
    l2: float


def roofline(device: DeviceInfo, dtype: str) -> Roofline | None:
    """The device's ceilings for `dtype`, or None under the interpreter and for GPUs without a profile."""
    profile = PROFILES.get(device.profile)
    if device.interpret or profile is None or not profile.copy_tbps:
        return None
    peak = profile.peak_tflops.get("bf16" if dtype == "fp8" and "fp8" not in profile.peak_tflops else dtype)
    if not peak:
        return None
    copy = profile.copy_tbps * 1e12
    return Roofline(device.sm_count, peak * 1e12, HBM_HEADROOM * copy, L2_OVER_HBM * copy)


def _columns(configs: Sequence[Config], names: Sequence[str]) -> dict[str, np.ndarray]:
    return {name: np.array([config[name] for config in configs]) for name in names}


def _cdiv(a, b):
    return -(-a // b)


def gemm_bound_ms(problem, roof: Roofline, configs: Sequence[Config]) -> np.ndarray:
    """Lower bound on each config's time for a GEMM problem, ms."""
    p = problem
    c = _columns(configs, ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"))
    bm, bn, bk, split = (c[n].astype(np.float64) for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"))
    in_size, out_size = element_size(p.dtype), element_size(p.out_dtype)
    tiles = _cdiv(p.m, bm) * _cdiv(p.n, bn)
    ctas = tiles * split
    k_per_cta = _cdiv(_cdiv(p.k, bk), split) * bk  # each split runs whole K tiles, the last one padded
    waves = _cdiv(ctas, roof.sm_count)
    if "SCHEDULE" in configs[0]:
        # Stream-K spreads the tiles of the last, partial wave over every SM: no wave is left part-empty.
        stream_k = np.array([config["SCHEDULE"] == "stream_k" for config in configs])
        waves = np.where(stream_k, ctas / roof.sm_count, waves)
    tile_flops = 2.0 * bm * bn * k_per_cta
    compute = np.maximum(ctas * tile_flops / (MEASURED_PEAK_HEADROOM * roof.flops),
                         waves * tile_flops / (PER_SM_HEADROOM * roof.flops / roof.sm_count))
    l2 = ctas * (bm + bn) * k_per_cta * in_size / roof.l2
    compulsory = (p.m * p.k + p.k * p.n) * in_size + p.m * p.n * out_size
    workspace = np.where(split > 1, 2.0 * split * p.m * p.n * _FP32, 0.0)  # partials written, then read
    hbm = (compulsory + workspace) / roof.hbm
    # One launch whatever the schedule: the last program to finish a split tile reduces it (templates/gemm.py.j2).
    return 1e3 * np.maximum.reduce([compute, l2, hbm]) + LAUNCH_FLOOR_MS


def flash_bound_ms(problem, roof: Roofline, configs: Sequence[Config]) -> np.ndarray:
    """Lower bound on each config's time for a forward attention problem, ms."""
    from autotile.families.flash import seen_pairs

    p = problem
    c = _columns(configs, ("BLOCK_M", "BLOCK_N"))
    bm, bn = c["BLOCK_M"].astype(np.float64), c["BLOCK_N"].astype(np.float64)
    size, out_size = element_size(p.dtype), element_size(p.out_dtype)
    d = float(p.block_d)
    heads = p.batch * p.heads_q
    row_tiles = _cdiv(p.seq_q, bm)
    ctas = heads * row_tiles
    # Keys a row tile visits, rounded up to whole key blocks: all of them, or (causal) those under the diagonal.
    if p.causal:
        seen = seen_pairs(p.seq_q, p.seq_k, True) / p.seq_q  # keys per query row, on average
        keys = np.minimum(_cdiv(seen + bm / 2.0, bn) * bn, _cdiv(p.seq_k, bn) * bn)
    else:
        keys = _cdiv(p.seq_k, bn) * bn
    longest = _cdiv(p.seq_k, bn) * bn  # the last row tile sees every key
    flops_tile = 4.0 * bm * d * keys  # Q K^T and P V for one row tile
    per_sm = PER_SM_HEADROOM * roof.flops / roof.sm_count
    total = ctas * flops_tile / (MEASURED_PEAK_HEADROOM * roof.flops)
    busiest = _cdiv(ctas, roof.sm_count) * flops_tile / per_sm if not p.causal else 4.0 * bm * d * longest / per_sm
    compute = np.maximum(total, busiest)
    l2 = ctas * (bm * d + 2.0 * keys * d) * size / roof.l2
    q_elems = p.batch * p.heads_q * p.seq_q * p.head_dim
    kv_elems = p.batch * p.heads_kv * p.seq_k * p.head_dim
    hbm = (q_elems * size + 2 * kv_elems * size + q_elems * out_size) / roof.hbm
    return 1e3 * np.maximum.reduce([compute, l2, np.full_like(compute, hbm)]) + LAUNCH_FLOOR_MS


def _flash_model(problem) -> Callable | None:
    # Forward only; a sliding window or packed sequences visit fewer keys than the bound counts (it would not
    # be a lower bound there).
    if getattr(problem, "direction", None) != "fwd" or getattr(problem, "varlen", False):
        return None
    if getattr(problem, "window_left", -1) >= 0 or getattr(problem, "window_right", -1) >= 0:
        return None
    return flash_bound_ms


# family name -> (problem -> bound function or None)
MODELS: dict[str, Callable] = {
    "gemm": lambda problem: gemm_bound_ms,
    "flash": _flash_model,
}


def bound_function(family, problem, device: DeviceInfo):
    """(bound function, roofline) for the problem, or None when nothing models it on this device."""
    chooser = MODELS.get(family.name)
    if chooser is None:
        return None
    fn = chooser(problem)
    roof = roofline(device, getattr(problem, "dtype", ""))
    if fn is None or roof is None:
        return None
    return fn, roof


class Pruner:
    """Calibrated roofline bounds over a problem's feasible configs, and which of them can still come close.

    `observe` each measured config; `alive()` is the row mask of configs worth running (all of them until
    `min_observed` trials are in); `reason(config)` says why one is dropped, or '' when it is not.
    """

    def __init__(self, configs: Sequence[Config], bounds: np.ndarray, margin: float = DEFAULT_MARGIN,
                 min_observed: int = MIN_OBSERVED):
        if len(configs) != len(bounds):
            raise ValueError("one bound per config")
        self.configs = list(configs)
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.margin = margin
        self.min_observed = min_observed
        self.index = {config.hash: row for row, config in enumerate(self.configs)}
        self.best_ms: float | None = None
        self.scale: float | None = None  # min over observed configs of measured / bound
        self.observed = 0
        self.dropped: set[str] = set()  # hashes of configs a search skipped because of the model
        self._alive: np.ndarray | None = None

    @classmethod
    def for_problem(cls, family, problem, device: DeviceInfo, configs: Sequence[Config],
                    margin: float = DEFAULT_MARGIN, min_observed: int = MIN_OBSERVED) -> Pruner | None:
        """The pruner of `family`'s model for `problem` on `device`, or None when there is no model for it."""
        model = bound_function(family, problem, device)
        if model is None or not len(configs):
            return None
        fn, roof = model
        return cls(configs, fn(problem, roof, configs), margin, min_observed)

    def bound_ms(self, config: Config) -> float | None:
        row = self.index.get(config.hash)
        return None if row is None else float(self.bounds[row])

    def floor_ms(self) -> float:
        """The smallest bound over every config: no config of the space runs faster than this (uncalibrated)."""
        return float(self.bounds.min())

    def observe(self, config: Config, median_ms: float) -> None:
        """Take one measured (ok) trial into the calibration and the best time."""
        row = self.index.get(config.hash)
        if row is None or not median_ms > 0:
            return
        ratio = median_ms / self.bounds[row]
        self.scale = ratio if self.scale is None else min(self.scale, ratio)
        self.best_ms = median_ms if self.best_ms is None else min(self.best_ms, median_ms)
        self.observed += 1
        self._alive = None

    @property
    def active(self) -> bool:
        return self.observed >= self.min_observed and self.best_ms is not None

    def threshold_ms(self) -> float | None:
        """Configs whose calibrated bound is above this are dropped (None: nothing is dropped yet)."""
        if not self.active:
            return None
        return self.best_ms * (1.0 + self.margin)

    def alive(self) -> np.ndarray:
        """Row mask of the configs that can still come within `margin` of the best."""
        if self._alive is None:
            limit = self.threshold_ms()
            if limit is None:
                self._alive = np.ones(len(self.configs), dtype=bool)
            else:
                self._alive = self.scale * self.bounds <= limit
        return self._alive

    def reason(self, config: Config) -> str:
        """Why the model drops `config` ('' when it does not)."""
        row = self.index.get(config.hash)
        if row is None or self.alive()[row]:
            return ""
        bound = self.scale * self.bounds[row]
        return (f"model: at least {bound:.4g} ms (roofline bound x {self.scale:.3g} calibration), best so far "
                f"{self.best_ms:.4g} ms + {self.margin:.0%}")

    def drops(self, config: Config) -> bool:
        return bool(self.reason(config))

    def would_drop(self, config: Config, best_ms: float) -> bool:
        """Whether `config` would be dropped, with the calibration as it is, once the best time is `best_ms`."""
        row = self.index.get(config.hash)
        if row is None or self.scale is None:
            return False
        return bool(self.scale * self.bounds[row] > best_ms * (1.0 + self.margin))

    def share_dropped(self) -> float:
        """Fraction of the configs the model drops now."""
        return 1.0 - float(self.alive().mean()) if len(self.configs) else 0.0

