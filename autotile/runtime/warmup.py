"""Warm-up: call the ops once for every shape a model will run, before the first request does.

A generated kernel compiles on the first call of its specialisation: a second or more for each Triton kernel and up
to ~17 s for a Gluon one (sm90 builds on one CPU core), a stall that a serving engine would otherwise meet on its
first request of each shape. `warmup` makes those calls up front on random tensors of the model's shapes, twice
each, so that every kernel the ops serve compiles (into Triton's on-disk cache, which later processes read too) and
every launch plan is made; vendor calls load their libraries. It reports what served each call, the first call's
time (compile included) and the second's (what later calls cost).

The shapes come from the model table (autotile.models): each projection in nn.Linear layout at each token count,
through `autotile.linear`, and, given prefill shapes, causal prefill attention through `autotile.flash_attention`
(with the model's soft-capping, and its sliding window where a prompt is longer), forward and, with `backward`,
backward. Attention tensors are laid out as Hugging Face models make them: (B, S, H, D) projections seen as
(B, H, S, D) (`layout="bshd"`), or contiguous (B, H, S, D) (`layout="bhsd"`).

Integer arguments that Triton specialises (a size equal to 1, or a multiple of 16) compile their own kernels: warm the
token counts the engine will run (its CUDA-graph batch sizes, its prefill chunk), not only one per bucket.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable

import torch

from autotile.errors import BadInputError


@dataclasses.dataclass(frozen=True)
class WarmCall:
    """One warmed call: the op, its shape, what served it (explain's source and config), and the wall time of its
    first and second calls, in seconds."""

    op: str
    shape: str
    served: str
    first_s: float
    again_s: float


def parse_prefill(text: str | Iterable | None) -> tuple[tuple[int, int], ...]:
    """'1x4096,4x2048' (or pairs) -> ((1, 4096), (4, 2048)): prefill calls as batch x tokens.

    >>> parse_prefill("1x4096, 4x2048"), parse_prefill(None)
    (((1, 4096), (4, 2048)), ())
    """
    if text is None:
        return ()
    if not isinstance(text, (str, Iterable)):
        raise BadInputError(f"prefill takes 'BATCHxTOKENS,...' (e.g. '1x4096,4x2048') or (batch, tokens) pairs, "
                            f"got {text!r}")
    parts = [p.strip() for p in text.split(",") if p.strip()] if isinstance(text, str) else list(text)
    shapes = []
    for part in parts:
        try:
            batch, seq = (int(x) for x in part.lower().split("x")) if isinstance(part, str) else map(int, part)
        except (ValueError, TypeError):
            raise BadInputError(f"--prefill: {part!r} is not BATCHxTOKENS (e.g. 1x4096)") from None
        if batch < 1 or seq < 1:
            raise BadInputError(f"--prefill: {part!r} needs a batch and a token count of at least 1")
        shapes.append((batch, seq))
    return tuple(dict.fromkeys(shapes))


_NO_CUDA = ("warm-up compiles the kernels the ops serve on this machine's GPU, and there is no CUDA device here (on "
            "the CPU the ops run Triton's interpreter, which compiles nothing); run it where the model will be served")


def _device(device) -> torch.device:
    if device is None:
        if not torch.cuda.is_available():
            raise BadInputError(_NO_CUDA)
        return torch.device("cuda")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise BadInputError(f"device={device!r} is not a device: pass 'cuda', 'cuda:N' or 'cpu'") from None
    if target.type not in ("cuda", "cpu"):
        raise BadInputError(f"warm-up runs the ops on a CUDA device (or the CPU's interpreter), got device={device!r}")
    if target.type == "cuda" and not torch.cuda.is_available():
        raise BadInputError(_NO_CUDA)
    return target


def _tokens(tokens) -> tuple[int, ...]:
    """`tokens` as warmup takes them: None (every M bucket), "1,16,128", one int, or ints."""
    from autotile.models import parse_tokens

    if tokens is None or isinstance(tokens, str):
        return parse_tokens(tokens)
    values = [tokens] if isinstance(tokens, int) else list(tokens)
    if not values:
        raise BadInputError("tokens is empty: give the token counts to warm (e.g. [1, 16, 128]), or None for every "
                            "M bucket")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in values):
        raise BadInputError(f"tokens must be whole token counts, got {values!r}")
    return parse_tokens(",".join(map(str, values)))


def _timed(call: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _served(info: dict) -> str:
    """explain()'s answer in a few words: 'cuBLAS (vendor)', 'gluon_ws 128x256 (shipped-db, range)'..."""
    if info["vendor"]:
        return f"{info['vendor']} ({info['source']})"
    config = info["config"]
    tile = "x".join(str(config[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in config)
    kind = config.get("VARIANT") or config.get("LOADS") or ""
    match = f", {info['match']}" if info.get("match") not in (None, "", "default") else ""
    return f"{kind} {tile}".strip() + f" ({info['source']}{match})"


def _linear_calls(model, tokens, dtype: torch.dtype, device: torch.device):
    """(op, shape, call, explain) for each projection and token count, the weight made once a projection."""
    import autotile
    from autotile.models import projections

    gen = torch.Generator(device=device).manual_seed(0)
    for proj in projections(model):
        weight = torch.randn(proj.n, proj.k, device=device, dtype=dtype, generator=gen) * proj.k ** -0.5
        bias = torch.randn(proj.n, device=device, dtype=dtype, generator=gen) if proj.bias else None
        for m in tokens:
            x = torch.randn(m, proj.k, device=device, dtype=dtype, generator=gen)
            yield ("linear", f"{proj.name} {m} x {proj.n} x {proj.k}" + (" +bias" if proj.bias else ""),
                   lambda x=x, weight=weight, bias=bias: autotile.linear(x, weight, bias),
                   lambda x=x, weight=weight, bias=bias: autotile.explain("linear", x, weight, bias))


def _attention_tensors(problem, dtype: torch.dtype, device: torch.device, layout: str, grad: bool, gen):
    p = problem
    shapes = ((p.heads_q, p.seq_q), (p.heads_kv, p.seq_k), (p.heads_kv, p.seq_k))
    made = []
    for heads, seq in shapes:
        if layout == "bshd":
            t = torch.randn(p.batch, seq, heads, p.head_dim, device=device, dtype=dtype, generator=gen).transpose(1, 2)
        else:
            t = torch.randn(p.batch, heads, seq, p.head_dim, device=device, dtype=dtype, generator=gen)
        made.append(t.requires_grad_(grad))
    return made


def _flash_calls(model, prefill, dtype_name: str, dtype: torch.dtype, device: torch.device, layout: str,
                 backward: bool):
    import autotile
    from autotile.models import flash_problems

    gen = torch.Generator(device=device).manual_seed(1)
    for batch, seq in prefill:
        for p in flash_problems(model, (seq,), dtype_name, batch, shortest=1):
            features = {"softcap": p.softcap} if p.softcap > 0 else {}
            if p.window_left >= 0:
                features["window"] = (p.window_left, 0)
            q, k, v = _attention_tensors(p, dtype, device, layout, backward, gen)
            label = (f"{batch} x {seq}, {p.heads_q}/{p.heads_kv} heads of {p.head_dim}"
                     + (f", window {p.window_left}" if p.window_left >= 0 else "")
                     + (f", softcap {p.softcap:g}" if p.softcap > 0 else ""))

            def forward(q=q, k=k, v=v, features=features):
                return autotile.flash_attention(q, k, v, causal=True, **features)

            def explain(q=q, k=k, v=v, features=features):
                return autotile.explain("flash_attention", q, k, v, causal=True, **features)

            yield "flash_attention", label, forward, explain
            if backward:
                do = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)

                def step(forward=forward, do=do, q=q, k=k, v=v):
                    forward().backward(do)
                    q.grad = k.grad = v.grad = None

                def forward_explained(explain=explain):
                    info = explain()
                    return {**info, "source": f"forward: {info['source']}"}

                yield "flash_attention training step", label, step, forward_explained


def warmup(model: str | None = None, *, dims: str | None = None, tokens: Iterable[int] | str | None = None,
           prefill: Iterable | str | None = None, dtype: str = "bf16", layout: str = "bshd",
           backward: bool = False, device=None, report: Callable[[WarmCall], None] | None = None) -> list[WarmCall]:
    """Call autotile.linear (each projection of `model` at each of `tokens`, default every M bucket 1..8192) and,
    for each of `prefill` (BATCHxTOKENS, e.g. "1x4096,4x2048"), autotile.flash_attention as the model calls it, twice
    each; `backward`: a training step of each attention call too. `model` names a model of autotile.models (or
    `dims` describes one: "hidden=...,intermediate=...,heads=...,kv_heads=..."). `report` sees each call as it is
    warmed. Returns one WarmCall a call.

    `device`: the CUDA device to warm (default: the current one). Warming on the CPU runs the interpreter, which
    compiles nothing: it only checks the calls."""
    from autotile.models import model_dims

    if model is not None and dims:
        raise BadInputError(f"warm-up takes a model name or its dims, not both: model={model!r}, dims={dims!r}")
    if report is not None and not callable(report):
        raise BadInputError(f"report must be a function called with each WarmCall, got {type(report).__name__}")
    if dtype not in ("bf16", "fp16"):
        raise BadInputError(f"warm-up runs models in bf16 or fp16, got dtype={dtype!r}")
    if layout not in ("bshd", "bhsd"):
        raise BadInputError(f"layout must be 'bshd' ((B, S, H, D) projections seen as (B, H, S, D)) or 'bhsd', "
                            f"got {layout!r}")
    spec = model_dims(model, dims)
    tokens = _tokens(tokens)
    prefill = parse_prefill(prefill)
    target = _device(device)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    # Made one call at a time (the calls hold their tensors): a 70B model's every shape at once would not fit.
    calls = itertools.chain(_linear_calls(spec, tokens, torch_dtype, target),
                            _flash_calls(spec, prefill, dtype, torch_dtype, target, layout, backward))
    warmed = []
    for op, shape, call, explain in calls:
        first = _timed(call, target)
        again = _timed(call, target)
        entry = WarmCall(op, shape, _served(explain()), first, again)
        warmed.append(entry)
        if report is not None:
            report(entry)
    return warmed


__all__ = ["WarmCall", "parse_prefill", "warmup"]
