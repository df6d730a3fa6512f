"""Shared fixtures of the numerics suite: the implementation list, the ONE dtype -> tolerance table,
input builders and the comparison helpers against the float64 oracle in ``spec_numpy.py``."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
# `import spec_numpy` / `from test_logits_loss import ...` from any test file, whichever layer is collected
sys.path[:0] = [_HERE] + [os.path.join(_HERE, d) for d in ("unit", "contract", "kernels", "integration")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import spec_numpy as spec  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--x64",
        action="store_true",
        help="run the whole session with jax_enable_x64 (issue 16: the API keeps its dtypes under x64)",
    )


def pytest_configure(config):
    if config.getoption("--x64", default=False):
        jax.config.update("jax_enable_x64", True)
    # One compiled program serves every test (and every pytest-xdist worker) that builds the same one: JAX's
    # persistent cache, keyed by the program and the JAX version, in a folder of this machine (off: GMPO_TEST_CACHE="").
    cache = os.environ.get("GMPO_TEST_CACHE", os.path.join(tempfile.gettempdir(), "gmpo_jax_test_cache"))
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _on_hopper() -> bool:
    """Whether a Hopper (sm_90) or newer GPU is present: the Mosaic GPU kernels compile and run there."""
    from gmpo_jax.lm_head.mosaic_gpu import supported_on

    try:
        return any(supported_on(d) for d in jax.devices("gpu"))
    except RuntimeError:
        return False


# The GPU tests (marker ``gpu``) that need the compiled Mosaic kernels: skipped elsewhere.
needs_hopper = pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper (sm_90) or newer GPU")


# --------------------------------------------------------------------------------------------------
# Implementations under test. ONE list: the kernel suite joins by adding its name here (e.g.
# "mosaic_gpu", which also runs in Pallas interpret mode on CPU). "reference" (the dense float32
# oracle gmpo_jax.reference) is tested separately against the float64 oracle, see REFERENCE.
# --------------------------------------------------------------------------------------------------
IMPLEMENTATIONS: tuple[str, ...] = ("xla_chunked",)
REFERENCE = "reference"


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request) -> str:
    return request.param


# --------------------------------------------------------------------------------------------------
# The ONE dtype -> tolerance table. Every comparison against the float64 oracle uses it.
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Tol:
    loss_rtol: float  # |loss - ref| <= loss_rtol * max(|ref|, scale); scale = reduction of |terms|
    grad_rtol: float | None  # max|g - ref| <= grad_rtol * max|ref|   (None: use cosine + norm)
    grad_cos: float | None  # cos(g, ref) >= grad_cos                  (low-precision gradients)
    grad_norm_rtol: float | None  # | |g| / |ref| - 1 | <= this         (cosine is blind to scale)
    logp_rtol: float  # |logp - ref| <= logp_rtol * (1 + max|z|)  (the log-sum-exp of |z| rounds)
    reason: str


TOLERANCES: dict[str, Tol] = {
    "float32": Tol(
        loss_rtol=1e-5,
        grad_rtol=1e-4,
        grad_cos=None,
        grad_norm_rtol=None,
        logp_rtol=2e-6,
        reason=(
            "SPEC.md: f32 <= 1e-5 relative loss, 1e-4 gradients on CPU. The loss error is measured "
            "against max(|loss|, scale) because a GRPO sum of +/- terms can cancel, and the f32 error "
            "is relative to the terms, not to their sum. logp: f32 log-sum-exp of logits |z| is exact "
            "to a few ulps of max|z| (eps32 = 1.2e-7; 2e-6 leaves ~16 ulps)."
        ),
    ),
    "bfloat16": Tol(
        loss_rtol=1e-2,
        grad_rtol=None,
        grad_cos=0.999,
        grad_norm_rtol=1e-2,
        logp_rtol=2e-6,
        reason=(
            "SPEC.md: bf16 loss rel err <= 1e-2, gradient cosine >= 0.999, against the oracle run on "
            "the bf16-ROUNDED inputs upcast to f64. Gradients come back in bf16 (8-bit mantissa, "
            "rel. rounding 2^-9 = 2e-3 per element), so also |g|/|ref| within 1e-2 (cosine alone "
            "would pass a gradient scaled by 2). logp: products of bf16 values are exact in f32 and "
            "SPEC demands f32 accumulation, so the logits are as exact as for f32 inputs."
        ),
    ),
    "float16": Tol(
        loss_rtol=1e-2,
        grad_rtol=None,
        grad_cos=0.999,
        grad_norm_rtol=1e-2,
        logp_rtol=2e-6,
        reason="As bfloat16 (SPEC's low-precision contract); f16's 11-bit mantissa is finer than bf16's.",
    ),
}

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# --------------------------------------------------------------------------------------------------
# The kernel and ordering bounds: the tests that do not compare one dtype against the float64 oracle
# through the public API (kernels at the seam, kernels against the XLA path, two vocabulary orders, two
# compiled programs of one kernel). One place, a reason each; test_kernels.py and
# test_order_invariance.py import them. ``max|z|`` is the largest |logit / temperature| of the case.
# --------------------------------------------------------------------------------------------------
# Kernel log-prob / log-sum-exp vs float64, absolute, times (1 + max|z|): float32 accumulation of a
# 64..192-term dot product and a float32 log-sum-exp are exact to a few ulps of the largest logit.
LOGP_TOL = 2e-5
# Kernel entropy vs float64 ``-sum p log p``, absolute, times (1 + max|z|): the kernel's online float32
# sum of ``p (z2 - m2)`` carries the same few ulps of the largest logit as the log-sum-exp.
ENTROPY_TOL = 2e-5
# Kernel dhidden / dW / db vs float64, relative (norm): ``dz`` is rounded to the 16-bit input dtype
# before ``dz W^T`` / ``h^T dz`` (as in the xla_chunked path) and dhidden is returned in that dtype.
GRAD_REL_F64 = 1e-2
# Kernel log-sum-exp vs xla_chunked, absolute, times (1 + max|z|): the same rounding points; only the
# summation order and the kernel's base-2 exponentials differ.
LSE_VS_XLA = 1e-5
# Kernel gradients vs xla_chunked, relative (norm): as LSE_VS_XLA, plus one 16-bit rounding of dz that
# may fall differently.
GRAD_REL_XLA = 2e-3
# Gradients from the float16 logits the log-prob kernel kept vs the recompute, relative (norm): float16
# logits put ``p`` off by at most ``p |ln p| 2**-11``, and dW comes back in the 16-bit weight dtype.
SAVED_REL = 4e-3
# Two compiled programs of the same interpreter kernel (e.g. the log-prob kernel with and without the
# entropy outputs) are different XLA:CPU programs whose float32 rounding may differ: 1 ulp observed at
# one element; bitwise equality is only promised for one compiled kernel on the GPU (``gpu`` tests).
INTERPRET_MAX_ULP = 2
# float32 unit roundoff: the unit of the ulp-based bounds of test_order_invariance.py.
U32 = 2.0**-24
# A float32 log-sum-exp of a row is exact to LSE_ULPS units of (1 + |lse| + |z - lse|); per element
# ``p = exp(z - lse)`` inherits it (test_order_invariance's extreme rows).
LSE_ULPS = 8
# Slack on LSE_ULPS for dlogits of the loss from logits against float64: the objective's ``d loss / d logp``
# sees ``logp`` and carries that error once more.
DLOGITS_SLACK = 4
# Two vocabulary orders against each other: each is within the dtype table of float64, so within
# ORDER_SLACK times it of each other.
ORDER_SLACK = 2
# float32 log-probs of ``make_case`` inputs (logit scale 2, |z| of a few units) vs float64, absolute:
# LOGP_TOL without the (1 + max|z|) factor (test_order_invariance's x64 check).
X64_LOGP_ATOL = 2e-5

# Clip fractions are counts / count: exact up to one f32 division.
METRIC_FRACTION_ATOL = 1e-6


def tol_for(dtype) -> Tol:
    return TOLERANCES[np.dtype(dtype).name]


# --------------------------------------------------------------------------------------------------
# Objectives: one small description mapped to the library's config object and to the oracle kwargs.
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Obj:
    loss_type: str
    epsilon_low: float | None = None  # None: the library's default (SPEC: 0.4 gmpo, 0.2 otherwise)
    epsilon_high: float | None = None
    beta: float = 0.0
    level: str = "token"
    delta: float | None = None
    bias_kl: bool = False
    max_completion_length: int | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def lib(self, **override):
        import gmpo_jax

        kw = dict(beta=self.beta, use_bias_correction_kl=self.bias_kl)
        kw.update(override)
        eps = {}
        if self.epsilon_low is not None:
            eps["epsilon_low"] = self.epsilon_low
        if self.epsilon_high is not None:
            eps["epsilon_high"] = self.epsilon_high
        if self.loss_type == "gmpo":
            return gmpo_jax.GMPO(**eps, **kw)
        if self.loss_type == "cispo":
            eps.pop("epsilon_low", None)
            return gmpo_jax.CISPO(**eps, **kw)
        if self.loss_type == "sapo":
            return gmpo_jax.SAPO(temperature_pos=self.tau_pos, temperature_neg=self.tau_neg, **kw)
        return gmpo_jax.GRPO(
            loss_type=self.loss_type,
            importance_sampling_level=self.level,
            delta=self.delta,
            max_completion_length=self.max_completion_length,
            **eps,
            **kw,
        )

    def spec_kwargs(self) -> dict:
        return dict(
            loss_type=self.loss_type,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            importance_sampling_level=self.level,
            delta=self.delta,
            use_bias_correction_kl=self.bias_kl,
            max_completion_length=self.max_completion_length,
            sapo_temperature_pos=self.tau_pos,
            sapo_temperature_neg=self.tau_neg,
        )

    def __str__(self):
        parts = [self.loss_type]
        if self.level != "token":
            parts.append(self.level)
        if self.beta:
            parts.append(f"beta{self.beta}")
        if self.bias_kl:
            parts.append("biaskl")
        if self.delta is not None:
            parts.append(f"delta{self.delta}")
        if self.epsilon_low is not None or self.epsilon_high is not None:
            parts.append(f"eps{self.epsilon_low},{self.epsilon_high}")
        return "-".join(parts)


# --------------------------------------------------------------------------------------------------
# Inputs.
# --------------------------------------------------------------------------------------------------
# Log ratios used for off-policy cases: away from every clip bound used in the suite (ratio-space
# bounds log(0.8) = -0.223, log(1.2) = 0.182; log-space GMPO bounds +/-0.4; delta 1.5 = log 0.405).
R_GRID = np.array([-1.1, -0.62, -0.3, -0.12, -0.05, 0.0, 0.04, 0.1, 0.28, 0.55, 0.9])


@dataclasses.dataclass
class Case:
    hidden: np.ndarray  # [B, T, H] in the input dtype
    weight: np.ndarray  # [H, V] or [V, H] in the input dtype
    ids: np.ndarray  # [B, T] int32, padding (-100 / V + 5) under the mask
    mask: np.ndarray  # [B, T] bool
    adv: np.ndarray  # [B] f32
    bias: np.ndarray | None
    layout: str
    logp64: np.ndarray  # oracle log-probs of these (rounded) inputs
    old: np.ndarray | None = None
    ref: np.ndarray | None = None
    ris: np.ndarray | None = None

    @property
    def dtype(self):
        return self.hidden.dtype


def ragged_mask(B, T, rng, *, full_first=True, empty_row=None):
    lengths = rng.integers(1, T + 1, size=B)
    if full_first:
        lengths[0] = T
    if empty_row is not None:
        lengths[empty_row] = 0
    return np.arange(T)[None, :] < lengths[:, None]


def make_case(
    seed=0,
    *,
    B=5,
    T=7,
    H=12,
    V=37,
    dtype=np.float32,
    layout="hv",
    with_bias=False,
    logit_scale=2.0,
    temperature=1.0,
    mask=None,
    off_policy=True,
    with_ref=True,
    ris=None,
    adv=None,
) -> Case:
    """Random inputs with a ragged mask and padding ids (-100, V + 5) at masked positions."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, T, H)).astype(dtype)
    w = (rng.normal(size=(H, V)) * (logit_scale / np.sqrt(H))).astype(dtype)
    weight = w if layout == "hv" else np.ascontiguousarray(w.T)
    bias = (rng.normal(size=(V,)) * 0.5).astype(dtype) if with_bias else None
    if mask is None:
        mask = ragged_mask(B, T, rng)
    mask = np.asarray(mask, bool)
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    pad = np.where(rng.random((B, T)) < 0.5, -100, V + 5).astype(np.int32)
    ids = np.where(mask, ids, pad)
    if adv is None:
        adv = rng.normal(size=(B,))
        adv = np.where(np.abs(adv) < 0.1, 0.7, adv)
    adv = np.asarray(adv, np.float32)
    logp64 = spec.spec_logprobs(hidden, weight, ids, mask, bias=bias, temperature=temperature, weight_layout=layout)
    case = Case(hidden, weight, ids, mask, adv, bias, layout, logp64)
    if off_policy:
        r = rng.choice(R_GRID, size=(B, T))
        case.old = np.where(mask, np.minimum(logp64 - r, 0.0), 0.0).astype(np.float32)  # log-probs: <= 0
    if with_ref:
        case.ref = np.where(mask, np.minimum(logp64 + rng.uniform(-0.7, 0.7, size=(B, T)), 0.0), 0.0).astype(np.float32)
    if ris == "bt":
        case.ris = rng.uniform(0.5, 1.5, size=(B, T)).astype(np.float32)
    elif ris == "b1":
        case.ris = rng.uniform(0.5, 1.5, size=(B, 1)).astype(np.float32)
    elif ris == "b":
        case.ris = rng.uniform(0.5, 1.5, size=(B,)).astype(np.float32)
    return case


