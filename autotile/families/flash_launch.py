"""The flash kernels' launch arguments, worked out once per call signature.

A plan holds everything a launch needs besides the tensors (kernel, grid, strides, sizes, scale,
feature values, constexprs), so the runtime op's hot path is a dict lookup plus the launch:
`plan(q, k, v, o, lse, ...)`. Strides come from sample tensors; a plan is reused only for tensors
with the same shapes and strides (the runtime keys plans by them).

Layouts: dense Q/O (B, H, S, D) and LSE (B, Hq, S); packed (varlen) Q/O (total, H, D) and LSE
(Hq, total_q), which the kernels read with a zero batch stride and per-sequence row offsets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from autotile.device import current_device
from autotile.dtypes import element_size
from autotile.families.flash_reference import LOG2E
from autotile.families.gemm_launch import tile_counters
from autotile.launch import KeptEncodings, bind, bind_descriptors, launch
from autotile.render import launching

# The forward written in Gluon with FlashAttention-3's structure (templates/flash_gluon_ws.py.j2): persistent, a TMA
# producer warp and two consumer warpgroups of 64 query rows each. A value of the forward's LOADS axis.
GLUON_WS = "gluon_ws"


def _cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def rows_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, row) strides: (B, H, S, D) tensors as they are, packed (total, H, D) ones with batch stride 0."""
    return (0, t.stride(1), t.stride(0)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of the row statistics: (B, Hq, Sq), or (Hq, total_q) for packed sequences."""
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def feature_scalars(problem, scale: float) -> tuple:
    """sm_scale, win_left, win_right, softcap as the kernels take them (unused ones harmless: 0 and 1.0)."""
    p = problem
    win_left = max(p.window_left, 0)
    win_right = 0 if p.causal else max(p.window_right, 0)
    return (float(scale), win_left, win_right, float(p.softcap) if p.softcap > 0 else 1.0)


class _Launch:
    """One kernel launch with everything but the leading tensors fixed.

    A kept launch (`keep=True`: a runtime op's plan, called again and again with tensors of one signature)
    binds the compiled kernel on its first GPU call and then calls its C launcher directly
    (autotile.launch.bind); otherwise it goes through autotile.launch.launch.
    """

    __slots__ = ("kernel", "grid", "scalars", "options", "keep", "bound")

    def __init__(self, kernel, grid: tuple, scalars: tuple, options: dict, keep: bool):
        self.kernel, self.grid, self.scalars, self.options, self.keep = kernel, grid, scalars, options, keep
        self.bound = None

    def __call__(self, *tensors) -> None:
        if self.bound is not None:
            self.bound(*tensors, *self.scalars)
        elif self.keep:
            self.bound = bind(self.kernel, self.grid, *tensors, *self.scalars, **self.options)
            self.keep = self.bound is not None  # launch hooks or the interpreter: the ordinary path from now on
        else:
            launch(self.kernel, self.grid, *tensors, *self.scalars, **self.options)


class _DescriptorLaunch(_Launch):
    """A _Launch of a Gluon kernel whose leading arguments are host-built TMA descriptors of the call's first
    `described` tensors: `describe(*tensors[:described])` builds them (a rendered module's tensor_descriptors). The
    tensors follow them as pointers, all of them (the forward's q, k, v, o) or, `pointers_too=False`, those after
    the described ones (the backward's).

    A kept launch binds with bind_descriptors, and then encodes a descriptor only for a base address it has not
    seen (autotile.launch.KeptEncodings): the plan fixes shapes and strides. `sources`: the tensor each descriptor
    describes, by index (default: one descriptor a tensor, in order; a split head dim describes each tensor twice).
    """

    __slots__ = ("describe", "described", "pointers_too", "encodings", "queue", "sources")

    def __init__(self, kernel, grid: tuple, scalars: tuple, options: dict, keep: bool, describe, queue: bool = False,
                 described: int = 4, pointers_too: bool = True, sources: tuple = ()):
        super().__init__(kernel, grid, scalars, options, keep)
        self.describe, self.described, self.pointers_too = describe, described, pointers_too
        self.sources = tuple(sources) or tuple(range(described))
        self.encodings = ()
        # The kernel takes a tile queue after the descriptors (TILE_QUEUE): two counters, zero at launch and left
        # zero, from the current stream's (gemm_launch.tile_counters, which every kernel using them leaves zero).
        self.queue = queue

    def __call__(self, *tensors) -> None:
        queue = (tile_counters(tensors[0].device, 2),) if self.queue else ()
        pointers = tensors if self.pointers_too else tensors[self.described:]
        if self.bound is not None:
            encoded = [x for encode, source in zip(self.encodings, self.sources) for x in encode(tensors[source])]
            self.bound(*encoded, *queue, *pointers, *self.scalars)
        elif self.keep:
            bound = bind_descriptors(self.kernel, self.grid, *self.describe(*tensors[:self.described]), *queue,
                                     *pointers, *self.scalars, **self.options)
            if bound is None:  # launched through Triton's own path (launch hooks): the ordinary path from now on
                self.keep = False
            else:
                self.bound, encoders = bound
                self.encodings = tuple(KeptEncodings(encode) for encode in encoders)
        else:
            launch(self.kernel, self.grid, *self.describe(*tensors[:self.described]), *queue, *pointers,
                   *self.scalars, **self.options)


@dataclass
class ForwardPlan:
    """attn_fwd with every argument but the tensors fixed: call it with (q, k, v, o, lse, descale, alibi, cu_q, cu_k)."""

    fwd: _Launch
    interpret: bool

    def __call__(self, q, k, v, o, lse, descale, alibi, cu_q, cu_k) -> None:
        if self.interpret:
            with launching(True):
                self.fwd(q, k, v, o, lse, descale, alibi, cu_q, cu_k)
        else:
            self.fwd(q, k, v, o, lse, descale, alibi, cu_q, cu_k)


# The gluon_ws forward's causal tiles in groups of heads (HEAD_GROUPS in templates/flash_gluon_ws.py.j2, where
# flash_space.FORWARD_HEAD_GROUPS is on). The tile-major order (every head's heaviest query tile, then every head's
# next) reads a head's K and V once for each of its query tiles, some bh_count tiles apart. Where all heads' K and V
# outgrow L2, those reads come from memory: MHA Phi-3-mini 16 x 512 (32 heads of 96) has 100 MB of K and V, read 2.5
# times over by its 4 query tiles, beside 100 MB of Q and O: about 350 MB where one read of each is 200 MB. Its 129
# us against cuDNN's 103 on an H100 (results/gluon_head_split_2026-12-08a_h100.md) is that traffic at 2.7 TB/s. The
# same table: Phi-3-mini 4 x 2048 (100 MB of K and V, 128 heads: a round of tiles spans one query tile of each) ran
# 322 TFLOP/s, 1 x 4096 (the same causal pairs and heads, 50 MB, a round spans four query tiles of each) 462, and head
# dim 80 with GQA 32 / 8 at 4 x 2048 (25 MB) 396, 1.22x of cuDNN where Phi-3-mini's 96 ran 0.85x. In
# groups whose K and V fit a share of L2, a group's query tiles re-read them from L2. GQA heads share K and V:
# Llama-3-8B at 16 x 512 has 34 MB of them, within L2, and tile-major and head-major orders tied there
# (results/gluon_variants_2026-12-03i.txt). Groups take the tile queue: static rounds over groups dealt programs
# uneven work (Gemma-2-9B 4 x 2048 0.72x of cuDNN against 0.80x tile-major, results/gluon_variants_2026-12-03f.txt),
# which the queue evens out.
HEAD_GROUP_FROM_L2 = 1.0  # groups where all heads' K and V are more than this many L2s
HEAD_GROUP_L2_SHARE = 0.5  # the share of L2 a group's K and V may fill
# Query tiles a head up to which causal head-dim-256 tiles go one head after another, in static rounds too: Gemma-2-9B
# 16 x 512 0.84x -> 0.90x of cuDNN, 4 x 2048 0.77x -> 0.83x; 1 x 8192 (64 tiles a head) 0.79x -> 0.58x
# (results/gluon_variants_2026-12-03h.txt). The template's own order where HEAD_GROUPS is off (HEAD_MAJOR_TILES).
FORWARD_HEAD_MAJOR_TILES = 16


def forward_head_group(problem, config, total_keys: int = 0) -> int:
    """A group of the gluon_ws forward's tile order (HEAD_GROUPS): (batch, head) pairs of a dense causal call, or heads
    of a packed call over all `total_keys` of its sequences. 1 (one head after another) at head dim 256 up to
    FORWARD_HEAD_MAJOR_TILES query tiles a head (dense); with the tile queue, where all heads' K and V outgrow
    HEAD_GROUP_FROM_L2 L2s, as many as fill HEAD_GROUP_L2_SHARE of it; else all of them (the template's order)."""
    p = problem
    members, keys = (p.heads_q, total_keys) if p.varlen else (p.batch * p.heads_q, p.seq_k)
    if not p.varlen and p.block_d == 256 and _cdiv(p.seq_q, config["BLOCK_M"]) <= FORWARD_HEAD_MAJOR_TILES:
        return 1
    # K and V bytes a member reads (GQA: its group's share of them).
    per_member = 2 * keys * p.head_dim * element_size(p.dtype) * p.heads_kv / p.heads_q
    if not config.get("TILE_QUEUE") or members * per_member <= HEAD_GROUP_FROM_L2 * HOPPER_L2_BYTES:
        return members
    return max(1, min(members, int(HEAD_GROUP_L2_SHARE * HOPPER_L2_BYTES // per_member)))


def forward_plan(module, problem, config, scale: float, q, k, v, o, lse, alibi, interpret: bool,
                 keep: bool = False) -> ForwardPlan:
    p = problem
    varlen = p.varlen
    stride_ab = alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0
    # Packed sequences pass the totals as seq_q / seq_k (the TMA descriptors' extent); dense ones the lengths.
    seq_q, seq_k = (q.shape[0], k.shape[0]) if varlen else (p.seq_q, p.seq_k)
    scalars = (*rows_strides(q, varlen), *rows_strides(k, varlen), *rows_strides(v, varlen), *rows_strides(o, varlen),
               *lse_strides(lse, varlen), stride_ab, p.batch, p.heads_q, p.heads_kv, seq_q, seq_k,
               *feature_scalars(p, scale))
    options = dict(HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
                   WARP_SPECIALIZE=config["WARP_SPECIALIZE"], NEGATE_Q=scale < 0, num_warps=config["num_warps"],
                   num_stages=config["num_stages"])
    grid = (_cdiv(p.seq_q, config["BLOCK_M"]), p.batch * p.heads_q)
    keep = keep and not interpret
    if config["LOADS"] == GLUON_WS:
        # Persistent (templates/flash_gluon_ws.py.j2): a program per SM at most, each walking its share of the tiles;
        # its shared memory (a Q tile and num_stages K/V slots) leaves room for one program an SM.
        grid = (min(grid[0] * grid[1], current_device(q.device).sm_count),)
        block_m, block_n, block_d, head_dim = config["BLOCK_M"], config["BLOCK_N"], p.block_d, p.head_dim

        def describe(q, k, v, o):
            return module.tensor_descriptors(q, k, v, o, block_m, block_n, block_d, head_dim)

        queue = getattr(module, "TILE_QUEUE", False)
        sources = getattr(module, "DESCRIPTOR_SOURCES", ())
        if getattr(module, "HEAD_GROUPS", False):
            scalars += (forward_head_group(p, config, seq_k),)
        return ForwardPlan(_DescriptorLaunch(module.attn_fwd, grid, scalars, options, keep, describe, queue,
                                             sources=sources), interpret)
    return ForwardPlan(_Launch(module.attn_fwd, grid, scalars, options, keep), interpret)


@dataclass
class BackwardPlan:
    """The three backward kernels with every argument but the tensors fixed.

    Call with (q, k, v, o, do, lse, delta, dq, dk, dv, alibi, cu_q, cu_k); `delta` is scratch laid out as `lse`
    (None: allocated here).
    `dlse`: the gradient of the (log2-domain) log-sum-exp output too, when the caller returned it. It enters
    through delta: d lse / d x = p / ln 2, so dS = P (dP - delta + dlse * log2(e)).
    """

    preprocess: _Launch
    dkdv: _Launch
    dq: _Launch
    interpret: bool

    def __call__(self, q, k, v, o, do, lse, delta, dq, dk, dv, alibi, cu_q, cu_k, dlse=None) -> None:
        if delta is None:
            delta = torch.empty_like(lse)  # rowsum(dO * O)
        with launching(self.interpret):
            self.preprocess(o, do, delta, cu_q)
            if dlse is not None:
                delta.sub_(dlse, alpha=LOG2E)
            self.dkdv(q, k, v, do, dk, dv, lse, delta, alibi, cu_q, cu_k)
            self.dq(q, k, v, do, dq, lse, delta, alibi, cu_q, cu_k)


def backward_plan(module, problem, config, scale: float, q, k, v, o, do, lse, dq, dk, dv, alibi,
                  interpret: bool, keep: bool = False) -> BackwardPlan:
    p = problem
    varlen = p.varlen
    seq_q, seq_k = (q.shape[0], k.shape[0]) if varlen else (p.seq_q, p.seq_k)
    stride_ab = alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0
    stats = lse_strides(lse, varlen)
    meta = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    dims = {"HEAD_DIM": p.head_dim, "BLOCK_D": p.block_d}
    features = feature_scalars(p, scale)
    pre_scalars = (*rows_strides(o, varlen), *rows_strides(do, varlen), *stats, p.heads_q, seq_q)
    shared = (*rows_strides(q, varlen), *rows_strides(k, varlen), *rows_strides(v, varlen), *rows_strides(do, varlen))
    dkdv_scalars = (*shared, *rows_strides(dk, varlen), *rows_strides(dv, varlen), *stats, stride_ab,
                    p.heads_q, p.heads_kv, seq_q, seq_k, *features)
    dq_scalars = (*shared, *rows_strides(dq, varlen), *stats, stride_ab, p.heads_q, p.heads_kv, seq_q, seq_k, *features)
    rows_grid = (_cdiv(p.seq_q, config["BLOCK_M2"]), p.batch * p.heads_q)
    keep = keep and not interpret
    return BackwardPlan(
        _Launch(module.attn_bwd_preprocess, rows_grid, pre_scalars, dict(BLOCK_M=config["BLOCK_M2"], **dims, **meta),
                keep),
        _Launch(module.attn_bwd_dkdv, (_cdiv(p.seq_k, config["BLOCK_N1"]), p.batch * p.heads_kv), dkdv_scalars,
                dict(BLOCK_M1=config["BLOCK_M1"], BLOCK_N1=config["BLOCK_N1"], **dims, **meta), keep),
        _Launch(module.attn_bwd_dq, rows_grid, dq_scalars,
                dict(BLOCK_M2=config["BLOCK_M2"], BLOCK_N2=config["BLOCK_N2"], **dims, **meta), keep),
        interpret,
    )


# The Gluon backward's structure (templates/flash_gluon_bwd.py.j2): 64 query rows a step, 128 keys a tile.
GLUON_BWD_ROWS = 64
GLUON_BWD_KEYS = 128
# Programs a chunk of consecutive tiles should leave, per SM, for the hardware scheduler to balance them. 4
# consecutive tiles a program (benchmarks/prototypes/gluon_flash_bwd.py; results/gluon_flash_bwd_2026-12-04c_red_host.txt,
# call 8): not causal 0.64x -> 0.73x of cuDNN, head dim 64 causal 0.55x -> 0.66x, causal 2 x 32 x 4096 0.71x either
# way (512 programs); 1 x 32/8 x 4096 (256 tiles) fell to 0.26x (64 programs: half the SMs idle).
# Dense calls with tiles enough for chunks mostly go out head by head, one tile a program (HEAD_MAJOR_TILES_PER_SM
# below); causal calls whose Q and dO fit L2, and packed sequences, take chunks.
CHUNK_PROGRAMS_PER_SM = 3
# Programs an SM below which programs share tiles (SPLIT): causal 1 x 28/4 x 4096 (Qwen2.5-7B, 128 tiles, one
# program an SM, the first key blocks' programs walking all 64 query blocks of 7 heads while the last ones' walk
# one) ran at 0.57x of cuDNN, where 1 x 32/8 x 4096 (256 tiles) ran at 1.00x (results/flash_bwd_2026-12-04.txt).
SPLIT_PROGRAMS_PER_SM = 1.5
# The parts a tile may be shared by, and the consecutive work items a program may take, most first.
SPLITS = (1, 2, 3, 4)
CHUNKS = (4, 2, 1)


# Tiles go out head by head, not key block by key block, where a sequence has at most this many 128-key blocks and
# at least this many programs an SM run: its few tiles then run side by side and read its Q and dO from memory once.
# Measured (results/gluon_flash_bwd_dq_tma_2026-12-04.txt, calls 7 and 8, x cuDNN): causal 16 x 512 and 32 x 256
# with Llama-3-8B's heads (512 programs) 0.93x -> 1.05x and 1.05x -> 1.14x; with Qwen2.5-7B's (256 programs: the
# heaviest-first order balances them) 1.07x -> 0.97x.
HEAD_MAJOR_KEY_BLOCKS = 4
HEAD_MAJOR_PROGRAMS_PER_SM = 3
# ... and at any length where tiles are this many an SM, unless causal masks make tiles uneven and the call's Q and dO
# fit L2 (below HEAD_MAJOR_L2_MULTIPLE times it). Key block first, the tiles running at once hold the same key block
# of many heads, and each reads its head's Q and dO again from memory once they outgrow L2; head by head, a head's key
# blocks share them. Key block first, causal tiles also go heaviest first, which balances the SMs. Measured one a
# program against the key-block-first order's chunks of 4 (results/flash_bwd_2026-12-04d_chunks.txt, x cuDNN):
#   Q and dO 96-256 MiB: MHA 2 x 32 x 4096 causal 0.93-0.97x -> 0.99-1.04x, Llama-2-7B 4 x 2048 0.92x -> 1.00x,
#     8 x 1024 0.86-0.90x -> 1.01x, Phi-3-mini 2 x 4096 0.94x -> 1.00x, GQA 8 x 32/8 x 2048 0.90x -> 1.04x;
#   48-64 MiB, causal: Phi-3-mini 1 x 4096 1.07x -> 1.01x, Llama-2-7B 1 x 4096 1.05x -> 1.03x, head dim 64
#     4 x 32 x 2048 0.98-1.00x -> 0.97-0.98x;
#   not causal: MHA 2 x 32 x 4096 0.96x -> 0.97-0.99x, head dim 64 2 x 32 x 4096 (64 MiB) 0.90x -> 0.93-0.95x.
# With fewer tiles the heaviest-first order's balance wins: Llama-3-8B 1 x 4096 (256 tiles) 1.07-1.11x, head by head
# 0.81-0.83x; 4 x 2048 (512) 1.02-1.06x / 0.98-1.00x.
HEAD_MAJOR_TILES_PER_SM = 6
HEAD_MAJOR_L2_MULTIPLE = 1.5
# L2 of the Hopper GPUs the Gluon backward runs on: 50 MB, taken as MiB (NVIDIA H100 Tensor Core GPU Architecture whitepaper, H100
# SXM5; the H200 is the same GH100 die).
HOPPER_L2_BYTES = 50 * 2**20
# Tiles a program where they go out head by head: one, so that a head's tiles run side by side on as many SMs.
# In chunks of 4 one program walked them one after another (MHA 16 x 32 x 512 0.80x of cuDNN with 4 a program,
# 1.02x with one; Llama-2-7B 16 x 512 causal 0.86x -> 1.01x; results/flash_bwd_2026-12-04d_chunks.txt).
HEAD_MAJOR_CHUNK = 1


# A stream-K tail where tiles are even (not causal, dense, one a program): the tiles past the last whole wave would
# leave most SMs idle in a last wave (MHA 2 x 32 x 4096: 2048 tiles, 15.5 waves of 132, the last half empty). Instead,
# one program an SM shares their steps evenly (templates/flash_gluon_bwd.py.j2, TAIL). Its cost over the steps it
# walks, in key-loop steps: each program stores fp32 partials of dK and dV from registers for up to two tiles (5.5-6.6
# us a tile against 2.3 us a step: benchmarks/prototypes/flash_bwd_tile_clock.py,
# results/flash_bwd_tile_clock_2026-12-04.txt) and loads a second tile's K and V, and the reduction kernel runs after:
# about 8 steps. Taken where the steps it saves are at least TAIL_MIN_GAIN of the call's.
# NOTE: off (an infinite gain asked). Timed beside no tail (flash_bwd_bench.py --tail, H100, fp16, D 128 unless
# named; results/flash_bwd_tail_2026-12-05.txt) it gained 2% at MHA 1 x 32 x 4096 and D 64 2 x 32 x 4096 and lost 2%
# at MHA 2 x 32 x 4096, all within the runs' 5-16% spread, and lost 14% at GQA 2 x 32/8 x 4096 (430 against 499
# TFLOP/s), which the model of its cost does not explain. The template and this rule stay, tested on the GPU, for
# the next try: set TAIL_MIN_GAIN to 0.01 (the model's threshold) to turn it on.
TAIL_OVERHEAD_STEPS = 8
TAIL_MIN_GAIN = float("inf")
# Programs of the Gluon backward an SM holds at once: one (its shared memory: gluon_bwd_smem; 240 registers a consumer
# thread).
GLUON_BWD_PROGRAMS_PER_SM = 1


class GluonBackwardSchedule(NamedTuple):
    """How the Gluon backward deals out its tiles (gluon_backward_schedule)."""

    chunk: int  # consecutive work items a program
    split: int  # programs sharing each tile's query blocks
    head_major: bool  # tiles head by head (else key block first)
    tail: int  # the last tiles, whose steps the programs of a stream-K tail share (0: none)


def gluon_backward_tail(tiles: int, steps: int, sms: int, *, even: bool) -> int:
    """The tiles of the Gluon backward's stream-K tail (0: none) for `tiles` tiles of `steps` steps each, dealt one a
    program to `sms` SMs; `even`: every tile walks the same steps (not causal, dense)."""
    slots = GLUON_BWD_PROGRAMS_PER_SM * sms
    tail = tiles % slots
    if not even or tiles < slots or tail == 0:
        return 0
    waves = _cdiv(tiles, slots)
    saved = steps - (tail * steps / slots + TAIL_OVERHEAD_STEPS)  # the last wave, whole tiles against shared steps
    return tail if saved >= TAIL_MIN_GAIN * waves * steps else 0


def gluon_backward_head_major(key_blocks: int, work: int, sms: int, varlen: bool, *, causal: bool,
                              q_do_bytes: int) -> bool:
    """Whether the Gluon backward's tiles go out head by head (templates/flash_gluon_bwd.py.j2, _work_coords), for
    `work` work items (tiles x SPLIT) of `key_blocks` 128-key blocks a sequence, and `q_do_bytes` of Q and dO."""
    if varlen:  # packed: the tiles counted include those past a sequence's keys, which are skipped
        return False
    short = key_blocks <= HEAD_MAJOR_KEY_BLOCKS and work >= HEAD_MAJOR_PROGRAMS_PER_SM * sms
    outgrow_l2 = not causal or q_do_bytes >= HEAD_MAJOR_L2_MULTIPLE * HOPPER_L2_BYTES
    return short or (work >= HEAD_MAJOR_TILES_PER_SM * sms and outgrow_l2)


def gluon_backward_schedule(tiles: int, key_blocks: int, sms: int, varlen: bool = False, *, causal: bool,
                            q_do_bytes: int, steps: int = 0) -> GluonBackwardSchedule:
    """How the Gluon backward deals out `tiles` tiles (`key_blocks` 128-key blocks of each KV head, `steps` query
    blocks of every query head sharing it) on `sms` SMs, with `q_do_bytes` of Q and dO. SPLIT programs share a tile's
    walk where fewer than SPLIT_PROGRAMS_PER_SM programs an SM would run (the fewest parts that reach it; packed
    sequences never split). Tiles go out head by head where gluon_backward_head_major says so, HEAD_MAJOR_CHUNK a
    program; otherwise each program takes CHUNK consecutive work items: 4, 2 or 1, the most that leaves
    CHUNK_PROGRAMS_PER_SM programs an SM. Even tiles of one a program end in a stream-K tail where
    gluon_backward_tail says so."""
    split = 1 if varlen else next((s for s in SPLITS if tiles * s >= SPLIT_PROGRAMS_PER_SM * sms), SPLITS[-1])
    work = tiles * split
    if gluon_backward_head_major(key_blocks, work, sms, varlen, causal=causal, q_do_bytes=q_do_bytes):
        chunk, head_major = HEAD_MAJOR_CHUNK, True
    else:
        chunk, head_major = next(c for c in CHUNKS if c == 1 or work // c >= CHUNK_PROGRAMS_PER_SM * sms), False
    even = not causal and not varlen and split == 1 and chunk == 1
    return GluonBackwardSchedule(chunk, split, head_major, gluon_backward_tail(tiles, steps, sms, even=even))


def gluon_backward_steps(problem) -> int:
    """Steps of a dense tile of the Gluon backward: every 64-row query block of each query head sharing its keys."""
    p = problem
    return (p.heads_q // p.heads_kv) * _cdiv(p.seq_q, GLUON_BWD_ROWS)


def gluon_backward_problem_schedule(problem, sms: int) -> GluonBackwardSchedule:
    """gluon_backward_schedule of a flash problem: its tiles, key blocks, steps and bytes of Q and dO."""
    p = problem
    key_blocks = _cdiv(p.seq_k, GLUON_BWD_KEYS)
    q_do_bytes = 2 * p.batch * p.heads_q * p.seq_q * p.head_dim * element_size(p.dtype)
    # (Windowed tiles are uneven, as causal ones are: each walks the query blocks its window reaches.)
    return gluon_backward_schedule(key_blocks * p.batch * p.heads_kv, key_blocks, sms, p.varlen, causal=p.masked,
                                   q_do_bytes=q_do_bytes, steps=gluon_backward_steps(p))


class GluonBackwardPlan:
    """The Gluon backward (templates/flash_gluon_bwd.py.j2) with every argument but the tensors fixed; called as
    BackwardPlan is, (q, k, v, o, do, lse, delta, dq, dk, dv, alibi, cu_q, cu_k, dlse=None). `delta` is not used
    (None will do): the kernel reads LSE and Delta padded to whole query blocks, and adds dQ into fp32, both in
    scratch of its own
    (allocated a call from the caching allocator, so CUDA graphs capture them); with SPLIT > 1 or a stream-K tail,
    dK and dV partials too, which `reduce` adds. The LSE's gradient enters Delta in the preprocess (`preprocess_dlse`, see
    BackwardPlan). `dq_cast` casts dQ into the caller's tensor."""

    __slots__ = ("preprocess", "preprocess_dlse", "main", "reduce", "dq_cast", "scratch_parts", "scratch_size",
                 "takes_alibi", "alibi_in_lse")

    def __init__(self, preprocess: _Launch, preprocess_dlse: _Launch, main: _Launch, reduce: _Launch | None,
                 dq_cast: _Launch, stats: int, dq: int, part: int, takes_alibi: bool = False,
                 alibi_in_lse: bool = False):
        """`stats`, `dq`, `part`: elements of the padded LSE (and Delta), the fp32 dQ and (reduce) each partial;
        `takes_alibi`: the main kernel takes the slopes after the cumulative lengths (ALIBI); `alibi_in_lse`: so does
        the preprocess, after its own tensors and the keys' cumulative lengths (causal ALIBI: the rows' term)."""
        self.takes_alibi, self.alibi_in_lse = takes_alibi, alibi_in_lse
        self.preprocess, self.preprocess_dlse, self.main = preprocess, preprocess_dlse, main
        self.reduce, self.dq_cast = reduce, dq_cast
        self.scratch_parts = (stats, stats, dq) + ((part, part) if reduce is not None else ())
        self.scratch_size = sum(self.scratch_parts)

    def __call__(self, q, k, v, o, do, lse, delta, dq, dk, dv, alibi, cu_q, cu_k, dlse=None) -> None:
        # Every fp32 scratch tensor from one allocation (NOTE: each allocation costs ~10 us of host time on the
        # H200's host, as much as a launch); the kernels take them as flat pointers, 256-byte aligned.
        scratch = torch.empty(self.scratch_size, dtype=torch.float32, device=q.device).split(self.scratch_parts)
        lse_pad, delta_pad, dq_acc = scratch[:3]
        rows_bias = (cu_k, alibi) if self.alibi_in_lse else ()
        if dlse is None:
            self.preprocess(o, do, lse, lse, cu_q, lse_pad, delta_pad, dq_acc, *rows_bias)
        else:  # laid out as LSE (contiguous), whose strides the plan took
            self.preprocess_dlse(o, do, lse, dlse.contiguous(), cu_q, lse_pad, delta_pad, dq_acc, *rows_bias)
        # The main kernel's descriptors: over the first 7 of these (dense: all 9; dK's and dV's unused with
        # SPLIT > 1); its pointers: dK's and dV's (or their partials) and the cumulative lengths.
        described = (q, do, k, v, lse_pad, delta_pad, dq_acc, dk, dv)[:self.main.described]
        slopes = (alibi,) if self.takes_alibi else ()
        if self.reduce is None:
            self.main(*described, dk, dv, cu_q, cu_k, *slopes)
        else:
            dk_part, dv_part = scratch[3:]
            self.main(*described, dk_part, dv_part, cu_q, cu_k, *slopes)
            self.reduce(dk_part, dv_part, dk, dv)
        self.dq_cast(dq_acc, cu_q, dq)


def gluon_backward_stats_shape(problem, rows_q: int) -> tuple:
    """Shape of the Gluon backward's padded LSE and Delta (its fp32 dQ adds BLOCK_D columns) for `rows_q` rows of Q
    (dense: Sq; packed: the total). Their rows (flash_gluon_bwd.py.j2's _stat_first): dense, Sq rounded up to whole
    query blocks for each (sequence, head); packed, for each head, whole blocks of every sequence, sequence b's
    starting at block (its first row // 64) + b, so that none overlaps the next's."""
    p, rows = problem, GLUON_BWD_ROWS
    if p.varlen:
        return (p.heads_q, rows * (rows_q // rows + p.batch + 1))
    return (p.batch, p.heads_q, _cdiv(p.seq_q, rows) * rows)


def gluon_backward_plan(module, problem, config, scale: float, q, k, v, o, do, lse, dq, dk, dv,
                        keep: bool = False, alibi=None) -> GluonBackwardPlan:
    p = problem
    varlen = p.varlen
    rows, keys = GLUON_BWD_ROWS, GLUON_BWD_KEYS
    dims = {"HEAD_DIM": p.head_dim, "BLOCK_D": p.block_d}
    rows_q = q.shape[0] if varlen else p.seq_q
    stats_shape = gluon_backward_stats_shape(p, rows_q)
    stat_rows = stats_shape[-1]
    row_grid = (_cdiv(p.seq_q, rows), p.batch * p.heads_q)
    # ALiBi's slopes (B, Hq) or (Hq,): their row stride, for the kernels that take them (rendered in only where
    # ALIBI is; causal calls put the rows' term of the bias into the padded LSE, flash_gluon_bwd.py.j2's ALIBI_CAUSAL).
    stride_ab = alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0
    alibi_in_lse = p.alibi and p.causal
    pre_scalars = (*rows_strides(o, varlen), *rows_strides(do, varlen), *lse_strides(lse, varlen), p.heads_q, p.seq_q,
                   stat_rows, *((p.seq_k, stride_ab) if alibi_in_lse else ()))
    preprocess, preprocess_dlse = (
        _Launch(module.attn_bwd_gluon_preprocess, row_grid, pre_scalars,
                dict(BLOCK_M=rows, HAS_DLSE=has_dlse, **dims, num_warps=4), keep) for has_dlse in (False, True))
    tiles = _cdiv(p.seq_k, keys) * p.batch * p.heads_kv
    # Packed sequences: no tile split between programs (the tiles counted include those past a sequence's keys, and
    # a packed batch holds many sequences).
    sms = current_device(q.device).sm_count
    chunk, split, head_major, tail = gluon_backward_problem_schedule(p, sms)
    part = p.batch * p.heads_kv * p.seq_k * p.block_d  # elements of one part's fp32 dK (or dV) partials
    grid = _cdiv(tiles * split, chunk)
    # A stream-K tail (gluon_backward_tail): tiles below `whole` one a program, then tail_programs sharing the rest's
    # steps, each with fp32 partials (tail_programs, 2, keys, BLOCK_D) of dK and dV. Without one, both are 0 (unread;
    # one value for every call, so that they add no specialisations of the kernel).
    whole, tail_programs, steps = 0, 0, gluon_backward_steps(p)
    if tail:
        whole = tiles - tail
        tail_programs = min(GLUON_BWD_PROGRAMS_PER_SM * sms, tail * steps)
        grid = whole + tail_programs
        part = tail_programs * 2 * keys * p.block_d
    if split > 1:
        # The kernel writes fp32 partials of dK and dV, contiguous (SPLIT * B, Hkv, Sk, BLOCK_D).
        part_strides = (p.heads_kv * p.seq_k * p.block_d, p.seq_k * p.block_d, p.block_d)
        out_strides = part_strides * 2
    else:
        out_strides = (*rows_strides(dk, varlen), *rows_strides(dv, varlen))
    # The window's sides, each rendered in only where its switch is (LEFT_BOUND, RIGHT_WINDOW: a causal call's right
    # bound is the diagonal).
    window = ((p.window_left,) if p.window_left >= 0 else ()) + (
        (p.window_right,) if not p.causal and p.window_right >= 0 else ())
    slopes = (stride_ab,) if p.alibi else ()
    # Soft-capping's scalars, from the host as the scale's (rendered in only where SOFTCAP is).
    cap = (float(scale) / p.softcap, p.softcap * LOG2E) if p.softcap > 0 else ()
    main_scalars = (*out_strides, p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, stat_rows,
                    float(scale) * LOG2E, float(scale), whole, tail_programs, *window, *slopes, *cap)
    block_d = p.block_d

    def describe(*tensors):
        return module.tensor_descriptors(tensors, rows, keys, block_d)

    main = _DescriptorLaunch(module.attn_bwd_gluon, (grid,), main_scalars,
                             dict(BLOCK_M=rows, BLOCK_N=keys, CHUNK=chunk, SPLIT=split, HEAD_MAJOR=head_major,
                                  TAIL=bool(tail), **dims, num_warps=4, num_stages=config["num_stages"]), keep,
                             describe, described=7 if varlen else 9, pointers_too=False)
    reduce = None
    if tail:
        reduce = _Launch(module.attn_bwd_gluon_tail_reduce, (tail, keys // 64),
                         (*rows_strides(dk, False), *rows_strides(dv, False), p.batch * p.heads_kv, p.heads_kv,
                          p.seq_k, whole, tail_programs, steps),
                         dict(BLOCK_N=keys, ROWS=64, HEAD_MAJOR=head_major, **dims, num_warps=4), keep)
    elif split > 1:
        reduce = _Launch(module.attn_bwd_gluon_reduce, (_cdiv(p.seq_k, 64), p.batch * p.heads_kv),
                         (*rows_strides(dk, False), *rows_strides(dv, False),
                          part, p.heads_kv, p.seq_k),
                         dict(BLOCK_N=64, SPLIT=split, **dims, num_warps=4), keep)
    dq_cast = _Launch(module.attn_bwd_gluon_dq, row_grid,
                      (*rows_strides(dq, varlen), p.heads_q, p.seq_q, stat_rows, float(scale)),
                      dict(BLOCK_M=rows, **dims, num_warps=4), keep)
    stats = math.prod(stats_shape)
    return GluonBackwardPlan(preprocess, preprocess_dlse, main, reduce, dq_cast, stats, stats * p.block_d,
                             part if tail else split * part, takes_alibi=p.alibi, alibi_in_lse=alibi_in_lse)
