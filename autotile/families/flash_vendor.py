"""SDPA's backends as vendor configs of the flash family: which can compute a problem, and calling them.

A backend is listed for a problem only when it computes exactly what autotile.flash_attention
defines (bottom-right causal mask for Sq != Sk, rows that see no key give 0, GQA, any scale) and
torch says it can run there. The backends are called through their ATen ops, not through
F.scaled_dot_product_attention: that skips SDPA's backend selection on every call (host time), and
the flash op is the only way to get FlashAttention-2's bottom-right causal mask for Sq != Sk.

- sdpa-cudnn: cuDNN's fused attention; causal only for Sq == Sk (its causal mask is top-left).
- sdpa-flash: FlashAttention-2 (bottom-right causal, GQA, empty rows 0 and lse +inf, as here).
- sdpa-efficient: the memory-efficient (CUTLASS) kernel; one key/value head per query head, causal
  only for Sq == Sk.
- sdpa-math: plain ATen ops; any dtype and shape; bottom-right masks as an additive -inf mask
  (its softmax gives 0 for rows that see no key).
Forward outputs come with the log-sum-exp in the family's convention (log2 domain, (B, Hq, Sq)).
Backward configs: sdpa-flash runs its backward op on the given O and log-sum-exp (sdpa-cudnn too,
under CUDNN_BACKWARD_ON_GIVEN_LSE); the others recompute the forward under autograd and
differentiate it (the efficient kernel's backward takes its own forward's statistics, in a padded
layout this module does not rely on).
"""
from __future__ import annotations

import math
import threading
import warnings

import torch

from autotile.families.flash_reference import LOG2E, causal_seen, log2_sum_exp, map_head_chunks
from autotile.layouts import matching_strides, with_strides

CUDNN, FLASH, EFFICIENT, MATH = "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math"
# Usually fastest first on Hopper (SDPA's own order there since torch 2.9: cuDNN, then FlashAttention-2,
# then the memory-efficient kernel, then math); the first listed is what an untuned shape gets.
BACKENDS = (CUDNN, FLASH, EFFICIENT, MATH)
LN2 = math.log(2.0)

_HALF = ("fp16", "bf16")
# Sequence lengths of the probe tensors torch's capability checks run on: every length threshold in
# those checks (cuDNN's s_q >= 64, s_k != 1, multiples of 64) is at or below 64.
_PROBE_SEQ = 64

_allowed: dict[tuple, bool] = {}
_allowed_lock = threading.Lock()
_rng_placeholders: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_cudnn_direct_ok: dict[torch.device, bool] = {}  # False once cuDNN's backward refused a given O and LSE here
# cuDNN's backward on the given O and LSE (_cudnn_backward) rather than its forward run again first. Checked on an H100
# and an H200 (torch 2.11): gradients of the family's own O and LSE within 0.0034-0.0048 relative error of plain fp32
# torch over fourteen shapes (MHA and GQA, causal and not, head dims 64, 96 and 128), as the Gluon backward's, and
# every vendor config's GPU test (head dim 256 too) against float64; its time that of cuDNN's backward alone in SDPA's
# autograd (0.98-1.03x; benchmarks/results/flash_bwd_2026-12-05b_cudnn_direct.txt, _2026-12-05c_h200_cudnn_direct.txt).
# NOTE: torch keys its cached cuDNN backward graphs by q, k and v, and the graph bakes in the strides of O and dO it
# was built with (aten/src/ATen/native/cudnn/MHA.cpp, MHAParams). The call passes O in q's layout (the op writes it
# so, as SDPA does: autotile.layouts) and dO always laid out like O, so its own calls never mix layouts; beside SDPA's
# own backward on the same q, k and v, in either order, with dO laid out like O or not, every gradient was right
# (benchmarks/prototypes/cudnn_graph_cache_layouts.py, results/cudnn_graph_cache_layouts_2026-12-05b_h100.txt; GPU
# tests test_gpu_cudnn_direct_backward_beside_sdpas_own, _twice_with_do_laid_out_otherwise).
CUDNN_BACKWARD_ON_GIVEN_LSE = True


def expresses(backend: str, problem) -> bool:
    """Whether `backend` computes exactly this problem as the flash family defines it (not whether it can run here)."""
    p = problem
    square_or_full = not p.causal or p.seq_q == p.seq_k
    if backend == MATH:
        return p.dtype in _HALF + ("fp32",)
    # The fused kernels take fp16/bf16 with the head dim a multiple of 8 (SDPA pads other sizes with a copy).
    if p.dtype not in _HALF or p.head_dim % 8:
        return False
    if backend == CUDNN:
        return square_or_full and p.seq_k > 1
    if backend == FLASH:
        return True
    if backend == EFFICIENT:
        return square_or_full and p.heads_q == p.heads_kv
    return False


