"""The static configuration of one LM-head call: the mesh plan (from :class:`~gmpo_jax.MeshAxes`), the backend
resolved for one device's rows and vocabulary shard with the :class:`~gmpo_jax.HeadOptions` it computes with set on
it (``softcap``, ``logits_precision``, ``grad_filter``, per its declared
:class:`~gmpo_jax.lm_head.backend.Capabilities`), and the primals placed on the plan's layout."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from gmpo_jax import tuning
from gmpo_jax._dispatch import UnsupportedConfigError
from gmpo_jax._validation import grad_filter_threshold
from gmpo_jax.lm_head import backend as backend_lib
from gmpo_jax.lm_head import sharding
from gmpo_jax.lm_head.chunks import Head, LMHeadConfig
from gmpo_jax.objectives import PolicyInputs
from gmpo_jax.options import HeadOptions, MeshAxes

__all__ = ["resolve_config", "make_plan", "placed"]


def resolve_config(hidden, weight, bias, T: int, V: int, plan, head: HeadOptions, *, with_entropy: bool = False):
    """The static configuration: the backend resolved for one device's rows and vocabulary shard, with the call's
    :class:`~gmpo_jax.lm_head.backend.HeadSettings` set on it (a backend that does not declare a setting it is
    given raises ``UnsupportedConfigError``; the gradient filter is dropped where it would not be exact-safe: a
    backend without it, a vocabulary-parallel plan, a soft cap)."""
    B, H = hidden.shape[0], hidden.shape[2]
    if plan is not None:
        B, V_local = B // plan.data_shards, V // plan.vocab_shards
    else:
        V_local = V
    chunk = min(head.chunk_size or tuning.default_chunk_size(B, T), B)
    backend = backend_lib.resolve(
        head.implementation,
        hidden_dtype=hidden.dtype,
        weight_dtype=weight.dtype,
        H=H,
        V=V_local,
        rows=chunk * T,
        weight_layout=head.weight_layout,
        has_bias=bias is not None,
        **({"with_entropy": True} if with_entropy else {}),
        **({"logits_precision": head.logits_precision} if head.logits_precision is not None else {}),
    )
    caps = backend_lib.capabilities(backend)
    for value, what, declared in (
        (head.softcap, "softcap (Gemma's logit cap)", caps.softcap),
        (head.logits_precision, "logits_precision", caps.logits_precision),
    ):
        if value is not None and not declared:
            raise UnsupportedConfigError(f"the LM-head backend {backend.name!r} has no {what}")
    tau = grad_filter_threshold(head.grad_filter)
    if not caps.grad_filter or (plan is not None and plan.vocab_axis is not None) or head.softcap is not None:
        tau = None  # the exact gradient (the dropped windows' correction has no (1 - tanh^2) factor of a cap)
    settings = dict(softcap=head.softcap, logits_precision=head.logits_precision, grad_filter=tau)
    if isinstance(backend, backend_lib.WithHeadSettings) or any(v is not None for v in settings.values()):
        backend = backend_lib.with_settings(backend, **settings)  # the options' values, whatever the instance held
    return LMHeadConfig(
        backend=sharding.local_backend(backend, plan, V),
        chunk_size=chunk,
        weight_layout=head.weight_layout,
        weight_dtype=weight.dtype,
        bias_dtype=None if bias is None else bias.dtype,
        with_entropy=with_entropy,
        plan=plan,
        row_buckets=tuning.row_buckets(backend),
    )


def make_plan(hidden, weight, axes: MeshAxes, B: int, V: int, weight_layout: str):
    mesh, data_axis, vocab_axis = axes.mesh, axes.data_axis, axes.vocab_axis
    if mesh is None and data_axis is None and vocab_axis is None:
        inferred = sharding.infer_axes(hidden, weight, weight_layout)  # Explicit mesh axes only
        if inferred is not None:
            mesh, data_axis, vocab_axis = inferred
    return sharding.make_plan(mesh, data_axis, vocab_axis, B=B, V=V, weight_layout=weight_layout)


def placed(plan, head: Head, inputs: PolicyInputs) -> tuple[Head, PolicyInputs]:
    """The custom VJP's primals on the plan's layout, so that their gradients come back laid out alike."""
    if plan is None:
        return head, inputs
    return plan.place_all((head, inputs), (Head(*plan.head), inputs.specs(plan.batch, P())))
