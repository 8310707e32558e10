"""Where the gluon_ws GEMM's stream-K and split-K time goes: variants of its template timed beside data-parallel (GPU).

On an H100 (results/prefill_m1536_all_2026-12-07d_h100.json, n2560_prefill_all_2026-12-07d_h100.json) stream-K and
split-K 128 x 128 tiles ran 1.2-2.7x the time that spreading the data-parallel tiles' work evenly over the SMs would
take, and the excess grew with K (576 x 2560: +15 us at K = 2048, +24 at 4096, +40 at 9728), where the fix-up
(partials written, counted and summed) is the same at every K; the variants below then showed the fix-up's partial
loads to be the cost (RESULTS.md, fifty-first run). Each variant below changes one thing in a copy of
templates/gemm_gluon_ws.py.j2, rendered and launched through the family's own plans:
  - orig: the template as it is;
  - nostore: contributors count themselves without writing their partial (the last one sums stale slots);
  - nofix: no partial, no count, no sum: split tiles are never finished (time of the MMA work alone);
  - noreduce: the last contributor finishes the tile from its own partial sum alone (no partial loads);
  - skfirst: each program runs its stream-K (or split) share before its whole tiles, as CUTLASS orders them;
  - relacq: contributors count with a release atomic; only the last acquires (a second, acquire atomic);
  - relaxed: the count without ordering (no fences around the atomic);
  - nobarrier: no barrier between the warpgroup's partial stores and its count;
  - nolast: partials written and counted, but no contributor finishes the tile (no partial loads, no epilogue).
    NOTE: nothing resets its tile counters, which every launch on the stream shares, so it runs alone: a variant
    timed beside it (orig included) would find its counters past its count and never finish a tile;
  - allfinish: no partial written, no count: every contributor loads the slots and finishes the tile;
  - coalesced: partials laid out in the accumulator's register order, so that their stores and loads coalesce (the
    template's COALESCED_PARTIALS switch, on);
  - ownsum: split_k's last contributor keeps its own sum in registers (it neither stores nor reloads it); the others
    count their arrival, store, then count the store, for which the last waits;
  - coalesced_ownsum: both.
The other variants give wrong results, or may, on purpose (timing only); those in CHECKED are checked against F.linear
in float64. Medians of 5 interleaved rounds of do_bench medians (gemm_kernels_bench.interleaved), L2
not flushed.

    PYTHONPATH=. python benchmarks/prototypes/gluon_stream_k_diag.py OUT_DIR [VARIANT,...]   # default: all but nolast
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gemm_kernels_bench import interleaved  # noqa: E402

import autotile.render as render  # noqa: E402
from autotile.families import gemm_launch  # noqa: E402
from autotile.families.gemm import FAMILY, contiguous_problem  # noqa: E402
from autotile.families.gemm_policy import gluon_config  # noqa: E402
from autotile.resources import templates_dir  # noqa: E402
from autotile.space import Config  # noqa: E402

TEMPLATE = "gemm_gluon_ws.py.j2"
SHAPES = [(576, 2560, 4096), (1536, 3584, 3584), (1024, 512, 3584)]
CHECKED = ("orig", "skfirst", "relacq", "coalesced", "ownsum", "coalesced_ownsum")

STORE = ("    gl.store(_partials(ws_ptr, slot, offsets, TILE), acc)\n    gl.thread_barrier()\n"
         "    return gl.atomic_add(counter, 1, sem=\"acq_rel\", scope=\"gpu\")")
# A store that writes nothing (slot and offsets are never negative) but keeps the MMAs' result live: where a variant
# leaves the sum unused, the compiler drops the wgmma work itself (a variant that returned at once compiled its split
# tiles' main loop to one 64 x 8 dummy wgmma an iteration, sm90).
KEEP = "    gl.store(_partials(ws_ptr, slot, offsets, TILE), acc, mask=offsets + slot < 0)\n"
REDUCE_LOAD = ("total += gl.load(_partials(ws_ptr, 2 * qq + began_before, offsets, BLOCK_M * BLOCK_N),\n"
               "                                     cache_modifier=\".cg\")")
LAST = re.compile(r"(if _store_and_count\(.*?\)) == [^\n]*:$", re.MULTILINE)
# The template's switch for partials in the accumulator's register order (gemm_space.COALESCED_PARTIALS), forced on.
COALESCED_SWITCH = "{% if COALESCED_PARTIALS %}"
# split_k's tail with the last contributor's own sum kept in registers: a unit counts its arrival first (low 16 bits);
# one that is not last stores its partial, then counts the store (high bits, release); the last waits for the
# others' stores (acquire), loads only theirs, and adds its own in its split's place (the same order as orig's).
SPLIT_FIXUP = (
    "        if _store_and_count(ws_ptr, u, offsets, acc, counter, BLOCK_M * BLOCK_N) == sk_iters - 1:\n"
    "            total = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout)\n")
SPLIT_LOADS = (
    "                for j in gl.static_range(SPLIT_K):\n"
    "                    # .cg: straight from L2, where the other SMs' partials are.\n"
    "                    total += gl.load(_partials(ws_ptr, j * rest + r, offsets, BLOCK_M * BLOCK_N), "
    "mask=j < sk_iters,\n"
    "                                     other=0.0, cache_modifier=\".cg\")\n")
OWN_FIXUP = (
    "        arrived = gl.atomic_add(counter, 1, sem=\"relaxed\", scope=\"gpu\") % 65536\n"
    "        if arrived != sk_iters - 1:\n"
    "            gl.store(_partials(ws_ptr, u, offsets, BLOCK_M * BLOCK_N), acc)\n"
    "            gl.thread_barrier()\n"
    "            gl.atomic_add(counter, 65536, sem=\"release\", scope=\"gpu\")\n"
    "        else:\n"
    "            stored = gl.atomic_add(counter, 0, sem=\"acquire\", scope=\"gpu\") // 65536\n"
    "            while stored < sk_iters - 1:\n"
    "                stored = gl.atomic_add(counter, 0, sem=\"acquire\", scope=\"gpu\") // 65536\n"
    "            total = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout)\n")
OWN_LOADS = (
    "                for j in gl.static_range(SPLIT_K):\n"
    "                    if j == u // rest:\n"
    "                        total += acc\n"
    "                    else:\n"
    "                        total += gl.load(_partials(ws_ptr, j * rest + r, offsets, BLOCK_M * BLOCK_N),\n"
    "                                         mask=j < sk_iters, other=0.0, cache_modifier=\".cg\")\n")
WHOLE_TILES = "    for tile in range(gl.program_id(0), dp_tiles, gl.num_programs(0)):\n"


def _swap(text: str, function: str, first: str, second: str, end: str) -> str:
    """In `function`'s body, the text from `first` up to `second` moved after the text from `second` up to `end`."""
    at = text.index(function)
    a = text.index(first, at)
    b = text.index(second, a)
    e = text.index(end, b)
    return text[:a] + text[b:e] + text[a:b] + text[e:]


