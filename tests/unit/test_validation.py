"""Bad inputs raise the documented error, and the message names the offending argument.

Checks run at trace time, so none of these tests compiles anything.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gmpo_jax
import gmpo_jax.reference
from gmpo_jax import _validation

B, T, H, V = 2, 3, 4, 5


def good_args():
    rng = np.random.default_rng(0)
    return dict(
        hidden=jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32),
        weight=jnp.asarray(rng.normal(size=(H, V)), jnp.float32),
        completion_ids=jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32),
        completion_mask=jnp.ones((B, T), bool),
        advantages=jnp.asarray([1.0, -1.0], jnp.float32),
    )


BATCH_FIELDS = gmpo_jax.PolicyBatch._fields


def call(fn=None, *, objective=None, head=None, **override):
    """Call the loss with valid arguments, some replaced by ``override``: ``hidden`` / ``weight``, fields of the
    batch by their names, ``head`` a dict of ``HeadOptions`` fields (built here, so that a bad field raises
    inside the caller's ``pytest.raises``), and the other keywords of the call."""
    fn = fn or gmpo_jax.fused_linear_policy_loss
    a = good_args()
    hidden, weight = override.pop("hidden", a["hidden"]), override.pop("weight", a["weight"])
    fields = {k: override.pop(k) for k in BATCH_FIELDS if k in override}
    batch = gmpo_jax.PolicyBatch(**({k: a[k] for k in BATCH_FIELDS if k in a} | fields))
    options = None if head is None else gmpo_jax.HeadOptions(**head)
    return fn(hidden, weight, batch, objective=objective or gmpo_jax.GMPO(), head=options, **override)


def test_valid_call_passes():
    loss, _ = call()
    assert np.isfinite(float(loss))


# --------------------------------------------------------------------------------------------------
# Shapes and ranks among all inputs (errors name the argument, or the field: batch.old_logps, reference.hidden)
# --------------------------------------------------------------------------------------------------
f32 = lambda *s: jnp.zeros(s, jnp.float32)
REF_BETA = gmpo_jax.GMPO(beta=0.1)

SHAPE_ERRORS = [
    ("hidden", dict(hidden=f32(B, T * H))),
    ("hidden", dict(hidden=f32(1, B, T, H))),
    ("weight", dict(weight=f32(H, V, 1))),
    ("weight", dict(weight=f32(V, H))),  # a [V, H] table declared "hv"
    ("weight", dict(weight=f32(H, V), head=dict(weight_layout="vh"))),  # a [H, V] kernel declared "vh"
    ("weight", dict(weight=f32(H + 1, V))),
    ("weight_layout", dict(head=dict(weight_layout="HV"))),
    ("bias", dict(bias=f32(V + 1))),
    ("bias", dict(bias=f32(1, V))),
    (r"batch\.completion_ids", dict(completion_ids=jnp.zeros((B, T + 1), jnp.int32))),
    (r"batch\.completion_ids", dict(completion_ids=jnp.zeros((B * T,), jnp.int32))),
    (r"batch\.completion_mask", dict(completion_mask=jnp.ones((B, T - 1), bool))),
    (r"batch\.completion_mask", dict(completion_mask=jnp.ones((T, B), bool))),
    (r"batch\.advantages", dict(advantages=f32(B, 1))),
    (r"batch\.advantages", dict(advantages=f32(B + 1))),
    (r"batch\.old_logps", dict(old_logps=f32(B, T + 1))),
    (r"batch\.old_logps", dict(old_logps=f32(B))),
    (r"batch\.ref_logps", dict(ref_logps=f32(T, B), objective=REF_BETA)),
    (r"batch\.rollout_logps", dict(rollout_logps=f32(B, T, 1))),
    (r"batch\.rollout_is_ratio", dict(rollout_is_ratio=f32(B, 2), objective=gmpo_jax.GRPO())),
    (r"batch\.rollout_is_ratio", dict(rollout_is_ratio=f32(T), objective=gmpo_jax.GRPO())),
    (r"batch\.rollout_is_ratio", dict(rollout_is_ratio=f32(B, T, 1), objective=gmpo_jax.GRPO())),
    (r"batch\.segment_ids", dict(segment_ids=jnp.ones((B, T + 1), jnp.int32))),
    (r"reference\.hidden", dict(reference=gmpo_jax.ReferenceHead(f32(B + 1, T, H), f32(H, V)), objective=REF_BETA)),
    (r"reference\.hidden", dict(reference=gmpo_jax.ReferenceHead(f32(B, T), f32(H, V)), objective=REF_BETA)),
    (r"reference\.weight", dict(reference=gmpo_jax.ReferenceHead(f32(B, T, H), f32(H, V + 1)), objective=REF_BETA)),
    (
        r"reference\.bias",
        dict(reference=gmpo_jax.ReferenceHead(f32(B, T, H), f32(H, V), f32(V - 1)), objective=REF_BETA),
    ),
    ("temperature", dict(temperature=jnp.ones((2,)))),
]


@pytest.mark.parametrize("name, override", SHAPE_ERRORS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SHAPE_ERRORS)])
def test_shape_errors_name_the_argument(name, override):
    with pytest.raises(ValueError, match=name):
        call(**override)


