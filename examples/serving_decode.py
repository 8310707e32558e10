"""A Llama-shaped decoder served with continuous batching over a PagedKVCache, decode steps in CUDA graphs.

Random weights, real serving mechanics: requests arrive over time, their prompts are prefilled
(chunked prefill over the paged cache), running sequences decode one token a step, some fork
(parallel sampling: the child shares the parent's pages, copy-on-write) and finish (their pages go
back to the pool). Each decode step runs the whole model for a batch padded to the next captured
size (1, 2, 4, ..., as vLLM pads), replaying one CUDA graph per padded size; padding rows have
context length 0. Attention is `autotile` (a PagedAttentionPlan per padded size, made once before
capture) or `sdpa` (gather the pages, then scaled_dot_product_attention), the same loop otherwise.

    python examples/serving_decode.py                      # GPU: 8 layers, hidden 4096, 32/8 heads, both backends
    python examples/serving_decode.py --tiny --steps 6     # CPU (Triton's interpreter): a tiny model, seconds

benchmarks/serving_bench.py times the two backends side by side; tests/test_paged_serving_example.py runs
the tiny model on CPU and checks both backends give the same logits.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import autotile
from autotile.kvcache import PagedKVCache
from autotile.runtime.paged_plan import write_kv

PADDED_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 8
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 32000
    page_size: int = 16
    max_context: int = 2048  # the longest sequence the engine admits (prompt + generated tokens)
    dtype: torch.dtype = torch.bfloat16


TINY = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=97, page_size=8,
                   max_context=64, dtype=torch.float16)


class Decoder:
    """Pre-norm decoder layers (RMSNorm, RoPE attention with GQA, SwiGLU MLP); random weights scaled by
    1/sqrt(fan-in)."""

    def __init__(self, config: ModelConfig, device, seed: int = 0):
        self.config, self.device = config, torch.device(device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        c = config

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen, device=self.device) / math.sqrt(rows)).to(c.dtype)

        self.embed = torch.randn(c.vocab, c.hidden, generator=gen, device=self.device).to(c.dtype)
        qkv = (c.heads + 2 * c.kv_heads) * c.head_dim
        self.layers = [dict(qkv=weight(c.hidden, qkv), o=weight(c.heads * c.head_dim, c.hidden),
                            gate=weight(c.hidden, c.intermediate), up=weight(c.hidden, c.intermediate),
                            down=weight(c.intermediate, c.hidden)) for _ in range(c.layers)]
        self.lm_head = weight(c.hidden, c.vocab)
        # RoPE tables (max_context, head_dim / 2), indexed by position on the device (graph-safe).
        inv = 1.0 / (10000.0 ** (torch.arange(0, c.head_dim, 2, device=self.device).float() / c.head_dim))
        angles = torch.arange(c.max_context, device=self.device).float()[:, None] * inv[None, :]
        self.cos, self.sin = angles.cos(), angles.sin()

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (T, H, D) rotated by each token's position (T,)."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Hidden states of T tokens (T,) at positions (T,); attend(layer, q, k, v) -> (T, Hq, D) does the rest."""
        c = self.config
        x = self.embed[tokens]
        for index, w in enumerate(self.layers):
            h = F.rms_norm(x, (c.hidden,))
            q, k, v = (h @ w["qkv"]).split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
            q = self.rope(q.reshape(-1, c.heads, c.head_dim), positions)
            k = self.rope(k.reshape(-1, c.kv_heads, c.head_dim), positions)
            attended = attend(index, q, k, v.reshape(-1, c.kv_heads, c.head_dim))
            x = x + attended.reshape(-1, c.heads * c.head_dim) @ w["o"]
            h = F.rms_norm(x, (c.hidden,))
            x = x + (F.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
        return F.rms_norm(x, (c.hidden,)) @ self.lm_head


@dataclass
class Buffers:
    """The fixed tensors one padded batch size's graph reads and writes."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    logits: torch.Tensor | None = None
    graph: object = None
    plan: object = None


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)


@dataclass
class Stats:
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    forks: int = 0
    finished: int = 0
    logits: list = field(default_factory=list)  # (sequence ids, logits) of each decode step when recording

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Engine:
    """Continuous batching over one PagedKVCache; `backend` is 'autotile' or 'sdpa'."""

    def __init__(self, model: Decoder, *, num_pages: int, backend: str = "autotile", max_batch: int = 64,
                 use_graphs: bool | None = None, record_logits: bool = False):
        c, self.model, self.backend = model.config, model, backend
        if backend not in ("autotile", "sdpa"):
            raise ValueError(f"backend must be 'autotile' or 'sdpa', got {backend!r}")
        self.cache = PagedKVCache(num_layers=c.layers, num_pages=num_pages, page_size=c.page_size,
                                  num_kv_heads=c.kv_heads, head_dim=c.head_dim, dtype=c.dtype, device=model.device)
        # Padding rows write their K/V into a page no sequence owns.
        self.cache.allocate("<padding>")
        self.pad_slot = int(self.cache.reserve("<padding>", 1)[0])
        self.max_pages = -(-c.max_context // c.page_size)
        self.sizes = [s for s in PADDED_SIZES if s <= max_batch] or [1]
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        self.requests: dict[object, Request] = {}
        self.stats = Stats()
        self.record_logits = record_logits
        self._buffers: dict[int, Buffers] = {}
        self._next_id = 0

    # --- attention ----------------------------------------------------------------------------
    def _decode_attention(self, buffers: Buffers):
        c, cache = self.model.config, self.cache

        def attend(layer, q, k, v):
            write_kv(cache.k_pools[layer], cache.v_pools[layer], buffers.slots, k, v)
            if self.backend == "autotile":
                return buffers.plan.run(q, cache.k_pools[layer], cache.v_pools[layer], buffers.block_table,
                                        buffers.context_lens)
            # gather + SDPA: the pages of the whole (fixed-width) table, masked past each length.
            span = self.max_pages * c.page_size
            dense_k = cache.k_pools[layer][buffers.block_table].flatten(1, 2).transpose(1, 2)  # (B, Hkv, span, D)
            dense_v = cache.v_pools[layer][buffers.block_table].flatten(1, 2).transpose(1, 2)
            mask = (torch.arange(span, device=q.device)[None, :] < buffers.context_lens[:, None])[:, None, None, :]
            out = F.scaled_dot_product_attention(q[:, :, None, :], dense_k, dense_v, attn_mask=mask, enable_gqa=True)
            return out[:, :, 0, :]  # padding rows (all masked) give NaN here; their logits are never read
        return attend

    def _prefill_attention(self, slots, block_table, cu_seqlens, context_lens, lengths):
        cache = self.cache

        def attend(layer, q, k, v):
            k_pool, v_pool = cache.k_pools[layer], cache.v_pools[layer]
            if self.backend == "autotile":
                return autotile.paged_prefill(q, k_pool, v_pool, block_table, cu_seqlens, context_lens, k_new=k,
                                              v_new=v, slot_mapping=slots, max_context=self.model.config.max_context)
            write_kv(k_pool, v_pool, slots, k, v)
            outs, start = [], 0
            for row, n in enumerate(lengths):  # fresh prompts: causal attention over the sequence's own tokens
                pages = block_table[row, :-(-n // cache.page_size)].long()
                dense_k = k_pool[pages].flatten(0, 1)[:n].transpose(0, 1)[None]  # (1, Hkv, n, D)
                dense_v = v_pool[pages].flatten(0, 1)[:n].transpose(0, 1)[None]
                qs = q[start:start + n].transpose(0, 1)[None]
                outs.append(F.scaled_dot_product_attention(qs, dense_k, dense_v, is_causal=True,
                                                           enable_gqa=True)[0].transpose(0, 1))
                start += n
            return torch.cat(outs)
        return attend

    # --- steps ------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], max_new_tokens: int) -> object:
        seq_id = self._next_id
        self._next_id += 1
        self.requests[seq_id] = Request(list(prompt), max_new_tokens)
        self.cache.allocate(seq_id)
        return seq_id

    def prefill(self, seq_ids: list, sample) -> None:
        """Prompts of the new sequences, packed into one forward; samples each one's first token."""
        if not seq_ids:
            return
        start = time.perf_counter()
        prompts = [self.requests[s].prompt for s in seq_ids]
        lengths = [len(p) for p in prompts]
        slots = torch.cat([self.cache.reserve(s, n) for s, n in zip(seq_ids, lengths)])
        device = self.model.device
        tokens = torch.tensor([t for p in prompts for t in p], device=device)
        positions = torch.tensor([i for n in lengths for i in range(n)], device=device)
        cu_seqlens = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32,
                                  device=device)
        table = self.cache.block_table(seq_ids, max_pages=self.max_pages)
        attend = self._prefill_attention(slots, table, cu_seqlens, self.cache.context_lens(seq_ids), lengths)
        logits = self.model.forward(tokens, positions, attend)[cu_seqlens[1:].long() - 1]
        for seq_id, token in zip(seq_ids, sample(logits, seq_ids)):
            self.requests[seq_id].generated.append(int(token))
        if device.type == "cuda":
            torch.cuda.synchronize()
        self.stats.prefill_tokens += sum(lengths)
        self.stats.prefill_seconds += time.perf_counter() - start

    def _buffers_for(self, size: int) -> Buffers:
        if size in self._buffers:
            return self._buffers[size]
        c, device = self.model.config, self.model.device
        buffers = Buffers(tokens=torch.zeros(size, dtype=torch.long, device=device),
                          positions=torch.zeros(size, dtype=torch.long, device=device),
                          slots=torch.full((size,), self.pad_slot, dtype=torch.long, device=device),
                          block_table=torch.zeros(size, self.max_pages, dtype=torch.int32, device=device),
                          context_lens=torch.zeros(size, dtype=torch.int32, device=device))
        if self.backend == "autotile":
            # One plan per padded size, from host integers; the bound is the longest context admitted.
            buffers.plan = autotile.plan_paged_attention(
                batch=size, num_q_heads=c.heads, num_kv_heads=c.kv_heads, head_dim=c.head_dim,
                page_size=c.page_size, max_context=c.max_context, dtype=c.dtype, device=device)
        forward = lambda: self.model.forward(buffers.tokens, buffers.positions,  # noqa: E731
                                             self._decode_attention(buffers))
        if self.use_graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: compiles every kernel before capture
                for _ in range(2):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
            buffers.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(buffers.graph):
                buffers.logits = forward()
        else:
            buffers.graph = forward
        self._buffers[size] = buffers
        return buffers

    def decode_step(self, sample) -> None:
        """One token for every running sequence: fill the padded size's buffers, replay its graph, sample."""
        seq_ids = [s for s, r in self.requests.items() if len(r.generated) < r.max_new_tokens]
        if not seq_ids:
            return
        size = next((s for s in self.sizes if s >= len(seq_ids)), None)
        if size is None:
            raise RuntimeError(f"{len(seq_ids)} running sequences exceed the largest captured batch {self.sizes[-1]}")
        buffers = self._buffers_for(size)
        start = time.perf_counter()
        n = len(seq_ids)
        last = [self.requests[s].generated[-1] for s in seq_ids]
        positions = [self.cache.length(s) for s in seq_ids]  # the new token's position
        slots = self.cache.reserve_many(seq_ids)
        buffers.tokens[:n].copy_(torch.tensor(last))
        buffers.positions[:n].copy_(torch.tensor(positions))
        buffers.slots[:n].copy_(slots)
        buffers.slots[n:].fill_(self.pad_slot)
        self.cache.block_table(seq_ids, out=buffers.block_table)
        self.cache.context_lens(seq_ids, out=buffers.context_lens)
        if self.use_graphs:
            buffers.graph.replay()
            logits = buffers.logits[:n]
        else:
            logits = buffers.graph()[:n]
        if self.record_logits:
            self.stats.logits.append((list(seq_ids), logits.float().cpu()))
        tokens = sample(logits, seq_ids)  # reads the logits: the step's one synchronisation
        self.stats.decode_seconds += time.perf_counter() - start
        self.stats.decode_steps += 1
        self.stats.decode_tokens += n
        for seq_id, token in zip(seq_ids, tokens):
            self.requests[seq_id].generated.append(int(token))

    def fork(self, parent) -> object:
        """Parallel sampling: a child sharing every page of the parent (copy-on-write) and its tokens so far."""
        child = self._next_id
        self._next_id += 1
        self.cache.fork(parent, child)
        request = self.requests[parent]
        self.requests[child] = Request(request.prompt, request.max_new_tokens, list(request.generated))
        self.stats.forks += 1
        return child

    def finish_done(self) -> None:
        for seq_id in [s for s, r in self.requests.items() if len(r.generated) >= r.max_new_tokens]:
            self.cache.free(seq_id)
            del self.requests[seq_id]
            self.stats.finished += 1


