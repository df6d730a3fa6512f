"""The logits backend seam: the memory-bound passes of :func:`gmpo_jax.policy_loss_from_logits`, and its registry.

A backend computes, over logits ``[B, Tl, V]`` (``Tl = T`` or ``T + 1``; only the first ``T`` positions
count), the two memory-bound passes of the loss; the objective math lives in ``gmpo_jax.objectives``::

    logprobs(logits, ids, *, T, temperature, mask) -> (logp [B, T] f32, residual)
        # logp = z[id] - logsumexp(z), z = logits[:, :T] / temperature in f32 (one read of the logits);
        # mask [B, T] bool (always passed): a backend may skip masked rows (their logp is then 0: the
        # objective ignores it)
    dlogits(logits, ids, residual, dlogp [B, T] f32, *, T, temperature) -> [B, Tl, V] logits.dtype
        # dlogp / temperature * (onehot(id) - softmax(z)); rows t >= T and rows with dlogp == 0 are 0
    check_supported(*, dtype, B, T, Tl, V)   # raises UnsupportedConfigError / BackendUnavailableError

Optional (``mosaic_gpu``; declared as ``Capabilities(fused_dlogits=True)``), for token-local objectives under
differentiation::

    fused_plan(*, dtype, R, V) -> plan or None       # None: use the two methods above
    logprobs_and_dlogits(logits, ids, *, T, temperature, objective, old_logps, ref_logps, advantages,
                         rollout_is_ratio, weights, mask, id_ok)
        -> (logp [B, T] f32, loss f32 scalar, dlogits for a unit cotangent)

Dispatch (``gmpo_jax._dispatch``): ``implementation=None`` tries ``"mosaic_gpu"`` (Hopper GPUs)
then ``"xla"``; an explicit name never falls back. A backend *instance* may be passed too (e.g.
``MosaicGpuLogitsBackend(interpret=True)`` to run the kernels in the Pallas interpreter on CPU).
"""

from __future__ import annotations

import dataclasses

from gmpo_jax._dispatch import dispatch

__all__ = ["IMPLEMENTATIONS", "Capabilities", "capabilities", "resolve"]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a logits backend offers beyond the required seam, declared as its class attribute ``capabilities``
    (a backend that declares none has none).

    Attributes:
      fused_dlogits: it has ``fused_plan`` and ``logprobs_and_dlogits`` (token-local objectives' ``dlogits``
        written in the forward).
    """

    fused_dlogits: bool = False


def capabilities(backend) -> Capabilities:
    """The backend's declared :class:`Capabilities` (none when it declares none)."""
    return getattr(type(backend), "capabilities", _NONE)


_NONE = Capabilities()

# Ordered: the default dispatch tries them in this order; "module.path:ClassName", built with its defaults.
IMPLEMENTATIONS: dict[str, str] = {
    "mosaic_gpu": "gmpo_jax.logits.mosaic_gpu:MosaicGpuLogitsBackend",
    "xla": "gmpo_jax.logits.xla:XlaLogitsBackend",
}


def resolve(implementation, **config):
    """The backend for one call; ``config`` (dtype, B, T, Tl, V) goes to ``check_supported``.

    Raises:
      ValueError: unknown implementation name.
      UnsupportedConfigError / BackendUnavailableError: an explicit implementation cannot serve.
    """
    return dispatch(
        implementation, IMPLEMENTATIONS, "policy_loss_from_logits", required=("logprobs", "dlogits"), **config
    )
