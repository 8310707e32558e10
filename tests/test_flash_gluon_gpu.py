"""The flash family's Gluon forward (templates/flash_gluon_ws.py.j2) on a Hopper GPU against float64: O and LSE,
causal and not, odd lengths, more queries than keys (rows that see no key), GQA and MQA, the three head dims and two
padded ones (96, 80), padded ones in two parts (HEAD_SPLIT: 96, 80, 48), tiles in head groups, O through
buffers of its own, fp16,
packed sequences, any scale, a window's right side, strided (B, S, H, D) projections seen through
.transpose(1, 2), and the same bits run after run. Skipped without a Hopper GPU; tests/test_flash_gluon.py covers what the CPU can.
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
    (2, 4, 4, 113, 203, 128), (1, 2, 2, 799, 3, 128), (2, 8, 2, 1000, 1000, 128), (1, 8, 1, 257, 511, 256),
    (1, 4, 4, 300, 1030, 64), (3, 6, 2, 65, 4000, 64),
    (2, 8, 2, 333, 517, 96), (1, 4, 4, 250, 700, 80),  # padded head dims: TMA's zeros fill the tiles' columns
]


def gluon_configs(problem, device):
    """For each query tile and key block the space allows (two or three consumer warpgroups), its deepest pipeline."""
    found = {}
    for c in FAMILY.space(problem, device).feasible():
        tile = (c["BLOCK_M"], c["BLOCK_N"])
        if c["LOADS"] == GLUON_WS and c["num_stages"] > found.get(tile, {}).get("num_stages", 0):
            found[tile] = c
    assert found, problem
    return list(found.values())


def run_checked(problem, config, inputs) -> dict:
    outputs = FAMILY.allocate_outputs(problem, inputs)
    poison(outputs)
    FAMILY.launch(problem, config, inputs, outputs)
    torch.cuda.synchronize()
    result = FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs))
    assert result.ok, f"{problem} {config.to_json()}: {result.message}"
    return outputs


def check_every_gluon_config(shape, seed: int, **features) -> None:
    """Causal and not, every Gluon config the space offers for the problem, each run against float64."""
    from autotile.device import cuda_device

    device = cuda_device()
    for causal in (False, True):
        problem = FlashProblem("fwd", *shape, causal=causal, **features)
        inputs = FAMILY.make_inputs(problem, device, seed=seed)
        for config in gluon_configs(problem, device):
            run_checked(problem, config, inputs)


def check_static_and_queued(problem, device, seed: int, switch: str, where_it_applies: bool = False) -> None:
    """Every Gluon config the space offers for `problem`, in static rounds and from the tile queue, each rendered with
    `switch` on (`where_it_applies`: those that render it, at least one), against float64 twice with the same bits."""
    inputs = FAMILY.make_inputs(problem, device, seed=seed)
    checked = 0
    for config in gluon_configs(problem, device):
        for queued in (False, True):
            run = FAMILY.space(problem, device).admit(dict(config, TILE_QUEUE=queued))
            assert run is not None, config.to_json()
            if not FAMILY.render_switches(problem, run)[switch]:
                assert where_it_applies, config.to_json()
                continue
            checked += 1
            first = run_checked(problem, run, inputs)
            again = run_checked(problem, run, inputs)
            assert torch.equal(first["o"], again["o"]) and torch.equal(first["lse"], again["lse"]), run.to_json()
    assert checked, f"no Gluon config of {problem} renders {switch}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_matches_float64(shape, dtype):
    from autotile.device import cuda_device

    device = cuda_device()
    for causal in (False, True):
        problem = FlashProblem("fwd", *shape, causal=causal, dtype=dtype)
        inputs = FAMILY.make_inputs(problem, device, seed=7)
        for config in gluon_configs(problem, device):
            first = run_checked(problem, config, inputs)
            again = run_checked(problem, config, inputs)
            assert torch.equal(first["o"], again["o"]) and torch.equal(first["lse"], again["lse"]), config.to_json()


@pytest.mark.parametrize("shape", [(5, 8, 2, 700, 900, 128), (3, 4, 4, 1500, 1500, 64), (9, 4, 1, 130, 2000, 256),
                                   (40, 2, 1, 300, 300, 128), (4, 8, 8, 600, 600, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_packed_sequences_match_float64(shape):
    """Packed (varlen) sequences of random lengths up to the given ones: only tiles that hold rows are numbered (40
    sequences: more than the producer warp's 32 lanes take at once), keys of the next sequence masked, each
    sequence's own causal diagonal."""
    check_every_gluon_config(shape, 11, varlen=True)


def test_gluon_ws_reads_strided_projections_and_a_right_window():
    from autotile.device import cuda_device

    device = cuda_device()
    base = FlashProblem("fwd", 2, 8, 2, 777, 901, 128, causal=True)
    for problem in (base, dataclasses.replace(base, causal=False, window_right=37)):
        gen = torch.Generator(device="cpu").manual_seed(3)
        # (B, S, H, D) storage, as a projection writes it, seen as (B, H, S, D).
        inputs = {name: torch.randn(problem.batch, seq, heads, problem.head_dim, generator=gen).to(
                      device.torch_device, torch.bfloat16).transpose(1, 2)
                  for name, seq, heads in (("q", problem.seq_q, problem.heads_q), ("k", problem.seq_k, problem.heads_kv),
                                           ("v", problem.seq_k, problem.heads_kv))}
        for config in gluon_configs(problem, device):
            run_checked(problem, config, inputs)


@pytest.mark.parametrize("scale", [-0.07, 0.0, 0.3])
def test_gluon_ws_takes_any_scale(scale):
    """A negative scale (NEGATE_Q: the logits are scaled before their maxima are taken), zero (uniform weights over
    the keys a row sees) and a large one; causal with more queries than keys, so some rows see no key."""
    from autotile.device import cuda_device

    device = cuda_device()
    problem = FlashProblem("fwd", 2, 4, 2, 600, 300, 128, causal=True)
    inputs = FAMILY.make_inputs(problem, device, seed=5)
    q, k, v = (inputs[n].double() for n in "qkv")
    want, want_lse = FAMILY._attend(problem, inputs, q, k, v, dtype=torch.float64, lse=True, scale=scale)
    for config in gluon_configs(problem, device):
        outputs = FAMILY.allocate_outputs(problem, inputs)
        poison(outputs)
        FAMILY.run(problem, config, inputs, outputs, scale=scale)
        torch.cuda.synchronize()
        assert (outputs["o"].double() - want).abs().max().item() < 2e-2, (scale, config.to_json())
        seen = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(outputs["lse"]), seen), (scale, config.to_json())
        assert (outputs["lse"].double()[seen] - want_lse[seen]).abs().max().item() < 1e-3, (scale, config.to_json())


