"""The source patch of benchmarks/prototypes/flash_bwd_tile_clock.py (timestamps at tile boundaries) still finds its
anchors in today's rendered Gluon backward and gives Python that parses: a template change that moves an anchor fails
here, not on the GPU."""
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
