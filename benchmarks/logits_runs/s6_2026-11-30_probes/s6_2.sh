export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=$PWD
timeout 200 python3 scratch/s6_probe.py kernel 2>&1 | grep -v "^W\|^I0" | tail -20
timeout 150 python3 scratch/s6_probe.py e2e 2>&1 | grep -v "^W\|^I0" | tail -6
