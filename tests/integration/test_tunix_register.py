"""``gmpo_jax.integrations.tunix.register``: what it refuses at register time, before any learner step.

The learner passes the KL coefficient as its config's ``beta`` (and computes the reference log-probs only when
that is non-zero), so a GMPO objective with its own ``beta`` is refused when registered, as are a name already
in Tunix's registry (unless ``replace=True``) and, given ``algo_config=``, a config the loss would refuse on its
first call. Nothing is registered when ``register`` raises. No model runs here (registry and config checks
only). Skipped without Tunix.
"""

import itertools

import pytest

pytest.importorskip("tunix")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tunix.rl import function_registry  # noqa: E402
from tunix.rl.grpo.dapo_learner import DAPOConfig  # noqa: E402
from tunix.rl.grpo.grpo_learner import GRPOConfig, TrainExample  # noqa: E402

import gmpo_jax  # noqa: E402
from gmpo_jax.integrations import tunix as gtx  # noqa: E402

_names = itertools.count()


def fresh_name() -> str:
    """A name nothing has registered yet (Tunix's registry is process-global and has no removal)."""
    return f"gmpo_jax_register_test_{next(_names)}"


def registered(name: str) -> bool:
    try:
        function_registry.get_policy_loss_fn(name)
    except LookupError:
        return False
    return True


@pytest.mark.parametrize("beta", [0.04, np.float32(0.04), jnp.float32(0.04)])
def test_gmpo_with_its_own_beta_is_refused_at_register(beta):
    name = fresh_name()
    with pytest.raises(ValueError, match=r"objective\.beta=.* must be 0 with Tunix.*GRPOConfig\(beta="):
        gtx.register(name, objective=gmpo_jax.GMPO(beta=beta))
    assert not registered(name)
    with pytest.raises(ValueError, match=r"objective\.beta"):  # the same check without the registry
        gtx.make_policy_loss_fn(gmpo_jax.GMPO(beta=beta))


@pytest.mark.parametrize("beta", [0.0, 0, jnp.float32(0.0)])
def test_gmpo_with_zero_beta_registers(beta):
    name = fresh_name()
    assert gtx.register(name, objective=gmpo_jax.GMPO(beta=beta)) == name
    assert function_registry.get_policy_loss_fn(name).__name__ == "gmpo_jax_policy_loss_fn"


def test_duplicate_name_is_refused_unless_replace():
    name = gtx.register(fresh_name())
    first = function_registry.get_policy_loss_fn(name)
    with pytest.raises(ValueError, match=r"already registered.*replace=True"):
        gtx.register(name, objective=gmpo_jax.GMPO())
    assert function_registry.get_policy_loss_fn(name) is first  # untouched
    assert gtx.register(name, objective=gmpo_jax.GMPO(), replace=True) == name
    assert function_registry.get_policy_loss_fn(name) is not first


def test_name_registered_by_someone_else_is_refused():
    name = fresh_name()
    function_registry.register_policy_loss_fn(name)(lambda *a, **k: None)
    theirs = function_registry.get_policy_loss_fn(name)
    with pytest.raises(ValueError, match="already registered"):
        gtx.register(name)
    assert function_registry.get_policy_loss_fn(name) is theirs


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_tunix_builtins_are_refused_even_with_replace(name):
    builtin = function_registry.get_policy_loss_fn(name)
    with pytest.raises(ValueError, match="built-in"):
        gtx.register(name, replace=True)
    assert function_registry.get_policy_loss_fn(name) is builtin


@pytest.mark.parametrize("name", ["", None, 3])
def test_name_must_be_a_non_empty_string(name):
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        gtx.register(name)


def test_algo_config_must_name_this_loss():
    name = fresh_name()
    config = GRPOConfig(num_generations=2, policy_loss_fn="gmpo_jax_typo")
    with pytest.raises(ValueError, match=r"algo_config\.policy_loss_fn='gmpo_jax_typo'"):
        gtx.register(name, algo_config=config)
    assert not registered(name)


def with_attr(config, **attrs):
    """``config`` with attributes set that its ``__init__`` does not take (Tunix's PPO ``epsilon_c``)."""
    for key, value in attrs.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize(
    "make_config, objective, error, match",
    [
        (lambda n: DAPOConfig(policy_loss_fn=n), gmpo_jax.GMPO(), NotImplementedError, "token-mean"),
        (
            lambda n: GRPOConfig(num_generations=2, loss_algo="gspo-token", policy_loss_fn=n),
            gmpo_jax.GMPO(),
            NotImplementedError,
            "gspo-token",
        ),
        (
            lambda n: with_attr(GRPOConfig(num_generations=2, policy_loss_fn=n), epsilon_c=3.0),
            None,
            NotImplementedError,
            "dual",
        ),
        (lambda n: GRPOConfig(num_generations=2, loss_agg_mode="mean", policy_loss_fn=n), None, ValueError, "agg"),
        (  # Tunix's default kl_loss_mode="kl" runs as Tunix's own KL, which has no bias correction
            lambda n: GRPOConfig(num_generations=2, beta=0.04, policy_loss_fn=n),
            gmpo_jax.GMPO(use_bias_correction_kl=True),
            NotImplementedError,
            "use_bias_correction_kl",
        ),
    ],
)
def test_algo_config_is_checked_at_register(make_config, objective, error, match):
    name = fresh_name()
    with pytest.raises(error, match=match):
        gtx.register(name, objective=objective, algo_config=make_config(name))
    assert not registered(name)


@pytest.mark.parametrize(
    "config",
    [
        dict(beta=0.04, kl_loss_mode="low_var_kl"),  # folded k3 KL: the bias correction applies
        dict(beta=0.0),  # no KL term at all
    ],
)
def test_bias_corrected_gmpo_registers_where_it_applies(config):
    name = fresh_name()
    config = GRPOConfig(num_generations=2, policy_loss_fn=name, **config)
    assert gtx.register(name, objective=gmpo_jax.GMPO(use_bias_correction_kl=True), algo_config=config) == name


def test_bias_correction_with_tunix_kl_raises_in_the_loss_too():
    """Without ``algo_config=`` at register, the loss refuses the combination on its first call (before, the
    correction was silently dropped: Tunix's KL ran uncorrected)."""
    B, T = 2, 3
    ex = TrainExample(
        prompt_ids=jnp.ones((B, 2), jnp.int32),
        prompt_mask=jnp.ones((B, 2), bool),
        completion_ids=jnp.ones((B, T), jnp.int32),
        completion_mask=jnp.ones((B, T), bool),
        advantages=jnp.ones((B,), jnp.float32),
        ref_per_token_logps=jnp.zeros((B, T), jnp.float32),
        old_per_token_logps=None,
    )
    config = GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="kl")
    with pytest.raises(NotImplementedError, match="use_bias_correction_kl"):
        gtx.loss_arguments(config, ex, gmpo_jax.GMPO(use_bias_correction_kl=True))
    args = gtx.loss_arguments(config, ex, gmpo_jax.GMPO())  # uncorrected: Tunix's KL, a second pass
    assert args.batch.ref_logps is None and not args.objective.has_kl
