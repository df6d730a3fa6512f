"""A Tunix model's parts the fused loss needs: its final hidden states (:func:`final_hidden_states`), its LM-head
weight without a copy (:func:`lm_head`) and its final-logit soft cap (:func:`logit_softcap`)."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["final_hidden_states", "lm_head", "logit_softcap"]


def final_hidden_states(
    model: Any,
    prompt_ids: jax.Array,
    completion_ids: jax.Array,
    *,
    pad_id: int,
    eos_id: int,
    segment_ids: jax.Array | None = None,
    segment_positions: jax.Array | None = None,
) -> jax.Array:
    """Final (post-norm) hidden states of a Tunix model at the positions that predict ``completion_ids``.

    Runs the model with ``output_hidden_states=True`` and takes the sown ``all_hidden_states``; the
    model's own logits are then unused and XLA removes them when this runs under ``jax.jit``. (Called
    eagerly, the model still computes them once, without gradient.) ``segment_ids`` reach the model when
    its ``__call__`` takes them (or ``**kwargs``), as in Tunix's ``compute_per_token_logps``.

    Padded layout (``segment_ids`` None): tokens ``concat(prompt_ids, completion_ids)``, positions and
    the causal padding mask from Tunix's ``common.process_ids``, the per-position non-pad mask as
    ``segment_ids``; returns ``x[:, P-1 : P+T-1]`` (``x`` the ``[B, P+T, D]`` states), so row ``t``
    predicts ``completion_ids[:, t]``.

    Packed layout (Tunix's ``pack_sequences``): tokens ``completion_ids`` (the packed buffer, prompts and
    completions), positions ``segment_positions``, ``segment_ids`` passed to the model, and the
    attention mask ``M[b, q, k] = (k <= q) and segment_ids[b, q] == segment_ids[b, k]`` (causal within a
    segment: what the splash kernel computes from ``segment_ids``; Tunix passes ``attention_mask=None``,
    which its non-flash attention takes as no mask at all). Returns ``y[:, t] = x[:, t - 1]`` for
    ``t >= 1`` and ``y[:, 0] = 0``: the shift of Tunix's packed log-probs (``logits[:, :-1]`` left-padded
    by one), so row ``t`` predicts token ``t``. Row 0, and the first row of every later sequence (which
    holds the previous sequence's last state), predict nothing within their sequence: the completion mask
    must be 0 there. Tunix's packing puts each sequence's prompt (mask 0) first, so it is;
    :func:`~gmpo_jax.integrations.tunix.loss_arguments` checks a concrete mask.

    Args:
      model: a Tunix NNX causal LM whose ``__call__`` takes ``output_hidden_states`` (Qwen2, Qwen3,
        Gemma3, ...).
      prompt_ids: ``[B, P]`` int32, left-padded with ``pad_id``; ``[B, 0]`` when packed.
      completion_ids: ``[B, T]`` int32, right-padded with ``pad_id``; packed: the ``[B, L]`` buffer.
      pad_id, eos_id: the tokenizer's ids.
      segment_ids: None (padded) or ``[B, L]`` int, packed: 1, 2, ... per sequence, 0 for padding.
      segment_positions: ``[B, L]`` int, each token's position within its sequence; required with
        ``segment_ids`` (as in Tunix), else must be None.

    Returns:
      ``[B, T, D]`` (``[B, L, D]`` packed) in the model's activation dtype; row ``t`` predicts
      ``completion_ids[:, t]``.

    Raises:
      ValueError: ``segment_ids`` without ``segment_positions`` or the reverse, a packed ``prompt_ids``
        that is not ``[B, 0]``, or ``segment_ids`` / ``segment_positions`` not of ``completion_ids``'s
        shape.
      NotImplementedError: a model without ``output_hidden_states``.
    """
    from flax import nnx
    from tunix.rl import common

    params = inspect.signature(model.__call__).parameters
    if "output_hidden_states" not in params:
        raise NotImplementedError(
            f"{type(model).__name__}.__call__ has no output_hidden_states argument, so its "
            "final hidden states cannot be read without its logits"
        )
    takes_segment_ids = "segment_ids" in params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    packed = segment_ids is not None
    if packed:
        _check_packed_layout(prompt_ids, completion_ids, segment_ids, segment_positions)
        tokens, positions, model_seg = completion_ids, segment_positions, segment_ids
        attn_mask = _packed_attention_mask(segment_ids)
    else:
        if segment_positions is not None:
            raise ValueError("segment_positions is given without segment_ids; pass both (packed) or neither")
        tokens, positions, attn_mask, model_seg = common.process_ids(prompt_ids, completion_ids, pad_id, eos_id)
    kwargs = dict(positions=positions, cache=None, attention_mask=attn_mask, output_hidden_states=True)
    if takes_segment_ids:  # as Tunix passes them: the packing ids, else the per-position non-pad mask
        kwargs["segment_ids"] = model_seg
    model(tokens, **kwargs)
    sown = nnx.pop(model, nnx.Intermediate)
    x = sown["all_hidden_states"]
    x = x.get_value() if isinstance(x, nnx.Variable) else x
    x = x[-1] if isinstance(x, (tuple, list)) else x
    if packed:
        return jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0)))
    T = completion_ids.shape[1]
    return x[:, -T - 1 : -1]


def _check_packed_layout(prompt_ids, completion_ids, segment_ids, segment_positions) -> None:
    """The packed layout's shapes, with errors naming the argument."""
    if segment_positions is None:
        raise ValueError(
            "segment_positions must be given with segment_ids (packed batches): each token's position "
            "within its sequence, as Tunix's pack_sequences sets train_example.segment_positions"
        )
    shape = tuple(completion_ids.shape)
    if tuple(prompt_ids.shape) != shape[:1] + (0,):
        raise ValueError(
            f"packed batches hold prompts and completions in completion_ids, so prompt_ids must be "
            f"[B, 0] = {shape[:1] + (0,)}, got {tuple(prompt_ids.shape)}"
        )
    for name, x in (("segment_ids", segment_ids), ("segment_positions", segment_positions)):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have completion_ids' shape {shape}, got {tuple(x.shape)}")


def _packed_attention_mask(segment_ids: jax.Array) -> jax.Array:
    """``[B, L, L]`` bool: causal attention within each segment (padding, id 0, attends to padding)."""
    L = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((L, L), bool))
    return causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