# --------------------------------------------------------------------------------------------------
# Calling the library (fused implementations or gmpo_jax.reference) and the oracle.
# --------------------------------------------------------------------------------------------------
# XLA:CPU compile time dominates this suite (~2 s per distinct program on 2 cores). Two remedies:
# (1) one module-level jitted function per implementation, with the objective / chunk size / layout as
#     static arguments and every array (and temperature, num_items_in_batch) as a traced argument, so a
#     configuration compiles once and is reused by every test that shares it;
# (2) LLVM at -O0 for those programs, which halves compile time. It changes no IEEE semantics (XLA:CPU
#     compiles without fast-math); the golden, determinism and jit tests run with default options.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _call_policy(
    implementation, chunk_size, objective, weight_layout, h, w, b, ids, mask, adv, old, ref, ris, num_items, temperature
):
    import gmpo_jax
    import gmpo_jax.reference

    batch = gmpo_jax.PolicyBatch(
        ids, mask, adv, old_logps=old, ref_logps=ref, rollout_is_ratio=ris, num_items_in_batch=num_items
    )
    kw = dict(objective=objective, temperature=temperature, bias=b)
    if implementation == REFERENCE:
        return gmpo_jax.reference.policy_loss(h, w, batch, head=gmpo_jax.HeadOptions(weight_layout=weight_layout), **kw)
    head = gmpo_jax.HeadOptions(weight_layout=weight_layout, chunk_size=chunk_size, implementation=implementation)
    return gmpo_jax.fused_linear_policy_loss(h, w, batch, head=head, **kw)


