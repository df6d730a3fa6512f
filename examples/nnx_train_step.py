import jax
import jax.numpy as jnp
import optax
from flax import nnx

import gmpo_jax


class Policy(nnx.Module):  # any model whose call returns final hidden states [B, T, H]
    def __init__(self, vocab, hidden, rngs):
        self.embed = nnx.Embed(vocab, hidden, rngs=rngs)
        self.body = nnx.Linear(hidden, hidden, rngs=rngs)
        self.lm_head = nnx.Linear(hidden, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        return jax.nn.gelu(self.body(self.embed(tokens)))


@nnx.jit
def logprobs(model, inputs, completion_ids, completion_mask):  # at rollout: the behaviour policy's log-probs
    weight, layout = gmpo_jax.lm_head_weight(model.lm_head)  # [H, V] kernel, layout "hv": no copy
    head = gmpo_jax.HeadOptions(weight_layout=layout)
    return gmpo_jax.fused_linear_logprobs(
        model(inputs), weight, completion_ids, completion_mask=completion_mask, head=head
    )


@nnx.jit
def train_step(model, optimizer, objective, inputs, batch):  # batch: a gmpo_jax.PolicyBatch (a pytree)
    def loss_fn(model):
        weight, layout = gmpo_jax.lm_head_weight(model.lm_head)
        hidden = model(inputs)  # [B, T, H]: position t predicts batch.completion_ids[:, t]
        head = gmpo_jax.HeadOptions(weight_layout=layout)
        return gmpo_jax.fused_linear_policy_loss(hidden, weight, batch, objective=objective, head=head)

    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, aux


model = Policy(vocab=1000, hidden=64, rngs=nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
objective = gmpo_jax.GMPO(epsilon_low=0.4, epsilon_high=0.4)  # or GRPO(loss_type="dapo"), CISPO(...), SAPO()

# One rollout batch: 4 completions of up to 8 tokens (random here; your sampler and rewards in practice)
k_in, k_out = jax.random.split(jax.random.key(0))
inputs = jax.random.randint(k_in, (4, 8), 0, 1000)  # the tokens the policy reads
completion_ids = jax.random.randint(k_out, (4, 8), 0, 1000)  # the sampled tokens it is scored on
completion_mask = jnp.arange(8) < jnp.array([[8], [5], [8], [3]])  # ragged completion lengths
advantages = jnp.array([1.2, -0.8, 0.4, -0.4])  # one per completion: its reward, normalised in its group
old_logps = logprobs(model, inputs, completion_ids, completion_mask)
batch = gmpo_jax.PolicyBatch(completion_ids, completion_mask, advantages, old_logps=old_logps)

for step in range(3):  # several updates per rollout batch: after the first they are off-policy
    loss, aux = train_step(model, optimizer, objective, inputs, batch)
    print(f"step {step}: loss {float(loss):+.4f}, clip fraction {float(aux.clip_fraction):.3f}")
