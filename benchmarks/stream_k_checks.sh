#!/usr/bin/env bash
# The gluon_ws GEMM's split-K fix-up on a GPU in one device call (~8 min on an H100): split tiles finished by fixed
# owners (gemm_space.OWNED_SPLITS, off: it says why) tested against float64 and against the last arrival's bits,
# then the template variants of prototypes/gluon_stream_k_diag.py timed beside data-parallel tiles and cuBLAS: the
# fix-up without its partial loads (splitnoload), without any fix-up (nofix), and with owners (splitowned), split 2
# and 4 ways in 128 x 128 tiles and, on shapes of few tokens, swapped 64-token tiles whole and split 2 ways. The
# earlier counters of Nsight Compute (DRAM, L2, tensor pipe) are `ncu ... benchmarks/ncu_gemm_calls.py --cases
# benchmarks/prototypes/stream_k_ncu_cases.json`. Usage, from the repository root on the GPU machine:
# benchmarks/stream_k_checks.sh OUT_DIR.
set -u
out=$1
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
timeout 150 python3 -m pytest -m gpu -q -x tests/test_gemm_gpu.py -k owned_splits 2>&1 | tail -8 \
  | tee "$out/owned_split_tests.txt"
timeout 390 python3 benchmarks/prototypes/gluon_stream_k_diag.py "$out" nofix,splitnoload,splitowned \
  split2,split4,swdp,swsplit2 2>&1 | grep -v Warning | tail -12
