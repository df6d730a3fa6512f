export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
b() { PYTHONPATH=$1:$PWD timeout 80 python3 -m benchmarks.run --shape logits-llama3 --B $2 --T 1024 --impl mosaic_gpu --objective grpo --mode fwd+bwd --results $OUT/$3.jsonl --commit $3 2>&1 | grep -E "fwd\+bwd +ok" | tail -1 | sed "s/^/$3 /"; }
for i in 1 2; do b $PWD 2 new; b scratch/old 2 old; done
b $PWD 16 new; b scratch/old 16 old
