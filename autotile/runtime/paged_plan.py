"""Plans for paged attention: the host decides once per step, the run only launches.

A serving engine makes one plan per decode step shape (batch size, an upper bound on the
context length, page size, heads, head dim, dtypes: host integers it already has) and calls
`plan.run(...)` once per layer, as FlashInfer's `plan()`/`run()` and vLLM's attention
metadata split the work. The plan picks the config (the tuned winner through
`autotile.runtime.dispatch.resolve`, memoised), the split-KV strategy and the workspace; the
run launches the kernels and nothing else.

The run's contract (checked only where it costs no device read; the rest on CPU tensors and under
AUTOTILE_CHECKS=1, see `checks_on`):

- `q` (B, Hq, D), or (B, Q, Hq, D) for plans made with num_queries=Q, in the planned dtype,
  unit stride along D; B is the planned batch (pad a smaller batch with rows of length 0).
- `k_cache`, `v_cache` (num_pages, page_size, Hkv, D), unit stride along D; fp8 (e4m3) caches
  need `k_scale`/`v_scale` as (Hkv,) float32 tensors on the device.
- `block_table` (B, max_pages) int32, unit stride along pages: the first cdiv(context_lens[b],
  page_size) entries of row b are page ids in [0, num_pages); later entries are never read.
- `context_lens` (B,) int32, contiguous: 0 <= context_lens[b] <= max_context, and >= Q unless 0.
  A length of 0 marks a padding row: its output is 0 and its LSE -inf.
- `out` (optional) like q, unit stride along D; `lse` (optional, return_lse plans) (B, Q, Hq) float32, or (B, Hq)
  for 3-D q. Given both, the run allocates nothing.
Breaking the value rules (a page id out of range, a context longer than the table or than
max_context) reads memory out of bounds on a GPU, as in FlashInfer and vLLM. `AUTOTILE_CHECKS=1`
(or `checks=True`) checks every run's values first, at the cost of one device-to-host read (not
allowed while a CUDA graph is being captured); CPU runs check them, even under AUTOTILE_CHECKS=0. A
plan made with `checks=False` trusts its values as a GPU run does, on the CPU too: there a bad page id
takes the process down (Triton's interpreter reads outside its buffers).

Plans serve inference: a run records no autograd graph (a q that requires grad gets an output that does not, said
once). Inside a `torch.compile`d region a run is a graph break and runs eagerly; `autotile.paged_attention`, a
custom op, compiles whole.

A run does no device-to-host copy, no synchronisation and, given `out` (and `lse`), no
allocation: it can be captured in a CUDA graph and replayed with new queries, block tables and
lengths written into the same tensors. A plan's workspace serves one run at a time (one stream).

>>> import torch
>>> from autotile.kvcache import PagedKVCache
>>> cache = PagedKVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=1, head_dim=64)
>>> for seq, n in (("a", 20), ("b", 37)):
...     cache.allocate(seq)
...     _ = cache.append(seq, torch.randn(n, 1, 64), torch.randn(n, 1, 64))
>>> plan = plan_paged_attention(batch=2, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
...                             max_context=64, dtype=torch.float16, device="cpu")
>>> q = torch.randn(2, 4, 64, dtype=torch.float16)
>>> out = plan.run(q, cache.k_pools[0], cache.v_pools[0], cache.block_table(["a", "b"]), cache.context_lens(["a", "b"]))
>>> out.shape
torch.Size([2, 4, 64])
"""
from __future__ import annotations

import math
import numbers
import warnings

import torch

from autotile.device import DeviceInfo, cuda_device, interpret_device
from autotile.dtypes import canonical_dtype_name
from autotile.errors import BadInputError, KernelUnusableError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families.paged import (
    CACHE_DTYPES, FAMILY, PARTITION_CHOICES, QUERY_DTYPES, PagedLaunch, PagedProblem, SplitConstants, balanced_tile,
    cdiv, check_head_dim, context_bucket,
)
from autotile.runtime import fallback, trace
from autotile.runtime.eager import checked_by_op
from autotile.runtime.paged_fresh import fresh_prefill, is_fresh_uniform
from autotile.space import Config
from autotile.switches import switch

__all__ = ["PagedAttentionPlan", "PagedPrefillPlan", "plan_paged_attention", "plan_paged_prefill",
           "merge_attention_states", "checks_on"]


def checks_on(device: torch.device) -> bool:
    """Whether a run reads its lengths and page ids back and checks them: always for CPU tensors, where reading them
    is free; on a GPU only under `AUTOTILE_CHECKS=1` (a debug mode: a run then waits for the queued work).
    NOTE: CPU runs check even under `AUTOTILE_CHECKS=0`: under Triton's interpreter a page id out of range reads
    outside the host's buffers and takes the process down (a segmentation fault), where a GPU reads garbage."""
    if device.type == "cpu":
        return True
    return switch("AUTOTILE_CHECKS", False, "checks every paged run's lengths and page ids on the GPU, waiting for it")


# What each tensor argument of the paged ops and plans holds, for the message when something else is passed.
_TENSOR_ARGUMENTS = {
    "q": "the queries (B, Hq, D)", "k_cache": "the key cache (num_pages, page_size, Hkv, D)",
    "v_cache": "the value cache (num_pages, page_size, Hkv, D)",
    "block_table": "int32 (B, max_pages) page ids: pass torch.tensor(pages, dtype=torch.int32, device=q.device)",
    "context_lens": "int32 (B,) lengths: pass torch.tensor(lengths, dtype=torch.int32, device=q.device)",
    "cu_seqlens_q": "int32 (B + 1,) cumulative lengths from 0: pass torch.tensor(cu, dtype=torch.int32, "
                    "device=q.device)",
    "k_new": "the new tokens' keys (T, Hkv, D)", "v_new": "the new tokens' values (T, Hkv, D)",
    "slot_mapping": "the new tokens' slots (T,): pass the tensor PagedKVCache.reserve gave",
    "k_scale": "(Hkv,) float32 scales of an fp8 key cache", "v_scale": "(Hkv,) float32 scales of an fp8 value cache",
}


