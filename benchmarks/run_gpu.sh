#!/usr/bin/env bash
# GPU benchmarks for one device call. Usage, from the repository root on the GPU machine:
#   benchmarks/run_gpu.sh OUT_DIR NAME:BUDGET_S:LIMIT_S[:EXTRA+ARGS] [...]
# e.g. benchmarks/run_gpu.sh $OUT gemm:150:250 elementwise:90:120 flash:200:220:--skip-checks
# runs benchmarks/<NAME>_bench.py --budget-s BUDGET_S [EXTRA ARGS, '+' between them], killed after LIMIT_S. Each family's database,
# table and log are packed into OUT_DIR/<NAME>.tgz as soon as it ends (so a later one that runs out
# of time loses nothing), and its table is copied to OUT_DIR.
# Python packages the machine lacks travel as wheels in .whl/ (shared/device/wheels.sh).
set -u
out=$1
shift
. "$(dirname "$0")/gpu_env.sh"
work=/tmp/autotile-results
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv

for spec in "$@"; do
  IFS=: read -r name budget limit extra <<<"$spec"
  mkdir -p "$work/$name"
  # shellcheck disable=SC2086 # the extra arguments are meant to split
  timeout "$limit" python3 "benchmarks/${name}_bench.py" --out "$work/$name" --budget-s "$budget" ${extra//+/ } 2>&1 \
    | tee "$work/$name/${name}_log.txt" | grep -v "check ok\|^  ok " | tail -40
  cp "$work/$name/${name}_bench.md" "$out/" 2>/dev/null || echo "$name: no table written"
  tar czf "$out/$name.tgz" -C "$work" "$name"
done
