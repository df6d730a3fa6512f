"""The logits op's public function: check -> build the inputs pytree -> resolve the backend -> the custom VJP.

The custom VJP and its design decisions are in ``gmpo_jax.logits.vjp``; the memory-bound passes in the
backends (``xla.py``, ``mosaic_gpu.py``); the objectives in ``gmpo_jax.objectives``.
"""

from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Num

from gmpo_jax import _validation as V_
from gmpo_jax.logits import backend as backend_lib
from gmpo_jax.logits.vjp import LogitsConfig, logits_policy_loss
from gmpo_jax.logits.xla import entropy_and_lse
from gmpo_jax.objectives import LossAux, Objective, high_entropy_tokens, token_mean

__all__ = ["policy_loss_from_logits"]

ScalarLike = Union[float, Float[Array, ""]]


def _check_inputs(logits, token_args: dict) -> tuple[int, int, int, int]:
    """All argument checks (trace time, named errors); returns (B, T, Tl, V) with ``Tl`` = T or T + 1.
    ``token_args``: the per-token arguments (``_validation.token_args``)."""
    completion_ids, objective = token_args["completion_ids"], token_args["objective"]
    V_.require_rank("logits", logits, 3, "[B, T + 1, V] or [B, T, V]")
    V_.require_float("logits", logits)
    V_.require_rank("completion_ids", completion_ids, 2, "[B, T]")
    B, T = np.shape(completion_ids)
    _, Tl, V = np.shape(logits)
    if B < 1 or T < 1 or V < 1:
        raise ValueError(
            f"completion_ids [B, T] and logits [B, T(+1), V] must be non-empty, got "
            f"completion_ids.shape={np.shape(completion_ids)}, logits.shape={np.shape(logits)}"
        )
    if np.shape(logits)[0] != B or Tl not in (T, T + 1):
        raise ValueError(
            f"logits must have shape [B, T + 1, V] or [B, T, V] with B, T = {(B, T)} (from "
            f"completion_ids), got logits.shape={np.shape(logits)}"
        )
    V_.check_token_inputs(
        B=B,
        T=T,
        V=V,
        **token_args,
    )
    if objective.requires_reference and token_args["ref_logps"] is None:
        raise ValueError(V_.reference_error(objective, "ref_logps"))
    return B, T, Tl, V


