"""The flash family's Gluon backward (templates/flash_gluon_bwd.py.j2) on the CPU: where the backward's space offers
it, the structure its configs keep, where it is the untuned default, its Triton kernels (the preprocess's padded rows,
dQ's cast, the partials' reduction) under the interpreter, and its kernels compiled for sm90 with Triton's
own ptxas: within shared memory (and the space's estimate of it), few spills in the key loop, dQ added by a TMA
reduction.

Gluon kernels do not run under Triton's interpreter; tests/test_flash_gluon_bwd_gpu.py runs them against float64.
The compile runs in a child process (this one runs the interpreter).
"""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from autotile.device import planned_device
from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem, gluon_bwd_smem

H200 = planned_device("h200")
LLAMA_4K = FlashProblem("bwd", 1, 32, 8, 4096, 4096, 128, causal=True)


def gluon_configs(problem, device):
    return [c for c in FAMILY.space(problem, device).feasible() if c["LOADS"] == GLUON_WS]


@pytest.mark.parametrize("change", [
    dict(dtype="fp32"), dict(head_dim=256), dict(head_dim=100), dict(aligned=False),
    dict(softcap=50.0, alibi=True),  # (each alone is the Gluon backward's; together, the Triton one's)
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_gluon_ws_backward_is_infeasible_where_it_does_not_apply(change):
    problem = dataclasses.replace(LLAMA_4K, **change)
    assert not gluon_configs(problem, H200)
    assert FAMILY.space(problem, H200).feasible()  # the Triton backward still takes it


@pytest.mark.parametrize("window", [dict(window_left=256), dict(window_right=64), dict(window_left=64, window_right=64),
                                    dict(window_left=0, window_right=0)], ids=lambda w: ",".join(map(str, w.values())))
def test_non_causal_windows_take_the_gluon_backward_behind_their_switch(monkeypatch, window):
    """GLUON_BWD_NON_CAUSAL_WINDOW (on since its GPU tests passed) offers the Gluon backward to windows of calls that
    are not causal: the right side renders as an argument (RIGHT_WINDOW), the left as causal windows' (LEFT_BOUND)."""
    from autotile.families import flash_space
    from autotile.render import render_source

    problem = dataclasses.replace(LLAMA_4K, causal=False, heads_kv=32, **window)
    monkeypatch.setattr(flash_space, "GLUON_BWD_NON_CAUSAL_WINDOW", False)
    assert not gluon_configs(problem, H200)
    monkeypatch.setattr(flash_space, "GLUON_BWD_NON_CAUSAL_WINDOW", True)
    configs = gluon_configs(problem, H200)
    assert configs
    switches = FAMILY.render_switches(problem, configs[0])
    assert switches["RIGHT_WINDOW"] == (problem.window_right >= 0)
    assert switches["LEFT_BOUND"] == (problem.window_left >= 0)
    source = render_source("flash_gluon_bwd.py.j2", **switches)
    assert ("win_right" in source) == switches["RIGHT_WINDOW"]
    assert ("_end_block" in source) == switches["LEFT_BOUND"]
    causal = dataclasses.replace(LLAMA_4K, window_left=1023)  # a causal window's right bound is the diagonal
    assert not FAMILY.render_switches(causal, configs[0])["RIGHT_WINDOW"]


def test_alibi_takes_the_gluon_backward_behind_its_switch(monkeypatch):
    """GLUON_BWD_ALIBI (on since its GPU tests passed): the slopes' pointer and row stride are rendered in only where
    the call has ALiBi, and the plan hands them over."""
    from autotile.families import flash_space
    from autotile.render import render_source

    problem = dataclasses.replace(LLAMA_4K, alibi=True)
    monkeypatch.setattr(flash_space, "GLUON_BWD_ALIBI", False)
    assert not gluon_configs(problem, H200)
    monkeypatch.setattr(flash_space, "GLUON_BWD_ALIBI", True)
    configs = gluon_configs(problem, H200)
    assert configs and FAMILY.default_config(problem, H200)["LOADS"] == GLUON_WS
    for call, has in ((problem, True), (LLAMA_4K, False)):
        source = render_source("flash_gluon_bwd.py.j2", **FAMILY.render_switches(call, configs[0]))
        assert ("alibi_ptr" in source and "stride_ab" in source and "slope2" in source) == has
    monkeypatch.setattr(flash_space, "GLUON_BWD_SOFTCAP", True)
    assert not gluon_configs(dataclasses.replace(problem, softcap=30.0), H200)  # not both: the Triton backward's


def test_soft_capping_takes_the_gluon_backward_behind_its_switch_on_two_slots_at_head_dim_128(monkeypatch):
    """GLUON_BWD_SOFTCAP (on since its GPU tests passed): soft-capped calls take the Gluon backward, whose fp32 tile of
    P^T times the cap's derivative leaves room for two Q/dO slots at head dim 128; the cap's scalars come from the
    host (rendered in only where SOFTCAP is)."""
    from autotile.families import flash_space
    from autotile.render import render_source

    problem = dataclasses.replace(LLAMA_4K, heads_kv=16, softcap=50.0)
    monkeypatch.setattr(flash_space, "GLUON_BWD_SOFTCAP", False)
    assert not gluon_configs(problem, H200)
    monkeypatch.setattr(flash_space, "GLUON_BWD_SOFTCAP", True)
    assert {c["num_stages"] for c in gluon_configs(problem, H200)} == {2}
    assert {c["num_stages"] for c in gluon_configs(dataclasses.replace(problem, head_dim=64), H200)} == {2, 3, 4}
    assert FAMILY.default_config(problem, H200)["LOADS"] == GLUON_WS
    config = gluon_configs(problem, H200)[0]
    source = render_source("flash_gluon_bwd.py.j2", **FAMILY.render_switches(problem, config))
    assert "cap_scale" in source and "_tanh" in source
    assert "cap_scale" not in render_source("flash_gluon_bwd.py.j2", **FAMILY.render_switches(LLAMA_4K, config))


@pytest.mark.parametrize("head_dim,stages", [(128, {2, 3}), (96, {2, 3}), (64, {2, 3, 4})])
def test_gluon_ws_backward_configs_keep_its_structure(head_dim, stages):
    problem = dataclasses.replace(LLAMA_4K, head_dim=head_dim)
    configs = gluon_configs(problem, H200)
    for c in configs:
        assert (c["BLOCK_M1"], c["BLOCK_N1"], c["BLOCK_M2"], c["BLOCK_N2"], c["num_warps"]) == (64, 128, 64, 128, 4)
        assert gluon_bwd_smem(problem, c) <= H200.smem_per_block
    assert {c["num_stages"] for c in configs} == stages  # a fourth slot at head dim 128 would not fit
    assert FAMILY.render_switches(problem, configs[0])["LOADS"] == "gluon_bwd"


def test_the_untuned_backward_is_gluon_where_it_applies():
    def loads(problem):
        return FAMILY.default_config(problem, H200)["LOADS"]

    assert loads(LLAMA_4K) == GLUON_WS
    assert loads(dataclasses.replace(LLAMA_4K, causal=False, heads_kv=32)) == GLUON_WS
    assert loads(dataclasses.replace(LLAMA_4K, head_dim=96)) == GLUON_WS  # Phi-3's, in 128-wide tiles
    assert loads(dataclasses.replace(LLAMA_4K, batch=16, seq_q=512, seq_k=512)) == GLUON_WS
    short = dataclasses.replace(LLAMA_4K, seq_q=60, seq_k=60)  # no 128-key tile to fill: the Triton default's
    assert dict(FAMILY.default_config(short, H200)) == dict(FAMILY.triton_backward_default(short, H200))
    assert loads(dataclasses.replace(LLAMA_4K, head_dim=64)) == GLUON_WS
    assert loads(dataclasses.replace(LLAMA_4K, head_dim=256)) == "tma"
    assert loads(dataclasses.replace(LLAMA_4K, window_left=1023)) == GLUON_WS  # results/gluon_bwd_window_2026-12-05_h100.md
    # results/gluon_bwd_features_2026-12-06_h200.md: soft-capping, ALiBi, windows of calls that are not causal
    assert loads(dataclasses.replace(LLAMA_4K, softcap=30.0)) == GLUON_WS
    assert loads(dataclasses.replace(LLAMA_4K, alibi=True)) == GLUON_WS
    assert loads(dataclasses.replace(LLAMA_4K, causal=False, window_left=64, window_right=64)) == GLUON_WS
    # The deterministic default, which the runtime serves under torch.use_deterministic_algorithms(True).
    assert FAMILY.triton_backward_default(LLAMA_4K, H200)["LOADS"] == "tma"
    assert FAMILY.seed_configs(LLAMA_4K, H200)[0]["LOADS"] == GLUON_WS
    assert all(c["LOADS"] != GLUON_WS for c in FAMILY.seed_configs(LLAMA_4K, planned_device("a100")))


def _schedule(batch, heads_q, heads_kv, seq, head_dim=128, causal=True, varlen=False, **window):
    """flash_launch.gluon_backward_problem_schedule of a bf16 call, as gluon_backward_plan asks it."""
    from autotile.families.flash_launch import gluon_backward_problem_schedule

    problem = FlashProblem("bwd", batch, heads_q, heads_kv, seq, seq, head_dim, causal=causal, varlen=varlen,
                           **window)
    return gluon_backward_problem_schedule(problem, H200.sm_count)


def test_few_tiles_are_shared_by_programs():
    # (CHUNK, SPLIT, HEAD_MAJOR, tail tiles)
    assert _schedule(1, 32, 8, 4096) == (1, 1, False, 0)  # Llama-3-8B: 256 tiles, about 2 an SM
    assert _schedule(4, 32, 8, 2048) == (1, 1, False, 0)  # 512 tiles
    assert _schedule(1, 28, 4, 4096) == (1, 2, False, 0)  # Qwen2.5-7B: 128 tiles, each walked by two
    assert _schedule(1, 12, 2, 4096) == (1, 4, False, 0)  # Qwen2.5-1.5B: 64 tiles
    assert _schedule(1, 1, 1, 100) == (1, 4, False, 0)
    assert _schedule(64, 32, 32, 1024, varlen=True)[1] == 1  # packed: never split


def test_many_tiles_go_out_head_by_head_where_q_and_do_outgrow_l2():
    assert _schedule(2, 32, 32, 4096) == (1, 1, True, 0)  # MHA, 2048 tiles, Q and dO 128 MiB
    assert _schedule(2, 32, 32, 4096, head_dim=96) == (1, 1, True, 0)  # Phi-3-mini: 96 MiB
    assert _schedule(8, 32, 8, 2048) == (1, 1, True, 0)  # GQA, 1024 tiles, 256 MiB
    assert _schedule(8, 32, 32, 1024) == (1, 1, True, 0)
    # Causal, Q and dO within 1.5 x L2: key block first (heaviest first), in chunks.
    assert _schedule(1, 32, 32, 4096) == (2, 1, False, 0)  # 1024 tiles, 64 MiB
    assert _schedule(1, 32, 32, 4096, head_dim=96) == (2, 1, False, 0)  # 48 MiB
    assert _schedule(4, 32, 32, 2048, head_dim=64) == (4, 1, False, 0)  # 64 MiB
    # Not causal, tiles are even: head by head at any size.
    assert _schedule(2, 32, 32, 4096, head_dim=64, causal=False)[:3] == (1, 1, True)
    # Packed sequences: their tile count includes tiles past each sequence's keys.
    assert _schedule(2, 32, 32, 4096, varlen=True) == (4, 1, False, 0)


def test_short_sequences_tiles_go_out_head_by_head_one_a_program():
    from autotile.families.flash_launch import gluon_backward_head_major

    sms = H200.sm_count

    def head_major(key_blocks, work, varlen=False):
        return gluon_backward_head_major(key_blocks, work, sms, varlen, causal=True, q_do_bytes=0)

    assert head_major(4, 512)  # Llama-3-8B 16 x 512: 512 tiles
    assert head_major(2, 512)  # 32 x 256
    assert not head_major(4, 256)  # Qwen2.5-7B 16 x 512: 256 tiles
    assert not head_major(8, 512)  # Llama-3-8B 8 x 1024
    assert not head_major(4, 512, varlen=True)  # packed: tiles past a sequence are skipped
    # MHA 16 x 32 x 512: 2048 tiles, enough for chunks of 4, but one a program, a head's 4 side by side.
    assert _schedule(16, 32, 32, 512) == (1, 1, True, 0)
    assert _schedule(16, 28, 4, 512) == (1, 1, False, 0)  # Qwen2.5-7B 16 x 512: 256 tiles


def test_the_stream_k_tail_is_off_by_default():
    """Timed beside no tail it won nothing beyond the noise and lost 14% on GQA (flash_launch.TAIL_MIN_GAIN)."""
    assert _schedule(2, 32, 32, 4096, causal=False) == (1, 1, True, 0)
    assert _schedule(2, 32, 8, 4096, causal=False) == (1, 1, False, 0)


def test_even_tiles_past_the_last_whole_wave_end_in_a_stream_k_tail(monkeypatch):
    """Not causal, one tile a program: the tiles past the last whole wave are shared by every SM's program
    (flash_launch.gluon_backward_tail), where the steps it saves are worth its overhead (at the model's threshold)."""
    from autotile.families import flash_launch
    from autotile.families.flash_launch import gluon_backward_tail

    monkeypatch.setattr(flash_launch, "TAIL_MIN_GAIN", 0.01)
    assert _schedule(2, 32, 32, 4096, causal=False) == (1, 1, True, 68)  # 2048 tiles: 15 waves of 132, 68 left
    assert _schedule(1, 32, 32, 4096, causal=False) == (1, 1, True, 100)  # 1024 tiles
    assert _schedule(2, 32, 8, 4096, causal=False) == (1, 1, False, 116)  # GQA: 512 tiles of 256 steps each
    # Short tiles: the tail's overhead (partials, a second K and V, the reduction) is most of what it saves.
    assert _schedule(8, 32, 32, 1024, causal=False)[3] == 0  # 2048 tiles of 16 steps
    assert _schedule(2, 32, 32, 4096)[3] == 0  # causal: uneven tiles, already heaviest first
    assert _schedule(2, 32, 32, 4096, causal=False, varlen=True)[3] == 0  # packed: uneven tiles
    assert _schedule(1, 28, 4, 4096, causal=False)[3] == 0  # 128 tiles: shared (SPLIT), not a tail
    for window in (dict(window_left=256), dict(window_right=64), dict(window_left=64, window_right=64)):
        assert _schedule(2, 32, 32, 4096, causal=False, **window)[3] == 0, window  # a window's tiles are uneven
    assert gluon_backward_tail(264, 64, 132, even=True) == 0  # whole waves
    assert gluon_backward_tail(100, 64, 132, even=True) == 0  # less than a wave
    assert gluon_backward_tail(133, 64, 132, even=True) == 1
    assert gluon_backward_tail(264 + 130, 64, 132, even=True) == 0  # an almost full last wave: nothing to save
    assert gluon_backward_tail(2048, 64, 132, even=False) == 0


class _Scalar(int):
    """An int that takes Gluon's scalar calls (x.to(dtype)), for the rendered helpers run as Python."""

    def to(self, dtype):
        return self


for _name in ("add", "sub", "mul", "floordiv", "mod"):
    for _side in ("", "r"):
        _op = getattr(int, f"__{_side}{_name}__")
        setattr(_Scalar, f"__{_side}{_name}__", lambda a, b, _op=_op: _Scalar(_op(a, b)))


def rendered_tail_helpers(problem):
    """The rendered Gluon backward's scheduling helpers (_my_work, _tail_share, _tail_blocks) run as plain Python:
    their text as rendered, without @gluon.jit, against a stand-in for gl's scalar calls. -> (helpers, set_pid)."""
    import ast
    import types

    from autotile.render import render_source

    config = dict(LOADS=GLUON_WS, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=64, BLOCK_N2=128, num_warps=4, num_stages=2)
    tree = ast.parse(render_source(FAMILY.template, **FAMILY.render_switches(problem, config)))
    wanted = {"_my_work", "_tail_share", "_tail_blocks"}
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {f.name for f in functions} == wanted
    for f in functions:
        f.decorator_list = []
    pid = [0]
    gl = types.SimpleNamespace(constexpr=None, int32=None, int64=None, program_id=lambda axis: _Scalar(pid[0]),
                               cdiv=lambda a, b: _Scalar(-(-a // b)), minimum=lambda a, b: _Scalar(min(a, b)),
                               maximum=lambda a, b: _Scalar(max(a, b)))
    namespace = {"gl": gl}
    exec(compile(ast.Module(body=functions, type_ignores=[]), "flash_gluon_bwd (rendered)", "exec"), namespace)
    return namespace, lambda value: pid.__setitem__(0, value)


def tail_walks(problem, whole: int, tail_programs: int):
    """What each program of attn_bwd_gluon walks with a tail, from its rendered helpers: (program, j, tile, head,
    first block, end block) for the j-th tile of each program, one row a (tile, head) with blocks to walk."""
    helpers, set_pid = rendered_tail_helpers(problem)
    group, n_m = problem.heads_q // problem.heads_kv, triton_cdiv(problem.seq_q, 64)
    n_work = triton_cdiv(problem.seq_k, 128) * problem.batch * problem.heads_kv
    for program in range(whole + tail_programs):
        set_pid(program)
        first, end = helpers["_my_work"](_Scalar(n_work), _Scalar(whole), _Scalar(tail_programs), _Scalar(group),
                                         _Scalar(problem.seq_q), 64, 1, True)
        for work in range(first, end):
            for g in range(group):
                lo, hi = helpers["_tail_blocks"](_Scalar(work), _Scalar(g), _Scalar(n_m), _Scalar(n_work),
                                                 _Scalar(whole), _Scalar(tail_programs), _Scalar(group))
                if lo < hi:
                    yield program, work - first, work, g, lo, hi


def test_the_kernels_tail_walks_every_step_once():
    """Run as Python, the rendered kernel's helpers give every program below `whole` its own tile, whole, and the
    tail programs every step of the rest exactly once, in order, at most two tiles each."""
    import torch

    problem = FlashProblem("bwd", 2, 6, 2, 700, 900, 128, causal=False)  # 8 key blocks x 4 = 32 tiles of 3 x 11 steps
    whole, tail_programs = 28, 5  # fewer tail tiles than programs, as gluon_backward_tail leaves
    visits = torch.zeros(32, 3, 11, dtype=torch.int32)
    shares = {}
    for program, j, tile, g, lo, hi in tail_walks(problem, whole, tail_programs):
        visits[tile, g, lo:hi] += 1
        if program < whole:
            assert (j, tile, lo, hi) == (0, program, 0, 11)
        else:
            assert j < 2
            shares.setdefault(program, []).append((tile, g, lo, hi))
    assert (visits == 1).all()
    steps = [(tile, g, i) for p in sorted(shares) for tile, g, lo, hi in shares[p] for i in range(lo, hi)]
    assert steps == sorted(steps) and len(steps) == 4 * 3 * 11  # the tail's steps in order, shares contiguous
    assert sorted(len(set(t for t, *_ in share)) for share in shares.values())[-1] == 2  # some share crosses tiles


def rendered_block_bounds(problem):
    """The rendered Gluon backward's _first_block and _end_block (LEFT_BOUND) run as plain Python (as
    rendered_tail_helpers runs its scheduling helpers)."""
    import ast
    import types

    from autotile.render import render_source

    config = dict(LOADS=GLUON_WS, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=64, BLOCK_N2=128, num_warps=4, num_stages=2)
    tree = ast.parse(render_source(FAMILY.template, **FAMILY.render_switches(problem, config)))
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and node.name in ("_first_block", "_end_block")]
    for f in functions:
        f.decorator_list = []
    gl = types.SimpleNamespace(constexpr=None, minimum=min, maximum=max)
    namespace = {"gl": gl, "CAUSAL": problem.causal or problem.window_right >= 0}
    exec(compile(ast.Module(body=functions, type_ignores=[]), "flash_gluon_bwd (rendered)", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("causal, left, right", [
    (True, -1, -1), (True, 0, -1), (True, 300, -1), (False, 0, 0), (False, 0, -1), (False, 63, 64), (False, 300, 5),
    (False, -1, 100), (False, 1000, 1000), (False, 130, -1)], ids=lambda v: str(v))
@pytest.mark.parametrize("seq_q, seq_k", [(700, 700), (200, 777), (777, 200)])
def test_each_key_tile_walks_exactly_the_query_blocks_its_window_reaches(monkeypatch, causal, left, right, seq_q,
                                                                         seq_k):
    """A key tile's walk [_first_block, _end_block) of the rendered kernel, run as Python, holds every query block
    with a query that sees one of its keys, from the first such block to the last: causal, with a window or not, and
    windows of calls that are not causal on either side or both (RIGHT_WINDOW, LEFT_BOUND), Sq above and below Sk."""
    from autotile.families import flash_space
    from autotile.families.flash_reference import seen_mask

    monkeypatch.setattr(flash_space, "GLUON_BWD_NON_CAUSAL_WINDOW", True)
    problem = FlashProblem("bwd", 1, 2, 2, seq_q, seq_k, 128, causal=causal, window_left=left, window_right=right)
    helpers = rendered_block_bounds(problem)
    n_m = triton_cdiv(seq_q, 64)
    seen = seen_mask(seq_q, seq_k, "cpu", problem.scores)  # (Sq, Sk) bool
    right_arg = [right] if not causal and right >= 0 else []  # RIGHT_WINDOW's argument
    for kb in range(triton_cdiv(seq_k, 128)):
        first = helpers["_first_block"](kb, seq_q, seq_k, *right_arg, 64, 128)
        end = helpers["_end_block"](kb, seq_q, seq_k, left, first, n_m, 64, 128) if left >= 0 else n_m
        rows = seen[:, kb * 128:(kb + 1) * 128].any(dim=1).nonzero().flatten().tolist()
        if rows:
            assert (first, end) == (rows[0] // 64, rows[-1] // 64 + 1), (kb, first, end, rows[0], rows[-1])
        else:
            assert first >= min(end, n_m), (kb, first, end)


@pytest.mark.parametrize("head_major", [False, True], ids=["key-block-first", "head-major"])
# 12 tiles; fewer in the tail than programs, as gluon_backward_tail leaves (a share then crosses at most two tiles).
@pytest.mark.parametrize("whole, programs, steps", [(9, 4, 7), (10, 3, 7), (5, 13, 3), (6, 8, 1)],
                         ids=["shares-cross-tiles", "few-programs", "short-shares", "one-step-each"])
def test_the_tails_partials_are_added_in_program_order(head_major, whole, programs, steps):
    """The tail's reduction inverts the kernel's shares (its rendered helpers run as Python: tail_walks): each tail
    tile's dK and dV are the sums of the partials of exactly the programs whose shares cross it, each taken from its
    slot, stored at the tile's (key block, batch, KV head) in either tile order, rows past Sk and columns past D left
    alone."""
    import torch

    from autotile.families.flash_launch import rows_strides
    from autotile.render import launching

    batch, heads_kv, seq_k, head_dim, block_d, keys = 2, 2, 300, 96, 128, 128
    group, n_m = steps, 1  # `steps` query heads of one 64-row block share each KV head
    problem = FlashProblem("bwd", batch, group * heads_kv, heads_kv, 50, seq_k, head_dim, causal=False)
    module = _gluon_module(problem)
    key_blocks, n_bh = triton_cdiv(seq_k, keys), batch * heads_kv
    tiles = key_blocks * n_bh
    programs = min(programs, (tiles - whole) * steps)
    gen = torch.Generator().manual_seed(whole + programs)
    step_sums = torch.randn(tiles, steps, keys, block_d, generator=gen)  # what each step adds to a tile's dK
    dk_part = torch.full((programs, 2, keys, block_d), float("nan"))  # slots no share fills are never read
    covered = torch.zeros(tiles, steps, dtype=torch.int32)
    for program, j, tile, g, lo, hi in tail_walks(problem, whole, programs):
        covered[tile, g * n_m + lo:g * n_m + hi] += 1
        if program >= whole:  # the kernel's tail epilogue: slot 2p + j
            slot = dk_part[program - whole, j]
            slot.copy_(torch.where(slot.isnan(), 0.0, slot) + step_sums[tile, g * n_m + lo:g * n_m + hi].sum(0))
    assert (covered == 1).all()
    dv_part = -2 * dk_part
    dk, dv = (torch.zeros(batch, heads_kv, seq_k, head_dim, dtype=torch.bfloat16) for _ in range(2))
    with launching(True):
        module.attn_bwd_gluon_tail_reduce[(tiles - whole, keys // 64)](
            dk_part, dv_part, dk, dv, *rows_strides(dk, False), *rows_strides(dv, False), n_bh, heads_kv, seq_k,
            whole, programs, steps, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=keys, ROWS=64, HEAD_MAJOR=head_major)
    want_dk = torch.zeros(batch, heads_kv, key_blocks * keys, block_d)
    for tile in range(whole, tiles):
        kb, bh = (tile % key_blocks, tile // key_blocks) if head_major else (tile // n_bh, tile % n_bh)
        want_dk[bh // heads_kv, bh % heads_kv, kb * keys:(kb + 1) * keys] = step_sums[tile].sum(0)
    want_dk = want_dk[..., :seq_k, :head_dim]
    done = want_dk.abs().sum(-1) > 0  # the tail's tiles' keys; the whole tiles' stay as they were (zero)
    assert torch.allclose(dk.float(), want_dk, rtol=2**-7, atol=1e-5)  # one bf16 step (as above)
    assert torch.allclose(dv.float(), -2 * want_dk, rtol=2**-7, atol=1e-5)
    assert done.any() and (dk.float().abs().sum(-1) > 0).eq(done).all()


def _gluon_module(problem):
    """The rendered Gluon backward, imported for Triton's interpreter: its Triton kernels (preprocess, dQ's
    cast, the partials' reduction) run on the CPU; the Gluon kernel itself does not."""
    from autotile.render import load_kernel_module

    config = dict(LOADS=GLUON_WS, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=64, BLOCK_N2=128, num_warps=4, num_stages=2)
    return load_kernel_module(FAMILY.template, interpret=True, **FAMILY.render_switches(problem, config))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_the_preprocess_takes_causal_alibis_row_term_into_the_padded_lse(monkeypatch, varlen):
    """Causal ALiBi (ALIBI_CAUSAL): the padded LSE holds each row's LSE plus slope * log2(e) * (i + Sk - Sq), Sk and
    Sq each sequence's, with slopes (B, Hq); rows past a sequence stay +inf."""
    import torch

    from autotile.families import flash_space
    from autotile.families.flash_launch import LOG2E, gluon_backward_stats_shape, lse_strides, rows_strides
    from autotile.render import launching

    monkeypatch.setattr(flash_space, "GLUON_BWD_ALIBI", True)
    q_lengths, k_lengths = ([150, 1, 64, 129], [200, 5, 64, 300]) if varlen else ([100] * 3, [170] * 3)
    heads, dim, batch = 2, 64, len(q_lengths)
    problem = FlashProblem("bwd", batch, heads, 1, max(q_lengths), max(k_lengths), dim, causal=True, varlen=varlen,
                           alibi=True)
    module = _gluon_module(problem)
    gen = torch.Generator().manual_seed(1)
    cu_q = torch.tensor([0] + list(torch.tensor(q_lengths).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(k_lengths).cumsum(0)), dtype=torch.int32)
    shape = (int(cu_q[-1]), heads, dim) if varlen else (batch, heads, max(q_lengths), dim)
    o, do = (torch.randn(shape, generator=gen).bfloat16() for _ in range(2))
    lse = torch.randn((heads, int(cu_q[-1])) if varlen else (batch, heads, max(q_lengths)), generator=gen)
    slopes = torch.rand(batch, heads, generator=gen)
    pad_shape = gluon_backward_stats_shape(problem, int(cu_q[-1]) if varlen else problem.seq_q)
    lse_pad, delta_pad = torch.full(pad_shape, -7.0), torch.full(pad_shape, -7.0)
    dq_acc = torch.full(pad_shape + (dim,), -7.0)
    with launching(True):
        module.attn_bwd_gluon_preprocess[(triton_cdiv(problem.seq_q, 64), batch * heads)](
            o, do, lse, lse, cu_q, lse_pad, delta_pad, dq_acc, cu_k, slopes, *rows_strides(o, varlen),
            *rows_strides(do, varlen), *lse_strides(lse, varlen), heads, problem.seq_q, pad_shape[-1], problem.seq_k,
            slopes.stride(0), HEAD_DIM=dim, BLOCK_D=dim, BLOCK_M=64, HAS_DLSE=False)
    for b, (n, keys) in enumerate(zip(q_lengths, k_lengths)):
        bias = LOG2E * (torch.arange(n) + keys - n).float()
        for h in range(heads):
            if varlen:
                first = 64 * (int(cu_q[b]) // 64 + b)
                got, row_lse = lse_pad[h, first:first + triton_cdiv(n, 64) * 64], lse[h, cu_q[b]:cu_q[b + 1]]
            else:
                got, row_lse = lse_pad[b, h], lse[b, h]
            assert torch.allclose(got[:n], row_lse + slopes[b, h] * bias, rtol=1e-6, atol=1e-5), (b, h)
            assert torch.isinf(got[n:]).all()


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_the_preprocess_pads_each_sequences_rows_apart_and_dq_comes_back(varlen):
    """LSE, Delta (with the LSE's gradient) and the zeroed fp32 dQ land in whole 64-row blocks a (sequence, head), none
    overlapping another's, +inf LSE and zero Delta past each sequence's rows; dQ is cast back from them."""
    import torch

    from autotile.families.flash_launch import LOG2E, gluon_backward_stats_shape, lse_strides, rows_strides
    from autotile.render import launching

    lengths = [150, 1, 64, 129] if varlen else [100] * 3
    heads, dim, batch = 2, 64, len(lengths)
    problem = FlashProblem("bwd", batch, heads, 1, max(lengths), max(lengths), dim, causal=True, varlen=varlen)
    module = _gluon_module(problem)
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    shape = (int(cu[-1]), heads, dim) if varlen else (batch, heads, max(lengths), dim)
    o, do = (torch.randn(shape, generator=gen).bfloat16() for _ in range(2))
    stats = (heads, int(cu[-1])) if varlen else (batch, heads, max(lengths))
    lse, dlse = torch.randn(stats, generator=gen), torch.randn(stats, generator=gen)
    pad_shape = gluon_backward_stats_shape(problem, int(cu[-1]) if varlen else problem.seq_q)
    lse_pad, delta_pad = torch.full(pad_shape, -7.0), torch.full(pad_shape, -7.0)
    dq_acc = torch.full(pad_shape + (dim,), -7.0)
    grid = (triton_cdiv(problem.seq_q, 64), batch * heads)
    with launching(True):
        module.attn_bwd_gluon_preprocess[grid](
            o, do, lse, dlse, cu, lse_pad, delta_pad, dq_acc, *rows_strides(o, varlen), *rows_strides(do, varlen),
            *lse_strides(lse, varlen), heads, problem.seq_q, pad_shape[-1], HEAD_DIM=dim, BLOCK_D=dim, BLOCK_M=64,
            HAS_DLSE=True)
    delta = (o.float() * do.float()).sum(-1)
    taken = torch.zeros(pad_shape, dtype=torch.bool)
    for b, n in enumerate(lengths):
        for h in range(heads):
            if varlen:
                first = 64 * (int(cu[b]) // 64 + b)
                rows = (h, slice(first, first + triton_cdiv(n, 64) * 64))
                seq = slice(int(cu[b]), int(cu[b + 1]))
                want_lse, want_delta = lse[h, seq], delta[seq, h] - LOG2E * dlse[h, seq]
            else:
                rows = (b, h, slice(0, pad_shape[-1]))
                want_lse, want_delta = lse[b, h], delta[b, h] - LOG2E * dlse[b, h]
            assert not taken[rows].any(), (b, h)  # no two sequences' padded rows overlap
            taken[rows] = True
            got_lse, got_delta = lse_pad[rows], delta_pad[rows]
            assert torch.equal(got_lse[:n], want_lse) and torch.isinf(got_lse[n:]).all()
            assert torch.allclose(got_delta[:n], want_delta, rtol=1e-5, atol=1e-5) and not got_delta[n:].any()
            assert not dq_acc[rows].any()
    # dQ's cast: padded fp32 rows (sums of dS K) back to the caller's layout ((B, S, H, D) storage seen as
    # (B, H, S, D) where dense), scaled, nothing else read.
    dq_acc = torch.randn(dq_acc.shape, generator=gen)
    dq = torch.empty(shape, dtype=torch.bfloat16) if varlen else \
        torch.empty(batch, max(lengths), heads, dim, dtype=torch.bfloat16).transpose(1, 2)
    with launching(True):
        module.attn_bwd_gluon_dq[grid](dq_acc, cu, dq, *rows_strides(dq, varlen), heads, problem.seq_q, pad_shape[-1],
                                       0.125, HEAD_DIM=dim, BLOCK_D=dim, BLOCK_M=64)
    for b, n in enumerate(lengths):
        first = 64 * (int(cu[b]) // 64 + b)
        for h in range(heads):
            got = dq[cu[b]:cu[b + 1], h] if varlen else dq[b, h]
            want = dq_acc[h, first:first + n] if varlen else dq_acc[b, h, :n]
            # Within one bf16 step of the fp32 values: Triton's interpreter rounds toward zero, the GPU to nearest.
            assert torch.allclose(got.float(), want * 0.125, rtol=2**-7, atol=0)


def test_shared_tiles_partials_are_added_in_part_order():
    import torch

    from autotile.families.flash_launch import rows_strides
    from autotile.render import launching

    problem = FlashProblem("bwd", 2, 4, 2, 300, 300, 96, causal=True)  # a padded head dim: 96 of 128 columns
    module = _gluon_module(problem)
    split, gen = 3, torch.Generator().manual_seed(1)
    parts = [torch.randn(2, 2, 300, 128, generator=gen) for _ in range(2)]
    parts = [torch.stack([p * (i + 1) for i in range(split)]).reshape(split * 2, 2, 300, 128) for p in parts]
    dk, dv = (torch.empty(2, 2, 300, 96, dtype=torch.bfloat16) for _ in range(2))
    with launching(True):
        module.attn_bwd_gluon_reduce[(triton_cdiv(300, 64), 4)](
            *parts, dk, dv, *rows_strides(dk, False), *rows_strides(dv, False), 2 * 2 * 300 * 128, 2, 300,
            HEAD_DIM=96, BLOCK_D=128, BLOCK_N=64, SPLIT=split)
    for got, part in zip((dk, dv), parts):
        want = part.reshape(split, 2, 2, 300, 128).sum(0)[..., :96]
        assert torch.allclose(got.float(), want, rtol=2**-7, atol=1e-6)  # one bf16 step (as above)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# (problem, num_stages): causal MHA (4 tiles a program) on two slots, Qwen2.5-7B's heads on three (the most that fit;
# two programs a tile: dK and dV as fp32 partials), head dim 64 on four, packed sequences, and MHA not causal, whose
# 2048 tiles end in a stream-K tail. (Each build takes ~20 s.)
CASES = [
    (FlashProblem("bwd", 2, 32, 32, 4096, 4096, 128, causal=True), 2),
    (FlashProblem("bwd", 1, 28, 4, 4096, 4096, 128, causal=True), 3),
    (FlashProblem("bwd", 4, 32, 32, 2048, 2048, 64, causal=True), 4),
    (FlashProblem("bwd", 8, 32, 8, 2048, 2048, 128, causal=True, varlen=True), 2),
    (FlashProblem("bwd", 2, 32, 32, 4096, 4096, 128), 2),
    (FlashProblem("bwd", 1, 32, 8, 8192, 8192, 128, causal=True, window_left=4095), 2),  # Mistral-7B v0.1's window
    # A window on both sides, not causal (ModernBERT's local layers have 64 keys a side, at head dim 64).
    (FlashProblem("bwd", 2, 16, 16, 4096, 4096, 128, window_left=128, window_right=128), 2),
    # ALiBi (MPT-7B's heads, causal).
    (FlashProblem("bwd", 1, 32, 32, 4096, 4096, 128, causal=True, alibi=True), 2),
    # Soft-capping (Gemma-2-27B's heads and cap).
    (FlashProblem("bwd", 1, 32, 16, 4096, 4096, 128, causal=True, softcap=50.0), 2),
]
# Spill instructions (LDL/STL) in the key loops of both consumer partitions: 12 at head dim 128 causal, 0 at 64,
# 10 with Qwen2.5-7B's heads, 15 packed, 0 not causal with a stream-K tail or without (sm90 builds of Triton 3.6),
# against 53 before the row statistics came by TMA (the prototype's history). NOTE: a per-call scalar computed in the kernel and handed to the partitions (the scale
# times log2(e)) took it to 29: the kernel takes it from the host; so did descriptors built in the kernel (19, 13, 20).
KEY_LOOP_SPILLS = 24
# A sliding window's mask beside the causal one (LEFT_BOUND): 26 where the same build without it has 18 (sm90, 1 x 32/8
# x 8192 on two slots); both sides of a window that is not causal (RIGHT_WINDOW too): 30 where the plain build has 0
# (2 x 16 x 4096, head dim 128, two slots).
WINDOW_KEY_LOOP_SPILLS = 32
# ALiBi's bias beside the causal mask: 27 where the same build without it has 15 (1 x 32 x 4096 on two slots; the
# expression's form decides it: templates/flash_gluon_bwd.py.j2, ALIBI_CAUSAL).
ALIBI_KEY_LOOP_SPILLS = 32
# Soft-capping: 28 where the same build without it has 15 (1 x 32/16 x 4096 causal on two slots; P^T times the cap's
# derivative through shared memory, zeroed where the masks zero P^T: templates/flash_gluon_bwd.py.j2, SOFTCAP).
SOFTCAP_KEY_LOOP_SPILLS = 36


def _compile_case(case) -> dict:
    from autotile import xcompile

    problem, stages = case
    config = dict(LOADS=GLUON_WS, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=64, BLOCK_N2=128, num_warps=4,
                  num_stages=stages)
    return {k.name: dict(shared=k.shared, stack=k.stack, spills=k.mma_loop_spills, scratch=k.global_scratch,
                         features=list(k.ptx_features), estimate=gluon_bwd_smem(problem, config))
            for k in xcompile.compile_config(FAMILY, problem, config, H200)}


def _compile_cases() -> list:
    from compile_child import map_in_processes

    from autotile.families import flash_launch, flash_space

    # The stream-K tail is off by default (flash_launch.TAIL_MIN_GAIN); its template still builds, at the model's
    # threshold (set before the pool forks: its processes inherit it). Windows that are not causal, ALiBi and
    # soft-capping build with their switches on whatever their values.
    switches = ("GLUON_BWD_NON_CAUSAL_WINDOW", "GLUON_BWD_ALIBI", "GLUON_BWD_SOFTCAP")
    kept = flash_launch.TAIL_MIN_GAIN, [getattr(flash_space, name) for name in switches]
    flash_launch.TAIL_MIN_GAIN = 0.01
    for name in switches:
        setattr(flash_space, name, True)
    try:
        return map_in_processes(_compile_case, CASES)
    finally:
        flash_launch.TAIL_MIN_GAIN = kept[0]
        for name, value in zip(switches, kept[1]):
            setattr(flash_space, name, value)


def test_gluon_ws_backward_compiles_for_sm90_within_shared_memory_and_moves_its_gradients_by_tma():
    from compile_child import run_compile_child

    results = run_compile_child(__file__)
    assert len(results) == len(CASES)
    for case, kernels in zip(CASES, results):
        split, tail = case[0].heads_kv == 4, not case[0].masked
        assert set(kernels) == {"attn_bwd_gluon_preprocess", "attn_bwd_gluon", "attn_bwd_gluon_dq"} | (
            {"attn_bwd_gluon_reduce"} if split else set()) | ({"attn_bwd_gluon_tail_reduce"} if tail else set()), case
        main = kernels["attn_bwd_gluon"]
        assert main["shared"] <= main["estimate"] <= H200.smem_per_block, (case, main)
        assert {"wgmma", "tma", "setmaxnreg", "tma_reduce"} <= set(main["features"]), (case, main["features"])
        # dQ's adds are the TMA's: no thread adds an element (nor waits for L2's reply to an atomic).
        assert not {"atom", "red"} & set(main["features"]), case
        # Dense dK and dV of one program a tile go out by TMA stores (packed sequences' and partials from registers).
        assert ("tma_store" in main["features"]) == (not case[0].varlen and not split), (case, main["features"])
        # Its descriptors come from the host: no launch scratch to build them in.
        assert main["scratch"] == 0, (case, main)
        if main["stack"]:  # None: no cuobjdump with this Triton to read them
            bound = (ALIBI_KEY_LOOP_SPILLS if case[0].alibi else SOFTCAP_KEY_LOOP_SPILLS if case[0].softcap > 0
                     else WINDOW_KEY_LOOP_SPILLS if case[0].window_left >= 0 else KEY_LOOP_SPILLS)
            assert main["spills"] <= bound, (case, main)


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_compile_cases()) + "\n")
