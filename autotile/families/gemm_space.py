"""The GEMM family's search space: axes, the constraints that keep only meaningful combinations, and the
resource estimates they rest on (shared memory, accumulator registers, programs per SM).

The schedule is an axis: `data_parallel` (one program per C tile, or a persistent loop over tiles),
`split_k` (SPLIT_K programs per tile), `stream_k` (whole tiles for the full waves, the rest spread
evenly over the programs that fill the GPU) or, for the Gluon variant only, `pingpong` (whole tiles, two consumer
warpgroups taking them in turn). SPLIT_K > 1 exactly when the schedule is split_k.

The full grid of the axes has about a million points; `StagedSpace` enumerates the feasible ones by
binding the axes in order and checking each constraint as soon as the axes it reads are bound, so a
violated constraint prunes its whole subtree (well under a second per problem instead of tens).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from autotile.arch import Feature, arch_of, feature_constraint, require_dtypes
from autotile.device import DeviceInfo
from autotile.dtypes import element_size
from autotile.families.base import next_pow2
from autotile.space import Axis, AxisKind, Config, Constraint, Space

SCHEDULES = ("data_parallel", "split_k", "stream_k", "pingpong")
# The Gluon variant (templates/gemm_gluon_ws.py.j2): warp-specialised, persistent; whole waves of tiles, then the
# tiles left over by stream-K, split over K (split_k: only those split) or whole; one consumer warpgroup per
# GLUON_WG_ROWS rows of a tile, or (pingpong) two consumer warpgroups with whole tiles of their own.
GLUON_WS = "gluon_ws"
GLUON_SCHEDULES = ("stream_k", "data_parallel", "split_k", "pingpong")
PINGPONG = "pingpong"
# Tile widths no power of two: the Gluon variant holds one as two parts (WIDE_N), the largest power of two below it
# and a 16-, 32- or 64-column rest, so that projections whose 128- and 256-wide tiles leave a wave part-empty can
# fill it: N = 3072 is 32 tiles of 96 a row, 4608 32 of 144, 5120 32 of 160, 6144 32 of 192. cuBLAS picks such
# widths too (112 at 512 x 3584 x 3584, results/ncu_gemm_2026-12-04/).
GLUON_WIDE_NS = (96, 144, 160, 192)
# Every two-part width the kernel holds: the above, and 80 (64 + 16) as a swapped tile's tokens.
GLUON_TWO_PART = (80,) + GLUON_WIDE_NS
# Two-part tiles split over K (templates/gemm_gluon_ws.py.j2, _consumer_wide's split_k tail): for narrow weights and
# long K, where 144- or 160-token tiles are few (144 x 2560 x 10240: 20 tiles of 144 x 128). Compiled for sm90 without
# spills; on since test_gemm_gpu.py's two-part and swapped checks passed on an H100
# (results/gemm_two_part_split_tests_2026-12-07_h100.txt). Off, two-part tiles run whole only.
GLUON_TWO_PART_SPLIT = True
# Whole, unswapped tiles of the variants that load A by TMA start their last row tile at M - BLOCK_M (gemm_common.j2,
# _row0): it overlaps the tile before it instead of loading A boxes that lie mostly past M. Unclamped, such tiles ran
# up to 1.65x slower at the same tile count (H100, CUDA-graph streams): Gluon 128 x 128 on 4096 x 14336 0.598x of
# cuBLAS at 392 tokens (8 rows of the last row tile) and 0.918x clamped, 0.750x -> 1.044x at 424 tokens; 64 x 192 on
# 28672 x 4096 at 288 tokens 0.813x -> 1.022x (results/clamp_ab_2026-12-07_h100.json). Split tiles are not clamped:
# their rows sum in another order than the whole tile before them, whose rows the clamped tile writes again. C must
# not alias the residual (the runtime's ops always write a fresh C): a row written twice would add it twice.
CLAMP_ROW_TILES = True
# The same along N for whole tiles, swapped ones included (their columns are the tokens): the last column tile ends at
# N. Swapped 144-token tiles at 296 x 5120 x 4096 (the last token tile 8 tokens full) ran 0.654x -> 0.765x of cuBLAS,
# at 300 x 6144 x 4096 0.425x -> 0.499x; over 90 configs of nine shapes (both edges clamped against neither) 1.12x in
# the geometric mean, the worst 0.97x (tma 128 x 128 at 176 x 3584 x 3584), results/clamp_ab_cols_2026-12-07_h100.json.
CLAMP_COL_TILES = True
CLAMPED_VARIANTS = (GLUON_WS, "tma")
# Split gluon_ws tiles' fp32 partials laid out in the wgmma accumulator's register order (gemm_gluon_ws.py.j2,
# _register_order), so that a warp's 64-bit store or load of a register pair covers 256 contiguous bytes instead of 32
# in each of 8 rows. The partial loads were the fix-up's cost on an H100 (results/stream_k_diag_2026-12-07e2_h100.json:
# 1024 x 512 x 3584 split 4 ways ran 25.9 us, 14.1 without its fix-up); in register order every split and stream-K
# config ran faster, with the same bits (results/stream_k_diag_2026-12-07f_h100.json: that split 26.0 -> 20.9 us,
# 1536 x 3584 x 3584 split 4 91.2 -> 79.0, stream-K 76.6 -> 71.5, 576 x 2560 x 4096 stream-K 128 x 256 63.9 -> 48.8;
# register_order_tests_2026-12-07f_h100.txt).
COALESCED_PARTIALS = True
# Split gluon_ws tiles of two consumer warpgroups (128 kernel rows) and up to 128 columns finished by fixed owners,
# one per warpgroup's rows (gemm_gluon_ws.py.j2, _arrive_owning), where each program runs one split at most: two SMs
# then share a tile's partial loads and epilogue, where the last split to arrive did both alone. Interleaved, us, on
# an H100 (results/stream_k_diag_2026-12-07g_h100.json): 100 x 3072 x 3072 swapped 64-token tiles split 2 ways
# 19.2 -> 18.0, 128 x 128 split 2 21.1 -> 20.4; 1024 x 512 x 3584 split 2 19.8 -> 18.8, split 4 19.4 -> 18.9;
# 128 x 4096 x 4096 within 0.7 either way; the same bits (owned_split_tests_2026-12-07g_h100.txt). With one
# warpgroup there is nothing to share out, so 64-row tiles keep the last arrival's protocol.
# NOTE: off. An owner waits for splits that may not have started: that needs every program of the grid resident at
# once, which the grid's size ensures only while the kernel has the GPU to itself. Two such kernels on two streams
# (or one under MPS with a share of the SMs) can each hold SMs spinning for programs that never get one: a hang. The
# last arrival's protocol waits only for splits that have arrived, so it cannot. 3-6% on split tiles the policy does
# not serve (its split rows are 64-row and two-part tiles) is not worth that.
OWNED_SPLITS = False
GLUON_WG_ROWS = 64
# Swapped gluon_ws tiles (C^T = W X^T) put the tokens on wgmma's N side, in tiles of any of these (BLOCK_M; the wide
# ones held in two parts as above), over 64 or 128 weight rows (BLOCK_N): a prefill chunk's M is then cut in tiles
# that leave little of the last one empty (288 = 3 x 96, 480 = 3 x 160), where unswapped tiles come in 64 or 128
# rows. cuBLAS's mid-M kernels take such token sides too (96 x 128 at 288 x 5120 x 4096 and 144 x 128, the
# nvjet_sm90_tst kernels of results/kernel_profile_2026-12-02.txt).
GLUON_SWAP_TOKEN_TILES = (16, 32, 64, 80, 96, 128, 144, 160, 192, 256)
GLUON_SWAP_MAX_M = 1024
SPLIT_K_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)
PROMOTE_CHOICES = (1, 2, 4)
# Precise fp8 sums at most this many products in the tensor cores' reduced-precision accumulator
# before adding them to the fp32 one (PROMOTE_TILES x BLOCK_K). DeepSeek-V3 (sec. 3.3.2) promotes every
# 128; twice that keeps the error bound of `GemmFamily.tolerance` within 1.5x of it.
FP8_PRECISE_INTERVAL = 256
# K width of one group of block scales (SCALES == 'block'; the template's SCALE_BLOCK).
SCALE_BLOCK = 128
# SWAP_AB puts the tokens (M) on the MMA's N side, which takes up to 256 columns (Hopper's wgmma; Ampere's
# mma tiles N the same way): up to M = 256 every token fits one tile, so the weight is streamed once.
SWAP_MAX_M = 256
# Above this many tokens a swapped tile holds them all (the point of swapping there is to stream the weight once);
# smaller swapped tiles at M = 65-256 nearly doubled the space (21k -> 38k configs at M = 128) for nothing measured.
SWAP_ANY_TILE_M = 64
# Except for narrow weights (k and v projections): there swapped tiles of 16-64 tokens over 64 weight rows run up to
# TOKEN_TILE_MAX_M tokens, as cuBLAS's do (64 x 16 and 64 x 32 tiles over the whole K, ncu on an H100,
# results/ncu_narrow_2026-12-06_h100.txt). As a prefill chunk runs them they led every other tile on 19 of 25 k/v
# projections at 160-1200 tokens (results/token_tiles_{narrow,narrow_b,prefill}_2026-12-06_h100.json).
TOKEN_TILE_MAX_N = 2048
TOKEN_TILE_MAX_M = 640
TOKEN_TILE_BLOCK_MS = (16, 32, 64)


def token_tiles_fit(problem) -> bool:
    """Whether swapped tiles may hold fewer tokens than M above SWAP_ANY_TILE_M (narrow weights, few tokens)."""
    return SWAP_ANY_TILE_M < problem.m <= TOKEN_TILE_MAX_M and problem.n <= TOKEN_TILE_MAX_N


# The smallest BLOCK_K fp8 tensor-core tiles take (32 bytes of K at least twice); other operands take the axis's least.
FP8_MIN_BLOCK_K = 64
# Workspace elements a split-K run may use (fp32): 2**28 is 1 GiB.
SPLIT_K_WORKSPACE_LIMIT = 2**28
# Split-K is for problems whose tiles do not fill the GPU: with at least this many tiles per SM
# the data-parallel and stream-K schedules already keep every SM busy.
SPLIT_K_MAX_TILES_PER_SM = 2
# The interpreter's device reports the host's CPU count: the constraints count an H200's SMs instead,
# so the same configs are feasible on the CPU as on the GPU the project is tuned on.
NOMINAL_SMS = 132
# Shared memory the driver reserves per block (1 KiB on sm80 and newer); registers and threads per SM come
# from the device's architecture (autotile.arch).
SMEM_RESERVED_PER_BLOCK = 1024
# Registers a thread needs beside its accumulators (operand fragments, addresses, loop state): an estimate
# that ptxas -v reports within ~20 registers of for this template's sm90 kernels.
REGISTERS_BESIDE_ACCUMULATORS = 64


@dataclass(frozen=True)
class Rule:
    """A named constraint and the axes it reads (it is checked once they are all bound)."""

    reads: tuple[str, ...]
    constraint: Constraint


def rule(name: str, reads: tuple[str, ...], holds: Callable[[Mapping], bool], explain) -> Rule:
    return Rule(reads, Constraint(name, holds, explain))


class StagedSpace(Space):
    """A Space whose `feasible()` prunes subtrees as soon as a constraint's axes are bound.

    `upgrade`: as Space's.

    >>> space = StagedSpace([Axis("A", (1, 2, 3)), Axis("B", (1, 2))],
    ...                     [rule("a_small", ("A",), lambda c: c["A"] < 3, "A < 3"),
    ...                      rule("sum", ("A", "B"), lambda c: c["A"] + c["B"] <= 3, "A + B <= 3")])
    >>> [dict(c) for c in space.feasible()]
    [{'A': 1, 'B': 1}, {'A': 1, 'B': 2}, {'A': 2, 'B': 1}]
    """

    def __init__(self, axes: list[Axis], rules: list[Rule], upgrade: Callable[[Mapping], Mapping] | None = None):
        super().__init__(axes, [r.constraint for r in rules], upgrade)
        position = {a.name: i for i, a in enumerate(self.axes)}
        self._checks: list[list[Constraint]] = [[] for _ in self.axes]
        for r in rules:
            unknown = [n for n in r.reads if n not in position]
            if unknown or not r.reads:
                raise ValueError(f"constraint {r.constraint.name} reads {list(r.reads)}: not axes of this space")
            self._checks[max(position[n] for n in r.reads)].append(r.constraint)

    def feasible(self) -> Iterator[Config]:
        names = self.names()
        choices = [a.choices for a in self.axes]
        bound: dict = {}

        def walk(depth: int) -> Iterator[Config]:
            if depth == len(names):
                yield Config(bound)
                return
            for value in choices[depth]:
                bound[names[depth]] = value
                if all(c.holds(bound) for c in self._checks[depth]):
                    yield from walk(depth + 1)
            del bound[names[depth]]

        return walk(0)

    def pruned_by(self) -> dict[str, int]:
        """{constraint: grid configs it rules out}, each config counted once, against the first constraint it
        breaks as the axes are bound in order (a pruned subtree counts all of its configs)."""
        names = self.names()
        choices = [a.choices for a in self.axes]
        below = [math.prod(len(c) for c in choices[d + 1:]) for d in range(len(names))]
        removed = {c.name: 0 for c in self.constraints}
        bound: dict = {}

        def walk(depth: int) -> None:
            if depth == len(names):
                return
            for value in choices[depth]:
                bound[names[depth]] = value
                broken = next((c.name for c in self._checks[depth] if not c.holds(bound)), None)
                if broken is None:
                    walk(depth + 1)
                else:
                    removed[broken] += below[depth]
            del bound[names[depth]]

        walk(0)
        return removed


# --- estimates -------------------------------------------------------------------------------------

def two_level_accumulation(problem) -> bool:
    """Whether the kernel keeps a second accumulator: fp8 precise promotion or per-group block scales."""
    return problem.dtype == "fp8" and (problem.scale_mode == "block" or not problem.fp8_fast_accum)


def smem_bytes(problem, c: Mapping) -> int:
    """Pipelined operand tiles, plus the output tile staged for the TMA store."""
    operands = (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * element_size(problem.dtype) * c["num_stages"]
    staged = c["VARIANT"] in ("tma", GLUON_WS)
    staging = c["BLOCK_M"] * c["BLOCK_N"] * element_size(problem.out_dtype) if staged else 0
    staging = staging // 2 if c.get("EPILOGUE_SUBTILE") else staging
    return operands + (2 * staging if c.get("SCHEDULE") == PINGPONG else staging)  # pingpong: one per warpgroup


def gluon_swap_fits(problem) -> bool:
    """Whether swapped gluon_ws tiles apply to `problem`: B given as W (N, K), whose rows are the kernel's K-major A,
    and M up to GLUON_SWAP_MAX_M."""
    return problem.layout_b == "col" and problem.m <= GLUON_SWAP_MAX_M


def coalesced_partials(c: Config) -> bool:
    """Whether `c`'s split tiles lay their partials out in register order (COALESCED_PARTIALS: gluon_ws only)."""
    return COALESCED_PARTIALS and c["VARIANT"] == GLUON_WS


