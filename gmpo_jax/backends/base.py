"""The backend seam: per-chunk LM-head log-probs and gradients, and implementation dispatch.

Every loss in gmpo_jax shares one fused LM-head path (``gmpo_jax.fused_vjp``) that works on chunks of
whole sequences flattened to ``R`` rows. A backend supplies the two LM-head computations on such rows;
the objective math lives elsewhere (``gmpo_jax.objectives``), so a backend never sees a loss.

Dispatch follows tokamax: ``implementation=None`` tries the registered backends in order (Pallas Mosaic
GPU first, then the portable XLA path); a backend that cannot serve a call raises a typed
``NotImplementedError`` subclass and the next one is tried. An explicit ``implementation=`` never falls
back. Which implementation ran is logged on the ``gmpo_jax`` logger and shows in profiles as the
``jax.named_scope`` ``gmpo_jax/<name>``.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Protocol, runtime_checkable

import jax

__all__ = [
    "dispatch",
    "LMHeadBackend",
    "UnsupportedConfigError",
    "BackendUnavailableError",
    "IMPLEMENTATIONS",
    "resolve_backend",
]

logger = logging.getLogger("gmpo_jax")


class UnsupportedConfigError(NotImplementedError):
    """The backend runs on this platform but cannot serve this configuration (shape, dtype, budget).

    The default dispatch (``implementation=None``) falls back to the next backend with one warning; an
    explicit ``implementation=`` re-raises it.
    """


class BackendUnavailableError(NotImplementedError):
    """The backend cannot run on this platform at all (e.g. Mosaic GPU kernels without a Hopper GPU).

    The default dispatch falls back silently; an explicit ``implementation=`` re-raises it.
    """


@runtime_checkable
class LMHeadBackend(Protocol):
    """Per-chunk LM-head computations (rows = flattened tokens of a chunk).

    ``z = (hidden @ W + bias) / temperature`` in float32, ``W`` being ``[H, V]`` for
    ``weight_layout="hv"`` and ``[V, H]`` (used as ``W^T``) for ``"vh"``. Implementations must be
    hashable (they are static arguments of the custom VJP) and bitwise deterministic.
    """

    name: str

    def check_supported(self, *, hidden_dtype, weight_dtype, H: int, V: int, rows: int,
                        weight_layout: str, has_bias: bool, with_entropy: bool = False) -> None:
        """Raise ``UnsupportedConfigError`` / ``BackendUnavailableError`` if this call cannot be served."""

    def logprobs(self, hidden, weight, bias, ids, temperature, *, weight_layout, with_entropy=False):
        """``(logp [R] f32, lse [R] f32)`` with ``logp = z[id] - logsumexp(z)``; NaN for ids outside [0, V).

        With ``with_entropy``, a third output: the softmax entropy ``lse - sum_v p_v z_v`` ``[R]`` f32."""

    def grads(self, hidden, weight, bias, ids, dlogp, lse, temperature, *, weight_layout, dw_acc, db_acc):
        """``(dhidden [R, H] hidden.dtype, dw_acc, db_acc)`` for ``dz = dlogp (onehot(id) - softmax(z)) / T``.

        ``dw_acc`` (float32, ``weight.shape``) and ``db_acc`` (float32 ``[V]`` or None) are accumulated
        into and returned: ``dw_acc + hidden^T dz`` (laid out like the weight), ``db_acc + sum_rows dz``.
        ``dw_acc=None`` (a call of one chunk): return ``hidden^T dz`` itself (float32, or the weight's
        dtype after ``logprobs_for_grads`` kept the logits).

        Optional extension: a backend may also define ``logprobs_for_grads(hidden, weight, bias, ids,
        temperature, *, weight_layout, budget_bytes) -> (logp, lse, saved)``, keeping what its gradient
        pass can reuse within ``budget_bytes`` of device memory (``saved`` None when it keeps nothing);
        ``grads`` then gets ``saved=`` (only when it is not None). ``gmpo_jax.backends.mosaic_gpu`` keeps
        the logits.
        """


# Ordered: the default dispatch tries them in this order. Each module defines ``make_backend(**kw)``.
IMPLEMENTATIONS: dict[str, str] = {
    "mosaic_gpu": "gmpo_jax.backends.mosaic_gpu",
    "xla_chunked": "gmpo_jax.backends.xla_chunked",
}


def _make(registry: dict[str, str], name: str):
    module_path = registry[name]
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:  # e.g. a jax build without Pallas Mosaic GPU
        raise BackendUnavailableError(f"implementation={name!r} cannot be imported: {e}") from e
    return module.make_backend()


def dispatch(implementation, registry: dict[str, str], what: str, **config):
    """Pick a backend from ``registry`` (ordered name -> module path); shared by every op's dispatch.

    ``implementation`` is None (try the registry in order: a ``BackendUnavailableError`` falls through
    silently, an ``UnsupportedConfigError`` with one warning), a registered name (explicit: never falls
    back) or a backend instance (explicit, e.g. a kernel backend in interpret mode for tests). ``config``
    goes to ``check_supported``; ``what`` names the op in logs and errors.

    Raises:
      ValueError: unknown ``implementation`` name.
      UnsupportedConfigError / BackendUnavailableError: an explicitly requested backend cannot serve.
    """
    if implementation is not None and not isinstance(implementation, str):
        if not callable(getattr(implementation, "check_supported", None)):
            raise TypeError(f"implementation must be None, a name in {tuple(registry)} or a backend instance, "
                            f"got implementation={implementation!r}")
        implementation.check_supported(**config)
        logger.info("gmpo_jax: %s implementation=%r (explicit instance)", what, implementation)
        return implementation
    if implementation is not None:
        if implementation not in registry:
            raise ValueError(f"implementation must be None, one of {tuple(registry)} or a backend instance, "
                             f"got implementation={implementation!r}")
        backend = _make(registry, implementation)
        backend.check_supported(**config)
        logger.info("gmpo_jax: %s implementation=%s (explicit)", what, implementation)
        return backend
    for name in registry:
        try:
            backend = _make(registry, name)
            backend.check_supported(**config)
        except BackendUnavailableError as e:
            logger.debug("gmpo_jax: %s %s unavailable: %s", what, name, e)
            continue
        except UnsupportedConfigError as e:
            warnings.warn(f"gmpo_jax: {what} implementation={name!r} cannot serve this call ({e}); "
                          "falling back.", stacklevel=5)
            continue
        logger.info("gmpo_jax: %s implementation=%s", what, name)
        return backend
    raise BackendUnavailableError(f"no {what} implementation can serve this call")


def resolve_backend(implementation, **config) -> LMHeadBackend:
    """The LM-head backend for a call (see :func:`dispatch`); ``config`` goes to ``check_supported``."""
    return dispatch(implementation, IMPLEMENTATIONS, "fused LM head", **config)


def default_platform() -> str:
    return jax.default_backend()
