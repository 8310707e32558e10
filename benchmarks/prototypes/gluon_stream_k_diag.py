"""Where the gluon_ws GEMM's stream-K and split-K time goes: variants of its template timed beside data-parallel (GPU).

On an H100 (results/prefill_m1536_all_2026-12-07d_h100.json, n2560_prefill_all_2026-12-07d_h100.json) stream-K and
split-K 128 x 128 tiles ran 1.2-2.7x the time that spreading the data-parallel tiles' work evenly over the SMs would
take, and the excess grew with K. Variants of the template then showed (RESULTS.md, fifty-first and fifty-second runs)
that the split tiles' MMA work is not slow, that the fences cost nothing measurable, and that the fix-up's partial
loads were the cost: the template now lays partials out in register order and split_k's last contributor keeps its
own sum. Each variant below changes one thing in a copy of templates/gemm_gluon_ws.py.j2, rendered and launched
through the family's own plans:
  - orig: the template as it is;
  - nofix: no partial, no count, no sum: split tiles are never finished (time of the MMA work alone, the bound a
    cheaper fix-up could reach);
  - noreduce: stream-K's last contributor finishes the tile from its own partial sum alone (no partial loads);
  - skfirst: each program runs its stream-K (or split) share before its whole tiles, as CUTLASS orders them;
  - rowmajor: partials in row-major order (the template's COALESCED_PARTIALS switch, off);
  - storeown: split_k's last contributor stores its own partial and loads it back, as the others' (the template
    before it kept its own sum);
  - splitnoload: split_k's last contributor waits for the others' stores as orig does, then finishes from its own
    sum (no partial loads): orig minus this is what the loads cost, this minus nofix what the counting, the wait
    for the slowest contributor and the split tiles' epilogue cost;
  - splitnowait: split_k's last contributor loads the partials as soon as it knows it is last, without waiting for
    the others' stores (orig minus this: the wait alone);
  - splitowned: each warpgroup's rows of a split tile have a fixed owner, split (WG % splits), which waits for the
    others' stores of those rows and finishes them (the template's OWNED_SPLITS switch, on; gemm_space.OWNED_SPLITS,
    off, says why): with two warpgroups, two SMs share a tile's loads and epilogue where the last to arrive did
    both. Only where each program runs one split at most; elsewhere as orig.
nofix, noreduce, splitnoload and splitnowait give wrong results on purpose (timing only); those in CHECKED are
checked against F.linear in float64. Medians of 5 interleaved rounds of do_bench medians
(gemm_kernels_bench.interleaved), L2 not flushed.

    PYTHONPATH=. python benchmarks/prototypes/gluon_stream_k_diag.py OUT_DIR [VARIANT,... [SCHEDULE,... [MxNxK,...]]]
    (default: every variant and schedule on SHAPES; each kernel compiles for several seconds, so name few where time
    counts). The long-K prefill tail's question (RESULTS.md, "Causal tiles in head groups sized for L2, long-K tails
    split over K"): where 128 x 256 tiles split in two lose 11% at 3000 x 3584 x 18944,
    `OUT orig,nofix,splitnoload,splitnowait dp256,split2w,split3w 3000x3584x18944`.
"""
from __future__ import annotations

import json
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
# (128, 4096, 4096): a batched decode step's square projection, 32 whole tiles (a quarter of the SMs) or 128 split
# ones, where the fix-up decides whether splitting pays.
# (100, 3072, 3072): few tokens on a square weight, where swapped 128 x 64 tiles fill 48 SMs whole and 96 split.
# Few tokens first: the band the fix-up decides.
SHAPES = [(100, 3072, 3072), (128, 4096, 4096), (1024, 512, 3584), (576, 2560, 4096), (1536, 3584, 3584)]
CHECKED = ("orig", "skfirst", "rowmajor", "storeown", "splitowned")

