"""`autotile.flash_attention`: the flash family as a differentiable torch.library custom op.

Two ops, `autotile::flash_attention_fwd` (q, k, v -> o, lse) and `autotile::flash_attention_bwd`
(do, q, k, v, o, lse -> dq, dk, dv), each with a fake implementation so torch.compile can trace
them, joined by `register_autograd`. Forward and backward are separate problems of the flash family,
each served by what `dispatch.resolve` picks: a stored winner, SDPA's backend for shapes nobody
tuned (on a GPU), or a generated kernel.

What a call signature (shapes, strides, dtypes, device, alignment, mask, scale, features) runs is
worked out once and kept (`_Served`): later calls pay a dict lookup, a counter increment
(AUTOTILE_RECORD) and the launch of a prepared plan, or the SDPA backend's ATen op. Nothing on that
path syncs with the GPU or allocates outside torch's caching allocator, so it can be captured in a
CUDA graph. Eager calls that need no autograd skip the dispatcher; eager calls served by SDPA that do
need it call SDPA's differentiable op, so SDPA's own backward runs; eager calls served by a generated
kernel that need it record `_EagerFlash`, which calls the two ops' bodies (torch.compile and anything
traced still record the ops). CPU tensors run the generated kernels under Triton's interpreter.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import threading
from typing import Optional

import torch

from autotile.device import DeviceInfo, current_device
from autotile.dtypes import torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families import flash_vendor
from autotile.families.base import VENDOR_KEY
from autotile.families.flash import (FAMILY, GLUON_WS, MAX_HEAD_DIM, FlashFamily, FlashProblem, default_scale,
                                     effective_window, window_pair)
from autotile.families.flash_reference import Scores, attention_math, log2_sum_exp
from autotile.layouts import matching_strides, with_strides
from autotile.runtime import fallback, trace
from autotile.runtime.dispatch import on_clear
from autotile.runtime.eager import (any_autocast, autocast_operands, autograd_call_ok, direct_call_ok,
                                    checked_by_op, under_transform)
from autotile.space import Config

LN2 = math.log(2.0)


class _Served:
    """What calls of one signature run, worked out once; `calls` counts them for AUTOTILE_RECORD.

    `args`: the call's (causal, scale, window, softcap) normalised, for the custom op; `fp8`: the
    operands are fp8 (forward only: every call checks that no gradient is asked for).
    """

    __slots__ = ("run", "calls", "vendor", "args", "fp8", "sdpa", "backward", "sdpa_pair")

    def __init__(self, run, calls: list, vendor: bool, args: tuple = (), fp8: bool = False, sdpa: tuple | None = None):
        self.run = run
        self.calls = calls
        self.vendor = vendor
        self.args = args
        self.fp8 = fp8
        # (is_causal, scale, enable_gqa) where F.scaled_dot_product_attention, left to choose, serves the call
        # itself (no log-sum-exp asked for): the signature may skip to it (_sdpa_direct).
        self.sdpa = sdpa
        # The backward's _Served for this forward signature, by what else the backward depends on (_EagerFlash).
        self.backward: dict[tuple, _Served] = {}
        # sdpa_training_pair's answer for plain calls that need gradients, by deterministic mode.
        self.sdpa_pair: dict[bool, tuple | None] = {}


_served: dict[tuple, _Served] = {}
_UNRESOLVED = object()  # a _Served.sdpa_pair entry not worked out yet
# flash_attention's raw call key -> what serves it: the _Served of its normalised signature, or a copy whose runner
# makes the head dim's stride 1 first (see _first_call).
_calls: dict[tuple, _Served] = {}
_served_lock = threading.Lock()
# (q.shape, k.shape, v.shape, q.dtype, k.dtype, causal, scale) as the caller passed them -> (calls, is_causal,
# scale, enable_gqa), for signatures SDPA itself serves: no window, soft-capping or ALiBi, and no lse asked for.
# A short key because a short call is bound by host time: the full key (strides, devices, alignment) costs
# 2.3 us of Python on the development CPU against 0.6. NOTE: keyed by shapes and dtypes alone: a call of
# these shapes with other strides also runs SDPA, which is right for any tensors (at worst a layout a kernel
# would have served runs the vendor op); calls served by a kernel always take the full key.
_sdpa_direct: dict[tuple, tuple] = {}
_sdpa = torch.nn.functional.scaled_dot_product_attention
_any_autocast = any_autocast
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def _forget_served() -> None:
    with _served_lock:
        _served.clear()
        _calls.clear()
        _sdpa_direct.clear()


def _forget_calls() -> None:
    with _served_lock:
        _calls.clear()


on_clear(_forget_served)


def _keep(key: tuple, build) -> _Served:
    served = _served.get(key)
    if served is None:
        served = build()
        with _served_lock:
            _served[key] = served
    return served


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels step along the head dim with stride 1; any other strides are taken as they are.
    return t if t.stride(-1) == 1 else t.contiguous()


def check_args(q, k, v, scale, softcap) -> None:
    """What the family's shape checks do not cover: tensor types, a head dim for the default scale, the scale,
    fp8 on the CPU."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise BadInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() == 0 or q.shape[-1] == 0:
        raise ShapeMismatchError(f"q must end in a head dim of at least 1 (the kernels take 1..{MAX_HEAD_DIM}), got "
                                 f"shape {tuple(q.shape)}")
    check_numbers(scale, softcap)
    if q.dtype == torch.float8_e4m3fn and q.device.type == "cpu":
        # NOTE: Triton 3.6's interpreter rounds fp32 -> e4m3 wrongly (errors of 0.25 on [0, 1]); a wrong
        # result is worse than none.
        raise UnsupportedDtypeError("fp8 attention runs on CUDA GPUs only (the CPU interpreter rounds to e4m3 "
                                    "wrongly); on the CPU, cast q, k, v to bfloat16 or float32")


def check_numbers(scale, softcap) -> None:
    """scale a finite number, softcap a finite number >= 0; while torch.compile traces the call, the values are
    checked by the op's body (eager.checked_by_op)."""
    for name, value, advice in (("scale", scale, "a finite number (None: 1/sqrt(head_dim))"),
                                ("softcap", softcap, "a finite number >= 0 (0 or None: off)")):
        if value is None or checked_by_op(value):
            continue
        if not (_is_number(value) and math.isfinite(float(value)) and (name == "scale" or float(value) >= 0)):
            raise BadInputError(f"{name} must be {advice}, got {value!r}")


