"""The flash kernels' launch arguments, worked out once per call signature.

A plan holds everything a launch needs besides the tensors (kernel, grid, strides, sizes, scale,
feature values, constexprs), so the runtime op's hot path is a dict lookup plus the launch:
`plan(q, k, v, o, lse, ...)`. Strides come from sample tensors; a plan is reused only for tensors
with the same shapes and strides (the runtime keys plans by them).

Layouts: dense Q/O (B, H, S, D) and LSE (B, Hq, S); packed (varlen) Q/O (total, H, D) and LSE
(Hq, total_q), which the kernels read with a zero batch stride and per-sequence row offsets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autotile.families.flash_reference import LOG2E
from autotile.launch import launch
from autotile.render import launching


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


@dataclass
class ForwardPlan:
    """attn_fwd with every argument but the tensors fixed: call it with (q, k, v, o, lse, descale, alibi, cu_q, cu_k)."""

    kernel: object
    grid: tuple
    scalars: tuple
    options: dict
    interpret: bool

    def __call__(self, q, k, v, o, lse, descale, alibi, cu_q, cu_k) -> None:
        if self.interpret:
            with launching(True):
                launch(self.kernel, self.grid, q, k, v, o, lse, descale, alibi, cu_q, cu_k, *self.scalars, **self.options)
        else:
            launch(self.kernel, self.grid, q, k, v, o, lse, descale, alibi, cu_q, cu_k, *self.scalars, **self.options)


def forward_plan(module, problem, config, scale: float, q, k, v, o, lse, alibi, interpret: bool) -> ForwardPlan:
    p = problem
    if config["LOADS"] == "tma" and not interpret:
        from autotile.device import ensure_triton_allocator

        ensure_triton_allocator()
    varlen = p.varlen
    stride_ab = alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0
    # Packed sequences pass the totals as seq_q / seq_k (the TMA descriptors' extent); dense ones the lengths.
    seq_q, seq_k = (q.shape[0], k.shape[0]) if varlen else (p.seq_q, p.seq_k)
    scalars = (*rows_strides(q, varlen), *rows_strides(k, varlen), *rows_strides(v, varlen), *rows_strides(o, varlen),
               *lse_strides(lse, varlen), stride_ab, p.batch, p.heads_q, p.heads_kv, seq_q, seq_k,
               *feature_scalars(p, scale))
    options = dict(HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
                   WARP_SPECIALIZE=config["WARP_SPECIALIZE"], num_warps=config["num_warps"],
                   num_stages=config["num_stages"])
    grid = (_cdiv(p.seq_q, config["BLOCK_M"]), p.batch * p.heads_q)
    return ForwardPlan(module.attn_fwd, grid, scalars, options, interpret)


@dataclass
class BackwardPlan:
    """The three backward kernels with every argument but the tensors fixed.

    Call with (q, k, v, o, do, lse, delta, dq, dk, dv, alibi, cu_q, cu_k); `delta` is scratch laid out as `lse`.
    `dlse`: the gradient of the (log2-domain) log-sum-exp output too, when the caller returned it. It enters
    through delta: d lse / d x = p / ln 2, so dS = P (dP - delta + dlse * log2(e)).
    """

    kernels: tuple
    grids: tuple
    scalars: tuple
    options: tuple
    interpret: bool

    def __call__(self, q, k, v, o, do, lse, delta, dq, dk, dv, alibi, cu_q, cu_k, dlse=None) -> None:
        pre, dkdv, dqk = self.kernels
        pre_grid, dkdv_grid, dq_grid = self.grids
        pre_s, dkdv_s, dq_s = self.scalars
        pre_o, dkdv_o, dq_o = self.options
        with launching(self.interpret):
            launch(pre, pre_grid, o, do, delta, cu_q, *pre_s, **pre_o)
            if dlse is not None:
                delta.sub_(dlse, alpha=LOG2E)
            launch(dkdv, dkdv_grid, q, k, v, do, dk, dv, lse, delta, alibi, cu_q, cu_k, *dkdv_s, **dkdv_o)
            launch(dqk, dq_grid, q, k, v, do, dq, lse, delta, alibi, cu_q, cu_k, *dq_s, **dq_o)


def backward_plan(module, problem, config, scale: float, q, k, v, o, do, lse, dq, dk, dv, alibi,
                  interpret: bool) -> BackwardPlan:
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
    return BackwardPlan(
        (module.attn_bwd_preprocess, module.attn_bwd_dkdv, module.attn_bwd_dq),
        (rows_grid, (_cdiv(p.seq_k, config["BLOCK_N1"]), p.batch * p.heads_kv), rows_grid),
        (pre_scalars, dkdv_scalars, dq_scalars),
        (dict(BLOCK_M=config["BLOCK_M2"], **dims, **meta),
         dict(BLOCK_M1=config["BLOCK_M1"], BLOCK_N1=config["BLOCK_N1"], **dims, **meta),
         dict(BLOCK_M2=config["BLOCK_M2"], BLOCK_N2=config["BLOCK_N2"], **dims, **meta)),
        interpret,
    )
