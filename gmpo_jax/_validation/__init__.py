"""Trace-time input checks (every error names the argument, or the field as ``batch.old_logps``, and what was
expected), and the checked :class:`~gmpo_jax.PolicyBatch` normalised into the one pytree the custom VJPs take
(:func:`policy_inputs`).

``arguments``: types, shapes, dtypes and static options; ``values``: checks of concrete data; ``inputs``: each
op's arguments as a whole and their normalisation. :func:`check_num_items`,
:func:`warn_ignored_reference` (and their warn-once state) and :func:`caller_stacklevel` live here.
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings

import jax.numpy as jnp
import numpy as np

from gmpo_jax._validation.arguments import (  # noqa: F401
    LOGITS_PRECISIONS,
    WEIGHT_LAYOUTS,
    _concrete,
    _dtype,
    _shape,
    as_temperature,
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
    check_finite_unmasked,
    check_ids_in_range,
    check_mask,
    check_segment_ids,
)
from gmpo_jax.objectives import Objective, PolicyInputs  # noqa: F401

NUM_ITEMS_LOSS_TYPES = ("dapo", "cispo")  # the loss types whose normaliser num_items_in_batch overrides
_warned_ignored_num_items: set[str] = set()  # loss types already warned about (once per process each)
_warned_ignored_reference: set[str] = set()  # reference arguments already warned about (once per process each)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../gmpo_jax/


def caller_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called by the function that calls this: the first frame
    outside the ``gmpo_jax`` package (the user's call of the public function, also when it is traced by
    ``jax.jit``: the frames of JAX's tracing lie further out), found by walking the stack."""
    frame, level = sys._getframe(1), 1  # level 1: the frame that calls warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _is_real_scalar(x) -> bool:
    """A Python / NumPy real number (not a bool) or a 0-d integer / floating array (traced allowed)."""
    if isinstance(x, (bool, np.bool_, str, bytes)):
        return False
    if isinstance(x, numbers.Real):
        return True
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape") or _shape(x) != ():
        return False
    try:
        return jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)  # bool is neither
    except TypeError:
        return False


def check_num_items(num_items_in_batch, objective) -> None:
    """``num_items_in_batch`` (not None) must be a real scalar (TypeError otherwise, for every loss type: a
    Python / NumPy number or a 0-d integer / floating array, traced allowed; not a bool, a string, a list or
    a vector). Given to a loss type that ignores it (gmpo, grpo, bnpo, dr_grpo, sapo) it only warns, once
    per loss type and process, whatever its value: generic trainers pass it for every loss type (the Hugging
    Face ``Trainer`` hands ``num_items_in_batch`` to every ``compute_loss``; TRL's GRPO trainer then uses it
    for dapo only), and it changes nothing there. For dapo / cispo a concrete value must be finite and
    ``>= 1`` (NaN and inf fail too): it counts the unmasked tokens of an accumulation window that holds this
    call's, so 0 (or 0.5) would silently become the normaliser 1. Any real ``>= 1`` is accepted (TRL passes
    an int count; a per-process share ``count / processes`` is not integral). Traced it cannot be checked:
    the normaliser is ``max(n, 1)`` (``jnp.maximum``: a NaN propagates, the loss is NaN)."""
    if not _is_real_scalar(num_items_in_batch):
        raise TypeError(
            "batch.num_items_in_batch must be a real scalar (a Python / NumPy number or a 0-d integer or floating "
            "array, traced allowed; None: this call's own count), got "
            f"batch.num_items_in_batch={num_items_in_batch!r:.80}"
        )
    loss_type = objective.loss_type
    if loss_type not in NUM_ITEMS_LOSS_TYPES:
        if loss_type not in _warned_ignored_num_items:
            _warned_ignored_num_items.add(loss_type)
            warnings.warn(
                f"num_items_in_batch is ignored by loss_type={loss_type!r}: only {NUM_ITEMS_LOSS_TYPES} normalise "
                f"by it ({loss_type!r} has its own normaliser, see LossAux.loss_denominator); warned once per "
                "loss type",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )
        return
    value = _concrete(num_items_in_batch)
    if value is not None and not 1 <= float(value) < float("inf"):  # NaN fails too
        raise ValueError(
            "batch.num_items_in_batch must be >= 1 and finite (the number of unmasked completion tokens in the "
            "optimizer step's accumulation window; None: this call's own count), got "
            f"batch.num_items_in_batch={float(value)!r}"
        )


def warn_ignored_reference(name: str, objective) -> None:
    """A reference (``batch.ref_logps``, or ``reference=`` a ``ReferenceHead``) given to an objective without a
    KL term (:attr:`~gmpo_jax.objectives.Objective.has_kl` False) is not used: warned once per argument and
    process, at the caller's line."""
    if name in _warned_ignored_reference:
        return
    _warned_ignored_reference.add(name)
    what = "its log-probs are not computed" if name == "reference" else "the loss is the loss without it"
    warnings.warn(
        f"{name} is ignored: the objective ({type(objective).__name__}) has no KL term (objective.has_kl is "
        f"False: it was built with beta=0.0), so no reference is used and {what}; build the objective with a "
        "non-zero beta for a KL term; warned once per process",
        UserWarning,
        stacklevel=caller_stacklevel(),
    )
