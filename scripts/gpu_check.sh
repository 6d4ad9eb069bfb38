#!/usr/bin/env bash
# One GPU session's worth of checks: the test suite, then the benchmark; a per-file
# pass/fail summary is printed LAST and written to OUTDIR/summary.txt.
# Usage (on a GPU machine, repo root): bash scripts/gpu_check.sh [OUTDIR] [benchmark args...]
#   TESTS="tests/test_a.py ..."  limits the test run (default: tests, tests/dist aside);
#                                TESTS=none skips it
#   WORKERS=12                   pytest-xdist processes sharing the GPU (WORKERS=0: one
#                                process; without pytest-xdist it falls back to one process)
#   DIST=1                       also runs tests/dist, in one process (the 2-GPU machine)
#   BENCH=none                   skips the benchmark
#   LIMIT=480                    seconds after which the test run is interrupted (pytest
#                                still prints what ran), so one device call always reports
#   TEST_TIMEOUT=300             per-test limit (with pytest-timeout)
#   PYTHON=python3               the interpreter to use
#   KEYS=0                       skips counting distinct Triton compile keys per test file
#                                (tests/compile_keys.py; the table is in tests.log)
#   LINGHE_GPU_SUBSET=0          every parametrized case (tests/conftest.py: by default the
#                                GPU deselects cases that repeat another case's code path)
# OUTDIR gets: tests.log, junit.xml (dist: dist.log, dist.xml), summary.txt, and the
# benchmark's bench.json / bench.txt / bench.err. summary.txt is what the lead commits
# as benchmark/results/<device>_gpu_tests.txt.
set -uo pipefail
out=${1:-${OUT:-/tmp/linghe-gpu}}
shift || true
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# One Triton cache for every worker: a kernel that one worker compiled is loaded, not
# recompiled, by the others. Outside OUTDIR so the cache does not come back with the results.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/linghe-triton-cache}
mkdir -p "$TRITON_CACHE_DIR"

gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
versions=$($py -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')")
echo "$ngpu x $gpu; $versions"

common=(-q -p no:cacheprovider -rfE -o junit_family=xunit1 --durations=15)
if $py -c "import pytest_timeout" 2>/dev/null; then
  common+=(--timeout="${TEST_TIMEOUT:-300}")
fi
xdist=()
workers=${WORKERS:-12}
if [ "$workers" != 0 ]; then
  if $py -c "import xdist" 2>/dev/null; then
    # worksteal (xdist >= 3.2) rebalances when a few tests run long; else xdist's default.
    xdist=(-n "$workers")
    $py -c "import sys, xdist
sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" 2>/dev/null \
      && xdist+=(--dist worksteal)
    # Workers mostly compile (single-threaded); keep torch's CPU thread pools small.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  else
    echo "pytest-xdist is not installed: running the tests in one process"
    workers=0
  fi
fi

keys=()
[ "${KEYS:-1}" != 0 ] && keys=(--compile-keys="$out/compile_keys.json")
summaries=()
run_pytest() {  # name, pytest args...
  local name=$1
  shift
  local t0=$SECONDS
  # SIGINT first: pytest stops, prints its summary and writes the JUnit XML.
  timeout -k 30 -s INT "${LIMIT:-480}" "$py" -m pytest "$@" "${common[@]}" \
    --junitxml="$out/$name.xml" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc = 124 ] && echo "$name: interrupted after ${LIMIT:-480} s (LIMIT)" >> "$out/$name.log"
  grep -E "^(FAILED|ERROR) " "$out/$name.log" | head -40
  [ $rc = 124 ] && echo "$name: interrupted after ${LIMIT:-480} s (LIMIT)"
  summaries+=("$name ($((SECONDS - t0)) s wall, exit $rc): $(grep -E \
    "(passed|failed|error|skipped|no tests ran).* in [0-9.]+s" "$out/$name.log" | tail -1)")
}

if [ "${TESTS:-tests}" != none ]; then
  # shellcheck disable=SC2086
  if [ -z "${TESTS:-}" ]; then
    run_pytest junit tests --ignore=tests/dist "${xdist[@]}" "${keys[@]}"
  else
    run_pytest junit ${TESTS} "${xdist[@]}" "${keys[@]}"
  fi
fi
if [ "${DIST:-0}" = 1 ]; then
  run_pytest dist tests/dist  # ranks spawn their own processes: no xdist here
fi
if [ "${BENCH:-}" != none ]; then
  $py -m benchmark --json "$out/bench.json" "$@" 2>"$out/bench.err" | tee "$out/bench.txt"
  tail -5 "$out/bench.err"
fi

xmls=()
for x in "$out/junit.xml" "$out/dist.xml"; do [ -f "$x" ] && xmls+=("$x"); done
{
  echo "linghe GPU tests, $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD 2>/dev/null)"
  echo "device: $ngpu x $gpu; $versions; xdist workers: $workers;" \
    "LINGHE_GPU_SUBSET=${LINGHE_GPU_SUBSET:-default (on)}"
  grep -h "all files (distinct)" "$out/junit.log" 2>/dev/null | sed 's/^ */compile keys: /'
  [ ${#xmls[@]} -gt 0 ] && $py scripts/junit_summary.py "${xmls[@]}"
  printf '%s\n' "${summaries[@]}"
} > "$out/summary.txt"
echo "==================== summary ($out/summary.txt) ===================="
cat "$out/summary.txt"
