"""Exact work skipping in the LM-head chunk step: the rows that need work first, a static prefix of them.

A trained policy's RL batch has many rows that need no LM-head work: padding and masked tokens (no
log-prob is needed), and rows whose ``d loss / d logp`` is exactly zero (sequences with advantage 0 and
no KL term, clipped tokens), which need no gradient GEMMs. XLA shapes are static, so the chunk's rows
are reordered (a stable partition by "needs work": live rows first) and the backend runs on a *prefix*
of the reordered rows, chosen by ``lax.switch`` among a few static sizes (``tuning.ROW_BUCKETS``): the
smallest that holds every live row. The forward's live rows are the unmasked ones; the backward's those
whose ``d loss / d logp`` is non-zero (each pass orders its own). Nothing is approximated: the skipped
rows' log-probs are never read and their gradients are exactly zero. The cost is one gather of the rows'
hidden states per pass, a scatter of the results, and one compiled program per bucket size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gmpo_jax import tuning

__all__ = [
    "RowOrder",
    "order",
    "prefix_sizes",
    "prefix_index",
    "prefix_rows",
    "on_prefix",
    "on_live_rows",
    "take",
    "scatter_back",
]


class RowOrder(NamedTuple):
    """A chunk's ``R`` rows reordered so that the rows needing work come first.

    Attributes:
      perm: ``[R]`` int32, position -> row.
      inv: ``[R]`` int32, row -> position.
      n_live: int32 scalar, the number of live rows.
    """

    perm: jax.Array
    inv: jax.Array
    n_live: jax.Array


def order(live: jax.Array) -> RowOrder:
    """The order of the rows of ``live`` (bool, flattened): live rows first, stable within each group.

    A stable partition by prefix sums (what a stable ``argsort`` of the 0/1 key gives, without a sort:
    the gradient filter orders the rows once per vocabulary window, where sorts cost milliseconds)."""
    live = jnp.asarray(live).reshape(-1) != 0  # any 0/1 dtype (``~`` of an integer would be bitwise)
    n_live = jnp.sum(live, dtype=jnp.int32)
    inv = jnp.where(
        live, jnp.cumsum(live, dtype=jnp.int32) - 1, n_live + jnp.cumsum(~live, dtype=jnp.int32) - 1
    ).astype(jnp.int32)
    perm = jnp.zeros_like(inv).at[inv].set(jnp.arange(inv.size, dtype=jnp.int32), unique_indices=True)
    return RowOrder(perm, inv, n_live)


def prefix_sizes(rows: int, buckets: int) -> tuple[int, ...]:
    """The static prefix sizes: ``buckets`` steps of ``rows / buckets``, rounded up to
    ``tuning.ROW_ALIGN`` rows (the kernels' row blocks), the last being ``rows``."""

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    align = tuning.ROW_ALIGN
    return tuple(sorted({min(rows, cdiv(cdiv(k * rows, buckets), align) * align) for k in range(1, buckets + 1)}))


def take(x: jax.Array, order_: RowOrder, size: int) -> jax.Array:
    """The first ``size`` rows of ``x`` (``[R, ...]``) in the order."""
    return jnp.take(x, order_.perm[:size], axis=0)


def scatter_back(x: jax.Array, order_: RowOrder) -> jax.Array:
    """``x`` (``[size, ...]``, positions ``0..size-1`` of the order) back in row order, zeros elsewhere."""
    rows = order_.perm.size
    full = jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    return jnp.take(full, order_.inv, axis=0)


def prefix_index(n: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """The ``lax.switch`` index of :func:`on_prefix`: 0 when ``n == 0``, else ``1 +`` the position of the smallest
    size ``>= n``."""
    return jnp.where(n == 0, 0, 1 + jnp.searchsorted(jnp.asarray(sizes, jnp.int32), n, side="left")).astype(jnp.int32)


def prefix_rows(n: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """The rows :func:`on_prefix` runs on for ``n`` live rows: the smallest size ``>= n`` (0 when ``n == 0``)."""
    return jnp.asarray((0, *sizes), jnp.int32)[prefix_index(n, sizes)]


def on_prefix(n: jax.Array, sizes: tuple[int, ...], run: Callable, empty: Callable | None = None):
    """``run(S)`` for the smallest ``S`` in ``sizes`` with ``S >= n``, or ``empty()`` when ``n == 0``
    (``lax.switch``: one branch runs). Outputs whose dtype differs between the ``run`` branches (e.g. a
    16-bit weight gradient where the backend kept its logits, float32 where it did not) are promoted to
    a common one; ``empty``'s outputs take those dtypes (None: zeros shaped like ``run``'s outputs)."""
    runs = [lambda S=S: run(S) for S in sizes]
    shapes = [jax.eval_shape(b) for b in runs]
    target = jax.tree.map(lambda *s: jnp.result_type(*(x.dtype for x in s)), *shapes)
    if empty is None:
        empty = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0])  # noqa: E731

    def cast(b):
        return lambda: jax.tree.map(lambda x, d: x.astype(d), b(), target)

    return lax.switch(prefix_index(n, sizes), [cast(b) for b in [empty] + runs])


def on_live_rows(
    buckets: int, live: jax.Array, fn: Callable, arrays: tuple, accumulators=None, row_prefix: bool = False
):
    """``fn(*arrays)`` (each ``[R, ...]``) on every row when ``buckets <= 1``, else on the rows reordered live first
    (``live``: ``R`` bools in any shape), its per-row outputs scattered back (zeros elsewhere): on the static
    prefix that holds every live row (one ``lax.switch`` branch per prefix size), or, with ``row_prefix`` (a
    backend that serves a runtime prefix: ``Capabilities.row_prefix`` for a forward, ``row_prefix_grads`` for a
    backward), on all of them as ``fn(*arrays, n_rows=number of live rows)`` (one program).

    ``accumulators``: None for a forward (every output per-row); else ``fn`` returns ``(dh, *accumulators)``
    (the weight / bias gradients it accumulated into), and when no row is live they pass through unchanged."""
    if buckets <= 1:
        return fn(*arrays)
    order_ = order(live)
    R = order_.perm.size
    if row_prefix:
        out = fn(*(take(x, order_, R) for x in arrays), n_rows=order_.n_live)
        if accumulators is not None:
            return scatter_back(out[0], order_), *out[1:]
        return jax.tree.map(lambda x: scatter_back(x, order_), out)

    def run(S):
        out = fn(*(take(x, order_, S) for x in arrays))
        if accumulators is not None:
            return scatter_back(out[0], order_), *out[1:]
        return jax.tree.map(lambda x: scatter_back(x, order_), out)  # a tuple or a Forward (None fields kept)

    empty = (
        None
        if accumulators is None
        else (lambda: (jnp.zeros((R, *arrays[0].shape[1:]), arrays[0].dtype), *accumulators))
    )
    return on_prefix(order_.n_live, prefix_sizes(R, buckets), run, empty)
