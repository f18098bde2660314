#!/usr/bin/env bash
# Short follow-up GPU call: kernel GPU tests that were skipped, and the transformers baseline
# of the seed workload added to the existing results file.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp benchmarks/results/seed_workload.json "$OUT/seed_workload.json"
{
  timeout -k 5 75 python -m pytest -q -m gpu tests/test_compressor_kernel.py tests/test_rows_kernel.py tests/test_topk_gpu.py
  timeout -k 5 100 python benchmarks/run_all.py --only hf --engine-flag=--max-model-len=2048 --budget-s 95 --out-dir "$OUT"
} 2>&1 | grep -av "Warning\|warn(\|^INFO\|^  [a-z]" > "$OUT/last.log"
tail -30 "$OUT/last.log"
