#!/usr/bin/env bash
# The gemm policy's checks on a GPU in one device call (~3 min on an H100), as a prefill chunk or decode step runs the
# calls (CUDA-graph streams beside F.linear): the unseen grid's 24 projections, the default alone, at the grid's token
# counts, at other mid-sized counts and at prefill chunks; then the latest rules against the policy without them, on
# rows drawn out of sample (policy_rule_ab.py --seed 1; the rules were fitted on seed 0's draws and hand-picked rows).
# The rules were fitted on H100s: run this on each new GPU kind before trusting them there. Usage, from the repository
# root on the GPU machine: benchmarks/policy_checks.sh OUT_DIR [RULE ...] (default: the two latest rules; each rule
# adds about two minutes, and a device call has ten).
set -u
out=$1
shift
rules=${*:-_long_k_gluon_split _prefill_narrow_tma}
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
grid=benchmarks/decode_stream_candidates.py
timeout 120 python3 $grid --grid --budget-s 90 --out "$out/grid.json" 2>&1 | tail -1
for kind in mid prefill; do
  timeout 120 python3 $grid --grid-tokens $kind --budget-s 90 --out "$out/grid_$kind.json" 2>&1 | tail -1
done
for rule in $rules; do
  timeout 150 python3 benchmarks/policy_rule_ab.py --rule $rule --seed 1 --per-weight 2 --budget-s 110 \
    --out "$out/ab$rule.json" 2>&1 | tail -1
done
