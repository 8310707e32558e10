"""FlashAttention: softmax(scale * Q K^T) V without ever storing the Sq x Sk score matrix.

The forward streams K/V tiles past a resident Q tile, keeping a running row max and row sum
(online softmax), and saves each row's log-sum-exp. The backward recomputes the probability
tiles from that log-sum-exp: one kernel owns a key block and sums dK/dV over every query
head of its group, another owns a query block and sums dQ, so no atomics are needed.

Forward and backward are separate problems of one family (`direction`), tuned and looked up
separately. Masks are aligned to the bottom-right (query i sees key j <= i + Sk - Sq when causal),
as SDPA's `causal_lower_right` and FlashAttention do; rows that see no key give O = 0.
Model features are fields of the problem and switches of the template, so a plain call renders
none of them: sliding window (window_left/right), logit soft-capping (softcap), ALiBi (alibi),
packed variable-length sequences (varlen). SDPA's backends are the vendor configs of plain
problems (autotile/families/flash_vendor.py).
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from autotile.arch import (Feature, arch_of, architecture_constraints, device_default, device_seeds,
                           require_dtypes)
from autotile.device import HOPPER_SMEM_PER_BLOCK, DeviceInfo
from autotile.dtypes import element_size, torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families import flash_vendor
from autotile.families.base import (VENDOR_KEY, Baseline, CheckResult, Cost, Family, ProblemOption, Tensors,
                                    Tolerance, canonical_json, is_vendor, next_pow2, problem_to_dict)
from autotile.families.checks import compare
from autotile.families.flash_launch import (
    GLUON_BWD_KEYS, GLUON_BWD_ROWS, GLUON_WS, backward_plan, forward_plan, gluon_backward_plan)
from autotile.families.flash_reference import (LOG2E, Scores, attention_grads, attention_math,  # noqa: F401 - re-exported
                                               causal_seen, default_scale, fa_rule_check, join_packed, log2_sum_exp,
                                               map_head_chunks, per_batch_slopes, plain_fp8_forward, seen_pairs,
                                               split_packed)
from autotile.render import load_kernel_module
from autotile.space import Axis, AxisKind, Config, Constraint, Space

DIRECTIONS = ("fwd", "bwd")
DTYPES = ("fp32", "fp16", "bf16", "fp8")  # fp8 (e4m3 with per-tensor descales): forward only
MAX_HEAD_DIM = 256
# Problem fields added after the first shipped winners, with the values that mean "off": they are left
# out of the problem key at these values, so keys stored before they existed still match.
FEATURE_DEFAULTS = {"window_left": -1, "window_right": -1, "softcap": 0.0, "alibi": False, "varlen": False}
# A thread holds at most this many fp32 accumulator values before Hopper kernels start to spill
# (255 registers a thread, minus addresses, masks and the softmax statistics).
_ACCUMULATOR_REGISTERS = 192
_BLOCKS = (16, 32, 64, 128)
# Key blocks of 256 only for head dims <= 64, where a (BLOCK_M, 256) score tile costs what a
# (BLOCK_M, 128) one does at D = 128 and halves the loop trips of short-head problems.
_WIDE_BLOCK_N = 256
# Keys from which the untuned forward loads K/V through TMA. H200 sweep with Q kept in shared memory
# (results/flash_policy_sweep_2026-12-01b.md): TMA led at 4096 keys by 1-3%, pointer loads at 2000-2048 keys
# (by 3-4% on 4 x 2048 causal prefill, 13% at D = 64, 3 x 12 x 2000) and at 512.
_TMA_FROM_KEYS = 4096


LOADS_CHOICES = ("pointer", "tma", "pointer_lookahead", "tma_lookahead", GLUON_WS)
# gluon_ws's fixed structure: a 128-row query tile (two warpgroups), one warpgroup (4 warps) a partition, key
# blocks of 64 (head dim 256, whose accumulators take 128 registers a thread) or 128. NOTE: 256-key blocks at head
# dim 64 (the score tile's 128 fp32 registers and P's 64 a thread) spill P's registers around the P V wgmmas in the key
# loop (sm90 build, cuobjdump -sass: LDL.LU.64 before each HGMMA.64x64x16).
_GLUON_BLOCK_M = 128
_GLUON_BLOCK_N = (64, 128)
_GLUON_HEAD_DIMS = (64, 128, 256)


def forward_tiles_bytes(problem, config, q_tiles: int = 1) -> int:
    """Shared memory of a forward's resident Q tiles and its K and V tiles for every pipeline stage."""
    bd = problem.block_d
    return (q_tiles * config["BLOCK_M"] * bd + 2 * config["BLOCK_N"] * bd * config["num_stages"]) * element_size(
        problem.dtype)


def gluon_q_slots(problem, config) -> int:
    """Q slots of a gluon_ws forward (Hopper only): two (the next tile's Q loads during this tile's key loop) with
    64-key blocks where they fit beside the K/V stages, its barriers and tile buffer (1 KB), else one. 16 x 512
    Llama-3-8B causal at 128 x 64 on 4 stages: 0.93x of cuDNN with one slot, 0.95x with two; 1 x 4096 1.02x and 1.01x
    (results/gluon_variants_2026-12-03e.txt)."""
    fits = forward_tiles_bytes(problem, config, q_tiles=2) <= HOPPER_SMEM_PER_BLOCK - 1024
    return 2 if config["BLOCK_N"] == 64 and fits else 1


def _gluon_tile_queue(problem) -> bool:
    """Whether the untuned gluon_ws forward takes its tiles from a queue (TILE_QUEUE): at head dim 128 with more than
    one sequence, where static rounds leave programs waiting on the round's slowest tiles. H200, x cuDNN, each
    shape's default static -> queue (results/gluon_variants_2026-12-04_queue_axis.txt): causal Llama-3-8B 32 x 256
    0.99x -> 1.04x, 16 x 512 0.97x -> 1.01x, 8 x 1024 0.96x -> 1.02x, 4 x 2048 1.05x -> 1.07x, 2 x 4096 a tie;
    Qwen2.5-7B 16 x 512 0.99x -> 1.03x, 8 x 1024 0.97x -> 1.02x, 4 x 2048 1.05x -> 1.09x; not causal, 16 x 512
    0.96x -> 1.00x, 2 x 4096 a tie; Phi-3-mini (96 in 128-wide tiles) 16 x 512 0.91x -> 0.94x, 4 x 2048 a tie. One
    sequence keeps static rounds (1 x 4096 1.17x -> 1.15x, 1 x 8192 a tie), as do head dims 256 (Gemma-2-9B 4 x 2048
    0.82x -> 0.76x) and 64 (3 x 12 x 2000 and 4 x 12 x 4096, ties)."""
    return problem.block_d == 128 and problem.batch > 1


def gluon_split_kv(problem, config) -> bool:
    """Whether a gluon_ws forward gives its K and V slots back apart (SPLIT_KV in templates/flash_gluon_ws.py.j2): at
    head dim 256 with 128-key blocks, whose one slot (Q, K and V: 192 KB) is all that fits, as in cuDNN's
    64 x 128 x 256 forward (197 KB of shared memory, results/ncu_flash_2026-12-03/)."""
    return (problem.direction == "fwd" and config["LOADS"] == GLUON_WS and problem.block_d == 256
            and config["BLOCK_N"] == _GLUON_BLOCK_M)


# Keys up to which causal gluon_ws forwards at head dim 128 take 64-key blocks (see FlashFamily._forward_default).
_GLUON_SHORT_KEYS = 1024
# Keys up to which gluon_ws forwards at head dim 256 take 64-key blocks on two K/V slots; beyond, one split slot of
# 128-key blocks (SPLIT_KV). H200, causal Gemma-2-9B, x cuDNN, 64-key blocks -> split slot
# (results/gluon_variants_2026-12-04_split.txt): 1 x 4096 0.94x -> 1.20x, 4 x 2048 0.85x -> 1.04x, 1 x 8192 0.83x ->
# 1.12x; 16 x 512 0.90x -> 0.88x.
_GLUON_D256_SHORT_KEYS = 512
# Keys from which the gluon_ws forward is the default at head dim 64: it led at 2000 and 4096 keys once its persistent
# rounds alternated direction and O left through a TMA store; at 16 x 512 the pointer default led
# (results/gluon_variants_2026-12-03b.txt, _c.txt).
_GLUON_D64_FROM_KEYS = 2000


# Sequences up to this long take 32-row query steps in the untuned dK/dV kernel (64-row steps beyond): H200, causal,
# pointer loads, 64 x 128 dK/dV tiles against 32 x 128, same dQ tiles: 16 x 512 (Llama, Qwen, Phi heads) 0.585 /
# 0.539 ms, 0.555 / 0.516, 0.591 / 0.534; 8 x 1024 at D = 128 0.828 / 0.801, at D = 64 0.463 / 0.454; at 4 x 2048 a
# tie (1.318 / 1.313); 64-row steps led by 3-7% on 4096-token GQA and non-causal shapes and on D = 64 at 2048
# (results/flash_bwd_short_2026-12-02.txt, flash_bwd_tma_2026-12-02.txt).
_SHORT_BACKWARD_TOKENS = 1024

# The backward's loads: the tiles each kernel walks over (Q and dO for dK/dV, K and V for dQ) as masked pointer loads
# or through TMA descriptors; or gluon_ws, the Gluon backward (templates/flash_gluon_bwd.py.j2: one warp-specialised
# kernel for dQ, dK and dV, dQ added by reductions).
BACKWARD_LOADS_CHOICES = ("pointer", "tma", GLUON_WS)
# The Gluon backward's head dims (tiles; 96 pads to 128).
_GLUON_BWD_HEAD_DIMS = (64, 128)


