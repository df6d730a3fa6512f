"""Trainer-vs-sampler mismatch correction from the sampler's log-probs (``rollout_logps``), every mode,
every objective (GMPO's geometric-mean forms included), both ops, against the float64 oracle.

The oracle (``spec_numpy.spec_loss_from_logp``) implements SPEC.md "Rollout correction" on its own: the
weight ``min(e^d, cap)`` / ``e^d [e^d <= cap]`` per token or per sequence (``d = old - sampler``, on-policy
``old = logp``) multiplying the token-level objectives' policy term, and for GMPO one weight per
sequence, the geometric mean of its tokens' weights (``token_mask``: the dropped tokens leave the
geometric mean). Sampler log-probs are the oracle's log-probs plus noise of +-0.6, so with ``cap = 1.3``
some tokens and sequences are truncated or masked and some are not. Tolerances: ``conftest.TOLERANCES``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spec_numpy as spec
from conftest import DTYPES, Obj, assert_grad_close, assert_loss_close, check_against_spec, make_case

import gmpo_jax
from gmpo_jax.lm_head.mosaic_gpu import MosaicGpuBackend
from gmpo_jax.logits.mosaic_gpu import MosaicGpuLogitsBackend
from gmpo_jax.objectives import ROLLOUT_IS_MODES

CAP = 1.3
B, T, H, V = 5, 7, 64, 200
V_LOGITS = 2048  # the logits kernels' smallest view (as test_contract)


def _case(seed, *, dtype="float32", off_policy=True, ris=None, V=V):
    case = make_case(seed, B=B, T=T, H=H, V=V, dtype=DTYPES[dtype], off_policy=off_policy, ris=ris)
    rng = np.random.default_rng(seed + 100)
    old = case.logp64 if case.old is None else case.old
    rollout = np.where(case.mask, old - rng.uniform(-0.6, 0.6, size=(B, T)), 0.0).astype(np.float32)
    return case, rollout


def _spec(case, rollout, obj: Obj, mode, *, ris=None):
    return spec.spec_policy_loss(
        case.hidden, case.weight, case.ids, case.mask, case.adv, weight_layout=case.layout,
        old_logps=case.old, ref_logps=case.ref, rollout_is_ratio=ris, rollout_logps=rollout,
        rollout_is_mode=mode, rollout_is_cap=CAP, **obj.spec_kwargs(),
    )  # fmt: skip


def _lm_head(case, rollout, obj: Obj, mode, implementation, *, ris=None, chunk_size=2):
    def f(h, w):
        return gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(
                case.ids,
                case.mask,
                case.adv,
                old_logps=case.old,
                ref_logps=case.ref,
                rollout_logps=rollout,
                rollout_is_ratio=ris,
            ),
            objective=obj.lib(rollout_is_mode=mode, rollout_is_cap=CAP),
            head=gmpo_jax.HeadOptions(chunk_size=chunk_size, implementation=implementation),
        )

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        jnp.asarray(case.hidden), jnp.asarray(case.weight)
    )


OBJECTIVES = [
    Obj("gmpo", beta=0.04),
    Obj("grpo"),
    Obj("dapo", level="sequence"),
    Obj("cispo", epsilon_high=1.3),
    Obj("sapo"),
]


@pytest.mark.parametrize("mode", ROLLOUT_IS_MODES)
@pytest.mark.parametrize("obj", OBJECTIVES, ids=str)
def test_lm_head_modes(obj, mode):
    case, rollout = _case(OBJECTIVES.index(obj))
    want = _spec(case, rollout, obj, mode)
    assert want.margin > 1e-4, "test setup: a weight or ratio sits within 1e-4 of its bound"
    (loss, aux), grads = _lm_head(case, rollout, obj, mode, "xla_chunked")
    check_against_spec(loss, aux, (*grads, None), want, case, obj)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("obj", [Obj("gmpo"), Obj("grpo")], ids=str)
def test_on_policy_and_with_a_precomputed_ratio(obj, mode):
    """On-policy (``old = logp``, from the fused pass itself) and combined with ``rollout_is_ratio``."""
    case, rollout = _case(7, off_policy=False, ris="bt")
    want = _spec(case, rollout, obj, mode, ris=case.ris)
    (loss, aux), grads = _lm_head(case, rollout, obj, mode, "xla_chunked", ris=case.ris)
    check_against_spec(loss, aux, (*grads, None), want, case, obj)


@pytest.mark.parametrize(
    "obj, mode", [(Obj("gmpo"), "token_mask"), (Obj("grpo", beta=0.04), "sequence_truncate")], ids=str
)
def test_kernels_in_the_interpreter(obj, mode):
    """The kernels see only the cotangents: one token-level mode (masked tokens: rows the backward skips) with the
    sequence-level objective, one sequence-level mode with the token-level objective and its KL term (the mode x
    objective grid runs on ``xla_chunked`` above). One chunk: the interpreter runs the kernels once per chunk
    (the Mosaic kernels under the chunk scan: ``test_kernels``, ``test_row_skipping``, ``test_logits_precision``)."""
    case, rollout = _case(3, dtype="bfloat16")
    want = _spec(case, rollout, obj, mode)
    (loss, aux), grads = _lm_head(case, rollout, obj, mode, MosaicGpuBackend(interpret=True), chunk_size=None)
    check_against_spec(loss, aux, (*grads, None), want, case, obj)


@pytest.mark.parametrize(
    "obj,mode,impl",
    [(o, m, "xla") for o in (Obj("gmpo"), Obj("grpo")) for m in ROLLOUT_IS_MODES]
    + [(Obj("grpo"), "token_truncate", "mosaic_gpu"), (Obj("gmpo"), "token_mask", "mosaic_gpu")],
    ids=str,
)
def test_logits(obj, mode, impl):
    """``policy_loss_from_logits``: the token-local objectives leave the fused kernel for the three-pass
    path when a sampler log-prob is given (``token_loss`` has no such input)."""
    case, rollout = _case(11, V=V_LOGITS)
    w = np.asarray(case.weight, np.float64)
    z = np.asarray(case.hidden, np.float64) @ w
    dtype = "float32" if impl == "xla" else "bfloat16"
    logits = np.concatenate([z, z[:, :1]], axis=1).astype(DTYPES[dtype])
    zl = np.asarray(logits, np.float64)[:, :T]
    logsm = zl - zl.max(-1, keepdims=True)
    logsm = logsm - np.log(np.exp(logsm).sum(-1, keepdims=True))
    lp = np.where(case.mask, np.take_along_axis(logsm, np.where(case.mask, case.ids, 0)[..., None], -1)[..., 0], 0.0)
    want = spec.spec_loss_from_logp(
        lp, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref, rollout_logps=rollout,
        rollout_is_mode=mode, rollout_is_cap=CAP, **obj.spec_kwargs(),
    )  # fmt: skip
    onehot = np.arange(V_LOGITS) == np.where(case.mask, case.ids, -1)[..., None]
    dwant = np.zeros(logits.shape)
    dwant[:, :T] = np.where(case.mask[..., None], want.dlogp[..., None] * (onehot - np.exp(logsm)), 0.0)
    implementation = "xla" if impl == "xla" else MosaicGpuLogitsBackend(interpret=True)
    f = lambda x: gmpo_jax.policy_loss_from_logits(
        x,
        gmpo_jax.PolicyBatch(
            case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref, rollout_logps=rollout
        ),
        objective=obj.lib(rollout_is_mode=mode, rollout_is_cap=CAP),
        implementation=implementation,
    )
    (loss, _), g = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(logits))
    assert_loss_close(loss, want.loss, want.scale, np.dtype(DTYPES[dtype]))
    assert_grad_close(np.asarray(g), dwant, DTYPES[dtype], "dlogits")


def test_cap_inf_is_the_plain_ratio_and_cap_is_traced():
    """``cap = inf``: token_truncate is the plain importance weight; a traced cap does not recompile."""
    case, rollout = _case(2)
    obj = Obj("grpo")
    ris = np.exp(np.where(case.mask, case.old - rollout, 0.0)).astype(np.float32)
    want = _spec(case, None, obj, "token_truncate", ris=ris)
    f = jax.jit(
        lambda cap: gmpo_jax.fused_linear_policy_loss(
            case.hidden,
            case.weight,
            gmpo_jax.PolicyBatch(
                case.ids, case.mask, case.adv, old_logps=case.old, ref_logps=case.ref, rollout_logps=rollout
            ),
            objective=obj.lib(rollout_is_cap=cap),
        )[0]
    )
    assert_loss_close(f(jnp.float32(np.inf)), want.loss, want.scale, np.float32)
    assert f(jnp.float32(0.5)) != f(jnp.float32(np.inf))


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (
            dict(rollout_logps=np.zeros((B, T + 1), np.float32)),
            ValueError,
            r"batch\.rollout_logps must have shape \[B, T\]",
        ),
        (dict(rollout_logps=np.zeros((B, T), np.int32)), TypeError, r"batch\.rollout_logps"),
        (
            dict(rollout_is_ratio=-np.ones((B,), np.float32)),
            ValueError,
            r"batch\.rollout_is_ratio must be finite and >= 0",
        ),
        (
            dict(rollout_is_ratio=np.full((B,), np.inf, np.float32)),
            ValueError,
            r"batch\.rollout_is_ratio must be finite",
        ),
        (dict(rollout_logps=np.full((B, T), np.nan, np.float32)), ValueError, r"batch\.rollout_logps must be finite"),
    ],
)
def test_bad_batch_fields_raise(kwargs, err, match):
    case, rollout = _case(0)
    batch = gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, **(dict(rollout_logps=rollout) | kwargs))
    with pytest.raises(err, match=match):
        gmpo_jax.fused_linear_policy_loss(case.hidden, case.weight, batch, objective=gmpo_jax.GMPO())


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (
            dict(rollout_is_mode="tis"),
            ValueError,
            r"rollout_is_mode must be None or one of .*got rollout_is_mode='tis'",
        ),
        (dict(rollout_is_cap=0.0), ValueError, r"rollout_is_cap must be > 0"),
        (dict(rollout_is_cap=np.float32(-1.0)), ValueError, r"rollout_is_cap must be > 0"),
        (dict(rollout_is_cap="2"), TypeError, r"rollout_is_cap"),
    ],
)
@pytest.mark.parametrize("cls", [gmpo_jax.GMPO, gmpo_jax.GRPO, gmpo_jax.CISPO, gmpo_jax.SAPO], ids=lambda c: c.__name__)
def test_bad_objective_fields_raise(cls, kwargs, err, match):
    """The mode and the cap are the objective's (checked when it is built)."""
    with pytest.raises(err, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("op", ["lm_head", "logits"])
def test_mode_and_cap_without_rollout_logps_change_nothing(op):
    """An objective configured with a correction serves batches without ``rollout_logps`` unchanged (it used to
    be a ValueError to give the mode or the cap without them, when they were call arguments)."""
    case, _ = _case(2)
    batch = gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old)
    plain, shaped = Obj("grpo").lib(), Obj("grpo").lib(rollout_is_mode="token_mask", rollout_is_cap=1.5)
    if op == "lm_head":
        f = lambda o: gmpo_jax.fused_linear_policy_loss(case.hidden, case.weight, batch, objective=o)[0]  # noqa: E731
    else:
        z = np.concatenate([case.hidden @ case.weight] * 2, axis=1)[:, : T + 1].astype(np.float32)
        f = lambda o: gmpo_jax.policy_loss_from_logits(z, batch, objective=o)[0]  # noqa: E731
    assert float(f(shaped)) == float(f(plain))


@pytest.mark.parametrize("obj", [Obj("grpo"), Obj("gmpo")], ids=str)
def test_traced_non_positive_cap_is_nan(obj):
    """A traced cap cannot raise: ``<= 0`` makes the loss NaN (never weights of the wrong sign)."""
    case, rollout = _case(1)
    f = jax.jit(
        lambda cap: gmpo_jax.fused_linear_policy_loss(
            case.hidden,
            case.weight,
            gmpo_jax.PolicyBatch(case.ids, case.mask, case.adv, old_logps=case.old, rollout_logps=rollout),
            objective=obj.lib(rollout_is_cap=cap),
        )[0]
    )
    assert np.isnan(float(f(jnp.float32(-1.0)))) and np.isfinite(float(f(jnp.float32(1.5))))
