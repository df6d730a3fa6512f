"""Pallas Mosaic GPU kernels of both ops, one kernel per file (``<input>_<stage>.py``, see ``_common``).

* ``lm_head_lse.py``: log-sum-exp statistics of ``hidden @ W`` (logits recomputed with wgmma, never stored);
* ``lm_head_dlogits.py``: ``dlogits`` of a vocabulary window of ``hidden @ W``;
* ``lm_head_dhidden.py`` / ``lm_head_dweight.py``: the gradient GEMMs ``dz W^T`` / ``h^T dz`` of a window on a
  runtime row prefix (``tuning.ROW_PREFIX_GRADIENT``);
* ``logits_lse.py``: log-sum-exp statistics of logits that already exist;
* ``logits_dlogits.py``: ``dlogits`` of logits that already exist;
* ``logits_fused.py``: both passes over each row of existing logits, with the token loss, in one kernel;
* ``_common.py``: the shared Mosaic helpers (constants, transforms, splits, merges, the logits kernels' blocks);
  ``_lm_head_pipeline.py``: the LM-head kernels' blocks, logits-tile pipeline, grids and launch;
  ``_compat.py``: the jax 0.10.2 / 0.11.2 shim.

The backends (``gmpo_jax.lm_head.mosaic_gpu``, ``gmpo_jax.logits.mosaic_gpu``) call the entry
points re-exported here.
"""

from gmpo_jax.kernels._common import (
    BLOCK_ROWS,
    LN2,
    LOG2E,
    LogitsBlocks,
    logits_num_splits,
    merge_splits,
    row_block_flags,
)
from gmpo_jax.kernels._lm_head_pipeline import LMHeadBlocks, RowPrefixGrid, lm_head_num_splits
from gmpo_jax.kernels.lm_head_dlogits import lm_head_dlogits_window
from gmpo_jax.kernels.lm_head_lse import lm_head_lse_epilogue_bytes, lm_head_lse_partials, lm_head_merge_splits
from gmpo_jax.kernels.logits_dlogits import logits_dlogits
from gmpo_jax.kernels.logits_fused import (
    ROW_WIDTH,
    FusedLogitsBlocks,
    RowData,
    RowStats,
    logits_lse_and_dlogits,
    pack_row_data,
    slab_width,
)
from gmpo_jax.kernels.logits_lse import logits_lse_partials, logits_merge_splits

__all__ = [
    "BLOCK_ROWS",
    "LN2",
    "LOG2E",
    "LMHeadBlocks",
    "RowPrefixGrid",
    "LogitsBlocks",
    "FusedLogitsBlocks",
    "RowData",
    "RowStats",
    "ROW_WIDTH",
    "lm_head_num_splits",
    "logits_num_splits",
    "merge_splits",
    "row_block_flags",
    "lm_head_lse_partials",
    "lm_head_merge_splits",
    "lm_head_lse_epilogue_bytes",
    "lm_head_dlogits_window",
    "logits_lse_partials",
    "logits_merge_splits",
    "logits_dlogits",
    "logits_lse_and_dlogits",
    "pack_row_data",
    "slab_width",
]