STORE = ("    gl.store(_partials(ws_ptr, slot, offsets, TILE), acc)\n    gl.thread_barrier()\n"
         "    return gl.atomic_add(counter, 1, sem=\"acq_rel\", scope=\"gpu\")")
# A store that writes nothing (slot and offsets are never negative) but keeps the MMAs' result live: where a variant
# leaves the sum unused, the compiler drops the wgmma work itself (a variant that returned at once compiled its split
# tiles' main loop to one 64 x 8 dummy wgmma an iteration, sm90).
KEEP = "    gl.store(_partials(ws_ptr, slot, offsets, TILE), acc, mask=offsets + slot < 0)\n"
REDUCE_LOAD = ("total += gl.load(_partials(ws_ptr, 2 * qq + began_before, offsets, BLOCK_M * BLOCK_N),\n"
               "                                     cache_modifier=\".cg\")")
# The template's switch for partials in the accumulator's register order (gemm_space.COALESCED_PARTIALS).
COALESCED_SWITCH = "{% if COALESCED_PARTIALS %}"
# split_k's choice of protocol (up to 128 columns the last contributor keeps its own sum) and the sum's own term.
KEEPING_OWN = "        if BLOCK_N <= 128:\n{% if OWNED_SPLITS %}\n"
OWN_TERM = "                    if j == u // rest:\n"
KEEP_OWN = ("            gl.store(_partials(ws_ptr, u, offsets, BLOCK_M * BLOCK_N), acc, mask=offsets + u < 0)\n"
            "            last = sk_iters < 0\n")  # never, but not known while compiling
WHOLE_TILES = "    for tile in range(gl.program_id(0), dp_tiles, gl.num_programs(0)):\n"
# split_k's loads of the other contributors' partials (up to 128 columns), and the last one's wait for their stores.
SPLIT_LOAD = ("total += gl.load(_partials(ws_ptr, j * rest + r, offsets, BLOCK_M * BLOCK_N),\n"
              "                                         mask=j < sk_iters, other=0.0, cache_modifier=\".cg\")")
SPLIT_WAIT = "        while stored < contributors - 1:\n"
# The template's switch for split tiles finished by fixed owners (gemm_space.OWNED_SPLITS).
OWNED_SWITCH = "{% if OWNED_SPLITS %}"


def _swap(text: str, function: str, first: str, second: str, end: str) -> str:
    """In `function`'s body, the text from `first` up to `second` moved after the text from `second` up to `end`."""
    at = text.index(function)
    a = text.index(first, at)
    b = text.index(second, a)
    e = text.index(end, b)
    return text[:a] + text[b:e] + text[a:b] + text[e:]


def variants(source: str) -> dict[str, str]:
    anchors = (STORE, REDUCE_LOAD, COALESCED_SWITCH, KEEPING_OWN, OWN_TERM, SPLIT_LOAD, SPLIT_WAIT, OWNED_SWITCH)
    assert all(anchor in source for anchor in anchors), \
        "the template's fix-up moved: update this prototype"
    sk_first = _swap(source, "def _producer(", WHOLE_TILES, '{% if SCHEDULE == "split_k" %}', "\n\n@gluon.jit")
    sk_first = _swap(sk_first, "def _consumer(WG", WHOLE_TILES, "    rows = gl.arange(0, WG_ROWS",
                     "    tma.store_wait(0)\n")
    start = source.index("\n            last = _arrive_keeping_own(")  # the plain protocol's call (OWNED_SPLITS off)
    own_call = source[start:source.index("\n", start + 1) + 1]
    return {
        "orig": source,
        "nofix": source.replace(STORE, KEEP + "    return -1").replace(own_call, "\n" + KEEP_OWN).replace(
            OWNED_SWITCH, "{% if false %}"),
        "noreduce": source.replace(REDUCE_LOAD, "total += acc"),
        "skfirst": sk_first,
        "rowmajor": source.replace(COALESCED_SWITCH, "{% if false %}"),
        "storeown": source.replace(KEEPING_OWN, KEEPING_OWN.replace("<= 128", "< 0")).replace(
            OWN_TERM, OWN_TERM.replace("j == u // rest", "j < 0")),
        "splitnoload": source.replace(SPLIT_LOAD, "total += acc"),
        "splitnowait": source.replace(SPLIT_WAIT, SPLIT_WAIT.replace("contributors - 1", "0")),
        "splitowned": source.replace(OWNED_SWITCH, "{% if true %}"),
    }