@pytest.mark.parametrize("varlen, head_dim", [(False, 128), (True, 128), (False, 256)],
                         ids=["dense", "packed", "dense-d256"])
def test_the_served_forward_takes_descriptors_of_each_calls_tensors(monkeypatch, tmp_path, varlen, head_dim):
    """The op's kept plan encodes the TMA descriptors once per base address: calls with new q, k, v (and so new
    outputs) and a CUDA graph's own output must each read and write their own tensors, with no host sync. Two
    sequences at head dim 128 take their tiles from a queue (TILE_QUEUE); head dim 256 runs one split K/V slot."""
    import autotile
    from autotile.runtime import dispatch

    monkeypatch.setenv("AUTOTILE_VENDOR", "0")
    monkeypatch.setenv("AUTOTILE_DB", f"sqlite:///{tmp_path / 'empty.sqlite'}")
    dispatch.clear_cache()
    batch, heads_q, heads_kv, seq = 2, 8, 2, 700
    lengths = torch.tensor([0, seq, 2 * seq - 123], device="cuda", dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(9)

    def inputs():
        if varlen:
            return [torch.randn(int(lengths[-1]), h, head_dim, device="cuda", generator=gen).bfloat16()
                    for h in (heads_q, heads_kv, heads_kv)]
        return [torch.randn(batch, h, seq, head_dim, device="cuda", generator=gen).bfloat16()
                for h in (heads_q, heads_kv, heads_kv)]

    def attend(q, k, v):
        if varlen:
            return autotile.flash_attention_varlen(q, k, v, lengths, lengths, seq, seq, causal=True)
        return autotile.flash_attention(q, k, v, causal=True)

    def check(q, k, v, got):
        if varlen:  # each packed sequence as a batch of one
            pieces = [(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
                       got[s:e].transpose(0, 1)[None]) for s, e in zip(lengths[:-1].tolist(), lengths[1:].tolist())]
        else:
            pieces = [(q, k, v, got)]
        for q, k, v, got in pieces:
            group = q.shape[1] // k.shape[1]
            want = torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1),
                is_causal=True)
            assert (got.double() - want).abs().max().item() < 2e-2

    q, k, v = inputs()
    if varlen:
        served = autotile.explain("flash_attention_varlen", q, k, v, lengths, lengths, seq, seq, causal=True)
    else:
        served = autotile.explain("flash_attention", q, k, v, causal=True)
    assert served["config"]["LOADS"] == GLUON_WS, served
    assert served["config"]["TILE_QUEUE"] == (head_dim == 128), served
    assert (served["config"]["num_stages"] == 1) == (head_dim == 256), served
    for _ in range(3):
        q, k, v = inputs()
        check(q, k, v, attend(q, k, v))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = attend(q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fresh = inputs()
    for t, new in zip((q, k, v), fresh):
        t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    check(q, k, v, out)
    dispatch.clear_cache()


@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (3, 4, 4, 777, 900, 64), (2, 4, 2, 600, 600, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_tiles_taken_from_a_queue_match_float64_launch_after_launch(shape):
    """TILE_QUEUE (tiles from an atomic queue): every tile computed once, and the queue left at zero for the next
    launch, which would otherwise skip tiles (poisoned outputs show them); causal and not, dense and packed."""
    from autotile.device import cuda_device

    device = cuda_device()
    for causal, varlen in ((True, False), (False, False), (True, True)):
        problem = FlashProblem("fwd", *shape, causal=causal, varlen=varlen)
        inputs = FAMILY.make_inputs(problem, device, seed=13)
        for config in (FAMILY.validate_config(problem, device, dict(c, TILE_QUEUE=True))
                       for c in gluon_configs(problem, device)):
            first = run_checked(problem, config, inputs)
            for _ in range(3):
                again = run_checked(problem, config, inputs)
            assert torch.equal(first["o"], again["o"]), config.to_json()


@pytest.mark.parametrize("softcap", [1.0, 50.0])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 8, 4, 257, 511, 256), (1, 4, 4, 300, 1030, 64),
                                   (2, 8, 2, 333, 517, 96)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_soft_caps_as_float64(monkeypatch, shape, softcap):
    """Soft-capping in the Gluon forward (tanh.approx.f32, as FlashAttention-3's), every tile and key block the
    space offers, against float64: what lets soft-capped calls take it (flash_space.GLUON_SOFTCAP)."""
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "GLUON_SOFTCAP", True)
    check_every_gluon_config(shape, 9, softcap=softcap)


