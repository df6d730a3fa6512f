"""Trace-time input checks (every error names the argument, or the field as ``batch.old_logps``, and what was
expected), and the checked :class:`~gmpo_jax.PolicyBatch` normalised into the one pytree the custom VJPs take
(:func:`policy_inputs`).

``arguments``: types, shapes, dtypes and static options; ``values``: checks of concrete data; ``inputs``: each
op's arguments as a whole and their normalisation. :func:`check_num_items` (and its warn-once state) lives here.
"""

from __future__ import annotations

import os
import sys
import warnings

from gmpo_jax._validation.arguments import (  # noqa: F401
    LOGITS_PRECISIONS,
    WEIGHT_LAYOUTS,
    _concrete,
    _dtype,
    _shape,
    check_chunk_size,
    check_ids,
    check_lm_head,
    check_logits_precision,
    check_softcap,
    check_temperature,
    check_vocab_size,
    grad_filter_threshold,
    require_float,
    require_rank,
    require_shape,
)
from gmpo_jax._validation.inputs import (  # noqa: F401
    _f32,
    as_ids,
    as_mask,
    as_segments,
    check_batch,
    check_logits_inputs,
    check_objective,
    check_policy_inputs,
    check_reference,
    policy_inputs,
    reference_error,
    require_batch,
)
from gmpo_jax._validation.values import (  # noqa: F401
    check_ids_in_range,
    check_mask,
    check_not_nan_unmasked,
    check_segment_ids,
)
from gmpo_jax.objectives import Objective, PolicyInputs  # noqa: F401

NUM_ITEMS_LOSS_TYPES = ("dapo", "cispo")  # the loss types whose normaliser num_items_in_batch overrides
_warned_ignored_num_items: set[str] = set()  # loss types already warned about (once per process each)


def check_num_items(num_items_in_batch, objective) -> None:
    """A concrete ``num_items_in_batch`` must be ``>= 1`` (NaN fails too): it counts the unmasked tokens of an
    accumulation window that holds this call's, so 0 (or 0.5) would silently become the normaliser 1. Any
    real ``>= 1`` is accepted (TRL passes an int count; a per-process share ``count / processes`` is not
    integral). Traced it cannot be checked: the normaliser is ``max(n, 1)``. Given to a loss type that
    ignores it (gmpo, grpo, bnpo, dr_grpo, sapo) it warns once per loss type and process: generic
    trainers pass it for every loss type (the Hugging Face ``Trainer`` hands ``num_items_in_batch`` to
    every ``compute_loss``; TRL's GRPO trainer then uses it for dapo only), and it changes nothing there."""
    value = _concrete(num_items_in_batch)
    if value is not None and not float(value) >= 1:
        raise ValueError(
            "batch.num_items_in_batch must be >= 1 (the number of unmasked completion tokens in the optimizer "
            "step's accumulation window; None: this call's own count), got "
            f"batch.num_items_in_batch={float(value)!r}"
        )
    loss_type = objective.loss_type
    if loss_type not in NUM_ITEMS_LOSS_TYPES and loss_type not in _warned_ignored_num_items:
        _warned_ignored_num_items.add(loss_type)
        warnings.warn(
            f"num_items_in_batch is ignored by loss_type={loss_type!r}: only {NUM_ITEMS_LOSS_TYPES} normalise by "
            f"it ({loss_type!r} has its own normaliser, see LossAux.loss_denominator); warned once per loss type",
            UserWarning,
            stacklevel=_caller_stacklevel(),
        )


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside the ``gmpo_jax`` package (the caller's line, whatever the
    depth of the checks in between)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level
