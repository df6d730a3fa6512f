"""Orbax checkpoints of a training run: policy parameters, optimizer state and a JSON record.

Layout: ``<run_dir>/checkpoints/<step>/{state,meta}``. ``state`` is the pure-dict form
(``nnx.to_pure_dict``) of ``{"model": nnx.state(model), "optimizer": nnx.state(optimizer)}``; ``meta`` holds
the step and the configuration. Prompts and sampling keys are derived from ``(seed, step)``, so a resumed
run draws exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

__all__ = ["Checkpointer"]


class Checkpointer:
    """Save / restore ``(model, optimizer)`` with an ``orbax.checkpoint.CheckpointManager``.

    Args:
      directory: checkpoint folder (created if missing).
      max_to_keep: newest checkpoints kept on disk.
    """

    def __init__(self, directory: str, max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    @staticmethod
    def _state(model, optimizer) -> dict:
        return {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}

    def latest_step(self) -> int | None:
        """The newest saved step, or None when the folder holds no checkpoint."""
        return self._manager.latest_step()

    def save(self, step: int, model, optimizer, meta: dict[str, Any]) -> None:
        """Save (asynchronously) the state after ``step`` optimizer steps; ``meta`` must be JSON-able."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(self._state(model, optimizer)),
                meta=ocp.args.JsonSave({**meta, "step": int(step)}),
            ),
            force=True,
        )

    def restore(self, model, optimizer, step: int | None = None) -> dict[str, Any]:
        """Load a checkpoint into ``model`` and ``optimizer`` in place (their structure must match).

        Args:
          model, optimizer: freshly built objects of the saved run's configuration.
          step: the step to load; None = the newest.

        Returns:
          The saved ``meta`` dict (with ``"step"``).

        Raises:
          FileNotFoundError: no checkpoint in the folder.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._state(model, optimizer))
        out = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        model_state, opt_state = nnx.state(model), nnx.state(optimizer)
        nnx.replace_by_pure_dict(model_state, out.state["model"])
        nnx.replace_by_pure_dict(opt_state, out.state["optimizer"])
        nnx.update(model, model_state)
        nnx.update(optimizer, opt_state)
        return dict(out.meta)

    def close(self) -> None:
        """Wait for pending asynchronous saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
