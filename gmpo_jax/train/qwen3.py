"""``gmpo-jax train --model qwen3 [--checkpoint DIR]``: Tunix's Qwen3 as the policy of the training demo.

The loop, rollouts, tasks, metrics, plots and checkpoints are the toy model's (`gmpo_jax.train.loop`);
this module supplies the policy. `Qwen3Policy` wraps a ``tunix.models.qwen3.model.Qwen3`` and gives it
the interface the sampler and the loss use:

* training loss and log-probs: `Qwen3Policy.completion_hidden` is
  ``gmpo_jax.integrations.tunix.final_hidden_states`` (the model's post-norm hidden states; its logits
  are never used, and XLA drops them under ``jax.jit``) and `Qwen3Policy.head_weight` is
  ``gmpo_jax.integrations.tunix.lm_head`` (the ``lm_head`` ``[H, V]``, layout ``"hv"``, or the tied
  embedding ``[V, H]``, ``"vh"``); both go to ``gmpo_jax.fused_linear_policy_loss`` as the toy's do;
* sampling: `Qwen3Policy.init_cache` / `Qwen3Policy.decode` run Tunix's decoder layers against Tunix's own
  KV cache, and `Qwen3Policy.logits` applies the head to the positions being sampled only.

Where the weights come from:

* no ``--checkpoint``: a random initialisation at the preset's size (`architecture`): ``--d-model``,
  ``--n-layers``, ``--n-heads``, ``--n-kv-heads``, ``--head-dim``, ``--d-ff``, the task's vocabulary
  (``--vocab-size`` pads it), ``--tie-embeddings``; rope_theta 1e6 and RMS-norm epsilon 1e-6 as Qwen3.
  Hugging Face's Qwen3 initialisation (`initialise`), not Tunix's, which expects to be overwritten.
  Tunix 0.1.7's Qwen3 rotates with rope_theta 1e6 whatever its config says, so a checkpoint with
  another ``rope_theta`` is refused;
* ``--checkpoint DIR``: a Hugging Face Qwen3 directory (``config.json`` + ``*.safetensors``, as
  ``Qwen3ForCausalLM.save_pretrained`` writes it), read with Tunix's loader
  ``tunix.models.qwen3.params.create_model_from_safe_tensors`` (parameters cast to float32). The
  architecture is ``config.json``'s (`gmpo_jax.train.hf_checkpoint.read_checkpoint` maps its fields to
  Tunix's ``ModelConfig`` and checks every tensor's name, shape and dtype before anything is loaded; its
  `gmpo_jax.train.hf_checkpoint.checkpoint_token_map` maps the task's characters to the checkpoint's
  vocabulary).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from gmpo_jax.train.config import TrainConfig
from gmpo_jax.train.hf_checkpoint import ROPE_THETA

__all__ = [
    "Qwen3Policy",
    "architecture",
    "build_policy",
    "INITIALIZER_RANGE",
    "initialise",
]

#: Qwen3's RMS-norm epsilon (its rotary base, `gmpo_jax.train.hf_checkpoint.ROPE_THETA`, is the checkpoint
#: reader's, which refuses any other)
NORM_EPS = 1e-6
#: Qwen3Config.initializer_range: the standard deviation of a random initialisation's weights
INITIALIZER_RANGE = 0.02


def architecture(config: TrainConfig, vocab_size: int) -> dict:
    """Tunix ``ModelConfig`` keyword arguments of a randomly initialised policy.

    ``embed_dim = d_model``, ``num_layers = n_layers``, ``num_heads = n_heads``, ``num_kv_heads =
    n_kv_heads or n_heads``, ``head_dim = head_dim or d_model // n_heads``, ``hidden_dim = d_ff``,
    ``vocab_size``, ``use_tied_embedding = tie_embeddings``, ``rope_theta`` 1e6, ``norm_eps`` 1e-6.
    """
    c = config
    return dict(
        num_layers=c.n_layers,
        vocab_size=vocab_size,
        embed_dim=c.d_model,
        hidden_dim=c.d_ff,
        num_heads=c.n_heads,
        head_dim=c.head_dim or c.d_model // c.n_heads,
        num_kv_heads=c.n_kv_heads or c.n_heads,
        rope_theta=ROPE_THETA,
        norm_eps=NORM_EPS,
        use_tied_embedding=bool(c.tie_embeddings),
    )


def initialise(model, seed: int, std: float = INITIALIZER_RANGE) -> None:
    """Hugging Face's Qwen3 initialisation, in place, on a freshly built Tunix ``Qwen3``.

    Every parameter of two or more dimensions (the embedding, the attention and MLP projections, the LM
    head) is drawn from ``N(0, std**2)``, ``std = 0.02`` (``Qwen3Config.initializer_range``); the RMS-norm
    scales stay 1. Tunix's own initialisers are meant to be overwritten by a checkpoint and do not train
    well from scratch: its MLP kernels are zeros (with ``gate``, ``up`` and ``down`` all zero every MLP
    gradient is zero, so the MLPs would never train) and its ``N(0, 1)`` embedding next to Glorot
    projections leaves the token identity a small part of the residual stream.

    Args:
      model: a ``tunix.models.qwen3.model.Qwen3``.
      seed: the draws use ``fold_in(PRNGKey(seed), i)`` for the ``i``-th parameter (in ``nnx.state``
        order).
      std: the standard deviation.
    """
    import jax

    key = jax.random.PRNGKey(seed)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    new = [
        (std * jax.random.normal(jax.random.fold_in(key, i), x.shape, jax.numpy.float32)).astype(x.dtype)
        if x.ndim >= 2
        else x
        for i, x in enumerate(leaves)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, new))


def build_policy(arch: dict, *, dtype: str, seed: int, checkpoint: str | None = None) -> Qwen3Policy:
    """The `Qwen3Policy` of an architecture: loaded from ``checkpoint`` or randomly initialised.

    Args:
      arch: Tunix ``ModelConfig`` keyword arguments (`architecture` or `CheckpointInfo.architecture`).
      dtype: activation dtype name (``"float32"`` / ``"bfloat16"``); parameters are float32 either way
        (a bf16 checkpoint is upcast for the optimizer).
      seed: initialisation seed (unused with a checkpoint).
      checkpoint: a directory checked by `read_checkpoint`, or None.

    Returns:
      The policy, on the default device.
    """
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3_model

    cfg = qwen3_model.ModelConfig(**arch, dtype=jnp.dtype(dtype), param_dtype=jnp.float32)
    if checkpoint is not None:
        from tunix.models.qwen3 import params as qwen3_params

        model = qwen3_params.create_model_from_safe_tensors(checkpoint, cfg, dtype=jnp.float32)
    else:
        model = qwen3_model.Qwen3(cfg, rngs=nnx.Rngs(seed))
        initialise(model, seed)
    return Qwen3Policy(model)


class Qwen3Policy(nnx.Module):
    """A Tunix ``Qwen3`` with the policy interface of the training loop (module docstring).

    Args:
      model: a ``tunix.models.qwen3.model.Qwen3`` (held as ``self.model``; its parameters are this
        module's, for the optimizer and checkpoints).
    """

    def __init__(self, model: Any):
        self.model = model

    def completion_hidden(self, prompt_ids, completion_ids):
        """Hidden states that predict the completion: ``final_hidden_states(model, prompt, completion)``.

        No position is treated as padding (``pad_id=-1``): prompts are unpadded and the tokens after EOS
        are masked out of the loss, so this is the sampler's forward pass (causal attention over prompt
        and completion, positions ``0 .. P+T-1``) whatever ids the policy sampled.

        Args:
          prompt_ids: ``[N, P]`` int32. completion_ids: ``[N, T]`` int32.

        Returns:
          ``[N, T, H]`` (activation dtype): row ``t`` is the state after ``prompt + completion[:t]``.
        """
        from gmpo_jax.integrations.tunix import final_hidden_states

        return final_hidden_states(self.model, prompt_ids, completion_ids, pad_id=-1, eos_id=-1)

    def head_weight(self):
        """``(weight, layout)`` of the LM head, ``gmpo_jax.integrations.tunix.lm_head(model)``."""
        from gmpo_jax.integrations.tunix import lm_head

        return lm_head(self.model)

    def init_cache(self, batch: int, length: int) -> dict:
        """Tunix's empty KV cache for ``batch`` rows of up to ``length`` positions (activation dtype)."""
        return self.model.init_cache(batch, length, self.model.config.dtype)

    def decode(self, tokens, cache: dict, start):
        """Post-norm hidden states of ``tokens`` at positions ``start ..``, attending to the cached prefix.

        Tunix's embedder, decoder layers and final norm with its KV cache (the layers write the new keys
        and values at the cache's ``end_index``, which equals ``start`` when decoding proceeds from 0);
        attention mask ``M[q, k] = k <= start + q`` over the cache, rotary positions ``start + q``. The
        LM head is not applied (`logits` does, for the rows being sampled).

        Args:
          tokens: ``[B, S]`` int32. cache: from `init_cache` or a previous call. start: int or int32
            scalar, the position of ``tokens[:, 0]``.

        Returns:
          ``(hidden [B, S, H], cache)``; equal (up to rounding) to ``completion_hidden``'s rows.
        """
        import jax.numpy as jnp

        m = self.model
        b, s = tokens.shape
        length = cache["layer_0"]["k"].shape[1]
        pos = start + jnp.arange(s, dtype=jnp.int32)
        positions = jnp.broadcast_to(pos, (b, s))
        mask = jnp.broadcast_to(jnp.arange(length)[None, :] <= pos[:, None], (b, s, length))
        x = m.embedder.encode(tokens)
        new = {}
        for i, layer in enumerate(m.layers):
            new[f"layer_{i}"], x = layer(x, positions, cache[f"layer_{i}"], mask)
        return m.final_norm(x), new

    def logits(self, hidden):
        """Float32 logits ``hidden @ W`` of a few positions (sampling only).

        Args:
          hidden: ``[..., H]``.

        Returns:
          ``[..., V]`` float32.
        """
        import jax.numpy as jnp

        w, layout = self.head_weight()
        spec = "...h,hv->...v" if layout == "hv" else "...h,vh->...v"
        return jnp.einsum(spec, hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
