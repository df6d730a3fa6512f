"""``gmpo-jax train --mesh data=D,model=M``: the training step on a 2-D device mesh.

* **data** (``D``): the rollout batch is split over ``D`` devices (``NamedSharding(mesh, P("data"))``);
  the policy is replicated; sampling, the transformer and the fused loss run data parallel, and
  ``jax.jit``'s partitioner all-reduces the gradients of the replicated parameters.
* **model** (``M``): the LM head's vocabulary is split over ``M`` devices inside the fused loss and log-
  probs (``gmpo_jax.fused_linear_policy_loss`` / ``fused_linear_logprobs`` with ``vocab_axis="model"``:
  per-shard log-sum-exps combined with collectives, see ``gmpo_jax.lm_head.sharding``). The rest of the policy is
  replicated over ``model``.

Vocabulary padding. ``V`` (the tokenizer's 15, or ``--vocab-size``) need not be a multiple of ``M``: the
loss pads the head with zero columns (rows, for a tied ``[V, H]`` head) up to the next multiple of ``M``
and passes ``HeadOptions(vocab_size=V)``, which masks them out of the softmax, so the result is that of the unpadded
head and the padded columns get no gradient. When ``V % M == 0`` nothing is padded and the head
*parameter* (and its AdamW moments) are stored sharded along ``V`` as well; otherwise they are
replicated (an array cannot be split unevenly) and each device takes its slice of the padded copy.

The mesh is ``jax.make_mesh((D, M), ("data", "model"), axis_types=(Auto, Auto))`` over the first
``D * M`` devices: ``Auto`` axes let ``jax.jit`` partition the unannotated parts (the transformer, the
sampler, the optimizer) from the input shardings, while the fused calls name their axes explicitly. A
``TrainMesh`` is hashable and passed to the compiled functions as a static argument. ``--mesh
data=1,model=1`` places everything on one device and calls the fused functions without mesh arguments.
On CPU, simulate devices with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (set before JAX
starts).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = ["MESH_AXES", "TrainMesh", "parse_mesh", "make_train_mesh", "fused_head"]

#: the mesh axis names, in mesh order
MESH_AXES = ("data", "model")

_MESH_RE = re.compile(r"^\s*(\w+)\s*=\s*(\d+)\s*$")


def parse_mesh(spec: str) -> tuple[int, int]:
    """``(D, M)`` of a ``--mesh`` string ``"data=D,model=M"`` (either order; an absent axis is 1).

    Pure Python (no JAX).

    Raises:
      ValueError: a one-line reason (the caller prefixes ``--mesh``).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("must look like data=D,model=M")
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        m = _MESH_RE.match(part)
        if not m:
            raise ValueError(f"must look like data=D,model=M (entry {part.strip()!r} is not name=integer)")
        name, size = m.group(1), int(m.group(2))
        if name not in MESH_AXES:
            raise ValueError(f"axis names are {' and '.join(MESH_AXES)}, not {name!r}")
        if name in sizes:
            raise ValueError(f"names the {name} axis twice")
        if size < 1:
            raise ValueError(f"axis sizes must be >= 1 ({name}={size})")
        sizes[name] = size
    return sizes.get("data", 1), sizes.get("model", 1)


