"""Causal tiles of the Gluon forward in groups of heads sized for L2, against the template's own order (GPU).

    PYTHONPATH=. python benchmarks/prototypes/gluon_head_group_time.py --out OUT/head_groups.md

`flash_space.FORWARD_HEAD_GROUPS` off: the template's order (every head's heaviest query tile first; head dim 256 up
to 16 query tiles a head one head after another). On: groups of `flash_launch.forward_head_group` heads (the rule),
and of half, twice and one head, each group's tiles heaviest first (templates/flash_gluon_ws.py.j2, HEAD_GROUPS). For
each causal prefill shape, the family's default config, launched through the family as CUDA-graph replays of kept
plans (as the op's), beside SDPA's backends, in interleaved rounds of `do_bench` medians; every output is checked
against a float32 reference first. MHA shapes (Phi-3-mini, Llama-2-7B) are where the rule groups; GQA ones
(Llama-3-8B, Qwen2.5-7B) and Gemma-2's head dim 256 are controls where it keeps the template's order.
"""
from __future__ import annotations

import argparse
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
            flash_launch.forward_head_group = lambda p, c, group=group: group
            name = f"groups of {group}{' (rule)' if group == size else ''}, {tag}"
            launches[name], outputs = kept_replay(problem, config, q, k, v)
            errs[name] = ((outputs["o"].float() - want).abs().max() / want.abs().max()).item()
    finally:
        flash_launch.forward_head_group = rule
        flash_space.FORWARD_HEAD_GROUPS = False
    return launches


def main() -> None:
    from gluon_head_split_time import time_causal_cases, write_causal_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = time_causal_cases(CASES, grouped_launches, args.rounds)
    write_causal_table(args.out, "Gluon forward, causal tiles in head groups against the template's order", rows,
                       args.rounds)


if __name__ == "__main__":
    main()