def number_arguments(scale, softcap) -> tuple:
    """scale and softcap as numbers: one-element tensors are read (and keyed) by value, and refused where they
    require grad, since the kernels compute no gradient for them (SDPA refuses tensors outright)."""
    for name, value in (("scale", scale), ("softcap", softcap)):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise BadInputError(f"{name} is a tensor that requires grad, but attention takes it as a number and "
                                f"computes no gradient for it: for a learnable temperature t, pass q * t (the "
                                f"logits scale with q), or {name}=float(...) to train without it")
    return (float(scale) if isinstance(scale, torch.Tensor) else scale,
            float(softcap) if isinstance(softcap, torch.Tensor) else softcap)


# Arguments of SDPA and of FlashAttention's flash_attn_(varlen_)func, with what to pass instead (None: taken and
# ignored where its value changes nothing).
_FOREIGN_ARGUMENTS = {
    "is_causal": "pass causal=True",
    "softmax_scale": "pass scale=",
    "window_size": "pass window=(left, right)",
    "attn_mask": "arbitrary masks are not served (causal, window, softcap and alibi_slopes are): call "
                 "torch.nn.functional.scaled_dot_product_attention",
    "dropout_p": "attention dropout is not served: apply dropout elsewhere, or call "
                 "torch.nn.functional.scaled_dot_product_attention",
    "deterministic": "use torch.use_deterministic_algorithms(True), which the backward follows",
    "return_attn_probs": "the probabilities are not returned: return_lse=True gives each row's log-sum-exp",
    "block_table": "for paged K/V call autotile.paged_prefill or autotile.paged_attention",
}


def foreign_arguments(op: str, extra: dict) -> None:
    """Keyword arguments the op does not take: those of SDPA and FlashAttention get what to pass instead;
    dropout_p=0 and enable_gqa (GQA is taken from the head counts) change nothing and are let through."""
    for name, value in extra.items():
        if (name == "dropout_p" and value in (0, 0.0, None)) or (name == "enable_gqa" and value in (True, False)):
            continue
        advice = _FOREIGN_ARGUMENTS.get(name)
        if advice is None:
            raise BadInputError(f"{op}() got an unexpected keyword argument {name!r}; it takes causal, scale, window, "
                                "softcap, alibi_slopes and return_lse")
        raise BadInputError(f"{op}() takes no {name!r}: {advice}")


def _is_number(value) -> bool:
    # A Python or NumPy real, or a one-element tensor: what float() takes as a value (not a string).
    return isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def check_flags(causal, alibi_slopes) -> None:
    """`causal` is a truth value and `alibi_slopes` a tensor (or None): what the op's schema would refuse with
    torch's own words, or, for a string such as causal="no", take as true."""
    try:
        truth_value = causal in (True, False)  # bool, 0 and 1, NumPy's and one-element tensors' bools
    except RuntimeError:  # a tensor of several elements
        truth_value = False
    if not truth_value:
        raise BadInputError(f"causal must be True or False, got {causal!r}")
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise BadInputError(f"alibi_slopes must be None or a float32 tensor of shape (Hq,) or (B, Hq), got "
                            f"{type(alibi_slopes).__name__}: pass torch.tensor(slopes, dtype=torch.float32)")


def check_slopes_grad(alibi_slopes) -> None:
    """Called where autograd records the call: the kernels compute no gradient for ALiBi slopes (as FlashAttention's
    do not), and a slope that silently kept a None gradient would not train."""
    if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise BadInputError("alibi_slopes gets no gradient from flash attention: pass alibi_slopes.detach() (fixed "
                            "slopes), or add the bias through an attn_mask of "
                            "torch.nn.functional.scaled_dot_product_attention to learn them")


def autocast_inputs(q, k, v) -> tuple | None:
    """q, k, v cast as autocast casts SDPA's (an op that runs in the lower precision), or None where autocast leaves
    them as they are: it is off for their device, or they already have its dtype. fp8 inputs stay fp8."""
    return autocast_operands(q, k, v)


def check_fp8_grad(q, k, v) -> None:
    if q.dtype == torch.float8_e4m3fn and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise UnsupportedDtypeError("the fp8 path is forward only: call it under torch.no_grad(), or train in bf16")


# --- serving one problem ----------------------------------------------------------------------------
def _on_device(device: torch.device, launch):
    """`launch` wrapped to run with the tensors' GPU current (Triton launches on the current device)."""
    if device.type != "cuda":
        return launch
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_device

    def on_device(*args):
        if current() == index:
            return launch(*args)
        with torch.cuda.device(index):
            return launch(*args)
    return on_device


def _vendor_for(problem: FlashProblem, device: DeviceInfo, chosen: str, sample: dict, grad: bool) -> str | None:
    """The SDPA backend to serve: the chosen one if torch's checks take the call's own tensors (strides, alignment),
    else the first other vendor config of the problem that they take; None: none does."""
    q, k, v = sample["q"], sample["k"], sample["v"]
    options = [chosen] + [c[VENDOR_KEY] for c in FAMILY.vendor_configs(problem, device) if c[VENDOR_KEY] != chosen]
    for backend in options:
        if not q.is_cuda or flash_vendor.accepts(backend, q, k, v, grad):
            return backend
    return None


def serve_forward(problem: FlashProblem, device: DeviceInfo, scale: float, sample: dict) -> _Served:
    """The forward runner of `problem`: run(q, k, v, alibi, cu_q, cu_k, need_lse) -> (o, lse or None).

    lse is (B, Hq, Sq) (packed: (Hq, total_q)) fp32 in log2 units. `sample` holds tensors shaped and
    strided as every call of this runner will pass them (the runner keeps none of them).
    """
    served = _Served(None, trace.counter(FAMILY, problem, device), False)

    def install(run) -> None:
        served.run = run
        _forget_calls()  # flash_attention's entries by raw call key hold the runner they were made with

    def rebuild(resolution, q, k, v, o, lse, alibi, cu_q, cu_k) -> tuple:
        return _forward_runner(served, problem, device, scale, resolution, {"q": q, "k": k, "v": v, "alibi": alibi},
                               install, rebuild)

    served.run = _forward_runner(served, problem, device, scale, fallback.usable(FAMILY, problem, device), sample,
                                 install, rebuild)[1]
    return served


