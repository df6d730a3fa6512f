export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=$PWD
timeout 280 python3 - <<'PY' 2>&1 | grep -E "KERNEL|ERR|rror" | tail -8
import sys; sys.path.insert(0, "scratch")
import s6_probe as P
K = P.K
for B in (2, 16):
    c = lambda n, st, o: (K, K.FusedConfig(cluster=4, num_ctas=4 * n, stages=st, out_stages=o))
    v = {"62_s4o2": c(62, 4, 2)}
    for n in (80, 88, 93, 96, 99):
        v[f"{n}_s3o1"] = c(n, 3, 1)
    v["93_s2o2"] = c(93, 2, 2)
    try:
        P.kernel_alone(B, v)
    except Exception as e:
        print("ERR", repr(e)[:300])
PY
