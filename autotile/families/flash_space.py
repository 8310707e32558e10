"""The FlashAttention family's search space: the forward's and the backward's axes, the constraints that keep only
the configs a GPU builds and runs (shared memory, accumulator registers, TMA, the Gluon kernels' fixed structures) and
the resource estimates they rest on; the seeds of a search and the untuned defaults, from H200 measurements.

FlashFamily (flash.py) delegates its space, seed_configs, default_config and triton_backward_default here. The
functions given the family call its `space`, and its `first_feasible` through autotile.arch's device_seeds and
device_default, so that they see the family as its callers do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from autotile.arch import (Feature, arch_of, architecture_constraints, device_default, device_seeds,
                           require_dtypes)
from autotile.device import HOPPER_SMEM_PER_BLOCK, DeviceInfo
from autotile.dtypes import element_size
from autotile.families.base import next_pow2
from autotile.families.flash_launch import GLUON_BWD_KEYS, GLUON_BWD_ROWS, GLUON_WS
from autotile.space import Axis, AxisKind, Config, Constraint, Space

if TYPE_CHECKING:
    from autotile.families.flash import FlashFamily, FlashProblem


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


# Shared memory a gluon_ws forward's tiles (Q slots, K/V stages, O buffers) may take: the rest holds its barriers and
# the packed tiles' buffer (1 KB).
_GLUON_TILES_SMEM = HOPPER_SMEM_PER_BLOCK - 1024


def gluon_q_slots(problem, config) -> int:
    """Q slots of a gluon_ws forward (Hopper only): two (the next tile's Q loads during this tile's key loop) with
    64-key blocks where they fit beside the K/V stages, its barriers and tile buffer (1 KB), else one. 16 x 512
    Llama-3-8B causal at 128 x 64 on 4 stages: 0.93x of cuDNN with one slot, 0.95x with two; 1 x 4096 1.02x and 1.01x
    (results/gluon_variants_2026-12-03e.txt)."""
    fits = forward_tiles_bytes(problem, config, q_tiles=2) <= _GLUON_TILES_SMEM
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


# The Gluon forward's padded head dims run in two parts (HEAD_SPLIT in templates/flash_gluon_ws.py.j2): 96 = 64 + 32
# (Phi-3), each part with its own descriptors, slots and wgmmas, so that Q K^T is HEAD_DIM deep and O HEAD_DIM wide,
# where 128-wide tiles spend 4/3 of the MMA work on TMA's zeros. Checked against float64 on an H100, dense and packed,
# causal and not, every tile and key block the space offers, static rounds and the queue, the same bits twice
# (results/gpu_tests_2026-12-08a_h100_head_split.txt). Each Phi-3-mini causal default, x SDPA's best (cuDNN), padded ->
# split (results/gluon_head_split_2026-12-08a_h100.md): 1 x 4096 1.127x -> 1.201x, 4 x 2048 0.815x -> 0.849x,
# 8 x 1024 0.814x -> 0.821x, 16 x 512 0.798x -> 0.799x; no row slower. Short sequences gain little: their time is
# not the MMA work.
GLUON_HEAD_SPLIT = True
# The second parts HEAD_SPLIT takes (columns past BLOCK_D / 2). The template also takes 16-column tails (80 = 64 + 16,
# 48 = 32 + 16; compiled for sm90 in tests/test_flash_gluon.py): at head dim 80 the split ran 1.221x of cuDNN against
# 1.064x padded at 4 x 2048 and 1.084x against 0.958x at 16 x 512 (the same file, checked against float32 there).
# They join once their float64 test (test_flash_gluon_gpu.py -k head_split) has run.
HEAD_SPLIT_TAILS = (32,)
# Soft-capped, windowed and ALiBi calls keep the padded tiles until the GPU test's cases with those features have run
# (`-k "head_split and (softcap or window)"`).
HEAD_SPLIT_WITH_FEATURES = False


def gluon_head_split(problem, config) -> bool:
    """Whether a gluon_ws forward runs its padded head dim in two parts (HEAD_SPLIT): half the tile's width and a tail
    of HEAD_SPLIT_TAILS, on tiles up to 128 wide (256-wide ones are unmeasured), where GLUON_HEAD_SPLIT is on; with
    soft-capping, a window's left side or ALiBi only where HEAD_SPLIT_WITH_FEATURES is."""
    p = problem
    plain = HEAD_SPLIT_WITH_FEATURES or (p.softcap == 0 and p.window_left < 0 and not p.alibi)
    return (GLUON_HEAD_SPLIT and p.direction == "fwd" and config["LOADS"] == GLUON_WS and p.head_dim < p.block_d <= 128
            and p.head_dim - p.block_d // 2 in HEAD_SPLIT_TAILS and plain)


# gluon_ws forwards deal their tiles in groups of heads sized for L2 (HEAD_GROUPS in templates/flash_gluon_ws.py.j2;
# the group: flash_launch.forward_head_group): dense causal calls where FORWARD_HEAD_GROUPS is on, packed ones (whose
# order is query tile first, causal or not) where FORWARD_HEAD_GROUPS_PACKED is. NOTE: both off until the float64
# test (test_flash_gluon_gpu.py -k head_groups) has run and benchmarks/prototypes/gluon_head_group_time.py has timed
# them against the template's order; off, the template keeps its own order.
FORWARD_HEAD_GROUPS = False
FORWARD_HEAD_GROUPS_PACKED = False


def gluon_head_groups(problem, config) -> bool:
    """Whether a gluon_ws forward takes its tile order's head group as an argument (HEAD_GROUPS): dense calls whose
    keys have a right bound where FORWARD_HEAD_GROUPS is on, packed calls where FORWARD_HEAD_GROUPS_PACKED is."""
    p = problem
    if p.direction != "fwd" or config["LOADS"] != GLUON_WS:
        return False
    return FORWARD_HEAD_GROUPS_PACKED if p.varlen else FORWARD_HEAD_GROUPS and (p.causal or p.window_right >= 0)


# gluon_ws forwards' O through a shared-memory buffer of each consumer warpgroup's own (O_BUFFER in
# templates/flash_gluon_ws.py.j2), where it fits beside the Q slots and K/V stages, in place of the last key block's
# slot. Through the slot, a warpgroup waits at every tile's end for the other's last P V (64-key blocks: causal tiles
# give the first warpgroup one block fewer) or Q K^T, and for its TMA store to read the slot before giving it back;
# through a buffer it waits for neither, and for the store only a tile later. Short prefill is where a tile's end
# counts most (16 x 512: 2-8 blocks of 64 keys a tile). It fits with 64-key blocks up to head dim 128 (two Q slots and
# four K/V stages at 128: 224 KB) and with 128-key blocks at head dim 64. NOTE: off until its float64 test
# (test_flash_gluon_gpu.py -k o_buffer) has run and it has been timed against the slot
# (benchmarks/prototypes/gluon_o_buffer_time.py).
FORWARD_O_BUFFER = False


def gluon_o_buffer(problem, config) -> bool:
    """Whether a gluon_ws forward's O leaves through buffers of its warpgroups' own (O_BUFFER): where
    FORWARD_O_BUFFER is on and the two warpgroups' buffers (a query tile's rows) fit beside its Q slots and K/V
    stages (not SPLIT_KV's one slot)."""
    p = problem
    if not FORWARD_O_BUFFER or p.direction != "fwd" or config["LOADS"] != GLUON_WS or gluon_split_kv(p, config):
        return False
    buffers = config["BLOCK_M"] * p.block_d * element_size(p.dtype)
    return forward_tiles_bytes(p, config, gluon_q_slots(p, config)) + buffers <= _GLUON_TILES_SMEM


# Keys up to which causal gluon_ws forwards at head dim 128 take 64-key blocks (see forward_default).
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


# The Gluon forward's soft-capping (Gemma-2's every call; templates/flash_gluon_ws.py.j2, SOFTCAP). Checked against
# float64 on an H100 at every tile and key block its space offers (tests/test_flash_gluon_gpu.py::
# test_gluon_ws_soft_caps_as_float64), and 1.34-1.60x the Triton forward's speed through the op on Gemma-2-9B and
# -27B causal prefill, 1 x 4096 to 16 x 512 (results/gluon_softcap_2026-12-05_h100.md). Off, soft-capped calls take
# the Triton forward (benchmarks/prototypes/gluon_features_time.py times the two).
GLUON_SOFTCAP = True
# The Gluon forward's sliding windows (Mistral-7B v0.1, Gemma-2's and Gemma-3's local layers;
# templates/flash_gluon_ws.py.j2, LEFT_BOUND: a tile's loads and key loop start at its first row's window). Checked
# against float64 on an H100 at every tile and key block its space offers, windows of 0-300 keys, dense, packed,
# soft-capped and from the tile queue (tests/test_flash_gluon_gpu.py, results/gpu_tests_2026-12-05_gluon_window_h100.txt);
# through the op 1.27-1.42x the Triton forward's speed on causal prefill of Mistral-7B v0.1 (4096 keys), Gemma-3-12B
# and -27B (1024) and Gemma-2-9B's local layers (4096, soft-capped) at 4k-16k tokens, and 1.6-3.5x FlexAttention's
# (results/gluon_window_2026-12-05_h100.md). Off, windowed calls take the Triton forward.
GLUON_WINDOW = True
# Windows with both sides (not causal) compose the two masks above: correct against float64 on an H100, but 0.63-0.82x
# the Triton forward on ModernBERT's (64, 64) bands at 4 x 8192 and 16 x 2048, two or three key blocks a query block
# (results/gluon_gated_2026-12-06_h100_two_sided.md). Off: such calls take the Triton forward.
GLUON_TWO_SIDED_WINDOW = False
# ALiBi's per-head linear biases (BLOOM, MPT, Falcon-RW, Baichuan-13B; templates/flash_gluon_ws.py.j2, ALIBI: the bias
# added to the scaled logits before their row maxima): correct against float64 on an H100; 1.19x the Triton forward
# on MPT-7B at 1 x 4096 causal, 0.92x and 0.90x at 4 x 2048 and 16 x 512, where the untuned config takes the tile
# queue (results/gluon_gated_2026-12-06_h100_alibi.md). Off until a rule picks its shapes: ALiBi calls take the
# Triton forward.
GLUON_ALIBI = False


def gluon_ws_ok(problem, device: DeviceInfo) -> bool:
    """Whether the gluon_ws forward (templates/flash_gluon_ws.py.j2) applies: Hopper's wgmma and TMA compiled by
    Triton (never its interpreter, which does not run Gluon), 16-bit dense tensors with TMA-able strides, a head dim
    that is or pads to 64, 128 or 256 (96 -> 128: TMA fills the padding, or the tiles take it in two parts,
    gluon_head_split), dense or packed, and no feature but a right bound (causal, or a window's right side),
    soft-capping (GLUON_SOFTCAP), ALiBi (GLUON_ALIBI) and, where GLUON_WINDOW is on, a window's left side (with a right
    side too only where GLUON_TWO_SIDED_WINDOW is)."""
    p = problem
    return (not device.interpret and device.compute_capability[0] == 9 and p.direction == "fwd"
            and p.dtype in ("bf16", "fp16") and p.aligned and p.block_d in _GLUON_HEAD_DIMS and p.head_dim % 8 == 0
            and (p.window_left < 0 or (GLUON_WINDOW and (p.window_right < 0 or GLUON_TWO_SIDED_WINDOW)))
            and (p.softcap <= 0 or GLUON_SOFTCAP) and (not p.alibi or GLUON_ALIBI))


# The Gluon backward's causal sliding windows (templates/flash_gluon_bwd.py.j2, LEFT_BOUND: a tile walks the query
# blocks whose windows reach its keys). Checked against float64 on an H100 (windows of 0, 63 and 300 keys, Sq != Sk
# with keys no query sees, shared tiles, head dim 64, packed sequences:
# results/gpu_tests_2026-12-05_gluon_bwd_window_h100.txt); 1.40-1.43x the Triton backward on Mistral-7B v0.1 (4096
# keys) and Gemma-3-27B (1024) at 1 x 8192 (results/gluon_bwd_window_2026-12-05_h100.md). Off, windowed calls take the
# Triton backward.
GLUON_BWD_WINDOW = True
# Windows of calls that are not causal (a left side, a right side or both: ModernBERT's local layers, encoders) in the
# Gluon backward (RIGHT_WINDOW: the right bound an argument; LEFT_BOUND as above). Checked against float64 on an H100
# (results/gluon_gated_2026-12-06_h100_tests.txt); 1.14x and 1.32x the Triton backward on ModernBERT-base and -large
# at 4 x 8192 with a (64, 64) window, H200 (results/gluon_bwd_features_2026-12-06_h200.md).
GLUON_BWD_NON_CAUSAL_WINDOW = True
# ALiBi in the Gluon backward (ALIBI: P^T recomputed with the forward's bias). Checked against float64 on an H200,
# slopes (Hq,) and (B, Hq), causal and not, beside windows and packed sequences; 1.79x and 1.60x the Triton backward
# on MPT-7B at 1 x 4096 and 4 x 2048 causal (the same file).
GLUON_BWD_ALIBI = True
# Soft-capping in the Gluon backward (SOFTCAP: tanh again in P^T; P^T times the cap's derivative waits for dS^T in
# shared memory: 27-28 key-loop spill instructions against 15-18 without, where the derivative in registers took
# 153). Checked against float64 on an H200 (every slot count, causal and not, head dims 64-128 and 96 padded, packed,
# Gemma-2's local layers); 1.71x and 1.72x the Triton backward on Gemma-2-27B's global and local layers at 1 x 8192.
GLUON_BWD_SOFTCAP = True


def gluon_bwd_ok(problem, device: DeviceInfo) -> bool:
    """Whether the Gluon backward (templates/flash_gluon_bwd.py.j2) applies: Hopper, compiled (not interpreted),
    16-bit tensors with TMA-able strides, dense or packed, a head dim that is or pads to 64 or 128, causal or not,
    a causal call's sliding window where GLUON_BWD_WINDOW is on, other windows where GLUON_BWD_NON_CAUSAL_WINDOW is,
    ALiBi where GLUON_BWD_ALIBI is and soft-capping where GLUON_BWD_SOFTCAP is, not both."""
    p = problem
    windowed = p.window_left >= 0 or p.window_right >= 0
    window_ok = not windowed or (GLUON_BWD_WINDOW if p.causal else GLUON_BWD_NON_CAUSAL_WINDOW)
    return (not device.interpret and device.compute_capability[0] == 9 and p.direction == "bwd"
            and p.dtype in ("bf16", "fp16") and p.aligned and p.block_d in _GLUON_BWD_HEAD_DIMS
            and p.head_dim % 8 == 0 and window_ok and (not p.alibi or GLUON_BWD_ALIBI)
            and (p.softcap <= 0 or (GLUON_BWD_SOFTCAP and not p.alibi)))


def gluon_bwd_smem(problem, config) -> int:
    """Shared memory of a Gluon backward config, an upper bound: K and V of a tile, num_stages slots of Q, dO and
    their row statistics, two dS^T buffers, barriers, each consumer warpgroup's staging buffer for its fp32 dQ block
    (64 rows x 64 columns), which a TMA reduction adds to dQ, and (SOFTCAP) a 128 x 64 fp32 tile (sm90 builds:
    198,096 B at head dim 128 on two slots against 198,144 here, 166,352 at 64 on four against 166,400, soft-capped
    230,864 at 128 on two against 230,912; tests/test_flash_gluon_bwd.py)."""
    size, bd = element_size(problem.dtype), problem.block_d
    rows, keys = GLUON_BWD_ROWS, GLUON_BWD_KEYS
    slot = 2 * rows * bd * size + 2 * rows * 4
    dq_scratch = 2 * rows * 64 * 4
    capped = keys * rows * 4 if problem.softcap > 0 else 0  # SOFTCAP: P^T times the cap's derivative, fp32
    return (2 * keys * bd * size + config["num_stages"] * slot + 2 * keys * rows * size + 64 * 8 + dq_scratch
            + capped)


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


def space(problem: FlashProblem, device: DeviceInfo) -> Space:
    """The configs of the problem's direction that `device` can run."""
    require_dtypes(device, [problem.dtype, problem.out_dtype], f"{problem.dtype} flash attention")
    return forward_space(problem, device) if problem.direction == "fwd" else backward_space(problem, device)


def forward_space(p: FlashProblem, device: DeviceInfo) -> Space:
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


def backward_space(p: FlashProblem, device: DeviceInfo) -> Space:
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


def seed_configs(family: FlashFamily, problem: FlashProblem, device: DeviceInfo) -> list[Config]:
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
    return device_seeds(family, problem, device, wanted)


def default_config(family: FlashFamily, problem: FlashProblem, device: DeviceInfo) -> Config:
    # Forward: measured on the H200 (forward_default). Backward: the Gluon backward wherever it applies, else
    # triton_backward_default. The Gluon one led the Triton backward on every shape timed
    # (results/flash_bwd_2026-12-04.txt, calls 2-4): causal prefill of Llama-3-8B, Qwen2.5-7B, Qwen2.5-1.5B,
    # Llama-2-7B, Phi-3-mini (96 in 128-wide tiles) and Qwen2.5-0.5B (64) at 1 x 4096 to 16 x 512, and the anchors
    # (2 x 32 x 4096 at 128, causal and not; 3 x 12 x 2000, 4 x 32 x 2048 and 2 x 32 x 4096 at 64): 0.66-1.15x of
    # cuDNN against 0.37-0.90x.
    p = problem
    if p.direction == "fwd":
        return device_default(family, problem, device, forward_default(p, device))
    gluon = Config(_SEED_BACKWARD_GLUON[0])
    if family.space(problem, device).is_feasible(gluon):
        return device_default(family, problem, device, gluon)
    return triton_backward_default(family, problem, device)


def triton_backward_default(family: FlashFamily, problem: FlashProblem, device: DeviceInfo) -> Config:
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
    if p.block_d in (64, 128) and hopper and family.space(problem, device).is_feasible(Config(measured)):
        preferred = measured
        if max(p.seq_q, p.seq_k) <= _SHORT_BACKWARD_TOKENS:
            preferred = dict(measured, BLOCK_M1=32)
    # TMA loads where the GPU has them and the head dim is 128 or more: with the same tiles, 1-5% faster at head
    # dims 128 and 256 and 3% slower at 64 (results/flash_bwd_tma_2026-12-02.txt). Packed sequences keep pointer
    # loads, as they were measured with.
    tma = (arch_of(device).supports(Feature.TMA) and not device.interpret and p.aligned and not p.varlen
           and p.block_d >= 128)
    preferred["LOADS"] = "tma" if tma else "pointer"
    return device_default(family, problem, device, preferred)


def forward_default(p: FlashProblem, device: DeviceInfo) -> dict:
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