def uses_tma(config) -> bool:
    """A config whose streamed tiles arrive through TMA tensor descriptors."""
    return config["LOADS"].startswith("tma") or config["LOADS"] == GLUON_WS


def gluon_ws_ok(problem, device: DeviceInfo) -> bool:
    """Whether the gluon_ws forward (templates/flash_gluon_ws.py.j2) applies: Hopper's wgmma and TMA compiled by
    Triton (never its interpreter, which does not run Gluon), 16-bit dense tensors with TMA-able strides, a head dim
    that is or pads to 64, 128 or 256 (96 -> 128: TMA fills the padding), dense or packed, and no feature but a right
    bound (causal, or a window's right side)."""
    p = problem
    return (not device.interpret and device.compute_capability[0] == 9 and p.direction == "fwd"
            and p.dtype in ("bf16", "fp16") and p.aligned and p.block_d in _GLUON_HEAD_DIMS and p.head_dim % 8 == 0
            and p.window_left < 0 and p.softcap <= 0 and not p.alibi)


def gluon_bwd_ok(problem, device: DeviceInfo) -> bool:
    """Whether the Gluon backward (templates/flash_gluon_bwd.py.j2) applies: Hopper, compiled (not interpreted),
    16-bit tensors with TMA-able strides, dense or packed, a head dim that is or pads to 64 or 128, causal or not
    and no other feature (windows, soft-capping and ALiBi stay on the Triton backward)."""
    p = problem
    return (not device.interpret and device.compute_capability[0] == 9 and p.direction == "bwd"
            and p.dtype in ("bf16", "fp16") and p.aligned and p.block_d in _GLUON_BWD_HEAD_DIMS
            and p.head_dim % 8 == 0 and not p.has_features)


def gluon_bwd_smem(problem, config) -> int:
    """Shared memory of a Gluon backward config, an upper bound: K and V of a tile, num_stages slots of Q, dO and
    their row statistics, two dS^T buffers, barriers, and each consumer warpgroup's staging buffer for its fp32 dQ
    block (64 rows x 64 columns), which a TMA reduction adds to dQ (sm90 builds: 198,096 B at head dim 128 on two
    slots against 198,144 here, 166,352 at 64 on four against 166,400; tests/test_flash_gluon_bwd.py)."""
    size, bd = element_size(problem.dtype), problem.block_d
    rows, keys = GLUON_BWD_ROWS, GLUON_BWD_KEYS
    slot = 2 * rows * bd * size + 2 * rows * 4
    dq_scratch = 2 * rows * 64 * 4
    return 2 * keys * bd * size + config["num_stages"] * slot + 2 * keys * rows * size + 64 * 8 + dq_scratch


def _backward_upgrade(config):
    """A backward config stored before LOADS was one of its axes used pointer loads."""
    if "LOADS" in config or "BLOCK_M1" not in config:
        return config
    return {**dict(config), "LOADS": "pointer"}


def _backward_render_loads(config) -> str:
    """The template's LOADS of a backward config: its gluon_ws is flash_gluon_bwd.py.j2 ('gluon_bwd')."""
    loads = _backward_upgrade(config)["LOADS"]
    return "gluon_bwd" if loads == GLUON_WS else loads


def _forward_upgrade(config):
    """A forward config stored before MASKS_IN_LOOP was one of its axes ran its masked key blocks in loops of their
    own; one stored before TILE_QUEUE was dealt its tiles in static rounds."""
    if "BLOCK_M" not in config or ("MASKS_IN_LOOP" in config and "TILE_QUEUE" in config):
        return config
    return {"MASKS_IN_LOOP": False, "TILE_QUEUE": False, **dict(config)}


def _rows_needed(num_warps: int) -> int:
    # An mma covers 16 rows a warp; a Hopper warpgroup (4 warps) covers 64, and more warpgroups
    # may split the other dimension of the tile instead.
    return 16 * min(num_warps, 4)


def _largest_block(seq: int) -> int:
    # Blocks past the next power of two of a sequence only compute padding; 64 rows (one warpgroup)
    # stay allowed so that wide heads (256) keep a config whose accumulators fit in registers.
    return max(64, next_pow2(seq))


