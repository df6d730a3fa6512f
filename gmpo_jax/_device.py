"""What the Mosaic GPU backends of both ops ask of the device: is it Hopper or newer, how many SMs.

Shared by ``gmpo_jax.lm_head.mosaic_gpu`` and ``gmpo_jax.logits.mosaic_gpu``; imports no Pallas, so a
backend can ask before it loads its kernels.
"""

from __future__ import annotations

import jax

__all__ = ["supported_on", "num_sms", "DEFAULT_SMS"]

# SMs of an H100 / H200: the grid size in the Pallas interpreter and on devices that do not report theirs.
DEFAULT_SMS = 132


def supported_on(device) -> bool:
    """True on a CUDA GPU of compute capability 9.0 (Hopper) or newer."""
    if getattr(device, "platform", None) != "gpu":
        return False
    cc = getattr(device, "compute_capability", None)
    try:
        return float(cc) >= 9.0
    except (TypeError, ValueError):
        return False


def num_sms(interpret: bool = False) -> int:
    """Streaming multiprocessors of the first device (``DEFAULT_SMS`` in the interpreter or when the
    device does not say)."""
    if interpret:
        return DEFAULT_SMS
    try:
        return int(getattr(jax.devices()[0], "core_count", DEFAULT_SMS) or DEFAULT_SMS)
    except Exception:  # pragma: no cover - some PJRT clients do not report it
        return DEFAULT_SMS
