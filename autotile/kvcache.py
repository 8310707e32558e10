"""A paged KV cache: fixed-size pages in one preallocated pool per layer, a block table per sequence.

Sequences own lists of page ids; page p of every layer's pool belongs to the
same owners, so one block table serves all layers. Pages are reference
counted: `fork` lets a child share all of its parent's pages (parallel
sampling, beam search), and the first write into a shared page copies it
(copy-on-write), in every layer, before writing. Running out of pages raises
`OutOfPagesError` before anything is changed.

>>> import torch
>>> cache = PagedKVCache(num_layers=1, num_pages=32, page_size=16, num_kv_heads=2, head_dim=16)
>>> cache.allocate("a")
>>> slots = cache.append("a", torch.randn(300, 2, 16), torch.randn(300, 2, 16))
>>> s = cache.stats()
>>> (s.pages_used, s.tokens_stored, s.wasted_slots)
(19, 300, 4)
>>> cache.fork("a", "b")
>>> cache.append("b", torch.randn(1, 2, 16), torch.randn(1, 2, 16))  # copies the shared last page (19)
tensor([316])
>>> cache.stats().pages_used, cache.stats().pages_shared
(20, 18)
>>> table, lengths = cache.block_table(["a", "b"]), cache.context_lens(["a", "b"])
>>> table.shape, lengths.tolist()
(torch.Size([2, 19]), [300, 301])
"""
from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from autotile.errors import AutotileError, BadInputError, ShapeMismatchError
from autotile.families.paged import check_head_dim

# fp8 e4m3's largest finite value; values are divided by the cache's scale before the cast.
_FP8_MAX = 448.0


class OutOfPagesError(AutotileError, MemoryError):
    """The pool has fewer free pages than an allocation needs; nothing was changed."""


class UnknownSequenceError(AutotileError, KeyError):
    """A sequence id the cache does not hold (never allocated, or already freed)."""


@dataclass(frozen=True)
class CacheStats:
    """Usage of the pool. Shared pages count once in `pages_used` and `tokens_stored`."""

    pages_total: int
    pages_used: int
    pages_free: int
    pages_shared: int  # pages held by more than one sequence
    tokens_stored: int  # token slots holding K/V, each physical page counted once
    logical_tokens: int  # sum of the sequences' lengths (shared prefixes counted per sequence)
    wasted_slots: int  # reserved but empty slots at the ends of partly filled pages

    @property
    def utilisation(self) -> float:
        """Filled slots over reserved slots (1.0 when no page is partly empty)."""
        reserved = self.tokens_stored + self.wasted_slots
        return self.tokens_stored / reserved if reserved else 1.0


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


