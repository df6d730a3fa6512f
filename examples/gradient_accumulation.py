"""Gradient accumulation with gmpo_jax: k micro-batches through ``optax.MultiSteps`` give the same update as
one step on the whole batch, for GMPO (normalised by the number of sequences) and dapo (by the token count).

Every loss is ``loss = aux.loss_numerator / aux.loss_denominator`` with the normaliser of ITS call: GMPO,
grpo and sapo divide by the call's number of sequences (rows, or packed sequences), bnpo / dapo / cispo by its
token count, dr_grpo by ``sequences * max_completion_length``. To accumulate, each micro-batch's loss must be
divided by the whole window's normaliser instead:

* GMPO (and grpo, sapo, dr_grpo, bnpo): ``loss_i * aux_i.loss_denominator / window_denominator``; for GMPO
  ``aux_i.loss_denominator`` is the micro-batch's sequence count and ``window_denominator`` the window's.
* dapo / cispo: set ``batch.num_items_in_batch`` to the window's active-token count (global over data-parallel
  devices); then the micro-batch losses already add up to the window's loss.

``optax.MultiSteps`` AVERAGES the k gradients it accumulates, so each micro-batch's loss is also multiplied
by k (a manual loop that sums the gradients drops that factor). Plain SGD makes the check exact: Adam's
first update is about ``-lr * sign(g)``, which would hide a wrong factor.

Run: ``python examples/gradient_accumulation.py`` (CPU, seconds; it asserts and prints the differences).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gmpo_jax

B, T, D, V = 6, 5, 16, 32  # the window: 6 sequences of up to 5 tokens; hidden size 16, vocabulary 32
SPLIT = (3, 2, 1)  # its k = 3 micro-batches, of unequal sizes (equal ones would hide a wrong weighting)
k, TOL = len(SPLIT), 1e-5  # float32: the two summation orders differ by a few ulps of each leaf's largest entry
rng = np.random.default_rng(0)
normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
params = {"proj": normal(D, D) / 4, "head": normal(D, V) / 4}
lengths = np.array([5, 1, 4, 2, 5, 3])  # active completion tokens per sequence
inputs = normal(B, T, D)  # stands in for the model's inputs
data = gmpo_jax.PolicyBatch(
    completion_ids=jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
    completion_mask=jnp.asarray(np.arange(T) < lengths[:, None]),
    advantages=normal(B),
    old_logps=normal(B, T) * 0.3 - np.log(V),  # behaviour-policy log-probs (some ratios get clipped)
    ref_logps=normal(B, T) * 0.3 - np.log(V),  # reference log-probs (the KL term)
)
batch = (inputs, data)
starts = np.cumsum((0,) + SPLIT)  # a PolicyBatch is a pytree: jax.tree.map slices every field
micro_batches = [jax.tree.map(lambda a, s=s, e=e: a[s:e], batch) for s, e in zip(starts[:-1], starts[1:])]


def policy_loss(params, mb, objective, num_items_in_batch=None):
    inputs, data = mb
    hidden = jnp.tanh(inputs @ params["proj"])  # a one-layer "model"; gradients reach both parameters
    data = data._replace(num_items_in_batch=num_items_in_batch)
    return gmpo_jax.fused_linear_policy_loss(hidden, params["head"], data, objective=objective)


def one_update(micro_loss, whole_loss):
    """Params after one SGD step on the whole batch and after k micro-steps of MultiSteps(SGD), the whole
    batch's loss and the micro-batches' ``(loss, aux)``. ``micro_loss(params, mb) -> (loss to differentiate,
    (loss, aux))``, ``whole_loss(params, batch) -> loss``."""
    whole, grads = jax.jit(jax.value_and_grad(whole_loss))(params, batch)
    full = jax.tree.map(lambda p, g: p - g, params, grads)
    grad_fn = jax.jit(jax.grad(micro_loss, has_aux=True))
    opt = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=k)
    p, state, outs = params, opt.init(params), []
    for mb in micro_batches:  # MultiSteps applies the averaged update at the k-th call (zero updates before)
        grads, out = grad_fn(p, mb)
        updates, state = opt.update(grads, state, p)
        p = optax.apply_updates(p, updates)
        outs.append(out)
    return full, p, float(whole), outs


def max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


# --- GMPO: weight each micro-batch's loss by its sequence count over the window's ------------------------------
gmpo = gmpo_jax.GMPO(epsilon_low=0.4, epsilon_high=0.4, beta=0.04)
window_sequences = B  # GMPO's normaliser of the whole window: its number of sequences (packed: segments)


def gmpo_micro_loss(params, mb):
    loss, aux = policy_loss(params, mb, gmpo)  # aux.loss_denominator: this micro-batch's sequence count
    return k * loss * aux.loss_denominator / window_sequences, (loss, aux)


full, accumulated, whole, outs = one_update(gmpo_micro_loss, lambda p, b: policy_loss(p, b, gmpo)[0])
assert max_diff(accumulated, full) < TOL, max_diff(accumulated, full)
# the loss values re-normalise the same way: the sum of the numerators over the sum of the denominators
renormalised = float(sum(a.loss_numerator for _, a in outs) / sum(a.loss_denominator for _, a in outs))
assert abs(renormalised - whole) < TOL * abs(whole), (renormalised, whole)
unweighted = float(sum(loss for loss, _ in outs) / k)  # the mistake: the mean of the micro-batch means
assert abs(unweighted - whole) > 1e-2 * abs(whole), (unweighted, whole)  # unequal micro-batches: it matters
print(
    f"GMPO: update within {max_diff(accumulated, full):.1e} of the whole batch's; loss {renormalised:.6f} = {whole:.6f}"
)

# --- dapo: num_items_in_batch = the window's active-token count -------------------------------------------------
dapo = gmpo_jax.GRPO(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, beta=0.04)
window_tokens = int(data.completion_mask.sum())  # global over data-parallel devices; this window's only


def dapo_micro_loss(params, mb):
    loss, aux = policy_loss(params, mb, dapo, num_items_in_batch=window_tokens)
    return k * loss, (loss, aux)  # k: MultiSteps averages


full, accumulated, whole, outs = one_update(
    dapo_micro_loss, lambda p, b: policy_loss(p, b, dapo)[0]
)  # its own count: the window's
assert max_diff(accumulated, full) < TOL, max_diff(accumulated, full)
summed = float(sum(loss for loss, _ in outs))
assert abs(summed - whole) < TOL * abs(whole), (summed, whole)
own_counts = sum(float(a.loss_numerator / mb[1].completion_mask.sum()) for (_, a), mb in zip(outs, micro_batches)) / k
assert abs(own_counts - whole) > 1e-2 * abs(whole), (own_counts, whole)  # the mistake: no num_items_in_batch
print(f"dapo: update within {max_diff(accumulated, full):.1e} of the whole batch's; loss {summed:.6f} = {whole:.6f}")