# torch's check of each fused backend (torch.backends.cuda.<name>(SDPAParams, debug)).
_TORCH_CHECKS = {CUDNN: "can_use_cudnn_attention", FLASH: "can_use_flash_attention",
                 EFFICIENT: "can_use_efficient_attention"}


def _torch_allows(backend: str, problem, device_index: int) -> bool:
    """torch's own checks (hardware, build, head dim limits, backends switched off by the user) on small probes."""
    p = problem
    if backend == MATH:
        return torch.backends.cuda.math_sdp_enabled()
    check = getattr(torch.backends.cuda, _TORCH_CHECKS[backend], None)
    if check is None:
        return False
    key = (backend, p.dtype, p.heads_q, p.heads_kv, min(p.seq_q, _PROBE_SEQ), min(p.seq_k, _PROBE_SEQ), p.head_dim,
           p.direction, device_index, torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
           torch.backends.cuda.mem_efficient_sdp_enabled())
    hit = _allowed.get(key)
    if hit is not None:
        return hit
    from autotile.dtypes import torch_dtype

    dtype, dev = torch_dtype(p.dtype), torch.device("cuda", device_index)
    grad = p.direction == "bwd"

    def probe(heads: int, seq: int) -> torch.Tensor:
        return torch.empty(1, heads, min(seq, _PROBE_SEQ), p.head_dim, dtype=dtype, device=dev, requires_grad=grad)

    try:
        q, k, v = probe(p.heads_q, p.seq_q), probe(p.heads_kv, p.seq_k), probe(p.heads_kv, p.seq_k)
        # is_causal=False: SDPA refuses flash for causal Sq != Sk because of its top-left convention, but the
        # flash ATen op called here masks bottom-right, as this family does; causal support is `expresses`'s job.
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, p.heads_q != p.heads_kv)
        allowed = bool(check(params, False))
    except Exception:  # noqa: BLE001 - a torch without this backend (or this SDPAParams) on this device
        allowed = False
    with _allowed_lock:
        _allowed[key] = allowed
    return allowed


def accepts(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: bool = False) -> bool:
    """torch's own checks of `backend` on the call's tensors (their strides and alignment, which a problem
    does not record); the runtime asks once per call signature before serving a vendor config."""
    if backend == MATH:
        return True
    check = getattr(torch.backends.cuda, _TORCH_CHECKS.get(backend, ""), None)
    if check is None or not q.is_cuda:
        return False
    try:
        if grad and not (q.requires_grad or k.requires_grad or v.requires_grad):
            q = q.detach().requires_grad_(True)  # a view: the grad-dependent checks (cuDNN's D=256 backward) apply
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, q.shape[1] != k.shape[1])
        return bool(check(params, False))
    except Exception:  # noqa: BLE001 - a torch without this backend (or this SDPAParams)
        return False


def backends_for(problem, device) -> list[str]:
    """SDPA's backends that compute `problem` exactly and can run on `device`, usually fastest first."""
    p = problem
    if device.interpret or p.dtype == "fp8" or p.varlen or p.has_features:
        return []
    return [b for b in BACKENDS if expresses(b, p) and _torch_allows(b, p, device.index)]