@dataclasses.dataclass(frozen=True)
class TrainMesh:
    """The training mesh (hashable: a static argument of the compiled steps).

    Attributes:
      mesh: ``jax.sharding.Mesh`` of shape ``(data, model)``, axes ``("data", "model")``, ``Auto`` types.
      data: ``D``, batch shards. model: ``M``, vocabulary shards.
    """

    mesh: Any
    data: int
    model: int

    @property
    def data_axis(self) -> str | None:
        """``"data"`` when the batch is split (``D > 1``), else None."""
        return "data" if self.data > 1 else None

    @property
    def vocab_axis(self) -> str | None:
        """``"model"`` when the vocabulary is split (``M > 1``), else None."""
        return "model" if self.model > 1 else None

    def describe(self) -> str:
        return f"mesh data={self.data} x model={self.model}"

    # -- placement -------------------------------------------------------------------------------
    def batch_sharding(self):
        """``NamedSharding`` of arrays whose leading axis is the batch."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        return NamedSharding(self.mesh, P("data"))

    def put_batch(self, tree):
        """Every array of ``tree`` (None leaves kept) split along its leading axis over ``data``."""
        import jax

        return jax.tree.map(lambda x: jax.device_put(x, self.batch_sharding()), tree)

    def put_replicated(self, x):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        return jax.device_put(x, NamedSharding(self.mesh, P()))

    def place_module(self, module, vocab_size: int, weight_layout: str) -> None:
        """Place ``module``'s state (a policy or its ``nnx.Optimizer``) on the mesh, in place.

        Everything is replicated except, when ``M > 1`` and ``V % M == 0``, the LM-head arrays: 2-D leaves
        under ``lm_head`` / ``kernel`` (layout ``"hv"``, ``[H, V]``) or ``embed`` / ``embedding``
        (layout ``"vh"``, ``[V, H]``), i.e. the parameter and its optimizer moments, split along ``V``.
        """
        import jax
        from flax import nnx
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        head_path = ("lm_head", "kernel") if weight_layout == "hv" else ("embed", "embedding")
        split = self.vocab_axis is not None and vocab_size % self.model == 0
        v_dim = 1 if weight_layout == "hv" else 0

        def spec(path, x):
            keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", "")))) for k in path]
            while keys and keys[-1] == "value":  # a Variable flattened to its value
                keys.pop()
            is_head = (
                split and getattr(x, "ndim", 0) == 2 and x.shape[v_dim] == vocab_size and tuple(keys[-2:]) == head_path
            )
            if is_head:
                return NamedSharding(self.mesh, P(None, "model") if v_dim == 1 else P("model", None))
            return NamedSharding(self.mesh, P())

        state = nnx.state(module)
        shardings = jax.tree.map_with_path(spec, state)
        nnx.update(module, jax.device_put(state, shardings))


def make_train_mesh(data: int, model: int) -> TrainMesh:
    """The `TrainMesh` over the first ``data * model`` devices (validated by ``TrainConfig.validate``)."""
    import jax
    from jax.sharding import AxisType

    devices = jax.devices()[: data * model]
    mesh = jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)
    return TrainMesh(mesh, data, model)


def fused_head(weight, weight_layout: str, train_mesh: TrainMesh | None):
    """``(weight, head, sharding)`` for ``gmpo_jax.fused_linear_policy_loss`` / ``fused_linear_logprobs``: a
    ``gmpo_jax.HeadOptions`` and a ``gmpo_jax.MeshAxes`` (or None).

    Without a mesh (or on a 1 x 1 mesh): the weight unchanged, ``HeadOptions(weight_layout=...)`` and no mesh
    axes (the single-device program). Otherwise ``MeshAxes(mesh, data_axis, vocab_axis)`` (None for an axis of
    size 1) and, when ``V`` is not a multiple of ``M``, the weight padded with zeros along ``V`` to the next
    multiple and ``vocab_size=V`` (the padded columns are masked out of the softmax; differentiable: the pad's
    gradient is the slice of the real columns).
    """
    import gmpo_jax

    if train_mesh is None or (train_mesh.data_axis is None and train_mesh.vocab_axis is None):
        return weight, gmpo_jax.HeadOptions(weight_layout=weight_layout), None
    import jax.numpy as jnp

    axes = gmpo_jax.MeshAxes(train_mesh.mesh, data_axis=train_mesh.data_axis, vocab_axis=train_mesh.vocab_axis)
    v_dim = 1 if weight_layout == "hv" else 0
    V = weight.shape[v_dim]
    padded = -(-V // train_mesh.model) * train_mesh.model
    vocab_size = None
    if padded != V:
        pad = [(0, 0), (0, 0)]
        pad[v_dim] = (0, padded - V)
        weight = jnp.pad(weight, pad)
        vocab_size = V
    return weight, gmpo_jax.HeadOptions(weight_layout=weight_layout, vocab_size=vocab_size), axes
