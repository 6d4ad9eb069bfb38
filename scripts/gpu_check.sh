#!/usr/bin/env bash
# One GPU session's worth of checks: the test suite, then the benchmark.
# Usage (on a GPU machine, repo root): bash scripts/gpu_check.sh [OUTDIR] [benchmark args...]
# TESTS="tests/test_a.py ..." limits the test run; TESTS=none skips it; BENCH=none skips
# the benchmark.
# Full logs and the benchmark JSON go to OUTDIR; the benchmark table is printed last.
set -uo pipefail
out=${1:-${OUT:-/tmp/linghe-gpu}}
shift || true
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
if [ "${TESTS:-tests}" != none ]; then
  # shellcheck disable=SC2086
  python3 -m pytest ${TESTS:-tests} -q -p no:cacheprovider -rfE --timeout=300 2>&1 \
    | tee "$out/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
fi
if [ "${BENCH:-}" != none ]; then
  python3 -m benchmark --json "$out/bench.json" "$@" 2>"$out/bench.err" | tee "$out/bench.txt"
  tail -5 "$out/bench.err"
fi
