"""The loss inside a Flax NNX training step: gradients equal the dense reference's, through the
module's own parameters (untied Linear head and tied Embed head), and the optimizer step runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import gmpo_jax
from gmpo_jax import reference


class TinyPolicy(nnx.Module):
    def __init__(self, vocab: int, hidden: int, tied: bool, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, hidden, rngs=rngs)
        self.body = nnx.Linear(hidden, hidden, rngs=rngs)
        self.tied = tied
        if not tied:
            self.lm_head = nnx.Linear(hidden, vocab, use_bias=True, rngs=rngs)

    def __call__(self, tokens):
        return jnp.tanh(self.body(self.embed(tokens)))

    def head(self):
        return self.embed if self.tied else self.lm_head


def _batch(V=29, B=3, T=5):
    k = jax.random.split(jax.random.key(3), 4)
    tokens = jax.random.randint(k[0], (B, T), 0, V)
    ids = jax.random.randint(k[1], (B, T), 0, V)
    mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
    adv = jnp.array([0.7, -1.1, 0.4])
    old = -3.4 + 0.3 * jax.random.normal(k[2], (B, T))
    return tokens, ids, mask, adv, old


def _loss(model, fn, tokens, ids, mask, adv, old):
    hidden = model(tokens)
    weight, layout = gmpo_jax.lm_head_weight(model.head())
    bias = None if model.tied else model.lm_head.bias[...]
    loss, _ = fn(
        hidden,
        weight,
        gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=old),
        objective=gmpo_jax.GMPO(epsilon_low=0.2, epsilon_high=0.2),
        bias=bias,
        head=gmpo_jax.HeadOptions(weight_layout=layout),
    )
    return loss


@pytest.mark.parametrize("tied", [False, True], ids=["linear_head", "tied_embed"])
def test_nnx_value_and_grad_matches_dense_reference(tied):
    model = TinyPolicy(29, 8, tied, nnx.Rngs(0))
    batch = _batch()
    loss_f, grads_f = nnx.jit(nnx.value_and_grad(lambda m: _loss(m, gmpo_jax.fused_linear_policy_loss, *batch)))(model)
    loss_r, grads_r = nnx.jit(nnx.value_and_grad(lambda m: _loss(m, reference.policy_loss, *batch)))(model)
    np.testing.assert_allclose(loss_f, loss_r, rtol=1e-5)
    flat_f = jax.tree.leaves(grads_f)
    flat_r = jax.tree.leaves(grads_r)
    assert len(flat_f) == len(flat_r) > 0
    for gf, gr in zip(flat_f, flat_r):
        np.testing.assert_allclose(gf, gr, rtol=1e-4, atol=1e-6)
    # the head's gradient is not trivially zero
    head_grad = jax.tree.leaves(grads_f["embed"] if tied else grads_f["lm_head"]["kernel"])[0]
    assert float(jnp.abs(head_grad).max()) > 1e-4


def test_nnx_jit_train_step_decreases_loss():
    model = TinyPolicy(29, 8, False, nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-2), wrt=nnx.Param)
    batch = _batch()

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: _loss(m, gmpo_jax.fused_linear_policy_loss, *batch))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(5)]
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0]
