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

Modules: flash_space.py (axes, constraints, seeds, the untuned defaults), flash_launch.py (launch plans),
flash_reference.py (plain-torch references and the FA rule), flash_vendor.py (SDPA's backends).
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from autotile.device import DeviceInfo
from autotile.dtypes import element_size, torch_dtype
from autotile.errors import BadInputError, ShapeMismatchError, UnsupportedDtypeError
from autotile.families import flash_space, flash_vendor
from autotile.families.base import (VENDOR_KEY, Baseline, CheckResult, Cost, Family, ProblemOption, Tensors,
                                    Tolerance, host_int, is_vendor, next_pow2)
from autotile.families.checks import compare
from autotile.families.flash_launch import GLUON_WS, backward_plan, forward_plan, gluon_backward_plan
from autotile.families.flash_reference import (LOG2E, Scores, attention_grads, attention_math,  # noqa: F401 - re-exported
                                               causal_seen, default_scale, fa_rule_check, join_packed, log2_sum_exp,
                                               map_head_chunks, per_batch_slopes, plain_fp8_forward, seen_pairs,
                                               split_packed)
from autotile.families.flash_space import (_backward_render_loads, _forward_upgrade, gluon_bwd_smem,  # noqa: F401 - re-exported
                                           gluon_head_groups, gluon_head_split, gluon_o_buffer, gluon_q_slots,
                                           gluon_split_kv, uses_tma)
from autotile.layouts import base_aligned, matching_strides
from autotile.render import load_kernel_module
from autotile.space import Config, Space

DIRECTIONS = ("fwd", "bwd")
DTYPES = ("fp32", "fp16", "bf16", "fp8")  # fp8 (e4m3 with per-tensor descales): forward only
MAX_HEAD_DIM = 256
# Problem fields added after the first shipped winners, with the values that mean "off" (the family's
# later_fields): they are left out of the problem key and bucket at these values, so keys and buckets stored before
# they existed still match.
FEATURE_DEFAULTS = {"window_left": -1, "window_right": -1, "softcap": 0.0, "alibi": False, "varlen": False}


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



def _v_hint(k, v) -> str:
    """Why k and v differ where only the last dim does: a value head dim of its own (SDPA takes one) is not served."""
    if k.dim() == v.dim() and k.shape[:-1] == v.shape[:-1]:
        return (": a value head dim other than the key's is not served (nor by FlashAttention-2); call "
                "torch.nn.functional.scaled_dot_product_attention, or pad v to the key's head dim")
    return ""


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
    later_fields = FEATURE_DEFAULTS

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
        ProblemOption("window", int, "sliding window: keys a query sees left of itself, a model's window of W tokens "
                      "is W - 1 (-1: none; dropped where it masks nothing at the lengths, as the op drops it)",
                      default=-1),
        ProblemOption("softcap", float, "logit soft-capping, softcap * tanh(x / softcap) (Gemma-2: 50; 0: none)",
                      default=0.0),
        ProblemOption("alibi", bool, "ALiBi's per-head linear biases (MPT, BLOOM; tuned with the ALiBi paper's "
                      "slopes, served for any)", default=False),
    )

    # --- problems -----------------------------------------------------------------
    def check_tensors(self, q, k, v, *, causal: bool = False, direction: str = "fwd", window: tuple = (-1, -1),
                      softcap: float = 0.0, alibi_slopes=None, empty_ok: bool = False) -> FlashProblem:
        """Shapes, dtypes and devices of q, k, v, without reading their data (so fake tensors pass too).

        Returns the problem as if aligned; `problem_from_tensors` looks at the pointers. `empty_ok`: a batch, query
        or key length of 0 passes (the problem then counts it as 1), for calls that launch nothing.
        """
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ShapeMismatchError(
                    f"{name} must be (batch, heads, seq, head_dim) as in SDPA, got shape {tuple(t.shape)}; as in SDPA, "
                    f"q, k and v may instead share the same other leading dims (or none before heads)")
        if k.shape != v.shape:
            raise ShapeMismatchError(
                f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape{_v_hint(k, v)}")
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
            raise ShapeMismatchError(
                f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape{_v_hint(k, v)}")
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
        max_seqlen_q, max_seqlen_k = (max_seqlen(value, name) for name, value in (
            ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)))
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
        window, softcap, alibi = options.get("window"), options.get("softcap"), bool(options.get("alibi"))
        window = -1 if window is None else window
        softcap = softcap or 0.0
        if window < -1 or not 0.0 <= softcap < float("inf"):
            raise BadInputError(f"--window must be -1 (none) or a key count >= 0, and --softcap a number >= 0 (0: "
                                f"none); got {window} and {softcap}")
        shape_given = seqs or head_dims or any(options.get(n) for n in scalars)
        directions = DIRECTIONS if options.get("direction", "both") == "both" else (options["direction"],)
        causals = {"yes": (True,), "no": (False,), "both": (False, True)}[options.get("causal") or "both"]
        dtype = options.get("dtype") or "bf16"
        if dtype == "fp8" and directions == ("bwd",):
            raise UnsupportedDtypeError("the fp8 path is forward only: give --direction fwd with --dtype fp8, or "
                                        "tune the backward in bf16 or fp16")
        if not shape_given:
            if window >= 0 or softcap or alibi:
                raise BadInputError("--window, --softcap and --alibi describe a model's calls: give their shapes too "
                                    "(--seq, --heads, --head-dim), or use --model")
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
                        seq_k = options.get("seq_k") or seq
                        left, _ = effective_window((window, -1), seq, seq_k, causal)
                        problems.append(FlashProblem(direction, batch, heads, heads_kv, seq, seq_k, head_dim, causal,
                                                     dtype, window_left=left, softcap=softcap, alibi=alibi))
        return problems

    # --- the search (flash_space.py) ----------------------------------------------
    def interpreter_refusal(self, problem: FlashProblem) -> str | None:
        # NOTE: as the runtime refuses it (ops_flash): Triton 3.6's interpreter rounds fp32 -> e4m3 wrongly, so
        # every candidate would fail its check or be timed on wrong numbers.
        if problem.dtype == "fp8":
            return ("fp8 flash attention runs on CUDA GPUs only (the CPU interpreter rounds to e4m3 wrongly): tune it "
                    "with --gpu h100 or h200 on such a GPU, or tune bf16 here")
        return None

    def space(self, problem: FlashProblem, device: DeviceInfo) -> Space:
        return flash_space.space(problem, device)

    def seed_configs(self, problem: FlashProblem, device: DeviceInfo) -> list[Config]:
        """Hopper configs of Triton's fused-attention tutorial, tried right after the default."""
        return flash_space.seed_configs(self, problem, device)

    def default_config(self, problem: FlashProblem, device: DeviceInfo) -> Config:
        return flash_space.default_config(self, problem, device)

    def triton_backward_default(self, problem: FlashProblem, device: DeviceInfo) -> Config:
        """The untuned backward among the Triton ones (flash_attention.py.j2), which are deterministic: the runtime's
        under torch.use_deterministic_algorithms(True) where the served config is the Gluon backward."""
        return flash_space.triton_backward_default(self, problem, device)

    @staticmethod
    def _forward_default(p: FlashProblem, device: DeviceInfo) -> dict:
        """The forward's untuned config (flash_space.forward_default)."""
        return flash_space.forward_default(p, device)

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
        if flash_vendor.backward_takes_given_lse(backend, q.device):
            return super().timed_call(problem, config, inputs, outputs)  # its ATen backward, on O and LSE
        # The backward alone, as the generated backward (given O and LSE) is timed: the forward runs once here
        # and keeps its graph. NOTE: flash_vendor.backward of the other backends goes through autograd and runs the
        # forward on every call (cuDNN's backward of 2 x 32 x 4096 x 128 causal timed 2.01 ms that way, 1.54 ms
        # alone).
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            out, _ = flash_vendor.forward(backend, *leaves, causal=causal, scale=scale, need_lse=False)
        grad_out = inputs["do"]
        return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)

    # --- data -----------------------------------------------------------------------
    def make_inputs(self, problem: FlashProblem, device: DeviceInfo, seed: int = 0) -> Tensors:
        return self._inputs(problem, device, seed, forward_values=True)

    def make_layout_inputs(self, problem: FlashProblem, device: DeviceInfo, seed: int = 0) -> Tensors:
        # The backward's O and LSE without the attention that computes them: at 8192 tokens and 32 heads that takes
        # about a minute of CPU, where the compile it is made for takes seconds.
        return self._inputs(problem, device, seed, forward_values=False)

    def _inputs(self, problem: FlashProblem, device: DeviceInfo, seed: int, forward_values: bool) -> Tensors:
        """make_inputs; without `forward_values`, the backward's O and LSE are of the right layout only."""
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
            if forward_values:
                with torch.no_grad():
                    o, lse = self._attend(p, inputs, inputs["q"], inputs["k"], inputs["v"], dtype=torch.float32,
                                          lse=True)
            else:
                stats = (p.heads_q, shapes["q"][0]) if p.varlen else shapes["q"][:3]
                o, lse = raw["q"], torch.zeros(stats)
            inputs["o"] = tensor(shapes["q"], o, dtype)
            inputs["lse"] = lse.float().contiguous()
            inputs["do"] = tensor(shapes["q"], torch.randn(shapes["q"], generator=gen), dtype)
        return inputs

    def allocate_outputs(self, problem: FlashProblem, inputs: Tensors) -> Tensors:
        # Dense outputs are laid out like their inputs, as SDPA's backends and the ops' fake implementations lay them
        # out (autotile.layouts); packed ones are contiguous.
        q = inputs["q"]

        def like(t, dtype):
            if problem.varlen:
                return torch.empty(t.shape, dtype=dtype, device=q.device)
            return torch.empty_strided(t.shape, matching_strides(t), dtype=dtype, device=q.device)
        if problem.direction == "fwd":
            stats = (q.shape[1], q.shape[0]) if problem.varlen else q.shape[:3]
            return {"o": like(q, torch_dtype(problem.out_dtype)),
                    "lse": torch.empty(stats, dtype=torch.float32, device=q.device)}
        return {name: like(inputs[src], inputs[src].dtype) for name, src in (("dq", "q"), ("dk", "k"), ("dv", "v"))}

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
            RIGHT_WINDOW=not p.causal and p.window_right >= 0,  # (the Gluon backward's: its right bound an argument)
            ALIBI=p.alibi, VARLEN=p.varlen, HEAD_PADDED=p.block_d != p.head_dim, FP8=p.dtype == "fp8",
            LOADS=(config["LOADS"].removesuffix("_lookahead") if p.direction == "fwd"
                   else _backward_render_loads(config)),
            LOOKAHEAD=p.direction == "fwd" and config["LOADS"].endswith("_lookahead"),
            MASKS_IN_LOOP=forward.get("MASKS_IN_LOOP", False),
            INPUT_PRECISION="ieee" if p.dtype == "fp32" else "", UPCAST_DOTS=False, STORE_LSE=True,
            Q_SLOTS=gluon_q_slots(p, config) if config["LOADS"] == GLUON_WS and p.direction == "fwd" else 1,
            TILE_QUEUE=forward.get("TILE_QUEUE", False),
            SPLIT_KV=gluon_split_kv(p, config),
            HEAD_SPLIT=gluon_head_split(p, config),
            HEAD_GROUPS=gluon_head_groups(p, config),
            O_BUFFER=gluon_o_buffer(p, config),
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
                                       outputs["dv"], keep and not interpret, alibi)
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
    left, right = host_int(left), host_int(right)
    if left is None or right is None or min(left, right) < -1:
        raise BadInputError(f"window must be a pair (left, right) of ints >= -1 (-1: no limit), got {window!r}")
    return left, right


