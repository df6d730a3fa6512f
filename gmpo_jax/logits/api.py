"""The logits op's public function: check -> build the inputs pytree -> resolve the backend -> the custom VJP.

The custom VJP and its design decisions are in ``gmpo_jax.logits.vjp``; the memory-bound passes in the
backends (``xla.py``, ``mosaic_gpu.py``); the objectives in ``gmpo_jax.objectives``.
"""

from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gmpo_jax import _validation as V_
from gmpo_jax.batch import PolicyBatch
from gmpo_jax.logits import backend as backend_lib
from gmpo_jax.logits.vjp import LogitsConfig, logits_policy_loss
from gmpo_jax.logits.xla import entropy_and_lse
from gmpo_jax.objectives import LossAux, Objective, high_entropy_tokens, token_mean

__all__ = ["policy_loss_from_logits"]

ScalarLike = Union[float, Float[Array, ""]]


def policy_loss_from_logits(
    logits: Float[Array, "B T+1 V"] | Float[Array, "B T V"],
    batch: PolicyBatch,
    *,
    objective: Objective,
    temperature: ScalarLike = 1.0,
    implementation: Any = None,
) -> tuple[Float[Array, ""], LossAux]:
    r"""Policy-gradient loss (GMPO or the GRPO family) from logits that already exist.

    .. math::
        \log\pi_{b,t} = \mathrm{log\_softmax}\!\left(\frac{z_{b,t}}{\tau}\right)[y_{b,t}],\qquad
        \frac{\partial\mathcal{L}}{\partial z_{b,t,v}} = \frac{1}{\tau}
        \frac{\partial\mathcal{L}}{\partial\log\pi_{b,t}}\left(\mathbb{1}[v = y_{b,t}]
        - \mathrm{softmax}(z_{b,t}/\tau)_v\right)

    with the objective's loss of ``SPEC.md`` on :math:`\log\pi` (e.g. GMPO:
    :math:`\frac1B\sum_b -A_b \exp(\mathrm{mean}_t\,\mathrm{clip}(\log\pi - \log\pi_{old}))`), log-probs and
    loss in float32 whatever the logits' dtype. Memory-bound: the logits are read once or twice and ``dlogits``
    written once; beyond the logits and their gradient only ``[B, T]``-sized arrays are allocated (never a
    float32 or sliced copy of the logits; docs/DESIGN.md).

    Args:
      logits: ``[B, T + 1, V]`` (the usual causal-LM output over prompt-end + completion: position ``t``
        predicts ``batch.completion_ids[:, t]`` and the last position is dropped, lazily) or ``[B, T, V]``
        (already aligned); a floating dtype (``"xla"`` computes in float32 from any; the Mosaic kernels take
        bf16 / f16 / f32). At a counted token the row must hold no NaN or ``+inf`` and the own id's logit
        must not be ``-inf`` (a sampler never draws it); ``-inf`` elsewhere (a banned token) is fine. Checked
        when the logits are concrete; traced, such a row makes the loss NaN.
      batch: the per-token inputs, a :class:`~gmpo_jax.PolicyBatch` (its fields are documented there). A
        traced unmasked id out of range may also make that row of the gradient NaN when the loss is not (CISPO
        and SAPO with a zero advantage).
      objective: ``GMPO(...)``, ``GRPO(...)``, ``CISPO(...)`` or ``SAPO(...)`` with its hyper-parameters and
        loss shaping (:class:`~gmpo_jax.objectives.Objective`).
      temperature: ``> 0`` sampling temperature dividing the logits (float, or a traced scalar: one that is not
        finite and ``> 0`` makes the result NaN).
      implementation: None (``"mosaic_gpu"`` on Hopper-or-newer GPUs when it can serve the call, else
        ``"xla"``), an explicit name (never falls back), or a backend instance such as
        ``gmpo_jax.logits.MosaicGpuLogitsBackend(interpret=True)``; ``MosaicGpuLogitsBackend(inplace=True)``
        writes ``dlogits`` into the logits' buffer (Liger's ``inplace``; not under ``jax.vmap``).

    Returns:
      ``(loss, aux)``: ``loss`` a float32 scalar, ``aux`` a :class:`~gmpo_jax.LossAux` of float32 scalars (no
      gradient). The gradient with respect to ``logits`` has the logits' shape and dtype (zero at the dropped
      last position); everything else (the batch, ``temperature``, the objective) is data with a zero cotangent
      (``gmpo_jax.reference`` differentiates them too). Reverse mode only, first order (a ``jax.custom_vjp``: no
      ``jax.jvp`` / ``jacfwd``, no gradient of the gradient).

    Raises:
      TypeError: a ``batch`` that is not a ``PolicyBatch``, a non-objective; non-floating logits / advantages /
        log-probs; non-integer ids or segment ids; a ``batch.num_items_in_batch`` that is not a real scalar.
      ValueError:
        - inconsistent shapes (the argument or field named); an empty ``B``, ``T`` or ``V``;
        - a concrete ``temperature`` not finite and ``> 0``;
        - an objective with a KL term (``objective.has_kl``: static, fixed when it was built and kept by
          ``jax.tree.map``) without ``batch.ref_logps``;
        - concrete values the batch's fields rule out (see ``PolicyBatch``);
        - concrete logits with a NaN / ``+inf`` in a counted token's row, or ``-inf`` at its own id;
        - an unknown ``implementation`` (this op's are ``"xla"`` and ``"mosaic_gpu"``).
      UnsupportedConfigError / BackendUnavailableError: an explicitly requested implementation cannot serve
        this call (e.g. ``"mosaic_gpu"`` without a Hopper GPU, a dtype other than bf16 / f16 / f32, or rows of
        logits that the kernels' 128-byte tiles cannot cover).

    References: GMPO, arXiv 2507.20673; Liger-Kernel ``triton_grpo_loss``; TRL ``GRPOTrainer``.

    Example:
      >>> import jax, jax.numpy as jnp, gmpo_jax
      >>> logits = jax.random.normal(jax.random.key(0), (2, 4, 11))  # [B, T + 1, V]
      >>> ids = jnp.array([[1, 2, 3], [4, 5, -100]])
      >>> batch = gmpo_jax.PolicyBatch(ids, ids >= 0, advantages=jnp.array([1.0, -0.5]))
      >>> loss, aux = gmpo_jax.policy_loss_from_logits(logits, batch, objective=gmpo_jax.GMPO())
      >>> float(loss)  # on-policy: -mean_b A_b * exp(0)
      -0.25
      >>> jax.grad(lambda z: gmpo_jax.policy_loss_from_logits(z, batch, objective=gmpo_jax.GMPO())[0])(logits).shape
      (2, 4, 11)
    """
    B, T, Tl, V = V_.check_logits_inputs(logits, batch, objective, temperature)
    inputs = V_.policy_inputs(batch, objective, temperature)
    logits = jnp.asarray(logits)
    threshold = None
    if objective.top_entropy_quantile != 1.0:
        entropy, _ = entropy_and_lse(jax.lax.stop_gradient(logits), T, inputs.temperature)
        select, threshold = high_entropy_tokens(entropy, inputs.mask, objective.top_entropy_quantile)
        inputs = inputs._replace(token_select=select)
    backend = backend_lib.resolve(implementation, dtype=logits.dtype, B=B, T=T, Tl=Tl, V=V)
    with jax.named_scope(f"gmpo_jax/{backend.name}/policy_loss_from_logits"):
        loss, aux = logits_policy_loss(LogitsConfig(backend=backend, T=T), objective, logits, inputs)
    if threshold is None:
        return loss, aux
    return loss, aux._replace(entropy_threshold=threshold, entropy=token_mean(entropy, inputs.mask))