def _forward_runner(served: _Served, problem: FlashProblem, device: DeviceInfo, scale: float, resolution,
                    sample: dict, install, rebuild) -> tuple:
    """(config, run) of serve_forward for `resolution`; sets the served object's vendor and sdpa fields.

    Each render's first launch is guarded (autotile.runtime.fallback): a kernel that cannot build here hands its
    calls to the next choice, which `install` keeps.
    """
    config = resolution.config
    # NOTE: SDPA's backends give NaN for a zero or negative scale (seen on the H200 with cuDNN); the generated
    # kernel handles them, so such calls never go to the vendor.
    if resolution.vendor and scale > 0:
        backend = _vendor_for(problem, device, config[VENDOR_KEY], sample, grad=True)
        if backend is not None:
            causal = problem.causal
            own = _sdpa_picks(backend, problem, sample, scale)
            gqa = problem.heads_q != problem.heads_kv
            sdpa = torch.nn.functional.scaled_dot_product_attention
            # cuDNN and FlashAttention-2 write O in q's layout already; the efficient kernel (B, S, H, D) whatever q's.
            o_strides = matching_strides(sample["q"])

            def run_vendor(q, k, v, alibi, cu_q, cu_k, need_lse):
                if own and not need_lse:
                    # The backend SDPA itself picks for this call: its C entry point costs the least host time.
                    return with_strides(sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa), o_strides), None
                o, lse = flash_vendor.forward(backend, q, k, v, causal=causal, scale=scale, need_lse=need_lse)
                return with_strides(o, o_strides), lse
            served.vendor, served.sdpa = True, (causal, scale, gqa) if own else None
            return Config({VENDOR_KEY: backend}), run_vendor
    source = resolution.source
    if resolution.vendor:
        config, source = FAMILY.default_config(problem, device), "default"
        fallback.check_default(FAMILY, problem, config)
    served.vendor, served.sdpa = False, None
    q = sample["q"]
    outputs = FAMILY.allocate_outputs(problem, {"q": q})
    # Two renders of the forward: one writes the log-sum-exp (autograd, return_lse), one does not (inference).
    with_lse, without_lse = (FAMILY.plan(problem, config, sample, outputs, scale=scale, keep=True,
                                         store_lse=store) for store in (True, False))
    o_shape, o_dtype, lse_shape, dev = q.shape, torch_dtype(problem.out_dtype), outputs["lse"].shape, q.device
    o_strides = outputs["o"].stride()  # q's layout (autotile.layouts), as the plan took it
    # fp8 tensors passed by users carry their values as they are: unit descales.
    descale = torch.ones(3, dtype=torch.float32, device=dev) if problem.dtype == "fp8" else None

    def launcher(plan):
        def launch(q, k, v, o, lse, alibi, cu_q, cu_k):
            # Pointers a render does not read get any tensor (here the output or the lse).
            plan(q, k, v, o, lse, lse if descale is None else descale, lse if alibi is None else alibi,
                 lse if cu_q is None else cu_q, lse if cu_k is None else cu_k)
        return _on_device(dev, launch)

    def redo(need_lse: bool):
        def compute(runner, q, k, v, o, lse, alibi, cu_q, cu_k):
            # A render that failed is one launch of a call: the next choice computes the call, into its outputs.
            o_next, lse_next = runner(q, k, v, alibi, cu_q, cu_k, need_lse)
            o.copy_(o_next)
            if need_lse:
                lse.copy_(lse_next)
        return compute

    def proven_without(launch) -> None:
        nonlocal launch_without
        launch_without = launch

    def proven_with(launch) -> None:
        nonlocal launch_with
        launch_with = launch

    # Each render compiles at its first launch (an inference call may come long before the first with autograd).
    choice = fallback.Choice(FAMILY, problem, device, config, source)
    launch_without = fallback.guard(choice, launcher(without_lse), rebuild, install, proven=proven_without,
                                    redo=redo(False))
    launch_with = fallback.guard(choice, launcher(with_lse), rebuild, install, proven=proven_with, redo=redo(True))
    same_dtype = o_dtype == q.dtype
    # Packed rows past cu_seqlens_q[-1] belong to no sequence and no program writes them: they start as rows that
    # see no key (O zero, LSE +inf) rather than whatever memory held, which would reach the next layer and its
    # gradients. Where they begin is on the GPU, so the whole output is filled (one memset a call).
    packed = problem.varlen

    def run_kernel(q, k, v, alibi, cu_q, cu_k, need_lse):
        # NOTE: new_empty where O has Q's dtype: 2.7 us of host time against torch.empty's 4.3 on the H200 machine
        # (results/host_pieces_2026-12-02.txt).
        if packed:
            o = torch.zeros(o_shape, dtype=o_dtype, device=dev)
        else:
            o = (q.new_empty_strided(o_shape, o_strides) if same_dtype
                 else torch.empty_strided(o_shape, o_strides, dtype=o_dtype, device=dev))
        if not need_lse:
            launch_without(q, k, v, o, o, alibi, cu_q, cu_k)
            return o, None
        lse = (torch.full(lse_shape, math.inf, device=dev) if packed
               else torch.empty(lse_shape, dtype=torch.float32, device=dev))
        launch_with(q, k, v, o, lse, alibi, cu_q, cu_k)
        return o, lse
    return config, run_kernel


def _sdpa_picks(backend: str, problem: FlashProblem, sample: dict, scale: float) -> bool:
    """Whether F.scaled_dot_product_attention, left to choose, runs `backend` on this call with our semantics
    (its causal mask is top-left: the same as ours only when Sq == Sk)."""
    if problem.causal and problem.seq_q != problem.seq_k:
        return False
    enum = {flash_vendor.CUDNN: "CUDNN_ATTENTION", flash_vendor.FLASH: "FLASH_ATTENTION",
            flash_vendor.EFFICIENT: "EFFICIENT_ATTENTION", flash_vendor.MATH: "MATH"}.get(backend)
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(sample["q"], sample["k"], sample["v"], None, 0.0, problem.causal,
                                         scale=scale, enable_gqa=problem.heads_q != problem.heads_kv)
        return enum is not None and choice == getattr(SDPBackend, enum).value
    except Exception:  # noqa: BLE001 - a torch without this entry point: the backend's own op serves
        return False


