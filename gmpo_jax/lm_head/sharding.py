"""Data- and vocabulary-parallel fused losses on a ``jax.sharding.Mesh``: ``jax.shard_map`` + collectives.

The public functions take the mesh layout as a :class:`~gmpo_jax.MeshAxes`::

    loss, aux = fused_linear_policy_loss(hidden, weight, batch, objective=GMPO(),
                                         sharding=MeshAxes(mesh, data_axis="data", vocab_axis="model"))

* ``data_axis``: the batch axis ``B`` of ``hidden`` / ids / mask / advantages / log-probs is split over
  these mesh axes (data parallel; the weight is replicated over them).
* ``vocab_axis``: the vocabulary axis ``V`` of ``weight`` (and ``bias``) is split over these mesh axes
  (Megatron-style vocabulary parallelism; ``V`` must be a multiple of the shard count: pad it and pass
  ``HeadOptions(vocab_size=...)``).
* Both on a 2-D mesh. Mesh axes named in neither are replicated. ``mesh=None`` takes the mesh set with
  ``jax.set_mesh``. An axis may be a name or a tuple of names.

Example (one device here; the same call on a ``(2, 4)`` mesh splits the batch in 2 and the vocabulary in 4):

  >>> import jax, jax.numpy as jnp, gmpo_jax
  >>> mesh = jax.make_mesh((1, 1), ("data", "model"))
  >>> h, w, ids = jnp.zeros((2, 3, 4)), jnp.ones((4, 8)), jnp.zeros((2, 3), jnp.int32)
  >>> axes = gmpo_jax.MeshAxes(mesh, data_axis="data", vocab_axis="model")
  >>> head = gmpo_jax.HeadOptions(vocab_size=6)  # 8 = 6 real + 2 padding
  >>> batch = gmpo_jax.PolicyBatch(ids, jnp.ones((2, 3)), jnp.array([1.0, -0.5]))
  >>> loss, aux = gmpo_jax.fused_linear_policy_loss(
  ...     h, w, batch, objective=gmpo_jax.GMPO(), head=head, sharding=axes)
  >>> float(loss), float(aux.loss_denominator)  # on-policy: -mean_b A_b
  (-0.25, 2.0)
  >>> logp = gmpo_jax.fused_linear_logprobs(h, w, ids, head=head, sharding=axes)
  >>> round(float(jnp.exp(logp[0, 0])), 4)  # uniform over the 6 real tokens
  0.1667

Design decisions (and why):

* **Explicit axes, not inference from input shardings.** Under ``jax.jit`` with the default ``Auto``
  mesh axes an input's sharding is unknown while tracing (XLA's partitioner decides it later), so the
  only transparent route is ``custom_partitioning``, whose partitioning callbacks would have to re-split
  the custom VJP, its chunk scan and the backend's Pallas calls, and which XLA may still answer by
  gathering the weight. The layout of an LM head is a decision the caller has already made
  (Megatron / MaxText name it in their configs), so it is an argument; inside, ``jax.shard_map`` makes
  every collective explicit and hand-placed (the compiled program is checked never to gather the
  weight or the ``[N, V]`` logits). One exception is free of guessing: on a mesh with ``Explicit`` axes
  (``jax.make_mesh``'s default) the shardings are part of the input types, and ``infer_axes`` reads
  ``data_axis`` / ``vocab_axis`` from ``hidden``'s batch axis and ``weight``'s vocabulary axis when the
  caller gives none. Without axes, inputs placed on ``Auto`` axes run the single-device program and
  XLA's partitioner chooses the communication (correct, not optimised).
* **One custom VJP, the plan inside it.** ``gmpo_jax.lm_head.vjp`` has one custom VJP per function; a
  ``ShardingPlan`` in its static configuration runs the same chunk scan per device (local rows, local
  vocabulary shard) inside a ``jax.shard_map`` (:meth:`ShardingPlan.run`), in the forward of the VJP,
  which returns the loss and the gradients; the backward scales them by the cotangent. Nothing is
  differentiated through a collective, so there is no transpose of ``psum`` to get right, and
  ``check_vma=False`` is safe (the scan carries need no ``pcast``).
* **Global normalisers.** The denominator (``B``, token counts, ``num_items_in_batch``) and the
  metric fractions are computed from the *global* mask outside the ``shard_map``; every device divides
  its ``d loss / d logp`` by that global denominator, so the local hidden gradient is already final.
  Loss numerators and metric sums are ``psum``-ed (log-ratio range: ``pmin`` / ``pmax``) over the data
  axis; the float32 weight / bias gradient accumulators are ``psum``-ed over the data axis once, after
  the scan.
* **Vocabulary parallelism is a backend wrapper.** ``VocabParallelBackend`` wraps any backend of the
  seam (``gmpo_jax/lm_head/backend.py``): the inner backend sees its local ``[H, V/n]`` shard and ids shifted by
  the shard's offset and returns its local ``(logp, lse)``; the wrapper combines the shards' log-sum-
  exps with ``pmax`` / ``psum`` (``lse = M + log1p(l)``, ``l = sum_k exp(lse_k - M) - 1`` with the shards at
  ``M`` counted as exact ones apart from the others' mass: ``gmpo_jax._lse``) and takes the target's
  log-prob from the one shard that owns it (``psum`` of ``logp_k + lse_k - M`` where owned, less
  ``log1p(l)``). The gradient
  uses the global ``lse``, so each shard's ``dW`` / ``db`` block is local and final; the hidden
  gradient partials are ``psum``-ed over the vocabulary axis (in float32). Per chunk that is four
  ``[R]`` all-reduces forward and one ``[R, H]`` all-reduce backward; the weight never moves. Any
  backend joins unchanged, provided it treats the id -1 as "no target here" (NaN log-prob, zero
  one-hot; the ids another shard owns are passed as -1): the Pallas backend can run inside the same
  ``shard_map``.
* **Padded vocabularies** (``vocab_size < V``) are masked with an additive ``-inf`` bias on the padded
  columns (``mask_padded_vocab``): every backend already supports a bias, so padded columns drop out of
  the softmax and get exactly zero gradient on every path, sharded or not, with no backend change.
  Unmasked ids in ``[vocab_size, V)`` give NaN, as ids outside ``[0, V)`` do.
* **Placement.** Arguments are resharded to the plan's specs before the ``shard_map`` (``jax.reshard``
  on ``Explicit`` axes; on ``Auto`` axes ``shard_map`` does it). Outputs come back sharded like the
  primal: hidden gradients over ``data_axis``, weight / bias gradients over ``vocab_axis``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gmpo_jax.lm_head.backend import capabilities

__all__ = ["ShardingPlan", "VocabParallelBackend", "make_plan", "infer_axes", "mask_padded_vocab"]

AxisName = Union[str, tuple[str, ...]]

# ``jax.shard_map`` is public in jax 0.10.2 and 0.11.2 (``jax.experimental.shard_map`` is the deprecated
# spelling); the one import used here.
shard_map = jax.shard_map


def _axes(axis: AxisName | None) -> tuple[str, ...] | None:
    if axis is None:
        return None
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(f"a mesh axis must be a name or a non-empty tuple of names, got {axis!r}")
    return axes


def _spec_entry(axes: tuple[str, ...] | None):
    if axes is None:
        return None
    return axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """How one fused call is laid out on a mesh (hashable: a static argument of the custom VJP)."""

    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    data_axis: tuple[str, ...] | None
    vocab_axis: tuple[str, ...] | None
    data_shards: int
    vocab_shards: int
    weight_layout: str

    @property
    def batch(self) -> P:
        """Spec of arrays whose leading axis is the batch ``B``."""
        return P(_spec_entry(self.data_axis))

    @property
    def weight(self) -> P:
        v = _spec_entry(self.vocab_axis)
        return P(None, v) if self.weight_layout == "hv" else P(v, None)

    @property
    def vocab(self) -> P:
        """Spec of ``[V]`` arrays (the bias)."""
        return P(_spec_entry(self.vocab_axis))

    def place(self, x, spec: P):
        """``x`` resharded to ``spec`` where the mesh's axes are ``Explicit`` (``shard_map`` requires the
        types to match there); on ``Auto`` axes ``shard_map`` reshards by itself."""
        if x is None:
            return None
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types))
        if not any(t == AxisType.Explicit for t in types.values()):
            return x
        named = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
        if any(types[a] != AxisType.Explicit for a in named):
            return x
        return jax.reshard(x, NamedSharding(self.mesh, spec))

    @property
    def head(self) -> tuple[P, P, P]:
        """Specs of ``(hidden, weight, bias)``: rows over the data axis, the vocabulary over the vocabulary axis."""
        return (self.batch, self.weight, self.vocab)

    def place_all(self, args: tuple, specs: tuple) -> tuple:
        """Every array of ``args`` (a tuple of pytrees) placed on its spec (``specs``: a tree prefix)."""

        def place(spec, sub):
            return jax.tree.map(lambda x: self.place(x, spec) if isinstance(x, jax.Array) and x.ndim else x, sub)

        return jax.tree.map(place, tuple(specs), tuple(args), is_leaf=lambda x: isinstance(x, P))

    def run(self, fn, args: tuple, in_specs: tuple, out_specs):
        """``fn(*args)`` per device under ``jax.shard_map`` (each argument placed on its spec first).

        ``check_vma=False``: nothing is differentiated through the collectives (the custom VJP's forward
        computes the gradients), so the scan carries need no ``pcast``."""
        return shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
            *self.place_all(args, in_specs)
        )

    def sum_data(self, x):
        """``x`` summed over the data axis (inside :meth:`run`); None and unsharded batches pass through."""
        return x if (x is None or self.data_axis is None) else lax.psum(x, self.data_axis)


def make_plan(
    mesh, data_axis: AxisName | None, vocab_axis: AxisName | None, *, B: int, V: int, weight_layout: str
) -> ShardingPlan | None:
    """Validate the mesh arguments of a public call; None when neither axis is given (single-device path).

    Raises:
      ValueError: ``mesh`` without an axis, no mesh (neither ``mesh=`` nor ``jax.set_mesh``), an axis not
        in the mesh, an axis used twice, ``B`` not a multiple of the data shards or ``V`` not a multiple
        of the vocabulary shards.
    """
    d, v = _axes(data_axis), _axes(vocab_axis)
    if d is None and v is None:
        if mesh is not None:
            raise ValueError("mesh= needs data_axis= and / or vocab_axis= (the mesh axes to split B and V over)")
        return None
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or mesh.empty:
            raise ValueError(
                "data_axis= / vocab_axis= need mesh= (a jax.sharding.Mesh) or a mesh set with jax.set_mesh(...)"
            )
    named = (d or ()) + (v or ())
    for a in named:
        if a not in mesh.axis_names:
            raise ValueError(f"mesh axis {a!r} is not in the mesh, whose axes are {tuple(mesh.axis_names)}")
    if len(set(named)) != len(named):
        raise ValueError(
            f"a mesh axis may split one array axis only, got data_axis={data_axis!r}, vocab_axis={vocab_axis!r}"
        )
    nd = math.prod(mesh.shape[a] for a in d) if d else 1
    nv = math.prod(mesh.shape[a] for a in v) if v else 1
    if B % nd:
        raise ValueError(f"hidden's batch B={B} must be a multiple of the {nd} data shards of data_axis={data_axis!r}")
    if V % nv:
        raise ValueError(
            f"the vocabulary V={V} must be a multiple of the {nv} shards of vocab_axis={vocab_axis!r}: "
            f"pad the LM head to {-(-V // nv) * nv} and pass vocab_size={V}"
        )
    return ShardingPlan(mesh, d, v, nd, nv, weight_layout)


def infer_axes(hidden, weight, weight_layout: str):
    """``(mesh, data_axis, vocab_axis)`` read from ``Explicit``-axis input shardings, or None.

    Only on meshes with ``Explicit`` axes are shardings known while tracing. ``hidden``'s batch axis
    gives ``data_axis``, ``weight``'s vocabulary axis gives ``vocab_axis``.

    Raises:
      ValueError: ``hidden`` sharded along ``T`` / ``H`` or ``weight`` along ``H`` (not supported).
    """
    sh, sw = jax.typeof(hidden).sharding, jax.typeof(weight).sharding
    found = [s for s in (sh, sw) if isinstance(s, NamedSharding) and any(e is not None for e in s.spec)]
    if not found:
        return None
    mesh = found[0].mesh
    if any(t != AxisType.Explicit for t in mesh.axis_types):
        return None
    hs = tuple(sh.spec) + (None,) * (3 - len(sh.spec)) if isinstance(sh, NamedSharding) else (None,) * 3
    ws = tuple(sw.spec) + (None,) * (2 - len(sw.spec)) if isinstance(sw, NamedSharding) else (None,) * 2
    v_entry, h_entry = (ws[1], ws[0]) if weight_layout == "hv" else (ws[0], ws[1])
    if hs[1] is not None or hs[2] is not None or h_entry is not None:
        raise ValueError(
            f"only hidden's batch axis and weight's vocabulary axis may be sharded, got "
            f"hidden sharded as {sh.spec} and weight as {sw.spec}"
        )
    return mesh, hs[0], v_entry


def mask_padded_vocab(ids, bias, V: int, vocab_size: int | None):
    """``(ids, bias)`` with vocabulary columns ``>= vocab_size`` masked out of the softmax.

    The padded columns get a ``-inf`` bias (``0`` where the caller has no bias, otherwise its own
    values), so they add nothing to the sum-exp and receive exactly zero gradient on every backend;
    unmasked ids in ``[vocab_size, V)`` become -1, i.e. NaN like any id outside the vocabulary. The
    padded rows of the weight must be finite (checkpoints store zeros).
    """
    if vocab_size is None or vocab_size == V:
        return ids, bias
    live = jnp.arange(V, dtype=jnp.int32) < vocab_size
    base = jnp.zeros((V,), jnp.float32) if bias is None else bias
    bias = jnp.where(live, base, jnp.asarray(-jnp.inf, base.dtype))
    ids = jnp.where(ids < vocab_size, ids, -1)
    return ids, bias


# ------------------------------------------------------------------------------------------------
# Vocabulary parallelism: a wrapper around any backend of the seam
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VocabParallelBackend:
    """Runs ``inner`` on the local vocabulary shard; combines the shards with collectives over ``axis``.

    Only valid inside a ``shard_map`` over ``axis``; ``shard_size`` is the local ``V``.
    """

    inner: Any
    axis: tuple[str, ...]
    shard_size: int

    @property
    def name(self) -> str:
        return f"{self.inner.name}/vocab_parallel"

    def check_supported(self, **config) -> None:
        self.inner.check_supported(**config)

    def _local(self, ids):
        """``(local ids, owned)``: ids shifted to this shard; -1 (no target here) where another shard owns them."""
        local = ids - lax.axis_index(self.axis) * self.shard_size
        owned = (local >= 0) & (local < self.shard_size)
        return jnp.where(owned, local, -1), owned

    def logprobs(self, hidden, weight, bias, ids, temperature, *, weight_layout, with_entropy=False):
        local, owned = self._local(ids)
        out = self.inner.logprobs(
            hidden,
            weight,
            bias,
            local,
            temperature,
            weight_layout=weight_layout,
            **({"with_entropy": True} if with_entropy else {}),
        )
        logp_k, lse_k = out[:2]
        with jax.named_scope("gmpo_jax/vocab_parallel/combine"):
            # the shards' log-sum-exps merged as states (lse_k, 0) (gmpo_jax._lse): the sum excludes one
            # instance of the largest, so the others' mass is not rounded to ulps of its exp(0) = 1
            m = lax.pmax(lse_k, self.axis)
            empty = jnp.isneginf(m)  # every column masked: keep lse = -inf, not NaN
            a = lse_k - jnp.where(empty, 0.0, m)  # <= 0, exactly 0 on the shards at the maximum
            top = a == 0.0
            tail, n_top = lax.psum((jnp.where(top, 0.0, jnp.exp(a)), jnp.where(top, 1.0, 0.0)), self.axis)
            l = tail + (n_top - 1.0)  # the top shards' exp(0) = 1 counted exactly, apart from the tail
            l1 = jnp.log1p(l)
            lse = m + l1
            # the owner's logp_k re-based: logp = logp_k + lse_k - lse = logp_k + a_k - log1p(l)
            tgt = lax.psum(jnp.where(owned, logp_k + a, 0.0), self.axis)
            n_shards = lax.psum(1, self.axis)
            valid = (ids >= 0) & (ids < self.shard_size * n_shards)
            logp = jnp.where(valid, jnp.minimum(tgt - l1, 0.0), jnp.nan)
            if not with_entropy:
                return logp, lse
            # H = lse - E[z] = sum_k w_k (H_k + lse - lse_k), w_k = exp(lse_k - lse) = exp(a_k - log1p(l))
            w = jnp.exp(a - l1)
            ent = lax.psum(jnp.where(w > 0, w * (out[2] + l1 - a), 0.0), self.axis)
        return logp, lse, ent

    def grads(self, hidden, weight, bias, ids, dlogp, lse, temperature, *, weight_layout, dw_acc, db_acc, entropy=None):
        kw = {} if entropy is None else {"entropy": entropy}  # the global lse and entropy: local terms are final
        dh, dw, db = self.inner.grads(
            hidden,
            weight,
            bias,
            self._local(ids)[0],
            dlogp,
            lse,
            temperature,
            weight_layout=weight_layout,
            dw_acc=dw_acc,
            db_acc=db_acc,
            **kw,
        )
        with jax.named_scope("gmpo_jax/vocab_parallel/dhidden"):
            dh = lax.psum(dh.astype(jnp.float32), self.axis).astype(hidden.dtype)
        return dh, dw, db


def local_backend(backend, plan: ShardingPlan | None, V: int):
    """The backend each device runs: ``backend`` itself, or wrapped for vocabulary parallelism over a
    ``V``-column vocabulary (``V`` the global size)."""
    if plan is None or plan.vocab_axis is None:
        return backend
    if capabilities(backend).cancel_rounding and backend.cancel_rounding:  # needs the whole vocabulary's row sums
        backend = dataclasses.replace(backend, cancel_rounding=False)
    return VocabParallelBackend(backend, plan.vocab_axis, V // plan.vocab_shards)
