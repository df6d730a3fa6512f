#!/usr/bin/env bash
# Issue 5 on the device, in one call: kernel sweep + floors + end-to-end timings, the gpu-marked tests,
# then the shared benchmark suite's logits group (one process per configuration: peak memory).
#   bash benchmarks/logits_device_run.sh      (logs under $OUT)
set -u
OUT="${OUT:-/tmp/gmpo_logits}"; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH="$PWD"
t0=$(date +%s)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1
timeout "${SWEEP_S:-120}" python3 benchmarks/logits_sweep.py ${SWEEP_ARGS:-} > "$OUT/sweep.jsonl" 2> "$OUT/sweep.err"
echo "sweep rc=$? at $(( $(date +%s) - t0 ))s" >> "$OUT/env.txt"
JAX_PLATFORMS=cuda timeout "${PYTEST_S:-90}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_logits_loss.py -x > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? at $(( $(date +%s) - t0 ))s" >> "$OUT/env.txt"
left=$(( ${TOTAL_S:-225} - ($(date +%s) - t0) ))
if [ "$left" -gt 30 ]; then
  timeout "$left" python3 -m benchmarks.run --suite gpu --only logits --budget-s $(( left - 25 )) \
    --results "$OUT/run.jsonl" --log "$OUT/suite.log" --table "$OUT/table.txt" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at $(( $(date +%s) - t0 ))s" >> "$OUT/env.txt"
fi
tail -n 3 "$OUT/sweep.err"; cat "$OUT/env.txt"; tail -n 5 "$OUT/pytest.log"