def owned_splits(c: Config) -> bool:
    """Whether `c`'s split tiles are finished by fixed owners (OWNED_SPLITS: gluon_ws split_k, two warpgroups)."""
    return (OWNED_SPLITS and c["VARIANT"] == GLUON_WS and c["SCHEDULE"] == "split_k"
            and gluon_tile_rows(c) >= 2 * GLUON_WG_ROWS)


def clamps_row_tiles(c: Mapping) -> bool:
    """Whether `c`'s last row tile starts at M - BLOCK_M (CLAMP_ROW_TILES): whole, unswapped tiles of
    CLAMPED_VARIANTS."""
    return CLAMP_ROW_TILES and _whole_clamped_tiles(c) and not c.get("SWAP_AB")


def clamps_col_tiles(c: Mapping) -> bool:
    """Whether `c`'s last column tile starts at N - BLOCK_N (CLAMP_COL_TILES): whole tiles of CLAMPED_VARIANTS."""
    return CLAMP_COL_TILES and _whole_clamped_tiles(c)


def _whole_clamped_tiles(c: Mapping) -> bool:
    return c["VARIANT"] in CLAMPED_VARIANTS and c["SCHEDULE"] in ("data_parallel", PINGPONG)


def gluon_swapped(c: Mapping) -> bool:
    """Whether `c` is a swapped gluon_ws tile: the kernel's rows are the weight's (BLOCK_N), its columns tokens."""
    return c["VARIANT"] == GLUON_WS and bool(c.get("SWAP_AB"))


