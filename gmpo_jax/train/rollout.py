"""Rollouts: jit-compiled sampling with a KV cache, group-normalised advantages, behaviour log-probs.

Data flow of one step (see `gmpo_jax.train.loop`): prompts ``[N, P]`` (each prompt repeated ``G`` times,
groups contiguous) -> `sample_completions` -> completion ids / mask ``[N, T]`` -> host rewards ``[N]`` ->
`group_advantages` ``[N]`` -> optional `policy_logprobs` of the behaviour policy (``old_logps``, when the
batch is reused for several optimizer passes) and of the frozen reference (``ref_logps``, when
``beta > 0``) -> a `RolloutBatch`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import gmpo_jax

__all__ = [
    "RolloutBatch",
    "sample_completions",
    "group_advantages",
    "completion_hidden",
    "head_weight",
    "policy_logprobs",
]


class RolloutBatch(NamedTuple):
    """One rollout batch, the input of a training step (a pytree; ``None`` fields are absent).

    Attributes:
      prompt_ids: ``[N, P]`` int32.
      completion_ids: ``[N, T]`` int32; ``pad_id`` after EOS.
      completion_mask: ``[N, T]`` bool; True for sampled tokens up to and including EOS.
      advantages: ``[N]`` float32, group-normalised.
      old_logps: ``[N, T]`` float32 behaviour log-probs, or None (on-policy).
      ref_logps: ``[N, T]`` float32 reference log-probs, or None (no KL term).
    """

    prompt_ids: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    advantages: jax.Array
    old_logps: jax.Array | None = None
    ref_logps: jax.Array | None = None


def _top_p_filter(logits: jax.Array, top_p: float) -> jax.Array:
    """Mask (to -inf) the tokens outside the smallest set whose probability reaches ``top_p``."""
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep_sorted = before < top_p  # the top token is always kept
    n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_logits, n_keep - 1, axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


@nnx.jit(static_argnames=("max_new_tokens", "top_p", "eos_id", "pad_id"))
def sample_completions(
    model,
    prompt_ids: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    *,
    max_new_tokens: int,
    top_p: float = 1.0,
    eos_id: int = 1,
    pad_id: int = 0,
):
    """Sample one completion per prompt row, autoregressively with a KV cache (one compiled program).

    The prompt is prefilled in one pass; then a ``lax.scan`` of ``max_new_tokens`` steps samples a token
    from ``softmax(logits / temperature)`` (restricted to the top-``top_p`` nucleus when ``top_p < 1``),
    feeds it back through `Transformer.decode` (one position, attending to the cache) and stops a row at
    its first EOS: later positions hold ``pad_id`` and are masked.

    Args:
      model: a `Transformer` (any module with ``init_cache``, ``decode``, ``logits``).
      prompt_ids: ``[N, P]`` int32, equal-length prompts (no padding).
      key: PRNG key.
      temperature: float32 scalar ``> 0`` (traced: changing it does not recompile).
      max_new_tokens: ``T``, completion length limit (static).
      top_p: nucleus mass in ``(0, 1]``; 1 samples the full distribution (static).
      eos_id, pad_id: special token ids (static).

    Returns:
      ``(completion_ids [N, T] int32, completion_mask [N, T] bool)``; the mask is True up to and
      including the first EOS (all True if no EOS was sampled: truncated at ``T``).
    """
    n, p = prompt_ids.shape
    cache = model.init_cache(n, p + max_new_tokens)
    hidden, cache = model.decode(prompt_ids, cache, 0)
    logits = model.logits(hidden[:, -1])

    def step(carry, t):
        cache, logits, done, key = carry
        key, sub = jax.random.split(key)
        scaled = logits / temperature
        if top_p < 1.0:
            scaled = _top_p_filter(scaled, top_p)
        tok = jax.random.categorical(sub, scaled, axis=-1).astype(jnp.int32)
        valid = ~done
        tok = jnp.where(valid, tok, pad_id)
        done = done | (tok == eos_id)
        hidden, cache = model.decode(tok[:, None], cache, p + t)
        return (cache, model.logits(hidden[:, 0]), done, key), (tok, valid)

    init = (cache, logits, jnp.zeros((n,), bool), key)
    _, (toks, valid) = jax.lax.scan(step, init, jnp.arange(max_new_tokens))
    return toks.T, valid.T


def group_advantages(rewards, group_size: int, *, scale: str = "group", eps: float = 1e-4) -> np.ndarray:
    """Group-normalised advantages, GRPO style (TRL's ``scale_rewards``).

    .. math::
        A_{g,i} = \\frac{r_{g,i} - \\bar r_g}{\\sigma_g + \\epsilon} \\;(\\text{scale="group"}), \\qquad
        A_{g,i} = r_{g,i} - \\bar r_g \\;(\\text{scale="none"}, \\text{Dr. GRPO})

    with :math:`\\bar r_g` the mean and :math:`\\sigma_g` the unbiased (``ddof=1``, as ``torch.std``)
    standard deviation of the ``G`` rewards of prompt ``g``. A group whose rewards are all equal gets
    zero advantages (it carries no learning signal).

    Args:
      rewards: ``[N]`` rewards, ``N = num_prompts * group_size``, groups contiguous.
      group_size: ``G >= 2``.
      scale: ``"group"`` or ``"none"``.
      eps: added to the std.

    Returns:
      ``[N]`` float32 advantages.

    Raises:
      ValueError: ``N`` not divisible by ``group_size``, ``group_size < 2`` or an unknown ``scale``.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if group_size < 2 or r.shape[0] % group_size:
        raise ValueError(
            f"rewards of length {r.shape[0]} cannot be split into groups of group_size={group_size} (>= 2)"
        )
    if scale not in ("group", "none"):
        raise ValueError(f"scale must be 'group' or 'none', got scale={scale!r}")
    g = r.reshape(-1, group_size)
    adv = g - g.mean(axis=1, keepdims=True)
    if scale == "group":
        adv = adv / (g.std(axis=1, ddof=1, keepdims=True) + eps)
    return adv.reshape(-1).astype(np.float32)


def completion_hidden(model, prompt_ids: jax.Array, completion_ids: jax.Array) -> jax.Array:
    """Hidden states that predict the completion tokens: ``model([prompt, completion])[:, P-1:-1]``.

    A policy with its own ``completion_hidden(prompt_ids, completion_ids)`` method (Tunix's Qwen3,
    `gmpo_jax.train.qwen3.Qwen3Policy`) is asked for them instead.

    Args:
      model: the policy (returns ``[N, P + T, H]`` hidden states).
      prompt_ids: ``[N, P]``. completion_ids: ``[N, T]``.

    Returns:
      ``[N, T, H]``: row ``t`` is the state after reading ``prompt + completion[:t]``.
    """
    if hasattr(model, "completion_hidden"):
        return model.completion_hidden(prompt_ids, completion_ids)
    p = prompt_ids.shape[1]
    hidden = model(jnp.concatenate([prompt_ids, completion_ids], axis=1))
    return hidden[:, p - 1 : -1]


def head_weight(model, dtype):
    """``(weight, weight_layout)`` of ``model.head`` (or of ``model.head_weight()`` where the policy has
    that method) for the fused loss, cast to the activation ``dtype``."""
    weight, layout = model.head_weight() if hasattr(model, "head_weight") else gmpo_jax.lm_head_weight(model.head)
    return weight.astype(dtype), layout


@nnx.jit(static_argnames=("temperature", "train_mesh"))
def policy_logprobs(
    model,
    batch_prompt_ids: jax.Array,
    completion_ids: jax.Array,
    completion_mask: jax.Array,
    temperature: float = 1.0,
    train_mesh=None,
) -> jax.Array:
    """Per-token log-probs of the completions under ``model`` via ``gmpo_jax.fused_linear_logprobs``.

    Used for ``old_logps`` (the behaviour policy, before the first update on a batch) and ``ref_logps``
    (the frozen reference). Never forms ``[N, T, V]`` logits.

    Args:
      model: a `Transformer`.
      batch_prompt_ids: ``[N, P]`` int32. completion_ids: ``[N, T]`` int32. completion_mask: ``[N, T]``.
      temperature: the sampling temperature, a Python float (static): log-probs of the sampling distribution.
      train_mesh: None (one device) or a `gmpo_jax.train.parallel.TrainMesh` (static): the fused call is
        sharded over its data / vocabulary axes (``--mesh``).

    Returns:
      ``[N, T]`` float32, 0 where the mask is False; no gradient is taken through it.
    """
    from gmpo_jax.train.parallel import fused_head

    h = completion_hidden(model, batch_prompt_ids, completion_ids)
    weight, layout = head_weight(model, h.dtype)
    weight, head, axes = fused_head(weight, layout, train_mesh)
    logps = gmpo_jax.fused_linear_logprobs(
        h, weight, completion_ids, completion_mask=completion_mask, temperature=temperature, head=head, sharding=axes
    )
    return jax.lax.stop_gradient(logps)