def serve_backward(problem: FlashProblem, device: DeviceInfo, scale: float, sample: dict, has_dlse: bool) -> _Served:
    """The backward runner: run(q, k, v, o, do, lse, alibi, cu_q, cu_k, dlse) -> (dq, dk, dv)."""
    served = _Served(None, trace.counter(FAMILY, problem, device), False)

    def install(run) -> None:
        served.run = run

    def rebuild(resolution, q, k, v, o, do, lse, alibi, cu_q, cu_k, dlse) -> tuple:
        sample = {"q": q, "k": k, "v": v, "o": o, "do": do, "lse": lse, "alibi": alibi}
        return _backward_runner(served, problem, device, scale, resolution, sample, has_dlse, install, rebuild)

    served.run = _backward_runner(served, problem, device, scale, fallback.usable(FAMILY, problem, device), sample,
                                  has_dlse, install, rebuild)[1]
    return served


def gluon_before_vendor(problem: FlashProblem, device: DeviceInfo, resolution) -> bool:
    """Whether a backward nobody tuned goes to the Gluon backward rather than SDPA's.

    The family's backward serves only calls whose forward was not SDPA's own call (a generated forward, or
    return_lse). Where cuDNN's backward runs on the given O and LSE (flash_vendor.CUDNN_BACKWARD_ON_GIVEN_LSE, on)
    at its own speed, it serves first: the Gluon backward beside it ran at 0.78-1.05x over fourteen model and
    anchor shapes on an H100 and 0.92-1.11x over ten on an H200 (head dim 64 not causal 0.90-0.92x, GQA at 4k on the
    H200 1.10x; benchmarks/results/flash_bwd_2026-12-05b_cudnn_direct.txt, _2026-12-05c_h200_cudnn_direct.txt), so
    an untuned call gets the vendor's backward, which never loses to PyTorch's, and a tuned winner the Gluon one where
    it wins.
    Where cuDNN's backward would run its forward again first (the flag off, or torch's op refused the given O and LSE
    on this device; cuDNN's of 2 x 32 x 4096 causal took 2.01 ms so, 1.54 ms alone) or SDPA's pick is another backend
    (FlashAttention-2's, given O and LSE, runs at 0.53-0.76x of cuDNN's), the Gluon backward comes first: it ran at
    0.92x or more of cuDNN's backward alone over the model shapes measured
    (benchmarks/results/flash_bwd_2026-12-04d_chunks.txt). With a generated forward on an H100, a training step with
    cuDNN's backward on the given O and LSE ran at 0.855x of SDPA's own step (geometric mean of 16 model shapes, the
    forward untuned) against 0.781x with the Gluon backward first (results/serve_bench_h100_train_flag_2026-12-05.md).
    A stored winner, even the vendor op, still serves as
    stored; under torch.use_deterministic_algorithms(True) the Triton backward would serve (0.6-0.8x) and SDPA's
    stays, as it does where the Gluon backward failed here (the resolution's match is then 'fallback')."""
    if resolution.source != "vendor" or resolution.match != "vendor" or torch.are_deterministic_algorithms_enabled():
        return False
    chosen = resolution.config[VENDOR_KEY]
    if chosen == flash_vendor.CUDNN and flash_vendor.backward_takes_given_lse(chosen,
                                                                              torch.device(device.torch_device)):
        return False
    return FAMILY.default_config(problem, device).get("LOADS") == GLUON_WS


# Forward FLOPs below which a training call runs SDPA's own forward and backward even where a generated forward
# would serve (sdpa_training_pair): a step this small gains nothing from the generated forward and pays our autograd
# Function's host time, where SDPA's C++ autograd costs the least. H100, a generated forward and cuDNN's backward on
# its O and LSE beside SDPA's step: 1 x 1000 (6.1-8.2 GFLOP of forward work) ran at 0.44-0.67x, host-bound (361-383
# us of host time a step against SDPA's 219-292; kernels 137 us against 143;
# results/serve_bench_h100_train_flag_2026-12-05.md); Llama-3-8B, Qwen2.5-7B and Gemma-2-9B at 2 x 1000, 8 x 512,
# 4 x 1000 and 16 x 512 (14-34 GFLOP) at 0.51-1.01x over two runs, none ahead of parity
# (results/serve_bench_h100_train_small_rule_off_2026-12-05b.md, _rule_15g_2026-12-05b.md); from 4 x 2048 (69-137
# GFLOP) 0.92-1.04x, which the forward's tuning decides. The threshold lies between 34 and 69 GFLOP (their geometric
# middle).
HOST_BOUND_STEP_FLOPS = 48e9


def sdpa_training_pair(q, k, v, causal: bool, scale: float, window: tuple = (-1, -1),
                       softcap: float = 0.0) -> tuple | None:
    """(is_causal, scale, enable_gqa) where a plain call that needs gradients, whose forward a generated kernel
    serves, should run SDPA's forward and backward instead; None where it should not.

    A generated forward leaves the backward to the family, whose resolution for an untuned call is SDPA's backward,
    unless the Gluon backward comes first (gluon_before_vendor). SDPA's backward of a forward it did not run is
    cuDNN's (or the efficient kernel's) after running its forward again, one more forward a step: more than a
    generated forward saves (its policies and winners win by 3-30%). SDPA's own pair needs no second forward.
    FlashAttention-2's backward takes O and LSE as given, as cuDNN's does under
    flash_vendor.CUDNN_BACKWARD_ON_GIVEN_LSE, so with those the pair stays ours, except for a step too small to
    hide the host time of our autograd Function (HOST_BOUND_STEP_FLOPS): SDPA's pair serves it whichever backward
    would."""
    if scale <= 0 or window != (-1, -1) or softcap or (causal and q.shape[2] != k.shape[2]):
        return None  # SDPA's is_causal is top-left aligned: the same mask only where Sq == Sk
    device = current_device(q.device)
    forward = FAMILY.problem_from_tensors(q, k, v, causal=causal)
    problem = dataclasses.replace(forward, direction="bwd")
    resolution = fallback.usable(FAMILY, problem, device)
    if not resolution.vendor:
        return None  # a stored backward winner serves as stored, and no SDPA backend takes these tensors
    backend = _vendor_for(problem, device, resolution.config[VENDOR_KEY], {"q": q, "k": k, "v": v}, grad=True)
    if backend is None:
        return None
    host_bound = FAMILY.cost(forward).flops < HOST_BOUND_STEP_FLOPS
    if not host_bound and (gluon_before_vendor(problem, device, resolution)
                           or flash_vendor.backward_takes_given_lse(backend, q.device)):
        return None
    return causal, scale, q.shape[1] != k.shape[1]


