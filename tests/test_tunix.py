"""gmpo_jax.integrations.tunix against Tunix's own GRPO loss, on tiny random Tunix Qwen3 models (float32, CPU).

Skipped without the optional extra (``pip install -e '.[tunix]'``).

Tolerance (one table, float32 inputs): loss within 2e-5 relative, every parameter gradient within 1e-4 of
that leaf's largest entry. Both sides compute logits, log-sum-exp and ratios in float32 but in different
orders (a chunked online log-sum-exp against Tunix's dense one), which moves results by a few ulps
(measured: ~1e-6 relative); the bounds are SPEC.md's float32 bounds and far below any sign or
factor error (a wrong normaliser or a dropped KL term changes the loss by >1e-2).
"""

import re

import numpy as np
import pytest

tunix = pytest.importorskip("tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl import algo_core, function_registry  # noqa: E402
from tunix.rl.grpo.dapo_learner import DAPOConfig  # noqa: E402
from tunix.rl.grpo.drgrpo_learner import DrGRPOConfig  # noqa: E402
from tunix.rl.grpo.grpo_learner import GRPOConfig, TrainExample  # noqa: E402

import gmpo_jax  # noqa: E402
from gmpo_jax.integrations import tunix as gtx  # noqa: E402

LOSS_RTOL, GRAD_TOL = 2e-5, 1e-4
PAD, EOS = 0, 1


def tiny_qwen3(vocab=97, tied=False, seed=0):
    cfg = qwen3.ModelConfig(
        num_layers=1,
        vocab_size=vocab,
        embed_dim=16,
        hidden_dim=32,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        rope_theta=10_000,
        norm_eps=1e-6,
        use_tied_embedding=tied,
    )
    return qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))