def _value_and_grad(implementation, chunk_size, objective, weight_layout, h, w, b, *rest):
    if b is None:
        f = lambda h, w: _call_policy(implementation, chunk_size, objective, weight_layout, h, w, None, *rest)
        (loss, aux), (dh, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w)
        return (loss, aux), (dh, dw, None)
    f = lambda h, w, b: _call_policy(implementation, chunk_size, objective, weight_layout, h, w, b, *rest)
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(h, w, b)


_FAST_VG = jax.jit(_value_and_grad, static_argnums=(0, 1, 2, 3), compiler_options=FAST_COMPILE)
_FAST_LOSS = jax.jit(_call_policy, static_argnums=(0, 1, 2, 3), compiler_options=FAST_COMPILE)


def _case_args(case: Case, *, temperature, num_items_in_batch, old, ref, ris):
    j = lambda x: None if x is None else jnp.asarray(x)
    return (
        j(case.hidden),
        j(case.weight),
        j(case.bias),
        j(case.ids),
        j(case.mask),
        j(case.adv),
        j(case.old) if old else None,
        j(case.ref) if ref else None,
        j(case.ris) if ris else None,
        None if num_items_in_batch is None else jnp.asarray(num_items_in_batch, jnp.float32),
        jnp.asarray(temperature, jnp.float32),
    )


