"""The logits op: the policy loss from ``[B, T(+1), V]`` logits that already exist (memory-bound passes).

Data flow: ``api.py`` (check -> inputs pytree -> dispatch) -> ``vjp.py`` (the custom VJP: log-probs
forward, ``dlogits`` backward, or both in one fused kernel for token-local objectives) -> a backend of
the seam in ``backend.py``: ``xla.py`` (portable) or ``mosaic_gpu.py`` (Pallas kernels in
``gmpo_jax/kernels/``).
"""

from gmpo_jax.logits.api import policy_loss_from_logits


def __getattr__(name):  # the backend classes import their kernels lazily
    if name == "MosaicGpuLogitsBackend":
        from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend

        return MosaicGpuLogitsBackend
    if name == "XlaLogitsBackend":
        from gmpo_jax.logits.xla import XlaLogitsBackend

        return XlaLogitsBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["policy_loss_from_logits", "MosaicGpuLogitsBackend", "XlaLogitsBackend"]
