"""The flash backward on the GPU: the family's Gluon and Triton backwards and the public op beside SDPA's cuDNN and
FlashAttention-2 backwards, on the prefill shapes of real models.

    PYTHONPATH=. python benchmarks/flash_bwd_bench.py [--quick] [--shapes LABEL,...] > OUT.txt

Each shape: the Gluon backward (templates/flash_gluon_bwd.py.j2) on two slots (--all-stages: each count; and, where programs
share tiles, SPLIT, each tile walked by one program: 'unsplit'; where even tiles end in a stream-K tail, without it:
'no tail'; --chunks: other numbers of consecutive tiles a program, 'chunkN'; --tail: a tail forced where the rule
declines one, 'forced tail'), the Triton backward's
untuned config (FlashFamily.triton_backward_default), the untuned default as the family picks it, and the public op
(autotile.flash_attention's autograd backward with generated kernels only, AUTOTILE_VENDOR=0, no tuned winners), all
given the same O and LSE; SDPA's backends through autograd on their own forward's graph. The Gluon backward's
gradients are checked on every shape against plain torch in fp32 first (FlashAttention's rule is what the family's
tests check against float64; here a gross-error check: relative max error under 2%).
Timings: interleaved rounds of triton.testing.do_bench medians (L2 flushed), median of rounds. TFLOP/s count
2.5 x 4 * B * H * pairs * D (pairs under the diagonal when causal).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

from autotile.device import cuda_device  # noqa: E402
from autotile.families import flash_launch, flash_vendor  # noqa: E402
from autotile.families.base import VENDOR_KEY  # noqa: E402
from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem  # noqa: E402
from autotile.space import Config  # noqa: E402
from flash_bench import interleaved, kernel_call, sdpa_calls  # noqa: E402

# (label, heads_q, heads_kv, head_dim): the models' attention heads.
MODELS = (("Llama-3-8B", 32, 8, 128), ("Qwen2.5-7B", 28, 4, 128), ("Llama-2-7B", 32, 32, 128),
          ("Phi-3-mini", 32, 32, 96), ("Qwen2.5-1.5B", 12, 2, 128), ("Qwen2.5-0.5B", 14, 2, 64))
TOKENS = ((1, 4096), (2, 4096), (4, 2048), (8, 1024), (16, 512))


def shapes(quick: bool) -> list[tuple[str, FlashProblem]]:
    out = [("anchor MHA 2x32x4096 causal", FlashProblem("bwd", 2, 32, 32, 4096, 4096, 128, causal=True)),
           ("anchor MHA 2x32x4096", FlashProblem("bwd", 2, 32, 32, 4096, 4096, 128)),
           ("anchor D64 3x12x2000 causal", FlashProblem("bwd", 3, 12, 12, 2000, 2000, 64, causal=True)),
           ("anchor D64 4x32x2048 causal", FlashProblem("bwd", 4, 32, 32, 2048, 2048, 64, causal=True)),
           ("anchor D64 2x32x4096", FlashProblem("bwd", 2, 32, 32, 4096, 4096, 64)),
           # Short MHA calls, whose tiles go out head by head (flash_launch.gluon_backward_head_major).
           ("anchor MHA 16x32x512", FlashProblem("bwd", 16, 32, 32, 512, 512, 128)),
           ("anchor MHA 32x32x256 causal", FlashProblem("bwd", 32, 32, 32, 256, 256, 128, causal=True)),
           # Where head by head begins at any length (flash_launch.HEAD_MAJOR_TILES_PER_SM): 1024 tiles.
           ("anchor MHA 1x32x4096 causal", FlashProblem("bwd", 1, 32, 32, 4096, 4096, 128, causal=True)),
           ("anchor GQA 8x32/8x2048 causal", FlashProblem("bwd", 8, 32, 8, 2048, 2048, 128, causal=True)),
           # Not causal, where a stream-K tail takes the last wave's tiles (flash_launch.gluon_backward_tail) or,
           # 16 steps a tile, does not: last waves 52%, 76% and 88% full, and 52% of short tiles.
           ("anchor MHA 1x32x4096", FlashProblem("bwd", 1, 32, 32, 4096, 4096, 128)),
           ("anchor GQA 2x32/8x4096", FlashProblem("bwd", 2, 32, 8, 4096, 4096, 128)),
           ("anchor MHA 8x32x1024", FlashProblem("bwd", 8, 32, 32, 1024, 1024, 128))]
    # Packed sequences (lengths drawn between a quarter and all of the longest; TFLOP/s on their real tokens) beside
    # the dense shapes of the same longest length above.
    out += [("packed Llama-3-8B 8x<=2048", FlashProblem("bwd", 8, 32, 8, 2048, 2048, 128, causal=True, varlen=True)),
            ("packed Qwen2.5-7B 16x<=1024", FlashProblem("bwd", 16, 28, 4, 1024, 1024, 128, causal=True,
                                                          varlen=True))]
    for name, hq, hkv, d in MODELS[:2] if quick else MODELS:
        for batch, seq in TOKENS[::2] if quick else TOKENS:
            out.append((f"{name} {batch}x{seq}", FlashProblem("bwd", batch, hq, hkv, seq, seq, d, causal=True)))
    return out


def gluon_schedule(problem: FlashProblem, device) -> flash_launch.GluonBackwardSchedule:
    """How the Gluon backward's plan deals out its tiles."""
    return flash_launch.gluon_backward_problem_schedule(problem, device.sm_count)