def example(B=4, P=3, T=6, vocab=97, *, old=True, ref=False, sampler=False, seed=0):
    """Left-padded prompts, right-padded completions, one completion fully padded."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(2, vocab, (B, P))
    prompt[0, :1] = PAD
    comp = rng.integers(2, vocab, (B, T))
    comp[1, T // 2 :] = PAD
    comp[2, :] = PAD
    near = lambda: jnp.asarray(rng.normal(size=(B, T)) * 0.3 - np.log(vocab), jnp.float32)  # noqa: E731
    return TrainExample(
        prompt_ids=jnp.asarray(prompt),
        prompt_mask=jnp.asarray(prompt != PAD),
        completion_ids=jnp.asarray(comp),
        completion_mask=jnp.asarray(comp != PAD),
        advantages=jnp.asarray(rng.normal(size=B), jnp.float32),
        ref_per_token_logps=near() if ref else None,
        old_per_token_logps=near() if old else None,
        sampler_is_weights=jnp.asarray(rng.uniform(0.5, 1.5, (B, T)), jnp.float32) if sampler else None,
    )


def value_and_grad(loss_fn, model, ex, config):
    @nnx.jit
    def run(model, ex):
        f = lambda m: loss_fn(m, ex, algo_config=config, pad_id=PAD, eos_id=EOS)  # noqa: E731
        return nnx.value_and_grad(f, has_aux=True)(model)

    (loss, aux), grads = run(model, ex)
    return loss, aux, nnx.state(grads, nnx.Param)


def assert_same(tunix_out, ours_out):
    (l1, a1, g1), (l2, a2, g2) = tunix_out, ours_out
    np.testing.assert_allclose(l2, l1, rtol=LOSS_RTOL, atol=1e-7)
    for key in ("kl", "pg_clipfrac"):
        np.testing.assert_allclose(a2[key], a1[key], rtol=LOSS_RTOL, atol=1e-7, err_msg=key)
    leaves1, leaves2 = jax.tree.leaves(g1), jax.tree.leaves(g2)
    assert len(leaves1) == len(leaves2)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in leaves1)
    for a, b in zip(leaves1, leaves2):
        scale = max(float(jnp.max(jnp.abs(a))), 1e-12)
        assert float(jnp.max(jnp.abs(a - b))) <= GRAD_TOL * scale


def with_temperature(config, t):
    config.temperature = t  # what the learner sets from the rollout config
    return config


CASES = {
    # GRPO, per-sequence mean, k3 KL folded into the fused pass, off-policy, rollout temperature
    "grpo_kl": (
        lambda: with_temperature(GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl"), 0.9),
        dict(ref=True),
    ),
    # DAPO: token-mean, clip-higher, sampler importance weights
    "dapo_sampler_is": (lambda: with_temperature(DAPOConfig(num_generations=2), 1.0), dict(sampler=True)),
    # Dr.GRPO: sequence-mean-token-scale, with GSPO-token importance sampling
    "drgrpo_gspo": (
        lambda: with_temperature(DrGRPOConfig(num_generations=2, beta=0.0, loss_algo="gspo-token"), 1.0),
        dict(),
    ),
    # seq-mean-token-sum, Tunix's default "kl" estimator (second fused pass), on-policy
    "token_sum_kl_mode": (
        lambda: with_temperature(GRPOConfig(num_generations=2, beta=0.1, loss_agg_mode="seq-mean-token-sum"), 0.0),
        dict(old=False, ref=True),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_tunix_grpo_loss(case):
    make_config, ex_kwargs = CASES[case]
    config, model, ex = make_config(), tiny_qwen3(), example(**ex_kwargs)
    expected = value_and_grad(algo_core.grpo_loss_fn, model, ex, config)
    got = value_and_grad(gtx.make_policy_loss_fn(), model, ex, config)
    assert_same(expected, got)


def test_matches_tunix_grpo_loss_tied_embedding():
    config = with_temperature(
        GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl", loss_agg_mode="token-mean"), 0.7
    )
    model, ex = tiny_qwen3(tied=True), example(ref=True, seed=1)
    assert gtx.lm_head(model)[1] == "vh"
    assert_same(
        value_and_grad(algo_core.grpo_loss_fn, model, ex, config),
        value_and_grad(gtx.make_policy_loss_fn(), model, ex, config),
    )


def test_gmpo_through_tunix_matches_reference():
    """GMPO via the Tunix loss fn == gmpo_jax.reference.policy_loss on the model's dense logits."""
    config = with_temperature(GRPOConfig(num_generations=2, beta=0.05, kl_loss_mode="low_var_kl"), 0.8)
    model, ex = tiny_qwen3(seed=2), example(ref=True, seed=2)
    objective = gmpo_jax.GMPO(epsilon_low=0.3, epsilon_high=0.35)

    def dense(model, ex, algo_config, pad_id, eos_id):
        hidden = gtx.final_hidden_states(model, ex.prompt_ids, ex.completion_ids, pad_id=pad_id, eos_id=eos_id)
        weight, layout = gtx.lm_head(model)
        mask = ex.completion_mask
        loss, aux = gmpo_jax.reference.policy_loss(
            hidden,
            weight,
            ex.completion_ids,
            mask,
            ex.advantages,
            objective=gmpo_jax.GMPO(epsilon_low=0.3, epsilon_high=0.35, beta=0.05),
            old_logps=ex.old_per_token_logps,
            ref_logps=ex.ref_per_token_logps,
            temperature=0.8,
            weight_layout=layout,
        )
        rows = jnp.sum(jnp.sum(mask, -1) > 0)  # Tunix's sequence-mean-token-mean: mean over non-empty rows
        return loss * mask.shape[0] / rows, {"kl": aux.kl, "pg_clipfrac": aux.clip_fraction}

    assert_same(
        value_and_grad(dense, model, ex, config), value_and_grad(gtx.make_policy_loss_fn(objective), model, ex, config)
    )


