"""Flash attention's model features and edge cases against float64 torch, under Triton's interpreter.

Sliding windows (narrower than a block, wider than the sequence, one-sided), soft-capping, ALiBi
(slopes per head and per batch entry), the log-sum-exp as an output with its gradient, packed
variable-length sequences, scale 0 and negative scales, bf16 on the CPU, and head dims that are not
powers of two (80, 96, 112). Every case checks the output and all three gradients with
FlashAttention's rule (flash_reference.fa_rule_check) on odd lengths with Sq != Sk.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autotile.device import interpret_device
from autotile.errors import BadInputError, ShapeMismatchError
from autotile.families.flash import FAMILY, FlashProblem, alibi_slopes, packed_lengths
from autotile.families.flash_reference import (Scores, attention_grads, attention_math, fa_rule_check, join_packed,
                                               log2_sum_exp, split_packed)
from autotile.runtime import ops_flash, ops_flash_varlen
from autotile.space import Config

INTERPRET = interpret_device()
FWD_SMALL = Config(LOADS="pointer", BLOCK_M=16, BLOCK_N=16, WARP_SPECIALIZE=False, num_warps=1,
                   num_stages=2)
BWD_SMALL = Config(LOADS="pointer", BLOCK_M1=16, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=16, num_warps=1, num_stages=2)


def run_and_check(problem: FlashProblem, preferred: Config, seed: int = 0):
    config = FAMILY.first_feasible(problem, INTERPRET, preferred)
    inputs = FAMILY.make_inputs(problem, INTERPRET, seed=seed)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    for t in outputs.values():
        t.fill_(float("nan"))  # an element the kernel never writes stays NaN and fails the check
    FAMILY.launch(problem, config, inputs, outputs)
    result = FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs))
    assert result.ok, result.message
    return outputs


FEATURES = [
    # (label, problem fields)
    pytest.param(dict(window_left=5, window_right=3), id="window-5,3"),
    pytest.param(dict(window_left=7, causal=True), id="window-7-causal"),
    pytest.param(dict(window_left=0, window_right=0), id="window-0,0"),
    pytest.param(dict(window_left=-1, window_right=2), id="window-right-only"),
    pytest.param(dict(window_left=500, window_right=500), id="window-wider-than-sequence"),
    pytest.param(dict(softcap=1.5), id="softcap"),
    pytest.param(dict(alibi=True), id="alibi"),
    pytest.param(dict(alibi=True, softcap=2.0, window_left=9, causal=True), id="all-together"),
]
SHAPES = [(1, 4, 2, 37, 45, 16), (1, 2, 1, 50, 21, 24)]  # GQA 4:2 with Sq < Sk; MQA, Sq > Sk, odd head dim


@pytest.mark.parametrize("shape", SHAPES, ids=["37x45-gqa", "50x21-d24"])
@pytest.mark.parametrize("features", FEATURES)
def test_features_forward_and_backward(features, shape):
    fwd = FlashProblem("fwd", *shape, dtype="fp16", **features)
    run_and_check(fwd, FWD_SMALL)
    run_and_check(dataclasses.replace(fwd, direction="bwd"), BWD_SMALL)


def test_a_window_that_leaves_rows_without_keys_gives_zero_rows():
    # Sq > Sk with a left window of 1 and causal: row i sees keys i - 10 and i - 9; rows 0..8 see nothing.
    problem = FlashProblem("fwd", 1, 1, 1, 30, 21, 16, causal=True, dtype="fp32", window_left=1)
    out = run_and_check(problem, FWD_SMALL)
    assert torch.equal(out["o"][0, 0, :9], torch.zeros(9, 16))
    assert torch.isinf(out["lse"][0, 0, :9]).all() and torch.isfinite(out["lse"][0, 0, 9:]).all()
    run_and_check(dataclasses.replace(problem, direction="bwd"), BWD_SMALL)


@pytest.mark.parametrize("head_dim", [80, 96, 112])
def test_head_dims_between_powers_of_two(head_dim):
    # Padded to the next power of two inside the kernel with masks, no copies.
    fwd = FlashProblem("fwd", 1, 2, 1, 19, 33, head_dim, causal=True, dtype="fp16")
    run_and_check(fwd, FWD_SMALL)
    run_and_check(dataclasses.replace(fwd, direction="bwd"), BWD_SMALL)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_bf16_on_the_cpu_is_right(direction):
    # NOTE: the interpreter's bf16 tl.dot is wrong in triton 3.6; CPU renders upcast the dot operands.
    problem = FlashProblem(direction, 1, 4, 2, 29, 40, 32, causal=True, dtype="bf16")
    run_and_check(problem, FWD_SMALL if direction == "fwd" else BWD_SMALL)


# --- through the op ------------------------------------------------------------------------------
def _leaves(gen, *shapes, dtype=torch.float32):
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(True) for s in shapes]


def _check_against_reference(out, tensors, do, ref_fn, dtype_name, reductions):
    """out and the gradients of (out * do).sum() against ref_fn at float64 (and at the tensors' dtype for the rule)."""
    q, k, v = tensors
    wide = [t.detach().double().requires_grad_(True) for t in tensors]
    plain = [t.detach().clone().requires_grad_(True) for t in tensors]
    ref, base = ref_fn(*wide, torch.float64), ref_fn(*plain, q.dtype)
    result = fa_rule_check("o", out, ref, base, dtype_name, reductions[0])
    assert result.ok, result.message
    got = torch.autograd.grad(out, tensors, do)
    want = torch.autograd.grad(ref, wide, do.double())
    plain_grads = torch.autograd.grad(base, plain, do)
    for name, g, w, b, n in zip(("dq", "dk", "dv"), got, want, plain_grads, reductions[1:]):
        result = fa_rule_check(name, g, w, b, dtype_name, n)
        assert result.ok, result.message


# Large scales run in fp16: with logits near 40, fp32 kernels (like every log2-domain FlashAttention) round
# scale * log2(e) into the exponent and land ~1e-6 relative from torch, past the fp32 rule's floor.
@pytest.mark.parametrize("scale, dtype", [(0.0, torch.float32), (-0.3, torch.float32), (-2.5, torch.float16),
                                          (2.5, torch.float16)], ids=["zero", "negative", "large-negative", "large"])
def test_any_finite_scale_gives_finite_correct_results(scale, dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _leaves(gen, (1, 2, 13, 16), (1, 2, 21, 16), (1, 2, 21, 16), dtype=dtype)
    out = ops_flash.flash_attention(q, k, v, causal=True, scale=scale)
    assert torch.isfinite(out).all()
    do = torch.randn(out.shape, generator=gen, dtype=dtype)
    _check_against_reference(out, (q, k, v), do,
                             lambda q, k, v, dt: attention_math(q, k, v, causal=True, scale=scale, dtype=dt),
                             "fp32" if dtype == torch.float32 else "fp16", (21, 21, 26, 26))


def test_op_features_with_autograd_and_per_batch_slopes():
    gen = torch.Generator().manual_seed(2)
    q, k, v = _leaves(gen, (2, 4, 23, 16), (2, 2, 31, 16), (2, 2, 31, 16), dtype=torch.float16)
    slopes = torch.rand(2, 4, generator=gen) * 0.5  # (B, Hq): one set of slopes per batch entry
    scores = Scores(causal=False, window_left=6, window_right=2, softcap=3.0)
    out = ops_flash.flash_attention(q, k, v, window=(6, 2), softcap=3.0, alibi_slopes=slopes, scale=0.4)
    do = torch.randn(out.shape, generator=gen, dtype=torch.float16)

    def ref(q, k, v, dtype):
        return attention_math(q, k, v, scale=0.4, dtype=dtype, scores=scores, alibi_slopes=slopes.double())
    _check_against_reference(out, (q, k, v), do, ref, "fp16", (31, 31, 2 * 23, 2 * 23))


def test_return_lse_matches_logsumexp_and_carries_its_gradient():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _leaves(gen, (1, 2, 17, 16), (1, 1, 12, 16), (1, 1, 12, 16))
    out, lse = ops_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    assert lse.shape == (1, 2, 17)
    ref_lse = log2_sum_exp(q.detach().double(), k.detach().double(), causal=True, scale=0.25) * 0.6931471805599453
    seen = torch.isfinite(ref_lse)
    assert torch.isinf(lse[~seen]).all() and (~seen).sum() == 2 * 5  # Sq - Sk = 5 rows see no key
    assert torch.allclose(lse[seen].double(), ref_lse[seen], atol=1e-5)
    do, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    got = torch.autograd.grad((out, lse), (q, k, v), (do, torch.where(seen, dlse, torch.zeros_like(dlse))))
    want = attention_grads(*(t.detach().double() for t in (q, k, v)), do.double(), causal=True, scale=0.25,
                           dtype=torch.float64, dlse=torch.where(seen, dlse, torch.zeros_like(dlse)).double())
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w, atol=2e-5), (g.double() - w).abs().max()


def test_bad_feature_arguments_say_what_to_do():
    q = k = v = torch.randn(1, 2, 5, 16)
    with pytest.raises(BadInputError, match="window"):
        ops_flash.flash_attention(q, k, v, window=(3,))
    with pytest.raises(BadInputError, match="window"):
        ops_flash.flash_attention(q, k, v, window=(-2, 1))
    with pytest.raises(BadInputError, match="softcap"):
        ops_flash.flash_attention(q, k, v, softcap=-1.0)
    with pytest.raises(BadInputError, match="alibi_slopes"):
        ops_flash.flash_attention(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(BadInputError, match="alibi_slopes"):
        ops_flash.flash_attention(q, k, v, alibi_slopes=torch.ones(2, dtype=torch.float64))


# --- packed sequences --------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_varlen_family(direction, causal):
    problem = FlashProblem(direction, 3, 4, 2, 37, 29, 16, causal=causal, dtype="fp16", varlen=True)
    lens_q, lens_k = packed_lengths(problem)
    assert max(lens_q) == 37 and max(lens_k) == 29 and len(lens_q) == 3
    run_and_check(problem, FWD_SMALL if direction == "fwd" else BWD_SMALL)


def test_varlen_tma_forward_reads_each_head_rows():
    # TMA loads of packed sequences: Q through a 2-D descriptor over one head's rows (its base offset by the head),
    # K/V through 3-D ones; several query heads per key head, and sequences that end inside a tile.
    problem = FlashProblem("fwd", 3, 4, 2, 37, 29, 16, causal=True, dtype="fp16", varlen=True)
    run_and_check(problem, Config(FWD_SMALL, LOADS="tma"))


def test_varlen_tma_backward_with_features():
    # Packed sequences through the backward's TMA loads: each head's descriptor starts at its sequence's first row,
    # so the rows of the next sequence are never read; with a window, soft-capping and ALiBi.
    problem = FlashProblem("bwd", 3, 4, 2, 37, 29, 16, causal=True, dtype="fp16", varlen=True, window_left=6,
                           alibi=True, softcap=2.0)
    run_and_check(problem, Config(BWD_SMALL, LOADS="tma"))


def test_varlen_family_with_features():
    problem = FlashProblem("fwd", 3, 2, 2, 33, 40, 24, causal=True, dtype="fp16", varlen=True, window_left=6,
                           alibi=True, softcap=2.0)
    run_and_check(problem, FWD_SMALL)
    run_and_check(dataclasses.replace(problem, direction="bwd"), BWD_SMALL)


def test_varlen_op_equals_attention_of_each_sequence():
    gen = torch.Generator().manual_seed(4)
    lens_q, lens_k = [5, 17, 1, 9], [7, 17, 3, 9]  # one sequence shorter than any block; Sq != Sk
    cu_q = torch.tensor([0, 5, 22, 23, 32], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 24, 27, 36], dtype=torch.int32)
    q, k, v = _leaves(gen, (32, 4, 16), (36, 2, 16), (36, 2, 16), dtype=torch.float16)
    out, lse = ops_flash_varlen.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                       return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 32)
    do = torch.randn(out.shape, generator=gen, dtype=torch.float16)

    def ref(q, k, v, dtype):
        parts = [attention_math(qb, kb, vb, causal=True, scale=0.25, dtype=dtype)
                 for qb, kb, vb in zip(split_packed(q, cu_q), split_packed(k, cu_k), split_packed(v, cu_k))]
        return join_packed(parts)
    _check_against_reference(out, (q, k, v), do, ref, "fp16", (17, 17, 2 * 17, 2 * 17))
    want_lse = torch.cat([log2_sum_exp(qb.double(), kb.double(), causal=True, scale=0.25)[0]
                          for qb, kb in zip(split_packed(q.detach(), cu_q), split_packed(k.detach(), cu_k))], dim=1)
    seen = torch.isfinite(want_lse)
    assert torch.allclose(lse[seen].double(), want_lse[seen] * 0.6931471805599453, atol=1e-3)


