#!/usr/bin/env bash
# The one-program row skipping (tuning.ROW_PREFIX_FORWARD / ROW_PREFIX_GRADIENT) beside the per-bucket default, in
# one device call: first call (lower + compile + first run), Mosaic call sites, conditionals and the step time on the
# GRPO-like family members and the full-mask one, at both headline heads.
#   bash benchmarks/row_prefix_ab.sh [reverse] [filter]  # on the GPU (~5 min); JSON lines in $OUT/row_prefix.jsonl
# Each line is a benchmarks.compile_probe process (one configuration per process, as a user's first call); run it
# twice, the second time with "reverse" (the variants in the other order), so a drift in the lease favours none.
# "filter": the gradient filter (grad_filter=0.01, "auto") per static prefix beside it on one program, instead.
# EXTRA="--tuning WGMMA_IN_FLIGHT=1 ...": added to every setting (a kernel variant under all three).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gmpo_row_prefix_ab}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
DATA="heavy-shared,light,unsure,heavy-shared-live"
ONE="--tuning ROW_PREFIX_FORWARD=True --tuning ROW_PREFIX_GRADIENT=True"
variants=("" "--tuning ROW_PREFIX_FORWARD=True" "$ONE")
[[ " $* " == *" filter "* ]] && variants=("--grad-filter 0.01" "--grad-filter 0.01 $ONE")
order=$(seq 0 $((${#variants[@]} - 1)))
[[ " $* " == *" reverse "* ]] && order=$(seq $((${#variants[@]} - 1)) -1 0)
for shape in "--shape qwen2.5-0.5b --B 8 --T 2048" "--shape llama3-8b --B 4 --T 2048"; do
  for i in $order; do
    PYTHONPATH=. timeout 150 python3 -m benchmarks.compile_probe $shape --data "$DATA" --iters 20 --timeout-s 140 \
      ${variants[$i]} ${EXTRA:-} --results "$OUT/row_prefix.jsonl" 2>&1 | tail -4
  done
done