def require_tensors(**given) -> None:
    """BadInputError naming the first argument that is not a tensor (None passes), and what to pass instead."""
    for name, value in given.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise BadInputError(f"{name} must be a tensor of {_TENSOR_ARGUMENTS[name]}; got {type(value).__name__}")


_warned_grad = False


def _warn_no_grad(q: torch.Tensor) -> None:
    """Said once, for a q that requires grad: plans are for inference, and their output carries no gradient to q."""
    global _warned_grad
    if torch.is_grad_enabled() and not _warned_grad:
        _warned_grad = True
        warnings.warn("autotile: paged attention plans serve inference and record no autograd graph: the output "
                      "carries no gradient to q. Train with autotile.flash_attention(_varlen); run the plan under "
                      "torch.inference_mode() to silence this.", stacklevel=3)


def _positive_finite(*scales: torch.Tensor) -> bool:
    """Every value finite and > 0 (reads them back: checked runs only)."""
    return all(bool(((s > 0) & s.isfinite()).all()) for s in scales)


def _fix_hint(t: torch.Tensor, device: torch.device) -> str:
    """What to change in an int32 index tensor the run refused (dtype, device, strides), as a clause."""
    fixes = ([".to(torch.int32)"] if t.dtype != torch.int32 else []) + (
        [f".to({str(device)!r})"] if t.device != device else []) + (
        [".contiguous()"] if t.dim() and t.stride(-1) != 1 else [])
    return f": pass it{''.join(fixes)}" if fixes else ""


@torch.compiler.disable
def _run_eagerly(run, plan, *args, **kwargs):
    """A plan's run called from a torch.compile'd region: a graph break, and the run eagerly.

    NOTE: a run reads host state that dynamo cannot trace (its kept launch, a lock of Triton's interpreter, value
    checks that read tensors back), so it is kept out of the graph rather than traced."""
    return run(plan, *args, **kwargs)


