#!/usr/bin/env bash
# The GPU benchmark in one device call (< 9 minutes):
#
#   bash benchmarks/gpu_suite.sh                      # the main table of docs/performance.md (--only realistic)
#   bash benchmarks/gpu_suite.sh --only kernels,core,peers,logits   # the older full suite (flat data)
#   bash benchmarks/gpu_suite.sh --only features      # loss features vs the plain path (RESULTS.md)
#
# Arguments go to `python3 -m benchmarks.run --suite gpu` (see its --help). Installs the carried peer
# wheels (.whl/, name it in `carry`) when present, prints versions, runs every job in its own process
# with its timeout, stops starting jobs after --budget-s (default 480 s), and leaves in $OUT (default
# /tmp/gmpo_bench):
#   run.jsonl    this run's records: append them to benchmarks/results/<device>.jsonl, then run
#                `python -m benchmarks.report` (README, docs/performance.md and RESULTS.md tables)
#   table.txt    the compact table (also printed last)
#   suite.log    every job's stderr/stdout, for failures
#   versions.txt nvidia-smi and package versions
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/gmpo_bench}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
export GMPO_BENCH_DATA="${GMPO_BENCH_DATA:-/tmp/gmpo_bench_data}"   # batches handed to the PyTorch peers

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" \
    || echo "[gpu_suite] wheel install failed: the PyTorch peers will be skipped"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "== $(date -u +%FT%TZ) $(hostname) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
    --format=csv 2>&1 || echo "nvidia-smi unavailable"
  "$PY" - <<'PYEOF'
import importlib.metadata as md, platform
print("python", platform.python_version())
for p in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "torch", "triton",
          "liger-kernel", "cut-cross-entropy", "numpy"):
    try:
        print(f"{p} {md.version(p)}")
    except md.PackageNotFoundError:
        pass
PYEOF
} 2>&1 | tee "$OUT/versions.txt"

"$PY" -m benchmarks.run --suite gpu --budget-s 480 --results "$OUT/run.jsonl" --log "$OUT/suite.log" \
  --table "$OUT/table.txt" "$@"
rc=$?
echo "[gpu_suite] exit $rc; records: $( (wc -l < "$OUT/run.jsonl") 2>/dev/null || echo 0) in $OUT/run.jsonl"
exit $rc
