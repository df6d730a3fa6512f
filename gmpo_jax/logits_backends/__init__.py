"""Backends of :func:`gmpo_jax.policy_loss_from_logits` and their dispatch.

A backend computes, over logits ``[B, Tl, V]`` (``Tl = T`` or ``T + 1``; only the first ``T`` positions
count), the two memory-bound passes of the loss; the objective math lives in ``gmpo_jax.objectives``::

    logprobs(logits, ids, *, T, temperature) -> (logp [B, T] f32, residual)
        # logp = z[id] - logsumexp(z), z = logits[:, :T] / temperature in f32 (one read of the logits)
    dlogits(logits, ids, residual, dlogp [B, T] f32, *, T, temperature) -> [B, Tl, V] logits.dtype
        # dlogp / temperature * (onehot(id) - softmax(z)); rows t >= T and rows with dlogp == 0 are 0
    check_supported(*, dtype, B, T, Tl, V)   # raises UnsupportedConfigError / BackendUnavailableError

Dispatch as in ``gmpo_jax.backends.base``: ``implementation=None`` tries ``"mosaic_gpu"`` (Hopper GPUs)
then ``"xla"``; an explicit name never falls back. A backend *instance* may be passed too (e.g.
``MosaicGpuLogitsBackend(interpret=True)`` to run the kernels in the Pallas interpreter on CPU).
"""

from __future__ import annotations

import importlib
import logging
import warnings

from gmpo_jax.backends.base import BackendUnavailableError, UnsupportedConfigError

__all__ = ["IMPLEMENTATIONS", "resolve"]

logger = logging.getLogger("gmpo_jax")

# Ordered: the default dispatch tries them in this order. Each module defines ``make_backend()``.
IMPLEMENTATIONS: dict[str, str] = {
    "mosaic_gpu": "gmpo_jax.logits_backends.mosaic_gpu",
    "xla": "gmpo_jax.logits_backends.xla",
}


def _make(name: str):
    try:
        module = importlib.import_module(IMPLEMENTATIONS[name])
    except ImportError as e:  # e.g. a jax build without Pallas Mosaic GPU
        raise BackendUnavailableError(f"implementation={name!r} cannot be imported: {e}") from e
    return module.make_backend()


def resolve(implementation, **config):
    """The backend for one call; ``config`` (dtype, B, T, Tl, V) goes to ``check_supported``.

    Raises:
      ValueError: unknown implementation name.
      UnsupportedConfigError / BackendUnavailableError: an explicit implementation cannot serve.
    """
    if implementation is not None and not isinstance(implementation, str):
        implementation.check_supported(**config)  # a backend instance: explicit, never falls back
        return implementation
    if implementation is not None:
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be None, one of {tuple(IMPLEMENTATIONS)} or a backend "
                             f"instance, got implementation={implementation!r}")
        backend = _make(implementation)
        backend.check_supported(**config)
        logger.info("gmpo_jax: policy_loss_from_logits implementation=%s (explicit)", implementation)
        return backend
    for name in IMPLEMENTATIONS:
        try:
            backend = _make(name)
            backend.check_supported(**config)
        except BackendUnavailableError as e:
            logger.debug("gmpo_jax: %s unavailable: %s", name, e)
            continue
        except UnsupportedConfigError as e:
            warnings.warn(f"gmpo_jax: implementation={name!r} cannot serve this call ({e}); falling back.",
                          stacklevel=4)
            continue
        logger.info("gmpo_jax: policy_loss_from_logits implementation=%s", name)
        return backend
    raise BackendUnavailableError("no policy_loss_from_logits implementation can serve this call")