def lib_value_and_grad(
    case: Case,
    objective,
    *,
    implementation,
    chunk_size=None,
    temperature=1.0,
    num_items_in_batch=None,
    old=True,
    ref=True,
    ris=True,
):
    """((loss, aux), (dhidden, dweight, dbias|None)) of the library for ``case`` (cached fast jit)."""
    args = _case_args(case, temperature=temperature, num_items_in_batch=num_items_in_batch, old=old, ref=ref, ris=ris)
    return _FAST_VG(implementation, chunk_size, objective, case.layout, *args)


def lib_loss(
    case: Case,
    objective,
    *,
    implementation,
    chunk_size=None,
    temperature=1.0,
    num_items_in_batch=None,
    old=True,
    ref=True,
    ris=True,
):
    """(loss, aux) only: the primal path (no gradient work), cached fast jit."""
    args = _case_args(case, temperature=temperature, num_items_in_batch=num_items_in_batch, old=old, ref=ref, ris=ris)
    return _FAST_LOSS(implementation, chunk_size, objective, case.layout, *args)


def fast_jit(f, **kw):
    """jax.jit with the suite's fast-compile options (a fresh function compiles afresh)."""
    return jax.jit(f, compiler_options=FAST_COMPILE, **kw)


def _call_logprobs(implementation, chunk_size, weight_layout, h, w, b, ids, mask, temperature):
    import gmpo_jax
    import gmpo_jax.reference

    if implementation == REFERENCE:
        return gmpo_jax.reference.logprobs(
            h,
            w,
            ids,
            completion_mask=mask,
            bias=b,
            temperature=temperature,
            head=gmpo_jax.HeadOptions(weight_layout=weight_layout),
        )
    return gmpo_jax.fused_linear_logprobs(
        h,
        w,
        ids,
        completion_mask=mask,
        bias=b,
        temperature=temperature,
        head=gmpo_jax.HeadOptions(weight_layout=weight_layout, chunk_size=chunk_size, implementation=implementation),
    )


