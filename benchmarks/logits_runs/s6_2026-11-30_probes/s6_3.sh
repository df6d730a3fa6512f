export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1 PYTHONPATH=$PWD
timeout 100 python3 scratch/s6_hlo.py 2>&1 | tail -3
timeout 200 python3 - <<'PY' 2>&1 | grep -v "^W\|^I0" | tail -20
import sys; sys.path.insert(0, "scratch")
import s6_probe as P
K = P.K
for B in (2, 16):
    c = lambda C, n, **kw: (K, K.FusedConfig(cluster=C, num_ctas=C * n, **kw))
    v = {"c4x62": c(4, 62), "c2x124": c(2, 124), "c2x132": c(2, 132), "c8x31": c(8, 31), "c8x32": c(8, 32)}
    try:
        P.kernel_alone(B, v)
    except Exception as e:
        print("ERR", repr(e)[:400])
        v.pop("c8x31"); v.pop("c8x32"); P.kernel_alone(B, v)
PY
