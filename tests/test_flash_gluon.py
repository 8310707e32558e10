"""The flash family's Gluon forward (templates/flash_gluon_ws.py.j2) on the CPU: where the space offers it, the
structure its configs keep, and its kernel compiled for sm90 with Triton's own ptxas, without spills.

Gluon kernels do not run under Triton's interpreter; tests/test_flash_gluon_gpu.py runs them against float64.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from autotile.device import interpret_device, planned_device
from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem

H200 = planned_device("h200")
LLAMA_4K = FlashProblem("fwd", 1, 32, 8, 4096, 4096, 128, causal=True)


def gluon_configs(problem, device):
    return [c for c in FAMILY.space(problem, device).feasible() if c["LOADS"] == GLUON_WS]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])  # (the backward's gluon_ws: tests/test_flash_gluon_bwd.py)
def test_the_space_offers_gluon_ws_on_hopper_only(direction):
    problem = dataclasses.replace(LLAMA_4K, direction=direction)
    assert gluon_configs(problem, H200)
    assert not gluon_configs(problem, interpret_device())  # Gluon does not run under the interpreter
    assert not gluon_configs(problem, planned_device("a100"))


@pytest.mark.parametrize("change", [
    dict(dtype="fp32"), dict(dtype="fp8"), dict(head_dim=100), dict(aligned=False),
    dict(alibi=True),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_gluon_ws_is_infeasible_where_it_does_not_apply(change):
    # (The backward's gluon_ws is its own kernel: tests/test_flash_gluon_bwd.py.)
    problem = dataclasses.replace(LLAMA_4K, **change)
    assert not gluon_configs(problem, H200)


def test_head_dims_that_pad_to_a_gluon_tile_take_it_by_the_padded_tiles_rules():
    # Phi-3's 96 (and 80) pad to 128-wide tiles, whose extra columns TMA fills with zeros.
    for head_dim in (80, 96):
        problem = dataclasses.replace(LLAMA_4K, head_dim=head_dim)
        assert {c["BLOCK_N"] for c in gluon_configs(problem, H200)} == {64, 128}
        assert FAMILY.default_config(problem, H200)["LOADS"] == GLUON_WS
    short = FlashProblem("fwd", 16, 32, 32, 512, 512, 96, causal=True)
    assert dict(FAMILY.default_config(short, H200)) == dict(FAMILY.default_config(
        dataclasses.replace(short, head_dim=128), H200))


@pytest.mark.parametrize("feature, switch", [(dict(softcap=50.0), "GLUON_SOFTCAP"),
                                             (dict(window_left=1023), "GLUON_WINDOW"),
                                             (dict(window_left=4095, softcap=50.0), "GLUON_WINDOW")])
def test_soft_capped_and_windowed_calls_take_gluon_ws_by_default_unless_switched_off(monkeypatch, feature, switch):
    from autotile.families import flash_space

    problem = dataclasses.replace(LLAMA_4K, seq_q=8192, seq_k=8192, **feature)
    assert FAMILY.default_config(problem, H200)["LOADS"] == GLUON_WS
    assert FAMILY.render_switches(problem, FAMILY.default_config(problem, H200))["LEFT_BOUND"] == ("window_left" in feature)
    monkeypatch.setattr(flash_space, switch, False)
    assert not gluon_configs(problem, H200)
    assert FAMILY.default_config(problem, H200)["LOADS"] != GLUON_WS


def test_alibi_stays_on_the_triton_forward_until_checked_on_a_gpu(monkeypatch):
    from autotile.families import flash_space
    from autotile.render import render_source

    alibi = dataclasses.replace(LLAMA_4K, alibi=True)
    assert not gluon_configs(alibi, H200)
    monkeypatch.setattr(flash_space, "GLUON_ALIBI", True)
    configs = gluon_configs(alibi, H200)
    assert configs and FAMILY.default_config(alibi, H200)["LOADS"] == GLUON_WS
    source = render_source(FAMILY.template, **FAMILY.render_switches(alibi, configs[0]))
    assert "slope2" in source and "slope2" not in render_source(
        FAMILY.template, **FAMILY.render_switches(LLAMA_4K, configs[0]))


def test_two_sided_windows_stay_on_the_triton_forward_until_checked_on_a_gpu(monkeypatch):
    from autotile.families import flash_space

    two_sided = dataclasses.replace(LLAMA_4K, causal=False, window_left=100, window_right=30)
    assert not gluon_configs(two_sided, H200)
    assert gluon_configs(dataclasses.replace(two_sided, window_right=-1), H200)  # left-only: checked
    monkeypatch.setattr(flash_space, "GLUON_TWO_SIDED_WINDOW", True)
    assert gluon_configs(two_sided, H200)


def test_a_window_right_side_alone_and_packed_sequences_keep_gluon_ws():
    assert gluon_configs(dataclasses.replace(LLAMA_4K, causal=False, window_right=100), H200)
    assert gluon_configs(dataclasses.replace(LLAMA_4K, varlen=True), H200)


def test_two_q_slots_where_64_key_blocks_leave_room():
    from autotile.families.flash import gluon_q_slots

    def slots(head_dim, block_n, stages):
        return gluon_q_slots(dataclasses.replace(LLAMA_4K, head_dim=head_dim),
                             dict(BLOCK_M=128, BLOCK_N=block_n, num_stages=stages))

    assert slots(128, 64, 4) == 2 and slots(64, 64, 4) == 2
    assert slots(256, 64, 2) == 1  # 2 x 64 KB of Q and 2 x 64 KB of K and V: more than 227 KB
    assert slots(128, 128, 2) == 1  # 128-key blocks keep one (measured only at 64)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gluon_ws_configs_keep_its_structure(head_dim):
    from autotile.families.flash import gluon_split_kv

    problem = dataclasses.replace(LLAMA_4K, head_dim=head_dim)
    configs = gluon_configs(problem, H200)
    assert {c["BLOCK_N"] for c in configs} == {64, 128}
    for c in configs:
        assert c["BLOCK_M"] == 128 and c["num_warps"] == 4 and not c["WARP_SPECIALIZE"] and not c["MASKS_IN_LOOP"]
        # One K/V slot only where K and V go back apart: head dim 256's 128-key blocks, which fit no second slot.
        assert (c["num_stages"] == 1) == gluon_split_kv(problem, c) == (head_dim == 256 and c["BLOCK_N"] == 128)
    # Triton's forwards keep two stages at least.
    assert all(c["num_stages"] >= 2 for c in FAMILY.space(problem, H200).feasible() if c["LOADS"] != GLUON_WS)


def test_the_tile_queue_is_gluon_ws_and_untuned_where_head_dim_128_runs_more_than_one_sequence():
    def queued(problem) -> bool:
        config = FAMILY.default_config(problem, H200)
        assert config["LOADS"] == GLUON_WS, problem
        return config["TILE_QUEUE"]

    llama = FlashProblem("fwd", 4, 32, 8, 2048, 2048, 128, causal=True)
    assert queued(llama) and queued(dataclasses.replace(llama, batch=16, seq_q=512, seq_k=512))
    assert queued(dataclasses.replace(llama, varlen=True)) and queued(dataclasses.replace(llama, head_dim=96))
    assert not queued(LLAMA_4K)  # one sequence: static rounds led (1 x 4096)
    assert queued(dataclasses.replace(llama, causal=False))
    assert not queued(dataclasses.replace(llama, heads_q=16, head_dim=256))  # Gemma-2: static rounds led
    assert not queued(dataclasses.replace(llama, heads_q=12, heads_kv=12, head_dim=64))  # a tie
    # Only gluon_ws takes tiles from a queue; a config stored before the axis existed runs static rounds.
    space = FAMILY.space(llama, H200)
    tma = dict(LOADS="tma", BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, MASKS_IN_LOOP=False, num_warps=4,
               num_stages=3)
    assert space.admit(dict(tma, TILE_QUEUE=True)) is None and space.admit(tma)["TILE_QUEUE"] is False
    stored = dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, num_warps=4, num_stages=3)
    assert space.validate(stored)["TILE_QUEUE"] is False
    assert not FAMILY.render_switches(llama, space.validate(stored))["TILE_QUEUE"]
    assert FAMILY.render_switches(llama, space.validate(dict(stored, TILE_QUEUE=True)))["TILE_QUEUE"]


def _rendered_functions(problem, config, names, **scope):
    """The rendered kernel's functions `names` as plain Python, in `scope` (Gluon's minimum is min), each calling the
    others and what `scope` stands in for."""
    import ast
    import types

    from autotile.render import render_source

    source = render_source(FAMILY.template, **FAMILY.render_switches(problem, config))
    functions = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(f.name for f in functions) == sorted(names)
    for function in functions:
        function.decorator_list = []
    scope = dict(scope, gl=types.SimpleNamespace(minimum=min), HEAD_MAJOR_TILES=16)
    exec(compile(ast.Module(body=functions, type_ignores=[]), "rendered", "exec"), scope)
    return [scope[name] for name in names]


def _rendered_tile_order(problem, config):
    """The rendered kernel's _tile (tile index -> (query tile, batch, head)) as plain Python."""
    return _rendered_functions(problem, config, ["_tile"])[0]


