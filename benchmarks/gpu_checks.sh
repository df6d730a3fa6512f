#!/usr/bin/env bash
# The GPU test suite on the lent H200, plainly and under x64 (issue 16), in one device call:
#   bash benchmarks/gpu_checks.sh            # logs in $OUT (default /tmp/gmpo_gpu_checks)
# Each pass has its own time limit so that the call ends inside 10 minutes; the last lines of each log
# are printed. The pytest markers: `gpu` (needs a Hopper GPU); the `--x64` option is tests/conftest.py's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gmpo_gpu_checks}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout "${GPU_TESTS_S:-330}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/ > "$OUT/gpu_tests.log" 2>&1
echo "[gpu_checks] gpu tests exit $?"; tail -n 15 "$OUT/gpu_tests.log"
timeout "${GPU_X64_S:-220}" python3 -m pytest -m gpu --x64 -q -p no:cacheprovider -rfE tests/test_kernels.py \
  tests/test_logits_loss.py > "$OUT/gpu_tests_x64.log" 2>&1
echo "[gpu_checks] gpu tests under x64 exit $?"; tail -n 15 "$OUT/gpu_tests_x64.log"
