#!/usr/bin/env bash
# The GPU check, run from anywhere on a CUDA machine:
#   bash tools/gpu_check.sh          every `gpu` test, then benchmarks/run_all.py (the seed workload)
#   bash tools/gpu_check.sh tests    only the `gpu` tests
#   bash tools/gpu_check.sh bench    only benchmarks/run_all.py; RUN_ALL_FLAGS adds flags to it, e.g.
#                                    RUN_ALL_FLAGS="--quick --kernels all" (the micro-benchmarks of benchmarks/ too)
# With OUT set, the test log and the benchmark results go under $OUT; otherwise the log is printed only and the
# results land in benchmarks/results/. The exit status is the tests' (the benchmark records its own failures).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
mode=${1:-all}
status=0
log=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; log=$OUT/gpu_tests.log; fi
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  python -m pytest -q -m gpu 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  # shellcheck disable=SC2086
  python benchmarks/run_all.py ${OUT:+--out-dir "$OUT"} ${RUN_ALL_FLAGS:-}
fi
exit "$status"