def _backward_runner(served: _Served, problem: FlashProblem, device: DeviceInfo, scale: float, resolution,
                     sample: dict, has_dlse: bool, install, rebuild) -> tuple:
    """(config, run) of serve_backward for `resolution`; a generated kernel's first call is guarded (see fallback)."""
    config, source = resolution.config, resolution.source
    if resolution.vendor:
        # See serve_forward on scales.
        usable = not has_dlse and scale > 0 and not gluon_before_vendor(problem, device, resolution)
        backend = _vendor_for(problem, device, config[VENDOR_KEY], sample, grad=True) if usable else None
        if backend is not None:
            causal = problem.causal

            grad_strides = tuple(matching_strides(sample[name]) for name in ("q", "k", "v"))

            def run_vendor(q, k, v, o, do, lse, alibi, cu_q, cu_k, dlse):
                grads = flash_vendor.backward(backend, do, q, k, v, o, lse, causal=causal, scale=scale)
                return tuple(with_strides(g, strides) for g, strides in zip(grads, grad_strides))
            served.vendor = True
            return Config({VENDOR_KEY: backend}), run_vendor
        # SDPA's backward takes no gradient of the log-sum-exp (and no backend may take these tensors), or the Gluon
        # backward serves first (gluon_before_vendor): the generated kernel computes this one.
        config, source = FAMILY.default_config(problem, device), "default"
        fallback.check_default(FAMILY, problem, config)
    if config.get("LOADS") == GLUON_WS and torch.are_deterministic_algorithms_enabled():
        # The Gluon backward adds dQ in whatever order its programs finish: the Triton backward, deterministic,
        # serves under torch.use_deterministic_algorithms(True).
        config, source = FAMILY.triton_backward_default(problem, device), "default"
        fallback.check_default(FAMILY, problem, config)
    served.vendor = False
    q = sample["q"]
    outputs = FAMILY.allocate_outputs(problem, sample)
    plan = FAMILY.plan(problem, config, sample, outputs, scale=scale, keep=True)
    dev = q.device

    def launch(q, k, v, o, do, lse, alibi, cu_q, cu_k, dlse, dq, dk, dv):
        plan(q, k, v, o, do, lse, None, dq, dk, dv, lse if alibi is None else alibi, lse if cu_q is None else cu_q,
             lse if cu_k is None else cu_k, dlse)

    launch_here = _on_device(dev, launch)
    # Packed rows in no sequence get no gradient from the kernels: zero, not whatever memory held (see
    # _forward_runner). Dense gradients are laid out as their inputs, as the plan took them (autotile.layouts).
    grad_strides = tuple(outputs[name].stride() for name in ("dq", "dk", "dv"))

    def new_grad(t, strides):
        if problem.varlen:
            return torch.zeros(t.shape, dtype=t.dtype, device=dev)
        return t.new_empty_strided(t.shape, strides)

    def run_kernel(q, k, v, o, do, lse, alibi, cu_q, cu_k, dlse):
        dq, dk, dv = (new_grad(t, strides) for t, strides in zip((q, k, v), grad_strides))
        launch_here(q, k, v, o, do, lse, alibi, cu_q, cu_k, dlse, dq, dk, dv)
        return dq, dk, dv
    choice = fallback.Choice(FAMILY, problem, device, config, source)
    return config, fallback.guard(choice, run_kernel, rebuild, install)


def _layout(t: torch.Tensor | None) -> tuple | None:
    """Shape, strides, dtype, device and 16-byte alignment: what a bound launch and the problem depend on
    (Triton specialises each pointer argument on its alignment)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, not t.data_ptr() & 15)


def _forward_key(q, k, v, causal, scale, window, softcap, alibi) -> tuple:
    # Everything the problem, its served config and the plan's arguments depend on (~2 us to build).
    return (_layout(q), _layout(k), _layout(v), causal, scale, window, softcap, _layout(alibi))


def _served_forward(q, k, v, causal: bool, scale: float, window: tuple, softcap: float, alibi) -> _Served:
    def build():
        problem = FAMILY.problem_from_tensors(q, k, v, causal=causal, window=window, softcap=softcap,
                                              alibi_slopes=alibi)
        return serve_forward(problem, current_device(q.device), scale, {"q": q, "k": k, "v": v, "alibi": alibi})
    return _keep(("fwd",) + _forward_key(q, k, v, causal, scale, window, softcap, alibi), build)


def _served_backward(q, k, v, o, do, lse, causal, scale, window, softcap, alibi, dlse) -> _Served:
    def build():
        problem = FAMILY.problem_from_tensors(q, k, v, causal=causal, direction="bwd", window=window,
                                              softcap=softcap, alibi_slopes=alibi)
        sample = {"q": q, "k": k, "v": v, "o": o, "do": do, "lse": lse, "alibi": alibi}
        return serve_backward(problem, current_device(q.device), scale, sample, dlse is not None)
    key = ("bwd",) + _forward_key(q, k, v, causal, scale, window, softcap, alibi) + (
        _layout(o), _layout(do), _layout(lse), dlse is not None, torch.are_deterministic_algorithms_enabled())
    return _keep(key, build)


# --- the custom ops ---------------------------------------------------------------------------------
@torch.library.custom_op("autotile::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                        window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """o (B, Hq, Sq, D) and lse (B, Hq, Sq) fp32, log2 domain (+inf for rows that see no key)."""
    check_numbers(scale, softcap)  # traced as symbols, they were not checked before
    served = _served_forward(q, k, v, causal, scale, (window_left, window_right), softcap, alibi_slopes)
    served.calls[0] += 1
    return served.run(q, k, v, alibi_slopes, None, None, True)


@flash_attention_fwd.register_fake
def _flash_attention_fwd_fake(q, k, v, causal, scale, window_left=-1, window_right=-1, softcap=0.0,
                              alibi_slopes=None):
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    return (q.new_empty_strided(q.shape, matching_strides(q), dtype=out_dtype),
            q.new_empty(q.shape[:3], dtype=torch.float32))


def _flash_attention_bwd(do, q, k, v, o, lse, causal, scale, window_left=-1, window_right=-1, softcap=0.0,
                         alibi_slopes=None, dlse=None):
    """The body of autotile::flash_attention_bwd, which eager backward calls (_backward) without the dispatcher."""
    do, lse = _unit_stride(do), lse.contiguous()
    served = _served_backward(q, k, v, o, do, lse, causal, scale, (window_left, window_right), softcap,
                              alibi_slopes, dlse)
    served.calls[0] += 1
    return served.run(q, k, v, o, do, lse, alibi_slopes, None, None, dlse)


@torch.library.custom_op("autotile::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float, window_left: int = -1, window_right: int = -1,
                        softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                        dlse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the forward above, recomputed from its o and lse (and the gradient of lse, when given)."""
    return _flash_attention_bwd(do, q, k, v, o, lse, causal, scale, window_left, window_right, softcap, alibi_slopes,
                                dlse)


