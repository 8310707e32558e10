"""Causal tiles of the Gluon forward in groups of heads sized for L2, against the template's own order (GPU).

    PYTHONPATH=. python benchmarks/prototypes/gluon_head_group_time.py --out OUT/head_groups.md

`flash_space.FORWARD_HEAD_GROUPS` off: the template's order (every head's heaviest query tile first; head dim 256 up
to 16 query tiles a head one head after another). On: groups of `flash_launch.forward_head_group` heads (the rule),
and of half, twice and one head, each group's tiles heaviest first (templates/flash_gluon_ws.py.j2, HEAD_GROUPS). For
each causal prefill shape, the family's default config, launched through the family as CUDA-graph replays of kept
plans (as the op's), beside SDPA's backends, in interleaved rounds of `do_bench` medians; every output is checked
against a float32 reference first. MHA shapes (Phi-3-mini, Llama-2-7B) are where the rule groups; GQA ones
(Llama-3-8B, Qwen2.5-7B) and Gemma-2's head dim 256 are controls where it keeps the template's order. Then packed
sequences (`FORWARD_HEAD_GROUPS_PACKED`), the template's order against the same group sizes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (model, Hq, Hkv, D, shapes (batch, tokens)): causal prefill.
CASES = (("phi-3-mini", 32, 32, 96, ((16, 512), (8, 1024), (4, 2048), (2, 4096))),
         ("llama-2-7b", 32, 32, 128, ((16, 512), (4, 2048))),
         ("llama-3-8b", 32, 8, 128, ((16, 512), (4, 2048))),
         ("qwen2.5-7b", 28, 4, 128, ((16, 512),)),
         ("gemma-2-9b", 16, 8, 256, ((16, 512), (4, 2048))))


def grouped_launches(q, k, v, want: torch.Tensor, errs: dict) -> dict:
    """The default config with the template's order and in head groups (the rule's size, half, twice, one): graph
    replays of kept plans, each output's error against `want` in `errs`."""
    from gluon_features_time import kept_replay

    from autotile.device import current_device
    from autotile.families import flash_launch, flash_space
    from autotile.families.flash import FAMILY, GLUON_WS

    rule = flash_launch.forward_head_group
    problem = FAMILY.problem_from_tensors(q, k, v, causal=True)
    config = FAMILY.default_config(problem, current_device(q.device))
    assert config["LOADS"] == GLUON_WS, config.to_json()
    heads = problem.batch * problem.heads_q
    size = rule(problem, config)
    tag = f"{config['BLOCK_N']} keys x {config['num_stages']}{' queue' if config['TILE_QUEUE'] else ''}"
    launches = {}
    try:
        flash_space.FORWARD_HEAD_GROUPS = False
        launches[f"template order, {tag}"], outputs = kept_replay(problem, config, q, k, v)
        errs[f"template order, {tag}"] = ((outputs["o"].float() - want).abs().max() / want.abs().max()).item()
        flash_space.FORWARD_HEAD_GROUPS = True
        for group in sorted({size, max(1, size // 2), min(heads, 2 * size), 1}, reverse=True):
            flash_launch.forward_head_group = lambda p, c, keys=0, group=group: group
            name = f"groups of {group}{' (rule)' if group == size else ''}, {tag}"
            launches[name], outputs = kept_replay(problem, config, q, k, v)
            errs[name] = ((outputs["o"].float() - want).abs().max() / want.abs().max()).item()
    finally:
        flash_launch.forward_head_group = rule
        flash_space.FORWARD_HEAD_GROUPS = False
    return launches


# Packed sequences (flash_attention_varlen's order is query tile first, causal or not): (model, Hq, Hkv, D, sequences,
# longest), lengths drawn from a quarter of the longest up to it.
PACKED = (("phi-3-mini", 32, 32, 96, 8, 2048), ("llama-2-7b", 32, 32, 128, 16, 1024),
          ("llama-3-8b", 32, 8, 128, 8, 2048))


def packed_lines(rounds: int) -> list[str]:
    """The packed cases' default config with the template's order and in head groups (the rule's size, half, twice,
    one), each checked against the family's reference first; graph replays of kept plans, interleaved rounds."""
    import triton.testing
    from gluon_features_time import kept_replay

    from autotile.bench import interleaved_medians
    from autotile.device import current_device
    from autotile.families import flash_launch, flash_space
    from autotile.families.flash import FAMILY, FlashProblem

    lines = ["", "Packed sequences (causal), ms; x the template's order", "",
             "| model | sequences | kernel | ms | x template order |", "|---|---|---|---|---|"]
    rule = flash_launch.forward_head_group
    for name, hq, hkv, dim, sequences, longest in PACKED:
        problem = FlashProblem("fwd", sequences, hq, hkv, longest, longest, dim, causal=True, varlen=True)
        device = current_device(torch.device("cuda"))
        inputs = FAMILY.make_inputs(problem, device, seed=3)
        config = FAMILY.default_config(problem, device)
        size = rule(problem, config, inputs["k"].shape[0])
        launches = {}
        try:
            for group in [None] + sorted({size, max(1, size // 2), min(hq, 2 * size), 1}, reverse=True):
                flash_space.FORWARD_HEAD_GROUPS_PACKED = group is not None
                flash_launch.forward_head_group = lambda p, c, keys=0, group=group: group
                label = "template order" if group is None else f"groups of {group}{' (rule)' if group == size else ''}"
                launches[label], outputs = kept_replay(problem, config, **inputs)
                result = FAMILY.check(problem, inputs, outputs, FAMILY.reference(problem, inputs))
                if not result.ok:
                    raise SystemExit(f"{name} packed, {label}: {result.message}")
        finally:
            flash_launch.forward_head_group = rule
            flash_space.FORWARD_HEAD_GROUPS_PACKED = False
        ms = interleaved_medians(launches, rounds, lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40))
        for label, t in sorted(ms.items(), key=lambda kv: kv[1]):
            lines.append(f"| {name} | {sequences} up to {longest} | {label} | {t:.4f} | "
                         f"{ms['template order'] / t:.3f}x |")
        print("\n".join(lines[-len(ms):]), flush=True)
    return lines


def main() -> None:
    from gluon_head_split_time import run_causal_prototype

    args = run_causal_prototype(__doc__.splitlines()[0], CASES, grouped_launches,
                                "Gluon forward, causal tiles in head groups against the template's order")
    packed = packed_lines(args.rounds)
    with args.out.open("a") as out:
        out.write("\n".join(packed) + "\n")


if __name__ == "__main__":
    main()
