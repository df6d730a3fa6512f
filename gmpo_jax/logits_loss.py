"""The policy loss from logits that already exist: validate -> dispatch -> one custom VJP.

Design decisions of the custom VJP (and why):

* **One memory-bound pass forward, one backward.** The forward reads the
  logits once (online log-sum-exp and the target logit per row, in float32), then runs the objective on
  the ``[B, T]`` log-probs. The backward reads them once more and writes ``dlogits`` once. For GMPO and
  GSPO the gradient cannot be written during the first read: a token's ``d loss / d logp`` depends on
  reductions over its whole sequence (the geometric mean, the sequence ratio), and one row of Llama-3
  logits (250 KB) does not stay on chip until they are known.
* **Token-local objectives fuse.** For the GRPO family at token level, CISPO and SAPO, a token's
  ``d loss / d logp`` is a function of its own log-prob and of data known beforehand
  (``objective.token_local``; its ``token_loss`` and ``token_weights``). A backend with
  ``logprobs_and_dlogits`` (``mosaic_gpu``) then writes ``dlogits`` for a unit cotangent in the forward of
  the VJP, in the same kernel that computes each row's log-sum-exp and each token's weighted loss (each
  row read from device memory once, kept on chip for the second pass, and written once); the residual
  is that array and the backward multiplies it by the cotangent (with ``jax.grad``'s constant 1 XLA
  drops the multiply; another cotangent, e.g. a scaled loss, rounds the bf16 gradient twice: about one
  ulp instead of half an ulp). The hyper-parameters must be concrete (they are compiled into the
  kernel); traced ones take the general path. Float16 logits keep the general path: their stored
  unit-cotangent gradient would lose small entries to subnormals before a loss scale could lift them.
* **Gradient scale in the forward, logits pass in the backward** (the general path). The forward of the
  VJP computes the loss and ``d loss / d logp`` (``jax.grad`` of the objective's numerator over the whole
  batch, whose selects implement SPEC.md's strict boundary rule) and keeps as residuals only
  ``[B, T]``-sized arrays plus a reference to the logits (no copy). The backward multiplies
  ``d loss / d logp`` by the cotangent and writes ``dlogits = dlogp * (onehot - softmax(z / tau)) / tau``
  in the logits' dtype in one pass; for ``[B, T + 1, V]`` logits the last position's gradient is written
  as zeros by the same pass (no padding or concatenation of a ``[B, T, V]`` array). Plain evaluation
  (no gradient) runs only the forward read and the objective, on every path.
* **Masked tokens.** Their ids are replaced by 0 before the logits pass (any id, e.g. -100 or >= V, is
  allowed under the mask); the objective selects them out and their ``dlogits`` rows are selected to
  exactly zero, whatever the logits hold there. An *unmasked* id outside ``[0, V)`` raises when the
  ids and mask are concrete, and gives NaN under jit.
* **Cotangents.** Only ``logits`` gets a gradient; advantages, old / reference log-probs, the IS ratio,
  the temperature and the objective's hyper-parameters are data (zero cotangents), as in TRL / Liger.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Num

from gmpo_jax import _validation as V_
from gmpo_jax import logits_backends
from gmpo_jax.api import LossAux, _as_ids, _as_mask, _f32, _rollout_is_ratio
from gmpo_jax.objectives import ChunkData, Objective, _concrete_value as _concrete_float, finalize_metrics

__all__ = ["policy_loss_from_logits"]

ScalarLike = Union[float, Float[Array, ""]]


def _check_inputs(*, logits, completion_ids, completion_mask, advantages, objective, old_logps, ref_logps,
                  rollout_is_ratio, num_items_in_batch, temperature) -> tuple[int, int, int, int]:
    """All argument checks (trace time, named errors); returns (B, T, Tl, V) with ``Tl`` = T or T + 1."""
    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be a GMPO, GRPO, CISPO or SAPO instance, got objective={objective!r}")
    V_.require_rank("logits", logits, 3, "[B, T + 1, V] or [B, T, V]")
    V_.require_float("logits", logits)
    V_.require_rank("completion_ids", completion_ids, 2, "[B, T]")
    B, T = np.shape(completion_ids)
    _, Tl, V = np.shape(logits)
    if B < 1 or T < 1 or V < 1:
        raise ValueError(f"completion_ids [B, T] and logits [B, T(+1), V] must be non-empty, got "
                         f"completion_ids.shape={np.shape(completion_ids)}, logits.shape={np.shape(logits)}")
    if np.shape(logits)[0] != B or Tl not in (T, T + 1):
        raise ValueError(f"logits must have shape [B, T + 1, V] or [B, T, V] with B, T = {(B, T)} (from "
                         f"completion_ids), got logits.shape={np.shape(logits)}")
    V_.check_ids(completion_ids, B, T)
    V_.check_mask(completion_mask, B, T)
    V_.check_ids_in_range(completion_ids, completion_mask, V)
    V_.require_shape("advantages", advantages, (B,), "[B]")
    V_.require_float("advantages", advantages)
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if x is not None:
            V_.require_shape(name, x, (B, T), "[B, T]")
            V_.require_float(name, x)
    if rollout_is_ratio is not None:
        if np.shape(rollout_is_ratio) not in ((B, T), (B, 1), (B,)):
            raise ValueError(
                f"rollout_is_ratio must have shape [B, T], [B, 1] or [B] = {(B, T)}, {(B, 1)} or {(B,)}, "
                f"got rollout_is_ratio.shape={np.shape(rollout_is_ratio)}")
        V_.require_float("rollout_is_ratio", rollout_is_ratio)
    if objective.requires_reference and ref_logps is None:
        raise ValueError(f"objective.beta={objective.beta!r} != 0 needs a reference: pass ref_logps")
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, bool) or not (isinstance(num_items_in_batch, numbers.Real)
                                                        or np.shape(num_items_in_batch) == ()):
            raise ValueError(f"num_items_in_batch must be a scalar, got {num_items_in_batch!r}")
        if isinstance(num_items_in_batch, numbers.Real) and num_items_in_batch < 0:
            raise ValueError(f"num_items_in_batch must be >= 0, got num_items_in_batch={num_items_in_batch!r}")
    V_.check_temperature(temperature)
    return B, T, Tl, V


@dataclasses.dataclass(frozen=True)
class _Config:
    backend: Any  # hashable backend instance
    T: int


def _safe_ids(ids, mask, V: int):
    """Ids with the masked positions set to 0, and where they lie in ``[0, V)`` (elsewhere logp is NaN)."""
    safe_ids = jnp.where(mask, ids, 0)
    return safe_ids, (safe_ids >= 0) & (safe_ids < V)


def _objective(objective: Objective, logp, data: ChunkData, num_items, *, with_grads: bool, loss=None):
    """Loss, metrics and (``with_grads``) ``d loss / d logp`` of the objective on the ``[B, T]`` log-probs.

    A token-local objective's loss is one weighted sum, ``sum_{b,t} token_weights * token_loss`` (the
    function whose gradient the fused kernel writes): a single reduction after the logits pass instead
    of the per-sequence and batch reductions and the division of ``chunk_numerator / denominator``
    (measured on the H200: four small kernels after the fused one become two). Its ``loss_numerator``
    is ``loss * loss_denominator``; the metrics come from ``chunk_numerator``'s sums (XLA drops them
    when unused). ``loss``: that sum, already formed (the fused kernel writes each token's term), so
    that no ``[B, T]`` pass recomputes it (token-local objectives, ``with_grads=False`` only).
    """
    mask = data.mask
    denom = objective.denominator(mask, num_items).astype(jnp.float32)
    with jax.named_scope("gmpo_jax/objective"):
        if objective.token_local:
            weights = objective.token_weights(mask, num_items)
            adv = data.advantages.astype(jnp.float32)[:, None]

            def total(lp):
                tl = objective.token_loss(lp, data.old_logps, data.ref_logps, adv, data.rollout_is_ratio, mask=mask)
                return jnp.sum(jnp.where(mask, weights * tl, 0.0))

            if with_grads:
                assert loss is None
                loss, g = jax.value_and_grad(total)(logp)
                dlogp = jnp.where(mask, g, 0.0)
            else:
                loss, dlogp = total(logp) if loss is None else loss, None
            _, sums = objective.chunk_numerator(jax.lax.stop_gradient(logp), data)
            num = loss * denom
        elif with_grads:
            (num, sums), g = jax.value_and_grad(lambda lp: objective.chunk_numerator(lp, data), has_aux=True)(logp)
            dlogp = jnp.where(mask, g / denom, 0.0)
            loss = num / denom
        else:
            num, sums = objective.chunk_numerator(logp, data)
            dlogp, loss = None, num / denom
    aux = dict(loss_numerator=num, loss_denominator=denom, **finalize_metrics(sums, mask))
    return loss, aux, dlogp


def _run(cfg: _Config, objective: Objective, logits, ids, mask, adv, old, ref, ris, num_items, temperature, *,
         with_grads: bool):
    safe_ids, id_ok = _safe_ids(ids, mask, logits.shape[-1])
    logp, residual = cfg.backend.logprobs(logits, safe_ids, T=cfg.T, temperature=temperature)
    logp = jnp.where(id_ok, logp, jnp.nan)
    loss, aux, dlogp = _objective(objective, logp, ChunkData(mask, adv, old, ref, ris), num_items,
                                  with_grads=with_grads)
    return loss, aux, (safe_ids, residual, dlogp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _policy_loss(cfg, objective, logits, ids, mask, adv, old, ref, ris, num_items, temperature):
    loss, aux, _ = _run(cfg, objective, logits, ids, mask, adv, old, ref, ris, num_items, temperature,
                        with_grads=False)
    return loss, aux


def _fused(cfg: _Config, objective: Objective, logits) -> bool:
    """Whether the forward of the VJP writes ``dlogits`` itself (token-local objective, concrete
    hyper-parameters, a backend with ``logprobs_and_dlogits`` whose ``fused_plan`` accepts the shape)."""
    plan = getattr(cfg.backend, "fused_plan", None)
    if plan is None or not objective.token_local:
        return False
    if any(_concrete_float(leaf) is None for leaf in jax.tree.leaves(objective)):
        return False
    B, Tl, V = logits.shape
    return plan(dtype=logits.dtype, R=B * Tl, V=V) is not None


def _run_fused(cfg, objective, logits, ids, mask, adv, old, ref, ris, num_items, temperature):
    safe_ids, id_ok = _safe_ids(ids, mask, logits.shape[-1])
    logp, loss, dlogits = cfg.backend.logprobs_and_dlogits(
        logits, safe_ids, T=cfg.T, temperature=temperature, objective=objective, old_logps=old, ref_logps=ref,
        advantages=adv, rollout_is_ratio=ris, weights=objective.token_weights(mask, num_items), mask=mask,
        id_ok=id_ok)
    logp = jnp.where(id_ok, logp, jnp.nan)
    loss, aux, _ = _objective(objective, logp, ChunkData(mask, adv, old, ref, ris), num_items, with_grads=False,
                              loss=loss)
    return loss, aux, dlogits


def _policy_loss_fwd(cfg, objective, logits, ids, mask, adv, old, ref, ris, num_items, temperature):
    if _fused(cfg, objective, logits):
        loss, aux, dlogits = _run_fused(cfg, objective, logits, ids, mask, adv, old, ref, ris, num_items,
                                        temperature)
        return (loss, aux), (dlogits,)
    loss, aux, (safe_ids, residual, dlogp) = _run(cfg, objective, logits, ids, mask, adv, old, ref, ris,
                                                  num_items, temperature, with_grads=True)
    return (loss, aux), (logits, safe_ids, residual, dlogp, temperature)


def _policy_loss_bwd(cfg, res, cotangents):
    g, _ = cotangents  # the metrics carry no gradient
    if len(res) == 1:  # fused: dlogits of a unit cotangent (XLA drops the multiply when g is the constant 1)
        (unit,) = res
        dlogits = (unit.astype(jnp.float32) * g.astype(jnp.float32)).astype(unit.dtype)
        return (None, dlogits, None, None, None, None, None, None, None, None)
    logits, safe_ids, residual, dlogp, temperature = res
    dlogits = cfg.backend.dlogits(logits, safe_ids, residual, dlogp * g.astype(jnp.float32), T=cfg.T,
                                  temperature=temperature)
    return (None, dlogits, None, None, None, None, None, None, None, None)


_policy_loss.defvjp(_policy_loss_fwd, _policy_loss_bwd)


def policy_loss_from_logits(
    logits: Union[Float[Array, "B T+1 V"], Float[Array, "B T V"]],
    completion_ids: Int[Array, "B T"],
    completion_mask: Num[Array, "B T"] | Bool[Array, "B T"],
    advantages: Float[Array, " B"],
    *,
    objective: Objective,
    old_logps: Optional[Float[Array, "B T"]] = None,
    ref_logps: Optional[Float[Array, "B T"]] = None,
    rollout_is_ratio: Optional[Array] = None,
    num_items_in_batch: Optional[ScalarLike] = None,
    temperature: ScalarLike = 1.0,
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
      advantages: ``[B]`` float, one per completion (group-normalised by the caller).
      objective: ``GMPO(...)``, ``GRPO(...)``, ``CISPO(...)`` or ``SAPO(...)`` with its hyper-parameters.
      old_logps: ``[B, T]`` float behaviour-policy log-probs; None = on-policy (``old = sg(logp)``).
      ref_logps: ``[B, T]`` float reference log-probs for the KL term (needed when ``beta != 0``).
      rollout_is_ratio: ``[B, T]``, ``[B, 1]`` or ``[B]`` inference-engine importance-sampling correction
        (Liger's ``vllm_is_ratio``); multiplies the per-token policy loss. Ignored by GMPO (with a
        warning), as SPEC.md defines.
      num_items_in_batch: scalar, total active tokens of the whole generation batch: the dapo / cispo
        normaliser override. Ignored by the other loss types.
      temperature: ``> 0`` sampling temperature dividing the logits (float or traced scalar).
      implementation: None (``"mosaic_gpu"`` on Hopper-or-newer GPUs when it can serve the call, else
        ``"xla"``), an explicit name (never falls back), or a backend instance such as
        ``gmpo_jax.logits_backends.mosaic_gpu.MosaicGpuLogitsBackend(interpret=True)``.
        ``MosaicGpuLogitsBackend(inplace=True)`` writes ``dlogits`` into the logits' buffer (Liger's
        ``inplace``): half the memory when the logits die with the loss (an intermediate of the same
        jit, or donated with ``donate_argnums``); if they are still live, XLA copies them first. It
        does not batch under ``jax.vmap`` (the default backend does).

    Returns:
      ``(loss, aux)``: ``loss`` a float32 scalar, ``aux`` a :class:`LossAux` of float32 scalars (no
      gradient). The gradient with respect to ``logits`` has the logits' shape and dtype (zero at the
      dropped last position). Reverse mode only (a ``jax.custom_vjp``: no ``jax.jvp`` / ``jacfwd``).

    Raises:
      TypeError: non-floating logits / advantages / log-probs, non-integer ids, a non-objective.
      ValueError: inconsistent shapes (named), an empty ``B``, ``T`` or ``V``, a concrete ``temperature``
        not finite and ``> 0``, a concrete mask with values other than 0 / 1, a concrete unmasked id
        outside ``[0, V)``, a concrete ``beta != 0`` without ``ref_logps``, an unknown ``implementation`` (this path's are ``"xla"`` and
        ``"mosaic_gpu"``).
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
    B, T, Tl, V = _check_inputs(
        logits=logits, completion_ids=completion_ids, completion_mask=completion_mask, advantages=advantages,
        objective=objective, old_logps=old_logps, ref_logps=ref_logps, rollout_is_ratio=rollout_is_ratio,
        num_items_in_batch=num_items_in_batch, temperature=temperature)
    mask = _as_mask(completion_mask)
    ids = _as_ids(completion_ids)
    f32 = _f32
    ris = _rollout_is_ratio(objective, rollout_is_ratio)
    logits = jnp.asarray(logits)
    backend = logits_backends.resolve(implementation, dtype=logits.dtype, B=B, T=T, Tl=Tl, V=V)
    cfg = _Config(backend=backend, T=T)
    with jax.named_scope(f"gmpo_jax/{backend.name}/policy_loss_from_logits"):
        loss, aux = _policy_loss(cfg, objective, logits, ids, mask, f32(advantages), f32(old_logps),
                                 f32(ref_logps), ris, f32(num_items_in_batch),
                                 jnp.asarray(temperature, jnp.float32))
    return loss, LossAux(**aux)
