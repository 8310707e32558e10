#!/usr/bin/env bash
# Why the gluon_ws GEMM's stream-K and split-K tiles run slower than their share of the data-parallel work, in one
# device call (~4 min on an H100): Nsight Compute's DRAM, L2 and tensor-pipe counters of stream-K, split-K and
# data-parallel launches beside cuBLAS's, then the template variants of prototypes/gluon_stream_k_diag.py timed.
# Usage, from the repository root on the GPU machine: benchmarks/stream_k_checks.sh OUT_DIR.
set -u
out=$1
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct
metrics=$metrics,lts__t_sectors_op_write.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
timeout 100 ncu --clock-control none --nvtx -k "regex:gemm|nvjet|sm90|xmma|cutlass|splitK|reduce" --metrics $metrics \
  python3 benchmarks/ncu_gemm_calls.py --cases benchmarks/prototypes/stream_k_ncu_cases.json \
  > "$out/ncu_stream_k.txt" 2>&1
grep -E "^  [A-Za-z]|gpu__time|dram__|lts__|gmma" "$out/ncu_stream_k.txt" | head -80
PYTHONPATH=. timeout 200 python3 benchmarks/prototypes/gluon_stream_k_diag.py "$out" 2>&1 | grep -v Warning | tail -12