@flash_attention_bwd.register_fake
def _flash_attention_bwd_fake(do, q, k, v, o, lse, causal, scale, window_left=-1, window_right=-1, softcap=0.0,
                              alibi_slopes=None, dlse=None):
    return tuple(t.new_empty_strided(t.shape, matching_strides(t)) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, window_left, window_right, softcap, alibi_slopes = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, alibi_slopes)
    ctx.args = (causal, scale, window_left, window_right, softcap)


def eager_or_op(op, body, *tensors):
    """The op's body for plain tensors outside any tracing (eager.autograd_call_ok), else the custom op, which
    torch.compile records. NOTE: called eagerly from an autograd backward, the op's dispatch (redispatch, its no-grad
    wrapper, dynamo's disabled frame) took 30 of the 76 us of host time a flash backward cost around its kernels (CPU,
    kernels stubbed out: 76 -> 46 us a call). torch.compiler.is_compiling() alone is not enough to tell: Inductor's
    AOT tracing of the backward runs this with fake tensors while it returns False."""
    return body if autograd_call_ok(*tensors) else op


class _NoDoubleBackward(torch.autograd.Function):
    """Gradients autograd was asked to differentiate again (create_graph=True). The backward kernels have no
    derivative of their own: without this, the gradients would come back as constants, and a loss on them (a
    gradient penalty) would train silently without its own gradient. SDPA's fused backends raise, so does this."""

    @staticmethod
    def forward(ctx, count, *tensors):
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("autotile's attention backward has no derivative (double backward): compute a loss on "
                           "attention gradients with torch.nn.functional.scaled_dot_product_attention under "
                           "torch.nn.attention.sdpa_kernel(SDPBackend.MATH)")


def no_double_backward(grads: tuple, *inputs) -> tuple:
    """`grads` as they are, or, when autograd records the backward (create_graph=True), tied to the backward's inputs
    by a function that refuses a second differentiation."""
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
        return grads
    return _NoDoubleBackward.apply(len(grads), *grads, *(t for t in inputs if t is not None))


def _backward(ctx, do, dlse):
    q, k, v, o, lse, alibi_slopes = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    bwd = eager_or_op(flash_attention_bwd, _flash_attention_bwd, do, q, k, v, o, lse, alibi_slopes, dlse)
    dq, dk, dv = bwd(do, q, k, v, o, lse, *ctx.args, alibi_slopes, dlse)
    return (*no_double_backward((dq, dk, dv), q, k, v, do, dlse), None, None, None, None, None, None)


torch.library.register_autograd("autotile::flash_attention_fwd", _backward, setup_context=_setup_context)


