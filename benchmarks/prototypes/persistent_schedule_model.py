"""How evenly gluon_ws's persistent programs share a forward's tiles: a model, no GPU.

templates/flash_gluon_ws.py.j2 runs min(tiles, SMs) programs; in round r program p takes tile r * P + slot. Causal
tiles come heaviest first (the query tile index is the slowest). This model weighs each tile by the key blocks it
reads and reports the busiest program's work over the mean (1.00 = every program ends together) for:
  - forwards: every round deals the tiles out in program order (slot = p);
  - alternate: odd rounds deal them out backwards (slot = P - 1 - p), the template's order;
and for packed sequences, numbering all of the longest sequence's tiles for every sequence (tiles past a shorter
sequence's end cost nothing but take their turn) against numbering only the tiles that hold rows.
Fixed costs per tile (Q load, epilogue) are left out, so it overstates the spread of light tiles.
    python benchmarks/prototypes/persistent_schedule_model.py
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from autotile.families.flash import FlashProblem, packed_lengths  # noqa: E402

SMS = 132  # H200
BLOCK_M = BLOCK_N = 128  # gluon_ws's query tile and its default key block at head dim 128


def key_blocks(length: int, pid_m: int, causal: bool) -> int:
    """Key blocks query tile pid_m of a sequence of `length` reads (0: the tile holds no row)."""
    if pid_m * BLOCK_M >= length:
        return 0
    last = min(length, (pid_m + 1) * BLOCK_M) if causal else length
    return math.ceil(last / BLOCK_N)


def makespan(weights: list[int], alternate: bool) -> float:
    programs = min(len(weights), SMS)
    load = [0] * programs
    for c, weight in enumerate(weights):
        r, slot = divmod(c, programs)
        load[programs - 1 - slot if alternate and r % 2 else slot] += weight
    return max(load) / (sum(load) / programs)


def tiles(lengths: list[int], heads: int, causal: bool, rows_only: bool) -> list[int]:
    """Tile weights in the template's order: query tile index slowest (heaviest first when causal), then sequences,
    then heads; `rows_only` drops tiles past a sequence's end."""
    n_m = math.ceil(max(lengths) / BLOCK_M)
    order = range(n_m - 1, -1, -1) if causal else range(n_m)
    found = [key_blocks(length, m, causal) for m in order for length in lengths for _ in range(heads)]
    return [w for w in found if w] if rows_only else found


def main() -> None:
    print("dense, causal: batch x heads x tokens: forwards / alternate")
    for batch, heads, seq in ((1, 32, 4096), (1, 28, 4096), (1, 32, 1025), (4, 32, 2048), (16, 32, 512),
                              (1, 32, 16384), (3, 12, 2000), (4, 16, 2048)):
        weights = tiles([seq] * batch, heads, True, False)
        print(f"  {batch} x {heads} x {seq}: {makespan(weights, False):.3f} / {makespan(weights, True):.3f}")
    problem = FlashProblem("fwd", 8, 32, 8, 2048, 2048, 128, causal=True, varlen=True)  # flash_bench's varlen case
    lengths, _ = packed_lengths(problem)
    print(f"packed, causal, 32 heads, lengths {lengths}:")
    print(f"  all tiles, forwards: {makespan(tiles(lengths, 32, True, False), False):.3f}")
    print(f"  tiles that hold rows, alternate: {makespan(tiles(lengths, 32, True, True), True):.3f}")


if __name__ == "__main__":
    main()