@pytest.mark.parametrize(
    "name, override",
    [
        (r"batch\.completion_ids", dict(completion_ids=jnp.zeros((B, T), jnp.float32))),
        (r"batch\.completion_ids", dict(completion_ids=jnp.zeros((B, T), bool))),
        ("hidden", dict(hidden=jnp.zeros((B, T, H), jnp.int32))),
        ("weight", dict(weight=jnp.zeros((H, V), jnp.int32))),
        (r"batch\.advantages", dict(advantages=jnp.zeros((B,), jnp.int32))),
        (r"batch\.old_logps", dict(old_logps=jnp.zeros((B, T), jnp.int32))),
        (r"batch\.segment_ids", dict(segment_ids=jnp.ones((B, T), jnp.float32))),
        ("chunk_size", dict(head=dict(chunk_size=1.5))),
        (r"batch\.completion_mask", dict(completion_mask=np.full((B, T), "a"))),
        (r"batch\.advantages", dict(advantages=np.full((B,), None, dtype=object))),
        ("objective", dict(objective="gmpo")),
        ("reference", dict(reference=(f32(B, T, H), f32(H, V)))),  # a tuple, not a ReferenceHead
        ("head", dict(head_options=dict(chunk_size=2))),
        ("sharding", dict(sharding=("data", None))),
    ],
)
def test_dtype_errors_are_type_errors(name, override):
    with pytest.raises(TypeError, match=name):
        if "objective" in override:  # bypass call()'s default objective
            a = good_args()
            batch = gmpo_jax.PolicyBatch(a["completion_ids"], a["completion_mask"], a["advantages"])
            gmpo_jax.fused_linear_policy_loss(a["hidden"], a["weight"], batch, objective=override["objective"])
        elif "head_options" in override:  # a dict where the HeadOptions belongs
            a = good_args()
            batch = gmpo_jax.PolicyBatch(a["completion_ids"], a["completion_mask"], a["advantages"])
            gmpo_jax.fused_linear_policy_loss(
                a["hidden"], a["weight"], batch, objective=gmpo_jax.GMPO(), head=override["head_options"]
            )
        else:
            call(**override)


def test_batch_must_be_a_policy_batch():
    """A plain tuple (or dict) of the fields is refused, for both ops: the error names ``batch``."""
    a = good_args()
    fields = (a["completion_ids"], a["completion_mask"], a["advantages"])
    with pytest.raises(TypeError, match="batch must be a gmpo_jax.PolicyBatch"):
        gmpo_jax.fused_linear_policy_loss(a["hidden"], a["weight"], fields, objective=gmpo_jax.GMPO())
    with pytest.raises(TypeError, match="batch must be a gmpo_jax.PolicyBatch"):
        gmpo_jax.policy_loss_from_logits(f32(B, T + 1, V), dict(enumerate(fields)), objective=gmpo_jax.GMPO())


@pytest.mark.parametrize("field", ["completion_ids", "completion_mask", "advantages"])
@pytest.mark.parametrize("fn", [gmpo_jax.fused_linear_policy_loss, gmpo_jax.reference.policy_loss])
def test_required_batch_fields_are_named_when_none(fn, field):
    """``PolicyBatch(ids, None, adv)`` names the missing field (not a shape error about ``shape=()``)."""
    with pytest.raises(TypeError, match=rf"batch\.{field} is required .*got None"):
        call(fn, **{field: None})


def test_logprobs_ids_are_named_when_none():
    a = good_args()
    with pytest.raises(TypeError, match=r"completion_ids is required .*got None"):
        gmpo_jax.fused_linear_logprobs(a["hidden"], a["weight"], None)


def test_num_items_in_batch_vector_is_a_type_error():
    """A vector is not a real scalar: TypeError, like a bool or a string (tests/unit/test_edge_arguments.py)."""
    with pytest.raises(TypeError, match=r"batch\.num_items_in_batch must be a real scalar"):
        call(num_items_in_batch=jnp.ones((2,)), objective=gmpo_jax.GRPO())


# --------------------------------------------------------------------------------------------------
# Values of call arguments
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, -1.0, np.float32(0.0), float("inf"), float("nan")])
def test_temperature_must_be_positive(temperature):
    with pytest.raises(ValueError, match="temperature"):
        call(temperature=temperature)


