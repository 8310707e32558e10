#!/usr/bin/env bash
# The checks behind the GEMM family's switches (gemm_space.GLUON_TWO_PART_SPLIT: two-part Gluon tiles split over K;
# CLAMP_ROW_TILES / CLAMP_COL_TILES: whole tiles' last row and column tiles clamped to the operands' edges; all on
# since they passed on an H100, results/gemm_two_part_split_tests_2026-12-07_h100.txt and
# clamp_tests*_2026-12-07_h100.txt): their tests against float64 and bit for bit, then the two-part tiles timed beside
# the policy's default and F.linear on narrow, long-K weights at 144-240 tokens, in one device call (~9 min). Usage,
# from the repository root on the GPU machine: benchmarks/gemm_gated_checks.sh OUT_DIR. Run it again on a new GPU kind
# or Triton version before trusting the switches there. COALESCED_PARTIALS (on) has its test here too
# (test_partials_in_register_order_give_the_row_major_layouts_bits); its timing is gluon_stream_k_diag.py's.
set -u
out=$1
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
timeout 200 python3 -m pytest -m gpu -q tests/test_gemm_gpu.py -k "swapped or two_part or clamped or register_order" \
  2>&1 | tail -8 | tee "$out/gemm_switch_tests.txt"
# Every candidate on Phi-2's projections (N = 2560), then the default and the swapped Gluon tiles on long-K down
# projections (Llama-3-8B, Qwen2.5-7B, Phi-3-mini, Gemma-2-2B, Qwen2.5-3B).
timeout 170 python3 benchmarks/decode_stream_candidates.py --gluon-swap --token-tiles \
  --tokens 144,176,240 --shapes 2560x10240,2560x2560 --budget-s 130 --out "$out/two_part_split_narrow.json" 2>&1 \
  | tail -12
timeout 170 python3 benchmarks/decode_stream_candidates.py --gluon-swap --only "default,gluon swap" \
  --tokens 144,176,208 --shapes 3584x18944,4096x14336,3072x8192,2304x9216,2048x11008 --budget-s 130 \
  --out "$out/two_part_split_longk.json" 2>&1 | tail -20
