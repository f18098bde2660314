#!/usr/bin/env bash
# One short GPU call that re-checks the engine after a round of changes (run from the repo root on the
# device machine; every part has its own time limit so one slow part cannot starve the rest):
#   graphs/speculation GPU tests, decode and verify step times, the seed workload (graphs, eager and
#   each top-k backend), and the demo model with and without speculation. Logs and JSON go to $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filter() { grep -av "Warning\|warn(\|debug_dump\|^\s*$\|^INFO\|^  [a-z]" ; }
{
  timeout -k 5 ${T_TESTS:-110} python -m pytest -q -m gpu tests/test_cuda_graphs_gpu.py \
    -k "auto or speculative or speculation or mtp_1"
  timeout -k 5 ${T_STEPS:-100} python -m sparseserve.benchmarks.decode_graphs --steps 12 --batches 1,8,64 \
    --spec-k 1,2 --no-eager --out "$OUT/decode_graphs_spec.json"
  timeout -k 5 ${T_SEED:-100} python benchmarks/run_all.py --only ${SEED_RUNS:-graphs,eager} --skip-hf-latency \
    --engine-flag=--max-model-len=2048 --budget-s 95 --out-dir "$OUT"
  timeout -k 5 ${T_DEMO:-90} python tools/eval_demo.py --device cuda --out "$OUT/demo_eval.json"
} 2>&1 | filter > "$OUT/check.log"
tail -60 "$OUT/check.log"
