#!/usr/bin/env bash
# The flash family's attention features on the Gluon kernels, checked and timed in one device call (~5 min on an
# H100). Usage, from the repository root on the GPU machine: benchmarks/gpu_feature_checks.sh OUT_DIR
# GPU tests against float64 first (soft-capping and windows in the Gluon forward, windows in the Gluon backward: those
# of calls that are not causal wait for theirs, flash_space.GLUON_BWD_NON_CAUSAL_WINDOW), then
# each feature off and on through the op beside FlexAttention, and the windowed backward beside the Triton one.
set -u
out=$1
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
timeout 300 python3 -m pytest -m gpu -q tests/test_flash_gluon_gpu.py -k "soft_caps or windows" 2>&1 | tail -3 \
  | tee "$out/gluon_forward_feature_tests.txt"
timeout 240 python3 -m pytest -m gpu -q tests/test_flash_gluon_bwd_gpu.py -k windows 2>&1 | tail -3 \
  | tee "$out/gluon_backward_window_tests.txt"
for feature in softcap window; do
  timeout 150 python3 benchmarks/prototypes/gluon_features_time.py --feature $feature --flex --rounds 3 \
    --out "$out/gluon_$feature.md" 2>&1 | tail -12
done
timeout 90 python3 benchmarks/prototypes/gluon_bwd_window_time.py --out "$out/gluon_bwd_window.md" 2>&1 | tail -6
