export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
for B in 2 16; do for p in scratch/old scratch/k041 $PWD scratch/old scratch/k041 $PWD; do
PYTHONPATH=$p:$PWD timeout 60 python3 scratch/s6_harness.py $B time 2>&1 | grep -E "^TIME|Error"; done; done
for p in scratch/old scratch/k041 $PWD; do echo "== $p"
PYTHONPATH=$p:$PWD timeout 100 ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum python3 scratch/s6_harness.py 2 ncu > $OUT/ncu.txt 2>&1
grep -E "^  [a-zA-Z_]|gpu__time_duration" $OUT/ncu.txt | paste - - | awk '{print $NF, $1}' | head -20; done