@pytest.mark.parametrize("chunk_size", [0, -2])
def test_chunk_size_at_least_one(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        call(head=dict(chunk_size=chunk_size))


@pytest.mark.parametrize("num_items", [-3, jnp.float32(-5.0), np.float32(np.nan)], ids=["int", "jax", "nan"])
def test_negative_num_items_in_batch(num_items):
    with pytest.raises(ValueError, match=r"batch\.num_items_in_batch"):
        call(num_items_in_batch=num_items, objective=gmpo_jax.GRPO())


def test_unknown_implementation():
    """An unknown name raises when the ``HeadOptions`` is built (as its other fields), naming the known ones."""
    with pytest.raises(ValueError, match=r"implementation must be None, one of \('mosaic_gpu', 'xla_chunked'\)"):
        gmpo_jax.HeadOptions(implementation="triton")
    assert gmpo_jax.HeadOptions(implementation="xla_chunked").implementation == "xla_chunked"


@pytest.mark.parametrize(
    "objective",
    [gmpo_jax.GMPO(beta=0.1), gmpo_jax.GRPO(beta=0.04), gmpo_jax.CISPO(beta=0.1), gmpo_jax.SAPO(beta=0.1)],
    ids=lambda o: type(o).__name__,
)
def test_beta_without_reference(objective):
    with pytest.raises(ValueError, match=r"beta.*batch\.ref_logps, or reference="):
        call(objective=objective)


def test_traced_beta_without_reference_raises():
    """A traced beta cannot be checked for 0, so without a reference it is an error (it used to drop the KL
    term silently: a beta schedule with a forgotten reference); with a reference it traces fine."""
    with pytest.raises(ValueError, match="beta.*traced.*reference"):
        jax.jit(lambda beta: call(objective=gmpo_jax.GMPO(beta=beta))[0])(jnp.float32(0.1))
    with pytest.raises(ValueError, match="beta.*traced.*reference"):
        jax.jit(
            lambda beta: gmpo_jax.policy_loss_from_logits(
                jnp.zeros((B, T + 1, 7)),
                gmpo_jax.PolicyBatch(jnp.zeros((B, T), jnp.int32), jnp.ones((B, T)), jnp.ones((B,))),
                objective=gmpo_jax.GRPO(beta=beta),
            )[0]
        )(jnp.float32(0.1))
    got = jax.jit(lambda beta: call(objective=gmpo_jax.GMPO(beta=beta), ref_logps=f32(B, T) - 1.0)[0])(0.1)
    assert np.isfinite(float(got))


def test_concrete_non_finite_advantages_raise():
    with pytest.raises(ValueError, match=r"batch\.advantages must be finite.*batch\.advantages\[1\]"):
        call(advantages=jnp.array([1.0, jnp.nan] + [0.5] * (B - 2)))


def test_backend_classes_and_other_ops_backends_are_type_errors():
    from gmpo_jax.lm_head import XlaChunkedBackend
    from gmpo_jax.logits import XlaLogitsBackend

    with pytest.raises(TypeError, match="instance, not the class"):
        call(head=dict(implementation=XlaChunkedBackend))
    with pytest.raises(TypeError, match="not a fused LM head backend"):
        call(head=dict(implementation=XlaLogitsBackend()))
    with pytest.raises(ValueError, match="row_buckets"):
        call(head=dict(implementation=XlaChunkedBackend(row_buckets=0)))


def test_beta_zero_with_reference_is_fine(monkeypatch):
    """Not an error: the reference is ignored, with a warning (once per process; reset here)."""
    monkeypatch.setattr(_validation, "_warned_ignored_reference", set())
    with pytest.warns(UserWarning, match=r"batch\.ref_logps is ignored"):
        loss, _ = call(objective=gmpo_jax.GMPO(beta=0.0), ref_logps=f32(B, T) - 1.0)
    assert np.isfinite(float(loss))


@pytest.mark.parametrize(
    "fn", [gmpo_jax.fused_linear_policy_loss, gmpo_jax.reference.policy_loss], ids=["fused", "dense"]
)
def test_both_ref_logps_and_reference_head(fn):
    """``batch.ref_logps`` and ``reference=`` are two sources of one thing: giving both is an error (the message
    names both), with or without a KL term."""
    reference = gmpo_jax.ReferenceHead(f32(B, T, H), f32(H, V))
    for objective in (gmpo_jax.GMPO(beta=0.1), gmpo_jax.GMPO()):
        with pytest.raises(ValueError, match=r"batch\.ref_logps or reference="):
            call(fn, objective=objective, ref_logps=f32(B, T), reference=reference)


def test_reference_head_needs_hidden_and_weight():
    """A ``ReferenceHead`` is built from both (a NamedTuple: the constructor refuses one alone)."""
    with pytest.raises(TypeError, match="weight"):
        gmpo_jax.ReferenceHead(f32(B, T, H))
    loss, _ = call(objective=gmpo_jax.GMPO(beta=0.1), reference=gmpo_jax.ReferenceHead(f32(B, T, H), f32(H, V)))
    assert np.isfinite(float(loss))


def test_reference_validates_like_the_fused_path():
    with pytest.raises(ValueError, match="weight"):
        call(gmpo_jax.reference.policy_loss, weight=f32(V, H))
    with pytest.raises(ValueError, match="beta"):
        call(gmpo_jax.reference.policy_loss, objective=gmpo_jax.GRPO(beta=0.1))
    with pytest.raises(TypeError, match="completion_ids"):
        call(gmpo_jax.reference.policy_loss, completion_ids=f32(B, T))


# --------------------------------------------------------------------------------------------------
# Objective hyper-parameters (checked at construction)
# --------------------------------------------------------------------------------------------------
OBJECTIVE_ERRORS = [
    ("epsilon_low", lambda: gmpo_jax.GMPO(epsilon_low=-0.1)),
    ("epsilon_high", lambda: gmpo_jax.GMPO(epsilon_high=-0.1)),
    ("epsilon_low", lambda: gmpo_jax.GRPO(epsilon_low=-0.01)),
    ("epsilon_high", lambda: gmpo_jax.GRPO(epsilon_high=-1.0)),
    ("epsilon_high", lambda: gmpo_jax.CISPO(epsilon_high=-0.2)),
    ("beta", lambda: gmpo_jax.GMPO(beta=-0.1)),
    ("beta", lambda: gmpo_jax.GRPO(beta=-0.1)),
    ("beta", lambda: gmpo_jax.GMPO(beta=float("inf"))),  # an infinite coefficient: an infinite loss
    ("beta", lambda: gmpo_jax.SAPO(beta=np.float32(np.inf))),
    ("beta", lambda: gmpo_jax.GRPO(beta=1e39)),  # finite in float64, infinite in the loss's float32
    ("delta", lambda: gmpo_jax.GRPO(delta=0.0)),
    ("delta", lambda: gmpo_jax.GRPO(delta=-1.5)),
    ("temperature_pos", lambda: gmpo_jax.SAPO(temperature_pos=0.0)),
    ("temperature_neg", lambda: gmpo_jax.SAPO(temperature_neg=-1.0)),
    ("loss_type", lambda: gmpo_jax.GRPO(loss_type="ppo")),
    ("loss_type", lambda: gmpo_jax.GRPO(loss_type="gmpo")),
    ("importance_sampling_level", lambda: gmpo_jax.GRPO(importance_sampling_level="seq")),
    ("max_completion_length", lambda: gmpo_jax.GRPO(loss_type="dr_grpo")),
    ("max_completion_length", lambda: gmpo_jax.GRPO(loss_type="dr_grpo", max_completion_length=0)),
    ("max_completion_length", lambda: gmpo_jax.GRPO(loss_type="dr_grpo", max_completion_length=2.5)),
    ("max_completion_length", lambda: gmpo_jax.GRPO(loss_type="grpo", max_completion_length=-3)),
    # sequence-level importance sampling is a configuration error for GMPO, CISPO and SAPO
    ("importance_sampling_level", lambda: gmpo_jax.GMPO(importance_sampling_level="sequence")),
    ("importance_sampling_level", lambda: gmpo_jax.CISPO(importance_sampling_level="sequence")),
    ("importance_sampling_level", lambda: gmpo_jax.SAPO(importance_sampling_level="sequence")),
    # the loss shaping every objective takes
    ("entropy_coef", lambda: gmpo_jax.GMPO(entropy_coef=float("nan"))),
    ("entropy_coef", lambda: gmpo_jax.GRPO(entropy_coef=jnp.array(np.inf))),
    ("top_entropy_quantile", lambda: gmpo_jax.CISPO(top_entropy_quantile=0.0)),
    ("top_entropy_quantile", lambda: gmpo_jax.SAPO(top_entropy_quantile=1.5)),
    ("rollout_is_mode", lambda: gmpo_jax.GMPO(rollout_is_mode="tis")),
    ("rollout_is_cap", lambda: gmpo_jax.GRPO(rollout_is_cap=0.0)),
    ("rollout_is_cap", lambda: gmpo_jax.SAPO(rollout_is_cap=np.float32(-2.0))),
]


@pytest.mark.parametrize("name, make", OBJECTIVE_ERRORS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OBJECTIVE_ERRORS)])
def test_objective_hyperparameters(name, make):
    with pytest.raises(ValueError, match=name):
        make()


