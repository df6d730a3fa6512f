export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
for p in $PWD scratch/old; do PYTHONPATH=$p timeout 120 python3 scratch/s6_e2e.py 2>&1 | grep -E "^E2E|^pkg|Error|error" | tail -4; done
export PYTHONPATH=$PWD
timeout 100 ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum python3 scratch/s6_profile.py 2 > $OUT/ncu_2.txt 2>&1
grep -E "^  [a-zA-Z_]|gpu__time_duration" $OUT/ncu_2.txt | paste - - | awk '{print $NF, $1}' | head -20
