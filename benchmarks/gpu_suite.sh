#!/usr/bin/env bash
# The whole GPU benchmark in one device call.
#
#   bash benchmarks/gpu_suite.sh [--commit abc1234] [--only kernels,core,peers,logits] [--budget-s 480] [...]
#
# Any argument is passed on to `python3 -m benchmarks.run --suite gpu` (later ones win). Installs the
# carried peer wheels (.whl/, name it in `carry`) when present, prints versions, runs every job in its own
# process with its timeout, stops starting jobs after --budget-s (default 480 s, so the call ends well
# inside 10 minutes), and leaves in $OUT (default /tmp/gmpo_bench):
#   run.jsonl    this run's records (append to benchmarks/results/<device>.jsonl, then
#                `python -m benchmarks.report`)
#   table.txt    the compact table (also printed last)
#   suite.log    every job's stderr/stdout noise, for failures
#   versions.txt nvidia-smi and package versions
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gmpo_bench}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" \
    || echo "[gpu_suite] wheel install failed: the PyTorch peers will be skipped"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
    --format=csv 2>&1 || echo "nvidia-smi unavailable"
  python3 - <<'EOF'
import importlib.metadata as md, platform
print("python", platform.python_version())
for p in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "torch", "triton",
          "liger-kernel", "cut-cross-entropy", "numpy"):
    try:
        print(f"{p} {md.version(p)}")
    except md.PackageNotFoundError:
        pass
EOF
} 2>&1 | tee "$OUT/versions.txt"

python3 -m benchmarks.run --suite gpu --budget-s 480 --results "$OUT/run.jsonl" --log "$OUT/suite.log" \
  --table "$OUT/table.txt" "$@"
rc=$?
echo "[gpu_suite] exit $rc; records: $( (wc -l < "$OUT/run.jsonl") 2>/dev/null || echo 0) in $OUT/run.jsonl"
exit $rc