def use_template(folder: Path) -> None:
    """Render from `folder` from now on (a copy of templates/ with one template changed)."""
    render.templates_dir = lambda: folder
    render.environment.cache_clear()
    render._loaded.clear()
    gemm_launch.launch_plan.cache_clear()


# The candidates' 128 x 128 x 64 tiles on 5 stages (the prefill default's), and 128 x 256 on 3; swapped (sw*), 64
# tokens over 128 weight rows on 6 stages (gemm_policy.gluon_swapped_config's), timed on shapes of up to
# SWAPPED_MAX_M tokens.
SWAPPED = dict(SWAP_AB=True, BLOCK_M=64, BLOCK_N=128, GROUP_M=1, num_stages=6)
SCHEDULES = {"dp": dict(), "sk": dict(SCHEDULE="stream_k"), "split2": dict(SCHEDULE="split_k", SPLIT_K=2),
             "split4": dict(SCHEDULE="split_k", SPLIT_K=4),
             "sk256": dict(SCHEDULE="stream_k", BLOCK_N=256, num_stages=3),
             "dp256": dict(BLOCK_N=256, num_stages=3), "split2w": dict(SCHEDULE="split_k", SPLIT_K=2, BLOCK_N=256,
                                                                       num_stages=3),
             "split3w": dict(SCHEDULE="split_k", SPLIT_K=3, BLOCK_N=256, num_stages=3),
             "swdp": SWAPPED, "swsplit2": dict(SWAPPED, SCHEDULE="split_k", SPLIT_K=2)}
SWAPPED_MAX_M = 256


def configs(problem, schedules: list[str] | None = None) -> dict[str, Config]:
    return {name: Config(gluon_config(problem, **dict(dict(BLOCK_K=64, num_stages=5), **values)))
            for name, values in SCHEDULES.items() if (not schedules or name in schedules or name == "dp")
            and (problem.m <= SWAPPED_MAX_M or not values.get("SWAP_AB"))}


def whole_tiles(name: str) -> bool:
    """Whether schedule `name` runs whole tiles only: the variants change the split tiles' path, so it is timed once."""
    return SCHEDULES[name].get("SCHEDULE", "data_parallel") == "data_parallel"


def selected(names, only: list[str] | None) -> list[str]:
    """The variants a run times: those asked for and orig (all by default)."""
    unknown = set(only or ()) - set(names)
    if unknown:
        raise SystemExit(f"no variant {sorted(unknown)}: pick from {sorted(names)}")
    return [name for name in names if not only or name in only or name == "orig"]


def main(out: Path, only: list[str] | None = None, schedules: list[str] | None = None,
         shapes: list[str] | None = None) -> None:
    unknown = set(schedules or ()) - set(SCHEDULES)
    if unknown:  # checked once, before anything compiles
        raise SystemExit(f"no schedule {sorted(unknown)}: pick from {sorted(SCHEDULES)}")
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
    for m, n, k in [tuple(int(x) for x in shape.split("x")) for shape in shapes] if shapes else SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        ref = F.linear(x.double(), w.double())
        fns = {"cuBLAS": lambda x=x, w=w: F.linear(x, w)}
        errors = {}
        for variant, folder in folders.items():
            use_template(folder)
            for name, config in configs(problem, schedules).items():
                if variant != "orig" and whole_tiles(name):
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
        # After each shape: a device call that runs out of time keeps the shapes timed before it.
        (out / "stream_k_diag.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                                           indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(arg.split(",") for arg in sys.argv[2:5]))
