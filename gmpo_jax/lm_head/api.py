"""The LM-head op's public functions: check -> build the inputs pytree -> resolve config -> the custom VJP.

No math lives here: the objectives are in ``gmpo_jax.objectives``, the chunk scan and its custom VJPs in
``gmpo_jax.lm_head.vjp``, the per-chunk LM-head computations in the backends (``xla_chunked.py``,
``mosaic_gpu.py``), the mesh layout in ``sharding.py``.
"""

from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int, Num

from gmpo_jax import _validation as V_
from gmpo_jax.lm_head import sharding
from gmpo_jax.lm_head.config import make_plan as _plan
from gmpo_jax.lm_head.config import placed as _placed
from gmpo_jax.lm_head.config import plan_kwargs as _plan_kwargs
from gmpo_jax.lm_head.config import resolve_config as _config
from gmpo_jax.lm_head.vjp import Head, fused_logprobs, fused_policy_loss
from gmpo_jax.objectives import LossAux, Objective, PolicyInputs, high_entropy_tokens, token_mean

__all__ = ["fused_linear_policy_loss", "fused_linear_logprobs"]

ScalarLike = Union[float, Float[Array, ""]]
AxisName = Union[str, tuple[str, ...]]


def fused_linear_policy_loss(
    hidden: Float[Array, "B T H"],
    weight: Float[Array, "H V"] | Float[Array, "V H"],
    completion_ids: Int[Array, "B T"],
    completion_mask: Num[Array, "B T"] | Bool[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    *,
    objective: Objective,
    old_logps: Float[Array, "B T"] | None = None,
    ref_logps: Float[Array, "B T"] | None = None,
    ref_hidden: Float[Array, "B T Hr"] | None = None,
    ref_weight: Array | None = None,
    bias: Float[Array, " V"] | None = None,
    ref_bias: Float[Array, " V"] | None = None,
    rollout_is_ratio: Array | None = None,
    num_items_in_batch: ScalarLike | None = None,
    temperature: ScalarLike = 1.0,
    segment_ids: Int[Array, "B T"] | None = None,
    rollout_logps: Float[Array, "B T"] | None = None,
    rollout_is_mode: str | None = None,
    rollout_is_cap: ScalarLike | None = None,
    top_entropy_quantile: float = 1.0,
    softcap: float | None = None,
    entropy_coef: ScalarLike | None = None,
    logits_precision: str | None = None,
    grad_filter: float | str | None = None,
    weight_layout: str = "hv",
    chunk_size: int | None = None,
    implementation: Any | None = None,
    vocab_size: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: AxisName | None = None,
    vocab_axis: AxisName | None = None,
) -> tuple[Float[Array, ""], LossAux]:
    r"""Policy-gradient loss (GMPO or the GRPO family) fused with the LM head.

    .. math::
        \log\pi_{b,t} = \mathrm{log\_softmax}\!\left(\frac{h_{b,t} W + c}{\tau}\right)[y_{b,t}]

    computed in float32 with a vocabulary-blocked online log-sum-exp, then the objective's loss of
    ``SPEC.md`` (e.g. GMPO: :math:`\frac1B\sum_b -A_b \exp(\mathrm{mean}_t\,\mathrm{clip}(\log\pi -
    \log\pi_{old}))`). The ``[B, T, V]`` logits are never materialised in float32: memory beyond the
    inputs is one float32 copy of the weight (gradient accumulator), the ``[B, T, H]`` hidden gradient
    and one chunk's vocabulary block. A call of one chunk needs no accumulator: there the Mosaic GPU
    kernels return the weight gradient in the weight's dtype (bfloat16; float16 weights and data-parallel
    calls keep float32) and may keep the chunk's logits for the gradient pass (docs/DESIGN.md). That
    bfloat16 weight gradient is rounded before the cotangent scales it: a loss scaled by a constant that is
    not a power of two is rounded twice (scale ``advantages`` instead, which gives the same gradient without
    ``beta`` or ``entropy_coef``, or use two chunks). Differentiable in ``hidden``, ``weight`` and ``bias``
    (custom VJP: the gradients are computed in the forward pass and scaled by the cotangent); evaluation
    without differentiation does no gradient work.

    Args:
      hidden: ``[B, T, H]`` bf16 / f16 / f32 final hidden states of the completion positions, already
        shifted (position ``t`` predicts ``completion_ids[:, t]``).
      weight: LM head, ``[H, V]`` (``weight_layout="hv"``, Flax ``Linear`` kernel) or ``[V, H]``
        (``"vh"``, tied embedding table); never transposed or copied.
      completion_ids: ``[B, T]`` integer sampled tokens. Masked positions may hold any value (e.g. -100
        or ``>= V``); an unmasked id outside ``[0, V)`` raises ValueError when the ids and the mask are
        concrete; traced (under jit) it has a NaN log-prob,
        which makes the loss NaN unless the objective ignores that token's value (e.g. a zero advantage
        and ``beta = 0``); ``aux.log_ratio_min`` / ``log_ratio_max`` are NaN then too.
      completion_mask: ``[B, T]`` bool or {0, 1}; 1 = the token counts.
      advantages: ``[B]`` float, one per row (group-normalised by the caller), or ``[B, T]`` one per token
        (packed batches). GMPO takes a sequence's advantage as the mean over its unmasked tokens
        (their common value when the advantage is per sequence).
      objective: ``GMPO(...)``, ``GRPO(...)``, ``CISPO(...)`` or ``SAPO(...)`` with its hyper-parameters.
      old_logps: ``[B, T]`` float behaviour-policy log-probs; None = on-policy (``old = sg(logp)``).
      ref_logps: ``[B, T]`` float reference log-probs for the KL term. Given to an objective without a KL
        term (``objective.has_kl`` False) it is ignored: a UserWarning once per process, at the caller's line.
      ref_hidden, ref_weight, ref_bias: instead of ``ref_logps``, the reference model's hidden states
        ``[B, T, H_ref]`` and LM head (same ``weight_layout``); its log-probs are computed with the same
        fused path, without gradient (not at all for an objective without a KL term: ignored and warned,
        as ``ref_logps``).
      bias: ``[V]`` LM-head bias or None.
      rollout_is_ratio: ``[B, T]``, ``[B, 1]`` or ``[B]`` precomputed importance weights ``>= 0`` of the
        trainer vs the sampler (Liger's ``vllm_is_ratio``), no gradient; multiplies each token's policy
        term (not the KL). GMPO multiplies each sequence's term by the geometric mean of its tokens'
        weights (SPEC.md "Rollout correction").
      rollout_logps: ``[B, T]`` float log-probs of the sampler (e.g. vLLM) for the mismatch correction
        computed here from ``old_logps`` (or the current log-probs, on-policy) and these, per
        ``rollout_is_mode``; combines with ``rollout_is_ratio``. None: no correction.
      rollout_is_mode: ``"token_truncate"`` (None: this default), ``"token_mask"``, ``"sequence_truncate"``
        or ``"sequence_mask"`` (TRL's ``vllm_importance_sampling_mode``), see
        :class:`gmpo_jax.objectives.RolloutCorrection` for each formula, GMPO's included. Only with
        ``rollout_logps`` (ValueError otherwise).
      rollout_is_cap: ``> 0`` truncation / masking threshold of the weight (float or traced; None: 2.0),
        only with ``rollout_logps``. A traced cap ``<= 0`` cannot raise: it makes the loss NaN.
      num_items_in_batch: scalar, the dapo / cispo normaliser override: the number of active (unmasked)
        completion tokens in ONE optimizer step's accumulation window, i.e. every micro-batch whose
        gradients are accumulated into one update (under data parallelism: the global count over all
        devices, since the normalisers are global). Not the token count of a whole generation batch
        when it spans more micro-steps than one optimizer step accumulates: that scales each update
        by ``gas / steps_per_generation`` (TRL #5619). With ``optax.MultiSteps`` (which averages the
        accumulated gradients) multiply each micro-step's loss by the number of accumulation steps.
        A real scalar (TypeError for a bool, a string, a list or a vector, for every loss type). For dapo /
        cispo a concrete value must be finite and ``>= 1`` (ValueError; any real: a per-process share
        ``count / processes`` need not be integral); a traced one cannot be checked: the normaliser is
        ``max(n, 1)`` and a NaN propagates (NaN loss). The other loss types ignore it, whatever its value,
        and warn once per loss type at the caller's line (trainers pass it for every loss type, as the
        Hugging Face ``Trainer`` does; ``_validation.check_num_items``). docs/guide.md: "`num_items_in_batch` under gradient accumulation".
      temperature: ``> 0`` sampling temperature dividing the logits (float or traced scalar).
      segment_ids: ``[B, T]`` integer or None: a packed batch, several sequences per row (the layout
        of Tunix and MaxText). Each maximal run of equal positive ids within a row is one sequence; id 0
        is padding (masked whatever ``completion_mask`` says). Every per-sequence reduction (GMPO's
        geometric mean, GSPO's sequence ratio, grpo / sapo's per-sequence mean) runs per sequence, and
        the ``B`` of the normalisers (gmpo, grpo, sapo, dr_grpo) is the number of sequences, so the same
        sequences padded one per row give the same loss and gradients. Pass ``[B, T]`` advantages
        (and a ``[B, T]`` ``rollout_is_ratio``) with it. Rows are chunked and sharded whole.
      top_entropy_quantile: Python float in ``(0, 1]`` (TRL's name; default 1: every token). Below 1 only
        the tokens whose entropy (of the temperature-scaled softmax) is at or above the
        ``1 - top_entropy_quantile`` quantile of the unmasked tokens' entropies (over the global batch)
        receive policy gradient ("Beyond the 80/20 rule", arXiv 2506.01939): the token-level objectives
        multiply the others' policy term by 0 (their tokens still count in the normalisers, as in TRL),
        GMPO keeps them in the geometric mean without gradient. The KL term is not selected. Costs one
        more log-sum-exp pass (entropies; no gradient); ``aux.entropy_threshold`` is the quantile.
      softcap: None, or the final-logit soft cap ``c > 0`` of Gemma-family models
        (``final_logit_softcapping``): the logits are ``c tanh((h W + b) / c) / temperature``, on every
        implementation (the Mosaic kernels compute the cap in their epilogues) and for ``ref_hidden`` too.
      entropy_coef: None (default), or a scalar ``c`` (float or traced): the loss gains the entropy term
        ``-c * agg(H)``, ``H`` the per-token entropy of ``softmax(z / temperature)`` aggregated as the
        objective aggregates its KL term (per-sequence mean for gmpo / grpo / sapo, token sum over the
        loss's normaliser for bnpo / dapo / dr_grpo / cispo; SPEC.md "Entropy term"), with its exact
        gradient ``dH/dz = -p (log p + H) / temperature`` formed in the same passes as the policy
        gradient (no logits materialised). ``c > 0`` rewards entropy (verl's ``entropy_coeff``).
      logits_precision: None (default), ``"float32"`` or ``"bf16x3"``: how accurately the LM head's products
        are computed. None: in the inputs' dtype with float32 accumulation (16-bit products are exact; the
        logits' gradient is rounded to the inputs' 16-bit dtype before the two gradient GEMMs), and a
        float32 ``hidden`` / ``weight`` runs the portable path at ``Precision.HIGHEST``. ``"float32"``:
        float32-accurate logits and gradients on every path: the Mosaic kernels split float32 (and
        float16) operands into three bfloat16 parts and sum the six leading products (as XLA's
        ``BF16_BF16_F32_X6``), keep the logits' gradient in float32 and multiply its parts the same way;
        ``hidden`` and ``weight`` may then each be bf16, f16 or f32 (ScaleRL's float32 LM head, arXiv
        2510.13786). ``"bf16x3"``: two parts and three products in the kernels (up to ``3 * 2**-16``
        of each product instead of float32's ``2**-24``; half the work); the portable path computes
        both like ``"float32"``. Costs: docs/performance.md "Float32 LM head".
      grad_filter: None (default: the exact gradient, unless an ``implementation=MosaicGpuBackend(grad_filter=...)``
        instance sets its own), ``"auto"`` (the threshold ``tuning.GRAD_FILTER_AUTO``) or a real number ``tau``
        in ``[0, 1)`` (static; given here it replaces the backend's): the LM head's gradient may skip, per token
        row, each vocabulary window of ``tuning.GRAD_FILTER_WINDOW`` columns whose softmax mass off the row's
        target is ``<= tau`` (the target's own window is always kept; the windows from column
        ``tuning.GRAD_FILTER_TAIL`` on are kept or skipped together). A row ``r`` with cotangent ``c_r = d loss /
        d logp_r`` and dropped mass ``D_rk`` in window ``k`` gets ``-c_r sum_k D_rk mean_k(W) / temperature``
        added to its hidden-state gradient (``mean_k(W)``: the window's mean weight column over the columns a
        ``-inf`` bias does not remove). Error bound: the row's hidden-state gradient moves by at most ``|c_r|
        sum_k D_rk max_(v in k) |W_v - mean_k(W)| / temperature`` (``sum_k D_rk <= (n_windows - 1) tau``) and
        each weight column ``v`` by at most ``sum_r |c_r| p_(r,v) |h_r| / temperature`` over the rows that
        dropped it. Off (the exact gradient) with a ``softcap``; rows with an ``entropy_coef`` term keep every
        window. Only the ``mosaic_gpu`` backend skips work; the others (and vocabulary-parallel calls) return the
        exact gradient. No effect on the loss, the metrics or evaluation without gradients. How it works:
        docs/DESIGN.md "The gradient filter"; accuracy and speed: docs/performance.md "Gradient filter".
      weight_layout: ``"hv"`` or ``"vh"`` (see ``weight``).
      chunk_size: sequences per chunk (``>= 1``; need not divide ``B``). None: about
        ``tuning.TARGET_ROWS`` tokens per chunk.
      implementation: None (best available: ``"mosaic_gpu"`` on Hopper GPUs, else ``"xla_chunked"``;
        a Mosaic configuration it cannot serve falls back with one warning), an explicit name, which
        never falls back, or a backend instance (e.g.
        ``gmpo_jax.lm_head.MosaicGpuBackend(interpret=True)`` for the kernels in the Pallas
        interpreter). Which one ran is logged on the ``gmpo_jax`` logger (INFO).
      vocab_size: the real vocabulary when the LM head is padded to ``V`` (e.g. to a multiple of the
        vocabulary shards): columns ``>= vocab_size`` are left out of the softmax and get zero gradient;
        an unmasked id in ``[vocab_size, V)`` is out of range (ValueError if concrete, else NaN). None:
        all ``V`` columns are real.
      mesh: the ``jax.sharding.Mesh`` of ``data_axis`` / ``vocab_axis`` (None: the ``jax.set_mesh`` one).
      data_axis: mesh axis name (or tuple of names) the batch ``B`` is split over: data parallel, ``B`` a
        multiple of its size. Normalisers and metrics stay global: the result equals the unsharded one.
      vocab_axis: mesh axis name(s) the weight's (and bias') vocabulary ``V`` is split over: vocabulary
        parallel, ``V`` a multiple of its size; the weight is never gathered. With neither axis, inputs
        sharded over ``Explicit`` mesh axes have their axes read from ``hidden`` and ``weight``. See
        ``gmpo_jax.lm_head.sharding``; gradients come back sharded like the primals.

    Returns:
      ``(loss, aux)``: ``loss`` a float32 scalar, ``aux`` a :class:`LossAux` of float32 scalars. Their
      gradients w.r.t. ``hidden``, ``weight`` and ``bias`` come in those arguments' dtypes.

    Gradients and what cannot be checked under ``jit``: reverse mode only (a ``jax.custom_vjp``:
    ``jax.grad`` / ``vjp`` work, ``jax.jvp`` / ``jacfwd`` do not). Only ``hidden``, ``weight`` and ``bias`` receive
    gradients (``temperature``, advantages, old / reference log-probs, the IS ratio and the objective's
    hyper-parameters are treated as data: zero cotangent). A traced ``completion_mask`` is taken as
    ``!= 0`` (a concrete one must hold only 0 and 1), a traced ``temperature`` is not checked for
    ``> 0``, and a traced unmasked out-of-range id gives NaN (a concrete one raises). Hidden states at masked positions must be finite
    (their ids are ignored, but ``0 * NaN`` in the weight gradient is still NaN). With ``mesh=``, take
    gradients under ``jax.jit`` or inside ``jax.set_mesh(mesh)`` (JAX needs the mesh context to build the
    cotangent of a mesh-sharded scalar).

    Raises:
      TypeError:
        - non-floating ``hidden`` / ``weight`` / ``advantages`` / log-probs;
        - non-integer ``completion_ids`` or ``segment_ids``;
        - an ``objective`` that is not an objective;
        - a ``num_items_in_batch`` that is not a real scalar (a bool, a string, a list, a vector);
        - a ``grad_filter`` that is neither None, ``"auto"`` nor a number.
      ValueError:
        - inconsistent shapes (the argument named); an empty ``B``, ``T``, ``H`` or ``V``;
        - ``weight`` not ``[H, V]`` / ``[V, H]`` as ``weight_layout`` declares; an unknown ``weight_layout``;
        - a concrete ``temperature`` not finite and ``> 0``; ``chunk_size < 1``;
        - an objective with a KL term (``objective.has_kl``: its ``beta`` non-zero or traced when it was
          built, kept by ``jax.tree.map``) without a reference; both ``ref_logps`` and ``ref_hidden``;
        - a concrete ``num_items_in_batch`` not finite and ``>= 1`` (dapo / cispo);
        - concrete non-finite ``advantages``; concrete negative ``segment_ids``;
        - a concrete ``rollout_is_ratio`` not finite and ``>= 0``;
        - ``old_logps`` / ``ref_logps`` / ``rollout_logps`` / ``ref_hidden`` NaN at an unmasked token (concrete;
          the error names the first ``(b, t)``);
        - an unknown ``rollout_is_mode`` or a concrete ``rollout_is_cap <= 0``, or either without
          ``rollout_logps``;
        - ``top_entropy_quantile`` outside ``(0, 1]``; a concrete non-finite ``entropy_coef``;
        - an unknown ``logits_precision``; a ``grad_filter`` string other than ``"auto"`` or a number outside
          ``[0, 1)``;
        - a concrete mask with values other than 0 / 1; a concrete unmasked id outside ``[0, V)``;
        - an unknown ``implementation`` name; ``vocab_size`` outside ``[1, V]``;
        - mesh axes not in the mesh or not dividing ``B`` / ``V``.
      UnsupportedConfigError: an explicitly requested implementation cannot serve this call.

    References: GMPO, arXiv 2507.20673; Liger-Kernel ``LigerFusedLinearGRPOLoss``; TRL ``GRPOTrainer``.

    Example:
      >>> import jax, jax.numpy as jnp, gmpo_jax
      >>> k = jax.random.split(jax.random.key(0), 3)
      >>> h = jax.random.normal(k[0], (2, 3, 8)); w = jax.random.normal(k[1], (8, 11)) / 3
      >>> ids = jax.random.randint(k[2], (2, 3), 0, 11); mask = jnp.array([[1, 1, 0], [1, 1, 1]])
      >>> loss, aux = gmpo_jax.fused_linear_policy_loss(h, w, ids, mask, jnp.array([1.0, -0.5]),
      ...                                               objective=gmpo_jax.GMPO())
      >>> float(loss)  # on-policy: -mean_b A_b * exp(0)
      -0.25
    """
    token_args = V_.token_args(locals())
    B, T, H, V = V_.check_policy_inputs(
        hidden=hidden,
        weight=weight,
        ref_hidden=ref_hidden,
        ref_weight=ref_weight,
        bias=bias,
        ref_bias=ref_bias,
        weight_layout=weight_layout,
        chunk_size=chunk_size,
        vocab_size=vocab_size,
        **token_args,
    )
    V_.check_top_entropy_quantile(top_entropy_quantile)
    V_.check_softcap(softcap)
    V_.check_logits_precision(logits_precision)
    tau = V_.grad_filter_threshold(grad_filter)
    plan = _plan(hidden, weight, mesh, data_axis, vocab_axis, B, V, weight_layout)
    inputs = V_.policy_inputs(**token_args)
    head_args = dict(
        weight_layout=weight_layout,
        chunk_size=chunk_size,
        implementation=implementation,
        softcap=softcap,
        logits_precision=logits_precision,
    )
    threshold = None
    if top_entropy_quantile != 1.0:
        _, entropy = fused_linear_logprobs(
            hidden, weight, inputs.ids, completion_mask=inputs.mask, bias=bias, temperature=inputs.temperature,
            vocab_size=vocab_size, return_entropy=True, **head_args, **_plan_kwargs(plan),
        )  # fmt: skip
        select, threshold = high_entropy_tokens(lax.stop_gradient(entropy), inputs.mask, top_entropy_quantile)
        inputs = inputs._replace(token_select=select)
    if ref_hidden is not None and objective.has_kl:  # without a KL term it is ignored (warned)
        ref_logps = lax.stop_gradient(
            fused_linear_logprobs(
                ref_hidden,
                ref_weight,
                inputs.ids,
                completion_mask=inputs.mask,
                bias=ref_bias,
                temperature=inputs.temperature,
                vocab_size=vocab_size,
                **head_args,
                **_plan_kwargs(plan),
            )
        )
        inputs = inputs._replace(ref_logps=ref_logps)
    ids, bias = sharding.mask_padded_vocab(inputs.ids, bias, V, vocab_size)
    cfg = _config(hidden, weight, bias, T, V, plan, **head_args, grad_filter=tau)
    head, inputs = _placed(plan, Head(hidden, weight, bias), inputs._replace(ids=ids))
    loss, aux = fused_policy_loss(cfg, objective, head, inputs)
    if threshold is None:
        return loss, aux
    return loss, aux._replace(entropy_threshold=threshold, entropy=token_mean(lax.stop_gradient(entropy), inputs.mask))


def fused_linear_logprobs(
    hidden: Float[Array, "B T H"],
    weight: Float[Array, "H V"] | Float[Array, "V H"],
    completion_ids: Int[Array, "B T"],
    *,
    completion_mask: Num[Array, "B T"] | Bool[Array, "B T"] | None = None,
    bias: Float[Array, " V"] | None = None,
    temperature: ScalarLike = 1.0,
    weight_layout: str = "hv",
    chunk_size: int | None = None,
    implementation: Any | None = None,
    vocab_size: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: AxisName | None = None,
    vocab_axis: AxisName | None = None,
    return_entropy: bool = False,
    softcap: float | None = None,
    logits_precision: str | None = None,
) -> Float[Array, "B T"] | tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    r"""Per-token log-probs (and optionally entropies) through the LM head without materialising the logits.

    .. math::
        \log\pi_{b,t} = z_{b,t,y} - \log\sum_v e^{z_{b,t,v}},\qquad z = \mathrm{cap}(h W + c) / \tau

    (``cap`` the identity, or Gemma's ``s tanh(x / s)`` with ``softcap=s``).

    For rollout-time old-policy and reference log-probs, or any loss of your own: it is differentiable
    (its own custom VJP; one cotangent per token; the logits are recomputed block by block in the
    backward, and the forward's log-sum-exp is reused).

    Args:
      hidden: ``[B, T, H]`` bf16 / f16 / f32 hidden states.
      weight: ``[H, V]`` (``weight_layout="hv"``) or ``[V, H]`` (``"vh"``) LM head.
      completion_ids: ``[B, T]`` integer target ids. Without a mask, an id outside ``[0, V)`` raises
        ValueError when concrete and gives NaN when traced.
      completion_mask: optional ``[B, T]`` bool / {0, 1}; masked positions return 0, receive no gradient
        and may hold any id.
      bias: optional ``[V]`` LM-head bias.
      temperature: ``> 0`` logits temperature (float or traced scalar).
      weight_layout, chunk_size, implementation, vocab_size, mesh, data_axis, vocab_axis: as in
        :func:`fused_linear_policy_loss`.
      return_entropy: also return the per-token entropy of the (temperature-scaled) softmax,
        :math:`\mathcal{H}_{b,t} = \log\sum_v e^{z_v} - \sum_v p_v z_v` in nats, in ``[0, log V]`` (``V`` =
        ``vocab_size`` when given: padded columns are outside the softmax): what TRL
        logs as ``entropy`` and thresholds for its top-entropy token masking. Computed in the same pass
        as the log-sum-exp (one extra running sum per row). A metric: it carries **no gradient** (its
        cotangent is ignored; differentiate the log-probs only). Every implementation computes it
        (``mosaic_gpu``: two more float32 operations per logit in the log-prob kernel).
      softcap: None or Gemma's final-logit soft cap ``c > 0``, as in :func:`fused_linear_policy_loss`.
      logits_precision: None, ``"float32"`` or ``"bf16x3"``, as in :func:`fused_linear_policy_loss`.

    Returns:
      ``[B, T]`` float32 log-probs; with ``return_entropy`` the pair ``(logp, entropy)``, both ``[B, T]``
      float32 and 0 at masked positions.

    Raises:
      TypeError / ValueError: as :func:`fused_linear_policy_loss`, for the arguments it takes; TypeError
        for a ``return_entropy`` that is not a bool.

    Example:
      >>> import jax, jax.numpy as jnp, gmpo_jax
      >>> h = jnp.zeros((1, 2, 4)); w = jnp.ones((4, 5))
      >>> logp = gmpo_jax.fused_linear_logprobs(h, w, jnp.array([[0, 4]]))  # uniform logits: log(1/5)
      >>> [round(float(x), 4) for x in logp[0]]
      [-1.6094, -1.6094]
    """
    B, T, H, V = V_.check_lm_head(hidden, weight, bias, weight_layout)
    V_.check_ids(completion_ids, B, T)
    if completion_mask is not None:
        V_.check_mask(completion_mask, B, T)
    V_.check_temperature(temperature)
    V_.check_chunk_size(chunk_size)
    V_.check_vocab_size(vocab_size, V)
    V_.check_ids_in_range(completion_ids, completion_mask, vocab_size or V)
    if not isinstance(return_entropy, (bool, np.bool_)):
        raise TypeError(f"return_entropy must be a bool, got return_entropy={return_entropy!r}")
    V_.check_softcap(softcap)
    V_.check_logits_precision(logits_precision)
    plan = _plan(hidden, weight, mesh, data_axis, vocab_axis, B, V, weight_layout)
    mask = jnp.ones((B, T), jnp.bool_) if completion_mask is None else V_.as_mask(completion_mask)
    ids, bias = sharding.mask_padded_vocab(jnp.where(mask, V_.as_ids(completion_ids), 0), bias, V, vocab_size)
    inputs = PolicyInputs(mask=mask, advantages=None, ids=ids, temperature=jnp.asarray(temperature, jnp.float32))
    cfg = _config(
        hidden,
        weight,
        bias,
        T,
        V,
        plan,
        chunk_size=chunk_size,
        weight_layout=weight_layout,
        implementation=implementation,
        with_entropy=bool(return_entropy),
        softcap=softcap,
        logits_precision=logits_precision,
    )
    out = fused_logprobs(cfg, *_placed(plan, Head(hidden, weight, bias), inputs))
    if return_entropy:
        return out[0], lax.stop_gradient(out[1])
    return out