@pytest.mark.parametrize("window", [0, 1, 63, 300])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 8, 4, 257, 511, 256), (1, 4, 4, 700, 1030, 64),
                                   (3, 6, 2, 65, 4000, 64), (2, 8, 2, 333, 517, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_windows_as_float64(monkeypatch, shape, window):
    """Sliding windows in the Gluon forward (LEFT_BOUND: each tile's loads and key loop start at its first row's
    window), causal and left-only, every tile and key block the space offers, against float64: what lets windowed
    calls take it (flash_space.GLUON_WINDOW). Windows of 0 and 1 keys leave most key blocks of a tile masked."""
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "GLUON_WINDOW", True)
    check_every_gluon_config(shape, 5, window_left=window)


@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 4, 4, 700, 1030, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_two_sided_windows_as_float64(monkeypatch, shape):
    """A window on both sides of the diagonal (not causal): the loop runs from the first row's left edge to the last
    row's right edge, and a block may need both masks. What lets such calls take it (GLUON_TWO_SIDED_WINDOW)."""
    from autotile.device import cuda_device
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "GLUON_TWO_SIDED_WINDOW", True)
    device = cuda_device()
    for left, right in ((50, 30), (0, 0), (200, 1)):
        problem = FlashProblem("fwd", *shape, window_left=left, window_right=right)
        inputs = FAMILY.make_inputs(problem, device, seed=19)
        for config in gluon_configs(problem, device):
            run_checked(problem, config, inputs)


@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 8, 4, 257, 511, 256), (1, 4, 4, 300, 1030, 64),
                                   (2, 8, 2, 333, 517, 96)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_alibi_as_float64(monkeypatch, shape):
    """ALiBi in the Gluon forward (ALIBI: -slope * |i + Sk - Sq - j| added to the scaled logits), causal and not,
    every tile and key block the space offers, against float64. NOTE: flash_space.GLUON_ALIBI stays off until this
    and the test below pass."""
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "GLUON_ALIBI", True)
    check_every_gluon_config(shape, 21, alibi=True)


@pytest.mark.parametrize("features", [dict(causal=True, softcap=30.0), dict(window_left=100, window_right=30),
                                      dict(causal=True, varlen=True, window_left=200)],
                         ids=["soft-capped", "two-sided-window", "packed-window"])
def test_gluon_ws_alibi_with_slopes_per_sequence_and_other_features_as_float64(monkeypatch, features):
    """Slopes (B, Hq), one row a sequence, beside soft-capping, a two-sided window and packed sequences."""
    from autotile.device import cuda_device
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "GLUON_ALIBI", True)
    monkeypatch.setattr(flash_space, "GLUON_TWO_SIDED_WINDOW", True)
    device = cuda_device()
    problem = FlashProblem("fwd", 3, 8, 2, 700, 900, 128, alibi=True, **features)
    inputs = FAMILY.make_inputs(problem, device, seed=23)
    gen = torch.Generator(device="cuda").manual_seed(23)
    inputs["alibi"] = torch.rand(3, 8, device="cuda", generator=gen) * 0.25
    for config in gluon_configs(problem, device):
        run_checked(problem, config, inputs)