def _logprobs_and_vjp(implementation, chunk_size, weight_layout, h, w, b, ids, mask, temperature, cot):
    f = lambda h, w, b: _call_logprobs(implementation, chunk_size, weight_layout, h, w, b, ids, mask, temperature)
    logp, vjp = jax.vjp(f, h, w, b)
    return logp, vjp(cot)


_FAST_LOGP = jax.jit(_call_logprobs, static_argnums=(0, 1, 2), compiler_options=FAST_COMPILE)
_FAST_LOGP_VJP = jax.jit(_logprobs_and_vjp, static_argnums=(0, 1, 2), compiler_options=FAST_COMPILE)


def lib_logprobs(
    hidden,
    weight,
    ids,
    mask=None,
    *,
    implementation,
    bias=None,
    temperature=1.0,
    weight_layout="hv",
    chunk_size=None,
    cotangent=None,
):
    """Library log-probs [B, T] (cached fast jit); with ``cotangent``: (logp, (dhidden, dweight, dbias))."""
    j = lambda x: None if x is None else jnp.asarray(x)
    args = (j(hidden), j(weight), j(bias), j(ids), j(mask), jnp.asarray(temperature, jnp.float32))
    if cotangent is None:
        return np.asarray(_FAST_LOGP(implementation, chunk_size, weight_layout, *args))
    return _FAST_LOGP_VJP(implementation, chunk_size, weight_layout, *args, jnp.asarray(cotangent))


def lib_loss_fn(case: Case, objective, *, implementation, chunk_size=None, temperature=1.0, num_items_in_batch=None):
    """A plain function (hidden, weight, bias) -> (loss, aux), everything else closed over (default jit)."""
    _, _, _, ids, mask, adv, old, ref, ris, num_items, _ = _case_args(
        case, temperature=temperature, num_items_in_batch=num_items_in_batch, old=True, ref=True, ris=True
    )
    return lambda h, w, b: _call_policy(
        implementation,
        chunk_size,
        objective,
        case.layout,
        h,
        w,
        b,
        ids,
        mask,
        adv,
        old,
        ref,
        ris,
        num_items,
        temperature,
    )


