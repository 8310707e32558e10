"""Prototype: a FlashAttention backward in Gluon with FlashAttention-3's structure on Hopper.

Built into the family since: templates/flash_gluon_bwd.py.j2, the backward's LOADS=gluon_ws, with its preprocess
as one Triton kernel (here: torch ops, whose fp32 copies of O and dO this file's timings include), and programs
sharing tiles where few KV heads leave SMs idle. It runs at 0.84-0.92x of cuDNN on the anchors below, up to 1.15x
with few KV heads (benchmarks/RESULTS.md, "twenty-seventh run"). This file keeps the measurements' history.

Status: correct on the H200 (float64 checks of dQ, dK and dV within FlashAttention's bounds, causal and not, GQA,
Sq != Sk, head dims 64 and 128, every variant measured). Against cuDNN (bf16;
results/gluon_flash_bwd_2026-12-04c_red_host.txt), with dQ added by RED, the row statistics through TMA and tiles
4 a program where there are enough (_chunk):
  - D = 128, 4096 tokens: causal 2 x 32 0.71x (the family's Triton backward 0.69-0.70x), GQA 1 x 32/8 0.78x (0.58x),
    not causal 0.73x (0.69x);
  - behind the family at head dim 64 (0.66x against 0.76x) and on short sequences (16 x 512: 0.49x against 0.68x).
Four changes took it from 0.58x to 0.71x (causal) and 0.47x to 0.78x (GQA): the row statistics come with each slot
by TMA (no layout crossing, 53 -> 13 spill instructions), dQ is added by vector RED instructions (an ATOMG waits for
L2's reply; ncu: tensor pipe 35% -> 49%, cuDNN's 62%), tiles go out key block first (heaviest first under causal
masks), and a program takes 4 neighbouring heads' tiles of one key block (one set-up and drain for four). Still
slower than cuDNN: per step, the two consumer warpgroups meet at dS (both halves feed each one's dQ wgmma), and each
waits for its own wgmmas in turn (ncu: mbarrier waits and wgmma waits lead the stall samples,
results/ncu_bwd_2026-12-04/).
The family's backward (Triton tl.dot kernels: dK/dV, then dQ, each recomputing P and dP) runs at 0.74x of cuDNN at
D = 128, 4k (benchmarks/RESULTS.md); its dK/dV kernel alone took as long as cuDNN's whole backward, and adding dQ
there with atomics did not pay in Triton (RESULTS.md "ninth run"). This is FlashAttention-3's answer, written where
each warpgroup's registers and barriers can be stated. On the GPU:
    python benchmarks/prototypes/gluon_flash_bwd.py          # checks against float64, then times beside SDPA
    python benchmarks/prototypes/gluon_flash_bwd.py --quick  # three checks and two shapes

Structure: a program owns one block of 128 keys of one KV head (a tile) and walks every query block (64 rows) of the
query heads that share it (GQA: no reduction of dK/dV across programs). Tiles go out key block first; with
`persistent`, a program an SM walks its share of them.
  - one producer warp loads K and V once a tile, then each query block's Q, dO, LSE and Delta into a ring of STAGES
    slots (TMA);
  - two consumer warpgroups, each its own partition, own 64 of the 128 keys each and keep dK and dV for them in
    registers. For each query block i, with P^T and dP^T (keys x queries) from wgmmas of shared-memory operands:
        S^T = K Q_i^T, dP^T = V dO_i^T         issued together
        P^T = exp2(S^T * scale * log2(e) - LSE_i)    (LSE in the log2 domain, as the forward writes it)
        dV += P^T dO_i                         P^T from registers
        dS^T = P^T * (dP^T - Delta_i)           Delta = rowsum(dO * O)
        dK += dS^T Q_i                         dS^T from shared memory
        dQ_i += dS K                           dS^T from shared memory, read transposed; added to an fp32 dQ
                                               (rows padded to whole query blocks), scaled and cast afterwards
  - dQ: with D = 128 both warpgroups' dS^T halves meet in shared memory (a barrier between them) and each computes
    half of dQ_i's columns over all 128 keys (32 registers of fp32 a thread); with D = 64 each computes dQ_i over its
    own 64 keys, all columns, and both add (no barrier). dS^T is double-buffered, so a warpgroup one block ahead
    never overwrites what the other still reads.
Not here: FlashAttention-3's TMA reduce-add for dQ (Gluon 3.6 has no call for it: vector REDs from registers
instead; the family's template since calls the op through Gluon's IR builder, 1-16% faster: templates/
flash_gluon_bwd.py.j2, _tma_add), a deterministic mode, windows and other features, D = 256, packed sequences.
Layout: q, o, do (B, H, SQ, D), k, v (B, HKV, SK, D), 16-byte aligned rows, unit stride along D, bf16 or fp16.
Causal masks align the last query with the last key.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

WG_KEYS = gl.constexpr(64)  # keys a consumer warpgroup owns (the wgmma's M for S^T, dP^T, dK and dV)
BLOCK_N = 128  # keys a program owns: two consumer warpgroups
BLOCK_M = 64  # query rows a step
LOG2E = 1.4426950408889634
# Timed and checked side by side: the default (4 tiles a program where there are enough) and host-built descriptors
# on a persistent grid. Measured, lost and taken out (results/gluon_flash_bwd_2026-12-04b_variants.txt,
# _c_red_host.txt; the code is in the history): dQ by atomics, the row statistics from global memory, FlashAttention-3's
# order of the last two wgmmas, dQ from the wgmma's registers, three slots, 128 query rows a step at head dim 64, a
# tile queue, dQ over each warpgroup's own keys at head dim 128, and each step's dQ deferred to the next.
VARIANTS = {
    "default": dict(),
    "host persistent": dict(host_desc=True, persistent=True),
}


@gluon.jit
def _red_add_f32x4(ptrs, values):
    # NOTE: gl.atomic_add emits a PTX atom whose result is unused, and ptxas makes it an ATOMG (it waits for L2's
    # reply) or a REDG depending on the kernel around it: ATOMG here with in-kernel descriptors, REDG with host-built
    # ones (sm90 SASS). cuDNN's backward adds dQ with RED. An explicit `red` makes it RED always. A thread's 4 values
    # here are adjacent in memory (the layout's size_per_thread is [1, 4]): one vector RED at the first's address.
    return gl.inline_asm_elementwise(
        "red.relaxed.gpu.global.add.v4.f32 [$4], {$8, $9, $10, $11};\n"
        "mov.u32 $0, 0;\nmov.u32 $1, 0;\nmov.u32 $2, 0;\nmov.u32 $3, 0;",
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [ptrs.to(gl.int64), values.to(gl.int32, bitcast=True)], dtype=gl.int32,
        is_pure=False, pack=4)


@gluon.jit
def _first_block(kb, SQ, SK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    # The first query block that sees a key of key block kb: query i sees key j when j <= i + SK - SQ (causal).
    if CAUSAL:
        return gl.maximum(kb * BLOCK_N - (SK - SQ), 0) // BLOCK_M
    else:
        return 0


@gluon.jit
def _my_tiles(n_tiles, CHUNK: gl.constexpr):
    # (first tile, end, step) of this program: CHUNK > 0, that many consecutive tiles (the same key block of
    # neighbouring heads: equal work, one program's set-up and drain for all of them); 0, every num_programs-th tile.
    if CHUNK > 0:
        first = gl.program_id(0) * CHUNK
        return first, gl.minimum(first + CHUNK, n_tiles), 1
    else:
        return gl.program_id(0), n_tiles, gl.num_programs(0)


@gluon.jit
def _tile_coords(tile, n_bh, HKV):
    # Tile t: key block t // (B * HKV) of (batch, KV head) t % (B * HKV). Key blocks lead, so that with causal
    # masks the heaviest tiles (the first key blocks, seen by the most query blocks) go first.
    kb = tile // n_bh
    bh = tile % n_bh
    return kb, bh // HKV, bh % HKV


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
              delta_smem, kv_bar, kv_empty, ready, empty, HKV, n_bh, n_tiles, group, H, SQ, SK,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              CHUNK: gl.constexpr):
    n_m = gl.cdiv(SQ, BLOCK_M)
    slot_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * BLOCK_M * 4
    it = 0
    t = 0
    tile, tile_end, tile_step = _my_tiles(n_tiles, CHUNK)
    while tile < tile_end:
        kb, b, h_kv = _tile_coords(tile, n_bh, HKV)
        mbarrier.wait(kv_empty, (t & 1) ^ 1)  # both consumers are done with the last tile's K and V
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, h_kv, kb * BLOCK_N, 0], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [b, h_kv, kb * BLOCK_N, 0], kv_bar, v_smem)
        first = _first_block(kb, SQ, SK, BLOCK_M, BLOCK_N, CAUSAL)
        for g in range(group):
            h = h_kv * group + g
            stat_row = (b * H + h) * (n_m * BLOCK_M)  # LSE and Delta rows padded to whole query blocks
            for i in range(first, n_m):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a slot's first use passes at once
                mbarrier.expect(ready.index(s), slot_bytes)
                tma.async_copy_global_to_shared(q_desc, [b, h, i * BLOCK_M, 0], ready.index(s), q_smem.index(s))
                tma.async_copy_global_to_shared(do_desc, [b, h, i * BLOCK_M, 0], ready.index(s), do_smem.index(s))
                tma.async_copy_global_to_shared(lse_desc, [stat_row + i * BLOCK_M], ready.index(s), lse_smem.index(s))
                tma.async_copy_global_to_shared(delta_desc, [stat_row + i * BLOCK_M], ready.index(s),
                                                delta_smem.index(s))
                it += 1
        t += 1
        tile += tile_step


@gluon.jit
def _consumer(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, kv_bar, ready,
              empty, ds_ready, kv_empty, dq_ptr, dk_ptr, dv_ptr, HKV, n_bh, n_tiles, group, H, SQ, SK, qk_scale,
              sm_scale, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
              HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, DQ_BY_KEYS: gl.constexpr, CHUNK: gl.constexpr):
    # S^T, dP^T: (64 keys, BLOCK_M queries); dK, dV: (64 keys, HEAD_D); dQ: (BLOCK_M queries, DQ_COLS).
    DQ_COLS: gl.constexpr = HEAD_D if DQ_BY_KEYS else HEAD_D // 2
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    key_index = gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    zero_st = gl.zeros([WG_KEYS, BLOCK_M], gl.float32, st_layout)
    zero_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    # dQ's adds go out of a layout of 4 contiguous columns a thread, whose addresses are one register and constant
    # offsets. Added straight from the wgmma layout, every element had its own 64-bit address, and ptxas spilled them
    # (270 spill instructions in the loop).
    add_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // DQ_COLS, DQ_COLS // 4], [4, 1], [1, 0])
    dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, add_layout))
    dq_cols = gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, add_layout))
    if not DQ_BY_KEYS:
        dq_cols = dq_cols + WG * DQ_COLS
    dq_offsets = dq_rows[:, None] * HEAD_D + dq_cols[None, :]
    k_mine = k_smem.reshape([BLOCK_N, HEAD_D]).slice(WG * WG_KEYS, WG_KEYS, dim=0)
    v_mine = v_smem.reshape([BLOCK_N, HEAD_D]).slice(WG * WG_KEYS, WG_KEYS, dim=0)
    if DQ_BY_KEYS:
        k_dq = k_mine  # (64 own keys, HEAD_D)
    else:
        k_dq = k_smem.reshape([BLOCK_N, HEAD_D]).slice(WG * DQ_COLS, DQ_COLS, dim=1)  # (128 keys, half the columns)
    n_m = gl.cdiv(SQ, BLOCK_M)
    n_pad = n_m * BLOCK_M  # rows of the fp32 dQ accumulator and of padded LSE and Delta a head
    it = 0
    t = 0
    tile, tile_end, tile_step = _my_tiles(n_tiles, CHUNK)
    while tile < tile_end:
        kb, b, h_kv = _tile_coords(tile, n_bh, HKV)
        key0 = kb * BLOCK_N + WG * WG_KEYS
        keys = key0 + key_index
        mbarrier.wait(kv_bar, t & 1)
        dk = gl.zeros([WG_KEYS, HEAD_D], gl.float32, kv_layout)
        dv = gl.zeros([WG_KEYS, HEAD_D], gl.float32, kv_layout)
        first = _first_block(kb, SQ, SK, BLOCK_M, BLOCK_N, CAUSAL)
        for g in range(group):
            h = h_kv * group + g
            # The fp32 dQ accumulator: (B, H, SQ rounded up to BLOCK_M, HEAD_D) contiguous, so that a block's adds
            # need no mask (a masked vector atomic took a branch around each).
            dq_base = dq_ptr + (b * H + h).to(gl.int64) * n_pad * HEAD_D
            for i in range(first, n_m):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                q_t = q_smem.index(s).reshape([BLOCK_M, HEAD_D])
                do_t = do_smem.index(s).reshape([BLOCK_M, HEAD_D])
                st_tok = warpgroup_mma(k_mine, q_t.permute((1, 0)), zero_st, use_acc=False, is_async=True)
                dpt_tok = warpgroup_mma(v_mine, do_t.permute((1, 0)), zero_st, use_acc=False, is_async=True)
                q0 = i * BLOCK_M
                # The producer's TMA put the block's LSE (+inf past SQ) and Delta in the slot: read straight into
                # the columns of S^T, no layout crossing.
                lse = lse_smem.index(s).load(gl.SliceLayout(0, st_layout))
                st = warpgroup_mma_wait(1, deps=(st_tok, ))
                pt = gl.exp2(st * qk_scale - lse[None, :])
                if CAUSAL:
                    # Key j is seen by query i when j <= i + SK - SQ; only blocks across the diagonal need the mask.
                    if q0 + SK - SQ < key0 + WG_KEYS - 1:
                        pt = gl.where(keys[:, None] <= (q0 + cols)[None, :] + (SK - SQ), pt, 0.0)
                pt_op = gl.convert_layout(pt.to(dtype), op_layout)
                dv = warpgroup_mma(pt_op, do_t, dv, is_async=True)
                dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))  # dP^T, issued before dV, is done
                delta = delta_smem.index(s).load(gl.SliceLayout(0, st_layout))
                dst = (pt * (dpt - delta[None, :])).to(dtype)
                # dS^T to shared memory for dQ (it is read transposed there), double-buffered by step.
                buf = ds_smem.index(it % 2)
                buf.slice(WG * WG_KEYS, WG_KEYS, dim=0).store(dst)
                fence_async_shared()
                if DQ_BY_KEYS:
                    ds_t = buf.slice(WG * WG_KEYS, WG_KEYS, dim=0).permute((1, 0))  # (queries, own keys)
                else:
                    mbarrier.arrive(ds_ready.index(it % 2), count=1)
                    ds_t = buf.permute((1, 0))  # (queries, all 128 keys)
                # dK's A operand dS^T from the shared memory dQ reads it from, not registers.
                dk = warpgroup_mma(buf.slice(WG * WG_KEYS, WG_KEYS, dim=0), q_t, dk, is_async=True)
                if not DQ_BY_KEYS:
                    mbarrier.wait(ds_ready.index(it % 2), (it // 2) & 1)  # the other warpgroup's half is there too
                dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
                dq_tok = warpgroup_mma(ds_t, k_dq, zero_dq, use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
                mbarrier.arrive(empty.index(s), count=1)
                _red_add_f32x4(dq_base + q0 * HEAD_D + dq_offsets, gl.convert_layout(dq * sm_scale, add_layout))
                it += 1
        mbarrier.arrive(kv_empty, count=1)  # every wgmma reading this tile's K and V is done (each step waits them)
        # dK = scale * sum dS^T Q; dV = sum P^T dO. Rows past SK are not stored.
        out_rows = key0 + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, kv_layout))
        dims = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, kv_layout))
        keep = (out_rows < SK)[:, None]
        dk_offsets = b.to(gl.int64) * stride_dkb + h_kv.to(gl.int64) * stride_dkh + \
            out_rows.to(gl.int64)[:, None] * stride_dks + dims[None, :]
        gl.store(dk_ptr + dk_offsets, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=keep)
        dv_offsets = b.to(gl.int64) * stride_dvb + h_kv.to(gl.int64) * stride_dvh + \
            out_rows.to(gl.int64)[:, None] * stride_dvs + dims[None, :]
        gl.store(dv_ptr + dv_offsets, dv.to(dv_ptr.dtype.element_ty), mask=keep)
        t += 1
        tile += tile_step


@gluon.jit
def flash_bwd_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
                     stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                     stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks,
                     stride_dvb, stride_dvh, stride_dvs, B, H, HKV, SQ, SK, qk_scale, sm_scale,
                     HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, HOST_DESC: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr):
    # grid: (programs,): each walks CHUNK consecutive tiles (CHUNK > 0) or every programs-th tile (0) of
    # cdiv(SK, BLOCK_N) * B * HKV (see _tile_coords). lse_ptr and delta_ptr: (B * H * SQ rounded up to BLOCK_M) rows.
    gl.static_assert(BLOCK_N == 2 * WG_KEYS, "two consumer warpgroups of 64 keys")
    gl.static_assert(num_warps == 4, "each partition is one warpgroup")
    # At head dim 64 each warpgroup's dQ is over its own keys (both add): half of 64 columns would split a 128-byte
    # swizzle atom.
    DQ_BY_KEYS: gl.constexpr = HEAD_D <= 64
    if HOST_DESC:
        dtype: gl.constexpr = q_ptr.dtype  # q_ptr .. v_ptr, lse_ptr, delta_ptr: TMA descriptors built on the host
    else:
        dtype: gl.constexpr = q_ptr.dtype.element_ty
    group = H // HKV
    n_bh = B * HKV
    n_tiles = gl.cdiv(SK, BLOCK_N) * n_bh
    q_block: gl.constexpr = [1, 1, BLOCK_M, HEAD_D]
    kv_block: gl.constexpr = [1, 1, BLOCK_N, HEAD_D]
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(q_block, dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(kv_block, dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    stat_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    if HOST_DESC:
        q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc = q_ptr, do_ptr, k_ptr, v_ptr, lse_ptr, delta_ptr
    else:
        q_desc = tma.make_tensor_descriptor(q_ptr, [B, H, SQ, HEAD_D], [stride_qb, stride_qh, stride_qs, 1], q_block,
                                            q_layout)
        do_desc = tma.make_tensor_descriptor(do_ptr, [B, H, SQ, HEAD_D], [stride_dob, stride_doh, stride_dos, 1],
                                             q_block, q_layout)
        k_desc = tma.make_tensor_descriptor(k_ptr, [B, HKV, SK, HEAD_D], [stride_kb, stride_kh, stride_ks, 1],
                                            kv_block, kv_layout)
        v_desc = tma.make_tensor_descriptor(v_ptr, [B, HKV, SK, HEAD_D], [stride_vb, stride_vh, stride_vs, 1],
                                            kv_block, kv_layout)
        n_stats = B * H * gl.cdiv(SQ, BLOCK_M) * BLOCK_M
        lse_desc = tma.make_tensor_descriptor(lse_ptr, [n_stats], [1], [BLOCK_M], stat_layout)
        delta_desc = tma.make_tensor_descriptor(delta_ptr, [n_stats], [1], [BLOCK_M], stat_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_block, q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_block, q_layout)
    k_smem = gl.allocate_shared_memory(dtype, kv_block, kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, kv_block, kv_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_empty, count=2)  # both consumer warpgroups are done with a tile's K and V
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups release each slot
    for s in gl.static_range(2):
        mbarrier.init(ds_ready.index(s), count=2)  # both warpgroups' halves of dS^T are in the buffer
    gl.warp_specialize([
        (_consumer, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, kv_bar, ready, empty,
                     ds_ready, kv_empty, dq_ptr, dk_ptr, dv_ptr, HKV, n_bh, n_tiles, group, H, SQ, SK, qk_scale,
                     sm_scale, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, HEAD_D, BLOCK_M,
                     BLOCK_N, STAGES, CAUSAL, DQ_BY_KEYS, CHUNK)),
        (_consumer, (1, q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, kv_bar, ready, empty,
                     ds_ready, kv_empty, dq_ptr, dk_ptr, dv_ptr, HKV, n_bh, n_tiles, group, H, SQ, SK, qk_scale,
                     sm_scale, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, HEAD_D, BLOCK_M,
                     BLOCK_N, STAGES, CAUSAL, DQ_BY_KEYS, CHUNK)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                     delta_smem, kv_bar, kv_empty, ready, empty, HKV, n_bh, n_tiles, group, H, SQ, SK, BLOCK_M,
                     BLOCK_N, STAGES, CAUSAL, CHUNK))], [4, 1], [240, 24])


def _host_descriptors(q, k, v, do, lse, delta):
    """flash_bwd_kernel's TMA descriptors (q, k, v, do, lse, delta) built once on the host, not in every program."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    D = q.shape[-1]
    q_block, kv_block = [1, 1, BLOCK_M, D], [1, 1, BLOCK_N, D]
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for(q_block, dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for(kv_block, dtype)
    stat_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    out = [TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)
           for t, block, layout in ((q, q_block, q_layout), (k, kv_block, kv_layout), (v, kv_block, kv_layout),
                                    (do, q_block, q_layout))]
    out += [TensorDescriptor(t.view(-1), [t.numel()], [1], [BLOCK_M], stat_layout) for t in (lse, delta)]
    return out


