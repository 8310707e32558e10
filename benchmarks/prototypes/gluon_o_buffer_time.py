"""The Gluon forward's O through a buffer of each warpgroup's own, against through the last key block's slot (GPU).

    PYTHONPATH=. python benchmarks/prototypes/gluon_o_buffer_time.py --out OUT/o_buffer.md

`flash_space.FORWARD_O_BUFFER` off: O leaves through the tile's last K/V slot, after both warpgroups' last P V (64-key
blocks) or Q K^T (128-key blocks), and the slot goes back once the TMA store has read it. On: through a buffer of its
own, the store waited for a tile later (templates/flash_gluon_ws.py.j2, O_BUFFER). For each causal prefill shape,
the family's default config both ways (where the buffer fits: 64-key blocks up to head dim 128, 128-key blocks at 64),
launched through the family as CUDA-graph replays of kept plans (as the op's), beside SDPA's backends, in interleaved
rounds of `do_bench` medians; every output is checked against a float32 reference first.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (model, Hq, Hkv, D, shapes (batch, tokens)): causal prefill where the default takes 64-key blocks (up to 1024 keys
# at head dims 96-128) or head dim 64's 128-key blocks.
CASES = (("llama-3-8b", 32, 8, 128, ((16, 512), (8, 1024), (32, 256))),
         ("qwen2.5-7b", 28, 4, 128, ((16, 512), (8, 1024))),
         ("phi-3-mini", 32, 32, 96, ((16, 512), (8, 1024))),
         ("head dim 64", 12, 12, 64, ((3, 2000), (4, 4096))))


def buffer_launches(q, k, v, want: torch.Tensor, errs: dict) -> dict:
    """The default config with O through the slot and through buffers: graph replays of kept plans, each output's
    error against `want` in `errs`."""
    from gluon_features_time import kept_replay

    from autotile.device import current_device
    from autotile.families import flash_space
    from autotile.families.flash import FAMILY, GLUON_WS

    problem = FAMILY.problem_from_tensors(q, k, v, causal=True)
    config = FAMILY.default_config(problem, current_device(q.device))
    assert config["LOADS"] == GLUON_WS, config.to_json()
    tag = f"{config['BLOCK_N']} keys x {config['num_stages']}{' queue' if config['TILE_QUEUE'] else ''}"
    launches = {}
    try:
        for on in (False, True):
            flash_space.FORWARD_O_BUFFER = on
            if on and not FAMILY.render_switches(problem, config)["O_BUFFER"]:
                continue  # (no room beside this config's slots)
            name = f"{'O buffers' if on else 'O through a slot'}, {tag}"
            launches[name], outputs = kept_replay(problem, config, q, k, v)
            errs[name] = ((outputs["o"].float() - want).abs().max() / want.abs().max()).item()
    finally:
        flash_space.FORWARD_O_BUFFER = False
    return launches


def main() -> None:
    from gluon_head_split_time import run_causal_prototype

    run_causal_prototype(__doc__.splitlines()[0], CASES, buffer_launches,
                         "Gluon forward, O through buffers of its own against through a K/V slot")


if __name__ == "__main__":
    main()