TRACED_INVALID = [  # (objective, field, an invalid value, a valid one): what a jitted schedule might produce
    (gmpo_jax.GMPO, "epsilon_low", -0.1, 0.4),
    (gmpo_jax.GMPO, "epsilon_high", -0.1, 0.4),
    (gmpo_jax.GMPO, "beta", -0.1, 0.1),
    (gmpo_jax.GRPO, "epsilon_low", -0.5, 0.2),
    (gmpo_jax.GRPO, "epsilon_high", -0.5, 0.2),
    (gmpo_jax.GRPO, "delta", 0.0, 1.5),
    (gmpo_jax.GRPO, "beta", float("inf"), 0.1),
    (gmpo_jax.CISPO, "epsilon_high", 0.0, 0.2),
    (gmpo_jax.SAPO, "temperature_neg", -1.0, 1.05),
]


def _tiny_head(seed: int):
    """``(rng, hidden [2, 6, 8], weight [8, 16], ids, their log-probs as NumPy)`` of a random float32 head."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 16, (2, 6)), jnp.int32)
    return rng, h, w, ids, np.asarray(gmpo_jax.fused_linear_logprobs(h, w, ids))


@pytest.mark.parametrize(
    "cls, field, bad, good", TRACED_INVALID, ids=[f"{c.__name__}-{f}" for c, f, _, _ in TRACED_INVALID]
)
def test_traced_invalid_hyperparameter_gives_nan(cls, field, bad, good):
    """A traced hyper-parameter cannot raise (its check needs the value): outside its range the loss is NaN, never a
    finite value computed with a meaningless bound (a negative clip range only enters comparisons); inside it, the
    traced value gives the eager loss. Ratios on both sides of every bound, advantages of both signs."""
    rng, h, w, ids, logp = _tiny_head(0)
    old = jnp.asarray(logp + rng.choice([-1.0, 1.0], logp.shape), jnp.float32)  # ratios e^{+-1}: past every bound
    ref = jnp.asarray(logp - 0.3, jnp.float32) if field == "beta" else None
    batch = gmpo_jax.PolicyBatch(ids, jnp.ones(ids.shape), jnp.array([1.0, -1.0]), old_logps=old, ref_logps=ref)

    def loss(h, v):
        return gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=cls(**{field: v}))[0]

    traced = jax.jit(loss)
    assert np.isnan(float(traced(h, jnp.float32(bad))))
    np.testing.assert_allclose(float(traced(h, jnp.float32(good))), float(loss(h, good)), rtol=1e-6)
    value, dh = jax.jit(jax.value_and_grad(loss))(h, jnp.float32(bad))  # a training step: the gradient NaN too
    assert np.isnan(float(value)) and not np.isfinite(np.asarray(dh)).all()  # (clipped tokens: 0, by selection)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_mask"])
@pytest.mark.parametrize("cls", [gmpo_jax.GMPO, gmpo_jax.GRPO])
def test_traced_non_positive_rollout_cap_gives_nan(cls, mode):
    """A traced ``rollout_is_cap <= 0`` cannot raise: the loss is NaN in every mode, also where the cap only enters a
    comparison (the mask modes), never the loss of an infinite cap."""
    _, h, w, ids, logp = _tiny_head(1)
    rollout = jnp.asarray(logp - 0.5, jnp.float32)
    batch = gmpo_jax.PolicyBatch(ids, jnp.ones(ids.shape), jnp.array([1.0, -1.0]), rollout_logps=rollout)
    loss = jax.jit(
        lambda cap: gmpo_jax.fused_linear_policy_loss(
            h, w, batch, objective=cls(rollout_is_mode=mode, rollout_is_cap=cap)
        )[0]
    )
    assert np.isnan(float(loss(jnp.float32(-1.0)))) and np.isfinite(float(loss(jnp.float32(2.0))))


def test_objective_defaults_follow_spec():
    """SPEC: GMPO eps_low = eps_high = 0.4 (the paper's (e^-0.4, e^0.4)); the other types 0.2."""
    g = gmpo_jax.GMPO()
    assert (g.epsilon_low, g.epsilon_high, g.beta) == (0.4, 0.4, 0.0)
    r = gmpo_jax.GRPO()
    assert (r.epsilon_low, r.epsilon_high, r.beta, r.delta) == (0.2, 0.2, 0.0, None)
    assert r.importance_sampling_level == "token"
    assert gmpo_jax.CISPO().epsilon_high == 0.2
    s = gmpo_jax.SAPO()
    assert (s.temperature_pos, s.temperature_neg) == (1.0, 1.05)


# --------------------------------------------------------------------------------------------------
# fused_linear_logprobs
# --------------------------------------------------------------------------------------------------
LOGPROBS_ERRORS = [
    (ValueError, "hidden", dict(hidden=f32(B, T))),
    (ValueError, "weight", dict(weight=f32(V, H))),
    (ValueError, "weight_layout", dict(head=dict(weight_layout="t"))),
    (ValueError, "bias", dict(bias=f32(V + 2))),
    (ValueError, "completion_ids", dict(completion_ids=jnp.zeros((B, T + 1), jnp.int32))),
    (TypeError, "completion_ids", dict(completion_ids=f32(B, T))),
    (ValueError, "completion_mask", dict(completion_mask=jnp.ones((B + 1, T), bool))),
    (ValueError, "temperature", dict(temperature=0.0)),
    (ValueError, "chunk_size", dict(head=dict(chunk_size=0))),
    (ValueError, "implementation", dict(head=dict(implementation="cuda"))),
    (ValueError, "vocab_size", dict(head=dict(vocab_size=V + 1))),
    (TypeError, "head", dict(head="hv")),
    (TypeError, "sharding", dict(sharding="data")),
]


@pytest.mark.parametrize(
    "exc, name, override", LOGPROBS_ERRORS, ids=[f"{n}-{i}" for i, (_, n, _) in enumerate(LOGPROBS_ERRORS)]
)
def test_logprobs_validation(exc, name, override):
    a = good_args()
    a.pop("advantages")
    a.update(override)
    h, w, ids = a.pop("hidden"), a.pop("weight"), a.pop("completion_ids")
    with pytest.raises(exc, match=name):
        if isinstance(a.get("head"), dict):
            a["head"] = gmpo_jax.HeadOptions(**a["head"])
        gmpo_jax.fused_linear_logprobs(h, w, ids, **a)


# --------------------------------------------------------------------------------------------------
# Concrete non-Python values are checked like Python numbers (found by the fresh-user review)
# --------------------------------------------------------------------------------------------------
def _tiny():
    k = jax.random.split(jax.random.key(5), 2)
    h = jax.random.normal(k[0], (2, 3, 4))
    w = jax.random.normal(k[1], (4, 5))
    return h, w, jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3)), jnp.array([1.0, -1.0])


