#!/usr/bin/env bash
# The GPU test suite on the lent H200, plainly and under x64 (issue 16), in one device call:
#   bash benchmarks/gpu_checks.sh            # logs in $OUT (default /tmp/gmpo_gpu_checks)
# Compiling the Mosaic kernels dominates (CPU-bound), so the test files run as parallel pytest processes
# sharing the GPU (no preallocation); each has the same time limit, so the call ends inside 10 minutes.
# The pytest markers: `gpu` (needs a Hopper GPU); the `--x64` option is tests/conftest.py's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gmpo_gpu_checks}"
LIMIT="${GPU_TESTS_S:-540}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() {  # run NAME PYTEST_ARGS...
  local name=$1; shift
  timeout "$LIMIT" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE "$@" > "$OUT/$name.log" 2>&1
  echo "$?" > "$OUT/$name.rc"
}
for f in contract kernels logits_loss; do
  run "$f" tests/*/"test_$f.py" &
  run "${f}_x64" --x64 tests/*/"test_$f.py" &
done
# the loss features' GPU tests (soft cap, entropy term, float32 head, gradient filter), plainly
FEATURES="softcap entropy_term logits_precision grad_filter"
for f in $FEATURES; do
  run "$f" tests/*/"test_$f.py" &
done
# the float32 head's gradient error, split GEMMs vs one HIGHEST GEMM (a diagnostic, not a test: JSON lines)
timeout "$LIMIT" python3 -m benchmarks.precision_probe > "$OUT/precision_probe.log" 2>&1 &
wait
for f in contract kernels logits_loss; do
  for name in "$f" "${f}_x64"; do
    echo "[gpu_checks] $name exit $(cat "$OUT/$name.rc")"; tail -n 6 "$OUT/$name.log"
  done
done
for name in $FEATURES; do
  echo "[gpu_checks] $name exit $(cat "$OUT/$name.rc")"; tail -n 6 "$OUT/$name.log"
done
echo "[gpu_checks] precision_probe"; grep '^{' "$OUT/precision_probe.log" || tail -n 6 "$OUT/precision_probe.log"