@pytest.mark.parametrize("group", [1, 5, 7, 24, 200])
def test_causal_tiles_in_head_groups_cover_every_tile_once_each_groups_heaviest_first(monkeypatch, group):
    """HEAD_GROUPS' order, run from the rendered source: every (query tile, batch, head) once; groups of `group`
    heads (the last one smaller where it does not divide them), each group's query tiles heaviest first."""
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "FORWARD_HEAD_GROUPS", True)
    problem = FlashProblem("fwd", 3, 8, 2, 700, 700, 128, causal=True)
    config = dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, MASKS_IN_LOOP=False,
                  TILE_QUEUE=True, num_warps=4, num_stages=4)
    assert FAMILY.render_switches(problem, config)["HEAD_GROUPS"]
    tile = _rendered_tile_order(problem, config)
    n_m, heads = 6, 3 * 8
    order = [tile(c, n_m, 3, 8, 128, group) for c in range(n_m * heads)]
    assert sorted(order) == [(m, b, h) for m in range(n_m) for b in range(3) for h in range(8)]
    size = min(group, heads)
    for first in range(0, heads, size):
        tiles = order[first * n_m:min(first + size, heads) * n_m]
        assert {b * 8 + h for _, b, h in tiles} == set(range(first, min(first + size, heads)))
        assert [m for m, _, _ in tiles] == sorted((m for m, _, _ in tiles), reverse=True)
    # One group of every head is the tile-major order the template keeps without HEAD_GROUPS.
    monkeypatch.setattr(flash_space, "FORWARD_HEAD_GROUPS", False)
    plain = _rendered_tile_order(problem, config)
    if group >= heads:
        assert order == [plain(c, n_m, 3, 8, 128) for c in range(n_m * heads)]


