"""The flash backward of windowed, ALiBi and soft-capped calls: the Gluon backward beside the Triton one (GPU).

    PYTHONPATH=. python benchmarks/prototypes/gluon_bwd_window_time.py --out OUT/gluon_bwd_window.md

Mistral-7B v0.1 (a 4096-token window) and Gemma-3-27B (1024) heads at 1 x 8192, causal, and ModernBERT-base and
-large's local layers (64 keys each side, not causal; their Gluon backward behind flash_space.
GLUON_BWD_NON_CAUSAL_WINDOW, turned on here) at 4 x 8192, MPT-7B's ALiBi (GLUON_BWD_ALIBI) at 1 x 4096 and
4 x 2048, and Gemma-2-27B's soft-capping (GLUON_BWD_SOFTCAP), global and local layers: each backward's untuned config
(the switches turned on here),
launched through the family on the same inputs, held to each other first, then timed in
interleaved rounds of `do_bench` medians (L2 flushed). TFLOP/s count the pairs the window leaves, 2.5x the forward's.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (model, batch, Hq, Hkv, seq, head dim, causal, window left, window right, ALiBi, softcap)
CASES = (("mistral-7b-v0.1", 1, 32, 8, 8192, 128, True, 4095, -1, False, 0.0),
         ("gemma3-27b", 1, 32, 16, 8192, 128, True, 1023, -1, False, 0.0),
         ("modernbert-base", 4, 12, 12, 8192, 64, False, 64, 64, False, 0.0),
         ("modernbert-large", 4, 16, 16, 8192, 64, False, 64, 64, False, 0.0),
         ("mpt-7b", 1, 32, 32, 4096, 128, True, -1, -1, True, 0.0),
         ("mpt-7b", 4, 32, 32, 2048, 128, True, -1, -1, True, 0.0),
         ("gemma2-27b", 1, 32, 16, 8192, 128, True, -1, -1, False, 50.0),
         ("gemma2-27b local", 1, 32, 16, 8192, 128, True, 4095, -1, False, 50.0))


def main() -> None:
    import triton
    import triton.testing

    from autotile.bench import interleaved_medians
    from autotile.device import cuda_device
    from autotile.families import flash_space
    from autotile.families.flash import FAMILY, FlashProblem
    from autotile.families.flash_reference import seen_pairs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = cuda_device()
    lines = [f"# Windowed and ALiBi backward, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__}, {datetime.date.today()}, bf16, medians of {args.rounds} interleaved rounds", "",
             "| model | B x S | window (left, right) / feature | Triton backward ms (TF/s) | Gluon backward ms (TF/s) | speed-up | configs |",
             "|---|---|---|---|---|---|---|"]
    for switch in ("GLUON_BWD_WINDOW", "GLUON_BWD_NON_CAUSAL_WINDOW", "GLUON_BWD_ALIBI", "GLUON_BWD_SOFTCAP"):
        setattr(flash_space, switch, True)
    for name, batch, hq, hkv, seq, dim, causal, left, right, alibi, softcap in CASES:
        problem = FlashProblem("bwd", batch, hq, hkv, seq, seq, dim, causal=causal, window_left=left,
                               window_right=right, alibi=alibi, softcap=softcap)
        inputs = FAMILY.make_inputs(problem, device, seed=3)
        gluon = FAMILY.default_config(problem, device)
        triton_config = flash_space.triton_backward_default(FAMILY, problem, device)
        calls, grads = {}, {}
        for label, config in (("triton", triton_config), ("gluon", gluon)):
            outputs = FAMILY.allocate_outputs(problem, inputs)
            FAMILY.launch(problem, config, inputs, outputs)
            grads[label] = outputs
            calls[label] = lambda config=config, outputs=outputs: FAMILY.launch(problem, config, inputs, outputs)
        # A float64 reference of 8k x 8k scores a head would take minutes: the two backwards (each checked against
        # float64 on smaller shapes by the GPU tests) are held to each other instead.
        for name_ in ("dq", "dk", "dv"):
            a, b = grads["triton"][name_].float(), grads["gluon"][name_].float()
            err = ((a - b).abs().max() / a.abs().max()).item()
            assert err < 2e-2, f"{name_} differs by {err:.4f}"
        ms = interleaved_medians(calls, args.rounds, lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40))
        pairs = seen_pairs(seq, seq, causal, left, right)
        flops = 2.5 * 4 * batch * hq * pairs * dim
        tf = {k: flops / (t * 1e-3) / 1e12 for k, t in ms.items()}
        lines.append(f"| {name} | {batch} x {seq} | {left}, {'causal' if causal else right}{' / ALiBi' if alibi else ''}{f' / cap {softcap:g}' if softcap else ''} | {ms['triton']:.3f} ({tf['triton']:.0f}) | "
                     f"{ms['gluon']:.3f} ({tf['gluon']:.0f}) | {ms['triton'] / ms['gluon']:.2f}x | "
                     f"`{triton_config.to_json()}` / `{gluon.to_json()}` |")
        print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
