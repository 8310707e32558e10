"""The flash family's Gluon backward (templates/flash_gluon_bwd.py.j2) on a Hopper GPU against float64: dQ, dK, dV,
causal and not, odd lengths, more queries than keys and fewer (rows that see no key), GQA and MQA, head dims 64 and
128 and Phi-3's 96 (padded to 128), fp16, packed sequences, strided (B, S, H, D) projections, any scale, a stream-K
tail; then through the ops: the untuned backward is Gluon, dense and packed, the gradient of the log-sum-exp enters,
a CUDA graph captures it, and under torch.use_deterministic_algorithms(True) the Triton backward serves instead, the
same bits run after run.
Skipped without a Hopper GPU; tests/test_flash_gluon_bwd.py covers what the CPU can.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autotile.bench import poison
from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")]

SHAPES = [  # (batch, heads_q, heads_kv, seq_q, seq_k, head_dim)
    (2, 4, 2, 1000, 1000, 128), (1, 2, 2, 300, 300, 128), (1, 4, 1, 777, 200, 128), (1, 4, 1, 200, 777, 128),
    (2, 2, 1, 333, 555, 64), (1, 3, 3, 129, 64 + 65, 64), (2, 8, 2, 333, 517, 96), (3, 2, 2, 2100, 2100, 128),
    (2, 16, 8, 1600, 1700, 128),  # 224 tiles: one program a tile (the others above share theirs: SPLIT); not causal,
    # the 92 past the first wave end in a stream-K tail
]


def gluon_configs(problem, device):
    """The Gluon backward's configs of `problem`, fewest slots first."""
    configs = sorted((c for c in FAMILY.space(problem, device).feasible() if c["LOADS"] == GLUON_WS),
                     key=lambda c: c["num_stages"])
    assert configs, problem
    return configs


def run_checked(problem, config, inputs, scale=None) -> dict:
    outputs = FAMILY.allocate_outputs(problem, inputs)
    poison(outputs)
    if scale is None:
        FAMILY.launch(problem, config, inputs, outputs)
    else:
        FAMILY.run(problem, config, inputs, outputs, scale=scale)
    torch.cuda.synchronize()
    result = FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs))
    assert result.ok, f"{problem} {config.to_json()}: {result.message}"
    return outputs


def switched_on(monkeypatch, *switches: str):
    """Turn on the flash_space switches a test needs (features that wait for their GPU tests): the device to run on."""
    from autotile.device import cuda_device
    from autotile.families import flash_space

    for name in switches:
        monkeypatch.setattr(flash_space, name, True)
    return cuda_device()


def check_first_config(problem, device, seed: int, inputs=None) -> None:
    """The problem's Gluon config of fewest slots against float64 (each config is its own build)."""
    inputs = FAMILY.make_inputs(problem, device, seed=seed) if inputs is None else inputs
    run_checked(problem, gluon_configs(problem, device)[0], inputs)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward_matches_float64(shape):
    """bf16 on two Q/dO slots (each config is its own build: the slot counts and fp16 are checked below)."""
    from autotile.device import cuda_device

    device = cuda_device()
    for causal in (False, True):
        problem = FlashProblem("bwd", *shape, causal=causal)
        inputs = FAMILY.make_inputs(problem, device, seed=7)
        run_checked(problem, gluon_configs(problem, device)[0], inputs)


@pytest.mark.parametrize("shape, dtype", [((2, 4, 2, 1000, 1000, 128), "bf16"), ((2, 2, 1, 333, 555, 64), "bf16"),
                                          ((1, 4, 1, 777, 200, 128), "fp16")], ids=["d128", "d64", "fp16"])
def test_every_slot_count_and_fp16_match_float64(shape, dtype):
    from autotile.device import cuda_device

    device = cuda_device()
    problem = FlashProblem("bwd", *shape, causal=True, dtype=dtype)
    inputs = FAMILY.make_inputs(problem, device, seed=9)
    configs = gluon_configs(problem, device)
    assert dtype == "fp16" or len(configs) >= 2
    for config in configs if dtype == "bf16" else configs[:1]:
        run_checked(problem, config, inputs)