def spec_for(
    case: Case, obj: Obj, *, temperature=1.0, num_items_in_batch=None, old=True, ref=True, ris=True, logp_for_loss=None
):
    return spec.spec_policy_loss(
        case.hidden,
        case.weight,
        case.ids,
        case.mask,
        case.adv,
        bias=case.bias,
        temperature=temperature,
        weight_layout=case.layout,
        old_logps=case.old if old else None,
        ref_logps=case.ref if ref else None,
        rollout_is_ratio=case.ris if ris else None,
        num_items_in_batch=num_items_in_batch,
        logp_for_loss=logp_for_loss,
        **obj.spec_kwargs(),
    )


# --------------------------------------------------------------------------------------------------
# Comparisons.
# --------------------------------------------------------------------------------------------------
def _f64(x):
    return np.asarray(x).astype(np.float64)


def rel_err(got, want) -> float:
    """``||got - want|| / ||want||`` (2-norm over every element, in float64): the relative gradient error."""
    got, want = _f64(got).ravel(), _f64(want).ravel()
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def assert_loss_close(got, want: float, scale: float, dtype, what="loss"):
    tol = tol_for(dtype)
    got = float(got)
    bound = tol.loss_rtol * max(abs(want), scale, 1e-30)
    assert np.isfinite(got), f"{what}: got {got}, want {want}"
    assert abs(got - want) <= bound, f"{what}: got {got!r}, want {want!r}, |err| {abs(got - want):.3e} > {bound:.3e}"


def assert_grad_close(got, want, dtype, what="grad", grad_rtol=None):
    tol = tol_for(dtype)
    if grad_rtol is not None:
        tol = dataclasses.replace(tol, grad_rtol=grad_rtol)
    assert got.dtype == np.dtype(dtype), f"{what}: cotangent dtype {got.dtype}, want the primal's {np.dtype(dtype)}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    g = _f64(np.asarray(got))
    assert np.all(np.isfinite(g)), f"{what}: non-finite gradient"
    ref_max = np.max(np.abs(want)) if want.size else 0.0
    if ref_max == 0.0:
        assert np.all(g == 0.0), f"{what}: want exactly zero, got max |g| {np.max(np.abs(g))}"
        return
    if tol.grad_rtol is not None:
        err = np.max(np.abs(g - want))
        assert err <= tol.grad_rtol * ref_max, (
            f"{what}: max|err| {err:.3e} > {tol.grad_rtol} * max|ref| {ref_max:.3e}; "
            f"worst at {np.unravel_index(np.argmax(np.abs(g - want)), g.shape)}"
        )
    else:
        ng, nw = np.linalg.norm(g), np.linalg.norm(want)
        cos = float(np.sum(g * want) / max(ng * nw, 1e-300))
        assert cos >= tol.grad_cos, f"{what}: cosine {cos:.6f} < {tol.grad_cos}"
        assert abs(ng / nw - 1) <= tol.grad_norm_rtol, f"{what}: norm ratio {ng / nw:.6f}"


def assert_fraction_close(got, want, what):
    assert abs(float(got) - want) <= METRIC_FRACTION_ATOL, f"{what}: got {float(got)}, want {want}"


def check_against_spec(
    loss, aux, grads, ref: spec.SpecResult, case: Case, obj: Obj, *, check_grads=True, grad_rtol=None
):
    """Loss, metrics and (optionally) gradients of the library against the float64 oracle."""
    dtype = case.dtype
    assert jnp.asarray(loss).dtype == jnp.float32, f"loss dtype {jnp.asarray(loss).dtype}"
    assert_loss_close(loss, ref.loss, ref.scale, dtype)
    m = ref.metrics
    assert_fraction_close(aux.clip_fraction, m["clip_fraction"], "clip_fraction")
    if obj.loss_type == "gmpo":
        assert_fraction_close(aux.clip_fraction_low, m["clip_fraction_low"], "clip_fraction_low")
        assert_fraction_close(aux.clip_fraction_high, m["clip_fraction_high"], "clip_fraction_high")
    if obj.beta != 0.0:
        kl_scale = abs(m["kl"]) if not obj.bias_kl else max(abs(m["kl"]), abs(m["kl_uncorrected"]))
        assert_loss_close(aux.kl, m["kl"], kl_scale, dtype, what="aux.kl")
    # loss == numerator / denominator, with the SPEC's normaliser as denominator.
    assert float(aux.loss_denominator) == pytest.approx(m["loss_denominator"], rel=1e-6), "loss_denominator"
    assert_loss_close(
        aux.loss_numerator, m["loss_numerator"], ref.scale * m["loss_denominator"], dtype, what="loss_numerator"
    )
    if check_grads:
        dh, dw, db = grads
        assert_grad_close(np.asarray(dh), ref.dhidden, dtype, "dhidden", grad_rtol)
        assert_grad_close(np.asarray(dw), ref.dweight, dtype, "dweight", grad_rtol)
        if case.bias is not None:
            assert_grad_close(np.asarray(db), ref.dbias, dtype, "dbias", grad_rtol)