def finite_scale(scale, head_dim: int) -> float:
    """The softmax scale as a float: 1/sqrt(D) by default; NaN and infinities are refused."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, torch.Tensor):
        raise BadInputError("scale must be a Python number (reading a tensor would synchronise the device); "
                            "pass float(scale) once, outside the step")
    if checked_by_op(scale):  # the op's body checks its value
        return scale
    value = float(scale)
    if not math.isfinite(value):
        raise BadInputError(f"scale must be a finite number, got {value}; the default is 1/sqrt(head_dim)")
    return value


def model_features(softcap, window) -> tuple[float, int]:
    """(softcap, window) as the kernels take them: softcap a finite float >= 0 (0 or None: none); window the keys a
    query sees left of itself, an int >= 0, or -1 / None for none; a flash-style (left, right) pair is taken too,
    its right side 0 or -1 (decode is causal)."""
    if softcap is None and window is None:
        return 0.0, -1  # a plain call: decode steps are short, its host time counts
    cap = 0.0 if softcap is None else softcap
    # Numbers torch.compile traces as symbols are checked by the op's body, which gets them as numbers.
    if not checked_by_op(cap) and (isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not math.isfinite(cap)
                                 or cap < 0):
        raise BadInputError(f"softcap must be a finite number >= 0 (Gemma-2 uses 50.0; 0 or None: none), got {softcap!r}")
    left = -1 if window is None else window
    if isinstance(left, (tuple, list)):
        if len(left) != 2 or left[1] not in (0, -1):
            raise BadInputError(f"window=(left, right) takes right 0 or -1 here (attention over a cache is causal), "
                                f"got {window!r}; or pass the left size alone")
        left = left[0]
    if not checked_by_op(left) and (isinstance(left, bool) or not isinstance(left, numbers.Integral) or left < -1):
        raise BadInputError(f"window must be an int >= 0, the keys a query sees left of itself (a model's "
                            f"sliding_window of W tokens is W - 1), or None / -1 for none; got {window!r}")
    return float(cap), int(left)


def effective_paged_window(window: int, max_context: int) -> int:
    """-1 where a window of `window` keys left of each query masks nothing in contexts of at most `max_context`
    tokens (a 4k sliding window in a plan bounded at 2k): the plan is then a plain one, its kernels and winners."""
    return -1 if window >= max_context - 1 else window


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    from autotile.dtypes import torch_dtype

    return torch_dtype(str(value))


def _device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        return cuda_device(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu":
        return interpret_device()
    raise BadInputError(f"paged attention runs on CUDA devices or (interpreted) on the CPU, not {device}")


def _resolve(problem: PagedProblem, info: DeviceInfo):
    return fallback.usable(FAMILY, problem, info)


def served_config(problem: PagedProblem, device: DeviceInfo, resolution) -> Config:
    """The config a decode plan runs for what dispatch resolved.

    A step's lengths are unknown on the host: a config not tuned for this very problem (a winner of a
    nearby shape, tuned on other lengths, or the default) runs with the balanced scheduler, which cuts
    contexts by the lengths it finds on the device, with the measured balanced tile (`balanced_tile`:
    BLOCK_N, warps, stages; the config's own where that one does not fit). An exact winner runs as tuned.
    """
    config = resolution.config
    if resolution.match == "exact" or config.get("VARIANT") not in ("whole", "split"):
        return config
    space = FAMILY.space(problem, device)
    for tile in (balanced_tile(problem, device.sm_count), {}):  # the measured tile, else the config's own
        candidate = {**dict(config), "VARIANT": "balanced", "PARTITION_SIZE": PARTITION_CHOICES[0], **tile}
        if space.is_feasible(candidate):
            return Config(candidate)
    return config


def prefill_problem(batch: int, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                    max_context: int, dtype_name: str, kv_dtype_name: str, softcap: float = 0.0,
                    window: int = -1) -> PagedProblem:
    """The problem a prefill step's config is keyed by: its context bound's bucket, and the mean query tokens per
    sequence (a power of two, at least 2: the prefill variant's problems)."""
    bound = context_bucket(max_context)
    queries = min(max(2, context_bucket(cdiv(max(num_tokens, 1), batch))), bound)
    return PagedProblem(batch, num_q_heads, num_kv_heads, head_dim, page_size, bound, bound, queries, dtype_name,
                        kv_dtype_name, softcap, window)


def served_prefill_config(problem: PagedProblem, device: DeviceInfo, resolution) -> Config:
    """The config a prefill plan runs for what dispatch resolved: a prefill config as it is, else the family's."""
    if resolution.config["VARIANT"] != "prefill":
        return FAMILY.prefill_config(problem, device)
    return resolution.config


def _choice(problem: PagedProblem, info: DeviceInfo, resolution) -> fallback.Choice:
    return fallback.Choice(FAMILY, problem, info, resolution.config, resolution.source)


def _shape_dtypes(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype, kv_dtype) -> tuple:
    dtype = _dtype(dtype)
    kv_dtype = dtype if kv_dtype is None else _dtype(kv_dtype)
    q_name, kv_name = canonical_dtype_name(dtype), canonical_dtype_name(kv_dtype)
    if q_name not in QUERY_DTYPES:
        raise UnsupportedDtypeError(f"queries must be one of {QUERY_DTYPES}, got {dtype}")
    if kv_name not in CACHE_DTYPES or (kv_name != "fp8" and kv_dtype != dtype):
        raise UnsupportedDtypeError(f"caches must be in the query dtype ({dtype}) or float8_e4m3fn, got {kv_dtype}")
    if min(num_q_heads, num_kv_heads, page_size) < 1 or num_q_heads % num_kv_heads:
        raise ShapeMismatchError(f"need Hq a multiple of Hkv >= 1 and page_size >= 1, got Hq={num_q_heads}, "
                                 f"Hkv={num_kv_heads}, page_size={page_size}")
    check_head_dim(head_dim)
    return dtype, kv_dtype, q_name, kv_name


def _described(t: torch.Tensor) -> str:
    """A tensor as the plans' messages show it: shape, dtype, device and strides."""
    return f"{tuple(t.shape)} {t.dtype} on {t.device} with strides {tuple(t.stride())}"


def _q_hint(q: torch.Tensor, wanted: tuple | None) -> str:
    """What to do about a refused q where one thing is plainly off: its layout along D, or a smaller batch."""
    if q.dim() and q.stride(-1) != 1:
        return ": pass q.contiguous()"
    if wanted is not None and q.dim() == len(wanted) and tuple(q.shape[1:]) == wanted[1:] and q.shape[0] < wanted[0]:
        return f": pad the batch to {wanted[0]} with rows of context length 0"
    return ""


def _check_int(name: str, value) -> None:
    """A plan's size given as an int (numpy's too): 2.5 sequences would otherwise be planned as 2."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BadInputError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


class _PlanBase:
    """What decode and prefill plans share: the shapes they were made for and the checks of a run's tensors."""

    def _init_shapes(self, *, batch, num_q_heads, num_kv_heads, head_dim, page_size, max_context, dtype, kv_dtype,
                     device, return_lse, checks):
        sizes = {"batch": batch, "num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                 "page_size": page_size, "max_context": max_context}
        for name, value in sizes.items():
            _check_int(name, value)
        if batch < 0 or max_context < 1:
            raise BadInputError(f"need batch >= 0 and max_context >= 1, got batch={batch}, max_context={max_context}")
        self.dtype, self.kv_dtype, self.dtype_name, self.kv_dtype_name = _shape_dtypes(
            num_q_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype)
        self.batch, self.num_q_heads, self.num_kv_heads = int(batch), int(num_q_heads), int(num_kv_heads)
        self.head_dim, self.page_size, self.max_context = int(head_dim), int(page_size), int(max_context)
        # None: the current CUDA device where there is one, else the CPU (Triton's interpreter runs the plan).
        self.device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BadInputError(f"device={str(self.device)!r} but torch sees no CUDA device here; pass device='cpu' "
                                "(Triton's interpreter runs the plan) or leave device out")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.device.type == "cpu":
            self.device = torch.device("cpu")  # 'cpu:0' names the one CPU device, whose tensors say 'cpu'
        self.return_lse = bool(return_lse)
        self.checks = checks_on(self.device) if checks is None else bool(checks)
        self.fp8 = self.kv_dtype_name == "fp8"
        self._cache_tail = (self.page_size, self.num_kv_heads, self.head_dim)

    def _check_common(self, k_cache, v_cache, block_table, context_lens, k_scale, v_scale) -> None:
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.dim() != 4 or tuple(cache.shape[1:]) != self._cache_tail or cache.dtype != self.kv_dtype:
                raise ShapeMismatchError(
                    f"{name} must be (num_pages, {', '.join(map(str, self._cache_tail))}) {self.kv_dtype} as planned, "
                    f"got {tuple(cache.shape)} {cache.dtype}")
            if cache.stride(-1) != 1 or cache.device != self.device:
                raise BadInputError(f"{name} must be on {self.device} with unit stride along the head dim")
        if k_cache.shape[0] != v_cache.shape[0]:
            raise ShapeMismatchError(f"k_cache has {k_cache.shape[0]} pages and v_cache {v_cache.shape[0]}")
        if (block_table.dim() != 2 or block_table.shape[0] != self.batch or block_table.shape[1] < 1
                or block_table.dtype != torch.int32 or block_table.stride(1) != 1 or block_table.device != self.device):
            raise ShapeMismatchError(
                f"block_table must be ({self.batch}, max_pages >= 1) int32 on {self.device} with unit stride along "
                f"pages, got {tuple(block_table.shape)} {block_table.dtype} on {block_table.device} with strides "
                f"{block_table.stride()}{_fix_hint(block_table, self.device)}")
        if (tuple(context_lens.shape) != (self.batch,) or context_lens.dtype != torch.int32
                or context_lens.stride(0) != 1 or context_lens.device != self.device):
            raise ShapeMismatchError(f"context_lens must be ({self.batch},) int32, contiguous, on {self.device}, got "
                                     f"{tuple(context_lens.shape)} {context_lens.dtype} on {context_lens.device} with "
                                     f"strides {context_lens.stride()}{_fix_hint(context_lens, self.device)}")
        if self.fp8:
            for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
                if (not isinstance(t, torch.Tensor) or tuple(t.shape) != (self.num_kv_heads,)
                        or t.dtype != torch.float32 or t.stride(0) != 1 or t.device != self.device):
                    raise BadInputError(
                        f"an fp8 cache needs {name} as a ({self.num_kv_heads},) float32 tensor on {self.device} "
                        "(stored values times the scale are the real K and V); PagedKVCache.k_scale/v_scale are such")
            if self.checks and not _positive_finite(k_scale, v_scale):
                raise BadInputError("k_scale and v_scale must be finite and > 0 (stored values times the scale are "
                                    "the real K and V)")
        elif k_scale is not None or v_scale is not None:
            raise BadInputError(f"k_scale/v_scale apply to fp8 caches only; these caches are {self.kv_dtype}")

    def _first_launch(self, *args, **kwargs) -> None:
        """The plan's first launch. A config dispatch chose that cannot build or launch here hands the plan to the next
        choice (autotile.runtime.fallback); once a launch returns, runs call the kernel's launch directly."""
        while True:
            try:
                self._kernel_launch()(*args, **kwargs)
            except Exception as exc:
                if self._choice is None or not fallback.recoverable(exc):
                    raise  # a config the caller gave is run as given
                try:
                    self._fail_over(exc)
                except KernelUnusableError as err:
                    self._launch_step = fallback.refusal(err)  # later runs say so at once
                    raise
                continue
            self._launch_step = self._kernel_launch()
            return

    def _fail_over(self, exc: BaseException) -> None:
        failed, first = self.config, self._choice
        while True:
            resolution = fallback.fail_over(self._choice, exc)
            self._choice = fallback.Choice(FAMILY, self.problem, first.device, resolution.config, resolution.source)
            config, source = self._config_for(resolution, first.device)
            if config != failed:
                break
            # The next choice runs the very kernel that failed (as this plan adapts it): unusable too.
        fallback.warn(first, config)
        self.config, self.source = config, source
        self.launch = self._make_launch()

    def _check_output(self, name: str, t, shape: tuple, dtype: torch.dtype) -> None:
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype or t.device != self.device):
            raise ShapeMismatchError(f"{name} must be {shape} {dtype} on {self.device}, got "
                                     f"{tuple(t.shape)} {t.dtype} on {t.device}")
        # The kernels store an output row as D consecutive elements (lse rows go by their strides).
        if name == "out" and t is not None and t.stride(-1) != 1:
            raise BadInputError(f"out must have unit stride along the head dim, got strides {t.stride()}; "
                                "pass torch.empty_like(q)")


class PagedAttentionPlan(_PlanBase):
    """Decode attention over a paged KV cache for one step shape; see the module docstring for the run's contract.

    Make it with `plan_paged_attention(...)` once per step shape (or once per padded batch size
    for CUDA graphs) and call `run(...)` for every layer.
    """

    def __init__(self, *, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 max_context: int, dtype=torch.bfloat16, kv_dtype=None, num_queries: int = 1,
                 device=None, return_lse: bool = False, mean_context: int | None = None,
                 config: Config | dict | None = None, num_sms: int | None = None, checks: bool | None = None,
                 split_constants=None, softcap: float | None = None, window=None):
        self.softcap, self.window = model_features(softcap, window)
        self._init_shapes(batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          page_size=page_size, max_context=max_context, dtype=dtype, kv_dtype=kv_dtype,
                          device=device, return_lse=return_lse, checks=checks)
        # Checked even for an empty step, so a bad override fails where it is written.
        self.split_constants = SplitConstants.of(split_constants)
        _check_int("num_queries", num_queries)
        if mean_context is not None:  # a hint, often an average: any real number from 1 to max_context
            if (isinstance(mean_context, bool) or not isinstance(mean_context, numbers.Real)
                    or not 1 <= mean_context <= max_context):
                raise BadInputError(f"mean_context must be a number from 1 to max_context ({max_context}), got "
                                    f"{mean_context!r}")
            mean_context = max(1, round(mean_context))
        if num_sms is not None:
            _check_int("num_sms", num_sms)
            if num_sms < 1:
                raise BadInputError(f"num_sms must be >= 1 (the SMs the balanced variant fills), got {num_sms}")
        if num_queries < 1 or num_queries > max_context:
            raise BadInputError(f"num_queries must be from 1 to max_context ({max_context}), got {num_queries}")
        self.num_queries = int(num_queries)
        self.window = effective_paged_window(self.window, self.max_context)
        self.problem = self.launch = self.source = None
        self.config = None
        self._calls = [0]  # runs, for AUTOTILE_RECORD (an empty step's are not recorded)
        if self.batch == 0:
            return  # an empty step: run returns empty outputs
        bound = context_bucket(max(self.max_context, self.num_queries))
        mean = bound if mean_context is None else min(context_bucket(max(mean_context, self.num_queries)), bound)
        self.problem = PagedProblem(self.batch, self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size,
                                    bound, mean, self.num_queries, self.dtype_name, self.kv_dtype_name, self.softcap,
                                    self.window)
        info = _device_info(self.device)
        self._calls = trace.counter(FAMILY, self.problem, info)
        self._num_sms = num_sms
        self._choice = None  # the generated kernel dispatch chose (autotile.runtime.fallback); None: a config given
        if config is not None:
            self.config, self.source = FAMILY.validate_config(self.problem, info, Config(config)), "given"
        else:
            resolution = _resolve(self.problem, info)
            self.config, self.source = self._config_for(resolution, info)
            self._choice = _choice(self.problem, info, resolution)
        self.launch = self._make_launch()
        self._launch_step = self._first_launch

    def _config_for(self, resolution, info: DeviceInfo) -> tuple[Config, str]:
        config = served_config(self.problem, info, resolution)
        balanced = ", balanced" if config is not resolution.config else ""
        return config, f"{resolution.source}, {resolution.match}{balanced}"

    def _make_launch(self) -> PagedLaunch:
        # A prefill config (query groups too wide for a decode tile, G x Q > 64) runs the tensor-core query
        # blocks over the batch's uniform Q tokens a sequence.
        return PagedLaunch(self.problem, self.config, self.device, return_lse=self.return_lse, num_sms=self._num_sms,
                           split_constants=self.split_constants)

    def _kernel_launch(self):
        return self.launch.decode_or_prefill

    def __repr__(self) -> str:
        return (f"PagedAttentionPlan(batch={self.batch}, heads={self.num_q_heads}/{self.num_kv_heads}, "
                f"head_dim={self.head_dim}, page_size={self.page_size}, max_context={self.max_context}, "
                f"num_queries={self.num_queries}, config={None if self.config is None else self.config.to_json()}, "
                f"source={self.source})")

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            context_lens: torch.Tensor, *, scale: float | None = None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """Attention of this step's queries; returns out (shaped like q), or (out, lse) for return_lse plans.

        No device-to-host copy, no synchronisation; no allocation when `out` (and `lse`) are given.
        """
        if torch.compiler.is_compiling():
            return _run_eagerly(PagedAttentionPlan.run, self, q, k_cache, v_cache, block_table, context_lens,
                                scale=scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
        scale = finite_scale(scale, self.head_dim)
        if not isinstance(q, torch.Tensor):
            require_tensors(q=q)
        three_d = q.dim() == 3
        if q.requires_grad:
            _warn_no_grad(q)
        q_shape = ((self.batch, self.num_q_heads, self.head_dim) if three_d and self.num_queries == 1
                   else (self.batch, self.num_queries, self.num_q_heads, self.head_dim))
        if tuple(q.shape) != q_shape or q.dtype != self.dtype or q.device != self.device or q.stride(-1) != 1:
            raise ShapeMismatchError(f"q must be {q_shape} {self.dtype} on {self.device} with unit stride along D, "
                                     f"got {_described(q)}{_q_hint(q, q_shape)}")
        lse_shape = q_shape[:-1]
        self._check_output("out", out, q_shape, self.dtype)
        self._check_output("lse", lse, lse_shape, torch.float32)
        if lse is not None and not self.return_lse:
            raise BadInputError("lse= was given to a plan made without return_lse=True")
        if self.batch == 0:
            out = torch.empty(q_shape, dtype=self.dtype, device=self.device) if out is None else out
            lse = torch.empty(lse_shape, dtype=torch.float32, device=self.device) if lse is None else lse
            return (out, lse) if self.return_lse else out
        try:
            self._check_common(k_cache, v_cache, block_table, context_lens, k_scale, v_scale)
        except AttributeError:  # a list or an array where a tensor goes: name it
            require_tensors(k_cache=k_cache, v_cache=v_cache, block_table=block_table, context_lens=context_lens,
                            k_scale=k_scale, v_scale=v_scale)
            raise
        if self.checks:
            check_decode_values(block_table, context_lens, k_cache.shape[0], self.page_size, self.max_context,
                                self.num_queries)
        if out is None:
            out = torch.empty(q_shape, dtype=self.dtype, device=self.device)
        if self.return_lse and lse is None:
            lse = torch.empty(lse_shape, dtype=torch.float32, device=self.device)
        self._calls[0] += 1
        q4, out4 = (q.unsqueeze(1), out.unsqueeze(1)) if three_d else (q, out)
        lse4 = lse.unsqueeze(1) if lse is not None and three_d else lse
        self._launch_step(q4, k_cache, v_cache, block_table, context_lens, out4, scale=scale, k_scale=k_scale,
                          v_scale=v_scale, lse=lse4)
        return (out, lse) if self.return_lse else out


def plan_paged_attention(*, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                         max_context: int, dtype=torch.bfloat16, kv_dtype=None, num_queries: int = 1, device=None,
                         return_lse: bool = False, mean_context: int | None = None, config=None,
                         num_sms: int | None = None, checks: bool | None = None,
                         split_constants=None, softcap: float | None = None, window=None) -> PagedAttentionPlan:
    """A decode plan from host integers: choose the config and the split-KV strategy, allocate the workspace.

    `max_context` is an upper bound on this step's context lengths (the engine's max model length
    works: one plan, and one CUDA graph, serves every step of a padded batch size); it picks the
    tuned config and sizes the 'split' variant. `mean_context` optionally narrows the config's
    bucket. `config` overrides the tuned config; `num_sms` the SM count the balanced variant fills;
    `split_constants` its scheduler's constants (autotile.families.paged.SplitConstants or a dict of its
    fields, e.g. {"items_per_sm": 16}; None: the module's); `checks` the AUTOTILE_CHECKS switch; `device` where
    the plan runs (None: the current CUDA device where there is one, else the CPU). `softcap` soft-caps the logits,
    softcap * tanh(x / softcap) (Gemma-2: 50.0), and `window` keeps the keys at most `window` positions left of each
    query (a sliding window of W tokens, as models configure it, is window=W - 1); both off by default, and a plan
    without them runs kernels that have neither. See the module docstring for an example and the contract.
    """
    return PagedAttentionPlan(batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              page_size=page_size, max_context=max_context, dtype=dtype, kv_dtype=kv_dtype,
                              num_queries=num_queries, device=device, return_lse=return_lse,
                              mean_context=mean_context, config=config, num_sms=num_sms, checks=checks,
                              split_constants=split_constants, softcap=softcap, window=window)


class PagedPrefillPlan(_PlanBase):
    """Chunked prefill over a paged KV cache: packed queries (cu_seqlens_q), each token attending causally to
    its sequence's whole context (the cached prefix and the new tokens); made by `plan_paged_prefill`.

    Run contract, beyond the module docstring's: q (T, Hq, D) for any T (the grid is sized from
    q.shape[0], a host integer; num_tokens only picks the config); cu_seqlens_q (B + 1,) int32 with
    cu_seqlens_q[0] = 0, non-decreasing, cu_seqlens_q[B] = T; sequence b's new tokens are its last
    q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] context positions, so q_len_b <= context_lens[b];
    their K and V must be in the pages when the kernel runs: pass k_new, v_new (T, Hkv, D) and
    slot_mapping (T,) int64 (PagedKVCache.reserve gives the slots) and the run writes them first.
    lse, when planned, is (T, Hq) float32.
    """

    def __init__(self, *, batch: int, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, max_context: int, dtype=torch.bfloat16, kv_dtype=None, device=None,
                 return_lse: bool = False, config: Config | dict | None = None, checks: bool | None = None,
                 softcap: float | None = None, window=None):
        self.softcap, self.window = model_features(softcap, window)
        self._init_shapes(batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          page_size=page_size, max_context=max_context, dtype=dtype, kv_dtype=kv_dtype,
                          device=device, return_lse=return_lse, checks=checks)
        _check_int("num_tokens", num_tokens)
        if num_tokens < 0:
            raise BadInputError(f"num_tokens counts the new tokens of all the sequences: it must be >= 0, got "
                                f"{num_tokens}")
        self.num_tokens = int(num_tokens)
        self.window = effective_paged_window(self.window, self.max_context)
        self.problem = self.launch = self.config = self.source = None
        self._calls = [0]  # runs, for AUTOTILE_RECORD (an empty step's are not recorded)
        if self.batch == 0:
            return
        self.problem = prefill_problem(self.batch, self.num_tokens, self.num_q_heads, self.num_kv_heads,
                                       self.head_dim, self.page_size, self.max_context, self.dtype_name,
                                       self.kv_dtype_name, self.softcap, self.window)
        info = _device_info(self.device)
        self._calls = trace.counter(FAMILY, self.problem, info)
        self._choice = None  # the generated kernel dispatch chose (autotile.runtime.fallback); None: a config given
        if config is not None:
            self.config, self.source = FAMILY.validate_config(self.problem, info, Config(config)), "given"
        else:
            resolution = _resolve(self.problem, info)
            self.config, self.source = self._config_for(resolution, info)
            self._choice = _choice(self.problem, info, resolution)
        if self.config["VARIANT"] != "prefill":
            raise BadInputError(f"{self.config.to_json()} is not a prefill config (VARIANT must be 'prefill')")
        self.launch = self._make_launch()
        self._launch_step = self._first_launch

    def _config_for(self, resolution, info: DeviceInfo) -> tuple[Config, str]:
        config = served_prefill_config(self.problem, info, resolution)
        return config, resolution.source if config is resolution.config else "default"

    def _make_launch(self) -> PagedLaunch:
        return PagedLaunch(self.problem, self.config, self.device, return_lse=self.return_lse)

    def _kernel_launch(self):
        return self.launch.prefill

    def run(self, q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, *, k_new=None, v_new=None,
            slot_mapping=None, scale=None, k_scale=None, v_scale=None, out=None, lse=None):
        """Writes k_new/v_new (when given) into their slots, then attends; returns out (T, Hq, D), or (out, lse)."""
        if torch.compiler.is_compiling():
            return _run_eagerly(PagedPrefillPlan.run, self, q, k_cache, v_cache, block_table, cu_seqlens_q,
                                context_lens, k_new=k_new, v_new=v_new, slot_mapping=slot_mapping, scale=scale,
                                k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
        scale = finite_scale(scale, self.head_dim)
        if not isinstance(q, torch.Tensor):
            require_tensors(q=q)
        if q.requires_grad:
            _warn_no_grad(q)
        if (q.dim() != 3 or tuple(q.shape[1:]) != (self.num_q_heads, self.head_dim) or q.dtype != self.dtype
                or q.device != self.device or q.stride(-1) != 1):
            raise ShapeMismatchError(f"q must be (T, {self.num_q_heads}, {self.head_dim}) {self.dtype} on "
                                     f"{self.device} with unit stride along D, got {_described(q)}"
                                     f"{_q_hint(q, None)}")
        tokens = q.shape[0]
        self._check_output("out", out, tuple(q.shape), self.dtype)
        self._check_output("lse", lse, (tokens, self.num_q_heads), torch.float32)
        if self.batch == 0 and tokens:
            raise ShapeMismatchError(f"q holds {tokens} tokens but the plan was made for batch=0 (no sequences); "
                                     "make the plan with the batch's sequences")
        if self.batch == 0 or tokens == 0:
            out = torch.empty(q.shape, dtype=self.dtype, device=self.device) if out is None else out
            if lse is None:
                lse = torch.empty((tokens, self.num_q_heads), dtype=torch.float32, device=self.device)
            return (out, lse) if self.return_lse else out
        try:
            self._check_common(k_cache, v_cache, block_table, context_lens, k_scale, v_scale)
            cu_ok = (tuple(cu_seqlens_q.shape) == (self.batch + 1,) and cu_seqlens_q.dtype == torch.int32
                     and cu_seqlens_q.stride(0) == 1 and cu_seqlens_q.device == self.device)
        except AttributeError:  # a list or an array where a tensor goes: name it
            require_tensors(k_cache=k_cache, v_cache=v_cache, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                            context_lens=context_lens, k_scale=k_scale, v_scale=v_scale)
            raise
        if not cu_ok:
            raise ShapeMismatchError(f"cu_seqlens_q must be ({self.batch + 1},) int32, contiguous, on {self.device}, "
                                     f"got {tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype} on {cu_seqlens_q.device} "
                                     f"with strides {cu_seqlens_q.stride()}{_fix_hint(cu_seqlens_q, self.device)}")
        check_new_tokens(k_new, v_new, slot_mapping, tokens)
        if self.checks:
            check_prefill_values(block_table, cu_seqlens_q, context_lens, k_cache.shape[0], self.page_size,
                                 self.max_context, tokens, slot_mapping)
        if k_new is not None:
            write_kv(k_cache, v_cache, slot_mapping, k_new, v_new, k_scale, v_scale)
        self._calls[0] += 1
        if self.source != "given" and is_fresh_uniform(q, k_new, v_new, k_cache, self.batch, self.max_context):
            return fresh_prefill(q, k_new, v_new, self.batch, scale, self.return_lse, out, lse, softcap=self.softcap,
                                 window=self.window)
        out = torch.empty(q.shape, dtype=self.dtype, device=self.device) if out is None else out
        if self.return_lse and lse is None:
            lse = torch.empty((tokens, self.num_q_heads), dtype=torch.float32, device=self.device)
        self._launch_step(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, out, scale=scale,
                          k_scale=k_scale, v_scale=v_scale, lse=lse)
        return (out, lse) if self.return_lse else out


def plan_paged_prefill(*, batch: int, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       page_size: int, max_context: int, dtype=torch.bfloat16, kv_dtype=None, device=None,
                       return_lse: bool = False, config=None, checks: bool | None = None, softcap: float | None = None,
                       window=None) -> PagedPrefillPlan:
    """A chunked-prefill plan from host integers: B sequences, `num_tokens` new tokens in all (it picks the
    tuned config; runs may pack any number), contexts up to `max_context`. `softcap` and `window` as for
    plan_paged_attention. See PagedPrefillPlan.

    >>> import torch
    >>> from autotile.kvcache import PagedKVCache
    >>> cache = PagedKVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=2, head_dim=64)
    >>> cache.allocate("a"); _ = cache.append("a", torch.randn(30, 2, 64), torch.randn(30, 2, 64))  # cached prefix
    >>> slots = cache.reserve("a", 5)  # five new tokens
    >>> plan = plan_paged_prefill(batch=1, num_tokens=5, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
    ...                           max_context=64, dtype=torch.float16, device="cpu")
    >>> q = torch.randn(5, 4, 64, dtype=torch.float16)
    >>> out = plan.run(q, cache.k_pools[0], cache.v_pools[0], cache.block_table(["a"]),
    ...                torch.tensor([0, 5], dtype=torch.int32), cache.context_lens(["a"]),
    ...                k_new=torch.randn(5, 2, 64).half(), v_new=torch.randn(5, 2, 64).half(), slot_mapping=slots)
    >>> out.shape
    torch.Size([5, 4, 64])
    """
    return PagedPrefillPlan(batch=batch, num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, page_size=page_size, max_context=max_context, dtype=dtype,
                            kv_dtype=kv_dtype, device=device, return_lse=return_lse, config=config, checks=checks,
                            softcap=softcap, window=window)


# --- writing new tokens --------------------------------------------------------------------------

FP8_MAX = 448.0  # e4m3's largest finite value: values are divided by the scale and clamped to it


def check_slots(slots: torch.Tensor, capacity: int, name: str) -> None:
    """Slot values (page * page_size + offset) within the cache's `capacity` slots, each once: reads them back (see
    checks_on). A negative slot would index from the end of the pool, into another sequence's page; a slot given
    twice leaves which write lands to chance."""
    if not slots.numel():
        return
    values = slots.cpu()
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= capacity:
        raise BadInputError(f"{name} holds {low if low < 0 else high}, outside the cache's {capacity} slots (0.."
                            f"{capacity - 1}): pass the slots reserve() gave; padding tokens take no slot (leave them "
                            "out, where vLLM's slot_mapping marks them -1)")
    if values.unique().numel() != values.numel():
        raise BadInputError(f"{name} names a slot more than once: each new token takes a slot of its own")


def check_new_tokens(k_new, v_new, slot_mapping, tokens: int) -> None:
    """Shapes only: k_new, v_new and slot_mapping come together, with one slot for each of the T new tokens."""
    require_tensors(k_new=k_new, v_new=v_new, slot_mapping=slot_mapping)
    if (k_new is None) != (v_new is None) or (k_new is None) != (slot_mapping is None):
        raise BadInputError("pass k_new, v_new and slot_mapping together (the new tokens' K, V and their slots), "
                            "or none of them when the pages already hold the new tokens")
    if slot_mapping is not None and tuple(slot_mapping.shape) != (tokens,):
        # Fewer slots than tokens would leave some new tokens' pages stale, and the kernel would attend to them.
        raise ShapeMismatchError(f"slot_mapping must be ({tokens},), one slot for each new token (row of q), "
                                 f"got {tuple(slot_mapping.shape)}; k_new and v_new hold the same {tokens} rows")


def write_kv(k_cache, v_cache, slot_mapping, k_new, v_new, k_scale=None, v_scale=None) -> None:
    """Store K and V (T, Hkv, D) at flat slots (page * page_size + offset), fp8 caches divided by their scales.

    Device work only (an index_put per cache): no synchronisation, so it can sit in a CUDA graph.
    """
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    want = (slot_mapping.shape[0], heads, dim)
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ShapeMismatchError(
            f"slot_mapping must be (T,) int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != want:
            raise ShapeMismatchError(f"{name} must be {want} (tokens, KV heads, head dim), got {tuple(t.shape)}")
    page_size = k_cache.shape[1]
    for cache, values, scale in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
        if scale is not None:
            values = (values.float() / scale[None, :, None]).clamp(-FP8_MAX, FP8_MAX)
        values = values.to(cache.dtype)
        if cache.is_contiguous():
            rows, values = cache.view(-1, heads * dim), values.reshape(-1, heads * dim)
            if (heads * dim * cache.element_size()) % 8 == 0:
                # NOTE: moved as 8-byte words: index_put gives each element its own thread and index
                # arithmetic, so 16-bit elements copied one by one run at a quarter of the speed.
                rows, values = rows.view(torch.int64), values.contiguous().view(torch.int64)
            rows[slot_mapping] = values
        else:
            cache[slot_mapping // page_size, slot_mapping % page_size] = values


# --- value checks (AUTOTILE_CHECKS=1, and the one-call op when it reads the lengths anyway) --------

def context_facts(block_table: torch.Tensor, context_lens: torch.Tensor, page_size: int) -> tuple[int, ...]:
    """(longest, shortest, shortest non-zero (0 if none), total, highest page, lowest page) over the pages
    within the contexts: one device-to-host read."""
    lens = context_lens.long()
    pages_in_use = (torch.arange(block_table.shape[1], device=block_table.device)[None, :]
                    < (lens[:, None] + page_size - 1) // page_size)
    used = torch.where(pages_in_use, block_table, 0)
    positive = torch.where(lens > 0, lens, torch.iinfo(torch.int64).max).min()
    stats = torch.stack([lens.max(), lens.min(), torch.where(lens.max() > 0, positive, 0), lens.sum(),
                         used.max().long(), used.min().long()])
    return tuple(int(x) for x in stats.tolist())


def check_context_facts(facts: tuple[int, ...], *, table_width: int, num_pages: int, page_size: int,
                        num_queries: int, max_context: int | None) -> None:
    longest, shortest, shortest_used, _, top_page, bottom_page = facts
    if shortest < 0:
        raise ShapeMismatchError(f"context_lens holds a negative length ({shortest}); 0 marks a padding row")
    if 0 < shortest_used < num_queries:
        raise ShapeMismatchError(
            f"every context must hold its {num_queries} query tokens (the queries are its last positions), "
            f"or be 0 for a padding row; the shortest context_lens entry is {shortest_used}")
    if longest > table_width * page_size:
        raise ShapeMismatchError(
            f"a context of {longest} tokens needs {cdiv(longest, page_size)} pages but block_table has "
            f"{table_width} columns of {page_size}-token pages; widen the table")
    if max_context is not None and longest > max_context:
        raise ShapeMismatchError(f"a context of {longest} tokens is longer than the planned max_context={max_context}; "
                                 "plan with a larger bound")
    if bottom_page < 0 or top_page >= num_pages:
        raise BadInputError(
            f"block_table points at page {top_page if top_page >= num_pages else bottom_page} within the "
            f"contexts, outside the cache's {num_pages} pages")


def check_decode_values(block_table, context_lens, num_pages: int, page_size: int, max_context: int | None,
                        num_queries: int) -> tuple[int, ...]:
    """Reads the lengths and page ids back (one sync) and raises on anything that breaks the run's contract."""
    facts = context_facts(block_table, context_lens, page_size)
    check_context_facts(facts, table_width=block_table.shape[1], num_pages=num_pages, page_size=page_size,
                        num_queries=num_queries, max_context=max_context)
    return facts


def check_prefill_values(block_table, cu_seqlens_q, context_lens, num_pages: int, page_size: int,
                         max_context: int | None, tokens: int, slot_mapping=None) -> tuple[int, ...]:
    """As check_decode_values, and cu_seqlens_q and the slots of the new tokens too; returns the context facts."""
    facts = context_facts(block_table, context_lens, page_size)
    check_context_facts(facts, table_width=block_table.shape[1], num_pages=num_pages, page_size=page_size,
                        num_queries=1, max_context=max_context)
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    if starts[0] != 0 or starts[-1] != tokens or any(b < a for a, b in zip(starts, starts[1:])):
        raise ShapeMismatchError(f"cu_seqlens_q must start at 0, never decrease and end at T={tokens}, got {starts}")
    for b, (a, e) in enumerate(zip(starts, starts[1:])):
        if e - a > lengths[b]:
            raise ShapeMismatchError(f"sequence {b} has {e - a} new tokens but a context of {lengths[b]}: the context "
                                     "counts the new tokens too")
    if slot_mapping is not None and slot_mapping.numel():
        check_slots(slot_mapping, num_pages * page_size, "slot_mapping")
        check_slots_follow_the_table(slot_mapping, block_table, starts, lengths, page_size)
    return facts


def check_slots_follow_the_table(slot_mapping, block_table, starts: list[int], lengths: list[int],
                                 page_size: int) -> None:
    """Each new token's slot is the one its position (the context's last tokens are the new ones) maps to through
    its sequence's block_table row: K and V written anywhere else would leave that position's page stale, which the
    kernel reads."""
    counts = torch.tensor([e - a for a, e in zip(starts, starts[1:])])
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    first = torch.tensor(lengths)[seq] - counts[seq]
    position = first + torch.arange(seq.numel()) - torch.tensor(starts[:-1])[seq]
    want = block_table.cpu().long()[seq, position // page_size] * page_size + position % page_size
    got = slot_mapping.cpu().long()
    wrong = (got != want).nonzero().flatten()
    if wrong.numel():
        t = int(wrong[0])
        raise BadInputError(
            f"slot_mapping[{t}] is {int(got[t])}, but that new token (sequence {int(seq[t])}, position "
            f"{int(position[t])}) belongs in slot {int(want[t])} of its block_table row: pass the slots "
            "PagedKVCache.reserve gave, or work them out from the same table; and count the new tokens in "
            "context_lens (take them after reserve), since the new tokens are the context's last")


# --- merging partial results -------------------------------------------------------------------

def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the results over each: (out, lse).

    out_* (..., D) and lse_* (...) natural-log log-sum-exps, as return_lse runs give them (a shared
    prefix attended once and each sequence's own suffix, as cascade attention splits them). Rows
    that saw no key contribute nothing: their lse is -inf from the paged ops and +inf from
    flash_attention (FlashAttention's convention; vLLM's merge_attn_states takes +inf so too).
    Plain torch, computed in float32.

    >>> import torch
    >>> o, l = merge_attention_states(torch.ones(2, 4), torch.zeros(2), torch.zeros(2, 4), torch.zeros(2))
    >>> o[0].tolist(), round(float(l[0]), 4)
    ([0.5, 0.5, 0.5, 0.5], 0.6931)
    """
    _check_merge_shapes(out_a, lse_a, out_b, lse_b)
    lse_a, lse_b = (torch.where(t == math.inf, -math.inf, t.float()) for t in (lse_a, lse_b))  # no key: -inf
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    weight_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))
    weight_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))
    out = out_a.float() * weight_a[..., None] + out_b.float() * weight_b[..., None]
    return out.to(out_a.dtype), lse


def _check_merge_shapes(out_a, lse_a, out_b, lse_b) -> None:
    # Broadcasting would otherwise pair rows of one result with other rows' LSEs and give wrong numbers silently.
    if out_a.shape != out_b.shape:
        raise ShapeMismatchError(f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} must have one shape")
    rows = tuple(out_a.shape[:-1])
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != rows:
            raise ShapeMismatchError(
                f"{name} must be {rows}, one value per row of out (its shape without D), got {tuple(lse.shape)}; "
                "flash_attention_varlen's lse is (Hq, total_q): pass lse.transpose(0, 1)")
