"""Import paths of the 0.1 layout that moved, kept importable (with a ``DeprecationWarning``).

``gmpo_jax.backends.*`` became ``gmpo_jax.lm_head.*`` and ``gmpo_jax.logits_backends.*`` became
``gmpo_jax.logits.*`` (e.g. ``gmpo_jax.logits_backends.mosaic_gpu.MosaicGpuLogitsBackend`` is
``gmpo_jax.logits.MosaicGpuLogitsBackend``). A meta-path finder maps the old module names onto the new
modules, so ``from gmpo_jax.backends.mosaic_gpu import MosaicGpuBackend`` keeps working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "gmpo_jax.backends": "gmpo_jax.lm_head",
    "gmpo_jax.backends.base": "gmpo_jax.lm_head.backend",
    "gmpo_jax.backends.mosaic_gpu": "gmpo_jax.lm_head.mosaic_gpu",
    "gmpo_jax.backends.xla_chunked": "gmpo_jax.lm_head.xla_chunked",
    "gmpo_jax.logits_backends": "gmpo_jax.logits",
    "gmpo_jax.logits_backends.mosaic_gpu": "gmpo_jax.logits.mosaic_gpu",
    "gmpo_jax.logits_backends.xla": "gmpo_jax.logits.xla",
    "gmpo_jax.sharding": "gmpo_jax.lm_head.sharding",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Old module name -> a thin module forwarding every attribute to the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname.count(".") == 1)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {new}", DeprecationWarning, stacklevel=2)
        target = importlib.import_module(new)
        module.__getattr__ = lambda name: getattr(target, name)
        module.__doc__ = f"Moved to ``{new}``."


def install() -> None:
    """Add the finder once (idempotent)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
