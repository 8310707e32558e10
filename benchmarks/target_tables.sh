#!/usr/bin/env bash
# Two target tables in one device call (~9 min on an H100): flash_bench.py's every shape (issue 14's forward and
# backward rows and the models' prefill heads; the default and up to four seeds a shape, beside SDPA's backends),
# then the GEMM default on prefill rows (issue 13: M >= 2048, 3000 x 5000 x 1536) beside F.linear as CUDA-graph
# streams. Usage, from the repository root on the GPU machine: benchmarks/target_tables.sh OUT_DIR.
set -u
out=$1
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
labels=$(python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import flash_bench
print(','.join(label for label, _ in flash_bench.shape_list(False)))")
timeout 390 python3 benchmarks/flash_bench.py --out "$out/flash_targets.md" --only shapes --quick --shapes "$labels" \
  2>&1 | grep -v Warning | tail -30
timeout 150 python3 benchmarks/decode_stream_candidates.py --default-only --tokens 2048,3000,8192 \
  --shapes 5000x1536,6144x4096,4096x14336,28672x4096,3584x18944,4608x3584 --out "$out/prefill_default.json" 2>&1 \
  | tail -20