@dataclass(frozen=True)
class FlashProblem:
    direction: str  # 'fwd' or 'bwd'
    batch: int  # varlen: the number of sequences
    heads_q: int
    heads_kv: int
    seq_q: int  # varlen: the longest query sequence
    seq_k: int  # varlen: the longest key/value sequence
    head_dim: int
    causal: bool = False
    dtype: str = "bf16"
    aligned: bool = True  # base pointers and row strides are multiples of 16 bytes (TMA-able)
    window_left: int = -1  # sliding window: keys more than this many positions left of the diagonal are masked
    window_right: int = -1  # ... right of the diagonal (causal masks everything right of it)
    softcap: float = 0.0  # > 0: logits x -> softcap * tanh(x / softcap) (Gemma-2)
    alibi: bool = False  # ALiBi: per-head slopes add -slope * |i + Sk - Sq - j|
    varlen: bool = False  # packed (total, H, D) sequences with cumulative lengths

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise BadInputError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if min(self.batch, self.heads_q, self.heads_kv, self.seq_q, self.seq_k) < 1:
            raise ShapeMismatchError(f"attention sizes must be >= 1, got {self}")
        if self.heads_q % self.heads_kv:
            raise ShapeMismatchError(
                f"{self.heads_q} query heads cannot share {self.heads_kv} key/value heads: Hq must be a multiple of Hkv")
        if not 1 <= self.head_dim <= MAX_HEAD_DIM:
            raise ShapeMismatchError(f"head dim {self.head_dim} is not supported: use 1..{MAX_HEAD_DIM} (64, 96, 128, 256 are tuned)")
        if self.dtype not in DTYPES:
            raise UnsupportedDtypeError(f"flash attention supports {DTYPES}, got {self.dtype!r}")
        if self.dtype == "fp8" and self.direction == "bwd":
            raise UnsupportedDtypeError("the fp8 path is forward only; train in bf16 or fp16")
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise BadInputError(f"{name} must be an int >= -1 (-1: no limit), got {value!r}")
        if not (isinstance(self.softcap, (int, float)) and math.isfinite(self.softcap) and self.softcap >= 0):
            raise BadInputError(f"softcap must be a finite number >= 0 (0: off), got {self.softcap!r}")
        if self.dtype == "fp8" and (self.has_features or self.varlen):
            raise UnsupportedDtypeError("the fp8 path computes plain dense attention only (no window, softcap, "
                                        "ALiBi or packed sequences); cast to bf16 for those")
        # FlashAttention's rule: causal masks everything right of the diagonal, whatever the window says.
        if self.causal and self.window_right != -1:
            object.__setattr__(self, "window_right", -1)
        object.__setattr__(self, "softcap", float(self.softcap))

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def out_dtype(self) -> str:
        return "bf16" if self.dtype == "fp8" else self.dtype

    @property
    def block_d(self) -> int:
        # The head dim padded to a power of two (96 -> 128); tl.dot needs >= 16, fp8 dots >= 32 along K.
        return max(32 if self.dtype == "fp8" else 16, next_pow2(self.head_dim))

    @property
    def masked(self) -> bool:
        """Causal or windowed: some key blocks of a query tile are masked (the diagonal, a window's edges)."""
        return self.causal or self.window_left >= 0 or self.window_right >= 0

    @property
    def has_features(self) -> bool:
        """A sliding window, soft-capping or ALiBi (what SDPA cannot express)."""
        return self.window_left >= 0 or self.window_right >= 0 or self.softcap > 0 or self.alibi

    @property
    def scores(self) -> Scores:
        return Scores(self.causal, self.window_left, self.window_right, self.softcap)


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes for `heads` heads (geometric, 2^(-8/n) ... 2^-8 for n a power of two), fp32."""
    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    nearest = 1 << (heads.bit_length() - 1)
    slopes = powers(nearest)
    if nearest < heads:  # the paper's rule for other head counts: every other slope of the next power of two
        slopes += powers(2 * nearest)[0::2][: heads - nearest]
    return torch.tensor(slopes, dtype=torch.float32)


def packed_lengths(problem: FlashProblem) -> tuple[list[int], list[int]]:
    """Query and key lengths of the sequences a varlen problem's inputs pack: the first is the longest,
    the others drawn (deterministically) between a quarter and all of it; keys keep Sk - Sq over queries."""
    p = problem
    gen = random.Random(f"{p.batch}:{p.seq_q}:{p.seq_k}")
    lens_q = [p.seq_q] + [gen.randint(max(1, p.seq_q // 4), p.seq_q) for _ in range(p.batch - 1)]
    lens_k = [p.seq_k] + [max(1, min(p.seq_k, n + p.seq_k - p.seq_q)) for n in lens_q[1:]]
    return lens_q, lens_k


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(_running_sum(lengths)), dtype=torch.int32)


def _running_sum(values):
    total = 0
    for value in values:
        total += value
        yield total


# Known-good starting points (Triton's fused-attention tutorial on Hopper; the forward ones measured
# within a few percent of each other on the H200, 2026-11-29).
_SEED_FORWARD = (
    dict(LOADS="pointer", BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=8, num_stages=3),
    dict(LOADS="pointer", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=8, num_stages=2),
    dict(LOADS="tma", BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=8, num_stages=3),
    dict(LOADS="tma", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=True, num_warps=8, num_stages=2),
    dict(LOADS="pointer", BLOCK_M=64, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=4, num_stages=3),
    # FlashAttention-3's structure as far as Triton expresses it: TMA loads, the next block's scores issued
    # before this block's softmax, with and without warp specialisation (unmeasured starting points).
    dict(LOADS="tma_lookahead", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=8, num_stages=2),
    dict(LOADS="tma_lookahead", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=True, num_warps=8, num_stages=2),
)
# Head-dim specific starting points: wide heads keep the (BLOCK_M, 256) accumulator within a warpgroup's
# registers with short key blocks; narrow heads take long key blocks (fewer loop trips per row tile).
_SEED_FORWARD_D256 = (
    dict(LOADS="tma", BLOCK_M=64, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=4, num_stages=2),
    dict(LOADS="tma", BLOCK_M=128, BLOCK_N=32, WARP_SPECIALIZE=False, num_warps=8, num_stages=2),
    dict(LOADS="tma", BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=True, num_warps=8, num_stages=2),
    dict(LOADS="pointer", BLOCK_M=64, BLOCK_N=32, WARP_SPECIALIZE=False, num_warps=4, num_stages=3),
)
_SEED_FORWARD_D64 = (
    dict(LOADS="tma", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=4, num_stages=3),
    dict(LOADS="tma", BLOCK_M=128, BLOCK_N=256, WARP_SPECIALIZE=False, num_warps=8, num_stages=2),
    dict(LOADS="tma", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=True, num_warps=8, num_stages=3),
    dict(LOADS="pointer", BLOCK_M=64, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=4, num_stages=3),
)
# The gluon_ws forward on Hopper (templates/flash_gluon_ws.py.j2): 128-key blocks on three K/V slots (head dims up to
# 128; the prototype's best from 4k keys, 0.89-1.02x of cuDNN, results/gluon_flash_2026-12-03.txt) and 64-key blocks
# on two (the one that fits at head dim 256); 128- and 64-key blocks with tiles taken from a queue (TILE_QUEUE);
# head dim 256's one split K/V slot of 128 keys (SPLIT_KV).
_SEED_FORWARD_GLUON = (
    dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=4, num_stages=3),
    dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=4, num_stages=2),
    dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=4, num_stages=3, TILE_QUEUE=True),
    dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=4, num_stages=4, TILE_QUEUE=True),
    dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=4, num_stages=1),
)
_SEED_BACKWARD = (
    dict(LOADS="pointer", BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=8, num_stages=2),
    dict(LOADS="pointer", BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=2),
    dict(LOADS="pointer", BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, num_warps=4, num_stages=3),
    # Short sequences (16 x 512, GQA 32/8, D = 128): 0.541 ms against 0.603 for the default's tiles
    # (results/flash_bwd_tma_2026-12-02.txt).
    dict(LOADS="pointer", BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=3),
)
# The Gluon backward on Hopper (templates/flash_gluon_bwd.py.j2): its structure on two and three Q/dO slots.
_SEED_BACKWARD_GLUON = tuple(
    dict(LOADS=GLUON_WS, BLOCK_M1=GLUON_BWD_ROWS, BLOCK_N1=GLUON_BWD_KEYS, BLOCK_M2=GLUON_BWD_ROWS,
         BLOCK_N2=GLUON_BWD_KEYS, num_warps=4, num_stages=stages) for stages in (2, 3))


# The flags of flash's size options (heads_kv is spelled --kv-heads, as in every family).
_CLI_SIZE_FLAGS = {"batch": "--batch", "heads": "--heads", "heads_kv": "--kv-heads", "seq": "--seq",
                   "seq_k": "--seq-k", "head_dim": "--head-dim"}


def _check_cli_sizes(sizes: dict) -> None:
    """Sizes given on the command line are >= 1: a 0 would divide the batch default by zero, or read as not given."""
    for name, values in sizes.items():
        bad = [v for v in values if v < 1]
        if bad:
            raise ShapeMismatchError(f"{_CLI_SIZE_FLAGS[name]} must be >= 1, got {bad[0]}")


class FlashFamily(Family):
    name = "flash"
    template = "flash_attention.py.j2"
    problem_type = FlashProblem
    shape_fields = ("batch", "heads_q", "heads_kv", "seq_q", "seq_k")
    # A model layer keeps its heads, head dim, dtype and features; batch and lengths vary per call.
    serving_fields = ("batch", "seq_q", "seq_k")
    range_free_fields = ("aligned",)

    cli_options = (
        ProblemOption("batch", int, "batch size (default: tokens per batch kept near 8k)"),
        ProblemOption("heads", int, "query heads (default 32)"),
        ProblemOption("heads_kv", int, "key/value heads (default: as many as query heads)"),
        ProblemOption("seq", int, "query sequence length(s)", multiple=True),
        ProblemOption("seq_k", int, "key/value sequence length (default: the query length)"),
        ProblemOption("head_dim", int, "head dim(s), e.g. 64,128", multiple=True),
        ProblemOption("causal", str, "causal mask, plain, or both", default="both", choices=("yes", "no", "both")),
        ProblemOption("dtype", str, "operand dtype", default="bf16", choices=DTYPES),
        ProblemOption("direction", str, "forward, backward, or both", default="both", choices=("fwd", "bwd", "both")),
    )

    # --- problems -----------------------------------------------------------------
    def problem_key(self, problem: FlashProblem) -> str:
        data = problem_to_dict(problem)
        for name, off in FEATURE_DEFAULTS.items():
            if data[name] == off:
                del data[name]
        return canonical_json(data)

    def check_tensors(self, q, k, v, *, causal: bool = False, direction: str = "fwd", window: tuple = (-1, -1),
                      softcap: float = 0.0, alibi_slopes=None, empty_ok: bool = False) -> FlashProblem:
        """Shapes, dtypes and devices of q, k, v, without reading their data (so fake tensors pass too).

        Returns the problem as if aligned; `problem_from_tensors` looks at the pointers. `empty_ok`: a batch, query
        or key length of 0 passes (the problem then counts it as 1), for calls that launch nothing.
        """
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ShapeMismatchError(
                    f"{name} must be 4-D (batch, heads, seq, head_dim) as in SDPA, got shape {tuple(t.shape)}")
        if k.shape != v.shape:
            raise ShapeMismatchError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise ShapeMismatchError(
                f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch (dim 0) and head dim (dim 3)")
        dtype = _common_dtype(q, k, v)
        check_alibi(alibi_slopes, q.shape[0], q.shape[1], q.device)
        left, right = window_pair(window)
        batch, seq_q, seq_k = (max(size, 1) if empty_ok else size for size in (q.shape[0], q.shape[2], k.shape[2]))
        return FlashProblem(direction, batch, q.shape[1], k.shape[1], seq_q, seq_k, q.shape[3], bool(causal), dtype,
                            True, left, right, float(softcap), alibi_slopes is not None)

    def problem_from_tensors(self, q, k, v, *, causal: bool = False, direction: str = "fwd", **features) -> FlashProblem:
        problem = self.check_tensors(q, k, v, causal=causal, direction=direction, **features)
        return dataclasses.replace(problem, aligned=all(_aligned(t, 3) for t in (q, k, v)))

    def check_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, direction: str = "fwd", window: tuple = (-1, -1), softcap: float = 0.0,
                     alibi_slopes=None) -> FlashProblem:
        """The varlen problem of packed q (total_q, Hq, D), k/v (total_k, Hkv, D) and cumulative lengths (B + 1,) int32."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise ShapeMismatchError(
                    f"{name} must be 3-D (total_tokens, heads, head_dim) as in FlashAttention's varlen API, "
                    f"got shape {tuple(t.shape)}")
        if k.shape != v.shape:
            raise ShapeMismatchError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        if q.shape[2] != k.shape[2]:
            raise ShapeMismatchError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in head dim (dim 2)")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or cu.shape[0] < 2:
                raise BadInputError(f"{name} must be a 1-D int32 tensor of B + 1 cumulative lengths (starting at 0), "
                                    f"got {getattr(cu, 'dtype', type(cu).__name__)} of shape {tuple(getattr(cu, 'shape', ()))}")
            if cu.device != q.device:
                raise BadInputError(f"{name} is on {cu.device}, q on {q.device}: move it to q's device")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ShapeMismatchError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                                     f"{tuple(cu_seqlens_k.shape)} must describe the same number of sequences")
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInputError(f"{name} must be a positive int (the longest sequence), got {value!r}")
        dtype = _common_dtype(q, k, v)
        batch = cu_seqlens_q.shape[0] - 1
        check_alibi(alibi_slopes, batch, q.shape[1], q.device)
        left, right = window_pair(window)
        return FlashProblem(direction, batch, q.shape[1], k.shape[1], max_seqlen_q, max_seqlen_k, q.shape[2],
                            bool(causal), dtype, all(_aligned(t, 2) for t in (q, k, v)), left, right, float(softcap),
                            alibi_slopes is not None, True)

    def default_suite(self) -> list[FlashProblem]:
        problems = []
        for direction in DIRECTIONS:
            for head_dim in (64, 128):
                for seq in (1024, 2048, 4096, 8192, 16384):
                    for causal in (False, True):
                        problems.append(FlashProblem(direction, max(1, 8192 // seq), 32, 32, seq, seq, head_dim, causal))
        return problems

    def problems_from_cli(self, **options) -> list[FlashProblem]:
        def values(name) -> list[int]:
            # A multiple option arrives as a tuple of ints or of comma-separated strings.
            raw = options.get(name)
            if raw in (None, (), []):
                return []
            out = []
            for item in raw if isinstance(raw, (list, tuple)) else [raw]:
                out.extend([item] if isinstance(item, int) else [int(x) for x in str(item).split(",") if x.strip()])
            return out

        seqs, head_dims = values("seq"), values("head_dim")
        scalars = ("batch", "heads", "heads_kv", "seq_k")
        _check_cli_sizes({"seq": seqs, "head_dim": head_dims,
                          **{n: [options[n]] for n in scalars if options.get(n) is not None}})
        shape_given = seqs or head_dims or any(options.get(n) for n in scalars)
        directions = DIRECTIONS if options.get("direction", "both") == "both" else (options["direction"],)
        causals = {"yes": (True,), "no": (False,), "both": (False, True)}[options.get("causal") or "both"]
        dtype = options.get("dtype") or "bf16"
        if not shape_given:
            return [FlashProblem(p.direction, p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim, p.causal, dtype)
                    for p in self.default_suite() if p.direction in directions and p.causal in causals
                    and not (dtype == "fp8" and p.direction == "bwd")]
        heads = options.get("heads") or 32
        heads_kv = options.get("heads_kv") or heads
        problems = []
        for direction in directions:
            if dtype == "fp8" and direction == "bwd":
                continue
            for seq in seqs or [4096]:
                batch = options.get("batch") or max(1, 8192 // seq)
                for head_dim in head_dims or [128]:
                    for causal in causals:
                        problems.append(FlashProblem(direction, batch, heads, heads_kv, seq,
                                                     options.get("seq_k") or seq, head_dim, causal, dtype))
        return problems

    # --- the search -----------------------------------------------------------------
    def space(self, problem: FlashProblem, device: DeviceInfo) -> Space:
        require_dtypes(device, [problem.dtype, problem.out_dtype], f"{problem.dtype} flash attention")
        return self._forward_space(problem, device) if problem.direction == "fwd" else self._backward_space(problem, device)

    def _forward_space(self, p: FlashProblem, device: DeviceInfo) -> Space:
        size, bd = element_size(p.dtype), p.block_d

        def smem_bytes(c) -> int:
            # gluon_ws keeps one or two Q tiles.
            return forward_tiles_bytes(p, c, gluon_q_slots(p, c) if c["LOADS"] == GLUON_WS else 1)

        def accumulators(c) -> float:
            # O accumulator (BLOCK_M, BLOCK_D) and the score tile (BLOCK_M, BLOCK_N), fp32, per thread; gluon_ws's
            # 4-warp consumers each own 64 of the rows.
            rows = 64 if c["LOADS"] == GLUON_WS else c["BLOCK_M"]
            return (rows * bd + rows * c["BLOCK_N"]) / (32 * c["num_warps"])

        axes = [
            # How K/V tiles arrive (pointer loads or TMA descriptors), and whether the whole key blocks run
            # the look-ahead schedule (the next block's scores before this block's softmax). One axis, so
            # configs stored before the schedule existed stay points of the space.
            Axis("LOADS", LOADS_CHOICES, AxisKind.RENDER),
            Axis("BLOCK_M", _BLOCKS),
            Axis("BLOCK_N", _BLOCKS + (_WIDE_BLOCK_N,)),
            Axis("WARP_SPECIALIZE", (False, True)),
            # The masked key blocks in the whole blocks' pipelined loop, behind a branch (templates/flash_attention).
            Axis("MASKS_IN_LOOP", (False, True), AxisKind.RENDER),
            # gluon_ws's tiles (dense or packed) taken from an atomic queue by whichever program is free
            # (FlashAttention-3's dynamic persistent schedule), where static rounds are dealt in advance.
            Axis("TILE_QUEUE", (False, True), AxisKind.RENDER),
            Axis("num_warps", (1, 2, 4, 8)),
            # One stage: gluon_ws's split K/V slot only (below); a Triton loop on one stage loads nothing ahead.
            Axis("num_stages", (1, 2, 3, 4)),
        ]
        constraints = [
            Constraint("one_stage_split_kv", lambda c: c["num_stages"] >= 2 or gluon_split_kv(p, c),
                       "one K/V stage is for gluon_ws's 128-key blocks at head dim 256 (K and V given back apart)"),
            Constraint("tile_queue_gluon_ws", lambda c: not c["TILE_QUEUE"] or c["LOADS"] == GLUON_WS,
                       "the tile queue is the gluon_ws forward's schedule"),
            Constraint("masks_in_loop_needs_masks", lambda c: p.masked or not c["MASKS_IN_LOOP"],
                       "a problem without a mask has no masked key blocks to move into the loop"),
            # The look-ahead loop peels its first and last whole blocks by hand; warp specialisation of a loop with a
            # branch in it is unmeasured (Triton 3.6). Both keep the masked blocks in loops of their own.
            Constraint("masks_in_loop_plain_loop",
                       lambda c: not (c["MASKS_IN_LOOP"]
                                      and (c["LOADS"].endswith("_lookahead") or c["WARP_SPECIALIZE"])),
                       "MASKS_IN_LOOP runs one plain loop: not with the look-ahead schedule or warp specialisation"),
            Constraint("shared_memory", lambda c: smem_bytes(c) <= device.smem_per_block,
                       lambda c: f"needs {smem_bytes(c)} B of shared memory, the device allows {device.smem_per_block} B"),
            Constraint("accumulator_registers", lambda c: accumulators(c) <= _ACCUMULATOR_REGISTERS,
                       lambda c: f"{accumulators(c):.0f} fp32 accumulator values a thread would spill"),
            Constraint("rows_per_warp", lambda c: c["BLOCK_M"] >= _rows_needed(c["num_warps"]),
                       lambda c: f"{c['num_warps']} warps need at least {_rows_needed(c['num_warps'])} query rows"),
            Constraint("tile_within_problem",
                       lambda c: c["BLOCK_M"] <= _largest_block(p.seq_q) and c["BLOCK_N"] <= _largest_block(p.seq_k),
                       "a block larger than the next power of two of its sequence only computes padding"),
            Constraint("wide_key_blocks", lambda c: c["BLOCK_N"] != _WIDE_BLOCK_N or bd <= 64,
                       f"{_WIDE_BLOCK_N}-key blocks are for head dims <= 64"),
            Constraint("fp8_block_n", lambda c: p.dtype != "fp8" or c["BLOCK_N"] >= 32,
                       "fp8 P V dots need at least 32 keys along K"),
            Constraint("tma_alignment", lambda c: not uses_tma(c) or (p.aligned and (p.head_dim * size) % 16 == 0),
                       "TMA needs 16-byte aligned base pointers and strides, and a head dim of a multiple of 16 bytes"),
            Constraint("warp_specialize_tma_only", lambda c: uses_tma(c) or not c["WARP_SPECIALIZE"],
                       "warp specialisation splits TMA producers from mma consumers; pointer loads have no producer"),
            # NOTE: Triton 3.6's NVGPUWarpSpecialization pass fails ("PassManager::run failed") on every 4-warp
            # forward whose Q K^T MMAs read Q from shared memory (all 72 such candidates of the H200 sweep,
            # results/flash_policy_sweep_2026-12-01b.md); 8 warps compile.
            Constraint("warp_specialize_eight_warps", lambda c: not c["WARP_SPECIALIZE"] or c["num_warps"] >= 8,
                       "warp specialisation compiles with 8 warps only (Triton 3.6)"),
            Constraint("gluon_ws_applies", lambda c: c["LOADS"] != GLUON_WS or gluon_ws_ok(p, device),
                       "the gluon_ws forward runs on Hopper GPUs (not Triton's interpreter) for bf16/fp16 tensors with "
                       "TMA-able strides, head dims 64, 128 or 256, and no window's left side, soft-capping or ALiBi"),
            Constraint("gluon_ws_structure",
                       lambda c: c["LOADS"] != GLUON_WS or (
                           c["BLOCK_M"] == _GLUON_BLOCK_M and c["BLOCK_N"] in _GLUON_BLOCK_N and c["num_warps"] == 4
                           and not c["WARP_SPECIALIZE"] and not c["MASKS_IN_LOOP"]),
                       f"gluon_ws takes {_GLUON_BLOCK_M}-row query tiles on two 4-warp consumer warpgroups, key blocks "
                       f"of {' or '.join(map(str, _GLUON_BLOCK_N))}, its own warp specialisation and masks in its loop"),
        ]
        constraints += architecture_constraints(device, {
            Feature.TMA: (uses_tma, "TMA loads"),
            Feature.WARP_SPECIALIZE: (lambda c: c["WARP_SPECIALIZE"], "WARP_SPECIALIZE"),
            # The next block's scores overlap this block's softmax only while an asynchronous MMA runs.
            Feature.ASYNC_MMA: (lambda c: c["LOADS"].endswith("_lookahead"), "the look-ahead schedule"),
        })
        return Space(axes, constraints, upgrade=_forward_upgrade)

    def _backward_space(self, p: FlashProblem, device: DeviceInfo) -> Space:
        size, bd = element_size(p.dtype), p.block_d

        def smem_dkdv(c) -> int:
            # Resident K and V tiles, plus Q and dO tiles for every pipeline stage.
            return (2 * c["BLOCK_N1"] * bd + 2 * c["BLOCK_M1"] * bd * c["num_stages"]) * size

        def smem_dq(c) -> int:
            # Resident Q and dO tiles, plus K and V tiles for every pipeline stage.
            return (2 * c["BLOCK_M2"] * bd + 2 * c["BLOCK_N2"] * bd * c["num_stages"]) * size

        def acc_dkdv(c) -> float:
            # dK and dV accumulators (BLOCK_N1, BLOCK_D) and the P^T, dP^T tiles (BLOCK_N1, BLOCK_M1), fp32.
            return (2 * c["BLOCK_N1"] * bd + 2 * c["BLOCK_N1"] * c["BLOCK_M1"]) / (32 * c["num_warps"])

        def acc_dq(c) -> float:
            # dQ accumulator (BLOCK_M2, BLOCK_D) and the P, dP tiles (BLOCK_M2, BLOCK_N2), fp32.
            return (c["BLOCK_M2"] * bd + 2 * c["BLOCK_M2"] * c["BLOCK_N2"]) / (32 * c["num_warps"])

        def triton(rule):
            # The Triton backward's resource rules; the Gluon one has its structure and its own rules below.
            return lambda c: c["LOADS"] == GLUON_WS or rule(c)

        axes = [
            # How the dK/dV kernel's Q and dO tiles and the dQ kernel's K and V tiles arrive (gluon_ws: one kernel).
            Axis("LOADS", BACKWARD_LOADS_CHOICES, AxisKind.RENDER),
            Axis("BLOCK_M1", _BLOCKS),
            Axis("BLOCK_N1", _BLOCKS),
            Axis("BLOCK_M2", _BLOCKS),
            Axis("BLOCK_N2", _BLOCKS),
            Axis("num_warps", (1, 2, 4, 8)),
            Axis("num_stages", (2, 3, 4)),
        ]
        limit = device.smem_per_block
        constraints = [
            Constraint("shared_memory_dkdv", triton(lambda c: smem_dkdv(c) <= limit),
                       lambda c: f"the dK/dV kernel needs {smem_dkdv(c)} B of shared memory, the device allows {limit} B"),
            Constraint("shared_memory_dq", triton(lambda c: smem_dq(c) <= limit),
                       lambda c: f"the dQ kernel needs {smem_dq(c)} B of shared memory, the device allows {limit} B"),
            Constraint("accumulator_registers",
                       triton(lambda c: max(acc_dkdv(c), acc_dq(c)) <= _ACCUMULATOR_REGISTERS),
                       lambda c: f"{max(acc_dkdv(c), acc_dq(c)):.0f} fp32 accumulator values a thread would spill"),
            Constraint("rows_per_warp",
                       triton(lambda c: min(c["BLOCK_N1"], c["BLOCK_M2"]) >= _rows_needed(c["num_warps"])),
                       lambda c: f"{c['num_warps']} warps need at least {_rows_needed(c['num_warps'])} rows in the tile a program owns"),
            Constraint("tile_within_problem",
                       lambda c: max(c["BLOCK_M1"], c["BLOCK_M2"]) <= _largest_block(p.seq_q)
                       and max(c["BLOCK_N1"], c["BLOCK_N2"]) <= _largest_block(p.seq_k),
                       "a block larger than the next power of two of its sequence only computes padding"),
            Constraint("tma_alignment", lambda c: not uses_tma(c) or (p.aligned and (p.head_dim * size) % 16 == 0),
                       "TMA needs 16-byte aligned base pointers and strides, and a head dim of a multiple of 16 bytes"),
            Constraint("gluon_ws_applies", lambda c: c["LOADS"] != GLUON_WS or gluon_bwd_ok(p, device),
                       "the gluon_ws backward runs on Hopper GPUs (not Triton's interpreter) for bf16/fp16 tensors with "
                       "TMA-able strides, head dims up to 128 (64 and 128 tiles), causal or not, without windows, "
                       "soft-capping or ALiBi"),
            Constraint("gluon_ws_structure",
                       lambda c: c["LOADS"] != GLUON_WS or (
                           c["BLOCK_M1"] == c["BLOCK_M2"] == GLUON_BWD_ROWS
                           and c["BLOCK_N1"] == c["BLOCK_N2"] == GLUON_BWD_KEYS and c["num_warps"] == 4),
                       f"gluon_ws computes dQ in its dK/dV kernel, on {GLUON_BWD_ROWS}-row query steps over "
                       f"{GLUON_BWD_KEYS}-key tiles (BLOCK_M1 = BLOCK_M2 = {GLUON_BWD_ROWS}, BLOCK_N1 = BLOCK_N2 = "
                       f"{GLUON_BWD_KEYS}) on two 4-warp consumer warpgroups"),
            Constraint("gluon_ws_shared_memory",
                       lambda c: c["LOADS"] != GLUON_WS or gluon_bwd_smem(p, c) <= limit,
                       lambda c: f"the gluon_ws backward needs {gluon_bwd_smem(p, c)} B of shared memory, the device "
                                 f"allows {limit} B"),
        ]
        constraints += architecture_constraints(device, {Feature.TMA: (uses_tma, "TMA loads")})
        return Space(axes, constraints, upgrade=_backward_upgrade)


    def seed_configs(self, problem: FlashProblem, device: DeviceInfo) -> list[Config]:
        """Hopper configs of Triton's fused-attention tutorial, tried right after the default."""
        if problem.direction == "fwd":
            by_head = {256: _SEED_FORWARD_D256, 64: _SEED_FORWARD_D64}.get(problem.block_d, ())
            wanted = by_head + _SEED_FORWARD
            if gluon_ws_ok(problem, device):
                wanted = _SEED_FORWARD_GLUON + wanted
            if not problem.masked:
                # No masked key blocks: a seed's MASKS_IN_LOOP has nothing to move, its tile shape still counts.
                wanted = [dict(w, MASKS_IN_LOOP=False) for w in wanted]
            if not arch_of(device).supports(Feature.TMA):
                # Without TMA (sm80, sm89) each seed's tile shape is tried with plain pointer loads.
                wanted = [dict(w, LOADS="pointer", WARP_SPECIALIZE=False) for w in wanted]
        else:
            wanted = _SEED_BACKWARD
            if gluon_bwd_ok(problem, device):
                wanted = _SEED_BACKWARD_GLUON + wanted
        return device_seeds(self, problem, device, wanted)

    def default_config(self, problem: FlashProblem, device: DeviceInfo) -> Config:
        # Forward: measured on the H200 (_forward_default). Backward: the Gluon backward wherever it applies, else
        # triton_backward_default. The Gluon one led the Triton backward on every shape timed
        # (results/flash_bwd_2026-12-04.txt, calls 2-4): causal prefill of Llama-3-8B, Qwen2.5-7B, Qwen2.5-1.5B,
        # Llama-2-7B, Phi-3-mini (96 in 128-wide tiles) and Qwen2.5-0.5B (64) at 1 x 4096 to 16 x 512, and the anchors
        # (2 x 32 x 4096 at 128, causal and not; 3 x 12 x 2000, 4 x 32 x 2048 and 2 x 32 x 4096 at 64): 0.66-1.15x of
        # cuDNN against 0.37-0.90x.
        p = problem
        if p.direction == "fwd":
            return device_default(self, problem, device, self._forward_default(p, device))
        gluon = Config(_SEED_BACKWARD_GLUON[0])
        if self.space(problem, device).is_feasible(gluon):
            return device_default(self, problem, device, gluon)
        return self.triton_backward_default(problem, device)

    def triton_backward_default(self, problem: FlashProblem, device: DeviceInfo) -> Config:
        """The untuned backward among the Triton ones (flash_attention.py.j2), which are deterministic: the runtime's
        under torch.use_deterministic_algorithms(True) where the served config is the Gluon backward.

        Starting points of Triton's fused-attention tutorial on H100, narrowed by head dim so the accumulators fit
        in registers; at head dims 64 and 128 on sm90, 64 x 128 dK/dV tiles on 3 stages and 128 x 64 dQ tiles, the
        shipped H200 winner of 2 x 32 x 4096 causal, which also led six configs timed side by side
        (results/flash_bwd_configs_2026-12-02.txt: 2.07 ms against 2.94 for the tutorial's); at D = 64, 4 x 32 x 2048
        causal, 0.716 ms against the tutorial's 0.807 (results/flash_bwd_atomic_dq_2026-12-02.txt). first_feasible
        adapts either to short sequences and other GPUs."""
        p = problem
        wide = p.block_d >= 256
        preferred = dict(BLOCK_M1=32, BLOCK_N1=64 if wide else 128, BLOCK_M2=64 if wide else 128, BLOCK_N2=32,
                         num_warps=8 if p.block_d >= 128 else 4, num_stages=2)
        measured = dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=3)
        hopper = not device.interpret and device.compute_capability >= (9, 0)  # where it was measured
        if p.block_d in (64, 128) and hopper and self.space(problem, device).is_feasible(Config(measured)):
            preferred = measured
            if max(p.seq_q, p.seq_k) <= _SHORT_BACKWARD_TOKENS:
                preferred = dict(measured, BLOCK_M1=32)
        # TMA loads where the GPU has them and the head dim is 128 or more: with the same tiles, 1-5% faster at head
        # dims 128 and 256 and 3% slower at 64 (results/flash_bwd_tma_2026-12-02.txt). Packed sequences keep pointer
        # loads, as they were measured with.
        tma = (arch_of(device).supports(Feature.TMA) and not device.interpret and p.aligned and not p.varlen
               and p.block_d >= 128)
        preferred["LOADS"] = "tma" if tma else "pointer"
        return device_default(self, problem, device, preferred)

    @staticmethod
    def _forward_default(p: FlashProblem, device: DeviceInfo) -> dict:
        """The forward's untuned config, from H200 measurements of a grid of candidates on the causal prefill of
        Llama-3-8B, Qwen2.5-7B, Phi-3-mini and Gemma-2-9B at 1 x 4096, 4 x 2048 and 16 x 512 tokens, and two
        anchors (benchmarks/flash_policy_sweep.py, results/flash_policy_sweep_2026-12-01.md; the rule before,
        pointer loads on 128 x 64 tiles, reached 0.39-0.77x of cuDNN, geomean 0.60x; these 0.50-0.89x, 0.71x; with
        Q kept in shared memory, results/flash_policy_sweep_2026-12-01b.md, 0.62-0.91x, 0.75x):
        - TMA loads from _TMA_FROM_KEYS keys on (pointer loads led below, and take packed sequences and the
          interpreter);
        - head dims up to 128, causal: 64 x 64 tiles on 4 warps, 3 stages (the diagonal's masked blocks are small);
          with pointer loads and head dims 96-128 the masked blocks run in the whole blocks' loop (MASKS_IN_LOOP:
          16 x 512 prefill of Llama-3-8B and Qwen2.5-7B 0.75x of cuDNN against 0.69x, 4 x 2048 a tie,
          results/flash_policy_sweep_2026-12-02b_short.md; with TMA loads at 1 x 4096 it lost 6%, and at D = 64,
          3 x 12 x 2000, 250 TFLOP/s against 265, results/flash_2026-12-02f_quick.md);
        - head dims up to 128, not causal: 128 x 128 tiles on 8 warps, 3 stages, warp-specialised with TMA;
        - head dim 256: 128 x 64 tiles on 8 warps, 2 stages; causal with TMA loads, 64 x 64 tiles on 4 warps,
          3 stages (Gemma-2-9B at 1 x 4096: 0.80x of cuDNN against 0.75x, in two sweeps,
          results/flash_policy_sweep_2026-12-02.md).
        Before all of these, on Hopper, the gluon_ws forward where it led the sweep with its candidates
        (results/flash_policy_sweep_2026-12-03_gluon.md, one run): head dim 128, 128-key blocks on 3 slots, at every
        length (causal Llama-3-8B and Qwen2.5-7B prefill 0.98-1.03x of cuDNN from 4 x 2048 tokens, the rule before
        0.79-0.86x; 16 x 512 0.78x against 0.75x; 16k 1.02x against 0.88x; non-causal 4k 0.92x against 0.84x; GQA
        1000 x 3000 0.95x against 0.84x); head dim 256 below _TMA_FROM_KEYS keys, 64-key blocks on 2 slots (Gemma-2-9B
        4 x 2048 0.76x against 0.72x, 16 x 512 0.66x against 0.62x; from 4096 keys a tie or 2% behind). At head dim 64
        it lost (3 x 12 x 2000 causal 0.84x against 0.92x, 4 x 16 x 4096 0.87x against 0.90x) until its persistent
        rounds alternated direction and O left through a TMA store (results/gluon_variants_2026-12-03b.txt, _c.txt):
        from 2000 keys it leads (causal 3 x 12 x 2000 283 TFLOP/s against the pointer default's 264, 1 x 32/8 x 4096
        395 against the TMA default's 339; not causal, 4 x 16 x 4096, 439 against 410), at 16 x 512 it does not
        (200 against 217).
        Packed sequences (results/flash_2026-12-03d_varlen.md: 8 sequences of 512-2048 tokens, Llama heads) ran
        at 410 TFLOP/s on real tokens against the pointer default's 345, once gluon_ws numbered only the tiles that
        hold rows. A query tile of 128 rows needs more than 64 queries.
        Causal at head dim 128 up to _GLUON_SHORT_KEYS keys, 64-key blocks on 4 slots, where each warpgroup reads only
        the blocks its rows see and two Q slots fit (results/gluon_variants_2026-12-03e.txt: Llama-3-8B 16 x 512
        0.95x of cuDNN against 0.89x for 128-key blocks, Qwen2.5-7B 8 x 1024 0.99x against 0.98x; 4 x 2048 0.96x
        against 1.01x). Causal at head dim 256 at every length, once each warpgroup read only its own key blocks
        (results/gluon_variants_2026-12-03f.txt: Gemma-2-9B 1 x 8192 0.81x of cuDNN against the TMA default's 0.79x).
        A head dim that pads to a gluon_ws tile takes that tile's rules: Phi-3-mini's 96 in 128-wide tiles ran 0.91x
        of cuDNN at 16 x 512 against the pointer default's 0.75x, 0.95x at 4 x 2048 against 0.73x, 1.16x at 1 x 4096
        against 0.77x, and not causal at 2 x 4096 0.97x against the TMA default's 0.79x
        (results/gluon_variants_2026-12-04_phi_d96.txt). Head dim 256 past _GLUON_D256_SHORT_KEYS keys, causal or
        not, runs one split K/V slot of 128-key blocks (SPLIT_KV; results/gluon_variants_2026-12-04_split.txt:
        Gemma-2-9B 4 x 2048 causal 1.04x of cuDNN against 0.85x, 1 x 8192 not causal 0.99x against the TMA default's
        0.76x). More than one sequence at head dim 128 takes its tiles from a queue (_gluon_tile_queue)."""
        # A padded head dim (96 -> 128) runs its tile's rules: the kernel's work is the padded tile's.
        bd = p.block_d
        if gluon_ws_ok(p, device) and p.seq_q > 64 and (
                bd in (128, 256) or (bd == 64 and p.seq_k >= _GLUON_D64_FROM_KEYS)):
            queue = _gluon_tile_queue(p)
            if bd == 128 and p.causal and not p.varlen and p.seq_k <= _GLUON_SHORT_KEYS:
                return dict(LOADS=GLUON_WS, BLOCK_M=_GLUON_BLOCK_M, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=4,
                            num_stages=4, TILE_QUEUE=queue)
            if bd == 256 and p.seq_k > _GLUON_D256_SHORT_KEYS:
                return dict(LOADS=GLUON_WS, BLOCK_M=_GLUON_BLOCK_M, BLOCK_N=_GLUON_BLOCK_M, WARP_SPECIALIZE=False,
                            num_warps=4, num_stages=1, TILE_QUEUE=queue)  # one split K/V slot (SPLIT_KV)
            return dict(LOADS=GLUON_WS, BLOCK_M=_GLUON_BLOCK_M, BLOCK_N=128 if bd <= 128 else 64,
                        WARP_SPECIALIZE=False, num_warps=4, num_stages=3 if bd <= 128 else 2, TILE_QUEUE=queue)
        tma = (arch_of(device).supports(Feature.TMA) and not device.interpret and p.aligned and not p.varlen
               and p.seq_k >= _TMA_FROM_KEYS)
        loads = "tma" if tma else "pointer"
        if p.block_d >= 256 and tma and p.masked:
            return dict(LOADS=loads, BLOCK_M=64, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=4, num_stages=3)
        if p.block_d >= 256:
            return dict(LOADS=loads, BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, num_warps=8, num_stages=2)
        if p.masked:
            in_loop = not tma and p.block_d >= 128
            return dict(LOADS=loads, BLOCK_M=64, BLOCK_N=64, WARP_SPECIALIZE=False, MASKS_IN_LOOP=in_loop, num_warps=4,
                        num_stages=3)
        if p.block_d <= 64 and tma:
            # Head dim 64, not causal, 4 x 16 x 4096 (where gluon_ws does not apply): 0.91x of cuDNN on 4 warps without
            # warp specialisation, against 0.75x for the 8 warp-specialised ones below
            # (results/flash_policy_sweep_2026-12-03c.md).
            return dict(LOADS=loads, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=4, num_stages=3)
        return dict(LOADS=loads, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=tma, num_warps=8, num_stages=3)

    # --- the vendor op: SDPA's backends ------------------------------------------------
    def vendor_configs(self, problem: FlashProblem, device: DeviceInfo) -> list[Config]:
        # NOTE: none under the interpreter (CPU calls exist to run the generated kernel), none for fp8,
        # packed sequences or the model features, which SDPA does not express.
        return [Config({VENDOR_KEY: name}) for name in flash_vendor.backends_for(problem, device)]

    def vendor_run(self, problem: FlashProblem, config: Config, inputs: Tensors) -> Tensors:
        p, backend, scale = problem, config[VENDOR_KEY], default_scale(problem.head_dim)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        if p.direction == "fwd":
            o, lse = flash_vendor.forward(backend, q, k, v, causal=p.causal, scale=scale, need_lse=True)
            return {"o": o, "lse": lse}
        dq, dk, dv = flash_vendor.backward(backend, inputs["do"], q, k, v, inputs["o"], inputs["lse"],
                                           causal=p.causal, scale=scale)
        return {"dq": dq, "dk": dk, "dv": dv}

    def timed_call(self, problem: FlashProblem, config: Config, inputs: Tensors, outputs: Tensors):
        if not is_vendor(config):
            # The launch plan built once and kept, as the runtime op keeps it: building it on every call (`launch`)
            # timed host work, not the kernel (a 41 us forward of Llama-3-8B's 1025-token prefill timed 64 us).
            plan, args = self._planned(problem, config, inputs, outputs, scale=default_scale(problem.head_dim),
                                       keep=True)
            return lambda: plan(*args)
        q, k, v, backend = inputs["q"], inputs["k"], inputs["v"], config[VENDOR_KEY]
        scale, causal = default_scale(problem.head_dim), problem.causal
        if problem.direction == "fwd":
            # As a user calls it to infer: no log-sum-exp asked for.
            return lambda: flash_vendor.forward(backend, q, k, v, causal=causal, scale=scale, need_lse=False)
        if backend == flash_vendor.FLASH:
            return super().timed_call(problem, config, inputs, outputs)  # its ATen backward, on O and LSE
        # The backward alone, as the generated backward (given O and LSE) is timed: the forward runs once here
        # and keeps its graph. NOTE: flash_vendor.backward goes through autograd and runs the forward on every call
        # (cuDNN's backward of 2 x 32 x 4096 x 128 causal timed 2.01 ms that way, 1.54 ms alone).
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            out, _ = flash_vendor.forward(backend, *leaves, causal=causal, scale=scale, need_lse=False)
        grad_out = inputs["do"]
        return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)

    # --- data -----------------------------------------------------------------------
    def make_inputs(self, problem: FlashProblem, device: DeviceInfo, seed: int = 0) -> Tensors:
        p = problem
        gen = torch.Generator(device="cpu").manual_seed(seed)
        dev = device.torch_device
        pad = 0 if p.aligned else 1  # unaligned problems start one element into their storage
        if p.varlen:
            lens_q, lens_k = packed_lengths(p)
            shapes = {"q": (sum(lens_q), p.heads_q, p.head_dim), "k": (sum(lens_k), p.heads_kv, p.head_dim)}
        else:
            shapes = {"q": (p.batch, p.heads_q, p.seq_q, p.head_dim), "k": (p.batch, p.heads_kv, p.seq_k, p.head_dim)}
        shapes["v"] = shapes["k"]

        def tensor(shape: tuple, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            t = torch.empty(math.prod(shape) + pad, dtype=dtype, device=dev)[pad:].view(shape)
            t.copy_(values.to(dtype).to(dev))
            return t

        raw = {n: torch.randn(shapes[n], generator=gen) for n in "qkv"}
        if p.dtype == "fp8":
            # Per-tensor scaling as fp8 recipes do: amax maps to e4m3's largest value, 448.
            scales = torch.stack([raw[n].abs().max() / 448.0 for n in "qkv"]).float()
            inputs = {n: tensor(shapes[n], raw[n] / scales[i], torch.float8_e4m3fn) for i, n in enumerate("qkv")}
            inputs["descale"] = scales.to(dev)
            return inputs
        dtype = torch_dtype(p.dtype)
        inputs = {n: tensor(shapes[n], raw[n], dtype) for n in "qkv"}
        if p.alibi:
            inputs["alibi"] = alibi_slopes(p.heads_q).to(dev)
        if p.varlen:
            inputs["cu_seqlens_q"], inputs["cu_seqlens_k"] = cumulative(lens_q).to(dev), cumulative(lens_k).to(dev)
        if p.direction == "bwd":
            # O and LSE come from plain torch, so timing and checking the backward needs no forward kernel.
            with torch.no_grad():
                o, lse = self._attend(p, inputs, inputs["q"], inputs["k"], inputs["v"], dtype=torch.float32, lse=True)
            inputs["o"] = tensor(shapes["q"], o, dtype)
            inputs["lse"] = lse.float().contiguous()
            inputs["do"] = tensor(shapes["q"], torch.randn(shapes["q"], generator=gen), dtype)
        return inputs

    def allocate_outputs(self, problem: FlashProblem, inputs: Tensors) -> Tensors:
        q = inputs["q"]
        if problem.direction == "fwd":
            stats = (q.shape[1], q.shape[0]) if problem.varlen else q.shape[:3]
            return {"o": torch.empty(q.shape, dtype=torch_dtype(problem.out_dtype), device=q.device),
                    "lse": torch.empty(stats, dtype=torch.float32, device=q.device)}
        # Contiguous whatever the inputs' strides, as the op's fake implementation promises torch.compile.
        return {name: torch.empty(inputs[src].shape, dtype=inputs[src].dtype, device=q.device)
                for name, src in (("dq", "q"), ("dk", "k"), ("dv", "v"))}

    # --- references ---------------------------------------------------------------------
    def _attend(self, p: FlashProblem, inputs: Tensors, q, k, v, *, dtype: torch.dtype, lse: bool, scale=None):
        """Plain-torch attention of the problem at `dtype` over dense or packed q, k, v: o, or (o, lse)."""
        scale = default_scale(p.head_dim) if scale is None else scale
        slopes = inputs.get("alibi")

        def dense(q, k, v, slopes):
            side = [] if slopes is None else [per_batch_slopes(slopes.double(), q.shape[0])]

            def chunk(q, k, v, *s):
                a = s[0] if s else None
                o = attention_math(q, k, v, scale=scale, dtype=dtype, scores=p.scores, alibi_slopes=a)
                if not lse:
                    return o
                return o, log2_sum_exp(q, k, scale=scale, scores=p.scores, alibi_slopes=a).to(o.dtype)
            return map_head_chunks(chunk, q, k, v, *side)
        if not p.varlen:
            return dense(q, k, v, slopes)
        parts = []
        for b, (qb, kb, vb) in enumerate(zip(*(split_packed(t, inputs[c]) for t, c in
                                              ((q, "cu_seqlens_q"), (k, "cu_seqlens_k"), (v, "cu_seqlens_k"))))):
            parts.append(dense(qb, kb, vb, None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])))
        if not lse:
            return join_packed(parts)
        return join_packed([o for o, _ in parts]), torch.cat([s for _, s in parts], dim=2)[0]

    def _grads(self, p: FlashProblem, inputs: Tensors, q, k, v, do, *, dtype: torch.dtype):
        scale, slopes = default_scale(p.head_dim), inputs.get("alibi")
        if not p.varlen:
            return attention_grads(q, k, v, do, scale=scale, dtype=dtype, scores=p.scores, alibi_slopes=slopes)
        grads = []
        split = [split_packed(t, inputs[c]) for t, c in
                 ((q, "cu_seqlens_q"), (k, "cu_seqlens_k"), (v, "cu_seqlens_k"), (do, "cu_seqlens_q"))]
        for b, (qb, kb, vb, dob) in enumerate(zip(*split)):
            row = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
            grads.append(attention_grads(qb, kb, vb, dob, scale=scale, dtype=dtype, scores=p.scores, alibi_slopes=row))
        return tuple(join_packed(list(g)) for g in zip(*grads))

    def _dequantised(self, problem: FlashProblem, inputs: Tensors) -> tuple[torch.Tensor, ...]:
        if problem.dtype != "fp8":
            return inputs["q"], inputs["k"], inputs["v"]
        descale = inputs["descale"].double()
        return tuple(inputs[n].double() * descale[i] for i, n in enumerate("qkv"))

    def reference(self, problem: FlashProblem, inputs: Tensors) -> Tensors:
        p = problem
        q, k, v = (t.detach().double() for t in self._dequantised(p, inputs))
        if p.direction == "fwd":
            o, lse = self._attend(p, inputs, q, k, v, dtype=torch.float64, lse=True)
            return {"o": o, "lse": lse}
        dq, dk, dv = self._grads(p, inputs, q, k, v, inputs["do"].double(), dtype=torch.float64)
        return {"dq": dq, "dk": dk, "dv": dv}

    def plain_torch(self, problem: FlashProblem, inputs: Tensors) -> Tensors:
        """The same computation in plain torch at the problem's dtype: the yardstick of the FA rule."""
        p = problem
        if p.dtype == "fp8":
            return {"o": plain_fp8_forward(inputs["q"], inputs["k"], inputs["v"], inputs["descale"], p.causal,
                                           default_scale(p.head_dim))}
        dtype = torch_dtype(p.dtype)
        if p.direction == "fwd":
            with torch.no_grad():
                return {"o": self._attend(p, inputs, inputs["q"], inputs["k"], inputs["v"], dtype=dtype, lse=False)}
        dq, dk, dv = self._grads(p, inputs, inputs["q"], inputs["k"], inputs["v"], inputs["do"], dtype=dtype)
        return {"dq": dq, "dk": dk, "dv": dv}

    def tolerance(self, problem: FlashProblem) -> Tolerance:
        # Only the log-sum-exp is compared element-wise (the outputs and gradients follow the FA rule in
        # check()). It is fp32 from the same rounded inputs as the reference: the row sum of up to Sk
        # terms rounds by at most Sk * 2^-24 relative, exp2 on the GPU is ex2.approx (2^-22 relative),
        # and fp32 dots of D products add D * 2^-24 of |s| ~ 1; in log2 units, times 4 for headroom.
        # fp8 scores come from Hopper's fp8 tensor cores, which accumulate in ~14 bits (DeepSeek-V3
        # report, sec. 3.3.2): D unit-size terms whose partial sums grow like sqrt(D) make an error of
        # ~ D * 2^-14 before the 1/sqrt(D) scale, ~ sqrt(D) * 2^-14 in the scores; the log-sum-exp
        # moves by at most the largest score error. ALiBi biases reach slope * (Sq + Sk) (slopes <= 1),
        # and their fp32 products round by 2^-24 of that; soft-capping's tanh (from exp2 and a
        # division) is off by a few 2^-23 of the cap.
        p = problem
        fp8_scores = math.sqrt(p.head_dim) * 2.0**-14 if p.dtype == "fp8" else 0.0
        alibi = (p.seq_q + p.seq_k) * 2.0**-24 if p.alibi else 0.0
        softcap = p.softcap * 4 * 2.0**-23
        return Tolerance(atol=4.0 * (p.seq_k * 2.0**-24 + 2.0**-22 + p.head_dim * 2.0**-24 + fp8_scores + alibi + softcap)
                         / math.log(2.0) + 1e-6, rtol=2.0**-20)

    def check(self, problem: FlashProblem, inputs: Tensors, outputs: Tensors, expected: Tensors) -> CheckResult:
        plain = self.plain_torch(problem, inputs)
        results = []
        for name, want in expected.items():
            if name == "lse":
                result = compare(name, outputs[name], want, self.tolerance(problem))
            else:
                reduction = problem.seq_k if name in ("o", "dq") else problem.group * problem.seq_q
                result = fa_rule_check(name, outputs[name], want, plain[name], problem.out_dtype, reduction)
            if not result.ok:
                return result
            results.append(result)
        return CheckResult(True, "; ".join(r.message for r in results), max(r.max_abs_error for r in results))

    def cost(self, problem: FlashProblem) -> Cost:
        p = problem
        lengths = zip(*packed_lengths(p)) if p.varlen else [(p.seq_q, p.seq_k)] * p.batch
        pairs = 0
        for seq_q, seq_k in lengths:
            pairs += seen_pairs(seq_q, seq_k, p.causal, p.window_left, p.window_right)
        tokens_q, tokens_k = (sum(x) for x in packed_lengths(p)) if p.varlen else (p.batch * p.seq_q, p.batch * p.seq_k)
        forward = 4.0 * p.heads_q * pairs * p.head_dim  # Q K^T and P V
        size, out_size = element_size(p.dtype), element_size(p.out_dtype)
        q_elems = tokens_q * p.heads_q * p.head_dim
        kv_elems = tokens_k * p.heads_kv * p.head_dim
        rows = tokens_q * p.heads_q
        if p.direction == "fwd":
            return Cost(forward, float(q_elems * size + 2 * kv_elems * size + q_elems * out_size + 4 * rows))
        # Backward: Q K^T recomputed, dV, dP, dQ, dK: 5 matmuls against the forward's 2, as SDPA counts.
        moved = 3 * q_elems * size + 2 * kv_elems * size + q_elems * size + 2 * kv_elems * size + 4 * rows
        return Cost(2.5 * forward, float(moved))

    def baseline(self, problem: FlashProblem, inputs: Tensors) -> Baseline | None:
        p = problem
        if p.dtype == "fp8" or p.varlen or p.has_features:
            return None  # SDPA has no fp8 path, no packed sequences, windows, soft-capping or ALiBi
        f = torch.nn.functional
        kwargs = dict(scale=default_scale(p.head_dim), enable_gqa=p.heads_q != p.heads_kv)
        if p.causal and p.seq_q == p.seq_k:
            kwargs["is_causal"] = True
        elif p.causal:
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(p.seq_q, p.seq_k)
        if p.direction == "fwd":
            q, k, v = inputs["q"], inputs["k"], inputs["v"]
            return Baseline("SDPA", lambda: f.scaled_dot_product_attention(q, k, v, **kwargs))
        q, k, v = (inputs[n].detach().clone().requires_grad_(True) for n in "qkv")
        o = f.scaled_dot_product_attention(q, k, v, **kwargs)
        do = inputs["do"]
        return Baseline("SDPA backward", lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))

    # --- running --------------------------------------------------------------------
    def render_switches(self, problem: FlashProblem, config: Config) -> dict:
        p = problem
        forward = _forward_upgrade(config) if p.direction == "fwd" else {}  # its render axes, for older configs too
        return dict(
            RIGHT_BOUND=p.causal or p.window_right >= 0, LEFT_BOUND=p.window_left >= 0, SOFTCAP=p.softcap > 0,
            ALIBI=p.alibi, VARLEN=p.varlen, HEAD_PADDED=p.block_d != p.head_dim, FP8=p.dtype == "fp8",
            LOADS=(config["LOADS"].removesuffix("_lookahead") if p.direction == "fwd"
                   else _backward_render_loads(config)),
            LOOKAHEAD=p.direction == "fwd" and config["LOADS"].endswith("_lookahead"),
            MASKS_IN_LOOP=forward.get("MASKS_IN_LOOP", False),
            INPUT_PRECISION="ieee" if p.dtype == "fp32" else "", UPCAST_DOTS=False, STORE_LSE=True,
            Q_SLOTS=gluon_q_slots(p, config) if config["LOADS"] == GLUON_WS and p.direction == "fwd" else 1,
            TILE_QUEUE=forward.get("TILE_QUEUE", False),
            SPLIT_KV=gluon_split_kv(p, config),
        )

    def kernel_module(self, problem: FlashProblem, config: Config, interpret: bool, store_lse: bool = True):
        """The rendered, imported module; `store_lse=False` renders a forward for inference calls (no LSE written)."""
        switches = self.render_switches(problem, config)
        # NOTE: Triton 3.6's interpreter computes bf16 tl.dot wrongly; CPU runs upcast the dot operands.
        switches["UPCAST_DOTS"] = interpret and problem.dtype == "bf16"
        switches["STORE_LSE"] = store_lse or problem.direction == "bwd"
        return load_kernel_module(self.template, interpret=interpret, **switches)

    def launch(self, problem: FlashProblem, config: Config, inputs: Tensors, outputs: Tensors) -> None:
        self.run(problem, config, inputs, outputs, scale=default_scale(problem.head_dim))

    def plan(self, problem: FlashProblem, config: Config, inputs: Tensors, outputs: Tensors, *, scale: float,
             keep: bool = False, store_lse: bool = True):
        """The launch plan of `config` for tensors shaped and strided as these (see flash_launch).

        `keep`: the plan will be called again and again (a runtime op's): its launches bind the compiled kernels.
        `store_lse=False`: a forward that leaves outputs["lse"] unwritten (any tensor may stand in for it).
        """
        interpret = inputs["q"].device.type == "cpu"
        module = self.kernel_module(problem, config, interpret, store_lse)
        alibi = inputs.get("alibi")
        if problem.direction == "fwd":
            return forward_plan(module, problem, config, scale, inputs["q"], inputs["k"], inputs["v"], outputs["o"],
                                outputs["lse"], alibi, interpret, keep)
        if config["LOADS"] == GLUON_WS:
            return gluon_backward_plan(module, problem, config, scale, inputs["q"], inputs["k"], inputs["v"],
                                       inputs["o"], inputs["do"], inputs["lse"], outputs["dq"], outputs["dk"],
                                       outputs["dv"], keep and not interpret)
        return backward_plan(module, problem, config, scale, inputs["q"], inputs["k"], inputs["v"], inputs["o"],
                             inputs["do"], inputs["lse"], outputs["dq"], outputs["dk"], outputs["dv"], alibi, interpret,
                             keep)

    def run(self, problem: FlashProblem, config: Config, inputs: Tensors, outputs: Tensors, *, scale: float) -> None:
        """`launch` with the softmax scale given (the runtime op passes the user's)."""
        plan, args = self._planned(problem, config, inputs, outputs, scale=scale)
        plan(*args)

    def _planned(self, problem: FlashProblem, config: Config, inputs: Tensors, outputs: Tensors, *, scale: float,
                 keep: bool = False) -> tuple:
        """(launch plan, the tensors it is called with) for these inputs and outputs."""
        plan = self.plan(problem, config, inputs, outputs, scale=scale, keep=keep)
        lse = inputs["lse"] if problem.direction == "bwd" else outputs["lse"]
        alibi = inputs.get("alibi", lse)
        cu_q, cu_k = inputs.get("cu_seqlens_q", lse), inputs.get("cu_seqlens_k", lse)
        if problem.direction == "fwd":
            return plan, (inputs["q"], inputs["k"], inputs["v"], outputs["o"], lse, inputs.get("descale", lse), alibi,
                          cu_q, cu_k)
        delta = torch.empty_like(lse)  # rowsum(dO * O), laid out as lse
        return plan, (inputs["q"], inputs["k"], inputs["v"], inputs["o"], inputs["do"], lse, delta, outputs["dq"],
                      outputs["dk"], outputs["dv"], alibi, cu_q, cu_k)


