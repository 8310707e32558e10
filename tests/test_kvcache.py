"""The paged KV cache manager: page accounting, copy-on-write forks, clean failure when pages run out."""
from __future__ import annotations

import pytest
import torch

from autotile.errors import BadInputError, ShapeMismatchError
from autotile.kvcache import OutOfPagesError, PagedKVCache, UnknownSequenceError

HEADS, DIM = 2, 16


def make_cache(num_pages=32, page_size=16, num_layers=1, **kwargs) -> PagedKVCache:
    return PagedKVCache(num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                        num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, **kwargs)


def tokens(n: int, num_layers: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (n, HEADS, DIM) if num_layers == 1 else (num_layers, n, HEADS, DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def test_300_tokens_in_16_token_pages_take_19_pages_and_waste_4_slots():
    cache = make_cache()
    cache.allocate("s")
    cache.append("s", *tokens(300))
    stats = cache.stats()
    assert (stats.pages_used, stats.tokens_stored, stats.wasted_slots) == (19, 300, 4)
    assert stats.pages_free == 32 - 19 and stats.logical_tokens == 300
    assert stats.utilisation == pytest.approx(300 / 304)


def test_token_by_token_appends_read_back_in_order():
    cache = make_cache(page_size=4)
    k, v = tokens(11)
    cache.allocate("a")
    cache.allocate("b")
    for i in range(11):  # interleaved with another sequence, so pages of "a" are not consecutive
        cache.append("a", k[i:i + 1], v[i:i + 1])
        cache.append("b", *tokens(1, seed=100 + i))
    got_k, got_v = cache.gather("a")
    torch.testing.assert_close(got_k, k, rtol=0, atol=0)
    torch.testing.assert_close(got_v, v, rtol=0, atol=0)
    assert cache.pages("a") != sorted(range(min(cache.pages("a")), max(cache.pages("a")) + 1))
    table = cache.block_table(["a", "b"])
    assert table.dtype == torch.int32 and table[0, :3].tolist() == cache.pages("a")


def test_fork_shares_pages_and_copies_the_partly_filled_last_page_on_write():
    cache = make_cache(num_layers=2)
    cache.allocate("parent")
    prefix_k, prefix_v = tokens(40, num_layers=2)
    cache.append("parent", prefix_k, prefix_v)
    cache.fork("parent", "child")
    assert cache.pages("child") == cache.pages("parent")
    assert cache.stats().pages_shared == 3 and cache.stats().pages_used == 3
    assert cache.pages_needed("child", 1) == 1  # the copy of the shared last page

    child_k, child_v = tokens(1, num_layers=2, seed=1)
    cache.append("child", child_k, child_v)
    assert cache.pages("child")[:2] == cache.pages("parent")[:2]
    assert cache.pages("child")[2] != cache.pages("parent")[2]
    for layer in range(2):
        parent_k, _ = cache.gather("parent", layer)
        got_k, got_v = cache.gather("child", layer)
        torch.testing.assert_close(parent_k, prefix_k[layer], rtol=0, atol=0)  # the parent's page is untouched
        torch.testing.assert_close(got_k, torch.cat([prefix_k[layer], child_k[layer]]), rtol=0, atol=0)
        torch.testing.assert_close(got_v, torch.cat([prefix_v[layer], child_v[layer]]), rtol=0, atol=0)
    # The parent is now the only holder of its old last page: it writes in place, no copy.
    assert cache.pages_needed("parent", 1) == 0
    stats = cache.stats()
    assert (stats.pages_used, stats.pages_shared, stats.tokens_stored, stats.logical_tokens) == (4, 2, 16 + 16 + 8 + 9, 40 + 41)


def test_fork_at_a_page_boundary_copies_nothing():
    cache = make_cache()
    cache.allocate("p")
    cache.append("p", *tokens(32))
    cache.fork("p", "c")
    assert cache.pages_needed("c", 1) == 1  # a fresh page, no copy
    cache.append("c", *tokens(1))
    assert cache.pages("c")[:2] == cache.pages("p") and cache.stats().pages_used == 3


def test_beam_search_forks_and_frees_return_every_page():
    cache = make_cache(num_pages=64)
    cache.allocate("prompt")
    cache.append("prompt", *tokens(37))
    beams = [f"beam{i}" for i in range(4)]
    for beam in beams:
        cache.fork("prompt", beam)
    cache.free("prompt")
    for step in range(5):
        for i, beam in enumerate(beams):
            cache.append(beam, *tokens(1, seed=10 * step + i))
        # The worst beam is dropped and the best one forked in its place, as beam search does.
        cache.free(beams[-1])
        cache.fork(beams[0], beams[-1])
        stats = cache.stats()
        assert stats.pages_used + stats.pages_free == stats.pages_total
    for beam in beams:
        assert cache.length(beam) == 42
        cache.free(beam)
    assert cache.stats().pages_free == 64 and cache.stats().tokens_stored == 0


def test_running_out_of_pages_raises_and_changes_nothing():
    cache = make_cache(num_pages=4, page_size=8)
    cache.allocate("a")
    cache.append("a", *tokens(20))  # 3 pages
    before = (cache.stats(), cache.pages("a"), cache.length("a"))
    with pytest.raises(OutOfPagesError, match="needs 2 more page"):
        cache.append("a", *tokens(13))
    assert (cache.stats(), cache.pages("a"), cache.length("a")) == before
    cache.fork("a", "b")
    cache.append("b", *tokens(1))  # copies the shared last page: the pool is now full
    with pytest.raises(OutOfPagesError, match="0 of 4 are free"):
        cache.append("a", *tokens(5))  # "a"'s last page is its own again, but 5 tokens overflow it
    cache.append("a", *tokens(4))  # fits in place


def test_misuse_raises_clear_errors():
    cache = make_cache()
    cache.allocate("a")
    with pytest.raises(BadInputError, match="already exists"):
        cache.allocate("a")
    with pytest.raises(UnknownSequenceError, match="allocate it first"):
        cache.append("nope", *tokens(1))
    with pytest.raises(ShapeMismatchError, match="must both be"):
        cache.append("a", torch.randn(3, HEADS + 1, DIM), torch.randn(3, HEADS + 1, DIM))
    assert cache.length("a") == 0 and cache.stats().pages_used == 0  # the bad call reserved nothing
    cache.append("a", *tokens(40))
    with pytest.raises(ShapeMismatchError, match="max_pages=2"):
        cache.block_table(["a"], max_pages=2)
    # Writes and reads name a layer that exists, and slots reserve() gave: in range, each once, integers (a -1,
    # vLLM's padding mark, indexed the pool's last slot, another sequence's).
    slots = cache.reserve("a", 2)
    for bad, words in ((slots - 10**6, "outside the cache"), (torch.tensor([5, 5]), "more than once"),
                       (slots.float(), "int64"), (slots[None], "1-D")):
        with pytest.raises(BadInputError, match=words):
            cache.write(0, bad, *tokens(2))
    for layer in (cache.num_layers, -1, 0.5):
        with pytest.raises(BadInputError, match="layer must be an int"):
            cache.gather("a", layer)
    cache.free("a")
    with pytest.raises(UnknownSequenceError, match="already freed"):
        cache.free("a")
    with pytest.raises(BadInputError, match="page_size must be an int"):
        PagedKVCache(num_layers=1, num_pages=4, page_size=2.5, num_kv_heads=1, head_dim=16)


def test_fp8_pages_store_values_divided_by_the_scale():
    scales = torch.tensor([0.01, 0.02])
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=8, num_kv_heads=HEADS, head_dim=DIM,
                         dtype=torch.float8_e4m3fn, k_scale=scales, v_scale=0.05)
    k, v = tokens(10)
    cache.allocate("a")
    cache.append("a", k, v)
    got_k, got_v = cache.gather("a")
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2**-4.
    torch.testing.assert_close(got_k.float() * scales[None, :, None], k, rtol=2**-4, atol=1e-3)
    torch.testing.assert_close(got_v.float() * 0.05, v, rtol=2**-4, atol=1e-3)
    with pytest.raises(BadInputError, match="needs k_scale"):
        PagedKVCache(num_layers=1, num_pages=4, page_size=8, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("count", [torch.tensor(3), True, "3", 1.5], ids=["tensor", "bool", "str", "float"])
def test_token_counts_must_be_ints(count):
    """A tensor count was stored as the sequence's length (length() then returned a tensor); True counted as 1."""
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=1, head_dim=64)
    cache.allocate("a")
    with pytest.raises(BadInputError, match="num_tokens must be an int"):
        cache.reserve("a", count)
    with pytest.raises(BadInputError, match="num_tokens must be an int"):
        cache.reserve_many(["a"], [count])
    assert cache.length("a") == 0


def test_numpy_counts_are_ints():
    np = pytest.importorskip("numpy")
    cache = PagedKVCache(num_layers=1, num_pages=8, page_size=16, num_kv_heads=1, head_dim=64)
    cache.allocate("a")
    cache.allocate("b")
    assert cache.reserve_many(["a", "b"], np.int64(2)).tolist() == [0, 1, 16, 17]
    cache.reserve("a", np.int64(1))
    assert cache.length("a") == 3 and type(cache.length("a")) is int
