export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 scratch/s6_probe.py kernel 2>&1 | grep -v "^W\|^I0" | tail -20
timeout 120 python3 scratch/s6_probe.py e2e 2>&1 | grep -v "^W\|^I0" | tail -6
for B in 2 16; do
timeout 100 ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum python3 scratch/s6_profile.py $B > $OUT/ncu_$B.txt 2>&1
grep -E "^  [a-zA-Z_]|gpu__time_duration" $OUT/ncu_$B.txt | paste - - | awk '{print $NF, $1}' | head -40
done
timeout 100 python3 -m pytest -q -m gpu tests/test_logits_loss.py -k fused 2>&1 | tail -3