@pytest.mark.parametrize("beta", [np.float32(5.0), jnp.array(5.0)], ids=["numpy", "jax"])
def test_concrete_array_beta_without_reference_raises(beta):
    h, w, ids, m, adv = _tiny()
    with pytest.raises(ValueError, match="beta"):
        gmpo_jax.fused_linear_policy_loss(h, w, gmpo_jax.PolicyBatch(ids, m, adv), objective=gmpo_jax.GRPO(beta=beta))


@pytest.mark.parametrize("temperature", [True, np.bool_(True), jnp.array(True)], ids=str)
def test_bool_temperature_raises(temperature):
    """A bool (Python, NumPy or a bool array, traced too: its dtype is static) is not a temperature."""
    with pytest.raises(TypeError, match="temperature"):
        call(temperature=temperature)
    with pytest.raises(TypeError, match="temperature"):
        jax.jit(lambda t: call(temperature=t))(jnp.array(True))


@pytest.mark.parametrize("temperature", [jnp.array(-1.0), jnp.array(0.0), np.float32(np.nan)], ids=str)
def test_concrete_array_temperature_must_be_positive(temperature):
    h, w, ids, m, adv = _tiny()
    with pytest.raises(ValueError, match="temperature"):
        gmpo_jax.fused_linear_policy_loss(
            h, w, gmpo_jax.PolicyBatch(ids, m, adv), objective=gmpo_jax.GMPO(), temperature=temperature
        )


@pytest.mark.parametrize("temperature", [-1.0, 0.0, np.inf], ids=["negative", "zero", "inf"])
def test_traced_bad_temperature_gives_nan(temperature):
    """A traced temperature cannot be checked: one that is not finite and positive makes every op's result NaN (not
    the loss of a negated temperature), and its gradients NaN too, whatever the backend."""
    h, w, ids, m, adv = _tiny()
    batch, obj = gmpo_jax.PolicyBatch(ids, m, adv), gmpo_jax.GMPO()
    logits = jnp.ones((*ids.shape, w.shape[1]))
    ops = {
        "fused": lambda t: gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=obj, temperature=t)[0],
        "reference": lambda t: gmpo_jax.reference.policy_loss(h, w, batch, objective=obj, temperature=t)[0],
        "logits": lambda t: gmpo_jax.policy_loss_from_logits(logits, batch, objective=obj, temperature=t)[0],
        "logprobs": lambda t: gmpo_jax.fused_linear_logprobs(h, w, ids, temperature=t).sum(),
    }
    for name, f in ops.items():
        assert np.isnan(float(jax.jit(f)(temperature))), name
        assert np.isfinite(float(jax.jit(f)(0.7))), name
    g = jax.jit(jax.grad(lambda h, t: gmpo_jax.fused_linear_policy_loss(h, w, batch, objective=obj, temperature=t)[0]))
    assert np.isnan(np.asarray(g(h, temperature))).all()


