#!/usr/bin/env bash
# The flash family's switches that wait for a GPU (flash_space.GLUON_TWO_SIDED_WINDOW, GLUON_ALIBI,
# GLUON_BWD_NON_CAUSAL_WINDOW, GLUON_BWD_ALIBI, GLUON_BWD_SOFTCAP): their tests against float64, then each feature's Gluon kernel beside
# the Triton one it would replace, in one device call (~6 min on an H100). Usage, from the repository root on the GPU
# machine: benchmarks/gpu_gated_checks.sh OUT_DIR. A switch goes on only where its tests pass and its timings lead.
set -u
out=$1
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
timeout 200 python3 -m pytest -m gpu -q tests/test_flash_gluon_gpu.py -k "two_sided or alibi" 2>&1 | tail -4 \
  | tee "$out/gluon_forward_gated_tests.txt"
timeout 260 python3 -m pytest -m gpu -q tests/test_flash_gluon_bwd_gpu.py -k "non_causal or alibi or soft_caps" 2>&1 | tail -4 \
  | tee "$out/gluon_backward_gated_tests.txt"
for feature in two_sided alibi; do
  timeout 100 python3 benchmarks/prototypes/gluon_features_time.py --feature $feature --flex --rounds 3 \
    --out "$out/gluon_$feature.md" 2>&1 | tail -8
done
timeout 120 python3 benchmarks/prototypes/gluon_bwd_window_time.py --out "$out/gluon_bwd_features.md" 2>&1 | tail -8
