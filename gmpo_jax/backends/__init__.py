"""LM-head backends behind one seam (see ``base.py``)."""

from gmpo_jax.backends.base import (
    IMPLEMENTATIONS,
    BackendUnavailableError,
    LMHeadBackend,
    UnsupportedConfigError,
    resolve_backend,
)

__all__ = ["IMPLEMENTATIONS", "BackendUnavailableError", "LMHeadBackend", "UnsupportedConfigError", "resolve_backend"]