@pytest.mark.parametrize("shape", [(5, 8, 2, 700, 900, 128), (3, 4, 4, 1500, 1500, 64), (40, 2, 1, 300, 300, 128),
                                   (4, 8, 8, 600, 600, 96)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward_of_packed_sequences_matches_float64(shape):
    """Packed (varlen) sequences of random lengths up to the given ones: boxes that read into the next sequence's
    rows (its queries masked by the padded LSE, its keys by the key mask), each sequence's own causal diagonal, tiles
    past a short sequence's keys skipped, and the LSE's rows padded per sequence."""
    from autotile.device import cuda_device

    device = cuda_device()
    for causal in (False, True):
        problem = FlashProblem("bwd", *shape, causal=causal, varlen=True)
        inputs = FAMILY.make_inputs(problem, device, seed=11)
        run_checked(problem, gluon_configs(problem, device)[0], inputs)


def test_gluon_backward_reads_strided_projections():
    from autotile.device import cuda_device

    device = cuda_device()
    problem = FlashProblem("bwd", 2, 8, 2, 777, 901, 128, causal=True)
    inputs = FAMILY.make_inputs(problem, device, seed=3)
    for name in ("q", "k", "v", "o", "do"):
        # (B, S, H, D) storage, as a projection writes it, seen as (B, H, S, D).
        t = inputs[name]
        inputs[name] = t.transpose(1, 2).contiguous().transpose(1, 2)
    for config in gluon_configs(problem, device)[:1]:
        run_checked(problem, config, inputs)


def _attend64(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v.double().repeat_interleave(group, 1), lse


@pytest.mark.parametrize("scale", [-0.07, 0.3])
def test_gluon_backward_takes_any_scale(scale):
    from autotile.device import cuda_device

    device = cuda_device()
    problem = FlashProblem("bwd", 2, 4, 2, 600, 700, 128, causal=True)
    inputs = FAMILY.make_inputs(problem, device, seed=5)
    leaves = [inputs[n].detach().double().requires_grad_() for n in "qkv"]
    o, lse = _attend64(*leaves, True, scale)
    inputs["o"] = o.detach().to(inputs["q"].dtype)
    inputs["lse"] = (lse.detach() * 1.4426950408889634).float().contiguous()
    want = torch.autograd.grad(o, leaves, inputs["do"].double())
    for config in gluon_configs(problem, device)[:1]:
        outputs = FAMILY.allocate_outputs(problem, inputs)
        poison(outputs)
        FAMILY.run(problem, config, inputs, outputs, scale=scale)
        torch.cuda.synchronize()
        for name, w in zip(("dq", "dk", "dv"), want):
            err = (outputs[name].double() - w).abs().max().item()
            assert err < 3e-2 * max(1.0, w.abs().max().item()), (scale, name, err, config.to_json())


@pytest.fixture
def family_only(monkeypatch, tmp_path):
    """The op with generated kernels only and no tuned winners: its untuned backward."""
    from autotile.runtime import dispatch

    monkeypatch.setenv("AUTOTILE_VENDOR", "0")
    monkeypatch.setenv("AUTOTILE_DB", f"sqlite:///{tmp_path / 'empty.sqlite'}")
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


@pytest.fixture
def gluon_plans(monkeypatch):
    """Counts the Gluon backward plans the family builds."""
    from autotile.families import flash

    built = []
    original = flash.gluon_backward_plan

    def counted(*args, **kwargs):
        built.append(args[1])
        return original(*args, **kwargs)
    monkeypatch.setattr(flash, "gluon_backward_plan", counted)
    return built


def _grads(q, k, v, do, *, with_lse=False):
    import autotile

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if with_lse:
        o, lse = autotile.flash_attention(*leaves, causal=True, return_lse=True)
        loss = (o.float() * do.float()).sum() + lse.sum()
    else:
        o = autotile.flash_attention(*leaves, causal=True)
        loss = (o.float() * do.float()).sum()
    return torch.autograd.grad(loss, leaves)


def _inputs(seed, batch=1, heads_q=8, heads_kv=2, seq=2048, head_dim=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads_q, seq, head_dim, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(batch, heads_kv, seq, head_dim, device="cuda", generator=gen).bfloat16() for _ in range(2))
    return q, k, v, torch.randn(q.shape, device="cuda", generator=gen).bfloat16()


@pytest.mark.parametrize("with_lse", [False, True], ids=["o", "o-and-lse"])
def test_the_ops_untuned_backward_is_gluon_and_matches_float64(family_only, gluon_plans, with_lse):
    q, k, v, do = _inputs(1)
    got = _grads(q, k, v, do, with_lse=with_lse)
    assert len(gluon_plans) == 1 and gluon_plans[0].direction == "bwd"
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, lse = _attend64(*leaves, True, q.shape[-1] ** -0.5)
    loss = (o * do.double()).sum() + (lse.sum() if with_lse else 0)
    want = torch.autograd.grad(loss, leaves)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        err = (g.double() - w).abs().max().item()
        assert err < 2e-2 * max(1.0, w.abs().max().item()), (name, err)


def test_the_packed_ops_backward_is_gluon_and_takes_the_lse_gradient(family_only, gluon_plans):
    import autotile

    gen = torch.Generator(device="cuda").manual_seed(5)
    lengths = [700, 1500, 33, 1024]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    total, heads_q, heads_kv, dim = sum(lengths), 8, 2, 128
    q = torch.randn(total, heads_q, dim, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(total, heads_kv, dim, device="cuda", generator=gen).bfloat16() for _ in range(2))
    do = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = autotile.flash_attention_varlen(*leaves, cu, cu, max(lengths), max(lengths), causal=True,
                                             return_lse=True)
    got = torch.autograd.grad((o.float() * do.float()).sum() + lse.sum(), leaves)
    assert len(gluon_plans) == 1 and gluon_plans[0].varlen
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        piece = [t[start:end].transpose(0, 1)[None].double().requires_grad_() for t in (q, k, v)]
        o64, lse64 = _attend64(*piece, True, dim ** -0.5)
        loss = (o64 * do[start:end].transpose(0, 1)[None].double()).sum() + lse64.sum()
        want = torch.autograd.grad(loss, piece)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            g = g[start:end].transpose(0, 1)[None].double()
            err = (g - w).abs().max().item()
            assert err < 2e-2 * max(1.0, w.abs().max().item()), (name, end - start, err)


def test_deterministic_mode_serves_the_triton_backward_bit_for_bit(family_only, gluon_plans):
    q, k, v, do = _inputs(2)
    torch.use_deterministic_algorithms(True)
    try:
        first, again = _grads(q, k, v, do), _grads(q, k, v, do)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not gluon_plans
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    plain = _grads(q, k, v, do)  # deterministic mode off: the Gluon backward serves (a plan of its own)
    assert len(gluon_plans) == 1
    assert all((a.float() - b.float()).abs().max().item() < 5e-2 for a, b in zip(first, plain))


def test_tiles_head_by_head_match_float64():
    """Short sequences on many programs take their tiles head by head (flash_launch.gluon_backward_head_major):
    4 key blocks of 100 (batch, KV head) pairs, 400 programs, odd lengths, Sq != Sk."""
    from autotile.device import cuda_device
    from autotile.families.flash_launch import gluon_backward_head_major

    device = cuda_device()
    for causal in (False, True):
        problem = FlashProblem("bwd", 50, 4, 2, 300, 450, 128, causal=causal)
        assert gluon_backward_head_major(4, 4 * 50 * 2, device.sm_count, False, causal=causal, q_do_bytes=0)
        inputs = FAMILY.make_inputs(problem, device, seed=11)
        run_checked(problem, gluon_configs(problem, device)[0], inputs)


@pytest.mark.parametrize("shape, sms", [
    ((1, 3, 3, 1000, 1000, 128), 10),  # 24 tiles key block first: 4 in the tail, shares of 6-7 steps across tiles
    ((2, 8, 2, 700, 900, 128), 5),  # GQA head by head: 2 tiles of 4 heads x 11 blocks, shares across heads
    ((1, 4, 2, 333, 555, 64), 4),  # head dim 64
    ((2, 4, 4, 300, 300, 96), 5),  # Phi-3's head dim, padded; 4 tiles' 20 steps on 5 programs
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"{v}sms")
def test_a_stream_k_tail_matches_float64(monkeypatch, shape, sms):
    """Even tiles past the last whole wave, shared by one program an SM (flash_launch.gluon_backward_tail): as if the
    GPU had `sms` SMs, with the tail's overhead taken as nothing so that small calls have one."""
    from autotile.device import cuda_device
    from autotile.families import flash_launch

    device = cuda_device()
    few = dataclasses.replace(device, sm_count=sms)
    monkeypatch.setattr(flash_launch, "current_device", lambda *_: few)
    monkeypatch.setattr(flash_launch, "TAIL_OVERHEAD_STEPS", 0)
    monkeypatch.setattr(flash_launch, "TAIL_MIN_GAIN", 0.0)
    problem = FlashProblem("bwd", *shape, causal=False)
    schedule = flash_launch.gluon_backward_problem_schedule(problem, sms)
    assert schedule.tail and schedule.split == 1, schedule
    inputs = FAMILY.make_inputs(problem, device, seed=13)
    run_checked(problem, gluon_configs(problem, device)[0], inputs)


def test_a_cuda_graph_captures_the_gluon_backward_without_syncs(family_only, gluon_plans):
    from autotile.device import cuda_device

    device = cuda_device()
    problem = FlashProblem("bwd", 1, 8, 2, 2048, 2048, 128, causal=True)
    config = FAMILY.default_config(problem, device)
    assert config["LOADS"] == GLUON_WS
    inputs = FAMILY.make_inputs(problem, device, seed=4)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    plan, args = FAMILY._planned(problem, config, inputs, outputs, scale=problem.head_dim ** -0.5, keep=True)
    plan(*args)  # binds, outside the capture
    torch.cuda.synchronize()
    poison(outputs)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            plan(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    result = FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs))
    assert result.ok, result.message


def test_the_untuned_backward_is_gluon_at_head_dims_64_to_128_and_triton_at_256():
    from autotile.device import cuda_device

    device = cuda_device()
    base = FlashProblem("bwd", 1, 8, 2, 4096, 4096, 128, causal=True)
    for change in (dict(), dict(seq_q=512, seq_k=512), dict(head_dim=64), dict(head_dim=96)):
        assert FAMILY.default_config(dataclasses.replace(base, **change), device)["LOADS"] == GLUON_WS, change
    assert FAMILY.default_config(dataclasses.replace(base, head_dim=256), device)["LOADS"] != GLUON_WS


@pytest.mark.parametrize("window", [0, 63, 300])
@pytest.mark.parametrize("shape", [(2, 4, 2, 1000, 1000, 128), (1, 4, 1, 200, 777, 128), (2, 2, 1, 333, 555, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward_windows_as_float64(monkeypatch, shape, window):
    """Causal sliding windows in the Gluon backward (LEFT_BOUND): each tile's query blocks end where their windows
    leave its keys; with Sk > Sq + window the first keys are seen by no query (dK and dV zero); tiles shared by
    programs (SPLIT) split only the blocks that see them."""
    device = switched_on(monkeypatch, "GLUON_BWD_WINDOW")
    check_first_config(FlashProblem("bwd", *shape, causal=True, window_left=window), device, seed=5)


def test_gluon_backward_windows_of_packed_sequences_match_float64(monkeypatch):
    device = switched_on(monkeypatch, "GLUON_BWD_WINDOW")
    check_first_config(FlashProblem("bwd", 5, 8, 2, 700, 900, 128, causal=True, varlen=True, window_left=200), device,
                       seed=13)


@pytest.mark.parametrize("window", [(63, 64), (300, 5), (-1, 100), (130, -1), (0, 0)], ids=lambda w: f"{w[0]},{w[1]}")
@pytest.mark.parametrize("shape", [(2, 4, 2, 1000, 1000, 128), (1, 4, 1, 200, 777, 128), (2, 2, 1, 333, 555, 64),
                                   (1, 4, 4, 777, 200, 64)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward_non_causal_windows_as_float64(monkeypatch, shape, window):
    """Windows of calls that are not causal (RIGHT_WINDOW: the right side an argument; LEFT_BOUND): a tile walks the
    query blocks from the first whose window reaches its keys to the last; keys no query sees get zero dK and dV.
    flash_space.GLUON_BWD_NON_CAUSAL_WINDOW went on when this passed."""
    device = switched_on(monkeypatch, "GLUON_BWD_NON_CAUSAL_WINDOW")
    check_first_config(FlashProblem("bwd", *shape, window_left=window[0], window_right=window[1]), device, seed=11)


def test_gluon_backward_non_causal_windows_of_packed_sequences_match_float64(monkeypatch):
    device = switched_on(monkeypatch, "GLUON_BWD_NON_CAUSAL_WINDOW")
    check_first_config(FlashProblem("bwd", 5, 8, 2, 700, 900, 64, varlen=True, window_left=64, window_right=64),
                       device, seed=17)


@pytest.mark.parametrize("shape", [(2, 4, 2, 1000, 1000, 128), (1, 4, 1, 200, 777, 128), (2, 2, 1, 333, 555, 64),
                                   (2, 8, 2, 333, 517, 96)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward_alibi_as_float64(monkeypatch, shape):
    """ALiBi in the Gluon backward (ALIBI): causal, the bias split between the keys and the rows' padded LSE; not
    causal, the distance an element. Slopes (Hq,) as make_inputs gives them, then (B, Hq).
    flash_space.GLUON_BWD_ALIBI went on when this and the test below passed."""
    device = switched_on(monkeypatch, "GLUON_BWD_ALIBI")
    for causal in (True, False):
        problem = FlashProblem("bwd", *shape, causal=causal, alibi=True)
        inputs = FAMILY.make_inputs(problem, device, seed=29)
        check_first_config(problem, device, 29, inputs)
        gen = torch.Generator(device="cuda").manual_seed(29)
        inputs["alibi"] = torch.rand(shape[0], shape[1], device="cuda", generator=gen) * 0.25
        # O and LSE of the new slopes (make_inputs's are the first slopes')
        with torch.no_grad():
            o, lse = FAMILY._attend(problem, inputs, inputs["q"], inputs["k"], inputs["v"], dtype=torch.float32,
                                    lse=True)
        inputs["o"].copy_(o)
        inputs["lse"].copy_(lse)
        check_first_config(problem, device, 29, inputs)


@pytest.mark.parametrize("features", [dict(causal=True, varlen=True), dict(causal=True, window_left=200),
                                      dict(window_left=64, window_right=64)],
                         ids=["packed", "causal-window", "two-sided-window"])
def test_gluon_backward_alibi_with_other_features_as_float64(monkeypatch, features):
    device = switched_on(monkeypatch, "GLUON_BWD_ALIBI", "GLUON_BWD_NON_CAUSAL_WINDOW")
    check_first_config(FlashProblem("bwd", 5, 8, 2, 700, 900, 128, alibi=True, **features), device, seed=31)


@pytest.mark.parametrize("softcap", [1.0, 50.0])
@pytest.mark.parametrize("shape", [(2, 4, 2, 1000, 1000, 128), (1, 4, 1, 200, 777, 128), (2, 2, 1, 333, 555, 64),
                                   (2, 8, 2, 333, 517, 96)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_backward_soft_caps_as_float64(monkeypatch, shape, softcap):
    """Soft-capping in the Gluon backward (SOFTCAP: tanh.approx.f32 again in P^T; P^T times the cap's derivative
    through shared memory), causal and not, every slot count the space offers.
    flash_space.GLUON_BWD_SOFTCAP went on when this and the test below passed."""
    device = switched_on(monkeypatch, "GLUON_BWD_SOFTCAP")
    for causal in (True, False):
        problem = FlashProblem("bwd", *shape, causal=causal, softcap=softcap)
        inputs = FAMILY.make_inputs(problem, device, seed=37)
        for config in gluon_configs(problem, device):
            run_checked(problem, config, inputs)


@pytest.mark.parametrize("features", [dict(varlen=True), dict(window_left=200)], ids=["packed", "gemma2-local"])
def test_gluon_backward_soft_caps_with_other_features_as_float64(monkeypatch, features):
    """Gemma-2's local layers (a causal window beside the cap) and packed sequences."""
    device = switched_on(monkeypatch, "GLUON_BWD_SOFTCAP")
    check_first_config(FlashProblem("bwd", 5, 8, 2, 700, 900, 128, causal=True, softcap=30.0, **features), device,
                       seed=41)
