"""The static configuration of one LM-head call: the mesh plan, the backend resolved for one device's rows and
vocabulary shard with the call's head options set on it (``softcap``, ``logits_precision``, ``grad_filter``, per
its declared :class:`~gmpo_jax.lm_head.backend.Capabilities`), and the primals placed on the plan's layout."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from gmpo_jax import tuning
from gmpo_jax._dispatch import UnsupportedConfigError
from gmpo_jax.lm_head import backend as backend_lib
from gmpo_jax.lm_head import sharding
from gmpo_jax.lm_head.chunks import Head, LMHeadConfig
from gmpo_jax.objectives import PolicyInputs

__all__ = ["resolve_config", "make_plan", "placed", "plan_kwargs"]


def resolve_config(
    hidden,
    weight,
    bias,
    T: int,
    V: int,
    plan,
    *,
    chunk_size,
    weight_layout: str,
    implementation,
    with_entropy: bool = False,
    softcap: float | None = None,
    logits_precision: str | None = None,
    grad_filter: float | None = None,
) -> LMHeadConfig:
    """The static configuration: the backend resolved for one device's rows and vocabulary shard (with the
    soft cap and the logits precision set on it, and the gradient filter's threshold where the backend has
    one: a backend without it, and a vocabulary-parallel plan, compute the exact gradient)."""
    B, H = hidden.shape[0], hidden.shape[2]
    if plan is not None:
        B, V_local = B // plan.data_shards, V // plan.vocab_shards
    else:
        V_local = V
    chunk = min(chunk_size or tuning.default_chunk_size(B, T), B)
    backend = backend_lib.resolve(
        implementation,
        hidden_dtype=hidden.dtype,
        weight_dtype=weight.dtype,
        H=H,
        V=V_local,
        rows=chunk * T,
        weight_layout=weight_layout,
        has_bias=bias is not None,
        **({"with_entropy": True} if with_entropy else {}),
        **({"logits_precision": logits_precision} if logits_precision is not None else {}),
    )
    caps = backend_lib.capabilities(backend)
    for field, value, what, declared in (
        ("softcap", None if softcap is None else float(softcap), "softcap (Gemma's logit cap)", caps.softcap),
        ("logits_precision", logits_precision, "logits_precision", caps.logits_precision),
    ):
        if value is None:
            continue
        if not declared:
            raise UnsupportedConfigError(f"the LM-head backend {backend.name!r} has no {what}")
        backend = dataclasses.replace(backend, **{field: value})
    if grad_filter is not None and caps.grad_filter and (plan is None or plan.vocab_axis is None):
        backend = dataclasses.replace(backend, grad_filter=grad_filter)
    return LMHeadConfig(
        backend=sharding.local_backend(backend, plan, V),
        chunk_size=chunk,
        weight_layout=weight_layout,
        weight_dtype=weight.dtype,
        bias_dtype=None if bias is None else bias.dtype,
        with_entropy=with_entropy,
        plan=plan,
        row_buckets=tuning.row_buckets(backend),
    )


def make_plan(hidden, weight, mesh, data_axis, vocab_axis, B, V, weight_layout):
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


def plan_kwargs(plan) -> dict:
    if plan is None:
        return {}
    return dict(mesh=plan.mesh, data_axis=plan.data_axis, vocab_axis=plan.vocab_axis)
