"""Pallas Mosaic GPU backend of the LM head (Hopper and newer): ``gmpo_jax.kernels`` behind the backend seam.

One role per module:

* ``adapter``: :class:`MosaicGpuBackend`, the frozen dataclass the dispatcher resolves (``check_supported``,
  ``logprobs``, ``logprobs_for_grads``, ``grads``);
* ``grad_pass``: the gradient pass over vocabulary windows (``dz`` by the kernel or from kept logits, then
  ``dh``, ``dW``, ``db`` by XLA GEMMs with float32 accumulation; bitwise deterministic);
* ``grad_filter``: the gradient filter (``grad_filter``) as a plan that the pass executes, and its correction;
* ``kept_logits``: how many logits tiles a single chunk keeps for the gradient pass, and ``dz`` from them;
* ``precision``: the kernels' operands, plain 16-bit or split into bfloat16 parts (``logits_precision``);
* ``layout``: block sizes, row padding, the weight as the bulk copies read it, window sizes.

``supported_on`` and ``split_dot`` are looked up on this package at call time, so that replacing them here
(``monkeypatch.setattr(gmpo_jax.lm_head.mosaic_gpu, "supported_on", ...)``) takes effect. Implementation
detail: docs/DESIGN.md.
"""

from gmpo_jax import tuning
from gmpo_jax._device import num_sms, supported_on
from gmpo_jax._dispatch import BackendUnavailableError, UnsupportedConfigError
from gmpo_jax.lm_head import rows as rows_lib
from gmpo_jax.lm_head.backend import (
    LOGITS_PRECISIONS,
    bf16_parts,
    cancel_rounding,
    logits_precision_of,
    num_parts,
    split_dot,
    stored_rowsum,
)
from gmpo_jax.lm_head.mosaic_gpu.adapter import MosaicGpuBackend
from gmpo_jax.lm_head.mosaic_gpu.grad_filter import (
    FilterPlan,
    _dropped_mass,
    _filter_live,
    _filter_sizes,
    _window_mass,
    _window_means,
)
from gmpo_jax.lm_head.mosaic_gpu.grad_pass import _GradPass
from gmpo_jax.lm_head.mosaic_gpu.kept_logits import SavedLogits, _dz_from_saved
from gmpo_jax.lm_head.mosaic_gpu.layout import _aligned, _per_column, _prepare, _vocab, block_config, epilogue_bytes
from gmpo_jax.lm_head.mosaic_gpu.precision import Operands

__all__ = ["MosaicGpuBackend", "supported_on", "block_config"]

_REEXPORTED = (  # the names of the single module this package replaced, importable from it as before
    tuning,
    num_sms,
    BackendUnavailableError,
    UnsupportedConfigError,
    rows_lib,
    LOGITS_PRECISIONS,
    bf16_parts,
    cancel_rounding,
    logits_precision_of,
    num_parts,
    split_dot,
    stored_rowsum,
    FilterPlan,
    _dropped_mass,
    _filter_live,
    _filter_sizes,
    _window_mass,
    _window_means,
    _GradPass,
    SavedLogits,
    _dz_from_saved,
    _aligned,
    _per_column,
    _prepare,
    _vocab,
    epilogue_bytes,
    Operands,
)
