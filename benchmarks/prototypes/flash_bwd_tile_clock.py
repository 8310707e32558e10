"""Where the Gluon backward's time goes at tile boundaries: the family's kernel with %globaltimer stamps.

The rendered templates/flash_gluon_bwd.py.j2 is patched (source text, this script only): each consumer warpgroup
stamps its program's start and end and SM, and for each of its tiles the start, K and V's arrival, the last step's
end and the end of the dK/dV stores, into a buffer whose address the patch bakes in. Printed: medians over tiles of
each phase in us, the steps a tile, and the gap an SM spends between one program's end and the next one's start.
On a Hopper GPU (the family's Gluon backward, untuned schedule):
    PYTHONPATH=. python benchmarks/prototypes/flash_bwd_tile_clock.py [--shape B,HQ,HKV,S,D[,causal]]
On a CPU, --compile-only checks that the patched kernel compiles for sm90.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from autotile import render  # noqa: E402
from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem  # noqa: E402

SLOTS = 20  # a (program, warpgroup)'s stamps: start, end, SM, then 4 a tile for up to 4 tiles
HELPER = '''
@gluon.jit
def _stamp(index, VALUE: gl.constexpr):
    # VALUE 0: %globaltimer (ns), 1: %smid; stored by one thread at TS_ADDR + 8 * index.
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    zero = gl.full([1], 0, gl.int64, layout)
    if VALUE == 0:
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [zero], dtype=gl.int64, is_pure=False,
                                        pack=1)
    else:
        now = gl.inline_asm_elementwise("{ .reg .b32 sm; mov.u32 sm, %smid; cvt.u64.u32 $0, sm; }", "=l,l", [zero],
                                        dtype=gl.int64, is_pure=False, pack=1)
    address = gl.full([1], TS_ADDR, gl.int64, layout) + index.to(gl.int64) * 8
    gl.store(address.to(gl.pointer_type(gl.int64), bitcast=True), now)

'''


def patch(source: str, address: int) -> str:
    """The rendered backward with stamps in its consumer partitions (anchors: lines of the rendered template)."""
    def once(text: str, old: str, new: str, nth: int = 1) -> str:
        at = -1
        for _ in range(nth):
            at = text.index(old, at + 1)
        return text[:at] + new + text[at + len(old):]

    consumer = "@gluon.jit\ndef _consumer("
    source = once(source, consumer, HELPER.replace("TS_ADDR", str(address)) + "\n" + consumer)
    base = "((gl.program_id(0) * 2 + WG) * {slots})".format(slots=SLOTS)
    mine = "    work, work_end = _my_work(n_work, whole, tail_programs, group, seq_q, BLOCK_M, CHUNK, TAIL)\n"
    loop = mine + "    while work < work_end:\n        kb, b, h_kv"
    source = once(source, loop,  # the consumer's (the producer's comes first)
                  f"{mine}    first_work = work\n    _stamp({base} + 0, 0)\n"
                  f"    _stamp({base} + 2, 1)\n    while work < work_end:\n        kb, b, h_kv", nth=2)
    tile = f"{base} + 3 + 4 * (work - first_work)"
    source = once(source, "            mbarrier.wait(kv_bar, t & 1)\n",
                  f"            _stamp({tile} + 0, 0)\n            mbarrier.wait(kv_bar, t & 1)\n"
                  f"            _stamp({tile} + 1, 0)\n")
    source = once(source, "            mbarrier.arrive(kv_empty, count=1)\n",
                  f"            _stamp({tile} + 2, 0)\n            mbarrier.arrive(kv_empty, count=1)\n")
    source = once(source, "            t += 1\n        work += 1\n    tma.store_wait(0)\n",
                  f"            _stamp({tile} + 3, 0)\n            t += 1\n        work += 1\n    tma.store_wait(0)\n"
                  f"    _stamp({base} + 1, 0)\n")
    return source


def patched_render(address: int):
    plain = render.render_source

    def render_source(template: str, **switches) -> str:
        source = plain(template, **switches)
        return patch(source, address) if "def attn_bwd_gluon(" in source else source
    return render_source


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,32,32,2048,128")
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    batch, heads_q, heads_kv, seq, head_dim, *rest = args.shape.split(",")
    problem = FlashProblem("bwd", int(batch), int(heads_q), int(heads_kv), int(seq), int(seq), int(head_dim),
                           causal=rest == ["causal"])
    config = dict(LOADS=GLUON_WS, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=64, BLOCK_N2=128, num_warps=4, num_stages=2)
    if args.compile_only:
        from autotile import xcompile
        from autotile.device import planned_device

        render.render_source = patched_render(1 << 40)
        builds = xcompile.compile_config(FAMILY, problem, config, planned_device("h200"), read_resources=False)
        print("compiled for sm90:", [k.name for k in builds])
        return 0
    from autotile.device import cuda_device

    device = cuda_device()
    programs = 4096  # more than any schedule of these shapes launches
    stamps = torch.zeros(programs * 2 * SLOTS, dtype=torch.int64, device="cuda")
    render.render_source = patched_render(stamps.data_ptr())
    inputs = FAMILY.make_inputs(problem, device, seed=0)
    outputs = FAMILY.allocate_outputs(problem, inputs)
    for _ in range(3):
        stamps.zero_()
        FAMILY.launch(problem, config, inputs, outputs)
        torch.cuda.synchronize()
    rows = stamps.view(programs, 2, SLOTS).cpu()
    used = rows[:, 0, 0] > 0
    rows = rows[used]
    t0 = rows[:, :, 0].min().item()
    phases = {"wait for K and V": [], "steps": [], "dK/dV stores": [], "between tiles": []}
    for prog in rows:
        for wg in prog:
            tiles = [wg[3 + 4 * j: 7 + 4 * j].tolist() for j in range(4) if wg[3 + 4 * j] > 0]
            for j, (start, ready, done, stored) in enumerate(tiles):
                phases["wait for K and V"].append(ready - start)
                phases["steps"].append(done - ready)
                phases["dK/dV stores"].append(stored - done)
                if j:
                    phases["between tiles"].append(start - tiles[j - 1][3])
    print(f"# {args.shape}: {len(rows)} programs; medians over tiles and warpgroups, us")
    for name, values in phases.items():
        if values:
            print(f"  {name}: median {statistics.median(values) / 1e3:.2f}, mean {statistics.mean(values) / 1e3:.2f}")
    # An SM's programs in start order: the gap from one's end to the next one's start.
    by_sm: dict[int, list] = {}
    for prog in rows:
        by_sm.setdefault(int(prog[0, 2]), []).append((int(prog[:, 0].min()), int(prog[:, 1].max())))
    gaps = [b[0] - a[1] for runs in by_sm.values() for a, b in zip(sorted(runs), sorted(runs)[1:])]
    if gaps:
        print(f"  between programs on an SM: median {statistics.median(gaps) / 1e3:.2f}, mean "
              f"{statistics.mean(gaps) / 1e3:.2f}; whole launch {(rows[:, :, 1].max().item() - t0) / 1e3:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