@pytest.mark.parametrize("shape", [(5, 8, 2, 700, 900, 128), (9, 4, 1, 130, 2000, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_windows_soft_capped_packed_and_queued_as_float64(monkeypatch, shape):
    """Gemma-2's local layers (a window and soft-capping) dense and packed, static rounds and the tile queue."""
    from autotile.device import cuda_device
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "GLUON_WINDOW", True)
    device = cuda_device()
    for varlen in (False, True):
        problem = FlashProblem("fwd", *shape, causal=True, varlen=varlen, window_left=200, softcap=30.0)
        inputs = FAMILY.make_inputs(problem, device, seed=17)
        for config in gluon_configs(problem, device):
            for queued in (False, True):
                run_checked(problem, FAMILY.validate_config(problem, device, dict(config, TILE_QUEUE=queued)), inputs)


@pytest.mark.parametrize("features", [{}, dict(varlen=True), dict(softcap=30.0), dict(window_left=100)],
                         ids=["dense", "packed", "softcap", "window"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 333, 517, 96), (1, 4, 4, 250, 700, 80), (3, 6, 2, 65, 1000, 48),
                                   (4, 8, 8, 600, 600, 96)], ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_head_split_as_float64(monkeypatch, shape, features):
    """Padded head dims in two parts (HEAD_SPLIT: 96 = 64 + 32, 80 = 64 + 16, 48 = 32 + 16), causal and not, every
    tile and key block the space offers, against float64, the same bits twice: what lets flash_space.HEAD_SPLIT_TAILS
    take a tail and HEAD_SPLIT_WITH_FEATURES be turned on."""
    from autotile.device import cuda_device
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "GLUON_HEAD_SPLIT", True)
    monkeypatch.setattr(flash_space, "HEAD_SPLIT_TAILS", (16, 32))
    monkeypatch.setattr(flash_space, "HEAD_SPLIT_WITH_FEATURES", True)
    device = cuda_device()
    for causal in (False, True):
        check_static_and_queued(FlashProblem("fwd", *shape, causal=causal, **features), device, 13, "HEAD_SPLIT")


@pytest.mark.parametrize("group", [1, 5, 1000], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("shape", [(3, 8, 2, 700, 900, 128), (2, 8, 8, 333, 517, 96), (1, 8, 4, 257, 511, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_head_groups_as_float64(monkeypatch, shape, group):
    """Tiles in groups of heads (HEAD_GROUPS): one head at a time, groups that do not divide the heads, and one group
    of them all; causal, dense and packed (random lengths), static rounds and the queue, every tile and key block,
    against float64 (poisoned outputs show a tile skipped), launch after launch: what lets
    flash_space.FORWARD_HEAD_GROUPS and FORWARD_HEAD_GROUPS_PACKED be turned on. (A right window alone and packed
    calls without a mask take the same orders.)"""
    from autotile.device import cuda_device
    from autotile.families import flash_launch, flash_space

    monkeypatch.setattr(flash_space, "FORWARD_HEAD_GROUPS", True)
    monkeypatch.setattr(flash_space, "FORWARD_HEAD_GROUPS_PACKED", True)
    monkeypatch.setattr(flash_launch, "forward_head_group", lambda problem, config, total_keys=0: min(
        group, problem.heads_q if problem.varlen else problem.batch * problem.heads_q))
    device = cuda_device()
    for features in (dict(causal=True), dict(causal=True, varlen=True)):
        check_static_and_queued(FlashProblem("fwd", *shape, **features), device, 17, "HEAD_GROUPS")


@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (3, 4, 4, 777, 900, 64), (2, 8, 8, 333, 517, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_ws_o_buffer_as_float64(monkeypatch, shape):
    """O through each warpgroup's own buffer (O_BUFFER), its TMA store waited for a tile later: causal and not, dense
    and packed, static rounds and the queue, every tile and key block it has room beside, against float64 (poisoned
    outputs show a store lost), launch after launch: what lets flash_space.FORWARD_O_BUFFER be turned on."""
    from autotile.device import cuda_device
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "FORWARD_O_BUFFER", True)
    device = cuda_device()
    for features in (dict(causal=True), dict(), dict(causal=True, varlen=True)):
        check_static_and_queued(FlashProblem("fwd", *shape, **features), device, 19, "O_BUFFER", where_it_applies=True)