def test_register_switches_learner_lookup():
    name = gtx.register("gmpo_jax_test", objective=gmpo_jax.GMPO())
    assert name == "gmpo_jax_test"
    assert function_registry.get_policy_loss_fn(name).__name__ == "gmpo_jax_policy_loss_fn"
    config = GRPOConfig(num_generations=2, policy_loss_fn=name)  # Tunix's GRPOConfig accepts the name
    assert config.policy_loss_fn == name
    with pytest.raises(ValueError, match="built-in"):
        gtx.register("grpo")


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda c, e: (c, e.replace(segment_ids=jnp.zeros_like(e.completion_ids))), "packed"),
        (lambda c, e: (c, e.replace(advantages=jnp.zeros(e.completion_ids.shape))), "token-level advantages"),
        (lambda c, e: (setattr(c, "epsilon_c", 3.0) or c, e), "dual-clip"),
    ],
)
def test_unmapped_features_raise(bad, match):
    config, ex = bad(GRPOConfig(num_generations=2, beta=0.0), example())
    with pytest.raises(NotImplementedError, match=match):
        gtx.loss_arguments(config, ex)


def test_gmpo_rejects_other_aggregations():
    config = GRPOConfig(num_generations=2, beta=0.0, loss_agg_mode="token-mean")
    with pytest.raises(NotImplementedError, match="GMPO"):
        gtx.loss_arguments(config, example(), gmpo_jax.GMPO())


def _largest_buffer(hlo_text):
    sizes = [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"(?:f32|bf16|f16)\[([\d,]*)\]", hlo_text)
    ]
    return max(sizes)


def test_compiled_step_holds_no_logits():
    """The jitted loss + gradient holds no [B, T, V] buffer; Tunix's own loss does (the control)."""
    B, P, T, V = 4, 3, 8, 4099  # B * T = 32 > D = 16, so [B, T, V] is larger than the [D, V] head itself
    config = with_temperature(GRPOConfig(num_generations=2, beta=0.0), 1.0)
    model, ex = tiny_qwen3(vocab=V), example(B=B, P=P, T=T, vocab=V)

    def compiled_hlo(loss_fn):
        graphdef, state = nnx.split(model)

        def step(state, ex):
            def f(state):
                return loss_fn(nnx.merge(graphdef, state), ex, algo_config=config, pad_id=PAD, eos_id=EOS)

            return jax.value_and_grad(f, has_aux=True)(state)

        return jax.jit(step).lower(state, ex).compile().as_text()

    # chunk_size=1: one sequence per chunk, so no chunk-sized buffer can reach B * T * V by itself
    ours = _largest_buffer(compiled_hlo(gtx.make_policy_loss_fn(chunk_size=1)))
    theirs = _largest_buffer(compiled_hlo(algo_core.grpo_loss_fn))
    assert theirs >= B * T * V
    assert ours < B * T * V, ours


def test_grpo_learner_trains_with_fused_gmpo():
    """Two steps of Tunix's GRPOLearner (vanilla sampler, KL to a reference) with the fused GMPO loss."""
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo.grpo_learner import GRPOLearner
    from tunix.rl.rollout import base_rollout
    from tunix.tests import test_common

    vocab = test_common.MockVocab()
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    cluster = rl_cluster_lib.RLCluster(
        actor=tiny_qwen3(vocab=vocab.GetPieceSize()),
        reference=tiny_qwen3(vocab=vocab.GetPieceSize()),
        tokenizer=vocab,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in roles},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100, max_steps=2
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=4, max_prompt_length=8, kv_cache_size=16, temperature=0.9
            ),
        ),
    )
    calls = []
    fused = gtx.make_policy_loss_fn(gmpo_jax.GMPO())

    def counted(*args, **kwargs):  # traced once per compilation: proves the learner runs our loss
        calls.append(1)
        return fused(*args, **kwargs)

    function_registry.register_policy_loss_fn("gmpo_jax_learner_test")(counted)
    config = GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl", policy_loss_fn="gmpo_jax_learner_test")

    def rewards(prompts, completions, **kwargs):
        return list(np.random.default_rng(0).normal(size=len(completions)))

    learner = GRPOLearner(rl_cluster=cluster, algo_config=config, reward_fns=rewards)
    model = cluster.actor_trainer.model
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    learner.train([{"prompts": np.array(["input string", "hello world"])}] * 2)
    after = nnx.state(model, nnx.Param)
    assert calls
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(after))
    assert any(bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
