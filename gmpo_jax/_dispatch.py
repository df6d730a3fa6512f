"""Implementation dispatch shared by both ops, and its typed errors.

Dispatch follows tokamax: ``implementation=None`` tries an op's registered backends in order (Pallas
Mosaic GPU first, then the portable XLA path); a backend that cannot serve a call raises a typed
``NotImplementedError`` subclass and the next one is tried. An explicit ``implementation=`` (a name or a
backend instance) never falls back. Which implementation ran is logged on the ``gmpo_jax`` logger (INFO)
and shows in profiles as the ``jax.named_scope`` ``gmpo_jax/<name>``.
"""

from __future__ import annotations

import importlib
import logging
import warnings

__all__ = ["UnsupportedConfigError", "BackendUnavailableError", "dispatch"]

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


def _make(registry: dict[str, str], name: str):
    """A default-configured instance of ``registry[name]`` (``"module.path:ClassName"``)."""
    module_path, class_name = registry[name].split(":")
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:  # e.g. a jax build without Pallas Mosaic GPU
        raise BackendUnavailableError(f"implementation={name!r} cannot be imported: {e}") from e
    return getattr(module, class_name)()


def check_implementation(implementation, names: tuple[str, ...] = ()) -> None:
    """TypeError for what can never be an implementation: a backend class instead of an instance, or an object
    without ``check_supported``; ValueError for a name not in ``names`` (the registered names; empty: any name
    passes)."""
    as_name = f"a name in {names}" if names else "a name"
    if isinstance(implementation, type):
        raise TypeError(
            f"implementation must be a backend instance, not the class, got implementation={implementation.__name__}: "
            f"pass {implementation.__name__}() (or {as_name})"
        )
    if implementation is not None and not isinstance(implementation, str):
        if not callable(getattr(implementation, "check_supported", None)):
            raise TypeError(
                f"implementation must be None, {as_name} or a backend instance, got implementation={implementation!r}"
            )
    if isinstance(implementation, str) and names and implementation not in names:
        raise ValueError(
            f"implementation must be None, one of {names} or a backend instance, got implementation={implementation!r}"
        )


def dispatch(implementation, registry: dict[str, str], what: str, *, required: tuple[str, ...] = (), **config):
    """Pick a backend from ``registry`` (ordered name -> ``"module.path:ClassName"``); shared by every op's dispatch.

    ``implementation`` is None (try the registry in order: a ``BackendUnavailableError`` falls through
    silently, an ``UnsupportedConfigError`` with one warning), a registered name (explicit: never falls
    back) or a backend instance (explicit, e.g. a kernel backend in interpret mode for tests). ``config``
    goes to ``check_supported``; ``what`` names the op in logs and errors; ``required``: the methods a
    backend instance of this op must have (another op's backend is a TypeError, not a confusing call).

    Raises:
      TypeError: a backend class instead of an instance, or an instance of another op's backend.
      ValueError: unknown ``implementation`` name.
      UnsupportedConfigError / BackendUnavailableError: an explicitly requested backend cannot serve.
    """
    check_implementation(implementation, tuple(registry))
    if implementation is not None and not isinstance(implementation, str):
        missing = [m for m in required if not callable(getattr(implementation, m, None))]
        if missing:
            raise TypeError(
                f"implementation={implementation!r} is not a {what} backend (it has no {', '.join(missing)}); "
                f"this op's backends are {tuple(registry)}"
            )
        implementation.check_supported(**config)
        logger.info("gmpo_jax: %s implementation=%r (explicit instance)", what, implementation)
        return implementation
    if implementation is not None:  # a registered name (check_implementation)
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
            warnings.warn(
                f"gmpo_jax: {what} implementation={name!r} cannot serve this call ({e}); falling back.", stacklevel=5
            )
            continue
        logger.info("gmpo_jax: %s implementation=%s", what, name)
        return backend
    raise BackendUnavailableError(f"no {what} implementation can serve this call")
