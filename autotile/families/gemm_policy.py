"""Configs for GEMMs nobody tuned, and where a short search starts: a policy per regime, not a list.

The regime follows from M, N, K, the dtypes, the layouts and the GPU's SM count:
- decode (M <= 16): every weight element is read once, so the kernel streams B: one 16-row tile of A,
  whole columns of B in data-parallel tiles where the weight's width gives the SMs enough of them (32 columns
  256 deep, else 64 or 128 columns 128 deep with A and B swapped on Hopper so that B feeds wgmma from shared
  memory), else 64-column tiles split over K until the programs fill the SMs (a split costs its partial
  tile's round trip through the workspace). Its ceiling is copy bandwidth over the weight's bytes.
- mid (16 < M <= 512): up to M = 64 (STREAM_MAX_M), decode's weight-streaming kernel with every token in
  one tile; up to M = 128 (WIDE_STREAM_MAX_M) the same with a 128-token tile where its programs fit one wave,
  else one wave of TMA tiles or the weight streamed unsplit (few_tokens_config); above, tiles chosen by how
  well they fill the SMs (tiled_mid_config), on Hopper the Gluon variant's tiles where they fill their waves
  (swapped, 80-192 tokens over 128 weight rows, where that token side cuts M better), and for narrow weights (k and v projections, 65-640 tokens, ahead of the streaming kernels too)
  swapped tiles of 16-64 tokens over 64 weight rows, as cuBLAS tiles them (token_tile_config).
- prefill (M > 512): on Hopper, the Gluon variant (warp-specialised, whole tiles): 128 x 256 x 64 for 16-bit
  operands, 128 x 128 x 128 for precise fp8, 128 x 256 x 128 with fast accumulation. Elsewhere 128 x 256 tiles
  on TMA loads in a persistent loop (fp8: Triton's persistent TMA tutorial's 128 x 256 x 128 with fast
  accumulation; 128 x 128 x 128 with two accumulators, promoted every 2 K tiles, for precise accumulation and
  block scales).
- irregular (fp8 and tf32 mid and prefill): when whole tiles leave the last wave (or the only one) less than
  STREAM_K_BELOW busy, stream-K: data-parallel full waves, then the rest spread evenly over the GPU. For 16-bit
  operands the H200 measured persistent data-parallel tiles faster (prefill_config).

Rules that name a results file were set from H200 measurements of every candidate
(benchmarks/gemm_policy_sweep.py); the other numbers are starting points from the anchors (shared/anchors,
H200 2026-11-29), from Triton's tutorials and from ptxas's register counts.
benchmarks/gemm_kernels_bench.py measures the policy against cuBLAS.
"""
from __future__ import annotations

import math

from autotile.arch import Feature, arch_of
from autotile.device import DeviceInfo
from autotile.dtypes import element_size
from autotile.families.base import next_pow2
from autotile.families.gemm_space import (
    FP8_PRECISE_INTERVAL, GLUON_WS, SPLIT_K_CHOICES, SPLIT_K_MAX_TILES_PER_SM, TOKEN_TILE_BLOCK_MS,
    gluon_swap_fits, gluon_ws_ok, has_promote_axis, programs_per_sm, sm_count, smem_bytes, tile_count,
    tma_ok, token_tiles_fit,
)

DECODE_MAX_M = 16
MID_MAX_M = 512
# Tokens up to which a mid GEMM streams its weight (streaming_config): all M rows in one tile of A, no larger
# than B's (64 x 128 each at M = 64).
STREAM_MAX_M = 64
# Tokens up to which a mid GEMM may stream its weight in one swapped tile of 128 tokens (wide_streaming_config).
WIDE_STREAM_MAX_M = 128
# A split's fixed cost (start, pipeline fill, the last contributor's wait) in K tiles of streaming;
# its partial tile's round trip through the workspace is added in proportion to its bytes.
SPLIT_FIXED_K_TILES = 1.0
# The last wave's share of busy programs below which stream-K replaces data-parallel tiles
# (3000 x 5000 x 1536 with 128 x 256 tiles: 480 tiles on 132 SMs, 3.64 waves, 91%).
STREAM_K_BELOW = 0.92
# Beyond this many waves the last one's idle SMs cost too little to pay stream-K's partial tiles.
STREAM_K_MAX_WAVES = 8
# Share of the SMs a weight-streaming or mid-M grid must give a program before a split stops paying: the
# smallest split reaching it (at M = 64 on the H200, 2 splits of 64 x 64 tiles beat the cost model's 4; at
# M = 256, 128 unsplit 64 x 128 tiles on 132 SMs beat 2 and 4 splits).
FILL_SMS = 0.8
# Busy share of the program slots by which 128 x 128 prefill tiles must beat 128 x 256 ones to replace them.
PREFILL_HALF_N_GAIN = 0.10
# K from which a mid-M GEMM takes 128 x 128 tiles split over K (down projections, K = 14336-18944: 0.75-0.82x
# of cuBLAS at M = 256, against 0.56-0.63x for unsplit 64 x 128 tiles).
MID_LONG_K = 8192
# Mid-M tiles on TMA loads that a problem takes where they fit one wave and keep FILL_SMS of the SMs busy, in this
# order (results/gemm_mid_tiles_2026-12-02.txt, H200, ours / cuBLAS): 64 x 128 x 128 on 4 warps, 4 stages (256 x 4096
# x 4096: 0.917x against 0.739x for the pointer-loaded 64 x 128 x 64 tiles; 256 x 4096 x 14336: 0.887x against
# 0.813x split over K); 128 x 128 x 64 on 8 warps, 4 stages (512 x 3584 x 18944: 0.826x against 0.587x; 512 x 4096
# x 4096: 0.785x against 0.792x). Where neither fits one wave they lost to the rules below (256 x 6144 x 4096: 0.64x
# and 0.69x against 0.73x).
ONE_WAVE_MID_TILES = (
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
)
# Up to WIDE_STREAM_MAX_M tokens, where the wide streaming kernel takes more than one wave
# (results/gemm_policy_sweep_2026-12-02_mid.md, M = 96 and 128, Llama-3-8B and Qwen2.5-7B):
# - the one-wave TMA tiles lead from this share of the SMs on (qkv projections, 55-73% of the SMs: 0.76-0.83x
#   of cuBLAS against 0.69-0.79x for the split 64 x 128 tiles);
# - where they take more than one wave (gate_up), the weight streams unsplit through swapped 128-token tiles: 128
#   weight rows deep 64 on 3 stages (two programs an SM) unless 64 rows deep 128 on 4 stages (one an SM) fill the
#   last wave better by FEW_TOKENS_WAVE_GAIN (Llama-3-8B 0.93-0.98x against 0.88-0.92x for 64 x 128 tiles;
#   Qwen2.5-7B, 1.12 waves against 4.48: 0.86-0.89x against 0.72-0.76x for 128 x 256 tiles).
FEW_TOKENS_FILL_SMS = 0.5
FEW_TOKENS_WAVE_GAIN = 0.10
_FEW_TOKENS_STREAMS = (dict(BLOCK_N=128, BLOCK_K=64, num_stages=3), dict(BLOCK_N=64, BLOCK_K=128, num_stages=4))


# Decode's data-parallel tiles, narrowest first: each is taken up to one tile an SM; past the widest, 64-column
# tiles in waves. Measured as a decode step runs them (CUDA graphs, one weight a call, 512 MB a graph; H100; 44
# projections of Llama-3, Qwen2.5, Mistral-Nemo, Phi-3 and Gemma-2 at 1 and 16 tokens, every candidate;
# benchmarks/decode_stream_candidates.py, results/decode_candidates_2026-12-06_h100*.json), x cuBLAS, against the
# split-K tiles they replaced:
# - 32 x 256 (B not swapped), N 2048-4096, K 3072-5120: 1.00-1.23x against 0.85-1.09x;
# - 64 x 128 (swapped), N 4608-8192: 1.01-1.07x against 0.87-0.92x;
# - 128 x 128 (swapped, 4 stages: one program an SM), N 9216-14336: 1.00-1.01x against 0.83-0.98x;
# - down projections (K 14336-18944): 32 x 256 1.05-1.10x against 0.99-1.05x;
# - short K (896-2048), any width: 64 x 128 1.02-1.13x at K < 2048, 32 x 256 0.95-1.04x at K = 2048-2304, against
#   0.70-0.93x (a 256-deep tile leaves too few K steps for a 5-stage pipeline below 2048).
# A split tile's partial sums round-trip through the workspace, and in those graphs its tile counters took a memset
# node a replay (1.0-1.3 us of the gap; captured launches now take counters zeroed once, gemm_launch.py, and a split
# 16 x 4608 x 3584 still ran 0.94x against 1.05x whole). The split stays where K is long and whole tiles leave more
# than half the SMs idle (N = 256-1792 at K 3072-8960: 1.06-1.27x split; N = 1024 x K 4096 whole: 0.91x).
# streaming_config (17-64 tokens) takes the same tiles.
DECODE_WHOLE_TILES = (
    dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=5),
    dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5),
    dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
)
# With 64 tokens a 32 x 256 tile overflows shared memory in 5 stages: 32 x 128 in 6 (1.04-1.06x at N 1536-4096).
STREAM_64_WHOLE_TILES = (dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=6),) + DECODE_WHOLE_TILES[1:]
DECODE_WHOLE_MIN_SMS = 0.45
DECODE_WHOLE_MIN_K = 896  # the shortest measured (Qwen2.5-0.5B)
DECODE_DEEP_MIN_K = 2048
# Measured at 2048 (whole tiles won) and 3072 (the split won); 2304 (Gemma-2-2B) is taken as 2048's.
DECODE_SPLIT_MIN_K = 2304


def regime(problem) -> str:
    if problem.m <= DECODE_MAX_M:
        return "decode"
    return "mid" if problem.m <= MID_MAX_M else "prefill"


def _base(**values) -> dict:
    config = dict(VARIANT="blocked", SCHEDULE="data_parallel", SPLIT_K=1, PERSISTENT=False, WARP_SPECIALIZE=False,
                  FLATTEN=False, SWAP_AB=False, GROUP_M=1, num_warps=4, num_stages=3)
    config.update(values)
    return config