def greedy(logits: torch.Tensor, seq_ids) -> list[int]:
    return logits.argmax(dim=-1).tolist()


def workload(config: ModelConfig, requests: int, seed: int = 0, *, prompt=(16, 512), new=(16, 256)) -> list:
    """(arrival step, prompt tokens, new tokens) of each request; prompt + new fit max_context."""
    rng = random.Random(seed)
    plan = []
    for i in range(requests):
        prompt_len = rng.randint(*prompt)
        new_tokens = min(rng.randint(*new), config.max_context - prompt_len - 1)
        plan.append((i // 4, [rng.randrange(config.vocab) for _ in range(prompt_len)], max(1, new_tokens)))
    return plan


def serve(engine: Engine, plan: list, *, steps: int, sample=greedy, fork_every: int = 0) -> Stats:
    """Runs `steps` decode steps: admits arrivals (prefill), decodes, forks every `fork_every` steps, finishes."""
    pending = list(plan)
    for step in range(steps):
        arrivals = []
        while pending and pending[0][0] <= step and len(engine.requests) + len(arrivals) < engine.sizes[-1]:
            _, prompt, new_tokens = pending.pop(0)
            arrivals.append(engine.add_request(prompt, new_tokens))
        engine.prefill(arrivals, sample)
        running = [s for s, r in engine.requests.items() if len(r.generated) < r.max_new_tokens]
        if fork_every and step % fork_every == fork_every - 1 and running and len(running) < engine.sizes[-1]:
            engine.fork(running[0])
        engine.decode_step(sample)
        engine.finish_done()
        if not pending and not engine.requests:
            break
    return engine.stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model that runs on CPU (Triton's interpreter)")
    parser.add_argument("--backend", choices=("autotile", "sdpa", "both"), default="both")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-batch", type=int, default=64)
    args = parser.parse_args()
    config = TINY if args.tiny else ModelConfig()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    model = Decoder(config, device)
    plan = workload(config, args.requests, prompt=(4, 24) if args.tiny else (16, 512),
                    new=(4, 24) if args.tiny else (16, 256))
    pages = args.max_batch * (-(-config.max_context // config.page_size)) + 8
    for backend in (("autotile", "sdpa") if args.backend == "both" else (args.backend,)):
        engine = Engine(model, num_pages=pages, backend=backend, max_batch=args.max_batch)
        stats = serve(engine, plan, steps=args.steps, fork_every=7)
        print(f"{backend:8s}: {stats.decode_tokens} tokens in {stats.decode_steps} decode steps, "
              f"{stats.decode_tokens_per_s:,.0f} tokens/s decoding; {stats.prefill_tokens} prompt tokens; "
              f"{stats.forks} forks, {stats.finished} finished")


if __name__ == "__main__":
    main()