def variants(source: str) -> dict[str, str]:
    assert all(anchor in source for anchor in (STORE, REDUCE_LOAD, COALESCED_SWITCH, SPLIT_FIXUP, SPLIT_LOADS)), \
        "the template's fix-up moved: update this prototype"
    sk_first = _swap(source, "def _producer(", WHOLE_TILES, '{% if SCHEDULE == "split_k" %}', "\n\n@gluon.jit")
    sk_first = _swap(sk_first, "def _consumer(WG", WHOLE_TILES, "    rows = gl.arange(0, WG_ROWS",
                     "    tma.store_wait(0)\n")
    coalesced = source.replace(COALESCED_SWITCH, "{% if true %}")
    relacq = source.replace('sem="acq_rel"', 'sem="release"')
    relacq = re.sub(r"(\n( *)if _store_and_count\(.*\n)(( *)\S)",
                    lambda m: m.group(1) + m.group(4) + 'gl.atomic_add(counter, 0, sem="acquire", scope="gpu")\n'
                    + m.group(3), relacq)
    return {
        "orig": source,
        "nostore": source.replace(STORE, KEEP + STORE.split("\n", 1)[1]),
        "nofix": source.replace(STORE, KEEP + "    return -1"),
        "noreduce": source.replace(REDUCE_LOAD, "total += acc"),
        "relaxed": source.replace(STORE, STORE.replace('sem="acq_rel"', 'sem="relaxed"')),
        "nobarrier": source.replace(STORE, STORE.replace("    gl.thread_barrier()\n", "")),
        "nolast": LAST.sub(r"\1 == -5:", source),
        "allfinish": source.replace(STORE, KEEP + "    return 1"),
        "coalesced": coalesced,
        "ownsum": source.replace(SPLIT_FIXUP, OWN_FIXUP).replace(SPLIT_LOADS, OWN_LOADS),
        "coalesced_ownsum": coalesced.replace(SPLIT_FIXUP, OWN_FIXUP).replace(SPLIT_LOADS, OWN_LOADS),
        "skfirst": sk_first,
        "relacq": relacq,
    }


