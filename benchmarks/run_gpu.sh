#!/usr/bin/env bash
# One device call's worth of GPU benchmarks. Usage, from the repository root on the GPU machine:
#   benchmarks/run_gpu.sh a OUT_DIR    # GEMM + fused elementwise
#   benchmarks/run_gpu.sh b OUT_DIR    # FlashAttention + PagedAttention
# Python packages the machine lacks travel as wheels in .whl/ (shared/device/wheels.sh).
# Each family writes its database, table and log under OUT_DIR/<family>/; the tables are also
# copied to OUT_DIR and everything is packed into OUT_DIR/results_<part>.tgz.
set -u
part=$1
out=$2
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
work=/tmp/autotile-results
mkdir -p "$work"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv

bench() {  # bench NAME SECONDS ARGS...
  local name=$1 limit=$2
  shift 2
  mkdir -p "$work/$name"
  timeout "$limit" python3 "benchmarks/${name}_bench.py" --out "$work/$name" "$@" 2>&1 \
    | tee "$work/$name/${name}_log.txt" | grep -v "check ok\|: ok" | tail -45
  cp "$work/$name/${name}_bench.md" "$out/" 2>/dev/null || echo "$name: no table written"
}

case $part in
  a)
    bench gemm 330 --budget-s 200 --trials 30
    bench elementwise 200 --budget-s 100
    ;;
  b)
    bench flash 330 --budget-s 230
    bench paged 230 --budget-s 140
    ;;
  *) echo "part must be a or b"; exit 2 ;;
esac
tar czf "$out/results_$part.tgz" -C "$work" .