def _fit_blocks(problem, config: dict) -> dict:
    """Blocks no larger than the next power of two of their dimension (the space's tile_within_problem)."""
    p = problem
    config["BLOCK_M"] = min(config["BLOCK_M"], max(16, next_pow2(p.m)))
    config["BLOCK_N"] = min(config["BLOCK_N"], max(32, next_pow2(p.n)))
    config["BLOCK_K"] = min(config["BLOCK_K"], max(32 if p.dtype != "fp8" else 64, next_pow2(p.k)))
    if config["BLOCK_M"] >= 128 and config["BLOCK_N"] >= 128 and p.dtype != "fp32":
        config["num_warps"] = 8
    if math.ceil(p.m / config["BLOCK_M"]) == 1:
        config["GROUP_M"] = 1
    if p.scale_mode == "block":
        config["BLOCK_K"] = min(config["BLOCK_K"], 128)
    if has_promote_axis(p):
        config.setdefault("PROMOTE_TILES", min(4, max(1, FP8_PRECISE_INTERVAL // config["BLOCK_K"])))
    return config


def programs(problem, config: dict, device: DeviceInfo) -> int:
    """Programs of `config` the GPU runs at once."""
    return sm_count(device) * programs_per_sm(problem, config, device)


def fills_one_wave(problem, config: dict, device: DeviceInfo, fill: float) -> bool:
    """Whether `config`'s tiles take one wave of its programs and fill at least `fill` of the SMs."""
    tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    return fill * sm_count(device) <= tiles <= programs(problem, config, device)


def wave_efficiency(tiles: int, slots: int) -> float:
    """Busy share of the program slots over all waves of whole tiles."""
    return tiles / (math.ceil(tiles / slots) * slots)


def split_cost(problem, config: dict) -> float:
    """One more split's cost in K tiles: a fixed part, plus its fp32 partial written and read back,
    counted against the bytes of A and B one K tile streams (decode GEMMs are memory-bound)."""
    rows = min(problem.m, config["BLOCK_M"])  # rows past M are neither stored nor read
    partial = 2 * rows * config["BLOCK_N"] * 4
    per_k_tile = (rows + config["BLOCK_N"]) * config["BLOCK_K"] * element_size(problem.dtype)
    return SPLIT_FIXED_K_TILES + partial / per_k_tile


def best_split(problem, config: dict, device: DeviceInfo) -> int:
    """The SPLIT_K minimising waves x (K tiles per split) + the splits' cost (1 when no split pays)."""
    p = problem
    tiles = tile_count(p, config["BLOCK_M"], config["BLOCK_N"])
    k_tiles = math.ceil(p.k / config["BLOCK_K"])
    slots = programs(p, config, device)
    if tiles >= SPLIT_K_MAX_TILES_PER_SM * sm_count(device):
        return 1  # the space's split_k_fills_the_gpu: enough tiles already

    def cost(split: int) -> float:
        return math.ceil(tiles * split / slots) * math.ceil(k_tiles / split) + split_cost(p, config) * (split - 1)

    usable = [s for s in SPLIT_K_CHOICES if s == 1 or k_tiles >= 2 * s]
    return min(usable, key=lambda s: (cost(s), s))


def _fit_stages(problem, config: dict, device: DeviceInfo) -> dict:
    """Fewer pipeline stages (down to 2) until the tiles fit the device's shared memory: the tile shapes
    chosen for Hopper's 227 KiB keep their shape on an A100 (163 KiB) or an L40S (99 KiB)."""
    while smem_bytes(problem, config) > device.smem_per_block and config["num_stages"] > 2:
        config = dict(config, num_stages=config["num_stages"] - 1)
    return config


def filling_split(problem, config: dict, device: DeviceInfo) -> int:
    """The smallest SPLIT_K whose programs cover FILL_SMS of the SMs (each split keeping at least two K tiles);
    1 when the tiles alone do."""
    tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    k_tiles = math.ceil(problem.k / config["BLOCK_K"])
    wanted = FILL_SMS * sm_count(device)
    usable = [s for s in SPLIT_K_CHOICES if s == 1 or k_tiles >= 2 * s]
    return next((s for s in usable if tiles * s >= wanted), usable[-1])


def _schedule(problem, config: dict, device: DeviceInfo, split: bool | str = False, stream_k: bool = True) -> dict:
    """Split-K (`split`: True, the cost model's best_split; "fill", filling_split) or stream-K where `config`'s
    tiles leave SMs idle (unless `stream_k` is off), else data-parallel tiles."""
    config = _fit_stages(problem, config, device)
    if split:
        split_k = filling_split(problem, config, device) if split == "fill" else best_split(problem, config, device)
        return dict(config, SCHEDULE="split_k", SPLIT_K=split_k, PERSISTENT=False) if split_k > 1 else config
    if not stream_k:
        return config
    tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    slots = programs(problem, config, device)
    if tiles / slots < STREAM_K_MAX_WAVES and wave_efficiency(tiles, slots) < STREAM_K_BELOW:
        return dict(config, SCHEDULE="stream_k", SPLIT_K=1, PERSISTENT=False, WARP_SPECIALIZE=False, FLATTEN=False)
    return config


def swap_ab_fits(problem, device: DeviceInfo) -> bool:
    """Whether the decode kernel computes C^T = B^T A^T: on Hopper this makes B's tile the operand wgmma
    reads straight from shared memory (m64n16 MMAs, asynchronous), where the plain 16-row tile runs
    synchronous mma.sync from registers (ptxas, sm90: 48 against 72 registers for 16 x 64 x 128)."""
    return (problem.dtype != "fp32" or problem.tf32) and arch_of(device).supports(Feature.ASYNC_MMA)


def decode_config(problem, device: DeviceInfo) -> dict:
    p = problem
    whole = _whole_stream_tiles(p, device)
    if whole is not None:
        return whole
    # Two programs per SM (16 x 64 x 128 tiles, 5 stages: 100 KiB of shared memory each), so one
    # program's pipeline fill and tail hide behind the other's streaming.
    config = _fit_blocks(p, _base(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5))
    if swap_ab_fits(p, device) and config["BLOCK_N"] >= 64:
        config["SWAP_AB"] = True
    return _schedule(p, config, device, split=True)


def _whole_stream_tiles(problem, device: DeviceInfo) -> dict | None:
    """Data-parallel tiles with every token in one tile (M <= STREAM_MAX_M): the narrowest of
    DECODE_WHOLE_TILES (at 64 tokens, STREAM_64_WHOLE_TILES) whose tiles fit one an SM, 256-deep ones from
    DECODE_DEEP_MIN_K, else 64-column waves; None where split-K tiles serve the problem (K over
    DECODE_SPLIT_MIN_K with whole tiles for fewer than DECODE_WHOLE_MIN_SMS of the SMs)."""
    p = problem
    # Measured for 16-bit weights on Hopper (wgmma from shared memory for the swapped widths).
    if p.dtype not in ("bf16", "fp16") or not swap_ab_fits(p, device) or p.k < DECODE_WHOLE_MIN_K:
        return None
    block_m = max(16, next_pow2(p.m))
    sms = sm_count(device)
    widths = [t for t in (STREAM_64_WHOLE_TILES if block_m > 32 else DECODE_WHOLE_TILES)
              if p.k >= DECODE_DEEP_MIN_K or t["BLOCK_K"] < 256]
    tiles = next((t for t in widths if math.ceil(p.n / t["BLOCK_N"]) <= sms), DECODE_WHOLE_TILES[1])
    if p.k > DECODE_SPLIT_MIN_K and math.ceil(p.n / tiles["BLOCK_N"]) < DECODE_WHOLE_MIN_SMS * sms:
        return None
    config = _fit_blocks(p, _base(BLOCK_M=block_m, **tiles))
    config["SWAP_AB"] = config["BLOCK_N"] >= 64
    return _fit_stages(p, config, device)


def streaming_config(problem, device: DeviceInfo) -> dict:
    """Decode's weight-streaming kernel for 16 < M <= STREAM_MAX_M: every token in one tile (so B is read
    once), A and B swapped, the fewest K splits that fill the SMs, 5 stages. On the H200 at M = 64 (Llama-3-8B
    and Qwen2.5-7B projections) the 64 x 128 stream-K tiles reached 0.50-0.92x of cuBLAS, geomean 0.72x
    (results/gemm_kernels_2026-12-01b_quick.md); this kernel at 4 stages with the cost model's splits 0.91x
    (_c_quick.md); in results/gemm_policy_sweep_2026-12-01.md, 2 splits at 5 stages led or tied on 4 of the 5
    split shapes (0.95-1.07x), unsplit 64-column tiles on the two gate_up projections (0.97-1.01x). As a
    decode step runs them (CUDA graphs, H100, results/decode_candidates_2026-12-06_h100_mid.json), whole tiles
    beat those splits wherever decode's do (_whole_stream_tiles: at 32 and 64 tokens 0.98-1.06x of cuBLAS
    against 0.46-1.01x), and the split stays where decode's does."""
    whole = _whole_stream_tiles(problem, device)
    if whole is not None:
        return whole
    return _streaming(problem, device, tokens=STREAM_MAX_M, stages=5)


def wide_streaming_config(problem, device: DeviceInfo) -> dict:
    """The weight-streaming kernel for STREAM_MAX_M < M <= WIDE_STREAM_MAX_M: every token in one swapped
    128-token tile (the MMA's N side), 64 weight rows a tile, 128-deep K tiles in 4 stages (192 KiB: one
    program per SM), the fewest K splits that fill the SMs."""
    return _streaming(problem, device, tokens=WIDE_STREAM_MAX_M, stages=4)


def _streaming(problem, device: DeviceInfo, tokens: int, stages: int) -> dict:
    """Up to `tokens` rows of A in one tile, swapped with B's 64-row tiles where it pays, 128-deep K tiles in
    `stages` stages, split over K as little as filling the SMs allows."""
    config = _fit_blocks(problem, _base(BLOCK_M=tokens, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=stages))
    config["SWAP_AB"] = swap_ab_fits(problem, device) and config["BLOCK_N"] >= 64
    return _schedule(problem, config, device, split="fill")


def streams_in_one_wave(problem, config: dict, device: DeviceInfo) -> bool:
    """Whether a swapped streaming config's programs (tiles x splits) all run in the GPU's first wave."""
    split = config["SPLIT_K"] if config["SCHEDULE"] == "split_k" else 1
    return config["SWAP_AB"] and tile_count(problem, config["BLOCK_M"], config["BLOCK_N"]) * split <= \
        programs(problem, config, device)


def _tma_loads(problem, device: DeviceInfo) -> bool:
    """Whether the problem's operands can be loaded by TMA on this GPU."""
    return tma_ok(problem) and arch_of(device).supports(Feature.TMA)


def tma_mid_tile(problem, tiles: dict, device: DeviceInfo) -> dict:
    """One of ONE_WAVE_MID_TILES on TMA loads, its blocks and stages fitted to the problem and the GPU."""
    return _fit_stages(problem, _fit_blocks(problem, _base(VARIANT="tma", GROUP_M=8, **tiles)), device)


def mid_config(problem, device: DeviceInfo) -> dict:
    """M <= STREAM_MAX_M streams the weight; up to WIDE_STREAM_MAX_M it does so where its programs fit one wave
    (results/gemm_policy_sweep_2026-12-01b_wide.md, M = 96 and 128 on Llama-3-8B and Qwen2.5-7B: the o and down
    projections went from 0.62-0.88x of cuBLAS with the tiled config to 0.86-1.06x; the qkv projections, whose
    96-144 tiles x 2 splits take 1.1-1.5 waves, ran 0.64-0.73x streamed against 0.72-0.79x tiled, and gate_up
    was within 5% either way); the rest takes tiles (tiled_mid_config)."""
    if problem.m <= STREAM_MAX_M:
        return streaming_config(problem, device)
    if problem.m <= WIDE_STREAM_MAX_M:
        token_tile = token_tile_config(problem, device)
        if token_tile is not None:
            return token_tile  # narrow weights (TOKEN_TILE_FEW_ROW_READS)
        wide = wide_streaming_config(problem, device)
        if streams_in_one_wave(problem, wide, device):
            return wide
        one_wave = _one_wave_split(problem, wide, device)
        if one_wave is not None:
            return one_wave
        few = few_tokens_config(problem, device)
        if few is not None:
            return few
    return tiled_mid_config(problem, device, token_tiles=problem.m > WIDE_STREAM_MAX_M)  # asked above otherwise


def _one_wave_split(problem, config: dict, device: DeviceInfo) -> dict | None:
    """A swapped streaming `config` whose filling split takes more than one wave, split instead in the most parts
    (two or more, each of two K tiles at least) that take one. At 100 tokens on N = 3072 (48 tiles: two parts fill 73%
    of the SMs, three take 1.1 waves, so the tiles ran whole before; H100, CUDA-graph streams,
    results/mid_n3072_2026-12-06d_h100.json): 3072 x 8192 0.584x of cuBLAS -> 0.846x, 3072 x 3072 0.643x -> 0.805x."""
    if not config["SWAP_AB"]:
        return None
    tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    k_tiles = math.ceil(problem.k / config["BLOCK_K"])
    slots = programs(problem, config, device)
    fits = [s for s in SPLIT_K_CHOICES if 2 <= s and tiles * s <= slots and k_tiles >= 2 * s]
    return dict(config, SCHEDULE="split_k", SPLIT_K=max(fits), PERSISTENT=False) if fits else None


def few_tokens_config(problem, device: DeviceInfo) -> dict | None:
    """STREAM_MAX_M < M <= WIDE_STREAM_MAX_M, 16-bit operands, where wide streaming takes more than one wave: the
    one-wave TMA tiles from FEW_TOKENS_FILL_SMS of the SMs, else unsplit swapped streaming tiles (the one of
    _FEW_TOKENS_STREAMS that fills its waves better; see FEW_TOKENS_FILL_SMS). None: the tiled rules decide."""
    p = problem
    if p.dtype not in ("bf16", "fp16") or not swap_ab_fits(p, device):
        return None
    if _tma_loads(p, device):
        for tiles in ONE_WAVE_MID_TILES:
            config = tma_mid_tile(p, tiles, device)
            if fills_one_wave(p, config, device, FEW_TOKENS_FILL_SMS):
                return config
    # Four warps even for 128 x 128 tiles (_fit_blocks would take 8): they led 8 warps on 4 stages by 6%.
    streams = [_fit_stages(p, dict(_fit_blocks(p, _base(BLOCK_M=WIDE_STREAM_MAX_M, SWAP_AB=True, **tiles)),
                                   num_warps=4), device) for tiles in _FEW_TOKENS_STREAMS]
    busy = [wave_efficiency(tile_count(p, c["BLOCK_M"], c["BLOCK_N"]), programs(p, c, device)) for c in streams]
    return streams[1] if busy[1] >= busy[0] + FEW_TOKENS_WAVE_GAIN else streams[0]


def _fewer_waves(problem, config: dict, device: DeviceInfo) -> dict:
    """`config` with one stage fewer where that fits more programs on an SM and so takes fewer waves of its tiles
    (results/gemm_mid_tiles_2026-12-02b_waves.txt, 64 x 128 x 64 tiles: 3 stages put 3 programs on an SM against 2,
    one wave against two: 512 x 4608 x 3584 0.683x of cuBLAS against 0.570x, 512 x 6144 x 4096 0.805x against 0.611x;
    where 4 stages already took one wave they led, 256 x 6144 x 4096 0.753x against 0.620x)."""
    if config["SCHEDULE"] != "data_parallel" or config["PERSISTENT"] or config["num_stages"] <= 2:
        return config
    fewer = dict(config, num_stages=config["num_stages"] - 1)
    tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    waves = lambda c: math.ceil(tiles / programs(problem, c, device))  # noqa: E731
    return fewer if waves(fewer) < waves(config) else config


def tiled_mid_config(problem, device: DeviceInfo, gluon: bool = True, token_tiles: bool = True) -> dict:
    """64 < M <= 512. On Hopper, narrow weights from MID_LONG_K first take Gluon 64 x 128 tiles split over K
    (_narrow_long_k); then swapped token tiles for narrow weights (token_tile_config; from LONG_K_GLUON_SPLIT_MIN_K,
    where they run whole, _long_k_gluon_split's Gluon tiles split over K); then the Gluon variant's tiles where they
    fill the SMs (_mid_gluon_config); after the one-wave TMA tiles (for narrow weights from fewer SMs:
    _narrow_one_wave), Gluon tiles that fill fewer of them (MID_GLUON_FEW_FILL; below MID_LONG_K the one-wave TMA
    tiles in their place: _wide_one_wave; from MID_LONG_K split in two where that takes one wave: _long_k_halves);
    for narrower weights, below MID_LONG_K, Gluon 64 x 128 tiles split over K or whole (_narrow_gluon_split).
    Otherwise 16-bit operands, measured at M = 256 on Llama-3-8B and Qwen2.5-7B projections
    (results/gemm_policy_sweep_2026-12-01.md; stream-K tiles, the rule before, reached 0.39-0.59x of cuBLAS):
    128 x 256 tiles on TMA in a persistent loop where they alone fill the GPU (gate_up: 0.77-0.91x); then the
    ONE_WAVE_MID_TILES that fit one wave; 128 x 128 tiles split over a long K (down: 0.75-0.82x); else 64 x 128
    tiles, split over K only as far as the SMs need (qkv and o: 0.70-0.77x), on 3 stages where that takes fewer
    waves than 4 (_fewer_waves)."""
    p = problem
    narrow_long = _narrow_gluon_split(p, device) if gluon and _narrow_long_k(p) else None
    if narrow_long is not None:
        return narrow_long
    token_tile = token_tile_config(p, device) if token_tiles else None
    if token_tile is not None:
        long_k_split = _long_k_gluon_split(p, token_tile, device) if gluon else None
        return long_k_split or token_tile
    wide_gluon = _mid_gluon_config(p, device) if gluon else None
    if wide_gluon is not None:
        return wide_gluon
    if p.dtype in ("bf16", "fp16"):
        tma = _tma_loads(p, device)
        if tile_count(p, 128, 256) >= sm_count(device):
            big = _base(VARIANT="tma" if tma else "blocked", PERSISTENT=tma, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                        GROUP_M=8, num_warps=8, num_stages=3)
            return _schedule(p, _fit_blocks(p, big), device, stream_k=False)
        for tiles in ONE_WAVE_MID_TILES if tma else ():
            config = tma_mid_tile(p, tiles, device)
            if fills_one_wave(p, config, device, FILL_SMS):
                return config
        narrow_wave = _narrow_one_wave(p, device) if tma else None
        if narrow_wave is not None:
            return narrow_wave
        few_tiles = _mid_gluon_config(p, device, fill=MID_GLUON_FEW_FILL) if gluon else None
        if few_tiles is not None:
            wide_wave = _wide_one_wave(p, device) if tma else None
            return wide_wave or _long_k_halves(p, few_tiles, device)
        if p.k >= MID_LONG_K:
            long_k = _base(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
            return _schedule(p, _fit_blocks(p, long_k), device, split=True)
        narrow = _narrow_gluon_split(p, device) if gluon else None
        if narrow is not None:
            return narrow
        small = _base(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
        return _fewer_waves(p, _schedule(p, _fit_blocks(p, small), device, split="fill"), device)
    block_m = 32 if p.m <= 32 else 64 if p.m <= 64 else 128
    config = _fit_blocks(p, _base(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128 if p.dtype == "fp8" else 64,
                                  GROUP_M=8, num_warps=4, num_stages=4 if block_m <= 64 else 3))
    return _schedule(p, config, device)


def gluon_config(problem, **tiles) -> dict:
    """A config of the Gluon variant (templates/gemm_gluon_ws.py.j2): a 128-row tile on two consumer warpgroups,
    whole tiles only. Its stream-K schedule lost to whole tiles on 13 of 15 bf16 projections, by up to 1.5x
    (2048 x 4096 x 14336, 128 x 256 tiles: 0.718x of cuBLAS against 1.054x; results/gluon_gemm_2026-12-04_bf16.md)."""
    config = _base(VARIANT=GLUON_WS, SCHEDULE="data_parallel", GROUP_M=8, num_warps=4, BLOCK_M=128, BLOCK_N=128,
                   BLOCK_K=128, num_stages=4)
    config.update(tiles)
    if math.ceil(problem.m / config["BLOCK_M"]) == 1:
        config["GROUP_M"] = 1  # one row of tiles: nothing to group
    if has_promote_axis(problem):
        config["PROMOTE_TILES"] = 1
    return config


def gluon_swapped_config(problem, device: DeviceInfo, **tiles) -> dict:
    """A swapped config of the Gluon variant (C^T = W X^T): BLOCK_M tokens a tile on wgmma's N side, over BLOCK_N
    (64 or 128) weight rows, on as many stages (up to 6) as fit. Consecutive tiles share a weight tile (GROUP_M 1),
    so that the programs running at once read each weight tile together, once from memory."""
    wanted = dict(dict(SWAP_AB=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=6, GROUP_M=1), **tiles)
    return _fit_stages(problem, gluon_config(problem, **wanted), device)


# The Gluon variant's 16-bit tiles on Hopper (results/gluon_gemm_2026-12-04_bf16.md, H200, x cuBLAS, whole tiles):
# 128 x 256 x 64 on 3 stages for prefill (2048-8192 tokens, Llama-3-8B, Qwen2.5-7B, Mistral-7B: 0.94-1.05x where
# the tma variant's same tiles ran 0.93-1.07x, 2048 x 4608 x 3584 aside), 128 x 128 x 64 on 5 stages where those
# fill the waves better (GLUON_HALF_N_GAIN); mid-sized M has its own rule (_mid_gluon_config). C staged in halves buys
# 128 x 256 tiles a fourth stage: within 3% either way, a seed.
_GLUON_WIDE = dict(BLOCK_N=256, BLOCK_K=64, num_stages=3)
_GLUON_HALF = dict(BLOCK_N=128, BLOCK_K=64, num_stages=5)
# 192-column tiles (WIDE_N: a 128- and a 64-column part) on 4 stages (results/gluon_gemm_2026-12-04_wide.md): where
# they kept the most slots busy by 5% or more they led (2048 x 4608 x 3584: 97% against 87%, 0.897x of cuBLAS against
# 0.846x for 128 x 128; 3000 x 5000 x 1536: 98% against 91%, 0.921x against 0.907x for 128 x 256); where they tied on
# busy slots they ran 3-5% behind (4096 x 4608 x 3584, 1024 and 2048 x 6144 x 4096). 3 stages: 0.73-0.77x.
_GLUON_192 = dict(BLOCK_N=192, BLOCK_K=64, num_stages=4)
PREFILL_WIDE_N_GAIN = 0.05
# The Gluon variant's 128 x 128 tiles replace 128 x 256 ones from this gain in busy slots (the tma variant's rule asks
# PREFILL_HALF_N_GAIN): they led by 5% at +0.097 (4096 x 4608 x 3584: 0.963x of cuBLAS against 0.914x) and by 11-25%
# above; at equal busy shares 128 x 256 led by 2-5% (3000 x 5000 x 1536, 2048 x 4096 x 4096;
# results/gluon_gemm_2026-12-04_bf16.md and _wide.md).
GLUON_HALF_N_GAIN = 0.05
# The tail split over K (SCHEDULE=split_k) in two, on 128 x 128 tiles, led whole tiles by 3-7% on 4 of 10 shapes
# with part-empty last waves (2048 x 4608 x 3584 0.885x of cuBLAS against 0.858x, 512 x 6144 x 4096 0.781x against
# 0.732x) and lost up to 30% on the others; more splits, and 128 x 256 tiles, lost nearly everywhere
# (results/gluon_gemm_2026-12-04_tail.md): a seed, not a default.
# Two-part tiles of 128 + 16 and 128 + 32 columns on 5 stages (results/gluon_gemm_2026-12-04_parts.md), for prefill
# where their whole waves beat the others' by PREFILL_PARTS_GAIN in the model of _modelled_waves: 1024 x 4608 x 3584
# (Qwen2.5-7B qkv) 144 wide 0.805x of cuBLAS against 0.716x for 128 x 128, 1024 x 5120 x 5120 (Mistral-Nemo o) 160
# wide 0.852x against 0.789x. Their extra wgmma and C store cost: PART_EFFICIENCY is the throughput a column keeps,
# from the same table (2048 x 4608 x 3584, 144 wide: 4 waves against 5 of 128 x 128, yet 2% behind; 2048 x 5120 x
# 5120, 160 wide: 4 waves against 5, 4% behind). 4 stages were 3-9% behind 5; at 256 and 512 tokens both widths
# lost (512 x 4608 x 3584, one wave of 144: 0.50x against 0.58x for two of 128), and 96 (64 + 32) lost everywhere.
# PREFILL_NARROW: narrow weights (N = 512-1024) at 768-1536 tokens, where 64 x 128 tiles take one wave (H100, CUDA-graph
# streams, results/prefill_narrow_2026-12-06_h100.json): 0.65-1.09x of cuBLAS against 0.42-0.78x for the 128-row tiles
# (1024 x 1024 x 4096 1.07x against 0.74x, 1536 x 512 x 3584 0.94x against 0.63x); where they take two waves
# (1536 x 1024) the 128-row tiles led.
# PREFILL_NARROW_WIDE: on weights up to this many rows, where 64 x 128 tiles take more than one wave and 64 x 192 ones
# fill MID_GLUON_FILL of the SMs in one, the 64 x 192 tiles. Every candidate at 1024 x 1280 x 5120 put them first
# (0.942x of cuBLAS against 0.767x for the 128 x 128 tiles the rules took: 80 tiles, 61% of the SMs;
# results/prefill_m1024_all_2026-12-07c_h100.json). Against the rules before on 105 rows the rule changed (520-2816
# tokens, N 512-2560, 35 weights of the model table; H100, CUDA-graph streams,
# results/prefill_narrow_wide_ab_2026-12-07c_h100.json): up to N = 2304, 93 rows 0.852x -> 1.012x, the worst pair
# 0.958x (520 x 2304 x 9216); at N = 2560 all twelve lost, 0.787x -> 0.688x (cause not found). Out of sample, at other
# token counts on the same weights up to N = 2304 (_oos_ file): 62 rows 0.821x -> 0.993x, each ahead. Measured in
# nn.Linear layout; B row-major takes the rule unmeasured.
PREFILL_NARROW_WIDE_MAX_N = 2304
_GLUON_64X192 = dict(BLOCK_M=64, BLOCK_N=192, BLOCK_K=64, num_stages=6)
_GLUON_PARTS = (dict(BLOCK_N=144, BLOCK_K=64, num_stages=5), dict(BLOCK_N=160, BLOCK_K=64, num_stages=5))
PART_EFFICIENCY = {144: 0.88, 160: 0.90}
PREFILL_PARTS_GAIN = 0.05
_GLUON_16BIT_SEEDS = (_GLUON_192, *_GLUON_PARTS,
                      # 64 x 192: one wave of 128 tiles at 256 x 6144 x 4096, 0.795x against 0.754x for the default.
                      _GLUON_64X192,
                      dict(BLOCK_N=256, BLOCK_K=64, num_stages=4, EPILOGUE_SUBTILE=True),
                      dict(BLOCK_N=128, BLOCK_K=64, num_stages=6, EPILOGUE_SUBTILE=True),
                      dict(BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="split_k", SPLIT_K=2),
                      dict(BLOCK_N=256, BLOCK_K=64, num_stages=3, SCHEDULE="stream_k"),
                      # Ping-pong consumers (a whole 128 x 128 tile each, main loops in turn): behind the default on
                      # 13 of 16 shapes, ahead on 1024 x 6144 x 4096 (0.990x of cuBLAS against 0.954x) and
                      # 2048 x 4096 x 14336 (1.013x against 0.994x; results/gluon_gemm_pingpong_2026-12-06_h100.md).
                      dict(BLOCK_N=128, BLOCK_K=64, num_stages=6, EPILOGUE_SUBTILE=True, SCHEDULE="pingpong"),
                      dict(BLOCK_N=128, BLOCK_K=64, num_stages=5, SCHEDULE="pingpong"))
# Mid-sized M on Hopper takes the Gluon variant's tile of the shortest modelled makespan (_mid_gluon_config), among
# those whose tiles fill MID_GLUON_FILL of the SMs: whole waves times the tile's area over MID_GLUON_EFFICIENCY, the
# throughput it keeps against 128 x 128 tiles. Measured with host-built descriptors, every candidate of 16 Llama-3-8B
# and Qwen2.5-7B projections at 256 and 512 tokens (results/gemm_policy_sweep_2026-12-04_mid.md): the rule picks the
# best Gluon tile, or one within 4%, on each, at 0.88-1.03x of cuBLAS (64 x 192 at 256 x {6144, 4608} x {4096, 3584}:
# 0.91-0.92x, where the tiled default ran 0.73-0.75x; 144 wide at 512 x 4608 x 3584: 0.89x against 0.69x; 192 wide
# at 512 x 6144 x 4096: 0.91x against 0.81x). Where no tile fills the SMs (K from MID_LONG_K, or N of 3584-4096 at
# 256 tokens: 58-67%) the Gluon tiles ran 0.73-0.87x against the tiled rules' 0.82-0.91x, which keep those. 128 x 128
# tiles take C in halves on 6 stages: 2-7% ahead of whole C on 5 stages on 12 of the 16 (within 1% elsewhere).
MID_GLUON_FILL = 0.7
# Where neither those nor the one-wave TMA tiles fill the SMs, Gluon tiles filling this share still led the tiled
# rules' split 64 x 128 tiles (as a prefill chunk runs them: CUDA-graph streams, one weight a call, H100,
# results/mid_candidates_2026-12-06_h100.json): at 192 tokens, 64 x 192 tiles on 43-50% of the SMs ran 0.80x of
# cuBLAS at 4096 x 4096 against 0.68x, 1.02x at 3584 x 3584 against 0.87x, 0.88x at 4096 x 14336 against 0.82x.
MID_GLUON_FEW_FILL = 0.4
_MID_GLUON_TILES = (dict(BLOCK_N=128, BLOCK_K=64, num_stages=6, EPILOGUE_SUBTILE=True), _GLUON_64X192,
                    dict(BLOCK_N=144, BLOCK_K=64, num_stages=5), dict(BLOCK_N=160, BLOCK_K=64, num_stages=5),
                    dict(BLOCK_N=192, BLOCK_K=64, num_stages=4),
                    dict(BLOCK_N=256, BLOCK_K=64, num_stages=4, EPILOGUE_SUBTILE=True))
# From the same table, time per tile area per wave against 128 x 128 (one round; a median of its rows); 128 x 256
# (C in halves) from the rows where it and 128 x 128 take different numbers of waves (H100, CUDA-graph streams,
# results/mid_wide_tiles_2026-12-06c_h100.json and mid_candidates_2026-12-06_h100.json): at 0.95 the rule took
# 128 x 128 tiles on 11 wide weights at 200-512 tokens where 128 x 256 ran 0.846x -> 0.977x of cuBLAS (geomean;
# 320 x 22016 x 4096 0.668x -> 0.992x, 200 x 14336 x 4096 0.714x -> 0.927x, 512 x 14336 x 4096 0.952x -> 0.947x);
# any value from 1.03 to 1.12 picks the same tiles on the 323 measured rows. The H200 agreed at 256 x 28672 x 4096
# (0.96x against 0.92x; results/gemm_policy_sweep_2026-12-04_mid.md).
MID_GLUON_EFFICIENCY = {(128, 128): 1.0, (64, 192): 0.87, (128, 144): 0.95, (128, 160): 0.93, (128, 192): 0.96,
                        (128, 256): 1.05}


# Swapped Gluon tiles (C^T = W X^T, gluon_swapped_config) among the mid tiles: (tokens, weight rows) -> the throughput
# the tile keeps against a 128 x 128 tile, as MID_GLUON_EFFICIENCY. Their token sides cut a chunk's M where 64- and
# 128-row tiles leave the last one part-empty (288 = 3 x 96, 300 in 2 x 160, 400 in 3 x 144). From every swapped
# tile timed beside the default at 96-480 tokens on 16 projections (H100, CUDA-graph streams,
# results/gluon_swap*_2026-12-07_h100.json): the makespan model's time of the row's Gluon default over its measured
# time, against the same for the swapped tile, the lower quartile of the rows (the medians, 0.86-1.12, count the
# default's slow part-filled row tiles in the swapped tile's favour). 128 and 256 tokens are the unswapped tiles' own
# sides; over 64 weight rows the same fit gave medians of 0.58-0.88 (80-192 tokens). Fitted before unswapped tiles
# clamped their last row tile (gemm_space.CLAMP_ROW_TILES); clamped, every candidate at 264-424 tokens on five wide
# weights still found the swapped defaults the best or within 3% (results/partial_rows_clamped_2026-12-07_h100.json).
MID_SWAPPED_EFFICIENCY = {(80, 128): 0.80, (96, 128): 0.85, (144, 128): 0.96, (160, 128): 1.0, (192, 128): 0.92}
# The share of a swapped tiling's last token tile that may be empty (the tiles timed had at most 15% of M as padding).
MID_SWAPPED_MAX_EMPTY = 0.15
# The modelled makespan a swapped tile must save to replace an unswapped one (the model's error: 128 x 256 at 320 x
# 22016 x 4096 ran 0.99x of cuBLAS, results/mid_wide_tiles_2026-12-06c_h100.json, where 160-token tiles model 1.6%
# shorter).
MID_SWAPPED_GAIN = 0.02


def _gluon_16bit(problem, device: DeviceInfo) -> bool:
    return problem.dtype in ("bf16", "fp16") and gluon_ws_ok(problem, device)


def _mid_gluon_config(problem, device: DeviceInfo, fill: float = MID_GLUON_FILL) -> dict | None:
    """16-bit mid-sized M on Hopper: of _MID_GLUON_TILES whose tiles fill `fill` of the SMs, the one of the shortest
    modelled makespan (whole waves times tile area over MID_GLUON_EFFICIENCY); None where none fills them."""
    p = problem
    if not _gluon_16bit(p, device):
        return None
    best, best_time = _shortest_makespan(p, device, fill, [gluon_config(p, **tiles) for tiles in _MID_GLUON_TILES],
                                         MID_GLUON_EFFICIENCY)
    if best is None or not gluon_swap_fits(p):
        return best
    # Swapped tiles where the unswapped ones apply, of token sides that leave little of the last tile empty.
    swapped = [gluon_swapped_config(p, device, BLOCK_M=tokens, BLOCK_N=rows) for tokens, rows in MID_SWAPPED_EFFICIENCY
               if math.ceil(p.m / tokens) * tokens <= (1 + MID_SWAPPED_MAX_EMPTY) * p.m]
    fewer, fewer_time = _shortest_makespan(p, device, fill, swapped, MID_SWAPPED_EFFICIENCY)
    return fewer if fewer_time < (1 - MID_SWAPPED_GAIN) * best_time else best


def _shortest_makespan(problem, device: DeviceInfo, fill: float, configs: list[dict], efficiency: dict):
    """(config, modelled makespan) of the config of `configs` whose tiles fill `fill` of the SMs in the shortest
    _makespan (efficiency[BLOCK_M, BLOCK_N] its throughput); (None, inf) where none fills them."""
    best, best_time = None, math.inf
    for config in configs:
        block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
        if tile_count(problem, block_m, block_n) < fill * sm_count(device):
            continue
        time = _makespan(problem, config, device, efficiency[block_m, block_n])
        if time < best_time:
            best, best_time = config, time
    return best, best_time


# Narrow weights at mid-sized M (N = 512-2048: k and v projections, small models' widths), where no whole tiles fill
# the SMs: the Gluon variant's 64 x 128 tiles split over K in as many parts as fit one wave, at most this many. As a
# prefill chunk runs them (CUDA-graph streams, H100, results/mid_narrow_2026-12-06_h100.json), 16 shapes at 192-512
# tokens: the best of splits 2-8 on each (0.64-0.95x of cuBLAS) against the tiled rules' split 64 x 128 tiles at
# 0.45-0.84x; more parts lost on each (their partial tiles' round trip through the workspace).
# Up to NARROW_WHOLE_MAX_K, from NARROW_WHOLE_MIN_TILES tiles, the tiles ran whole faster than split (224-448 tokens at
# 1024 x 3072 and 160-320 at 2048 x 3584: 0.71-0.89x against 0.67-0.85x; results/mid_narrow_2026-12-06b_h100.json);
# at K 4096-5120, or with fewer tiles (N = 512), the split led.
NARROW_SPLIT_MAX = 3
NARROW_MIN_K = 3072  # measured from 3072 (Llama-3.2-3B) on
NARROW_WHOLE_MAX_K = 3584
NARROW_WHOLE_MIN_TILES = 32
# NARROW_ONE_WAVE: where no token tile applies (each weight row would be read from L2 more than TOKEN_TILE_ROW_READS /
# N times) and the one-wave TMA tiles fill MID_GLUON_FEW_FILL to FILL_SMS of the SMs, those tiles still led every
# Gluon tile on narrow weights (H100, CUDA-graph streams, results/narrow_one_wave_2026-12-06c_h100.json, 70-96 tiles):
# 320 / 384 x 2048 x 4096 1.085 / 0.819x of cuBLAS against 0.975 / 0.730x for 64 x 128 Gluon tiles and 0.867 / 0.673x
# for the few-fill rule's 64 x 192; 448 / 512 x 1280 x 5120 0.976 / 0.965x against 0.700 / 0.765x for the rules before;
# 320 / 384 x 2048 x 3584 within 1% of the Gluon 64 x 128 tiles. On N = 3072 (Phi-3-mini's o and down projections)
# at 176 tokens the same (results/mid_n3072_2026-12-06d_h100.json): 3072 x 3072 0.648x -> 0.881x, 3072 x 8192 0.625x
# -> 0.837x, each the best candidate. Above MID_LONG_K, from 208 tokens, the same (NARROW_LONG_K_MIN_N); unmeasured for
# B row-major. Wider weights take them too in place of the unswapped few-fill Gluon tiles below MID_LONG_K
# (_wide_one_wave; from MID_LONG_K those tiles split in two led: _long_k_halves): at 176 x 3584 x 3584 and 176 x 4096 x
# 4096 0.873x / 0.885x of cuBLAS against 0.753x / 0.771x for the few-fill rule's 64 x 192, both edges clamped
# (results/clamp_ab_cols_2026-12-07_h100.json); at 128, 224 and 256 tokens on the same weights they led 64 x 192 by
# 12-22% (results/mid_candidates_2026-12-06*_h100.json). Out of sample, the default alone at 136-200 tokens on five
# such weights ran 0.84-1.04x (results/wide_one_wave_oos_2026-12-07c_h100.json). Swapped few-fill tiles too: every
# candidate at 160 tokens on 3584 x 3584 and 4096 x 4096 put these tiles first, 0.871x / 0.867x of cuBLAS against
# 0.745x / 0.760x for the swapped 80 x 128 tiles the rule took at 140-160 tokens
# (results/wide_one_wave_all_2026-12-07_h100.json); against that rule on the 40 rows the change makes (140-160 tokens,
# ten weights), 0.772x -> 0.900x, each ahead (results/wide_one_wave_swapped_ab_2026-12-07c_h100.json).
NARROW_ONE_WAVE_MAX_N = 3072
_NARROW_GLUON = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=6)


def _narrow_gluon(problem, split: int = 1) -> dict:
    """The Gluon variant's _NARROW_GLUON tiles, whole (split 1) or split over K in `split` parts."""
    return gluon_config(problem, **_NARROW_GLUON, SCHEDULE="split_k" if split > 1 else "data_parallel", SPLIT_K=split)


def _narrow_one_wave(problem, device: DeviceInfo) -> dict | None:
    """_one_wave_tma's tiles for narrow weights (N <= NARROW_ONE_WAVE_MAX_N); None elsewhere."""
    return _one_wave_tma(problem, device) if problem.n <= NARROW_ONE_WAVE_MAX_N else None


def _wide_one_wave(problem, device: DeviceInfo) -> dict | None:
    """_one_wave_tma's tiles in place of the few-fill Gluon tiles, swapped or not, below MID_LONG_K; None elsewhere
    (from MID_LONG_K, _long_k_halves)."""
    return None if problem.k >= MID_LONG_K else _one_wave_tma(problem, device)


def _one_wave_tma(problem, device: DeviceInfo) -> dict | None:
    """The first of ONE_WAVE_MID_TILES (64 x 128 x 128 on TMA) where its tiles take one wave on MID_GLUON_FEW_FILL of
    the SMs or more, for 16-bit weights in nn.Linear layout from NARROW_MIN_K on; None elsewhere."""
    p = problem
    if p.dtype not in ("bf16", "fp16") or p.k < NARROW_MIN_K or p.layout_b != "col":
        return None
    config = tma_mid_tile(p, ONE_WAVE_MID_TILES[0], device)
    return config if fills_one_wave(p, config, device, MID_GLUON_FEW_FILL) else None


def _narrow_gluon_split(problem, device: DeviceInfo) -> dict | None:
    """The Gluon variant's 64 x 128 tiles split over K in as many parts (2 to NARROW_SPLIT_MAX) as fit one wave of
    one program an SM (whole, up to NARROW_WHOLE_MAX_K, from NARROW_WHOLE_MIN_TILES); None off Hopper's 16-bit
    operands, below NARROW_MIN_K, or where the tiles alone fill more than half the SMs."""
    p = problem
    if not _gluon_16bit(p, device) or p.k < NARROW_MIN_K:
        return None
    tiles = tile_count(p, _NARROW_GLUON["BLOCK_M"], _NARROW_GLUON["BLOCK_N"])
    split = min(NARROW_SPLIT_MAX, sm_count(device) // tiles)
    if split < 2 or math.ceil(p.k / _NARROW_GLUON["BLOCK_K"]) < 2 * split:
        return None
    whole = p.k <= NARROW_WHOLE_MAX_K and tiles >= NARROW_WHOLE_MIN_TILES
    return _narrow_gluon(p, 1 if whole else split)


# From MID_LONG_K, narrow weights (N from NARROW_LONG_K_MIN_N to NARROW_ONE_WAVE_MAX_N: down projections of 1-4B
# models) take the Gluon 64 x 128 tiles split over K (_narrow_gluon_split) ahead of token tiles and the one-wave TMA
# tiles, where two parts or more still take one wave; from more tiles, the one-wave TMA tiles. Every candidate at
# 144-240 tokens (H100, CUDA-graph streams, results/longk_candidates_2026-12-07_h100.json and _heldout_ at 128-224
# tokens): at 144-192 tokens on 2304 x 9216, 2560 x 9728 and 2560 x 10240 the split tiles ran 0.78-0.90x of cuBLAS,
# the best candidate or within 1% of it, where the 128 x 128 split tiles of the rule before ran 0.48-0.57x and the
# one-wave TMA tiles 0.71-0.85x; from 208 tokens (4 rows of 64 x 128 tiles, past one wave split) the TMA tiles led
# (0.75-1.28x, each the best). On 1536 x 8960 and 2048 x 11008 the split tiles ran 0.71-1.12x against the token tiles'
# 0.64-0.95x; on 2048 x 8192 the two were within 2%. Below NARROW_LONG_K_MIN_N the token tiles' own long-K rule
# (TOKEN_TILE_LONG_K) was measured ahead.
NARROW_LONG_K_MIN_N = 1536


def _narrow_long_k(problem) -> bool:
    return problem.k >= MID_LONG_K and NARROW_LONG_K_MIN_N <= problem.n <= NARROW_ONE_WAVE_MAX_N


# From MID_LONG_K, the few-fill Gluon tiles (MID_GLUON_FEW_FILL, swapped or not; two-part tiles included) split over
# K in two where that still takes one wave: 53-66 tiles on 132 SMs, a long K loop against one partial tile's round trip
# through the workspace. Same tables: 144-192 tokens on 3584 x 14336, 3584 x 18944, 4096 x 11008 and 4096 x 14336
# (eight rows), 0.77-1.06x of cuBLAS whole -> 0.94-1.14x split (swapped 80 x 128 and unswapped 64 x 192 tiles).
def _long_k_halves(problem, config: dict, device: DeviceInfo) -> dict:
    """`config` split over K in two from MID_LONG_K where twice its tiles take one wave; `config` elsewhere."""
    tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    if problem.k < MID_LONG_K or config["SCHEDULE"] != "data_parallel" or 2 * tiles > sm_count(device):
        return config
    return dict(config, SCHEDULE="split_k", SPLIT_K=2)


# Narrow weights (gemm_space.token_tiles_fit) at 129-640 tokens, K >= NARROW_MIN_K, 16-bit on Hopper, nn.Linear
# layout: swapped tiles of 64 weight rows and 16, 32 or 64 tokens over the whole K, as cuBLAS tiles them (its 64 x 16
# and 64 x 32 tiles, 96 CTAs; results/ncu_narrow_2026-12-06_h100.txt). The fewest tokens a tile whose programs take
# one wave while each weight row is read from L2 at most TOKEN_TILE_ROW_READS / N times. As a prefill chunk runs
# them (CUDA-graph streams, H100, results/token_tiles_{narrow,narrow_b,prefill}_2026-12-06_h100.json: the 20 k/v
# projections at 160-640 tokens, N 512-2048, K 3072-5120, where the rule applies): 0.73-1.07x of cuBLAS, geomean
# 0.85x, against 0.61-0.79x (geomean 0.71x) for the rules before (Gluon 64 x 128 tiles, whole or split); the best
# candidate's geomean 0.86x. The rule's tile was the best token tile on 13 of 20; the misses that count: 256 x 1024
# takes 32-token tiles (128 programs), 4-6% behind 64-token ones, and 160 x 1280 x 5120 7% behind 64-token tiles
# split in two.
TOKEN_TILE_ROW_READS = 8192
# At 65-128 tokens (results/token_tiles_oos_2026-12-06c_h100.json: 96 and 128 tokens on 512 x 4096, 1024 x 5120,
# 2048 x 4608 and 1024 x 8192) the weight's stream dominates: the best token tile read each weight row at most 4096 / N
# times, and split 32- and 64-token tiles in two where they filled at most half the SMs (0.76-1.05x of cuBLAS against
# 0.55-0.90x for the streaming and tiled rules); 16-token tiles ran whole.
TOKEN_TILE_FEW_ROW_READS = 4096
# From K = TOKEN_TILE_LONG_K, above 128 tokens, 64-token tiles split in two over K lead where they take one wave (each
# program reads half as many bytes as a whole 32-token tile's; H100, CUDA-graph streams,
# results/token_tiles_longk_2026-12-06d_h100.json and token_tiles_oos_2026-12-06c_h100.json): 176 / 208 / 224 x 1024
# x 5120 0.833 / 0.927 / 0.932x of cuBLAS -> 0.930 / 1.024 / 1.056x, 176 / 208 / 224 x 1024 x 8192 0.880 / 0.691 /
# 0.843x -> 1.064 / 0.769 / 0.966x, 160 x 1280 x 5120 0.787x -> 0.842x (seven rows 0.838x -> 0.944x). At K 3072-4096
# the whole 32-token tiles led (160 / 192 x 1024 x 4096: 0.929 / 0.806x against 0.794 / 0.754x).
TOKEN_TILE_LONG_K = 5120
_TOKEN_TILES = {16: dict(BLOCK_K=128, num_stages=5), 32: dict(BLOCK_K=128, num_stages=5),
                64: dict(BLOCK_K=128, num_stages=4)}


# From LONG_K_GLUON_SPLIT_MIN_K, where the token tiles run whole (the 64-token ones split in two would take more than
# one wave, or K is under TOKEN_TILE_LONG_K), the Gluon 64 x 128 tiles split over K (_narrow_gluon_split) in their
# place.
# Every candidate on Mistral-Nemo's k/v projection (1024 x 5120) at 480 and 512 tokens (H100, CUDA-graph streams,
# split partials in register order, results/lowest_candidates_2026-12-07f_h100.json): 0.890x / 0.919x of cuBLAS
# against 0.772x / 0.789x for the whole 64-token tiles. Against the policy without it, on rows drawn from those it
# changes (seed 0 and, out of sample, seed 1; nn.Linear layout only, as token tiles):
# - from K = 5120 (129-505 tokens, N 1024-2048, K 5120-16384; results/long_k_gluon_split_ab_2026-12-07f_h100.json and
#   long_k_gluon_split_ab_oos_2026-12-07f_h100.json): 14 rows 0.823x -> 1.019x and 14 rows 0.789x -> 0.986x, each
#   ahead, the narrowest margin 1.069x;
# - at K 4096-4864 (gluon_split_k4096_ab_2026-12-07f_h100.json and gluon_split_k4096_ab_oos_2026-12-07f_h100.json;
#   145-417 tokens, N 896-2048): 9 rows 0.922x -> 1.005x and 9 rows 0.912x -> 0.979x, ahead on 17; the one behind
#   (0.981x, 145 x 896 x 4864) and 136 x 1024 x 4096 in the candidates' table (0.857x against 0.931x,
#   low_mid_candidates_2026-12-07f_h100.json) replace whole 32-token tiles at few tokens, where the rule is weakest.
LONG_K_GLUON_SPLIT_MIN_K = 4096


def _long_k_gluon_split(problem, token_tile: dict, device: DeviceInfo) -> dict | None:
    """_narrow_gluon_split's split tiles in place of whole `token_tile`s above WIDE_STREAM_MAX_M tokens from
    LONG_K_GLUON_SPLIT_MIN_K; None elsewhere."""
    if (problem.m <= WIDE_STREAM_MAX_M or problem.k < LONG_K_GLUON_SPLIT_MIN_K
            or token_tile["SCHEDULE"] != "data_parallel"):
        return None
    split = _narrow_gluon_split(problem, device)
    return split if split is not None and split["SCHEDULE"] == "split_k" else None


def token_tile_config(problem, device: DeviceInfo) -> dict | None:
    """Swapped tiles of TOKEN_TILE_BLOCK_MS tokens for narrow weights (see TOKEN_TILE_ROW_READS; up to
    WIDE_STREAM_MAX_M tokens TOKEN_TILE_FEW_ROW_READS, and tiles of 32 tokens or more split in two where that still
    takes one wave; above, from TOKEN_TILE_LONG_K, 64-token tiles split in two where they take one wave); None where
    the rule does not apply or no tile size takes one wave within the row reads."""
    p = problem
    if (p.dtype not in ("bf16", "fp16") or not swap_ab_fits(p, device) or not token_tiles_fit(p)
            or p.k < NARROW_MIN_K or p.layout_b != "col"):
        return None
    few = p.m <= WIDE_STREAM_MAX_M
    if not few and p.k >= TOKEN_TILE_LONG_K:
        block_m = max(TOKEN_TILE_BLOCK_MS)
        config = _token_tile(p, block_m, device)
        if (math.ceil(p.m / block_m) * p.n <= TOKEN_TILE_ROW_READS
                and 2 * tile_count(p, block_m, 64) <= programs(p, config, device)):
            return dict(config, SCHEDULE="split_k", SPLIT_K=2)
    for block_m in TOKEN_TILE_BLOCK_MS:
        if math.ceil(p.m / block_m) * p.n > (TOKEN_TILE_FEW_ROW_READS if few else TOKEN_TILE_ROW_READS):
            continue
        config = _token_tile(p, block_m, device)
        tiles, slots = tile_count(p, block_m, 64), programs(p, config, device)
        if tiles <= slots:
            if few and block_m > min(TOKEN_TILE_BLOCK_MS) and 2 * tiles <= slots:
                return dict(config, SCHEDULE="split_k", SPLIT_K=2)
            return config
    return None


def _token_tile(problem, block_m: int, device: DeviceInfo) -> dict:
    """Unsplit swapped tiles of `block_m` tokens and 64 weight rows (token_tile_config)."""
    return _fit_stages(problem, _base(BLOCK_M=block_m, BLOCK_N=64, SWAP_AB=True, **_TOKEN_TILES[block_m]), device)


def _makespan(problem, config: dict, device: DeviceInfo, efficiency: float) -> float:
    """Whole waves of `config`'s tiles times their area, over the throughput the tile keeps (`efficiency`, against
    a 128 x 128 tile): a modelled makespan for comparing tile shapes of one problem."""
    count = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    return math.ceil(count / programs(problem, config, device)) * config["BLOCK_M"] * config["BLOCK_N"] / efficiency


# Seeds of the Gluon variant for fp8 on Hopper: precise 128 x 128 tiles (their fp32 sum and per-tile accumulator
# fit a consumer's registers; 128 x 256 spills: 0.40x), fast 128 x 256 (8192^3: 1.061x of
# _scaled_mm(use_fast_accum=True)) and 128 x 128 on five stages (results/gluon_gemm_prototype_2026-12-02.txt),
# and stream-K over the last wave, which led precise 8192^3 by 1% (results/gluon_gemm_2026-12-04_fp8.md).
_GLUON_FP8_TILES = (dict(num_stages=4), dict(num_stages=5), dict(BLOCK_N=256, num_stages=3),
                    dict(num_stages=4, SCHEDULE="stream_k"))


def _prefill_narrow_wide(problem, device: DeviceInfo) -> dict | None:
    """The Gluon variant's 64 x 192 tiles where they fill MID_GLUON_FILL of the SMs in one wave, on weights of up to
    PREFILL_NARROW_WIDE_MAX_N rows; None elsewhere."""
    if problem.n > PREFILL_NARROW_WIDE_MAX_N:
        return None
    config = gluon_config(problem, **_GLUON_64X192)
    return config if fills_one_wave(problem, config, device, MID_GLUON_FILL) else None


# PREFILL_NARROW's one wave of 64 x 128 tiles on TMA loads 128 deep (the first of ONE_WAVE_MID_TILES) in place of the
# Gluon variant's 64 deep. Every candidate at 1024 tokens (H100, CUDA-graph streams,
# results/lowest_candidates_2026-12-07f_h100.json): 1024 x 1024 x 4096 1.064x of cuBLAS against 0.965x, 1024 x 1024 x
# 5120 1.113x against 1.039x, 1024 x 512 x 3584 0.787x against 0.777x (swapped 64 x 64 x 128 tiles led there, 0.851x).
# Against the policy without it on 40 rows drawn from the 1979 it changes (513-3584 tokens, N 128-1536, K 896-16384;
# seed 0 and, out of sample, seed 1: results/prefill_narrow_tma_ab_2026-12-07f_h100.json and
# prefill_narrow_tma_ab_oos_2026-12-07f_h100.json): 0.957x -> 0.986x and 0.957x -> 0.973x of cuBLAS; ahead on every
# row up to K = 4864 (1-5%), within 2% either way from K = 5120 (the worst pair 0.980x, 953 x 1024 x 16384).
def _prefill_narrow_tma(problem, device: DeviceInfo) -> dict | None:
    """The one-wave TMA tiles where they take one wave, for 16-bit weights in nn.Linear layout; None elsewhere."""
    p = problem
    if p.dtype not in ("bf16", "fp16") or p.layout_b != "col" or not _tma_loads(p, device):
        return None
    config = tma_mid_tile(p, ONE_WAVE_MID_TILES[0], device)
    return config if tile_count(p, config["BLOCK_M"], config["BLOCK_N"]) <= programs(p, config, device) else None


def _modelled_waves(problem, config: dict, device: DeviceInfo) -> float:
    """_makespan with the throughput a column keeps (PART_EFFICIENCY; 1 for other widths), for comparing widths."""
    return _makespan(problem, config, device, PART_EFFICIENCY.get(config["BLOCK_N"], 1.0))


# PREFILL_TAIL_SPLIT: the Gluon variant's tiles past the last whole wave split over K (split_k: every tail tile split
# at the same K offsets, so that a split's programs read the K slices of shared panels together) where the modelled
# makespan (_tail_split_makespan) falls by this share. Long K leaves most room: 3000 x 3584 x 18944 (Qwen2.5-7B's down
# projection at a 3000-token chunk; H100, results/tail_candidates_2026-12-08a_h100.json) runs 336 tiles of 128 x 256,
# two whole waves and 72 tiles on 132 SMs, at 0.841x of cuBLAS; split three ways the model puts it 10% faster. Split
# in two it ran 0.753x there, where the model has it level with whole tiles (no round saved): the split schedule cost
# about 66 us more than split_cost counts, and whether that is a cost a split or a cost of the schedule decides the
# rule. Stream-K's even share models faster still but ran 0.762x: each program walks its own K offset, so shared
# panels are read from memory at different times. Below PREFILL_TAIL_SPLIT_MIN_K the K loop leaves less to save:
# 128 x 256 tails split 2-8 ways lost 8-68% at K = 1536-4096 (results/gluon_gemm_2026-12-04_tail.md, an earlier
# fix-up). NOTE: off (an infinite gain asked) until benchmarks/prefill_tail_split.py and an A/B over model shapes
# (policy_rule_ab.py --set PREFILL_TAIL_SPLIT_GAIN=0.03) have timed it.
PREFILL_TAIL_SPLIT_GAIN = float("inf")
PREFILL_TAIL_SPLIT_MIN_K = 8192


def _tail_split_makespan(problem, config: dict, device: DeviceInfo, split: int) -> float:
    """K tiles a program walks, `config`'s whole waves and then its tail tiles split `split` ways, dealt round-robin,
    with split_cost's round trip of a partial for each split past the first."""
    tiles = tile_count(problem, config["BLOCK_M"], config["BLOCK_N"])
    slots = programs(problem, config, device)
    k_tiles = math.ceil(problem.k / config["BLOCK_K"])
    tail = tiles % slots
    rounds = math.ceil(tail * split / slots)
    return tiles // slots * k_tiles + rounds * math.ceil(k_tiles / split) + split_cost(problem, config) * (split - 1)


def _prefill_tail_split(problem, config: dict, device: DeviceInfo) -> dict:
    """`config` (whole Gluon tiles) with its tail split the way of the shortest modelled makespan, where that is
    PREFILL_TAIL_SPLIT_GAIN shorter than whole tiles', a whole wave comes first and K is PREFILL_TAIL_SPLIT_MIN_K or
    more; `config` elsewhere."""
    p = problem
    tiles, slots = tile_count(p, config["BLOCK_M"], config["BLOCK_N"]), programs(p, config, device)
    if (config["SCHEDULE"] != "data_parallel" or p.k < PREFILL_TAIL_SPLIT_MIN_K or tiles < slots
            or tiles % slots == 0):
        return config
    k_tiles = math.ceil(p.k / config["BLOCK_K"])
    usable = [s for s in SPLIT_K_CHOICES if s > 1 and k_tiles >= 2 * s]
    if not usable:
        return config
    spans = {s: _tail_split_makespan(p, config, device, s) for s in [1] + usable}
    split = min(usable, key=lambda s: (spans[s], s))
    if spans[split] <= (1 - PREFILL_TAIL_SPLIT_GAIN) * spans[1]:
        return dict(config, SCHEDULE="split_k", SPLIT_K=split)
    return config


def prefill_config(problem, device: DeviceInfo, gluon: bool = True, token_tiles: bool = True) -> dict:
    p = problem
    if gluon and p.dtype == "fp8" and gluon_ws_ok(p, device):
        # fp8 on Hopper. Precise: the Gluon kernel's two consumer warpgroups overlap one's promotion with the other's
        # MMAs, which Triton 3.6's tl.dot loop cannot (4096^3: 0.954x of _scaled_mm, 0.751x for the tma variant).
        # Fast accumulation: 128 x 256 tiles, 0.996x / 1.046x of _scaled_mm(use_fast_accum=True) at 4096^3 / 8192^3
        # against the tma variant's 0.946x / 1.020x (results/gluon_gemm_2026-12-04_fp8.md).
        return gluon_config(p, BLOCK_N=256, num_stages=3) if p.fp8_fast_accum else gluon_config(p)
    token_tile = token_tile_config(p, device) if token_tiles else None
    if token_tile is not None:
        return token_tile  # narrow weights up to TOKEN_TILE_MAX_M tokens
    if gluon and _gluon_16bit(p, device):
        # 16-bit on Hopper: 64 x 128 tiles where they take one wave (narrow weights), then 64 x 192 tiles where those
        # do (PREFILL_NARROW_WIDE); else whole 128 x 256 tiles, or
        # 128 x 128 where those fill the waves better by GLUON_HALF_N_GAIN;
        # 192-column tiles where they fill them better than both by PREFILL_WIDE_N_GAIN; 144 or 160 where their
        # modelled waves are shorter than the chosen one's by PREFILL_PARTS_GAIN.
        narrow = _narrow_gluon(p)
        if tile_count(p, narrow["BLOCK_M"], narrow["BLOCK_N"]) <= programs(p, narrow, device):
            # One wave of 64-row tiles: 128-row ones would leave half the SMs idle (PREFILL_NARROW).
            return _prefill_narrow_tma(p, device) or narrow
        wider = _prefill_narrow_wide(p, device)
        if wider is not None:
            return wider
        wide, half = gluon_config(p, **_GLUON_WIDE), gluon_config(p, **_GLUON_HALF)
        busy = lambda c: wave_efficiency(tile_count(p, c["BLOCK_M"], c["BLOCK_N"]), programs(p, c, device))  # noqa: E731
        best = half if busy(half) >= busy(wide) + GLUON_HALF_N_GAIN else wide
        if p.n > 128:
            n192 = gluon_config(p, **_GLUON_192)
            if busy(n192) >= max(busy(wide), busy(half)) + PREFILL_WIDE_N_GAIN:
                best = n192
            parts = [gluon_config(p, **tiles) for tiles in _GLUON_PARTS]
            part = min(parts, key=lambda c: _modelled_waves(p, c, device))
            if _modelled_waves(p, part, device) <= (1 - PREFILL_PARTS_GAIN) * _modelled_waves(p, best, device):
                return _prefill_tail_split(p, part, device)
        return _prefill_tail_split(p, best, device)
    tma = _tma_loads(p, device)
    if p.dtype == "fp8":
        if p.fp8_fast_accum:
            tiles = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_stages=3)
        else:
            tiles = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=4)
    elif p.dtype == "fp32" and not p.tf32:
        tiles = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_stages=3)
    else:
        tiles = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32 if p.dtype == "fp32" else 64, num_stages=3)
    config = _fit_blocks(p, _base(VARIANT="tma" if tma else "blocked", PERSISTENT=tma, GROUP_M=8, num_warps=8, **tiles))
    if p.dtype in ("bf16", "fp16") and config["BLOCK_N"] == 256:
        # Wave quantisation: 128 x 128 tiles where they keep the SMs busier by PREFILL_HALF_N_GAIN (2048 x 4608
        # x 3584: 73% of the last wave's slots busy with 128 x 256 tiles, 87% with 128 x 128; 0.79x of cuBLAS
        # against 0.73x; results/gemm_policy_sweep_2026-12-01.md).
        half = _fit_blocks(p, dict(config, BLOCK_N=128, num_stages=4))
        busy = lambda c: wave_efficiency(tile_count(p, c["BLOCK_M"], c["BLOCK_N"]), programs(p, c, device))  # noqa: E731
        if busy(half) >= busy(config) + PREFILL_HALF_N_GAIN:
            config = half
    # NOTE: no stream-K for 16-bit operands: on the H200 the persistent data-parallel 128 x 256 tiles beat it on
    # every shape where the wave rule chose it (2048 x {4608, 3584} x 3584, 2048 x 3584 x 18944, 3000 x 5000 x
    # 1536: 0.73-1.00x of cuBLAS against 0.65-0.80x; results/gemm_policy_sweep_2026-12-01.md).
    return _schedule(p, config, device, stream_k=p.dtype not in ("bf16", "fp16"))


def preferred_config(problem, device: DeviceInfo) -> dict:
    """The policy's config for `problem` (the family checks it against the space and takes the nearest feasible)."""
    if problem.dtype == "fp32" and not problem.tf32:
        return _schedule(problem, _fit_blocks(problem, _base(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)), device)
    return {"decode": decode_config, "mid": mid_config, "prefill": prefill_config}[regime(problem)](problem, device)


def _other_schedules(problem, config: dict, device: DeviceInfo) -> list[dict]:
    """`config`'s tiles under each schedule it does not use (the space drops those that do not apply)."""
    plain = dict(config, SCHEDULE="data_parallel", SPLIT_K=1)
    split = best_split(problem, config, device)
    return [c for c in (
        plain,
        dict(plain, SCHEDULE="split_k", SPLIT_K=split if split > 1 else 2, PERSISTENT=False, WARP_SPECIALIZE=False,
             FLATTEN=False),
        dict(plain, SCHEDULE="stream_k", PERSISTENT=False, WARP_SPECIALIZE=False, FLATTEN=False),
    ) if c["SCHEDULE"] != config["SCHEDULE"]]


# Tile shapes tried beside the policy's own, per regime (each re-scheduled as the policy would).
_DECODE_TILES = (dict(BLOCK_N=128, num_stages=4), dict(BLOCK_K=256, num_stages=4),
                 dict(BLOCK_N=32, BLOCK_K=256, SWAP_AB=False), dict(BLOCK_N=128, num_warps=8, num_stages=4))
_MID_TILES = (dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4),
              dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
              dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3),
              dict(BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=3))