def effective_window(window: tuple[int, int], seq_q: int, seq_k: int, causal: bool) -> tuple[int, int]:
    """`window` with each side that masks nothing at these lengths set to -1 (no limit).

    With queries aligned to the end of the keys (query i's diagonal is key i + seq_k - seq_q), a left side of at
    least seq_k - 1 keys and a right side of at least seq_q - 1 leave every key in view, and a causal call's right
    side adds nothing to its mask. Such calls (a model's 4k sliding window over a 2k prompt) are then plain calls:
    the vendor op and plain winners may serve them. For packed sequences pass the longest lengths: each
    sequence's own are no longer.

    >>> effective_window((4095, 0), 2048, 2048, True), effective_window((100, 0), 2048, 2048, True)
    ((-1, -1), (100, -1))
    >>> effective_window((4095, 2047), 2048, 2048, False), effective_window((4095, 10), 2048, 2048, False)
    ((-1, -1), (-1, 10))
    """
    left, right = window
    return (-1 if left >= seq_k - 1 else left), (-1 if causal or right >= seq_q - 1 else right)


def max_seqlen(value, name: str) -> int:
    """A varlen call's longest sequence as an int: any host integer >= 1, never a tensor (reading it would sync)."""
    length = host_int(value)
    if length is None or length < 1:
        raise BadInputError(f"{name} must be a host int >= 1 (the longest sequence), got {value!r}: pass a Python int, "
                            f"as FlashAttention's varlen API takes")
    return length


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
    return base_aligned(t) and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:dims])


FAMILY = FlashFamily()
