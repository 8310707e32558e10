"""autotile.warmup / `autotile warmup`: the calls a model's shapes make, each twice, with what served it.

On the CPU the ops run the interpreter, which compiles nothing: these tests check the calls (their shapes, features
and layouts, and that each runs), not the compile cache a GPU fills (benchmarks measure that).
"""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import autotile
from autotile.errors import BadInputError
from autotile.runtime.warmup import parse_prefill, warmup

# A small model with Gemma-2's features: soft-capped logits and an 8-token window on its local layers.
TINY = "hidden=32,intermediate=48,heads=2,kv_heads=1,softcap=50,sliding_window=8"


def test_each_projection_and_token_count_is_called_and_then_each_prefill_call_as_the_model_makes_it():
    seen = []
    warmed = warmup(dims=TINY, tokens="1,5", prefill="1x16,2x4", device="cpu", backward=True, report=seen.append)
    assert warmed == seen
    linear = [c for c in warmed if c.op == "linear"]
    # qkv (64 x 32), q (32 x 32), kv (16 x 32), o (32 x 32: as q, listed once), gate_up (96 x 32), gate (48 x 32),
    # down (32 x 48), at 1 and 5 tokens.
    assert [c.shape for c in linear] == [f"{name} {m} x {n} x {k}" for name, n, k in (
        ("qkv", 64, 32), ("q", 32, 32), ("kv", 16, 32), ("gate_up", 96, 32), ("gate", 48, 32), ("down", 32, 48))
        for m in (1, 5)]
    attention = [(c.op, c.shape) for c in warmed if c.op != "linear"]
    # 16 tokens pass the window (a global layer's call, then a local layer's); 4 do not (the window masks nothing
    # there: one call). Each with its training step.
    assert attention == [(op, shape) for shape in (
        "1 x 16, 2/1 heads of 16, softcap 50", "1 x 16, 2/1 heads of 16, window 7, softcap 50",
        "2 x 4, 2/1 heads of 16, softcap 50") for op in ("flash_attention", "flash_attention training step")]
    assert all(c.served and c.first_s > 0 and c.again_s > 0 for c in warmed)
    assert all(("(forward: " in c.served) == ("training" in c.op) for c in warmed)


def test_the_public_name_and_bad_input(monkeypatch):
    assert autotile.warmup is warmup
    with pytest.raises(BadInputError, match="BATCHxTOKENS"):
        parse_prefill("4096")
    with pytest.raises(BadInputError, match="at least 1"):
        parse_prefill("0x16")
    with pytest.raises(BadInputError, match="unknown model"):
        warmup("no-such-model", device="cpu")
    with pytest.raises(BadInputError, match="bf16 or fp16"):
        warmup(dims=TINY, dtype="fp32", device="cpu")
    with pytest.raises(BadInputError, match="layout"):
        warmup(dims=TINY, layout="sbhd", device="cpu")
    for kwargs, words in (({"dims": TINY, "tokens": []}, "tokens is empty"),
                          ({"dims": TINY, "tokens": [1.5]}, "whole token counts"),
                          ({"dims": TINY, "tokens": [1], "prefill": 8}, "BATCHxTOKENS"),
                          ({"dims": TINY, "tokens": [1], "report": 5}, "report must be a function"),
                          ({"model": "llama3-8b", "dims": TINY}, "not both"),
                          ({"dims": TINY, "tokens": [1], "device": "meta"}, "CUDA device"),
                          ({"dims": TINY, "tokens": [1], "device": "nonsense"}, "is not a device")):
        with pytest.raises(BadInputError, match=words):
            warmup(**{"device": "cpu", **kwargs})
    assert [c.shape for c in warmup(dims=TINY, tokens=3, device="cpu")][0] == "qkv 3 x 64 x 32"  # one int
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BadInputError, match="no CUDA device"):
        warmup("llama3-8b", tokens="1")
    with pytest.raises(BadInputError, match="no CUDA device"):
        warmup(dims=TINY, tokens=[1], device="cuda")


def test_the_command_says_what_to_do_without_a_gpu(monkeypatch):
    from autotile.cli.main import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(cli, ["warmup", "--model", "llama3-8b", "--tokens", "1,8"])
    assert result.exit_code != 0 and "no CUDA device" in result.output and "op " not in result.output