_PREFILL_TILES = (dict(BLOCK_N=128, num_stages=4), dict(BLOCK_N=128, num_warps=4, num_stages=4),
                  dict(BLOCK_M=256, BLOCK_N=128, num_stages=3), dict(PERSISTENT=False), dict(WARP_SPECIALIZE=True))
_FP8_TILES = (dict(BLOCK_N=256, num_stages=3), dict(BLOCK_N=128, num_stages=4),
              dict(BLOCK_N=128, BLOCK_K=64, num_stages=5), dict(BLOCK_M=64, BLOCK_N=256, num_stages=4),
              dict(PERSISTENT=False),
              # Two programs per SM: one's promotion (a full wgmma drain) overlaps the other's MMAs.
              dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4))


def seed_variations(problem, device: DeviceInfo) -> list[dict]:
    """Known-good starting points around the policy's config, per regime (the first is the policy's own)."""
    p = problem
    first = preferred_config(p, device)
    kind = regime(p)
    shapes = {"decode": _DECODE_TILES, "mid": _MID_TILES}.get(kind, _FP8_TILES if p.dtype == "fp8" else _PREFILL_TILES)
    wanted = [first]
    # The tiles varied below are the Triton variants' tiles of the rules (token tiles and the Gluon variant's have
    # their own seeds, further down).
    token_tiles = token_tile_config(p, device) is not None  # then `first` is its config
    tiled = first if first["VARIANT"] != GLUON_WS and not token_tiles else (
        (prefill_config if kind == "prefill" else tiled_mid_config)(p, device, gluon=False, token_tiles=False))
    if tiled is not first:
        wanted.append(tiled)
    if kind == "mid" and p.m <= STREAM_MAX_M:
        # The default streams the weight: try its 128-column tiles, and the tiled kernel and its variations.
        tiled = tiled_mid_config(p, device, gluon=False)
        wanted += [_schedule(p, _fit_blocks(p, dict(first, BLOCK_N=128, SCHEDULE="data_parallel", SPLIT_K=1)), device,
                             split=True), tiled]
    elif kind == "mid" and p.m <= WIDE_STREAM_MAX_M:
        # Streaming and tiles each won some shapes here: whichever is the default, the other is tried too (and
        # beside a token tile, the streaming rule it replaced).
        tiled = tiled_mid_config(p, device, gluon=False, token_tiles=False)
        few = few_tokens_config(p, device) if token_tiles else None
        wanted += [wide_streaming_config(p, device), tiled] + ([few] if few is not None else [])
    for shape in shapes:
        config = _fit_blocks(p, dict(tiled, **shape))
        wanted.append(_schedule(p, dict(config, SCHEDULE="data_parallel", SPLIT_K=1), device, split=kind == "decode"))
    wanted += _other_schedules(p, first, device)
    if kind == "decode":
        wanted.append(dict(first, SWAP_AB=not first["SWAP_AB"]))
    if token_tiles:
        # The other sizes, whole and split in two (each led some of the rule's measured shapes).
        for block_m in TOKEN_TILE_BLOCK_MS:
            tiles = _token_tile(p, block_m, device)
            wanted += [tiles, dict(tiles, SCHEDULE="split_k", SPLIT_K=2)]
    if tma_ok(p) and first["VARIANT"] == "blocked":
        wanted.append(dict(first, VARIANT="tma"))
    elif first["VARIANT"] == "tma":
        wanted.append(dict(first, VARIANT="blocked", PERSISTENT=False, WARP_SPECIALIZE=False, FLATTEN=False))
    if has_promote_axis(p) and first["VARIANT"] != GLUON_WS:
        wanted += [dict(first, PROMOTE_TILES=promote) for promote in (1, 2, 4) if promote != first.get("PROMOTE_TILES")]
    if kind == "prefill" and p.dtype == "fp8" and gluon_ws_ok(p, device):
        wanted += [gluon_config(p, **tiles) for tiles in _GLUON_FP8_TILES]
        if first["VARIANT"] == GLUON_WS:  # and the tma variant's own default, with its promotion intervals
            tiled = prefill_config(p, device, gluon=False)
            wanted += [dict(tiled, PROMOTE_TILES=promote) for promote in (1, 2, 4)] if has_promote_axis(p) else [tiled]
    if kind == "mid" and p.m > WIDE_STREAM_MAX_M and p.dtype in ("bf16", "fp16") and _tma_loads(p, device):
        # The one-wave TMA tiles whatever share of the SMs they fill (448-512 x 2048 x 3584 at 85-97%: 1.08-1.13x of
        # cuBLAS on an H100, ahead of every Gluon tile; results/mid_narrow_2026-12-06b_h100.json).
        wanted += [tma_mid_tile(p, tiles, device) for tiles in ONE_WAVE_MID_TILES]
    if kind in ("mid", "prefill") and _gluon_16bit(p, device):
        wanted += [gluon_config(p, **tiles) for tiles in (_GLUON_WIDE, _GLUON_HALF) + _GLUON_16BIT_SEEDS]
        # The narrow weights' 64 x 128 tiles, whole and split (_narrow_gluon_split, PREFILL_NARROW).
        wanted += [_narrow_gluon(p, split) for split in range(1, NARROW_SPLIT_MAX + 1)]
    return wanted
