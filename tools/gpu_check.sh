#!/usr/bin/env bash
# One batched GPU session: GPU tests, then benchmarks. Logs and JSON go to $OUT.
# Usage (on the device machine, repo root): bash tools/gpu_check.sh [tests|bench|all] [pytest -k expr]
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}; kexpr=${2:-}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python -m pytest -q -m gpu -s ${kexpr:+-k "$kexpr"} tests/test_cuda_graphs_gpu.py tests/test_model_gpu.py 2>&1 \
    | grep -v "Warning\|warn(" | tee "$OUT/gpu_tests.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 300 python -m sparseserve.benchmarks.decode_graphs --out "$OUT/decode_graphs.json" 2>&1 \
    | grep -v "Warning\|warn(\|INFO" | tee "$OUT/decode_graphs.log" | tail -20
fi