def policy_loss_from_logits(
    logits: Float[Array, "B T+1 V"] | Float[Array, "B T V"],
    completion_ids: Int[Array, "B T"],
    completion_mask: Num[Array, "B T"] | Bool[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    *,
    objective: Objective,
    old_logps: Float[Array, "B T"] | None = None,
    ref_logps: Float[Array, "B T"] | None = None,
    rollout_is_ratio: Array | None = None,
    num_items_in_batch: ScalarLike | None = None,
    temperature: ScalarLike = 1.0,
    segment_ids: Int[Array, "B T"] | None = None,
    rollout_logps: Float[Array, "B T"] | None = None,
    rollout_is_mode: str | None = None,
    rollout_is_cap: ScalarLike | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_coef: ScalarLike | None = None,
    implementation: Any = None,
) -> tuple[Float[Array, ""], LossAux]:
    r"""Policy-gradient loss (GMPO or the GRPO family) from logits that already exist.

    .. math::
        \log\pi_{b,t} = \mathrm{log\_softmax}\!\left(\frac{z_{b,t}}{\tau}\right)[y_{b,t}],\qquad
        \frac{\partial\mathcal{L}}{\partial z_{b,t,v}} = \frac{1}{\tau}
        \frac{\partial\mathcal{L}}{\partial\log\pi_{b,t}}\left(\mathbb{1}[v = y_{b,t}]
        - \mathrm{softmax}(z_{b,t}/\tau)_v\right)

    with the objective's loss of ``SPEC.md`` on :math:`\log\pi` (e.g. GMPO:
    :math:`\frac1B\sum_b -A_b \exp(\mathrm{mean}_t\,\mathrm{clip}(\log\pi - \log\pi_{old}))`), log-probs and
    loss in float32 whatever the logits' dtype. Memory-bound: the forward reads the logits once, the
    backward reads them once and writes ``dlogits`` once (for token-local objectives on ``"mosaic_gpu"``
    one kernel in the forward does both, keeping each row on chip between its two passes); beyond the logits and their
    gradient only ``[B, T]``-sized arrays are allocated (never a float32 or sliced copy of the logits).

    Args:
      logits: ``[B, T + 1, V]`` (the usual causal-LM output over prompt-end + completion: position ``t``
        predicts ``completion_ids[:, t]`` and the last position is dropped, lazily) or ``[B, T, V]``
        (already aligned); a floating dtype (``"xla"`` computes in float32 from any; the Mosaic kernels
        take bf16 / f16 / f32).
      completion_ids: ``[B, T]`` integer sampled tokens. Masked positions may hold any value (e.g. -100
        or ``>= V``); an unmasked id outside ``[0, V)`` raises ValueError when the ids and the mask are
        concrete; traced (under jit) it has a NaN log-prob,
        which makes the loss NaN unless the objective ignores that token's value (e.g. a zero advantage
        and ``beta = 0``); ``aux.log_ratio_min`` / ``log_ratio_max`` are NaN then too, and that row of
        the gradient may be NaN even when the loss is not (CISPO and SAPO with a zero advantage).
      completion_mask: ``[B, T]`` bool or {0, 1}; 1 = the token counts.
      advantages: ``[B]`` float, one per row (group-normalised by the caller), or ``[B, T]`` one per token
        (packed batches). GMPO takes a sequence's advantage as the mean over its unmasked tokens
        (their common value when the advantage is per sequence).
      objective: ``GMPO(...)``, ``GRPO(...)``, ``CISPO(...)`` or ``SAPO(...)`` with its hyper-parameters.
      old_logps: ``[B, T]`` float behaviour-policy log-probs; None = on-policy (``old = sg(logp)``).
      ref_logps: ``[B, T]`` float reference log-probs for the KL term (needed when ``objective.has_kl``;
        given to an objective without a KL term it is ignored: a UserWarning once per process, at the
        caller's line).
      rollout_is_ratio, rollout_logps, rollout_is_mode, rollout_is_cap: the trainer-vs-sampler mismatch
        correction, as in :func:`gmpo_jax.fused_linear_policy_loss` (with ``rollout_logps`` the token-local
        objectives run the three-pass path, not the fused kernel).
      num_items_in_batch: scalar, the dapo / cispo normaliser override: the number of active (unmasked)
        completion tokens in ONE optimizer step's accumulation window (global over devices), exactly as
        for :func:`gmpo_jax.fused_linear_policy_loss` (whose docstring has the details): a real scalar; for
        dapo / cispo a concrete value must be finite and ``>= 1``, a traced one is used as ``max(n, 1)``
        (a NaN propagates: NaN loss); the other loss types ignore it, whatever its value, and warn once per
        loss type at the caller's line. docs/guide.md: "`num_items_in_batch` under gradient accumulation".
      temperature: ``> 0`` sampling temperature dividing the logits (float or traced scalar).
      segment_ids, top_entropy_quantile: as in :func:`gmpo_jax.fused_linear_policy_loss` (packed rows;
        policy gradient only for the highest-entropy tokens, whose entropies come from one more fused XLA
        read of the logits here).
      entropy_coef: None (default), or a scalar ``c`` (float or traced): the loss gains the entropy term
        ``-c * agg(H)``, ``H`` the per-token entropy of ``softmax(z / temperature)`` aggregated as the
        objective aggregates its KL term (per-sequence mean for gmpo / grpo / sapo, token sum over the
        loss's normaliser for bnpo / dapo / dr_grpo / cispo; SPEC.md "Entropy term"), with its exact
        gradient ``dH/dz = -p (log p + H) / temperature`` added to ``dlogits`` by XLA (one more read of
        the logits for ``H`` and one fused pass over ``dlogits``; every implementation). ``c > 0``
        rewards entropy (verl's ``entropy_coeff``).
      implementation: None (``"mosaic_gpu"`` on Hopper-or-newer GPUs when it can serve the call, else
        ``"xla"``), an explicit name (never falls back), or a backend instance such as
        ``gmpo_jax.logits.MosaicGpuLogitsBackend(interpret=True)``.
        ``MosaicGpuLogitsBackend(inplace=True)`` writes ``dlogits`` into the logits' buffer (Liger's
        ``inplace``): half the memory when the logits die with the loss (an intermediate of the same
        jit, or donated with ``donate_argnums``); if they are still live, XLA copies them first. It
        does not batch under ``jax.vmap`` (the default backend does).

    Returns:
      ``(loss, aux)``: ``loss`` a float32 scalar, ``aux`` a :class:`LossAux` of float32 scalars (no
      gradient). The gradient with respect to ``logits`` has the logits' shape and dtype (zero at the
      dropped last position). Reverse mode only (a ``jax.custom_vjp``: no ``jax.jvp`` / ``jacfwd``).

    Raises:
      TypeError: non-floating logits / advantages / log-probs; non-integer ids or segment_ids; a non-objective;
        a ``num_items_in_batch`` that is not a real scalar (a bool, a string, a list, a vector).
      ValueError:
        - inconsistent shapes (the argument named); an empty ``B``, ``T`` or ``V``;
        - a concrete ``temperature`` not finite and ``> 0``; a concrete mask with values other than 0 / 1;
        - a concrete unmasked id outside ``[0, V)``;
        - an objective with a KL term (``objective.has_kl``: its ``beta`` non-zero or traced when it was
          built, kept by ``jax.tree.map``) without ``ref_logps``;
        - a concrete ``num_items_in_batch`` not finite and ``>= 1`` (dapo / cispo); concrete non-finite
          ``advantages``; concrete negative
          ``segment_ids``; a concrete ``rollout_is_ratio`` not finite and ``>= 0``;
        - ``old_logps`` / ``ref_logps`` / ``rollout_logps`` NaN at an unmasked token (concrete; the error names
          the first ``(b, t)``);
        - an unknown ``rollout_is_mode`` or a concrete ``rollout_is_cap <= 0``, or either without
          ``rollout_logps``;
        - ``top_entropy_quantile`` outside ``(0, 1]``; a concrete non-finite ``entropy_coef``;
        - an unknown ``implementation`` (this path's are ``"xla"`` and ``"mosaic_gpu"``).
      UnsupportedConfigError / BackendUnavailableError: an explicitly requested implementation cannot
        serve this call (e.g. ``"mosaic_gpu"`` without a Hopper GPU, a dtype other than bf16 / f16 /
        f32, or rows of logits that the kernels' 128-byte tiles cannot cover, see
        ``MosaicGpuLogitsBackend._split``).

    References: GMPO, arXiv 2507.20673; Liger-Kernel ``triton_grpo_loss``; TRL ``GRPOTrainer``.

    Example:
      >>> import jax, jax.numpy as jnp, gmpo_jax
      >>> logits = jax.random.normal(jax.random.key(0), (2, 4, 11))  # [B, T + 1, V]
      >>> ids = jnp.array([[1, 2, 3], [4, 5, -100]]); mask = ids >= 0
      >>> loss, aux = gmpo_jax.policy_loss_from_logits(logits, ids, mask, jnp.array([1.0, -0.5]),
      ...                                              objective=gmpo_jax.GMPO())
      >>> float(loss)  # on-policy: -mean_b A_b * exp(0)
      -0.25
      >>> jax.grad(lambda z: gmpo_jax.policy_loss_from_logits(
      ...     z, ids, mask, jnp.array([1.0, -0.5]), objective=gmpo_jax.GMPO())[0])(logits).shape
      (2, 4, 11)
    """
    token_args = V_.token_args(locals())
    B, T, Tl, V = _check_inputs(logits, token_args)
    V_.check_top_entropy_quantile(top_entropy_quantile)
    inputs = V_.policy_inputs(**token_args)
    logits = jnp.asarray(logits)
    threshold = None
    if top_entropy_quantile != 1.0:
        entropy, _ = entropy_and_lse(jax.lax.stop_gradient(logits), T, inputs.temperature)
        select, threshold = high_entropy_tokens(entropy, inputs.mask, top_entropy_quantile)
        inputs = inputs._replace(token_select=select)
    backend = backend_lib.resolve(implementation, dtype=logits.dtype, B=B, T=T, Tl=Tl, V=V)
    with jax.named_scope(f"gmpo_jax/{backend.name}/policy_loss_from_logits"):
        loss, aux = logits_policy_loss(LogitsConfig(backend=backend, T=T), objective, logits, inputs)
    if threshold is None:
        return loss, aux
    return loss, aux._replace(entropy_threshold=threshold, entropy=token_mean(entropy, inputs.mask))
