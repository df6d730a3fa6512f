"""``gmpo-jax train --mesh`` on 8 simulated CPU devices: prints one JSON object for tests/integration/test_train_mesh.py.

Run by ``tests/integration/test_train_mesh.py`` in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(the flag must be set before JAX initialises its CPU backend; the pytest process already has one device).
Directly: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/train_mesh_cases.py OUT_DIR``.

Output keys:
  ``runs``: mesh string -> ``{"history": [...], "head_spec": str, "moment_specs": [str], "seconds": float}``:
  two training steps of ``TINY``; the test compares them with a single-device run of ``TINY`` that it
  makes in its own process meanwhile.
  ``pad_case``: see `pad_case` (``V`` not a multiple of ``M``: the head padded, ``vocab_size=`` masking).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np
from flax import nnx

from gmpo_jax.train import TrainConfig, loop, parallel

# the tiny configuration of tests/integration/test_train.py (beta > 0 and num_iterations > 1: the sharded fused log-probs,
# old and reference, and the sharded fused loss all run) with a tied head of V = 16 = 8 x M: on model=2 the
# embedding table and its AdamW moments are stored split along V (the padded V = 15 case is `pad_case`)
TINY = dict(
    d_model=32,
    n_layers=1,
    n_heads=2,
    d_ff=64,
    batch_size=16,
    group_size=4,
    num_iterations=2,
    beta=0.04,
    learning_rate=3e-3,
    warmup_steps=1,
    progress=False,
    plots=False,
    save_every=0,
    steps=2,
    vocab_size=16,
    tie_embeddings=True,
)
MESHES = ("data=2,model=2", "data=4,model=1")


def run_training(out_dir: str) -> dict:
    runs = {}
    for mesh in MESHES:
        t0 = time.perf_counter()
        r = loop.train(TrainConfig(**TINY, mesh=mesh, output_dir=f"{out_dir}/{mesh}"), log=lambda s: None)
        moments = {
            str(x.sharding.spec)
            for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(r.optimizer))[0]
            if "['embed']['embedding']" in jax.tree_util.keystr(path)
        }
        runs[mesh] = {
            "history": r.history,
            "seconds": time.perf_counter() - t0,
            "head_spec": str(r.model.embed.embedding[...].sharding.spec),
            "moment_specs": sorted(moments),
        }
    return runs


def pad_case() -> dict:
    """``V = 15`` on ``M = 2`` (the default tokenizer vocabulary): `parallel.fused_head` pads the head to 16
    and passes ``HeadOptions(vocab_size=15)``. Loss, hidden and weight gradients of the fused loss through the pad, on
    the ``data=2,model=2`` mesh, against the unpadded single-device call; both weight layouts."""
    import jax.numpy as jnp

    import gmpo_jax

    tm = parallel.make_train_mesh(2, 2)
    rng = np.random.default_rng(1)
    B, T, H, V = 8, 5, 16, 15
    hidden = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None] < rng.integers(1, T + 1, (B, 1)))
    adv = jnp.asarray(rng.normal(size=B), jnp.float32)
    old = jnp.asarray(np.log(rng.uniform(0.02, 0.2, (B, T))), jnp.float32)
    out = {}
    for layout in ("hv", "vh"):
        w = jnp.asarray(rng.normal(size=(H, V) if layout == "hv" else (V, H)) / 4, jnp.float32)

        def loss(h, w, train_mesh):
            w2, head, axes = parallel.fused_head(w, layout, train_mesh)
            batch = gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old, ref_logps=old - 0.1)
            return gmpo_jax.fused_linear_policy_loss(
                h, w2, batch, objective=gmpo_jax.GMPO(beta=0.04), head=head, sharding=axes
            )[0]

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
        ref, (ref_dh, ref_dw) = grad(hidden, w, None)
        val, (dh, dw) = grad(tm.put_batch(hidden), w, tm)
        w2, head, _ = parallel.fused_head(w, layout, tm)
        out[layout] = {
            "padded_shape": list(w2.shape),
            "vocab_size": head.vocab_size,
            "loss": float(val),
            "ref_loss": float(ref),
            "dh_rel": float(jnp.max(jnp.abs(dh - ref_dh)) / jnp.max(jnp.abs(ref_dh))),
            "dw_rel": float(jnp.max(jnp.abs(dw - ref_dw)) / jnp.max(jnp.abs(ref_dw))),
            "dw_shape": list(dw.shape),
        }
    return out


if __name__ == "__main__":
    assert jax.device_count() >= 8, "set XLA_FLAGS=--xla_force_host_platform_device_count=8"
    t0 = time.perf_counter()
    result = {"runs": run_training(sys.argv[1]), "pad_case": pad_case(), "seconds": time.perf_counter() - t0}
    print("RESULT " + json.dumps(result))
