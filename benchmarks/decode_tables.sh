#!/usr/bin/env bash
# Tune models' GEMM tables, ship them into this copy's tuning_db/, and time them through the public op: one device
# call. From the repository root on the GPU machine:
#   benchmarks/decode_tables.sh OUT TOKENS SERVE_TOKENS BUDGET_S MODEL [MODEL ...]
# e.g. benchmarks/decode_tables.sh $OUT 1,2,4,8,16 1,3,4,8,12,16 60 qwen3-4b qwen2.5-1.5b
# Each model gets `autotile tune gemm --model M --tokens TOKENS --budget BUDGET_S` into its own database, then
# serve_bench.py times every projection of the models at SERVE_TOKENS (tokens off the tuned M test the verified
# ranges). Everything is packed into OUT/tables.tgz after each step (the device call returns few files; a call
# cut short keeps what it finished). Back on the development machine:
#   python benchmarks/ship_winners.py R/*.sqlite && python benchmarks/drop_losers.py R/serve_tables.json
set -u
out=$1 tokens=$2 serve_tokens=$3 budget=$4
shift 4
. "$(dirname "$0")/gpu_env.sh"
export AUTOTILE_CACHE_DIR=${AUTOTILE_CACHE_DIR:-/tmp/atc}
# A new folder each call: a warm machine keeps /tmp, and an earlier call's databases must not be shipped again
# (they may hold winners that drop_losers.py has since dropped).
work=$(mktemp -d /tmp/decode-tables.XXXXXX)
pack() { rm -rf "$work"/*.studies "$work"/*.lock; tar czf "$out/tables.tgz" -C "$work" .; }
for model in "$@"; do
  timeout $((budget + budget / 2 + 20)) python -m autotile.cli.main tune gemm --model "$model" --tokens "$tokens" \
    --trials 10 --patience 4 --budget "${budget}s" --db "sqlite:///$work/$model.sqlite" > "$work/tune_$model.txt" 2>&1
  echo "$model rc=$? $(tail -1 "$work/tune_$model.txt")"
  pack
done
python benchmarks/ship_winners.py "$work"/*.sqlite | tail -1
models=$(IFS=,; echo "$*")
python benchmarks/serve_bench.py --out "$work" --only gemm --models "$models" --tokens "$serve_tokens" \
  --name serve_tables > "$work/serve_log.txt" 2>&1
echo "serve rc=$?"; grep -i "geometric\|FAILED\|WRONG" "$work/serve_log.txt"
pack