def test_weighted_mask_is_rejected_when_concrete():
    h, w, ids, _, adv = _tiny()
    with pytest.raises(ValueError, match="completion_mask"):
        gmpo_jax.fused_linear_policy_loss(
            h, w, gmpo_jax.PolicyBatch(ids, jnp.full((2, 3), 0.5), adv), objective=gmpo_jax.GMPO()
        )


def test_non_array_and_non_backend_arguments_are_named():
    h, w, ids, m, adv = _tiny()
    with pytest.raises(TypeError, match="advantages"):
        gmpo_jax.fused_linear_policy_loss(h, w, gmpo_jax.PolicyBatch(ids, m, [1.0, -1.0]), objective=gmpo_jax.GMPO())
    with pytest.raises(TypeError, match="implementation"):
        gmpo_jax.fused_linear_policy_loss(
            h,
            w,
            gmpo_jax.PolicyBatch(ids, m, adv),
            objective=gmpo_jax.GMPO(),
            head=gmpo_jax.HeadOptions(implementation=123),
        )


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(epsilon_low="0.4"), TypeError, "epsilon_low"),
        (dict(epsilon_low=np.float32(-0.1)), ValueError, "epsilon_low"),
        (dict(beta=jnp.array(-1.0)), ValueError, "beta"),
        (dict(use_bias_correction_kl="no"), TypeError, "use_bias_correction_kl"),
    ],
    ids=["string", "numpy-negative", "jax-negative", "flag-string"],
)
def test_objective_hyper_parameter_types(kwargs, error, name):
    with pytest.raises(error, match=name):
        gmpo_jax.GMPO(**kwargs)


def test_numpy_integer_max_completion_length_is_accepted_as_int():
    obj = gmpo_jax.GRPO(loss_type="dr_grpo", max_completion_length=np.int64(5))
    assert obj.max_completion_length == 5 and type(obj.max_completion_length) is int


def test_concrete_unmasked_out_of_range_ids_raise():
    """Concrete ids and mask: an unmasked id outside [0, V) (or [0, vocab_size)) is a ValueError naming
    completion_ids and the position, in every entry point; masked positions may hold any id; traced ids
    cannot be checked (they give NaN, tested in test_numerics / test_logits_loss)."""
    rng = np.random.default_rng(0)
    B, T, H, V = 2, 5, 8, 11
    h = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((H, V)), jnp.float32)
    adv = jnp.array([1.0, -1.0])
    mask = np.ones((B, T), bool)
    mask[1, 3] = False
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    ids[1, 3] = -100  # masked: fine
    logits = jnp.asarray(rng.standard_normal((B, T + 1, V)), jnp.float32)
    gmpo_jax.fused_linear_policy_loss(h, w, gmpo_jax.PolicyBatch(ids, mask, adv), objective=gmpo_jax.GMPO())
    gmpo_jax.policy_loss_from_logits(logits, gmpo_jax.PolicyBatch(ids, mask, adv), objective=gmpo_jax.GMPO())
    bad = ids.copy()
    bad[0, 2] = V
    with pytest.raises(ValueError, match=r"completion_ids\[0, 2\] = 11"):
        gmpo_jax.fused_linear_policy_loss(h, w, gmpo_jax.PolicyBatch(bad, mask, adv), objective=gmpo_jax.GMPO())
    with pytest.raises(ValueError, match=r"completion_ids\[0, 2\] = 11"):
        gmpo_jax.policy_loss_from_logits(logits, gmpo_jax.PolicyBatch(bad, mask, adv), objective=gmpo_jax.GMPO())
    with pytest.raises(ValueError, match=r"completion_ids must lie in \[0, 11\)"):
        gmpo_jax.fused_linear_logprobs(h, w, jnp.asarray(ids))  # no mask: -100 counts
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        gmpo_jax.fused_linear_logprobs(
            h, w, np.where(mask, 8, 0), completion_mask=mask, head=gmpo_jax.HeadOptions(vocab_size=7)
        )
    traced = jax.jit(
        lambda i: gmpo_jax.fused_linear_policy_loss(
            h, w, gmpo_jax.PolicyBatch(i, mask, adv), objective=gmpo_jax.GMPO()
        )[0]
    )
    assert np.isnan(float(traced(bad)))


def test_positive_rollout_logps_raise():
    """``batch.rollout_logps`` are log-probs too: a counted value above 0.5 (a negated log-prob) raises."""
    with pytest.raises(
        ValueError, match=r"batch\.rollout_logps must be log-probabilities .*batch\.rollout_logps\[0, 1\]"
    ):
        call(rollout_logps=jnp.asarray([[-1.0, 2.0, -0.1], [-0.3, -0.2, -0.5]], jnp.float32))


