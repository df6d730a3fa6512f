"""The LM-head op's public functions: check -> build the inputs pytree -> resolve config -> the custom VJP.

No math lives here: the objectives are in ``gmpo_jax.objectives``, the chunk scan and its custom VJPs in
``gmpo_jax.lm_head.vjp``, the per-chunk LM-head computations in the backends (``xla_chunked.py``,
``mosaic_gpu/``), the mesh layout in ``sharding.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int, Num

from gmpo_jax import _validation as V_
from gmpo_jax._dispatch import logger
from gmpo_jax.batch import PolicyBatch, ReferenceHead
from gmpo_jax.lm_head import backend as backend_lib
from gmpo_jax.lm_head import sharding as sharding_lib
from gmpo_jax.lm_head.config import make_plan as _plan
from gmpo_jax.lm_head.config import placed as _placed
from gmpo_jax.lm_head.config import resolve_config as _config
from gmpo_jax.lm_head.vjp import Head, fused_logprobs, fused_policy_loss
from gmpo_jax.objectives import LossAux, Objective, PolicyInputs, high_entropy_tokens, token_mean
from gmpo_jax.options import HeadOptions, MeshAxes, as_head_options, as_mesh_axes

__all__ = ["fused_linear_policy_loss", "fused_linear_logprobs"]

ScalarLike = Union[float, Float[Array, ""]]


def fused_linear_policy_loss(
    hidden: Float[Array, "B T H"],
    weight: Float[Array, "H V"] | Float[Array, "V H"],
    batch: PolicyBatch,
    *,
    objective: Objective,
    bias: Float[Array, " V"] | None = None,
    temperature: ScalarLike = 1.0,
    reference: ReferenceHead | None = None,
    head: HeadOptions | None = None,
    sharding: MeshAxes | None = None,
) -> tuple[Float[Array, ""], LossAux]:
    r"""Policy-gradient loss (GMPO or the GRPO family) fused with the LM head.

    .. math::
        \log\pi_{b,t} = \mathrm{log\_softmax}\!\left(\frac{h_{b,t} W + c}{\tau}\right)[y_{b,t}]

    computed in float32 with a vocabulary-blocked online log-sum-exp, then the objective's loss of ``SPEC.md``
    on :math:`\log\pi` (e.g. GMPO: :math:`\frac1B\sum_b -A_b \exp(\mathrm{mean}_t\,\mathrm{clip}(\log\pi -
    \log\pi_{old}))`). Memory: the ``[B, T, V]`` logits are never materialised; beyond the inputs at most one
    float32 copy of the weight (the gradient accumulator), the ``[B, T, H]`` hidden gradient and one chunk's
    vocabulary block (docs/DESIGN.md).

    Args:
      hidden: ``[B, T, H]`` bf16 / f16 / f32 final hidden states of the completion positions, already shifted
        (position ``t`` predicts ``batch.completion_ids[:, t]``); any value at masked positions (ignored); a
        concrete NaN or infinity at a counted token raises ValueError (traced, it makes the loss NaN).
      weight: the LM head, ``[H, V]`` or ``[V, H]`` as ``head.weight_layout`` declares; never copied.
      batch: the per-token inputs, a :class:`~gmpo_jax.PolicyBatch` (its fields are documented there).
      objective: ``GMPO(...)``, ``GRPO(...)``, ``CISPO(...)`` or ``SAPO(...)`` with its hyper-parameters and
        loss shaping (:class:`~gmpo_jax.objectives.Objective`).
      bias: ``[V]`` LM-head bias or None; ``-inf`` masks a column out (as ``vocab_size`` padding does), but a
        counted token's own id must not have it (log-prob ``-inf``; a sampler never draws it: ValueError when
        concrete, under ``jit`` a NaN or meaningless loss).
      temperature: ``> 0`` sampling temperature dividing the logits (float, or a traced scalar: one that is not
        finite and ``> 0`` makes the result NaN).
      reference: a :class:`~gmpo_jax.ReferenceHead` from which the KL term's reference log-probs are computed
        with the same fused path, without gradient; instead of ``batch.ref_logps``. Given to an objective
        without a KL term (``objective.has_kl`` False) it is ignored (nothing computed): a UserWarning once
        per process, at the caller's line.
      head: how the LM head computes, a :class:`~gmpo_jax.HeadOptions` (None: ``HeadOptions()``).
      sharding: the mesh axes to split over, a :class:`~gmpo_jax.MeshAxes` (None: none, or those of inputs
        sharded over ``Explicit`` mesh axes).

    Returns:
      ``(loss, aux)``: ``loss`` a float32 scalar, ``aux`` a :class:`~gmpo_jax.LossAux` of float32 scalars (no
      gradient). The gradients w.r.t. ``hidden``, ``weight`` and ``bias`` come in those arrays' dtypes; reverse
      mode only (``jax.grad`` / ``vjp``, not ``jvp``); everything else (``temperature``, the batch, the
      objective) is data with a zero cotangent (``gmpo_jax.reference`` differentiates them too). Hidden states at
      masked positions are ignored, whatever they hold (NaN included), as their ids are; their gradient is 0.
      With ``sharding``, take gradients under ``jax.jit`` or inside ``jax.set_mesh(mesh)`` (JAX builds the
      cotangent of a mesh-sharded scalar only there; an eager ``jax.grad`` fails inside JAX).

    Raises:
      TypeError: a ``batch`` / ``reference`` / ``head`` / ``sharding`` / ``objective`` of the wrong class;
        non-floating ``hidden`` / ``weight`` / advantages / log-probs; non-integer ids or segment ids; a
        ``batch.num_items_in_batch`` that is not a real scalar.
      ValueError:
        - inconsistent shapes (the argument or field named); an empty ``B``, ``T``, ``H`` or ``V``;
        - ``weight`` not laid out as ``head.weight_layout`` declares; ``head.vocab_size`` above ``V``;
        - a concrete ``temperature`` not finite and ``> 0``;
        - an objective with a KL term (``objective.has_kl``: static, fixed when it was built and kept by
          ``jax.tree.map``) and neither ``batch.ref_logps`` nor ``reference``; both of them;
        - concrete values the batch's fields rule out (``PolicyBatch``: a mask of other values than 0 / 1, an
          unmasked id outside ``[0, V)``, non-finite advantages, a log-prob that is NaN, infinite or above 0.5
          at a counted token, ...); a non-finite ``hidden`` at a counted token; when a token counts, a
          non-finite ``weight`` entry, a NaN / ``+inf`` ``bias`` entry or ``-inf`` at a counted token's own id
          (elsewhere ``-inf`` bans a token); the same weight and bias checks in ``reference`` with a KL term
          (concrete values only: under ``jit`` such an entry makes the loss NaN);
        - mesh axes not in the mesh or not dividing ``B`` / ``V``; an unknown implementation name.
      UnsupportedConfigError: an explicitly requested implementation cannot serve this call.

    References: GMPO, arXiv 2507.20673; Liger-Kernel ``LigerFusedLinearGRPOLoss``; TRL ``GRPOTrainer``.

    Example:
      >>> import jax, jax.numpy as jnp, gmpo_jax
      >>> k = jax.random.split(jax.random.key(0), 3)
      >>> h = jax.random.normal(k[0], (2, 3, 8)); w = jax.random.normal(k[1], (8, 11)) / 3
      >>> ids = jax.random.randint(k[2], (2, 3), 0, 11); mask = jnp.array([[1, 1, 0], [1, 1, 1]])
      >>> batch = gmpo_jax.PolicyBatch(ids, mask, advantages=jnp.array([1.0, -0.5]))
      >>> loss, aux = gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=gmpo_jax.GMPO())
      >>> float(loss)  # on-policy: -mean_b A_b * exp(0)
      -0.25
    """
    head, axes = as_head_options(head), as_mesh_axes(sharding)
    B, T, H, V = V_.check_policy_inputs(
        hidden=hidden,
        weight=weight,
        batch=batch,
        objective=objective,
        bias=bias,
        temperature=temperature,
        reference=reference,
        weight_layout=head.weight_layout,
        vocab_size=head.vocab_size,
    )
    plan = _plan(hidden, weight, axes, B, V, head.weight_layout)
    inputs = V_.policy_inputs(batch, objective, temperature)
    threshold = None
    if objective.top_entropy_quantile != 1.0:
        _, entropy = _logprobs(Head(hidden, weight, bias), inputs, head, plan, with_entropy=True)
        entropy = lax.stop_gradient(entropy)
        select, threshold = high_entropy_tokens(entropy, inputs.mask, objective.top_entropy_quantile)
        inputs = inputs._replace(token_select=select)
    if reference is not None and objective.has_kl:  # without a KL term it is ignored (warned)
        ref_logps = _logprobs(Head(*reference), inputs, head, plan)
        inputs = inputs._replace(ref_logps=lax.stop_gradient(ref_logps))
    ids, bias = sharding_lib.mask_padded_vocab(inputs.ids, bias, V, head.vocab_size)
    cfg = _config(hidden, weight, bias, T, V, plan, head)
    if backend_lib.capabilities(cfg.backend).grad_filter:  # which gradient the loss has (the default filters)
        tau = cfg.backend.grad_filter
        logger.info("gmpo_jax: LM-head gradient %s", "exact" if tau is None else f"filtered at tau={tau:g}")
    params, inputs = _placed(plan, Head(hidden, weight, bias), inputs._replace(ids=ids))
    loss, aux = fused_policy_loss(cfg, objective, params, inputs)
    if threshold is None:
        return loss, aux
    return loss, aux._replace(entropy_threshold=threshold, entropy=token_mean(entropy, inputs.mask))


def fused_linear_logprobs(
    hidden: Float[Array, "B T H"],
    weight: Float[Array, "H V"] | Float[Array, "V H"],
    completion_ids: Int[Array, "B T"],
    *,
    completion_mask: Num[Array, "B T"] | Bool[Array, "B T"] | None = None,
    bias: Float[Array, " V"] | None = None,
    temperature: ScalarLike = 1.0,
    return_entropy: bool = False,
    head: HeadOptions | None = None,
    sharding: MeshAxes | None = None,
) -> Float[Array, "B T"] | tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    r"""Per-token log-probs (and optionally entropies) through the LM head without materialising the logits.

    .. math::
        \log\pi_{b,t} = z_{b,t,y} - \log\sum_v e^{z_{b,t,v}},\qquad z = \mathrm{cap}(h W + c) / \tau

    (``cap`` the identity, or Gemma's ``s tanh(x / s)`` with ``head.softcap=s``). For rollout-time behaviour
    and reference log-probs, or a loss of your own: differentiable in ``hidden``, ``weight`` and ``bias``
    (reverse mode; the logits are recomputed block by block in the backward).

    Args:
      hidden: ``[B, T, H]`` bf16 / f16 / f32 hidden states.
      weight: ``[H, V]`` or ``[V, H]`` LM head, as ``head.weight_layout`` declares.
      completion_ids: ``[B, T]`` integer target ids. Without a mask, an id outside ``[0, V)`` raises ValueError
        when concrete and gives NaN when traced.
      completion_mask: optional ``[B, T]`` bool / {0, 1}; masked positions return 0, receive no gradient and
        may hold any id and any hidden state.
      bias: optional ``[V]`` LM-head bias.
      temperature: ``> 0`` logits temperature (float, or a traced scalar: one that is not
        finite and ``> 0`` makes the result NaN).
      return_entropy: also return the per-token entropy of the (temperature-scaled) softmax,
        :math:`\mathcal{H}_{b,t} = \log\sum_v e^{z_v} - \sum_v p_v z_v` in nats, in ``[0, \log V]`` (``V`` =
        ``head.vocab_size`` when given): what TRL logs as ``entropy``. A metric: it carries no gradient.
      head: a :class:`~gmpo_jax.HeadOptions` (None: ``HeadOptions()``); its ``grad_filter`` applies to the
        policy loss only (these log-probs' gradient is exact).
      sharding: a :class:`~gmpo_jax.MeshAxes` (None: none, or read from ``Explicit`` mesh shardings).

    Returns:
      ``[B, T]`` float32 log-probs; with ``return_entropy`` the pair ``(logp, entropy)``, both ``[B, T]``
      float32 and 0 at masked positions.

    Raises:
      TypeError: as :func:`fused_linear_policy_loss`, for the arguments it takes; a ``return_entropy`` that is
        not a bool.
      ValueError: as :func:`fused_linear_policy_loss`, for the arguments it takes.
      UnsupportedConfigError: an explicitly requested implementation cannot serve this call.

    Example:
      >>> import jax, jax.numpy as jnp, gmpo_jax
      >>> h = jnp.zeros((1, 2, 4)); w = jnp.ones((4, 5))
      >>> logp = gmpo_jax.fused_linear_logprobs(h, w, jnp.array([[0, 4]]))  # uniform logits: log(1/5)
      >>> [round(float(x), 4) for x in logp[0]]
      [-1.6094, -1.6094]
    """
    head, axes = as_head_options(head), as_mesh_axes(sharding)
    B, T, H, V = V_.check_lm_head(hidden, weight, bias, head.weight_layout)
    V_.check_ids(completion_ids, B, T)
    if completion_mask is not None:
        V_.check_mask(completion_mask, B, T)
    V_.check_temperature(temperature)
    V_.check_vocab_size(head.vocab_size, V)
    V_.check_ids_in_range(completion_ids, completion_mask, head.vocab_size or V)
    if not isinstance(return_entropy, (bool, np.bool_)):
        raise TypeError(f"return_entropy must be a bool, got return_entropy={return_entropy!r}")
    plan = _plan(hidden, weight, axes, B, V, head.weight_layout)
    mask = jnp.ones((B, T), jnp.bool_) if completion_mask is None else V_.as_mask(completion_mask)
    ids = jnp.where(mask, V_.as_ids(completion_ids), 0)
    inputs = PolicyInputs(mask=mask, advantages=None, ids=ids, temperature=V_.as_temperature(temperature))
    out = _logprobs(Head(hidden, weight, bias), inputs, head, plan, with_entropy=bool(return_entropy))
    if return_entropy:
        return out[0], lax.stop_gradient(out[1])
    return out


def _logprobs(params: Head, inputs: PolicyInputs, head: HeadOptions, plan, *, with_entropy: bool = False):
    """The checked log-probs (and entropies) of ``inputs.ids`` through the LM head ``params``, on ``plan``."""
    hidden, weight, bias = params
    T = inputs.mask.shape[1]
    V = weight.shape[1] if head.weight_layout == "hv" else weight.shape[0]
    ids, bias = sharding_lib.mask_padded_vocab(inputs.ids, bias, V, head.vocab_size)
    inputs = PolicyInputs(mask=inputs.mask, advantages=None, ids=ids, temperature=inputs.temperature)
    exact = dataclasses.replace(head, grad_filter=None)  # the log-probs' backward never filters: a backend without it
    cfg = _config(hidden, weight, bias, T, V, plan, exact, with_entropy=with_entropy)
    return fused_logprobs(cfg, *_placed(plan, Head(hidden, weight, bias), inputs))
