"""Drop shipped GEMM winners that lost to the vendor op through the public op (serve_bench.py's rows).

    python benchmarks/drop_losers.py OUT/serve_bench.json [--below 0.97] [--dry-run]
    python benchmarks/drop_losers.py OUT/decode_stream.json    # decode_stream_bench.py's rows (CUDA-graph streams)

A winner is verified in the tuner, against cuBLAS, over its M bucket. The public op adds its own host path and
other token counts of the bucket, so serve_bench.py times it again, as a user calls it. A row served by a shipped
winner whose ratio stays below `--below` in both of its timings (the row's, and the second one serve_bench.py
takes of every slow row) loses that winner: the call falls back to the vendor op, as an untuned shape does.
The text dump is rewritten.
"""
from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotile.resources import shipped_db_path, shipped_dump_path  # noqa: E402
from autotile.store.ship import write_dump  # noqa: E402


def losers(rows: list[dict], below: float) -> dict[tuple[str, str], list[dict]]:
    """(device key, problem key of the serving winner) -> the rows it lost, for rows a shipped winner served."""
    lost: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if "error" in row or not str(row.get("served", "")).startswith("shipped-db/") or not row.get("tuned_for"):
            continue
        ratios = [row["ratio"]]
        retimed = row.get("diagnosis", {}).get("retimed")
        if retimed:
            ratios.append(retimed[1] / retimed[0])
        if max(ratios) < below:
            lost.setdefault((row["device"], row["tuned_for"]), []).append(row)
    return lost


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("serve_json", nargs="+", type=Path)
    parser.add_argument("--below", type=float, default=0.97)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    rows = []
    for path in args.serve_json:
        try:
            rows += json.loads(path.read_text())["gemm"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}: not the JSON serve_bench.py writes beside its table ({type(exc).__name__}: "
                             f"{exc}); pass OUT/NAME.json of a serve_bench.py run") from None
    lost = losers(rows, args.below)
    target = shipped_db_path()
    with sqlite3.connect(target) as conn:
        for (device, key), bad in sorted(lost.items()):
            shown = ", ".join(f"{r['model']} {r['proj']} M={r['m']} {r['ratio']:.3f}x" for r in bad)
            if args.dry_run:
                print(f"would drop {key} on {device}: {shown}")
                continue
            gone = conn.execute(
                "DELETE FROM autotile_winners WHERE device_key = ? AND problem_id IN "
                "(SELECT id FROM autotile_problems WHERE family = 'gemm' AND key = ?)", (device, key)).rowcount
            print(f"dropped {gone} winner(s) of {key} on {device}: {shown}")
    if lost and not args.dry_run:
        write_dump(target, shipped_dump_path())
    print(f"{len(lost)} winner(s) lost below {args.below}x in {len(rows)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
