"""The SASS of an ncu source-page CSV (--page source --print-source sass --csv) in address order, each line with its
share of warp stall samples and its two main stall reasons; lines under 0.05% are left out (a gap marker shows where).
    python benchmarks/prototypes/ncu_listing.py src.csv > listing.txt
"""
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
start = next(i for i, r in enumerate(rows) if any("Warp Stall Sampling (All Samples)" in c for c in r))
head = rows[start]
body = [r for r in rows[start + 1:] if len(r) == len(head)]
col = next(i for i, c in enumerate(head) if "Warp Stall Sampling (All Samples)" in c)
src = next((i for i, c in enumerate(head) if c.strip() in ("Source", "# Source")), 1)
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0
total = sum(num(r[col]) for r in body) or 1
stalls = [i for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
print("total samples", total)
gap = False
for r in body:
    share = num(r[col]) / total
    if share < 0.0005:
        if not gap:
            print("   ...")
        gap = True
        continue
    gap = False
    top = sorted(((num(r[i]), head[i][6:]) for i in stalls if num(r[i])), reverse=True)[:2]
    print(f"{share:6.2%} {r[0][-5:]} {r[src][:64]:64s} {' '.join(f'{n}={int(v)}' for v, n in top)}")