def test_nonfinite_policy_hidden_raises():
    """A NaN or infinite policy hidden state at a counted token (concrete) raises naming ``hidden`` and the token;
    at a masked token it is allowed (nothing reads it)."""
    h = good_args()["hidden"]
    with pytest.raises(ValueError, match=r"hidden must be finite at an unmasked token .*got inf in hidden\[1, 2, 0\]"):
        call(hidden=h.at[1, 2, 0].set(jnp.inf))
    mask = jnp.ones((B, T), bool).at[1, 2].set(False)
    loss, _ = call(hidden=h.at[1, 2, 0].set(jnp.nan), completion_mask=mask)
    assert np.isfinite(float(loss))


def test_nonfinite_head_parameters_raise():
    """A NaN or infinite weight entry (every token's log-sum-exp NaN), a NaN or ``+inf`` bias entry or ``-inf`` at a
    counted token's own id, and the same in a reference head with a KL term raise naming the entry, eagerly and under an eager ``jax.grad``; a ``-inf`` bias
    entry (a banned token, not the target here) is fine; with no counted token nothing reads the head; under ``jit``
    the values are not known and the loss is NaN."""
    a = good_args()
    w, ids = a["weight"], np.asarray(a["completion_ids"])
    banned = next(v for v in range(V) if v not in ids)
    bias = jnp.zeros((V,), jnp.float32)
    assert np.isfinite(float(call(bias=bias.at[banned].set(-jnp.inf))[0]))
    assert float(call(weight=w.at[1, 2].set(jnp.nan), completion_mask=jnp.zeros((B, T), bool))[0]) == 0.0
    loss = lambda w: call(weight=w)[0]  # noqa: E731
    for run in (loss, jax.grad(loss)):
        with pytest.raises(ValueError, match=r"weight must be finite, got weight\[1, 2\] = nan \(1 such entry"):
            run(w.at[1, 2].set(jnp.nan))
    with pytest.raises(ValueError, match=r"weight must be finite, got weight\[0, 4\] = -inf"):
        call(weight=w.at[0, 4].set(-jnp.inf))
    with pytest.raises(ValueError, match=r"bias must be finite or -inf, got bias\[3\] = inf"):
        call(bias=bias.at[3].set(jnp.inf))
    own = int(ids[0, 1])  # -inf at a counted token's own id: log-prob -inf
    with pytest.raises(ValueError, match=rf"own id must not be -inf .*bias\[{own}\] = -inf"):
        call(bias=bias.at[own].set(-jnp.inf), old_logps=jnp.full((B, T), -1.0))
    ref = gmpo_jax.ReferenceHead(a["hidden"], w.at[2, 1].set(jnp.nan))
    with pytest.raises(ValueError, match=r"reference\.weight must be finite, got reference\.weight\[2, 1\] = nan"):
        call(reference=ref, objective=gmpo_jax.GMPO(beta=0.1))
    assert np.isnan(float(jax.jit(loss)(w.at[1, 2].set(jnp.nan))))
    # past head.vocab_size the bias is replaced by -inf (anything there is fine); the weight's padding columns are
    # still multiplied (a NaN there would make every logit of that column, and the loss, NaN): checked
    pad = {"head": {"vocab_size": V - 2}, "completion_ids": jnp.asarray(ids % (V - 2))}
    assert float(call(**pad, bias=bias.at[V - 2].set(jnp.nan))[0]) == float(call(**pad)[0])
    with pytest.raises(ValueError, match=rf"weight must be finite, got weight\[0, {V - 1}\] = nan"):
        call(**pad, weight=w.at[0, V - 1].set(jnp.nan))
    assert np.isnan(float(jax.jit(lambda w: call(**pad, weight=w)[0])(w.at[0, V - 1].set(jnp.nan))))


def test_nonfinite_logits_raise_where_a_token_counts():
    """Known logits (eager, and under an eager ``jax.grad``): a NaN or ``+inf`` in a counted token's row, or ``-inf``
    at its own id, raises naming the entry; ``-inf`` at another id (a banned token), anything at a masked token or at
    the dropped last position is fine and gives the clean loss. int8 ids index the right column. Under ``jit`` the
    logits are not known: such a row gives a NaN loss."""
    rng = np.random.default_rng(1)
    V8 = 300  # beyond int8: the own-id lookup must not clip in the ids' dtype
    ids = jnp.asarray(rng.integers(0, 127, (B, T)), jnp.int8)
    mask = jnp.ones((B, T), bool).at[1, 2].set(False)
    z = jnp.asarray(rng.normal(size=(B, T + 1, V8)), jnp.float32)
    batch = gmpo_jax.PolicyBatch(ids, mask, good_args()["advantages"])
    loss = lambda logits: gmpo_jax.policy_loss_from_logits(logits, batch, objective=gmpo_jax.GMPO(entropy_coef=0.1))[0]
    own = int(ids[0, 1])
    want = float(loss(z))
    for unread in (z.at[1, 2].set(jnp.nan), z.at[:, T].set(jnp.nan)):
        assert float(loss(unread)) == want
    banned = z.at[0, 1, (own + 1) % V8].set(-jnp.inf).at[0, 1, own % 128 + 128].set(-jnp.inf)
    assert np.isfinite(float(loss(banned)))  # a banned id changes the entropy
    for bad, msg in (
        (z.at[0, 1, 3].set(jnp.nan), r"logits must be finite or -inf .*got logits\[0, 1, 3\] = nan"),
        (z.at[0, 1, 299].set(jnp.inf), r"logits must be finite or -inf .*got logits\[0, 1, 299\] = inf"),
        (z.at[0, 1, own].set(-jnp.inf), rf"own id must not be -inf .*logits\[0, 1, {own}\] = -inf"),
    ):
        for run in (loss, jax.grad(loss), jax.value_and_grad(loss)):
            with pytest.raises(ValueError, match=msg):
                run(bad)
        assert np.isnan(float(jax.jit(loss)(bad)))