def op_call(problem: FlashProblem, inputs: dict):
    """autotile.flash_attention's backward through autograd, on its own forward's graph (generated kernels only)."""
    import autotile

    leaves = [inputs[n].detach().clone().requires_grad_(True) for n in "qkv"]
    out = autotile.flash_attention(*leaves, causal=problem.causal)
    return lambda: torch.autograd.grad(out, leaves, inputs["do"], retain_graph=True)


def cudnn_direct_call(problem: FlashProblem, inputs: dict):
    """cuDNN's backward given the family's O and LSE (no second forward), as the vendor config is timed."""
    flash_vendor.CUDNN_BACKWARD_ON_GIVEN_LSE = True
    config = Config({VENDOR_KEY: flash_vendor.CUDNN})
    got = FAMILY.vendor_run(problem, config, inputs)
    refused = not flash_vendor._cudnn_direct_ok.get(inputs["q"].device, True)
    print(f"  {label_of(problem)} cuDNN direct: {gradient_error(problem, inputs, got)}"
          + (" (refused: ran its forward again)" if refused else ""), flush=True)
    return FAMILY.timed_call(problem, config, inputs, FAMILY.allocate_outputs(problem, inputs))


def label_of(problem: FlashProblem) -> str:
    return f"{problem.batch}x{problem.heads_q}/{problem.heads_kv}x{problem.seq_q} D{problem.head_dim}"


def gradient_error(problem: FlashProblem, inputs: dict, outputs: dict) -> str:
    """The worst relative error of outputs' dq, dk and dv against plain torch in fp32 ('WRONG' past 2%)."""
    q, k, v, do = (inputs[n].float() for n in ("q", "k", "v", "do"))
    want = FAMILY._grads(problem, inputs, q, k, v, do, dtype=torch.float32)
    worst = max(((outputs[name].float() - w).abs().max() / w.abs().max()).item()
                for name, w in zip(("dq", "dk", "dv"), want))
    return f"max rel err {worst:.4f}" + ("" if worst < 2e-2 else " WRONG")


def gross_check(problem: FlashProblem, config: Config, inputs: dict) -> str:
    outputs = FAMILY.allocate_outputs(problem, inputs)
    FAMILY.launch(problem, config, inputs, outputs)
    return gradient_error(problem, inputs, outputs)


def timed_cells(problem: FlashProblem, fns: dict, rounds: int, digits: int = 2) -> str:
    """Each call run once, then timed in interleaved rounds: 'name TFLOP/s (x cuDNN), ...; spread S' (the ratio where
    fns has 'SDPA cuDNN')."""
    for fn in fns.values():
        fn()
    times = interleaved(fns, rounds)
    spread = times.pop("spread")
    cost = FAMILY.cost(problem).flops
    cudnn = times.get("SDPA cuDNN")
    cells = [f"{name} {cost / ms / 1e9:.0f}" + (f" ({cudnn / ms:.{digits}f}x)" if cudnn else "")
             for name, ms in times.items()]
    return ", ".join(cells) + f"; spread {spread:.0%}"


