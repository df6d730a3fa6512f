"""Taking the LM head straight from Flax NNX modules, without copies or transposes."""

from __future__ import annotations

from typing import Any

__all__ = ["lm_head_weight"]


def lm_head_weight(module: Any) -> tuple[Any, str]:
    """Return ``(weight, weight_layout)`` for a Flax NNX LM head, ready for the fused losses.

    Args:
      module: an ``nnx.Linear`` (kernel ``[H, V]`` -> layout ``"hv"``) or an ``nnx.Embed`` used as a tied
        LM head (embedding table ``[V, H]`` -> layout ``"vh"``). A ``Linear``'s bias, if any, is
        ``module.bias[...]`` (pass it as ``bias=``).

    Returns:
      ``(weight, weight_layout)``: the module's own parameter array (no copy, no transpose; inside
      ``nnx.value_and_grad`` it is the traced parameter, so gradients reach the module) and its layout.

    Raises:
      TypeError: ``module`` is neither an ``nnx.Linear`` nor an ``nnx.Embed``.

    Example:
      >>> from flax import nnx
      >>> import gmpo_jax
      >>> w, layout = gmpo_jax.lm_head_weight(nnx.Embed(11, 4, rngs=nnx.Rngs(0)))
      >>> w.shape, layout
      ((11, 4), 'vh')
    """
    from flax import nnx

    if isinstance(module, nnx.Linear):
        return module.kernel[...], "hv"
    if isinstance(module, nnx.Embed):
        return module.embedding[...], "vh"
    raise TypeError(f"module must be an nnx.Linear or nnx.Embed LM head, got {type(module).__name__}")