class _EagerFlash(torch.autograd.Function):
    """What the op and its registered autograd do, for eager calls of plain tensors that need gradients
    (eager.autograd_call_ok): forward and backward call the implementations directly. NOTE: through the op, a
    short training call's backward cost 242-299 us of host time on the H200's host against 117-118 for SDPA's
    cuDNN backward through autograd (Qwen2.5-0.5B 16 x 512 ran at 0.45x of cuDNN, its kernels at 1.15x), 86-192 us
    more than the op's body called directly: the custom op's autograd wrapper and dispatch, and a zeros tensor made
    for an unused LSE's gradient (results/flash_bwd_op_gap_2026-12-04.txt). Gradients an output did not get stay
    None here (set_materialize_grads(False)): the backward then reads no LSE gradient."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, served):
        ctx.set_materialize_grads(False)
        q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
        o, lse = served.run(q, k, v, alibi_slopes, None, None, True)
        ctx.save_for_backward(q, k, v, o, lse, alibi_slopes)
        ctx.served = served
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        # NOTE: saved tensors are read once: non-reentrant activation checkpointing recomputes them on the first
        # read and refuses a second ("Unpack is being triggered for a tensor that was already unpacked once").
        saved = ctx.saved_tensors
        dq, dk, dv = _EagerFlash.gradients(ctx, saved, do, dlse)
        return (*no_double_backward((dq, dk, dv), *saved[:3], do, dlse), None, None)

    @staticmethod
    def gradients(ctx, saved, do, dlse):
        q, k, v, o, lse, alibi_slopes = saved
        do = torch.zeros_like(o) if do is None else _unit_stride(do)
        # q, k, v, o and lse are laid out as the forward's signature fixes them: the backward's _Served is found
        # by what else it depends on (NOTE: the full key's nine layouts cost ~30 us of host time on the H200's host).
        key = (do.stride(), do.dtype, not do.data_ptr() & 15, dlse is not None,
               torch.are_deterministic_algorithms_enabled())
        forward = ctx.served
        served = forward.backward.get(key)
        if served is None:
            causal, scale, window, softcap = forward.args
            served = forward.backward[key] = _served_backward(q, k, v, o, do, lse, causal, scale, window, softcap,
                                                              alibi_slopes, dlse)
        served.calls[0] += 1
        return served.run(q, k, v, o, do, lse, alibi_slopes, None, None, dlse)


# --- the public function ----------------------------------------------------------------------------
def _normalise(q, k, v, scale, window, softcap, causal=False):
    """Checked arguments, scale and window as the kernels take them. Dense calls: window sides that mask nothing at
    their lengths become -1 (effective_window), so such a call is a plain one (packed calls: ops_flash_varlen)."""
    check_args(q, k, v, scale, softcap)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    window = window_pair(window)  # (-1, -1) for None; Python ints from NumPy ones; a clear message for the rest
    lengths = _dense_lengths(q, k)
    if lengths is not None and window != (-1, -1) and not torch.compiler.is_compiling():
        window = effective_window(window, *lengths, bool(causal))
    return _unit_stride(q), _unit_stride(k), _unit_stride(v), scale, window, float(softcap or 0.0)


def _dense_lengths(q, k) -> tuple | None:
    """(Sq, Sk) of (B, H, S, D) tensors; None for anything else (check_args explains it)."""
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4:
        return q.shape[2], k.shape[2]
    return None


def _call_key(q, k, v, causal, scale, window, softcap, alibi) -> tuple:
    # The raw arguments of a call, so a repeated call is recognised before any checking or normalising:
    # layouts, each pointer's 16-byte alignment (Triton specialises on it), mask, scale and features.
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
            v.dtype, v.device, not q.data_ptr() & 15, not k.data_ptr() & 15, not v.data_ptr() & 15, causal, scale,
            window, softcap, _layout(alibi))


def _first_call(key: tuple, q, k, v, causal, scale, window, softcap, alibi) -> _Served:
    """Check and normalise a new call signature, and keep what serves it under its raw key."""
    check_flags(causal, alibi)
    qn, kn, vn, scale, window, softcap = _normalise(q, k, v, scale, window, softcap, causal)
    causal = bool(causal)
    inner = _served_forward(qn, kn, vn, causal, scale, window, softcap, alibi)
    run = inner.run
    if qn is not q or kn is not k or vn is not v:  # a head dim with a stride: copied, as every call of this layout
        def run(q, k, v, *rest, inner=inner.run):
            return inner(_unit_stride(q), _unit_stride(k), _unit_stride(v), *rest)
    served = _Served(run, inner.calls, inner.vendor, (causal, scale, window, softcap), q.dtype == torch.float8_e4m3fn,
                     inner.sdpa)
    with _served_lock:
        _calls[key] = served
    return served


def _is_empty(q, k) -> bool:
    return q.dim() == 4 and k.dim() == 4 and 0 in (q.shape[0], q.shape[2], k.shape[2])


def _empty_attention(q, k, v, causal, scale, window, softcap, alibi, return_lse):
    """A batch of 0, no queries or no keys: SDPA's result (empty, or with no keys rows of zeros; LSE +inf, as for
    every row that sees no key), differentiable, after the checks every call gets. Nothing to tune or launch."""
    check_flags(causal, alibi)
    q, k, v, scale, window, softcap = _normalise(q, k, v, scale, window, softcap, causal)
    FAMILY.check_tensors(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi, empty_ok=True)
    group = q.shape[1] // k.shape[1]
    keys, values = (t.float().repeat_interleave(group, 1) for t in (k, v))
    # Softmax over no keys is empty, and its product with no values is zeros: the rows SDPA returns.
    o = torch.softmax(q.float() @ keys.transpose(-1, -2) * scale, -1) @ values
    o = o.to(torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
    if not return_lse:
        return o
    return o, torch.full(q.shape[:3], math.inf, dtype=torch.float32, device=q.device)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None, window: tuple[int, int] | None = None, softcap: float | None = None,
                    alibi_slopes: torch.Tensor | None = None, return_lse: bool = False, **sdpa_arguments):
    """softmax(scale * q k^T) v with SDPA's layout, differentiable.

    q is (B, Hq, Sq, D) and k, v are (B, Hkv, Sk, D) with Hq a multiple of Hkv (MHA, GQA, MQA), or
    the same with no batch dim or several (SDPA's (..., H, S, D), folded into one batch);
    fp16, bf16 and fp32 train, fp8 e4m3 runs forward only (on a GPU; output bf16). Masks are
    bottom-right aligned, as SDPA's causal_lower_right and FlashAttention: `causal` masks key j from
    query i unless j <= i + Sk - Sq; `window=(left, right)` keeps keys j with
    i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1: no limit on that side; causal sets right to 0).
    Rows that see no key return 0; o (and each gradient) is laid out as q (as its input), as SDPA's backends
    lay theirs out (autotile.layouts). `scale` defaults to 1/sqrt(D) and may be any finite number.
    `softcap` > 0 maps the scaled logits x to softcap * tanh(x / softcap) (Gemma-2); `alibi_slopes`
    (Hq,) or (B, Hq) fp32 add -slope * |i + Sk - Sq - j| to head h's logits. With `return_lse` the
    result is (o, lse), lse (B, Hq, Sq) fp32 the natural-log log-sum-exp of each row's logits
    (+inf for rows that see no key), differentiable too. The generated backward on Hopper (Gluon, at head
    dims up to 128 untuned) adds dQ by reductions in any order; under
    torch.use_deterministic_algorithms(True) the Triton backward serves, which is deterministic (no atomics: one
    program sums each key block's gradient over its query heads). SDPA's backends follow that switch as SDPA does.
    Under torch.autocast, fp32/fp16/bf16 q, k, v are cast to autocast's dtype first, as for SDPA.

    >>> import torch, autotile
    >>> q, k, v = (torch.randn(1, 2, 5, 16, requires_grad=True) for _ in range(3))
    >>> out = autotile.flash_attention(q, k, v, causal=True)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> bool((out - ref).abs().max() < 1e-5)
    True
    >>> out.sum().backward(); q.grad.shape
    torch.Size([1, 2, 5, 16])
    """
    if sdpa_arguments:
        foreign_arguments("flash_attention", sdpa_arguments)
    if isinstance(scale, _Tensor) or isinstance(softcap, _Tensor):
        scale, softcap = number_arguments(scale, softcap)
    if not torch.compiler.is_compiling():
        # Only plain calls can be SDPA's (windows, soft-capping and ALiBi are not): the others skip the short key.
        plain = alibi_slopes is None and not return_lse and window is None and not softcap
        try:
            if q.__class__ is not _Tensor and q.__class__ is not _Parameter:
                raise TypeError  # fake tensors and other subclasses (a fake data pointer read warns): the op's path
            short = (q.shape, k.shape, v.shape, q.dtype, k.dtype, causal, scale) if plain else None
            direct = _sdpa_direct.get(short) if plain else None
            key = served = None
            if direct is None:
                key = _call_key(q, k, v, causal, scale, window, softcap, alibi_slopes)
                served = _calls.get(key)
                if served is None and q.is_meta:
                    key = None  # no data to run on: the op's fake registration gives the output
        except Exception:  # noqa: BLE001 - not plain tensors, an unhashable window, fake tensors: the op checks them
            direct = key = served = None
        if direct is not None:
            direct[0][0] += 1
            return _sdpa(q, k, v, is_causal=direct[1], scale=direct[2], enable_gqa=direct[3])
        if key is not None:
            # SDPA's direct calls above cast for autocast themselves; the others cast here (the C check: ~50 ns).
            if _any_autocast() and (cast := autocast_inputs(q, k, v)) is not None:
                return flash_attention(*cast, causal=causal, scale=scale, window=window, softcap=softcap,
                                       alibi_slopes=alibi_slopes, return_lse=return_lse)
            if served is None:
                if q.dim() != 4 and (folded := _leading_dims_folded(q, k, v, causal, scale, window, softcap,
                                                                     alibi_slopes, return_lse)) is not None:
                    return folded
                if _is_empty(q, k):
                    return _empty_attention(q, k, v, causal, scale, window, softcap, alibi_slopes, return_lse)
                served = _first_call(key, q, k, v, causal, scale, window, softcap, alibi_slopes)
            if served.fp8:
                check_fp8_grad(q, k, v)
            if plain and served.sdpa is not None:
                _sdpa_direct[short] = (served.calls, *served.sdpa)
            # SDPA's op records its own backward; plain tensors needing no autograd skip the dispatcher.
            if (served.vendor and not return_lse) or direct_call_ok(q, k, v, alibi_slopes):
                served.calls[0] += 1
                o, lse = served.run(q, k, v, alibi_slopes, None, None, return_lse)
                return (o, lse * LN2) if return_lse else o
            # A generated kernel's forward that autograd records: the op's implementations in a Function, or SDPA's
            # pair where the backward would be SDPA's anyway (sdpa_training_pair).
            if not served.vendor and not served.fp8 and autograd_call_ok(q, k, v, alibi_slopes):
                served.calls[0] += 1
                if plain:
                    deterministic = torch.are_deterministic_algorithms_enabled()
                    pair = served.sdpa_pair.get(deterministic, _UNRESOLVED)
                    if pair is _UNRESOLVED:
                        pair = served.sdpa_pair[deterministic] = sdpa_training_pair(q, k, v, *served.args)
                    if pair is not None:
                        return _sdpa(q, k, v, is_causal=pair[0], scale=pair[1], enable_gqa=pair[2])
                check_slopes_grad(alibi_slopes)
                o, lse = _EagerFlash.apply(q, k, v, alibi_slopes, served)
                return (o, lse * LN2) if return_lse else o
    if isinstance(q, torch.Tensor) and q.dim() != 4 and (folded := _leading_dims_folded(
            q, k, v, causal, scale, window, softcap, alibi_slopes, return_lse)) is not None:
        return folded
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and _is_empty(q, k):  # traced as eager
        return _empty_attention(q, k, v, causal, scale, window, softcap, alibi_slopes, return_lse)
    check_flags(causal, alibi_slopes)
    check_slopes_grad(alibi_slopes)
    q, k, v, scale, window, softcap = _normalise(q, k, v, scale, window, softcap, causal)
    if (cast := autocast_inputs(q, k, v)) is not None:
        q, k, v = cast
    if not torch.compiler.is_compiling() and under_transform():
        return attention_in_torch(q, k, v, bool(causal), scale, window, softcap, alibi_slopes, return_lse)
    o, lse = torch.ops.autotile.flash_attention_fwd(q, k, v, bool(causal), scale, window[0], window[1], softcap,
                                                    alibi_slopes)
    return (o, lse * LN2) if return_lse else o


def attention_in_torch(q, k, v, causal, scale, window, softcap, alibi, return_lse):
    """A call inside a torch.func transform (eager.under_transform), after the checks every call gets: the family's
    attention in plain torch (logits and softmax in fp32), with every feature, which every transform knows. It holds
    the (Sq, Sk) scores as torch's math attention does."""
    problem = FAMILY.check_tensors(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi,
                                   empty_ok=True)
    if problem.dtype == "fp8":
        raise BadInputError("autotile.flash_attention has no torch.func path for fp8 q, k and v: call it outside vmap, "
                            "grad and the other torch.func transforms")
    scores = Scores(causal, window[0], window[1], softcap)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = attention_math(q, k, v, scale=scale, dtype=wide, scores=scores, alibi_slopes=alibi).to(q.dtype)
    if not return_lse:
        return o
    return o, log2_sum_exp(q, k, scale=scale, scores=scores, alibi_slopes=alibi) * LN2


def _foldable(q, k, v) -> bool:
    """q, k and v of one rank of at least 3, with the same leading dims before (H, S, D)."""
    return q.dim() >= 3 and all(isinstance(t, torch.Tensor) and t.dim() == q.dim() and t.shape[:-3] == q.shape[:-3]
                                for t in (k, v))


def _leading_dims_folded(q, k, v, causal, scale, window, softcap, alibi_slopes, return_lse):
    """SDPA's other ranks, (H, S, D) and (..., H, S, D) alike for q, k and v, as one batch of the leading dims (a
    view where the strides allow, as reshape gives); None for anything else, which the 4-D checks then explain."""
    if not _foldable(q, k, v):
        return None
    lead = q.shape[:-3]
    out = flash_attention(*(t.reshape(-1, *t.shape[-3:]) for t in (q, k, v)), causal=causal, scale=scale,
                          window=window, softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse)
    if return_lse:
        return out[0].reshape(*lead, *out[0].shape[-3:]), out[1].reshape(*lead, *out[1].shape[-2:])
    return out.reshape(*lead, *out.shape[-3:])


def empty_call(q, k, v, *, causal: bool = False, scale: float | None = None, window=None, softcap=None,
               alibi_slopes=None, return_lse: bool = False) -> tuple[FlashFamily, DeviceInfo] | None:
    """For autotile.explain: (family, device) of a call with an empty batch, query or key length, after the checks
    every call gets (it launches nothing: _empty_attention), else None."""
    if isinstance(q, torch.Tensor) and q.dim() != 4 and _foldable(q, k, v):
        q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and _is_empty(q, k)):
        return None
    check_flags(causal, alibi_slopes)
    q, k, v, scale, window, softcap = _normalise(q, k, v, scale, window, softcap, causal)
    FAMILY.check_tensors(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                         empty_ok=True)
    return FAMILY, current_device(q.device)


def problem_for(q, k, v, *, causal: bool = False, scale: float | None = None, window=None, softcap=None,
                alibi_slopes=None, return_lse: bool = False) -> tuple[FlashFamily, FlashProblem, DeviceInfo]:
    """(family, forward problem, device) that `flash_attention(q, k, v, ...)` runs, for autotile.explain."""
    if isinstance(q, torch.Tensor) and q.dim() != 4 and _foldable(q, k, v):  # as the op folds them
        q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
    q, k, v, scale, window, softcap = _normalise(q, k, v, scale, window, softcap, causal)
    if (cast := autocast_inputs(q, k, v)) is not None:  # as the call casts them
        q, k, v = cast
    problem = FAMILY.problem_from_tensors(q, k, v, causal=causal, window=window, softcap=softcap,
                                          alibi_slopes=alibi_slopes)
    return FAMILY, problem, current_device(q.device)
