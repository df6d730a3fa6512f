"""The policy: a small decoder-only transformer in Flax NNX that returns final hidden states.

The model call stops at the final norm: ``Transformer(tokens) -> hidden [B, S, H]``. The LM head is a
separate module, `Transformer.head` -- an untied ``nnx.Linear`` (kernel ``[H, V]``, layout ``"hv"``) or,
with ``tie_embeddings=True``, the input ``nnx.Embed`` (table ``[V, H]``, layout ``"vh"``) -- so the training
loss feeds ``hidden`` and ``gmpo_jax.lm_head_weight(model.head)`` to the fused loss and the ``[B, S, V]``
logits are never formed. Sampling, which needs one position's logits at a time, uses `Transformer.logits`.

Architecture: learned absolute position embeddings (the built-in tasks have fixed-length prompts), pre-norm
blocks (RMSNorm, multi-head causal self-attention, GELU MLP), a final RMSNorm. Parameters are float32;
``dtype`` sets the activation dtype (bfloat16 on the GPU preset). `Transformer.decode` runs the same blocks
against a key/value cache for incremental sampling.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["KVCache", "Transformer"]


class KVCache(NamedTuple):
    """Per-layer keys and values of the positions decoded so far.

    Attributes:
      k: ``[L, B, S_max, n_heads, head_dim]`` keys (activation dtype); positions past the decoded
        prefix hold zeros and are masked out by causality.
      v: same shape, values.
    """

    k: jax.Array
    v: jax.Array


class _Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, dtype, rngs: nnx.Rngs):
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.norm1 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(
            d_model,
            d_model,
            use_bias=False,
            dtype=dtype,
            rngs=rngs,
            kernel_init=nnx.initializers.normal(0.02 / math.sqrt(2)),
        )
        self.norm2 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(
            d_ff, d_model, dtype=dtype, rngs=rngs, kernel_init=nnx.initializers.normal(0.02 / math.sqrt(2))
        )

    def __call__(self, x, q_pos, kv: tuple | None = None, start=None):
        """``x [B, S, D]``; ``q_pos [S]`` absolute positions. With ``kv = (k [B,Smax,h,d], v)``, this
        block's cache, the new keys/values are written at ``start`` and attention runs over the cache."""
        b, s, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (t.reshape(b, s, self.n_heads, self.head_dim) for t in (q, k, v))
        if kv is None:
            k_all, v_all, k_pos = k, v, q_pos
        else:
            k_all = jax.lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), (0, start, 0, 0))
            v_all = jax.lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), (0, start, 0, 0))
            k_pos = jnp.arange(k_all.shape[1])
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_all, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(self.head_dim)
        causal = k_pos[None, :] <= q_pos[:, None]
        scores = jnp.where(causal, scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_all.dtype)
        att = jnp.einsum("bhqk,bkhd->bqhd", probs, v_all).reshape(b, s, d)
        x = x + self.proj(att)
        x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
        return x, (None if kv is None else (k_all, v_all))


class Transformer(nnx.Module):
    """Decoder-only transformer policy whose call returns the final hidden states (no LM head).

    Args:
      vocab_size: ``V``, rows of the embedding / columns of the LM head.
      max_len: longest sequence (prompt + completion) the position embedding covers.
      d_model: ``H``. n_layers: blocks. n_heads: attention heads (must divide ``d_model``).
      d_ff: MLP width.
      tie_embeddings: LM head = the input embedding (``[V, H]``, layout ``"vh"``); else an untied
        bias-free ``nnx.Linear`` (``[H, V]``, layout ``"hv"``).
      dtype: activation dtype (``jnp.float32`` or ``jnp.bfloat16``); parameters are float32.
      rngs: ``nnx.Rngs`` for the initialisation.
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_ff: int,
        *,
        tie_embeddings: bool = False,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.n_heads = n_heads
        self.tie_embeddings = tie_embeddings
        self.dtype = dtype
        # default Embed init: std 1/sqrt(H), so tied logits start at unit scale like the untied head's
        self.embed = nnx.Embed(vocab_size, d_model, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(max_len, d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([_Block(d_model, n_heads, d_ff, dtype=dtype, rngs=rngs) for _ in range(n_layers)])
        self.final_norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        if tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(d_model, vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    @property
    def head(self) -> nnx.Module:
        """The LM-head module: ``self.lm_head`` (``nnx.Linear``) or, tied, ``self.embed`` (``nnx.Embed``)."""
        return self.embed if self.tie_embeddings else self.lm_head

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Final hidden states of a full causal pass.

        Args:
          tokens: ``[B, S]`` int token ids, ``S <= max_len``.

        Returns:
          ``[B, S, H]`` hidden states (activation dtype); position ``t`` predicts token ``t + 1``.
        """
        pos = jnp.arange(tokens.shape[1])
        x = self.embed(tokens) + self.pos_embed(pos)[None]
        for block in self.blocks:
            x, _ = block(x, pos)
        return self.final_norm(x)

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty `KVCache` for ``batch`` sequences of up to ``length`` positions."""
        block = self.blocks[0]
        shape = (len(self.blocks), batch, length, block.n_heads, block.head_dim)
        return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

    def decode(self, tokens: jax.Array, cache: KVCache, start) -> tuple[jax.Array, KVCache]:
        """Hidden states of ``tokens`` placed at positions ``start ..``, attending to the cached prefix.

        Args:
          tokens: ``[B, S]`` ids (``S = P`` to prefill a prompt, ``S = 1`` per sampled token).
          cache: `KVCache` holding positions ``< start``.
          start: int or int32 scalar, absolute position of ``tokens[:, 0]``.

        Returns:
          ``(hidden [B, S, H], cache)`` with this call's keys/values written at ``start``. Equal (up to
          float rounding) to ``self(prefix + tokens)[:, start:]``.
        """
        pos = start + jnp.arange(tokens.shape[1])
        x = self.embed(tokens) + self.pos_embed(pos)[None]
        ks, vs = [], []
        for i, block in enumerate(self.blocks):
            x, (k, v) = block(x, pos, (cache.k[i], cache.v[i]), start)
            ks.append(k)
            vs.append(v)
        return self.final_norm(x), KVCache(jnp.stack(ks), jnp.stack(vs))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits ``hidden @ W`` of a few positions (sampling only; training uses the fused loss).

        Args:
          hidden: ``[..., H]``.

        Returns:
          ``[..., V]`` float32.
        """
        if self.tie_embeddings:
            w = self.embed.embedding[...]
            return jnp.einsum("...h,vh->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
        w = self.lm_head.kernel[...]
        return jnp.einsum("...h,hv->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