def gluon_tile_rows(c: Mapping) -> int:
    """The rows of a gluon_ws kernel's tile (64 a consumer warpgroup): BLOCK_M, or BLOCK_N where swapped."""
    return c["BLOCK_N"] if gluon_swapped(c) else c["BLOCK_M"]


def gluon_tile_cols(c: Mapping) -> int:
    """The columns of a gluon_ws kernel's tile (wgmma's N side): BLOCK_N, or the tokens (BLOCK_M) where swapped."""
    return c["BLOCK_M"] if gluon_swapped(c) else c["BLOCK_N"]


def accumulator_registers(problem, c: Mapping) -> int:
    """fp32 accumulator registers per thread (gluon_ws: per consumer thread, whose warpgroup owns 64 rows, or
    under pingpong a whole tile)."""
    copies = 2 if two_level_accumulation(problem) else 1
    if c["VARIANT"] == GLUON_WS:
        rows = c["BLOCK_M"] if c.get("SCHEDULE") == PINGPONG else GLUON_WG_ROWS
        return copies * rows * gluon_tile_cols(c) // 128
    return copies * c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"])


def programs_per_sm(problem, c: Mapping, device: DeviceInfo) -> int:
    """How many programs of config `c` one SM holds at once (by shared memory, registers and threads)."""
    # gluon_ws: a warpgroup per 64 rows (pingpong: two), and the producer warp's warpgroup
    consumers = 2 if c.get("SCHEDULE") == PINGPONG else gluon_tile_rows(c) // GLUON_WG_ROWS
    threads = 128 * (consumers + 1) if c["VARIANT"] == GLUON_WS else 32 * c["num_warps"]
    arch = arch_of(device)
    by_smem = (device.smem_per_block + SMEM_RESERVED_PER_BLOCK) // (smem_bytes(problem, c) + SMEM_RESERVED_PER_BLOCK)
    registers = min(255, 8 * math.ceil((accumulator_registers(problem, c) + REGISTERS_BESIDE_ACCUMULATORS) / 8))
    by_registers = arch.registers_per_sm // (registers * threads)
    return max(1, min(by_smem, by_registers, arch.max_threads_per_sm // threads))


def min_block_k(problem) -> int:
    """The smallest BLOCK_K the problem's operands take (fp8_block_k)."""
    return FP8_MIN_BLOCK_K if problem.dtype == "fp8" else 32


def sm_count(device: DeviceInfo) -> int:
    return NOMINAL_SMS if device.interpret else device.sm_count


def tile_count(problem, block_m: int, block_n: int) -> int:
    return math.ceil(problem.m / block_m) * math.ceil(problem.n / block_n)


def tma_ok(problem) -> bool:
    """TMA needs unit-stride operands with 16-byte aligned rows and base pointers (and so does C's store)."""
    p = problem
    return (p.aligned and p.layout_a != "strided" and p.layout_b != "strided"
            and (p.n * element_size(p.out_dtype)) % 16 == 0)


def gluon_ws_ok(problem, device: DeviceInfo) -> bool:
    """Whether the Gluon variant (templates/gemm_gluon_ws.py.j2) applies: Hopper's wgmma and TMA compiled by Triton
    (never its interpreter, which does not run Gluon), 16-bit or fp8 tensor cores with tensor or row scales, row-major
    A and TMA-able operands; fp8 wgmma reads B K-major, so an fp8 B is given as W (N, K)."""
    p = problem
    return (not device.interpret and device.compute_capability[0] == 9 and tma_ok(p)
            and p.dtype in ("bf16", "fp16", "fp8") and p.layout_a != "col"
            and (p.dtype != "fp8" or p.layout_b == "col") and p.scale_mode != "block")


# --- the space -------------------------------------------------------------------------------------

def upgrade_config(problem, config: Mapping) -> Mapping:
    """A config stored before the schedule, SWAP_AB, PROMOTE_TILES and EPILOGUE_SUBTILE axes existed, as a config
    of today's space.

    Such a config ran split-K exactly when SPLIT_K > 1, never swapped A and B, (fp8) promoted the tensor cores'
    sums once per K tile, and stored C whole: the values filled in here run that same kernel.
    """
    if "VARIANT" not in config or "BLOCK_M" not in config or "EPILOGUE_SUBTILE" in config:
        return config
    upgraded = dict(config, EPILOGUE_SUBTILE=False)
    if "SCHEDULE" in config:
        return upgraded
    split_k = upgraded.get("SPLIT_K", 1)
    upgraded["SCHEDULE"] = "split_k" if isinstance(split_k, int) and split_k > 1 else "data_parallel"
    upgraded.setdefault("SWAP_AB", False)
    if has_promote_axis(problem):
        upgraded.setdefault("PROMOTE_TILES", 1)
    return upgraded


def has_promote_axis(problem) -> bool:
    """fp8 precise accumulation with tensor or row scales chooses how many K tiles the tensor cores sum."""
    return problem.dtype == "fp8" and not problem.fp8_fast_accum and problem.scale_mode != "block"


def gemm_space(problem, device: DeviceInfo) -> StagedSpace:
    p = problem
    require_dtypes(device, [p.dtype, p.out_dtype] + (["tf32"] if p.tf32 else []), f"a {p.dtype} GEMM")
    k_tiles = lambda c: math.ceil(p.k / c["BLOCK_K"])  # noqa: E731
    tiles = lambda c: tile_count(p, c["BLOCK_M"], c["BLOCK_N"])  # noqa: E731
    tensor_cores = p.dtype != "fp32" or p.tf32
    token_tiles = token_tiles_fit(p)
    sms = sm_count(device)

    axes = [
        Axis("VARIANT", ("blocked", "tma", GLUON_WS), AxisKind.RENDER),
        Axis("SCHEDULE", SCHEDULES, AxisKind.RENDER),
        Axis("SPLIT_K", SPLIT_K_CHOICES),
        Axis("PERSISTENT", (False, True)),
        Axis("WARP_SPECIALIZE", (False, True)),
        Axis("FLATTEN", (False, True)),
        Axis("SWAP_AB", (False, True), AxisKind.RENDER),
        # The TMA store of C in two (BLOCK_M, BLOCK_N / 2) halves: half the staging buffer, so room for a stage more.
        Axis("EPILOGUE_SUBTILE", (False, True), AxisKind.RENDER),
        Axis("BLOCK_M", (16, 32, 64, 80, 96, 128, 144, 160, 192, 256)),
        Axis("BLOCK_N", (32, 64, 96, 128, 144, 160, 192, 256)),
        Axis("BLOCK_K", (32, 64, 128, 256)),
    ]
    if has_promote_axis(p):
        axes.append(Axis("PROMOTE_TILES", PROMOTE_CHOICES))
    axes += [
        Axis("GROUP_M", (1, 4, 8, 16)),
        Axis("num_warps", (4, 8), AxisKind.META),
        Axis("num_stages", (2, 3, 4, 5, 6), AxisKind.META),
    ]
    rules = [
        rule("tma_alignment", ("VARIANT",), lambda c: c["VARIANT"] != "tma" or tma_ok(p),
             "TMA needs unit-stride operands with 16-byte aligned rows and base pointers"),
        Rule(("VARIANT",), feature_constraint(device, Feature.TMA, lambda c: c["VARIANT"] == "tma",
                                              "the tma variant")),
        Rule(("WARP_SPECIALIZE",), feature_constraint(device, Feature.WARP_SPECIALIZE,
                                                      lambda c: c["WARP_SPECIALIZE"], "WARP_SPECIALIZE")),
        rule("gluon_ws_applies", ("VARIANT",), lambda c: c["VARIANT"] != GLUON_WS or gluon_ws_ok(p, device),
             "the gluon_ws variant runs on Hopper GPUs (not Triton's interpreter), for 16-bit or fp8 (tensor or row "
             "scales) operands that TMA can load, with A row-major and an fp8 B as W (N, K)"),
        rule("gluon_ws_structure", ("VARIANT", "SCHEDULE", "SWAP_AB", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"),
             lambda c: c["VARIANT"] != GLUON_WS or (
                 c["SCHEDULE"] in GLUON_SCHEDULES and gluon_tile_rows(c) in (64, 128) and c["BLOCK_K"] >= 64
                 and c["num_warps"] == 4 and (c["BLOCK_M"] in GLUON_SWAP_TOKEN_TILES if c["SWAP_AB"] else
                                             c["BLOCK_N"] >= 64)),
             "gluon_ws is persistent (whole waves of tiles, then stream-K, split-K or whole tiles), one consumer warpgroup "
             "(4 warps) per 64 rows of a 64- or 128-row tile (swapped: of weight rows, BLOCK_N), BLOCK_K of at least 64, "
             f"BLOCK_N of at least 64 unswapped and swapped a token tile (BLOCK_M) of {GLUON_SWAP_TOKEN_TILES}"),
        rule("gluon_ws_swapped", ("VARIANT", "SCHEDULE", "SWAP_AB", "EPILOGUE_SUBTILE"),
             lambda c: not gluon_swapped(c) or (
                 c["SCHEDULE"] != PINGPONG and not c["EPILOGUE_SUBTILE"] and gluon_swap_fits(p)),
             f"swapped gluon_ws tiles store C^T whole (no pingpong, no EPILOGUE_SUBTILE), for M <= {GLUON_SWAP_MAX_M} "
             "and B given as W (N, K), whose rows are the kernel's K-major A"),
        rule("pingpong_gluon_only", ("VARIANT", "SCHEDULE"), lambda c: c["SCHEDULE"] != PINGPONG or c["VARIANT"] == GLUON_WS,
             "the pingpong schedule is the gluon_ws variant's (two warpgroups, each with tiles of its own)"),
        # (a two-part width is never a tile's rows: gluon_ws_structure)
        rule("wide_n_gluon_only", ("VARIANT", "SCHEDULE", "EPILOGUE_SUBTILE", "BLOCK_M", "BLOCK_N"),
             lambda c: (c["BLOCK_N"] not in GLUON_TWO_PART and c["BLOCK_M"] not in GLUON_TWO_PART) or (
                 c["VARIANT"] == GLUON_WS and not c["EPILOGUE_SUBTILE"] and p.dtype in ("bf16", "fp16")
                 and (c["SCHEDULE"] == "data_parallel" or (c["SCHEDULE"] == "split_k" and GLUON_TWO_PART_SPLIT))),
             f"tiles of {', '.join(map(str, GLUON_TWO_PART))} (no power of two) columns, or swapped tokens, are the "
             "gluon_ws variant's, for 16-bit operands in whole tiles (split over K where GLUON_TWO_PART_SPLIT is on)"),
        rule("schedule_split_k", ("SCHEDULE", "SPLIT_K"), lambda c: (c["SCHEDULE"] == "split_k") == (c["SPLIT_K"] > 1),
             "SPLIT_K > 1 is the split_k schedule, which needs SPLIT_K > 1"),
        rule("persistent_tma_only", ("VARIANT", "SCHEDULE", "PERSISTENT", "WARP_SPECIALIZE", "FLATTEN"),
             lambda c: (c["VARIANT"] == "tma" and c["SCHEDULE"] == "data_parallel")
             or not (c["PERSISTENT"] or c["WARP_SPECIALIZE"] or c["FLATTEN"]),
             "PERSISTENT, WARP_SPECIALIZE and FLATTEN only change the tma variant's data-parallel tile loop"),
        rule("epilogue_subtile_staged_only", ("VARIANT", "EPILOGUE_SUBTILE"),
             lambda c: not c["EPILOGUE_SUBTILE"] or c["VARIANT"] in ("tma", GLUON_WS),
             "EPILOGUE_SUBTILE splits the staged TMA store of C (tma and gluon_ws); pointer stores stage nothing"),
        # Halving a staging buffer under 128 x 128 frees too little for another stage to be worth a search axis.
        rule("epilogue_subtile_width", ("EPILOGUE_SUBTILE", "BLOCK_M", "BLOCK_N"),
             lambda c: not c["EPILOGUE_SUBTILE"] or (c["BLOCK_N"] >= 64 and c["BLOCK_M"] * c["BLOCK_N"] >= 128 * 128),
             "EPILOGUE_SUBTILE halves BLOCK_N: for C tiles of at least 128 x 128 (BLOCK_N >= 64)"),
        rule("swap_ab_for_few_rows", ("VARIANT", "SWAP_AB"),
             lambda c: not c["SWAP_AB"] or ((p.m <= SWAP_MAX_M or token_tiles or c["VARIANT"] == GLUON_WS)
                                            and tensor_cores),
             f"SWAP_AB puts N on the tensor cores' M side: for M <= {SWAP_MAX_M} (M <= {TOKEN_TILE_MAX_M} for "
             f"N <= {TOKEN_TILE_MAX_N}, gluon_ws's up to {GLUON_SWAP_MAX_M}) with tensor-core operands"),
        rule("swap_ab_tiles", ("VARIANT", "SWAP_AB", "BLOCK_M", "BLOCK_N"),
             lambda c: not c["SWAP_AB"] or (c["BLOCK_M"] <= SWAP_MAX_M and c["BLOCK_N"] >= 64 and (
                 p.m <= SWAP_ANY_TILE_M or c["BLOCK_M"] >= p.m or c["VARIANT"] == GLUON_WS
                 or (token_tiles and c["BLOCK_M"] in TOKEN_TILE_BLOCK_MS))),
             f"SWAP_AB wants BLOCK_M <= {SWAP_MAX_M} (tokens: the MMA's N side), BLOCK_N >= 64 (its 64-row side) "
             f"and, above {SWAP_ANY_TILE_M} tokens, every token in one tile (16-64 tokens a tile for N <= "
             f"{TOKEN_TILE_MAX_N} up to M = {TOKEN_TILE_MAX_M}; gluon_ws tiles any M)"),
        rule("tile_within_problem", ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
             lambda c: c["BLOCK_M"] <= max(16, next_pow2(p.m)) and c["BLOCK_N"] <= max(32, next_pow2(p.n))
             and c["BLOCK_K"] <= max(min_block_k(p), next_pow2(p.k)),
             "a block larger than the next power of two of its dimension only computes padding (the kernels mask "
             "K past the problem, so a short K still takes the smallest BLOCK_K its dtype allows)"),
        rule("fp8_block_k", ("BLOCK_K",), lambda c: c["BLOCK_K"] >= min_block_k(p),
             f"fp8 tensor-core tiles need BLOCK_K >= {FP8_MIN_BLOCK_K} (32 bytes of K at least twice)"),
        rule("block_scale_groups", ("BLOCK_K",), lambda c: p.scale_mode != "block" or SCALE_BLOCK % c["BLOCK_K"] == 0,
             f"block scales need each K tile inside one {SCALE_BLOCK}-wide scale group: BLOCK_K divides {SCALE_BLOCK}"),
        rule("split_k_depth", ("SPLIT_K", "BLOCK_K"), lambda c: c["SPLIT_K"] == 1 or k_tiles(c) >= 2 * c["SPLIT_K"],
             "each split needs at least two K tiles"),
        rule("split_k_workspace", ("SPLIT_K", "BLOCK_M", "BLOCK_N"),
             lambda c: c["SPLIT_K"] == 1 or tiles(c) * c["SPLIT_K"] * c["BLOCK_M"] * c["BLOCK_N"] <= SPLIT_K_WORKSPACE_LIMIT,
             "the split-K workspace would exceed 1 GiB"),
        # gluon_ws splits only the tiles left over after whole waves: it applies at any tile count.
        rule("split_k_fills_the_gpu", ("VARIANT", "SCHEDULE", "BLOCK_M", "BLOCK_N"),
             lambda c: c["SCHEDULE"] != "split_k" or c["VARIANT"] == GLUON_WS or tiles(c) < SPLIT_K_MAX_TILES_PER_SM * sms,
             f"split-K is for problems with fewer than {SPLIT_K_MAX_TILES_PER_SM} tiles per SM"),
        rule("group_m_useful", ("BLOCK_M", "GROUP_M"), lambda c: c["GROUP_M"] == 1 or math.ceil(p.m / c["BLOCK_M"]) > 1,
             "grouped ordering needs more than one row of tiles"),
        rule("accumulator_registers", ("VARIANT", "SCHEDULE", "SWAP_AB", "BLOCK_M", "BLOCK_N", "num_warps"),
             lambda c: accumulator_registers(p, c) <= 128,
             "the fp32 accumulators need more than 128 registers a thread"),
        # NOTE: Triton 3.6 fails to lower warp-specialised 64 x 256 tiles on one warpgroup for sm90
        # ("PassManager::run failed" in ConvertTritonGPUToLLVM; found by python -m autotile.xcompile).
        # NOTE: and it miscompiles warp-specialised 128 x 64 tiles on 4 warps: on the H200 every such kernel left
        # most of C unwritten (results/gemm_mid_tiles_2026-12-02.txt; 64 x 128 on 4 warps and 128 x 64 on 8 were right).
        rule("warp_specialize_tile", ("WARP_SPECIALIZE", "BLOCK_M", "BLOCK_N", "num_warps"),
             lambda c: not (c["WARP_SPECIALIZE"] and c["num_warps"] == 4
                            and ((c["BLOCK_N"] == 256 and c["BLOCK_M"] >= 64) or c["BLOCK_M"] >= 128)),
             "Triton 3.6 cannot compile warp-specialised 64 x 256 tiles on 4 warps, and gets 128-row ones wrong"),
        rule("work_per_warp", ("BLOCK_M", "BLOCK_N", "num_warps"),
             lambda c: c["BLOCK_M"] * c["BLOCK_N"] >= 128 * c["num_warps"],
             "tile too small to give every warp a full mma"),
        rule("shared_memory", ("VARIANT", "SCHEDULE", "EPILOGUE_SUBTILE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages"),
             lambda c: smem_bytes(p, c) <= device.smem_per_block,
             lambda c: f"needs {smem_bytes(p, c)} B of shared memory, the device allows {device.smem_per_block} B"),
    ]
    if has_promote_axis(p):
        rules.append(rule("gluon_ws_promotes_every_tile", ("VARIANT", "PROMOTE_TILES"),
                          lambda c: c["VARIANT"] != GLUON_WS or c["PROMOTE_TILES"] == 1,
                          "gluon_ws promotes precise fp8 sums once per K tile"))
        rules.append(rule("promote_interval", ("BLOCK_K", "PROMOTE_TILES"),
                          lambda c: c["BLOCK_K"] * c["PROMOTE_TILES"] <= FP8_PRECISE_INTERVAL,
                          f"precise fp8 promotes at least every {FP8_PRECISE_INTERVAL} products"))
    return StagedSpace(axes, rules, upgrade=lambda config: upgrade_config(p, config))