# --------------------------------------------------------------------------------------------------
# Shared by the training tests: configuration errors must stop before anything compiles
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def compile_counter():
    """Counts XLA backend compilations while the test body runs."""
    events = []

    def listener(event, duration, **kwargs):
        if "backend_compile" in event:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)


def jaxpr_ops(closed, keep):
    """``(primitive, aval, source)`` of every equation of a closed jaxpr, its sub-jaxprs (scans, conds, pjit,
    custom-vjp bodies, Pallas kernel bodies) included, with an output ``keep(eqn, aval)`` accepts."""
    from jax._src import source_info_util
    from jax.extend import core as jcore

    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            for v in e.outvars:
                if keep(e, v.aval):
                    found.append((e.primitive.name, str(v.aval), source_info_util.summarize(e.source_info)))
            for p in e.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(sub, jcore.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jcore.Jaxpr):
                        walk(sub)

    walk(closed.jaxpr)
    return found


def filter_window_stats(p, ids, window: int):
    """The gradient filter's per-window statistics in float64 (docs/SPEC.md "LM-head gradient filter"), from the
    softmax ``p [R, V]`` and the targets ``ids [R]``: ``(D, s)``, each ``[R, n_windows]``: ``D`` the row's mass off
    its target in each window of ``window`` columns (the last one partial), ``s = D sqrt(2 ln(n / n_eff))`` its
    score (``n`` the window's columns, ``n_eff`` its mass over its largest probability)."""
    R, V = p.shape
    n_w = -(-V // window)
    pad = np.pad(np.asarray(p, np.float64), ((0, 0), (0, n_w * window - V))).reshape(R, n_w, window)
    onehot = np.zeros((R, n_w * window))
    onehot[np.arange(R), ids] = 1.0
    D = (pad * (1.0 - onehot.reshape(R, n_w, window))).sum(-1)
    width = np.minimum(window, V - window * np.arange(n_w))[None]
    n_eff = pad.sum(-1) / np.maximum(pad.max(-1), 1e-300)
    return D, D * np.sqrt(2.0 * np.log(np.maximum(width / np.maximum(n_eff, 1.0), 1.0)))


def filter_window_means(w_hv, window: int, h_mean=None, bias=None, temperature=1.0):
    """``[n_windows, H]`` float64: each window's mean weight column (``w_hv`` ``[H, V]``), evenly or, with
    ``h_mean``, weighted by ``softmax((h_mean W + b) / temperature)`` over the window's columns (the gradient filter's
    tilted correction, docs/SPEC.md); columns with a ``-inf`` bias left out."""
    w = np.asarray(w_hv, np.float64)
    H, V = w.shape
    z = np.zeros(V) if h_mean is None else np.asarray(h_mean, np.float64) @ w
    b = np.zeros(V) if bias is None else np.asarray(bias, np.float64)
    z = np.where(np.isfinite(b), (z + np.where(np.isfinite(b), b, 0.0)) / temperature, -np.inf)
    out = []
    for a in range(0, V, window):
        zk = z[a : a + window]
        pi = np.exp(zk - zk[np.isfinite(zk)].max()) if np.isfinite(zk).any() else np.zeros_like(zk)
        pi = np.where(np.isfinite(zk), pi, 0.0) if h_mean is not None else np.isfinite(zk).astype(np.float64)
        out.append(w[:, a : a + window] @ pi / pi.sum() if pi.sum() > 0 else np.zeros(H))
    return np.stack(out)