def start_run(title: str, units: str = "") -> torch.device:
    """A backward benchmark's set-up: generated kernels only (AUTOTILE_VENDOR=0), an empty database unless AUTOTILE_DB
    names one (no tuned winner served), and its header line; the device to run on."""
    os.environ["AUTOTILE_VENDOR"] = "0"
    os.environ.setdefault("AUTOTILE_DB", "sqlite:///" + str(Path("/tmp/autotile_bwd_bench_empty.sqlite")))
    device = cuda_device()
    print(f"# {title}, {datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}" + (f"; {units}" if units else ""), flush=True)
    return device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", default="", help="comma-separated substrings of the shape labels to keep")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", default="", type=lambda text: [int(c) for c in text.split(",") if c],
                        help="also time the Gluon backward with these tiles a program (e.g. 1,2,8)")
    parser.add_argument("--other-order", action="store_true",
                        help="also time the Gluon backward with its tiles in the order its rule does not pick "
                             "(head by head or key block first: flash_launch.gluon_backward_head_major)")
    parser.add_argument("--tail", action="store_true",
                        help="also time the Gluon backward with a stream-K tail where even tiles would take one but "
                             "its rule declines (flash_launch.gluon_backward_tail, overhead taken as nothing)")
    parser.add_argument("--cudnn-direct", action="store_true",
                        help="also time cuDNN's backward on the family's O and LSE (flash_vendor.backward with "
                             "CUDNN_BACKWARD_ON_GIVEN_LSE on), as the op's untuned backward would call it")
    parser.add_argument("--all-stages", action="store_true",
                        help="time the Gluon backward on every slot count (default: two, the untuned one's)")
    args = parser.parse_args()
    device = start_run("flash backward", "TFLOP/s (x cuDNN)")
    wanted = [w for w in args.shapes.split(",") if w]
    for label, problem in shapes(args.quick):
        if wanted and not any(w in label for w in wanted):
            continue
        inputs = FAMILY.make_inputs(problem, device, seed=0)
        fns = {}
        for config in FAMILY.space(problem, device).feasible():
            if config["LOADS"] == GLUON_WS and (args.all_stages or config["num_stages"] == 2):
                fns[f"gluon s{config['num_stages']}"] = kernel_call(problem, config, inputs)
                chunk = gluon_schedule(problem, device).chunk
                for other in (c for c in args.chunks if c != chunk):
                    # exactly `other` consecutive tiles a program
                    kept = flash_launch.CHUNKS, flash_launch.CHUNK_PROGRAMS_PER_SM, flash_launch.HEAD_MAJOR_CHUNK
                    flash_launch.CHUNKS, flash_launch.CHUNK_PROGRAMS_PER_SM, flash_launch.HEAD_MAJOR_CHUNK = (
                        (other,), 0, other)
                    fns[f"gluon s{config['num_stages']} chunk{other}"] = kernel_call(problem, config, inputs)
                    flash_launch.CHUNKS, flash_launch.CHUNK_PROGRAMS_PER_SM, flash_launch.HEAD_MAJOR_CHUNK = kept
                if args.other_order and not problem.varlen:
                    rule = flash_launch.gluon_backward_head_major
                    flash_launch.gluon_backward_head_major = lambda *a, **k: not rule(*a, **k)
                    fns[f"gluon s{config['num_stages']} other order"] = kernel_call(problem, config, inputs)
                    flash_launch.gluon_backward_head_major = rule
                if gluon_schedule(problem, device).split > 1:
                    splits, flash_launch.SPLITS = flash_launch.SPLITS, (1,)
                    fns[f"gluon s{config['num_stages']} unsplit"] = kernel_call(problem, config, inputs)
                    flash_launch.SPLITS = splits
                kept = flash_launch.TAIL_OVERHEAD_STEPS, flash_launch.TAIL_MIN_GAIN
                if gluon_schedule(problem, device).tail:
                    flash_launch.TAIL_MIN_GAIN = float("inf")
                    fns[f"gluon s{config['num_stages']} no tail"] = kernel_call(problem, config, inputs)
                elif args.tail:
                    flash_launch.TAIL_OVERHEAD_STEPS, flash_launch.TAIL_MIN_GAIN = 0, 0.0
                    if gluon_schedule(problem, device).tail:
                        fns[f"gluon s{config['num_stages']} forced tail"] = kernel_call(problem, config, inputs)
                        print(f"  {label} gluon s{config['num_stages']} forced tail: "
                              f"{gross_check(problem, config, inputs)}", flush=True)
                flash_launch.TAIL_OVERHEAD_STEPS, flash_launch.TAIL_MIN_GAIN = kept
                if problem.batch * problem.seq_q <= 16384 and problem.heads_q <= 32:
                    print(f"  {label} gluon s{config['num_stages']}: {gross_check(problem, config, inputs)}",
                          flush=True)
        fns["triton default"] = kernel_call(problem, FAMILY.triton_backward_default(problem, device), inputs)
        default = FAMILY.default_config(problem, device)
        if not problem.varlen:
            fns["op"] = op_call(problem, inputs)
        else:
            # Issue 14's yardstick: the dense kernel on the same sequences padded to the longest, its TFLOP/s counted
            # on the real tokens as the packed kernel's are.
            dense = dataclasses.replace(problem, varlen=False)
            fns["dense padded"] = kernel_call(dense, FAMILY.default_config(dense, device),
                                              FAMILY.make_inputs(dense, device, seed=0))
        fns.update(sdpa_calls(problem, inputs))
        if args.cudnn_direct and not problem.varlen and flash_vendor.expresses(flash_vendor.CUDNN, problem):
            fns["cuDNN direct"] = cudnn_direct_call(problem, inputs)
        schedule = gluon_schedule(problem, device)
        dealt = (f"chunk {schedule.chunk}, split {schedule.split}, "
                 f"{'head by head' if schedule.head_major else 'key block first'}, tail {schedule.tail}")
        print(f"{label}: default {default['LOADS']} ({dealt}); " + timed_cells(problem, fns, args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
