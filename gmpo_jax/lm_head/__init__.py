"""The fused LM-head op: ``[tokens, hidden] x [hidden, vocab]`` and the policy loss, never the logits.

Data flow: ``api.py`` (check -> inputs pytree -> config -> dispatch) -> ``vjp.py`` (one custom VJP per
function: chunk scan, gradients as residuals, optional mesh plan from ``sharding.py``) -> a backend of
the seam in ``backend.py``: ``xla_chunked.py`` (portable) or ``mosaic_gpu.py`` (Pallas kernels in
``gmpo_jax/kernels/``).
"""

from gmpo_jax.lm_head.api import fused_linear_logprobs, fused_linear_policy_loss


def __getattr__(name):  # the backend classes import their kernels lazily
    if name == "MosaicGpuBackend":
        from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend

        return MosaicGpuBackend
    if name == "XlaChunkedBackend":
        from gmpo_jax.lm_head.xla_chunked import XlaChunkedBackend

        return XlaChunkedBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["fused_linear_policy_loss", "fused_linear_logprobs", "MosaicGpuBackend", "XlaChunkedBackend"]