def _common_dtype(q, k, v) -> str:
    from autotile.dtypes import canonical_dtype_name

    if not (q.device == k.device == v.device):
        raise BadInputError(f"q, k, v are on {q.device}, {k.device}, {v.device}: move them to one device")
    if not (q.dtype == k.dtype == v.dtype):
        raise UnsupportedDtypeError(f"q, k, v are {q.dtype}, {k.dtype}, {v.dtype}: cast them to one dtype")
    try:
        dtype = canonical_dtype_name(q.dtype)
    except UnsupportedDtypeError:
        dtype = str(q.dtype)
    if dtype not in DTYPES:
        raise UnsupportedDtypeError(
            f"flash attention takes fp16, bf16 or fp32 tensors (fp8 e4m3 forward only), got {q.dtype}; cast with .to(torch.bfloat16)")
    return dtype


def window_pair(window) -> tuple[int, int]:
    """FlashAttention's window_size=(left, right), -1 for an unbounded side; None means (-1, -1)."""
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise BadInputError(f"window must be a pair (left, right) of ints, -1 for no limit, got {window!r}") from None
    for value in (left, right):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise BadInputError(f"window must be a pair (left, right) of ints >= -1 (-1: no limit), got {window!r}")
    return left, right


def check_alibi(slopes, batch: int, heads_q: int, device) -> None:
    if slopes is None:
        return
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32 or slopes.shape not in (
            (heads_q,), (batch, heads_q)):
        raise BadInputError(f"alibi_slopes must be a float32 tensor of shape ({heads_q},) or ({batch}, {heads_q}), got "
                            f"{getattr(slopes, 'dtype', type(slopes).__name__)} {tuple(getattr(slopes, 'shape', ()))}")
    if slopes.stride(-1) != 1:
        raise BadInputError("alibi_slopes must have unit stride along heads: pass alibi_slopes.contiguous()")
    if slopes.device != device:
        raise BadInputError(f"alibi_slopes is on {slopes.device}, q on {device}: move it to q's device")


def _aligned(t: torch.Tensor, dims: int) -> bool:
    """Base pointer and the leading `dims` strides are multiples of 16 bytes (what TMA descriptors need)."""
    return t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:dims])


FAMILY = FlashFamily()
