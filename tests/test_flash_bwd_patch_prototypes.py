"""The source patches of benchmarks/prototypes/flash_bwd_tile_clock.py (timestamps at tile boundaries),
flash_bwd_tma_epilogue.py (dK and dV by TMA stores) and flash_bwd_host_desc.py (host-built descriptors) still find
their anchors in today's rendered Gluon backward and give Python that parses: a template change that moves an anchor
fails here, not on the GPU. (Their sm90 builds: each script's --compile-only.)"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem
from autotile.render import render_source

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "prototypes"))

CONFIG = dict(LOADS=GLUON_WS, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=64, BLOCK_N2=128, num_warps=4, num_stages=2)


def rendered(problem) -> str:
    return render_source(FAMILY.template, **FAMILY.render_switches(problem, CONFIG))


@pytest.mark.parametrize("problem", [FlashProblem("bwd", 4, 32, 32, 2048, 2048, 128, causal=True),
                                     FlashProblem("bwd", 8, 32, 8, 2048, 2048, 128, causal=True, varlen=True)],
                         ids=["dense", "packed"])
def test_the_clock_patch_stamps_each_tile_of_the_consumers(problem):
    import flash_bwd_tile_clock as clock

    source = clock.patch(rendered(problem), 1 << 40)
    ast.parse(source)
    consumer = source[source.index("def _consumer("):source.index("def attn_bwd_gluon(")]
    # program start, SM, four stamps a tile, program end: all in the consumer partitions
    assert consumer.count("_stamp(") == 7
    assert "_stamp(" not in source[source.index("def _producer("):source.index("def _stamp(")]


@pytest.mark.parametrize("head_dim", [128, 96, 64])
def test_the_epilogue_patch_sends_dk_and_dv_by_tma_where_one_program_has_a_tile(head_dim):
    import flash_bwd_tma_epilogue as epilogue

    source = epilogue.patch(rendered(FlashProblem("bwd", 4, 32, 32, 2048, 2048, head_dim, causal=True)))
    ast.parse(source)
    assert source.count("tma.async_copy_shared_to_global(d") == 2  # dK, then dV
    assert source.count("dq_desc, dq_smem, dk_desc, dv_desc, dk_ptr") == 3  # the consumer's signature, its 2 calls
    assert "if SPLIT == 1:" in source and "gl.store(dk_ptr + dk_offsets" in source  # partials keep gl.store


def test_the_descriptor_patch_takes_all_seven_from_the_host():
    import flash_bwd_host_desc as host

    source = host.patch(rendered(FlashProblem("bwd", 4, 32, 32, 2048, 2048, 128, causal=True)))
    ast.parse(source)
    kernel = source[source.index("def attn_bwd_gluon("):]
    assert "make_tensor_descriptor" not in kernel
    assert all(f"    {name}_desc = host_{name}\n" in kernel for name in host.NAMES)