def _check_count(num_tokens) -> None:
    """A token count as a Python (or numpy) int >= 0: a tensor, a bool, a float or a string would be stored as the
    sequence's length and break its page accounting later."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral):
        raise BadInputError(f"num_tokens must be an int >= 0, got {num_tokens!r} ({type(num_tokens).__name__}); "
                            "pass int(n)")
    if num_tokens < 0:
        raise BadInputError(f"num_tokens must be >= 0, got {num_tokens}")


class PagedKVCache:
    """K and V pools of shape (num_pages, page_size, num_kv_heads, head_dim) per layer, and their block tables.

    `dtype=torch.float8_e4m3fn` stores values divided by `k_scale` / `v_scale`
    (per-tensor floats, or per-KV-head tensors), as the paged attention
    kernel's fp8 path reads them back.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu",
                 k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None):
        sizes = {"num_layers": num_layers, "num_pages": num_pages, "page_size": page_size,
                 "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise BadInputError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        num_layers, num_pages, page_size, num_kv_heads, head_dim = (int(v) for v in sizes.values())
        if min(num_layers, num_pages, page_size, num_kv_heads, head_dim) < 1:
            raise BadInputError("num_layers, num_pages, page_size, num_kv_heads and head_dim must all be >= 1")
        # The page sizes and head dims the paged ops take (autotile.families.paged.PagedProblem), refused here
        # rather than at the first call. (Any dtype is kept: fp32 caches serve as references; the ops take fp16,
        # bf16 and fp8.)
        if page_size & (page_size - 1) or page_size > 256:
            raise ShapeMismatchError(f"page_size must be a power of two up to 256, got {page_size}")
        check_head_dim(head_dim)
        if dtype != torch.float8_e4m3fn and (k_scale is not None or v_scale is not None):
            raise BadInputError(f"k_scale and v_scale apply to fp8 caches only (dtype=torch.float8_e4m3fn); a "
                                f"{dtype} cache stores values as they are: leave them out")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.fp8 = dtype == torch.float8_e4m3fn
        self.k_scale = self._scale_tensor(k_scale, "k_scale") if self.fp8 else None
        self.v_scale = self._scale_tensor(v_scale, "v_scale") if self.fp8 else None
        # Free pages are handed out lowest id first (a stack popped from the end).
        self._free = list(range(num_pages - 1, -1, -1))
        self._refcount = [0] * num_pages
        self._filled = [0] * num_pages  # token slots written in each page (the same for all its owners)
        self._sequences: dict[Hashable, _Sequence] = {}

    def _scale_tensor(self, scale, name: str) -> torch.Tensor:
        if scale is None:
            raise BadInputError(f"an fp8 cache needs {name}: the factor stored values are multiplied by on reading")
        t = torch.as_tensor(scale, dtype=torch.float32).to(self.device).reshape(-1)
        if t.numel() == 1:
            t = t.expand(self.num_kv_heads).contiguous()
        if t.numel() != self.num_kv_heads:
            raise ShapeMismatchError(f"{name} must be one value or one per KV head ({self.num_kv_heads}), got {t.numel()}")
        # Writes divide by the scale: a zero, negative or non-finite one would store NaN or clamped garbage.
        if not bool(torch.isfinite(t).all() and (t > 0).all()):
            raise BadInputError(f"{name} must be finite and > 0 (a head's amax / 448 is the usual choice), "
                                f"got {t.tolist()}")
        return t

    # --- sequences ------------------------------------------------------------------
    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"sequence {seq_id!r} is not in the cache; allocate it first") from None

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._sequences

    def length(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).length

    def pages(self, seq_id: Hashable) -> list[int]:
        """The physical pages of a sequence, in order."""
        return list(self._seq(seq_id).pages)

    def allocate(self, seq_id: Hashable) -> None:
        """Start an empty sequence; pages are taken as tokens are appended."""
        if seq_id in self._sequences:
            raise BadInputError(f"sequence {seq_id!r} already exists; free it or pick another id")
        self._sequences[seq_id] = _Sequence()

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; pages no other sequence holds go back to the pool."""
        seq = self._sequences.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(f"sequence {seq_id!r} is not in the cache (already freed?)")
        for page in seq.pages:
            self._release(page)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """`child` starts as a copy of `parent` sharing every page; whichever writes into a shared page first copies it."""
        source = self._seq(parent)
        if child in self._sequences:
            raise BadInputError(f"sequence {child!r} already exists; free it or pick another id")
        for page in source.pages:
            self._refcount[page] += 1
        self._sequences[child] = _Sequence(list(source.pages), source.length)

    # --- writing --------------------------------------------------------------------
    def pages_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Free pages appending `num_tokens` to the sequence would take (including a copy-on-write)."""
        seq = self._seq(seq_id)
        room = len(seq.pages) * self.page_size - seq.length
        new_pages = -(-max(0, num_tokens - room) // self.page_size)
        copy = 1 if num_tokens > 0 and room > 0 and self._refcount[seq.pages[-1]] > 1 else 0
        return new_pages + copy

    def reserve(self, seq_id: Hashable, num_tokens: int = 1) -> torch.Tensor:
        """Make room for `num_tokens` more tokens; returns their flat slots (page * page_size + offset), int64.

        Call `write` for every layer with these slots. Raises OutOfPagesError, changing nothing,
        when the pool cannot hold them.
        """
        _check_count(num_tokens)
        num_tokens = int(num_tokens)
        needed = self.pages_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise OutOfPagesError(
                f"sequence {seq_id!r} needs {needed} more page(s) of {self.page_size} tokens but only "
                f"{len(self._free)} of {self.num_pages} are free; free finished sequences, preempt one, "
                "or build the cache with more pages")
        return torch.tensor(self._reserve_slots(seq_id, num_tokens), dtype=torch.int64, device=self.device)

    def _reserve_slots(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Takes the pages (copying a shared last page first) and returns the flat slots; the caller checked room."""
        seq = self._seq(seq_id)
        if num_tokens and seq.length % self.page_size and self._refcount[seq.pages[-1]] > 1:
            seq.pages[-1] = self._copy_page(seq.pages[-1])
        slots = []
        for position in range(seq.length, seq.length + num_tokens):
            index, offset = divmod(position, self.page_size)
            if index == len(seq.pages):
                seq.pages.append(self._take())
            page = seq.pages[index]
            self._filled[page] = offset + 1
            slots.append(page * self.page_size + offset)
        seq.length += num_tokens
        return slots

    def _check_layer(self, layer) -> None:
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < self.num_layers:
            raise BadInputError(f"layer must be an int in 0..{self.num_layers - 1}, got {layer!r}")

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (num_tokens, num_kv_heads, head_dim) of one layer into reserved slots (`reserve`'s).

        The slots' values are checked (in range, each once) where reading them is free: CPU tensors, or everywhere
        under AUTOTILE_CHECKS=1 (autotile.runtime.paged_plan.checks_on); a GPU write does not wait for them."""
        self._check_layer(layer)
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32):
            raise BadInputError("slots must be a 1-D int64 (or int32) tensor of reserved slots, as reserve() returns, "
                                f"got {getattr(slots, 'dtype', type(slots).__name__)} of shape "
                                f"{tuple(getattr(slots, 'shape', ()))}")
        from autotile.runtime.paged_plan import check_slots, checks_on

        if checks_on(slots.device):
            check_slots(slots, self.num_pages * self.page_size, "slots")
        want = (slots.numel(), self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise ShapeMismatchError(f"{name} must have shape {want} (tokens, KV heads, head dim), got {tuple(t.shape)}")
        slots = slots.to(self.device)
        for pool, values, scale in ((self.k_pools[layer], k, self.k_scale), (self.v_pools[layer], v, self.v_scale)):
            values = values.to(self.device)
            if scale is not None:
                values = (values.float() / scale[None, :, None]).clamp(-_FP8_MAX, _FP8_MAX)
            pool.view(-1, self.num_kv_heads, self.head_dim)[slots] = values.to(self.dtype)

    def append(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append tokens to a sequence in every layer: k, v (num_layers, num_tokens, Hkv, D), or (num_tokens, Hkv, D)
        for a one-layer cache. Returns the slots written."""
        if k.dim() == 3 and self.num_layers == 1:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        if (k.dim() != 4 or k.shape != v.shape or k.shape[0] != self.num_layers
                or tuple(k.shape[2:]) != (self.num_kv_heads, self.head_dim)):
            raise ShapeMismatchError(
                f"k and v must both be (num_layers={self.num_layers}, tokens, {self.num_kv_heads}, {self.head_dim}), "
                f"got {tuple(k.shape)} and {tuple(v.shape)}")
        slots = self.reserve(seq_id, k.shape[1])  # after the checks: a bad call must not advance the sequence
        for layer in range(self.num_layers):
            self.write(layer, slots, k[layer], v[layer])
        return slots

    # --- reading --------------------------------------------------------------------
    def block_table(self, seq_ids: Sequence[Hashable], max_pages: int | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """(len(seq_ids), max_pages) int32 on the cache's device; entries past a sequence's pages are 0.

        `out` (rows >= len(seq_ids), int32, on the device) is filled instead, its width the table's
        and its extra rows 0: the padded, fixed buffers a CUDA graph replays with.
        """
        seqs = [self._seq(s) for s in seq_ids]
        if out is not None:
            if out.dim() != 2 or out.shape[0] < len(seqs) or out.dtype != torch.int32:
                raise ShapeMismatchError(
                    f"out must be (>= {len(seqs)}, max_pages) int32, got {tuple(out.shape)} {out.dtype}")
            max_pages = out.shape[1]
        width = max([len(s.pages) for s in seqs] + [1]) if max_pages is None else max_pages
        rows = []
        for seq in seqs:
            if len(seq.pages) > width:
                raise ShapeMismatchError(f"a sequence holds {len(seq.pages)} pages, more than max_pages={width}")
            rows.append(seq.pages + [0] * (width - len(seq.pages)))
        rows += [[0] * width] * ((out.shape[0] if out is not None else 0) - len(seqs))
        table = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)
        if out is None:
            return table.to(self.device)
        out.copy_(table)
        return out

    def context_lens(self, seq_ids: Sequence[Hashable], *, out: torch.Tensor | None = None) -> torch.Tensor:
        """(len(seq_ids),) int32 on the cache's device; `out` (>= len(seq_ids),) is filled instead, extra entries 0
        (padding rows of a CUDA graph's fixed batch: a length of 0 makes paged attention skip the row)."""
        lengths = [self._seq(s).length for s in seq_ids]
        if out is None:
            return torch.tensor(lengths, dtype=torch.int32, device=self.device)
        if out.dim() != 1 or out.shape[0] < len(lengths) or out.dtype != torch.int32:
            raise ShapeMismatchError(f"out must be (>= {len(lengths)},) int32, got {tuple(out.shape)} {out.dtype}")
        out.copy_(torch.tensor(lengths + [0] * (out.shape[0] - len(lengths)), dtype=torch.int32))
        return out

    def reserve_many(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int] | int = 1) -> torch.Tensor:
        """`reserve` for several sequences at once (a decode step: one token each): their slots, concatenated in
        order, as one int64 tensor on the device (one copy to the device instead of one per sequence).

        Raises OutOfPagesError, changing nothing, when the pool may not hold them all (counting a
        copy-on-write for every sequence whose last page is shared, which can ask for one page more
        than needed when forks of one parent grow in the same step).
        """
        one = (isinstance(num_tokens, numbers.Integral)
               or (isinstance(num_tokens, torch.Tensor) and not num_tokens.dim()))
        counts = [num_tokens] * len(seq_ids) if one else list(num_tokens)
        if len(counts) != len(seq_ids):
            raise BadInputError(f"num_tokens must be one count >= 0 per sequence ({len(seq_ids)}), got {num_tokens}")
        for n in counts:
            _check_count(n)
        counts = [int(n) for n in counts]
        if len(set(seq_ids)) != len(seq_ids):
            raise BadInputError("reserve_many takes each sequence once; sum the tokens of a sequence instead")
        needed = sum(self.pages_needed(s, n) for s, n in zip(seq_ids, counts))
        if needed > len(self._free):
            raise OutOfPagesError(
                f"these {len(seq_ids)} sequences need up to {needed} more page(s) of {self.page_size} tokens but only "
                f"{len(self._free)} of {self.num_pages} are free; free finished sequences, preempt one, "
                "or build the cache with more pages")
        slots: list[int] = []
        for seq_id, n in zip(seq_ids, counts):
            slots += self._reserve_slots(seq_id, n)
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def gather(self, seq_id: Hashable, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V as contiguous (length, Hkv, D) tensors in the pool's dtype."""
        self._check_layer(layer)
        seq = self._seq(seq_id)
        pages = torch.tensor(seq.pages, dtype=torch.int64, device=self.device)
        k = self.k_pools[layer][pages].flatten(0, 1)[:seq.length]
        v = self.v_pools[layer][pages].flatten(0, 1)[:seq.length]
        return k, v

    def stats(self) -> CacheStats:
        used = [p for p in range(self.num_pages) if self._refcount[p] > 0]
        stored = sum(self._filled[p] for p in used)
        return CacheStats(
            pages_total=self.num_pages, pages_used=len(used), pages_free=len(self._free),
            pages_shared=sum(1 for p in used if self._refcount[p] > 1), tokens_stored=stored,
            logical_tokens=sum(s.length for s in self._sequences.values()),
            wasted_slots=len(used) * self.page_size - stored)

    # --- pages ----------------------------------------------------------------------
    def _take(self) -> int:
        page = self._free.pop()
        self._refcount[page] = 1
        self._filled[page] = 0
        return page

    def _release(self, page: int) -> None:
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._filled[page] = 0
            self._free.append(page)

    def _copy_page(self, page: int) -> int:
        """Copy a shared page (every layer) into a fresh one this sequence owns alone."""
        fresh = self._take()
        for pool in (*self.k_pools, *self.v_pools):
            pool[fresh].copy_(pool[page])
        self._filled[fresh] = self._filled[page]
        self._release(page)
        return fresh