def test_nonfinite_hidden_raises_under_an_eager_grad():
    """An eager ``jax.grad`` knows its argument's value: a NaN hidden state at a counted token raises there too."""
    h = good_args()["hidden"].at[0, 1, 2].set(jnp.nan)
    for argnums in (0, 1, (0, 1)):
        f = jax.grad(lambda h, w: call(hidden=h, weight=w)[0], argnums=argnums)
        with pytest.raises(
            ValueError, match=r"hidden must be finite at an unmasked token .*got nan in hidden\[0, 1, 2\]"
        ):
            f(h, good_args()["weight"])


def test_rollout_is_ratio_is_checked_where_a_token_counts():
    """``rollout_is_ratio`` may hold anything at a masked token ([B, T]) or in a row without counted tokens ([B],
    [B, 1]), as the log-prob fields may; a NaN where a token counts raises naming the position."""
    mask = jnp.ones((B, T), bool).at[1].set(False)
    ris = jnp.ones((B, T), jnp.float32).at[1, 0].set(jnp.nan)
    for r in (ris, ris[:, :1], ris[:, 0]):
        loss, _ = call(completion_mask=mask, rollout_is_ratio=r)
        assert np.isfinite(float(loss))
    with pytest.raises(ValueError, match=r"batch\.rollout_is_ratio must be finite .*rollout_is_ratio\[1, 0\] = nan"):
        call(rollout_is_ratio=ris)
    with pytest.raises(ValueError, match=r"batch\.rollout_is_ratio must be finite .*rollout_is_ratio\[1\] = nan"):
        call(rollout_is_ratio=ris[:, 0])


def test_rollout_is_ratio_with_a_traced_mask_is_checked_everywhere():
    """Which tokens count is unknown when the mask is traced: a concrete ratio is then checked at every position."""
    bad = jnp.ones((B, T), jnp.float32).at[0, 1].set(-1.0)
    with pytest.raises(ValueError, match=r"batch\.rollout_is_ratio must be finite and >= 0 \(a weight\), got "):
        jax.jit(lambda m: call(completion_mask=m, rollout_is_ratio=bad)[0])(jnp.ones((B, T), bool))


def test_advantages_are_checked_where_read():
    """Advantages may hold anything at a masked token ([B, T]) or for a row without counted tokens ([B]), as the
    jitted call ignores them; NaN where read raises naming ``[b, t]`` / ``[b]``."""
    mask = jnp.ones((B, T), bool).at[0, 2].set(False).at[1].set(False)
    token = jnp.ones((B, T), jnp.float32).at[0, 2].set(jnp.nan).at[1, 0].set(jnp.nan)
    row = jnp.asarray([1.0, jnp.nan], jnp.float32)
    for adv in (token, row):
        eager = call(completion_mask=mask, advantages=adv)[0]
        jitted = jax.jit(lambda a: call(completion_mask=mask, advantages=a)[0])(adv)
        assert np.isfinite(float(eager)) and float(eager) == float(jitted)
    with pytest.raises(
        ValueError, match=r"batch\.advantages must be finite where a token counts, got batch\.advantages\[0, 2\] = nan"
    ):
        call(advantages=token)


def test_ignored_reference_inputs_are_not_value_checked(monkeypatch):
    """Without a KL term the reference is ignored (warned): NaN in ``batch.ref_logps`` or ``reference.hidden``
    does not raise, as under jit."""
    monkeypatch.setattr(_validation, "_warned_ignored_reference", set())
    nan = jnp.full((B, T), jnp.nan, jnp.float32)
    with pytest.warns(UserWarning, match="ignored"):
        assert np.isfinite(float(call(ref_logps=nan)[0]))
    a = good_args()
    reference = gmpo_jax.ReferenceHead(jnp.full((B, T, H), jnp.nan), a["weight"])
    with pytest.warns(UserWarning, match="ignored"):
        assert np.isfinite(float(call(reference=reference)[0]))


def test_vjp_takes_a_python_float_cotangent():
    """``jax.vjp(f, x)[1](1.0)``, as JAX allows for a float32 scalar output, gives ``jax.grad``'s result (both ops)."""
    a = good_args()
    batch = gmpo_jax.PolicyBatch(a["completion_ids"], a["completion_mask"], a["advantages"])
    z = jnp.asarray(np.random.default_rng(2).normal(size=(B, T + 1, V)), jnp.float32)
    obj = gmpo_jax.GMPO(beta=0.0)
    for f, x in (
        (lambda z: gmpo_jax.policy_loss_from_logits(z, batch, objective=obj)[0], z),
        (lambda h: gmpo_jax.fused_linear_policy_loss(h, a["weight"], batch, objective=obj)[0], a["hidden"]),
    ):
        (got,) = jax.vjp(f, x)[1](1.0)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.grad(f)(x)))


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_64_bit_ids_under_x64(dtype):
    """Under ``jax_enable_x64`` 64-bit ids keep their values (an unsigned one was compared with the negative int32
    minimum, wrapped, and every id became -1: a NaN loss); one beyond the int32 range is out of range."""
    a = good_args()
    want = float(call()[0])
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        ids = np.asarray(a["completion_ids"]).astype(dtype)
        assert float(call(completion_ids=ids)[0]) == pytest.approx(want, rel=1e-6)
        with pytest.raises(ValueError, match=r"completion_ids"):
            call(completion_ids=ids + dtype(2**33))
    finally:
        jax.config.update("jax_enable_x64", old)
