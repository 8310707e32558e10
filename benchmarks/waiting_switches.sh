#!/usr/bin/env bash
# The switches that were built on the CPU and wait for a GPU, in four device calls of under ten minutes each, most
# promising first (a session's 30 minutes hold three):
#   tests    the float64 tests behind flash_space.FORWARD_HEAD_GROUPS and FORWARD_HEAD_GROUPS_PACKED (tiles in head
#            groups sized for L2, dense causal and packed) and HEAD_SPLIT_TAILS' 16-column tails (head dims 80, 48);
#   timings  the head groups beside the template's order and SDPA (benchmarks/prototypes/gluon_head_group_time.py),
#            and the long-K prefill tails split over K beside the default and cuBLAS (prefill_tail_split.py);
#   buffer   the float64 tests behind FORWARD_O_BUFFER (O through each warpgroup's own buffer), and its timing
#            against O through a slot (benchmarks/prototypes/gluon_o_buffer_time.py);
#   more     the tests behind HEAD_SPLIT_WITH_FEATURES (soft-capped and windowed calls on a head dim in two parts),
#            and gemm_policy's PREFILL_TAIL_SPLIT_GAIN against the policy without it on model rows out of sample.
# A switch goes on only where its tests pass and its timings lead. Usage, from the repository root on the GPU
# machine: benchmarks/waiting_switches.sh OUT_DIR {tests|timings|buffer|more}.
set -u
out=$1
part=$2
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
case $part in
  tests)
    timeout 300 python3 -m pytest -m gpu -q tests/test_flash_gluon_gpu.py -k head_groups 2>&1 | tail -6 \
      | tee "$out/head_group_tests.txt"
    timeout 250 python3 -m pytest -m gpu -q tests/test_flash_gluon_gpu.py -k "head_split and (80 or 48)" 2>&1 \
      | tail -6 | tee "$out/head_split_tail_tests.txt"
    ;;
  timings)
    timeout 300 python3 benchmarks/prototypes/gluon_head_group_time.py --rounds 4 --out "$out/head_groups.md" 2>&1 \
      | tail -70
    timeout 260 python3 benchmarks/prefill_tail_split.py "$out/tail_split.json" 200 2>&1 | tail -80
    ;;
  buffer)
    timeout 300 python3 -m pytest -m gpu -q tests/test_flash_gluon_gpu.py -k o_buffer 2>&1 | tail -6 \
      | tee "$out/o_buffer_tests.txt"
    timeout 240 python3 benchmarks/prototypes/gluon_o_buffer_time.py --rounds 4 --out "$out/o_buffer.md" 2>&1 \
      | tail -50
    ;;
  more)
    timeout 300 python3 -m pytest -m gpu -q tests/test_flash_gluon_gpu.py -k "head_split and (softcap or window)" \
      2>&1 | tail -6 | tee "$out/head_split_feature_tests.txt"
    timeout 200 python3 benchmarks/policy_rule_ab.py --set PREFILL_TAIL_SPLIT_GAIN=0.03 --seed 1 --per-weight 2 \
      --budget-s 160 --out "$out/tail_split_ab.json" 2>&1 | tail -30
    ;;
  *)
    echo "usage: $0 OUT_DIR {tests|timings|buffer|more}" >&2
    exit 2
    ;;
esac