@pytest.mark.parametrize("group", [1, 3, 8])
def test_packed_tiles_in_head_groups_cover_every_tile_once_a_group_after_another(monkeypatch, group):
    """HEAD_GROUPS over packed sequences, run from the rendered source (_grouped_packed_tile and _packed_tile; the
    two helpers that reduce over the lengths in registers stand in as Python): each program walking its own tiles
    forward, every (query tile, sequence, head) comes once, and the tiles of each group of `group` heads come together,
    query tile first within it."""
    from autotile.families import flash_space

    monkeypatch.setattr(flash_space, "FORWARD_HEAD_GROUPS_PACKED", True)
    lengths, heads, block_m = [300, 1, 129, 700, 128, 513], 8, 128
    problem = FlashProblem("fwd", len(lengths), heads, 2, 700, 700, 128, causal=True, varlen=True)
    config = dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=False, MASKS_IN_LOOP=False,
                  TILE_QUEUE=True, num_warps=4, num_stages=3)
    assert FAMILY.render_switches(problem, config)["HEAD_GROUPS"]

    def tiles_in_row(m, cu_q, batch, heads_q, BLOCK_M, WARPS):
        return sum(n > m * BLOCK_M for n in cu_q) * heads_q

    def longer(k, m, cu_q, batch, BLOCK_M, WARPS):
        return [b for b, n in enumerate(cu_q) if n > m * BLOCK_M][k]

    grouped, _ = _rendered_functions(problem, config, ["_grouped_packed_tile", "_packed_tile"],
                                     _tiles_in_row=tiles_in_row, _longer=longer)
    row_tiles = sum(-(-n // block_m) for n in lengths)
    n_m = -(-max(lengths) // block_m)
    every = sorted((m, b, h) for b, n in enumerate(lengths) for m in range(-(-n // block_m)) for h in range(heads))
    assert len(every) == row_tiles * heads
    for programs in (1, 5, 13):
        seen = {}
        for program in range(programs):
            cursor = (-1, n_m - 1, 0)  # (group, m, row_start) as the producer starts them
            for c in range(program, len(every), programs):
                pid_m, b, h, *cursor = grouped(c, *cursor, n_m, lengths, len(lengths), heads, group, row_tiles,
                                               block_m)
                seen[c] = (pid_m, b, h)
        assert sorted(seen.values()) == every, programs
        order = [seen[c] for c in range(len(every))]
        for first in range(0, heads, group):  # a group's tiles together, its query tiles heaviest first
            tiles = order[first * row_tiles:min(first + group, heads) * row_tiles]
            assert {h for _, _, h in tiles} == set(range(first, min(first + group, heads)))
            assert [m for m, _, _ in tiles] == sorted((m for m, _, _ in tiles), reverse=True)


def test_head_groups_are_sized_for_l2_where_all_heads_k_and_v_outgrow_it():
    from autotile.families import flash_launch

    queued = dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=64, TILE_QUEUE=True)
    phi3 = FlashProblem("fwd", 16, 32, 32, 512, 512, 96, causal=True)  # 100 MB of K and V: 196,608 B a head
    assert flash_launch.forward_head_group(phi3, queued) == int(0.5 * 50 * 2**20 // 196608) == 133
    assert flash_launch.forward_head_group(phi3, dict(queued, TILE_QUEUE=False)) == 16 * 32  # static rounds: tile-major
    llama = FlashProblem("fwd", 16, 32, 8, 512, 512, 128, causal=True)  # GQA: 34 MB of K and V, within L2
    assert flash_launch.forward_head_group(llama, queued) == 16 * 32
    phi3_long = dataclasses.replace(phi3, batch=4, seq_q=2048, seq_k=2048)  # 786,432 B a head
    assert flash_launch.forward_head_group(phi3_long, queued) == 33
    # Packed: groups of heads over all sequences' keys (8 x 2048 of Phi-3's: 6,291,456 B a head).
    packed = dataclasses.replace(phi3, batch=8, seq_q=2048, seq_k=2048, varlen=True)
    assert flash_launch.forward_head_group(packed, queued, 8 * 2048) == 4
    assert flash_launch.forward_head_group(dataclasses.replace(packed, heads_kv=8), queued, 8 * 2048) == 32
    gemma = FlashProblem("fwd", 4, 16, 8, 2048, 2048, 256, causal=True)  # 16 query tiles a head: one head at a time
    assert flash_launch.forward_head_group(gemma, dict(queued, TILE_QUEUE=False)) == 1
    assert flash_launch.forward_head_group(dataclasses.replace(gemma, batch=1, seq_q=8192, seq_k=8192),
                                           dict(queued, TILE_QUEUE=False)) == 16


def test_head_groups_render_only_where_switched_on_for_dense_bounded_calls(monkeypatch):
    from autotile.families import flash_space

    config = dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=64, WARP_SPECIALIZE=False, MASKS_IN_LOOP=False,
                  TILE_QUEUE=True, num_warps=4, num_stages=4)
    causal = FlashProblem("fwd", 16, 32, 32, 512, 512, 96, causal=True)
    assert not FAMILY.render_switches(causal, config)["HEAD_GROUPS"]  # off until timed
    monkeypatch.setattr(flash_space, "FORWARD_HEAD_GROUPS", True)
    assert FAMILY.render_switches(causal, config)["HEAD_GROUPS"]
    assert FAMILY.render_switches(dataclasses.replace(causal, causal=False, window_right=30), config)["HEAD_GROUPS"]
    packed = dataclasses.replace(causal, varlen=True)
    for other in (dataclasses.replace(causal, causal=False), packed):
        assert not FAMILY.render_switches(other, config)["HEAD_GROUPS"], other
    # Packed calls have a switch of their own, causal or not (their order is query tile first either way).
    monkeypatch.setattr(flash_space, "FORWARD_HEAD_GROUPS_PACKED", True)
    assert FAMILY.render_switches(packed, config)["HEAD_GROUPS"]
    assert FAMILY.render_switches(dataclasses.replace(packed, causal=False), config)["HEAD_GROUPS"]


# (problem, BLOCK_N, num_stages): causal and not, the three head dims, GQA, a right window, fp16, packed sequences.
CASES = [
    (LLAMA_4K, 128, 3),
    (FlashProblem("fwd", 2, 16, 16, 1000, 3000, 64, causal=False, dtype="fp16"), 128, 4),
    (FlashProblem("fwd", 3, 12, 12, 2000, 2000, 64, causal=True), 128, 3),
    (FlashProblem("fwd", 8, 32, 8, 2048, 2048, 128, causal=True, varlen=True), 128, 3),
    (FlashProblem("fwd", 1, 16, 8, 8192, 8192, 256, causal=True), 64, 2),
    (FlashProblem("fwd", 1, 8, 2, 777, 777, 128, window_right=64), 64, 3),
    (FlashProblem("fwd", 16, 32, 8, 512, 512, 128, causal=True), 64, 4),  # two Q slots, each warpgroup its own blocks
    (FlashProblem("fwd", 16, 32, 32, 512, 512, 96, causal=True), 64, 4),  # Phi-3's head dim, padded to 128
    (FlashProblem("fwd", 4, 32, 32, 1000, 1000, 96, causal=True, varlen=True), 128, 3),
    (FlashProblem("fwd", 4, 16, 8, 2048, 2048, 256, causal=True), 128, 1),  # D = 256 on one split K/V slot
    (FlashProblem("fwd", 1, 16, 8, 8192, 8192, 256), 128, 1),
]


# Spill instructions the key loop may hold: a per-tile scalar reloaded (above), never a tile of registers.
KEY_LOOP_RELOADS = 2
# Head dim 256 on one split K/V slot (SPLIT_KV) holds O (128 fp32 registers a thread) beside a 64 x 128 score tile
# (64): ptxas (Triton 3.6) reloads the per-tile wgmma descriptors and addresses once a key block and saves two 64-bit
# values around the P V wgmma, 12-16 local loads and stores in a loop of ~940 instructions around two 64 x 128 x 256
# wgmma groups (sm90 SASS, 4 x 2048 causal and 1 x 8192). A spilled tile would be 64 or more.
SPLIT_KV_LOOP_SPILLS = 24
# The causal cases rendered with TILE_QUEUE (tiles from an atomic queue; benchmarks/prototypes/gluon_flash_variants.py
# times it): Gemma-2's head dim 256, Llama-3's short and long prefill, and packed sequences.
QUEUE_CASES = [CASES[3], CASES[4], CASES[6], (FlashProblem("fwd", 4, 32, 8, 2048, 2048, 128, causal=True), 128, 3)]


def _build(problem, block_n, stages, queue=False) -> dict:
    from autotile.xcompile import compile_config

    config = dict(LOADS=GLUON_WS, BLOCK_M=128, BLOCK_N=block_n, WARP_SPECIALIZE=False, MASKS_IN_LOOP=False,
                  TILE_QUEUE=queue, num_warps=4, num_stages=stages)
    feasible = FAMILY.space(problem, H200).admit(config) is not None
    kernels = compile_config(FAMILY, problem, config, H200)
    switches = FAMILY.render_switches(problem, config)
    return dict(feasible=feasible, head_split=switches["HEAD_SPLIT"], head_groups=switches["HEAD_GROUPS"],
                o_buffer=switches["O_BUFFER"],
                kernels=[(k.name, k.shared, k.stack, k.mma_loop_spills, list(k.ptx_features), k.global_scratch)
                         for k in kernels])


# Gemma-2's soft-capped calls (flash_space.GLUON_SOFTCAP): its head dim 256 on one split K/V slot, and head dim 128.
SOFTCAP_CASES = [(FlashProblem("fwd", 4, 16, 8, 2048, 2048, 256, causal=True, softcap=50.0), 128, 1),
                 (FlashProblem("fwd", 1, 32, 16, 4096, 4096, 128, causal=True, softcap=50.0), 128, 3)]


# Sliding windows (flash_space.GLUON_WINDOW): Mistral-7B v0.1's 4096 keys, Gemma-3's 1024 at head dim 256 on one
# split K/V slot, and Gemma-2's local layers (a window and soft-capping) over packed sequences on 64-key blocks. NOTE:
# with both features on one split slot ptxas leaves 56 spill instructions in the key loop (47 with the two masks in
# branches of their own), over SPLIT_KV_LOOP_SPILLS; the window alone 22, soft-capping alone 15.
WINDOW_CASES = [(FlashProblem("fwd", 1, 32, 8, 8192, 8192, 128, causal=True, window_left=4095), 128, 3),
                (FlashProblem("fwd", 1, 16, 8, 8192, 8192, 256, causal=True, window_left=1023), 128, 1),
                (FlashProblem("fwd", 4, 16, 8, 2048, 2048, 256, causal=True, window_left=1023, softcap=50.0,
                              varlen=True), 64, 2)]


# ALiBi (flash_space.GLUON_ALIBI, off until its GPU test passes: turned on in the compiling process): MPT-7B's heads
# causal, and a two-sided window beside it at head dim 64 on 64-key blocks.
ALIBI_CASES = [(FlashProblem("fwd", 1, 32, 32, 4096, 4096, 128, causal=True, alibi=True), 128, 3),
               (FlashProblem("fwd", 2, 16, 16, 1000, 1000, 64, window_left=100, window_right=30, alibi=True), 64, 4)]


# Padded head dims in two parts (flash_space.GLUON_HEAD_SPLIT; the 16-column tails, which wait for their GPU test, are
# turned on in the compiling process): Phi-3's 96 on 64- and 128-key blocks and packed, 80 and 48. The other groups
# compile the padded tiles.
HEAD_SPLIT_CASES = [CASES[7], (FlashProblem("fwd", 4, 32, 32, 2048, 2048, 96, causal=True), 128, 3), CASES[8],
                    (FlashProblem("fwd", 2, 16, 8, 1000, 1000, 80), 128, 3),
                    (FlashProblem("fwd", 3, 12, 12, 2000, 2000, 48, causal=True), 64, 4)]


# Tiles in groups of heads (flash_space.FORWARD_HEAD_GROUPS and _PACKED, off until their GPU test and timing: turned
# on in the compiling process): Phi-3's heads at 16 x 512 in two parts, queued and in static rounds, Gemma-2's head dim
# 256 on one split K/V slot, and packed sequences.
HEAD_GROUP_CASES = [CASES[7], (FlashProblem("fwd", 4, 32, 32, 2048, 2048, 96, causal=True), 128, 3), CASES[9],
                    CASES[8]]
HEAD_GROUP_QUEUED = (True, True, False, True)


# O through each warpgroup's own buffer (flash_space.FORWARD_O_BUFFER, off until its GPU test and timing: turned on
# in the compiling process): Llama-3's and Phi-3's (split) short prefill on 64-key blocks, head dim 64 on 128-key
# blocks, and packed sequences; each beside its Q slots and K/V stages within the shared memory.
O_BUFFER_CASES = [CASES[6], CASES[7], CASES[2],
                  (FlashProblem("fwd", 8, 32, 8, 1024, 1024, 128, causal=True, varlen=True), 64, 4)]
O_BUFFER_QUEUED = (True, True, False, True)


def _build_job(job) -> dict:
    from autotile.families import flash_space

    case, queue, group = job
    flash_space.GLUON_HEAD_SPLIT = group in ("head split", "head groups", "o buffer")
    flash_space.HEAD_SPLIT_TAILS = (16, 32)
    flash_space.FORWARD_HEAD_GROUPS = flash_space.FORWARD_HEAD_GROUPS_PACKED = group == "head groups"
    flash_space.FORWARD_O_BUFFER = group == "o buffer"
    return _build(*case, queue=queue)


def _compile_cases() -> dict:
    from compile_child import map_in_processes

    from autotile.families import flash_space

    # Set before the pool forks (its processes inherit them): ALiBi and two-sided windows wait for their GPU tests.
    flash_space.GLUON_ALIBI = flash_space.GLUON_TWO_SIDED_WINDOW = True
    groups = {"static": (CASES, False), "queued": (QUEUE_CASES, True), "softcap": (SOFTCAP_CASES, False),
              "window": (WINDOW_CASES, False), "alibi": (ALIBI_CASES, False), "head split": (HEAD_SPLIT_CASES, False)}
    jobs = [(case, queue, name) for name, (cases, queue) in groups.items() for case in cases]
    jobs += [(case, queue, "head groups") for case, queue in zip(HEAD_GROUP_CASES, HEAD_GROUP_QUEUED)]
    jobs += [(case, queue, "o buffer") for case, queue in zip(O_BUFFER_CASES, O_BUFFER_QUEUED)]
    built = iter(map_in_processes(_build_job, jobs))
    results = {name: [next(built) for _ in cases] for name, (cases, _) in groups.items()}
    results["head groups"] = [next(built) for _ in HEAD_GROUP_CASES]
    return dict(results, **{"o buffer": list(built)})


def test_gluon_ws_kernels_compile_for_sm90_without_spills_in_the_key_loop_or_launch_scratch():
    from compile_child import run_compile_child

    results = run_compile_child(__file__)
    assert len(results["static"]) == len(CASES) and len(results["queued"]) == len(QUEUE_CASES)
    assert len(results["softcap"]) == len(SOFTCAP_CASES) and len(results["window"]) == len(WINDOW_CASES)
    assert len(results["alibi"]) == len(ALIBI_CASES) and len(results["head split"]) == len(HEAD_SPLIT_CASES)
    assert not any(result["head_split"] for result in results["static"])
    assert all(result["head_split"] for result in results["head split"])
    assert len(results["head groups"]) == len(HEAD_GROUP_CASES)
    assert all(r["head_groups"] for r in results["head groups"])
    assert not any(r["head_groups"] for r in results["static"])
    assert len(results["o buffer"]) == len(O_BUFFER_CASES) and all(r["o_buffer"] for r in results["o buffer"])
    assert not any(r["o_buffer"] for r in results["static"])
    for case, result in [*zip(CASES, results["static"]), *zip(QUEUE_CASES, results["queued"]),
                         *zip(SOFTCAP_CASES, results["softcap"]), *zip(WINDOW_CASES, results["window"]),
                         *zip(ALIBI_CASES, results["alibi"]), *zip(HEAD_SPLIT_CASES, results["head split"]),
                         *zip(HEAD_GROUP_CASES, results["head groups"]), *zip(O_BUFFER_CASES, results["o buffer"])]:
        assert result["feasible"], case
        (name, shared, stack, loop_spills, features, scratch), = result["kernels"]
        assert name == "attn_fwd" and shared <= H200.smem_per_block, (case, shared)
        # The TMA descriptors come built from the host: none is built in device scratch at launch.
        assert scratch == 0, (case, f"{scratch} B of global scratch a launch")
        assert "wgmma" in features and "tma" in features and "setmaxnreg" in features, (case, features)
        # NOTE: ptxas keeps a few per-tile values (the first key block's wgmma operand descriptors, hoisted out of the
        # persistent tile loop) on the stack for some shapes (non-causal, D = 256: 8-128 bytes) and reloads them once a
        # tile; with packed sequences it reloads one per-tile scalar (the first masked key block) once a key block, an
        # L1 hit beside two 64 x 128 x 128 wgmmas. What must not spill is the key loop's tiles: P spilled around the
        # P V wgmmas at 68 loads and stores a block (256-key blocks at D = 64).
        bound = SPLIT_KV_LOOP_SPILLS if case[0].block_d == 256 and case[1] == 128 else KEY_LOOP_RELOADS
        assert stack == 0 or loop_spills <= bound, (case, f"{loop_spills} spills in the key loop")


def test_a_kept_forward_plan_encodes_each_descriptor_once_per_base_address(monkeypatch):
    """The gluon_ws forward's kept launch binds with descriptors of the first call's q, k, v and o, then hands the C
    launcher the kept encoding of each tensor's base address, encoding only addresses it has not seen."""
    from autotile.families import flash_launch

    binds, calls, encoded = [], [], []

    def encoder(role):
        def encode(t):
            encoded.append((role, t.data_ptr()))
            return (f"map of {role} at {t.data_ptr()}", 7)
        return encode

    def bind_descriptors(kernel, grid, *args, **options):
        binds.append((kernel, grid, args, options))
        return (lambda *call: calls.append(call)), [encoder(role) for role in "qkvo"]

    monkeypatch.setattr(flash_launch, "bind_descriptors", bind_descriptors)
    described = lambda q, k, v, o: [f"{name} desc" for name in "qkvo"]  # noqa: E731
    fwd = flash_launch._DescriptorLaunch("attn_fwd", (132,), (64, 1.5), dict(BLOCK_M=128), True, described)
    q, k, v, o, o2, lse = (torch.zeros(4) for _ in range(6))
    fwd(q, k, v, o, lse)  # the first call launches as it binds
    fwd(q, k, v, o, lse)
    fwd(q, k, v, o2, lse)
    assert [b[2] for b in binds] == [("q desc", "k desc", "v desc", "o desc", q, k, v, o, lse, 64, 1.5)]
    p = lambda t: t.data_ptr()  # noqa: E731
    first, second = calls
    assert first[:8] == (f"map of q at {p(q)}", 7, f"map of k at {p(k)}", 7, f"map of v at {p(v)}", 7,
                         f"map of o at {p(o)}", 7)
    assert [t is u for t, u in zip(first[8:13], (q, k, v, o, lse))] == [True] * 5 and first[13:] == (64, 1.5)
    assert second[:6] == first[:6] and second[6] == f"map of o at {p(o2)}" and second[11] is o2
    assert encoded == [("q", p(q)), ("k", p(k)), ("v", p(v)), ("o", p(o)), ("o", p(o2))]


def test_a_split_head_dims_kept_launch_encodes_each_descriptor_from_its_own_tensor(monkeypatch):
    """HEAD_SPLIT describes each of q, k, v and o twice (DESCRIPTOR_SOURCES): a kept launch encodes each of the eight
    descriptors from the call's tensor it describes, so a new o re-encodes o's two parts and nothing else."""
    from autotile.families import flash_launch

    calls, encoded = [], []

    def encoder(role):
        def encode(t):
            encoded.append((role, t.data_ptr()))
            return (f"{role} at {t.data_ptr()}",)
        return encode

    def bind_descriptors(kernel, grid, *args, **options):
        return (lambda *call: calls.append(call)), [encoder(role + part) for part in ("", "2") for role in "qkvo"]

    monkeypatch.setattr(flash_launch, "bind_descriptors", bind_descriptors)
    described = lambda q, k, v, o: [f"{name}{part} desc" for part in ("", "2") for name in "qkvo"]  # noqa: E731
    fwd = flash_launch._DescriptorLaunch("attn_fwd", (132,), (64,), {}, True, described,
                                         sources=(0, 1, 2, 3, 0, 1, 2, 3))
    q, k, v, o, o2, lse = (torch.zeros(4) for _ in range(6))
    fwd(q, k, v, o, lse)  # launches as it binds
    fwd(q, k, v, o, lse)
    fwd(q, k, v, o2, lse)
    p = lambda t: t.data_ptr()  # noqa: E731
    for call, out in zip(calls, (o, o2)):
        tensors = (q, k, v, out)
        assert call[:8] == tuple(f"{role}{part} at {p(t)}" for part in ("", "2") for role, t in zip("qkvo", tensors))
    assert [role for role, _ in encoded] == list("qkvo") + ["q2", "k2", "v2", "o2"] + ["o", "o2"]
    assert encoded[-2:] == [("o", p(o2)), ("o2", p(o2))]


def test_a_backward_launch_passes_only_the_tensors_after_its_described_ones_as_pointers(monkeypatch):
    """The Gluon backward's main kernel takes descriptors of its first `described` tensors and, as pointers, only
    the tensors after them (dK's and dV's targets: the outputs, or SPLIT > 1's partials), bound and unbound alike."""
    from autotile.families import flash_launch

    launched, calls = [], []

    def bind_descriptors(kernel, grid, *args, **options):
        launched.append(args)
        return (lambda *call: calls.append(call)), [lambda t: (f"map {t.data_ptr()}",)] * 3

    monkeypatch.setattr(flash_launch, "bind_descriptors", bind_descriptors)
    monkeypatch.setattr(flash_launch, "launch", lambda kernel, grid, *args, **options: launched.append(args))
    describe = lambda a, b, c: ["a desc", "b desc", "c desc"]  # noqa: E731
    a, b, c, part, cu = (torch.zeros(4) for _ in range(5))
    for keep in (True, False):
        main = flash_launch._DescriptorLaunch("attn_bwd_gluon", (132,), (9,), {}, keep, describe, described=3,
                                              pointers_too=False)
        main(a, b, c, part, cu)
        main(a, b, c, part, cu)
    assert [args[:3] for args in launched] == [("a desc", "b desc", "c desc")] * 3
    assert all(args[3] is part and args[4] is cu and args[5:] == (9,) for args in launched)
    assert calls[0][:3] == tuple(f"map {t.data_ptr()}" for t in (a, b, c))
    assert calls[0][3] is part and calls[0][4] is cu and calls[0][5:] == (9,)


def test_a_queued_forward_takes_the_streams_zeroed_counters_after_its_descriptors(monkeypatch):
    """TILE_QUEUE's kernel takes two int32 counters after the descriptors, zero at launch: the current stream's tile
    counters, which every kernel using them leaves zero, bound and unbound alike."""
    from autotile.families import flash_launch, gemm_launch

    launched, calls = [], []

    def bind_descriptors(kernel, grid, *args, **options):
        launched.append(args)
        return (lambda *call: calls.append(call)), [lambda t: ("map",)] * 4

    monkeypatch.setattr(flash_launch, "bind_descriptors", bind_descriptors)
    monkeypatch.setattr(flash_launch, "launch", lambda kernel, grid, *args, **options: launched.append(args))
    described = lambda q, k, v, o: ["q desc", "k desc", "v desc", "o desc"]  # noqa: E731
    q, k, v, o = (torch.zeros(4) for _ in range(4))
    counters = gemm_launch.tile_counters(q.device, 2)
    for keep in (True, False):
        fwd = flash_launch._DescriptorLaunch("attn_fwd", (132,), (7,), {}, keep, described, queue=True)
        fwd(q, k, v, o)
        fwd(q, k, v, o)
    assert [a[4] is counters for a in launched] == [True] * 3 and launched[0][5:] == (q, k, v, o, 7)
    assert calls[0][4] is counters and calls[0][5:] == (q, k, v, o, 7)


def _variants_script():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "prototypes"))
    import gluon_flash_variants

    return gluon_flash_variants


def test_every_source_patch_of_the_variants_script_still_matches_the_kernel():
    # A patch that no longer matches stops a GPU run at its first shape: renames in the template must carry over.
    variants = _variants_script()
    problem = FlashProblem("fwd", 16, 32, 8, 512, 512, 128, causal=True)
    for name in variants.PATCHES:
        variants._rendered(problem, variants.gluon(128, 64, 4), name)


def test_the_variants_scripts_queue_set_pairs_each_gluon_default_with_the_queue_on_and_off():
    variants = _variants_script()
    cases = variants.queue_cases(H200)
    assert len(cases) >= 10
    for label, problem, pair in cases:
        (static, _), (queued, _) = pair["static"], pair["queue"]
        assert dict(static, TILE_QUEUE=True) == dict(queued) and not static["TILE_QUEUE"], label
        assert FAMILY.space(problem, H200).admit(static) and FAMILY.space(problem, H200).admit(queued), label
        assert dict(FAMILY.default_config(problem, H200)) in (dict(static), dict(queued)), label


def test_the_variants_script_renders_the_queue_from_the_config_beside_a_patch():
    from pathlib import Path

    gluon_flash_variants = _variants_script()
    problem = FlashProblem("fwd", 4, 16, 8, 2048, 2048, 256, causal=True)
    queued = gluon_flash_variants._rendered(problem, gluon_flash_variants.gluon(128, 64, 2, queue=True), "tile_major")
    assert queued.TILE_QUEUE and "if False:" in Path(queued.__file__).read_text()  # the tile_major patch applied
    assert not gluon_flash_variants._rendered(problem, gluon_flash_variants.gluon(128, 64, 2), None).TILE_QUEUE


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_compile_cases()) + "\n")


@pytest.mark.parametrize("template", ["flash_gluon_ws.py.j2", "flash_gluon_bwd.py.j2"])
def test_a_plain_gluon_render_carries_no_window_or_soft_capping_code(template):
    """Windows (LEFT_BOUND) and soft-capping (SOFTCAP) are render switches: a call without them runs a kernel with
    none of their code, arguments or masks."""
    from autotile.render import render_source

    def render(**features):
        problem = dataclasses.replace(LLAMA_4K, direction="bwd" if "bwd" in template else "fwd", **features)
        return render_source(template, **FAMILY.render_switches(problem, FAMILY.default_config(problem, H200)))

    plain = render()
    # (The forward kernel's signature takes win_left and softcap for every variant; none reads them unrendered.)
    for marker in ("_first_key_block", "_end_block", "left_until", "it -= first", "_tanh", "cap_scale"):
        assert marker not in plain, marker
    assert "bwd" not in template or ("win_left" not in plain and "win_right" not in plain)
    windowed = render(window_left=1023)
    assert "_end_block" in windowed or ("_first_key_block" in windowed and "left_until" in windowed)
    if "bwd" not in template:
        assert "_tanh" in render(softcap=50.0)
