#!/usr/bin/env bash
# The README's headline rows on this tree and on an earlier one, alternating, in one device call (a refactor's
# "no slower" check: issue 33 asks for within 3 %). The earlier tree is an ignored folder that the call carries:
#   git archive <commit> | tar -x -C .old && cp benchmarks/compile_probe.py .old/benchmarks/   (once, here)
#   bash benchmarks/headline_ab.sh .old          # on the GPU; JSON lines in $OUT/{new,old}.jsonl
#   ROWS="0 1" bash benchmarks/headline_ab.sh .old   # a subset of the rows (to fit one call's time limit)
# Each row is a benchmarks.compile_probe process per tree (compile, first call, then the median of 30 steps).
set -uo pipefail
cd "$(dirname "$0")/.."
OLD="${1:?usage: headline_ab.sh OLD_TREE}"
OUT="${OUT:-/tmp/gmpo_headline_ab}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
probe() {  # probe TREE TAG ARGS...
  local tree=$1 tag=$2; shift 2
  (cd "$tree" && PYTHONPATH=. timeout 230 python3 -m benchmarks.compile_probe --iters 30 --timeout-s 220 "$@" \
    --results "$OUT/$tag.jsonl") 2>&1 | tail -3
}
QWEN="--shape qwen2.5-0.5b --B 8 --T 2048"
rows=(
  "$QWEN --data heavy-shared-live,flat"
  "$QWEN --grad-filter 0.001 --data heavy-shared-live"
  "--shape llama3-8b --B 4 --T 2048 --data light"
  "--shape qwen2.5-0.5b --B 2 --T 32768 --data peaked"
  "--shape qwen2.5-0.5b --B 2 --T 32768 --grad-filter 0.001 --data peaked"
)
for i in ${ROWS:-${!rows[@]}}; do  # the order alternates, so a drift in the lease does not favour one tree
  if (( i % 2 )); then probe "$OLD" old ${rows[$i]}; probe . new ${rows[$i]}
  else probe . new ${rows[$i]}; probe "$OLD" old ${rows[$i]}; fi
done