# Programs a chunk of consecutive tiles should leave, per SM, for the hardware scheduler to balance them.
# 4 consecutive tiles a program (results/gluon_flash_bwd_2026-12-04c_red_host.txt, call 8): not causal 0.64x -> 0.73x
# cuDNN, head dim 64 causal 0.55x -> 0.66x, causal 2 x 32 x 4096 0.71x either way (512 programs); 1 x 32/8 x 4096
# (256 tiles) fell to 0.26x (64 programs: half the SMs idle).
CHUNK_PROGRAMS_PER_SM = 3


def _chunk(tiles: int, sms: int) -> int:
    """Consecutive tiles a program: 4, 2 or 1, the most that leaves CHUNK_PROGRAMS_PER_SM programs an SM."""
    return next(c for c in (4, 2, 1) if c == 1 or tiles // c >= CHUNK_PROGRAMS_PER_SM * sms)


def flash_bwd(q, k, v, o, do, lse2, causal=False, scale=None, stages=2, host_desc=False, persistent=False):
    """(dq, dk, dv) of softmax(q k^T * scale) v for q, o, do (B, H, SQ, D), k and v (B, HKV, SK, D), 16-bit, unit
    stride along D and 16-byte aligned rows; lse2 (B, H, SQ) fp32: each row's log-sum-exp of the scaled logits in
    the log2 domain (+inf for a row that sees no key), as the forward writes it. host_desc: TMA descriptors built on
    the host, not by every program; persistent: a program an SM walking every programs-th tile (the next tile's K
    and V load under the last one's dK and dV stores), not _chunk's consecutive tiles a program."""
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    n_pad = triton.cdiv(SQ, BLOCK_M) * BLOCK_M
    # The family's preprocess kernel, in torch here: LSE and Delta rows padded to whole query blocks (+inf LSE past
    # SQ, so P is 0 there), as the forward would write LSE.
    lse_in = torch.full((B, H, n_pad), float("inf"), device=q.device, dtype=torch.float32)
    lse_in[:, :, :SQ] = lse2
    delta_in = torch.zeros(B, H, n_pad, device=q.device, dtype=torch.float32)
    delta_in[:, :, :SQ] = (do.float() * o.float()).sum(-1)
    dq_acc = torch.zeros(B, H, n_pad, D, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    tiles = triton.cdiv(SK, BLOCK_N) * B * HKV
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    chunk = 0 if persistent else _chunk(tiles, sms)
    grid = (min(tiles, sms) if persistent else triton.cdiv(tiles, chunk), )
    inputs = (q, k, v, do, lse_in, delta_in)
    if host_desc:
        inputs = _host_descriptors(*inputs)
    flash_bwd_kernel[grid](*inputs, dq_acc, dk, dv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                           *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], B, H, HKV, SQ, SK, scale * LOG2E,
                           scale, HEAD_D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, CAUSAL=causal,
                           HOST_DESC=host_desc, CHUNK=chunk, num_warps=4)
    return dq_acc[:, :, :SQ].to(q.dtype), dk, dv


def _reference(q, k, v, do, causal, scale, dtype=torch.float64):
    """(o, lse2, dq, dk, dv) by autograd at `dtype`: float64 the reference, float32 the plain-torch bar."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    kr, vr = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kr.transpose(-1, -2) * scale
    sq, sk = s.shape[-2:]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        keep = keep.tril(sk - sq)
    # Masked logits at -1e30 underflow to probability 0 exactly; rows that see no key (more queries than keys) are
    # zeroed outright, so that neither they nor their gradients are NaN.
    s = s.masked_fill(~keep, -1e30)
    seen = keep.any(-1)
    lse = torch.logsumexp(s, -1)
    o = (torch.softmax(s, -1) * seen[:, None]) @ vr
    o.backward(do.to(dtype))
    lse2 = torch.where(seen, lse * LOG2E, torch.full_like(lse, float("inf")))
    return o.detach(), lse2.float(), qd.grad, kd.grad, vd.grad


def _time_cases(do_bench, quick: bool) -> None:
    """bf16 backward TFLOP/s (2.5x the forward's FLOPs) beside cuDNN's and the flash backend's, and the family's."""
    import os
    os.environ["AUTOTILE_VENDOR"] = "0"  # the family's generated kernels only
    import autotile
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    shapes = [(2, 32, 32, 4096, 128, True), (1, 32, 8, 4096, 128, True), (2, 32, 32, 4096, 128, False),
              (4, 32, 32, 2048, 64, True), (16, 32, 8, 512, 128, True)]
    for (B, H, HKV, S, D, causal) in (shapes[:2] if quick else shapes):
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        scale = 1 / math.sqrt(D)
        with torch.no_grad():
            kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
            s = (q.float() @ kr.float().transpose(-1, -2)) * scale
            if causal:
                s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device="cuda").tril(), float("-inf"))
            lse2 = (torch.logsumexp(s, -1) * LOG2E).contiguous()
            o = (torch.softmax(s, -1) @ vr.float()).to(q.dtype)
            del s
        pairs = S * S - (S * (S - 1) // 2 if causal else 0)
        flops = 2.5 * 4 * B * H * pairs * D
        fns = {f"gluon {name}": (lambda kw=kw: flash_bwd(q, k, v, o, do, lse2, causal, **kw))
               for name, kw in VARIANTS.items()}
        out_family = autotile.flash_attention(q, k, v, causal=causal)
        fns["family"] = lambda: torch.autograd.grad(out_family, (q, k, v), do, retain_graph=True)
        kr2, vr2 = (t.detach().repeat_interleave(H // HKV, 1).requires_grad_() for t in (k, v))
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, kr2, vr2, is_causal=causal)
            fns[name] = lambda out=out: torch.autograd.grad(out, (q, kr2, vr2), do, retain_graph=True)
        times = {}
        for name, fn in fns.items():
            try:
                fn()
                times[name] = []
            except Exception as exc:  # noqa: BLE001 - a backend that does not take the case
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        for _ in range(3):  # interleaved rounds, medians: repeated timings differ by up to ~9%
            for name in times:
                times[name].append(do_bench(fns[name], warmup=5, rep=30, return_mode="median"))
        best = {name: sorted(ts)[1] for name, ts in times.items()}
        cudnn = best.get("cudnn")
        print(f"bwd {B}x{H}/{HKV} {S} D={D} causal={causal}: " + ", ".join(
            f"{name} {flops / ms / 1e9:.0f}" + (f" ({cudnn / ms:.2f}x cuDNN)" if cudnn else "")
            for name, ms in best.items()) + " TFLOP/s", flush=True)


def main() -> int:
    from triton.testing import do_bench

    sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
    from autotile.families.flash_reference import fa_rule_check

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    quick = "--quick" in sys.argv[1:]
    torch.manual_seed(0)
    bad = 0
    # (B, H, HKV, SQ, SK, D, causal): odd lengths, Sq != Sk both ways, GQA and MQA, D = 64 and 128.
    checks = [(2, 4, 2, 1000, 1000, 128, True), (1, 2, 2, 300, 300, 128, False), (1, 4, 1, 777, 200, 128, True),
              (2, 2, 1, 333, 555, 64, True), (1, 4, 1, 200, 777, 128, True), (1, 3, 3, 129, 64, 64, False)]
    for (B, H, HKV, SQ, SK, D, causal) in (checks[:3] if quick else checks):
        q = torch.randn(B, H, SQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, HKV, SK, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HKV, SK, D, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(B, H, SQ, D, device="cuda", dtype=torch.bfloat16)
        scale = 1 / math.sqrt(D)
        o, lse2, *want = _reference(q, k, v, do, causal, scale)
        # FlashAttention's rule, as the family checks its own backward: within twice plain torch's error (the
        # same math in fp32, rounded to bf16) plus a rounding floor.
        plain = [g.to(q.dtype) for g in _reference(q, k, v, do, causal, scale, torch.float32)[2:]]
        for name, kw in VARIANTS.items():
            got = flash_bwd(q, k, v, o.to(q.dtype), do, lse2, causal, scale, **kw)
            results = [fa_rule_check(name, g, w, pl, "bf16", SK if name == "dq" else (H // HKV) * SQ)
                       for name, g, w, pl in zip(("dq", "dk", "dv"), got, want, plain)]
            ok = all(r.ok for r in results)
            bad += not ok
            print(f"check B={B} H={H}/{HKV} {SQ}x{SK} D={D} causal={causal} {name}: "
                  + "; ".join(r.message for r in results) + (" ok" if ok else " WRONG"), flush=True)
    if bad:
        return 1
    _time_cases(do_bench, quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
