#!/usr/bin/env bash
# The end-of-session GPU call: every GPU test not yet run on the final code, the decode
# graph benchmark, and the seed workload. Logs and JSON go to $OUT (at most 8 files).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filter() { grep -av "Warning\|warn(\|debug_dump\|^\s*$\|^INFO\|^  [a-z]" ; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader > "$OUT/gpu.txt"
{
  echo "== kernels (compressor, rows, topk, mhc, rmsnorm, rope)"
  timeout -k 5 110 python -m pytest -q -m gpu tests/test_compressor_kernel.py tests/test_rows_kernel.py tests/test_topk_gpu.py
  timeout -k 5 40 python -m pytest -q tests/test_mhc_kernel.py tests/test_norm_rope_kernels.py
  echo "== graphs and model parity"
  timeout -k 5 150 python -m pytest -q -m gpu -s tests/test_cuda_graphs_gpu.py tests/test_model_gpu.py
} 2>&1 | filter > "$OUT/tests.log"
tail -25 "$OUT/tests.log"
{
  echo "== decode graphs"
  timeout -k 5 75 python -m sparseserve.benchmarks.decode_graphs --steps 16 --out "$OUT/decode_graphs.json"
  echo "== seed workload"
  timeout -k 5 140 python benchmarks/run_all.py --only graphs,eager,hf --engine-flag=--max-model-len=2048 \
    --budget-s 130 --out-dir "$OUT"
} 2>&1 | filter > "$OUT/bench.log"
tail -40 "$OUT/bench.log"