# --- calling them ------------------------------------------------------------------------------------
def _bottom_right_mask(seq_q: int, seq_k: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(Sq, Sk) additive mask: 0 where query i sees key j <= i + Sk - Sq, -inf elsewhere."""
    seen = causal_seen(seq_q, seq_k, device)
    return torch.zeros(seq_q, seq_k, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def _math(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    seq_q, seq_k = q.shape[2], k.shape[2]
    mask = _bottom_right_mask(seq_q, seq_k, q.dtype, q.device) if causal and seq_q != seq_k else None
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, mask, 0.0, causal and seq_q == seq_k, None, scale=scale, enable_gqa=q.shape[1] != k.shape[1])[0]


def _log2_lse_from(lse: torch.Tensor, seq_q: int) -> torch.Tensor:
    """A backend's natural-log log-sum-exp ((B, H, Sq), (B, H, Sq, 1), or padded along Sq) in the family's log2
    units."""
    if lse.dim() == 4:
        lse = lse[..., 0]
    return lse[..., :seq_q] * LOG2E


def forward(backend: str, q, k, v, *, causal: bool, scale: float, need_lse: bool):
    """(o, lse or None): o (B, Hq, Sq, D) like q, lse (B, Hq, Sq) fp32 in log2 units (+inf for rows that see no key).

    Differentiable (through the backend's own backward) when the inputs require grad.
    """
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if backend == FLASH:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out[0], (_log2_lse_from(out[1], q.shape[2]) if need_lse else None)
    if backend == CUDNN:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, need_lse or grad, 0.0, causal, False,
                                                                 scale=scale)
        return out[0], (_log2_lse_from(out[1], q.shape[2]) if need_lse else None)
    if backend == EFFICIENT:
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, need_lse or grad, 0.0, causal,
                                                                     scale=scale)
        return out[0], (_log2_lse_from(out[1], q.shape[2]) if need_lse else None)
    if backend == MATH:
        o = _math(q, k, v, causal, scale)
        lse = None
        if need_lse:
            with torch.no_grad():
                lse = map_head_chunks(lambda q, k, v: log2_sum_exp(q, k, causal=causal, scale=scale).float(), q, k, v)
        return o, lse
    raise ValueError(f"unknown SDPA backend {backend!r}; known: {', '.join(BACKENDS)}")


def _cudnn_backward(do, q, k, v, o, lse, *, causal: bool, scale: float):
    """cuDNN's backward on the given O and log2 LSE, its forward not run again (2.2x less time at MHA 2 x 16 x 1000
    not causal on an H100: benchmarks/prototypes/cudnn_backward_direct.py). It takes the natural-log LSE as its
    forward leaves it, (B, H, Sq, 1) with unit strides below H; no bias, no packed lengths, no dropout."""
    seed, offset = _rng_placeholder(q.device)
    lse_nat = (lse * LN2).unsqueeze(-1).contiguous()
    # O in q's layout, as cuDNN's forward (and the op) leaves it, and dO always laid out like O. NOTE: torch caches the
    # backward graph by q, k and v, with the strides of O and dO it was built with (see CUDNN_BACKWARD_ON_GIVEN_LSE):
    # two calls on the same q, k and v whose dO differ in layout give the second wrong gradients, SDPA's own backward
    # included (benchmarks/results/cudnn_graph_cache_layouts_2026-12-05_h100.txt). One dO layout per q layout rules
    # that out for these calls; a copy only where autograd hands dO laid out otherwise (strides of size-1 dimensions
    # address nothing, so they may differ).
    if o.stride() != q.stride():
        o = with_strides(o, matching_strides(q))
    if do.stride() != o.stride():
        do = with_strides(do, o.stride())
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse_nat, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)[:3]


def _rng_placeholder(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2's backward takes its forward's dropout RNG state; without dropout it is never read."""
    hit = _rng_placeholders.get(device)
    if hit is None:
        hit = _rng_placeholders[device] = (torch.zeros(2, dtype=torch.uint64, device=device),
                                           torch.zeros((), dtype=torch.uint64, device=device))
    return hit


def backward_takes_given_lse(backend: str, device: torch.device) -> bool:
    """Whether `backward` of `backend` runs on the given O and LSE alone, rather than its forward again first."""
    return backend == FLASH or (backend == CUDNN and CUDNN_BACKWARD_ON_GIVEN_LSE
                                and _cudnn_direct_ok.get(device, True))


def backward(backend: str, do, q, k, v, o, lse, *, causal: bool, scale: float):
    """(dq, dk, dv) of the forward whose output is `o` and log2 log-sum-exp is `lse` (B, Hq, Sq)."""
    if backend == FLASH:
        seed, offset = _rng_placeholder(q.device)
        # FlashAttention-2 wants the natural-log log-sum-exp; rows that see no key keep +inf (P = 0 there).
        lse_nat = (lse * LN2).contiguous()
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse_nat, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    if backend not in BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == CUDNN and backward_takes_given_lse(backend, q.device):
        try:
            return _cudnn_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
        except RuntimeError as exc:  # a torch whose op takes other arguments: its forward again, as below
            _cudnn_direct_ok[q.device] = False
            warnings.warn(f"autotile: cuDNN's attention backward refused the forward's O and LSE ({str(exc)[:160]}); "
                          f"its forward runs again before each backward", RuntimeWarning, stacklevel=2)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out, _ = forward(backend, *leaves, causal=causal, scale=scale, need_lse=False)
        return torch.autograd.grad(out, leaves, do)