def use_template(folder: Path) -> None:
    """Render from `folder` from now on (a copy of templates/ with one template changed)."""
    render.templates_dir = lambda: folder
    render.environment.cache_clear()
    render._loaded.clear()
    gemm_launch.launch_plan.cache_clear()


# The candidates' 128 x 128 x 64 tiles on 5 stages (the prefill default's), and 128 x 256 on 3.
SCHEDULES = {"dp": dict(), "sk": dict(SCHEDULE="stream_k"), "split2": dict(SCHEDULE="split_k", SPLIT_K=2),
             "split4": dict(SCHEDULE="split_k", SPLIT_K=4),
             "sk256": dict(SCHEDULE="stream_k", BLOCK_N=256, num_stages=3)}


def configs(problem) -> dict[str, Config]:
    return {name: Config(gluon_config(problem, **dict(dict(BLOCK_K=64, num_stages=5), **values)))
            for name, values in SCHEDULES.items()}


def selected(names, only: list[str] | None) -> list[str]:
    """The variants a run times: those asked for and orig (all by default), but nolast only alone, since it leaves
    the stream's tile counters counted for every launch after it."""
    if only == ["nolast"]:
        return only
    if only and "nolast" in only:
        raise SystemExit("nolast leaves the stream's tile counters counted: time it alone")
    return [name for name in names if name != "nolast" and (not only or name in only or name == "orig")]


def main(out: Path, only: list[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="stream_k_diag_"))
    folders = {}
    texts = variants((templates_dir() / TEMPLATE).read_text())
    for name in selected(texts, only):
        text = texts[name]
        folders[name] = work / name
        shutil.copytree(templates_dir(), folders[name])
        (folders[name] / TEMPLATE).write_text(text)
    rows = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        ref = F.linear(x.double(), w.double())
        fns = {"cuBLAS": lambda x=x, w=w: F.linear(x, w)}
        errors = {}
        for variant, folder in folders.items():
            use_template(folder)
            for name, config in configs(problem).items():
                if variant != "orig" and name == "dp":  # the variants change the split tiles' path only
                    continue
                c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                plan = gemm_launch.launch_plan(FAMILY, problem, config, x.device)

                def call(plan=plan, c=c, x=x, b=w.t()):
                    gemm_launch.run_plan(plan, x, b, c, {})
                call()
                torch.cuda.synchronize()
                if variant in CHECKED:
                    errors[f"{variant}/{name}"] = (c.double() - ref).abs().max().item()
                fns[f"{variant}/{name}"] = call
        us = {name: ms * 1000 for name, ms in interleaved(fns, 5, 5, 30).items()}
        print(f"{m}x{n}x{k}: " + ", ".join(f"{name} {t:.1f}" for name, t in us.items()), flush=True)
        print("  max |error| against float64: " + ", ".join(f"{n_} {e:.3g}" for n_, e in errors.items()), flush=True)
        rows.append(dict(m=m, n=n, k=k, us=us, max_error=errors))
    (out / "stream_k_diag.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(",") if len(sys.argv) > 2 else None)