def test_varlen_eager_training_calls_record_a_function_with_the_ops_gradients():
    # As flash_attention's (test_flash.py): the custom op's autograd wrapper skipped, the op's bits kept.
    gen = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 6, 19], dtype=torch.int32)
    q, k, v = _leaves(gen, (19, 4, 16), (19, 2, 16), (19, 2, 16), dtype=torch.float32)
    do = torch.randn(19, 4, 16, generator=gen)
    out = ops_flash_varlen.flash_attention_varlen(q, k, v, cu, cu, 13, 13, causal=True, scale=0.3)
    assert type(out.grad_fn).__name__ == "_EagerVarlenBackward"
    got = torch.autograd.grad(out, (q, k, v), do)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    want_o, _ = torch.ops.autotile.flash_attention_varlen_fwd(*leaves, cu, cu, 13, 13, True, 0.3)
    want = torch.autograd.grad(want_o, leaves, do)
    assert torch.equal(out, want_o)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_varlen_bad_input_says_what_to_do():
    q, k = torch.randn(10, 2, 16), torch.randn(12, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(BadInputError, match="int32"):
        ops_flash_varlen.flash_attention_varlen(q, k, k, cu.long(), cu, 6, 6)
    with pytest.raises(ShapeMismatchError, match="3-D"):
        ops_flash_varlen.flash_attention_varlen(q[None], k, k, cu, cu, 6, 6)
    with pytest.raises(BadInputError, match="max_seqlen_q"):
        ops_flash_varlen.flash_attention_varlen(q, k, k, cu, cu, 0, 6)


def test_alibi_slopes_follow_the_paper():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    assert alibi_slopes(12).shape == (12,) and (alibi_slopes(12) > 0).all()


def test_a_window_wider_than_the_call_is_a_plain_call():
    """A model's sliding window over a shorter prompt masks nothing: the op serves it as a plain call (its problem
    has no window, so the vendor op and plain winners may serve it), with the plain result; a window that masks
    keeps it, dense and packed alike."""
    import autotile

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 40, 16, generator=gen) for _ in range(3))
    for window in ((39, 0), (4095, 0), (4095, -1)):
        info = autotile.explain("flash_attention", q, k, v, causal=True, window=window)
        assert (info["problem"]["window_left"], info["problem"]["window_right"]) == (-1, -1), window
        assert torch.equal(autotile.flash_attention(q, k, v, causal=True, window=window),
                           autotile.flash_attention(q, k, v, causal=True))
    assert autotile.explain("flash_attention", q, k, v, causal=True, window=(38, 0))["problem"]["window_left"] == 38
    # Not causal: the right side counts, masking nothing from Sq - 1 on.
    info = autotile.explain("flash_attention", q, k, v, window=(100, 39))
    assert (info["problem"]["window_left"], info["problem"]["window_right"]) == (-1, -1)
    assert autotile.explain("flash_attention", q, k, v, window=(100, 38))["problem"]["window_right"] == 38
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # (40, 4, 16): one sequence
    cu = torch.tensor([0, 40], dtype=torch.int32)
    info = autotile.explain("flash_attention_varlen", *packed, cu, cu, 40, 40, causal=True, window=(4095, 0))
    assert info["problem"]["window_left"] == -1
    got = autotile.flash_attention_varlen(*packed, cu, cu, 40, 40, causal=True, window=(4095, 0))
    assert torch.allclose(got, autotile.flash_attention_varlen(*packed, cu, cu, 40, 40, causal=True))