def logit_softcap(model: Any) -> float | None:
    """The final-logit soft cap ``c`` of a Tunix model (Gemma 1/2: ``logits = c tanh(logits / c)``), or None.

    Read from ``model.final_logits_softcap`` or ``model.config.final_logit_softcap``; passed as
    ``HeadOptions(softcap=...)`` to the fused calls, so that their logits equal the model's own."""
    softcap = getattr(model, "final_logits_softcap", None)
    if softcap is None:
        softcap = getattr(getattr(model, "config", None), "final_logit_softcap", None)
    return None if softcap is None else float(softcap)


def lm_head(model: Any) -> tuple[jax.Array, str]:
    """The LM-head weight of a Tunix model and its layout, without a copy.

    Args:
      model: a Tunix model with an ``lm_head`` ``Einsum`` (``w`` of shape ``[D, V]``, layout ``"hv"``) or a
        tied ``embedder`` (``input_embedding`` ``[V, D]``, layout ``"vh"``).

    Returns:
      ``(weight, layout)``: the parameter's own array (traced inside ``nnx.value_and_grad``, so gradients
      reach it) and the ``weight_layout`` for gmpo_jax.

    Raises:
      TypeError: no LM head found.

    A model's final-logit soft cap (Gemma 1/2) is not part of the weight: :func:`logit_softcap` reads it.
    """
    head = getattr(model, "lm_head", None)
    if head is not None:
        w = head.w[...]
        if getattr(head, "einsum_str", "").replace(" ", "").split("->")[0].split(",")[-1] not in ("DV", ""):
            raise TypeError(f"unexpected LM-head einsum {head.einsum_str!r}; expected '...,DV->...'")
        return w, "hv"
    embedding = getattr(getattr(model, "embedder", None), "input_embedding", None)
    if embedding is not None:
        return embedding[...], "vh"
    raise TypeError(f"{type(model).__name__} has neither an lm_head Einsum nor an embedder.input_embedding")
