"""examples/serving_decode.py at a tiny size on CPU: continuous batching with prefill, forks and finishes, decode
through a paged-attention plan per padded batch size; its logits match the same loop with gather + SDPA."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # NOTE: the interpreter needs triton's own jit helpers decorated in interpreter mode (see test_paged.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "serving_decode.py"


def load_example():
    spec = importlib.util.spec_from_file_location("serving_decode_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_tiny_model_serves_the_same_tokens_with_paged_attention_as_with_gather_sdpa():
    example = load_example()
    config = example.TINY
    model = example.Decoder(config, "cpu")
    plan = example.workload(config, 6, prompt=(4, 20), new=(3, 12))
    chosen = []

    def record(logits, seq_ids):
        tokens = logits.argmax(dim=-1).tolist()
        chosen.append(tokens)
        return tokens

    paged = example.Engine(model, num_pages=64, backend="autotile", max_batch=8, record_logits=True)
    stats = example.serve(paged, plan, steps=8, sample=record, fork_every=3)
    assert stats.forks == 2 and stats.finished >= 4 and stats.decode_steps == 8
    assert len(paged._buffers) >= 2, "the batch should have grown through more than one padded size"
    assert all(b.plan is not None and b.plan.batch == size for size, b in paged._buffers.items())
    replayed = iter(chosen)
    gathered = example.Engine(model, num_pages=64, backend="sdpa", max_batch=8, record_logits=True)
    example.serve(gathered, plan, steps=8, sample=lambda logits, seq_ids: next(replayed), fork_every=3)
    assert len(stats.logits) == len(gathered.stats.logits) == 8
    for (ids, got), (same_ids, want) in zip(stats.logits, gathered.stats.logits):
        assert ids == same_ids
        # Both paths round attention to fp16 in a different order (~1 ulp an element), carried through two
        # layers into logits of magnitude <= 8: 4 fp16 ulps at that magnitude.
        allowed = 4 * 2.0 ** (torch.frexp(want.abs().max())[1].item() - 11)
        assert (got - want).abs().max() <= allowed, f"logits differ by {(got - want).abs().max():.3g}"
    # Every page but the padding row's comes back once the remaining sequences are freed.
    for seq_id in list(paged.requests):
        paged.cache.free(seq_id)
    assert paged.cache.stats().pages_used == 1
