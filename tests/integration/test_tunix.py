"""gmpo_jax.integrations.tunix against Tunix's own GRPO loss, on tiny random Tunix Qwen3 models (float32, CPU).

Skipped without the optional extra (``pip install -e '.[tunix]'``).

Packed TrainExamples are made by Tunix's own ``tunix.rl.utils.pack_sequences`` from the padded ones (two
rows of 16 tokens: sequences of 8 and 6 tokens then padding; a sequence with an empty completion, one of
9 tokens, then padding) and checked two ways: the same sequences padded and packed give the same loss and
gradients through the integration, and the packed loss equals a per-sequence JAX reference fed by Tunix's
``compute_per_token_logps`` on the packed buffer (dense logits).

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
from tunix.rl import algo_core, common, function_registry  # noqa: E402
from tunix.rl import utils as rl_utils  # noqa: E402
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


def example(B=4, P=3, T=6, vocab=97, *, old=True, ref=False, sampler=False, token_adv=False, seed=0):
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
        advantages=jnp.asarray(rng.normal(size=(B, T) if token_adv else B), jnp.float32),
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


def assert_same(tunix_out, ours_out, keys=("kl", "pg_clipfrac")):
    (l1, a1, g1), (l2, a2, g2) = tunix_out, ours_out
    np.testing.assert_allclose(l2, l1, rtol=LOSS_RTOL, atol=1e-7)
    for key in keys:
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
    # token-level [B, T] advantages in the padded layout (Tunix broadcasts them per token)
    "token_advantages": (
        lambda: with_temperature(GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl"), 1.0),
        dict(ref=True, token_adv=True),
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


def test_logits_precision_passes_through():
    """``HeadOptions(logits_precision=...)`` reaches the fused loss (float32 model: Tunix's own loss to float32
    tolerance); a bad value raises when the options are built, naming the field, and a ``head`` that is not
    ``HeadOptions`` when the loss function is made."""
    config = CASES["grpo_kl"][0]()
    model, ex = tiny_qwen3(), example(ref=True)
    head = gmpo_jax.HeadOptions(logits_precision="float32")
    assert_same(
        value_and_grad(algo_core.grpo_loss_fn, model, ex, config),
        value_and_grad(gtx.make_policy_loss_fn(head=head), model, ex, config),
    )
    with pytest.raises(ValueError, match="logits_precision"):
        gmpo_jax.HeadOptions(logits_precision="fp32")
    with pytest.raises(TypeError, match="head"):
        gtx.make_policy_loss_fn(head=dict(logits_precision="float32"))


@pytest.mark.parametrize("sampler", [False, True])
def test_gmpo_through_tunix_matches_reference(sampler):
    """GMPO via the Tunix loss fn == gmpo_jax.reference.policy_loss on the model's dense logits (with
    ``sampler_is_weights``: as ``rollout_is_ratio``, GMPO's geometric mean of the token weights)."""
    config = with_temperature(GRPOConfig(num_generations=2, beta=0.05, kl_loss_mode="low_var_kl"), 0.8)
    model, ex = tiny_qwen3(seed=2), example(ref=True, seed=2, sampler=sampler)
    objective = gmpo_jax.GMPO(epsilon_low=0.3, epsilon_high=0.35)

    def dense(model, ex, algo_config, pad_id, eos_id):
        hidden = gtx.final_hidden_states(model, ex.prompt_ids, ex.completion_ids, pad_id=pad_id, eos_id=eos_id)
        weight, layout = gtx.lm_head(model)
        mask = ex.completion_mask
        batch = gmpo_jax.PolicyBatch(
            ex.completion_ids,
            mask,
            ex.advantages,
            old_logps=ex.old_per_token_logps,
            ref_logps=ex.ref_per_token_logps,
            rollout_is_ratio=ex.sampler_is_weights,
        )
        loss, aux = gmpo_jax.reference.policy_loss(
            hidden,
            weight,
            batch,
            objective=gmpo_jax.GMPO(epsilon_low=0.3, epsilon_high=0.35, beta=0.05),
            temperature=0.8,
            head=gmpo_jax.HeadOptions(weight_layout=layout),
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
        (lambda c, e: (setattr(c, "epsilon_c", 3.0) or c, e), "dual-clip"),
        (lambda c, e: (setattr(c, "loss_algo", "gspo-token") or c, e), "gspo-token"),
    ],
)
def test_unmapped_features_raise(bad, match):
    config, ex = bad(GRPOConfig(num_generations=2, beta=0.0), example(sampler=True))
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
    ours = _largest_buffer(compiled_hlo(gtx.make_policy_loss_fn(head=gmpo_jax.HeadOptions(chunk_size=1))))
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


# ---------------------------------------------------------------------------------------------------------
# Packed TrainExamples (segment_ids / segment_positions, prompt_ids [B, 0], [B, L] advantages)

PACK_BUDGET = 16


def pack(ex, budget=PACK_BUDGET):
    """``ex`` packed by Tunix's own ``pack_sequences`` (one row per packed example), rows stacked."""
    rows = [p for group in rl_utils.pack_sequences(iter([[ex]]), budget, pad_id=PAD) for p in group]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *rows)


class SegmentMaskedQwen3(qwen3.Qwen3):
    """Tunix's Qwen3, attending causally within each segment when called as Tunix calls it on packed rows
    (``attention_mask=None`` with ``segment_ids``): what its splash kernel computes on TPU. Tunix 0.1.7's
    other attention path applies no mask at all then (neither causal nor per segment), so this stands in
    for the kernel on CPU. Same parameters as :func:`tiny_qwen3` for the same seed."""

    def __call__(self, input_tokens, positions, cache, attention_mask, output_hidden_states=False, segment_ids=None):
        if attention_mask is None and segment_ids is not None:
            L = input_tokens.shape[1]
            causal = jnp.arange(L)[:, None] >= jnp.arange(L)[None, :]
            attention_mask = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])
        return super().__call__(input_tokens, positions, cache, attention_mask, output_hidden_states, segment_ids)


def segment_masked_qwen3(seed=0):
    return SegmentMaskedQwen3(tiny_qwen3(seed=seed).config, rngs=nnx.Rngs(seed))


def test_pack_layout():
    """What the packed tests run on: Tunix's packing of example() (so that they test what they claim)."""
    ex = example(ref=True)
    pk = pack(ex)
    seg, mask = np.asarray(pk.segment_ids), np.asarray(pk.completion_mask)
    np.testing.assert_array_equal(seg, [[1] * 8 + [2] * 6 + [0] * 2, [1] * 3 + [2] * 9 + [0] * 4])
    assert pk.prompt_ids.shape == (2, 0) and pk.advantages.shape == (2, PACK_BUDGET)
    assert mask.sum() == np.asarray(ex.completion_mask).sum()
    assert mask[1, :3].sum() == 0  # the sequence with an empty completion: its prompt only
    starts = np.ones_like(seg, bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    assert not np.any(mask[starts])  # every sequence starts with a masked prompt token


PACKED_CASES = {
    # sequence-mean-token-mean, k3 KL folded, off-policy, rollout temperature
    "grpo_kl": (
        lambda: with_temperature(GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl"), 0.9),
        dict(ref=True),
        {},
    ),
    # token-mean, clip-higher
    "dapo": (lambda: with_temperature(DAPOConfig(num_generations=2), 1.0), dict(), {}),
    # Dr.GRPO's token scale at the padded width, GSPO-token (per packed sequence)
    "drgrpo_gspo": (
        lambda: with_temperature(DrGRPOConfig(num_generations=2, beta=0.0, loss_algo="gspo-token"), 1.0),
        dict(),
        dict(max_completion_length=6),
    ),
    # seq-mean-token-sum with Tunix's "kl" estimator (second pass) and the entropy metric, on-policy
    "token_sum_kl_mode": (
        lambda: with_temperature(GRPOConfig(num_generations=2, beta=0.1, loss_agg_mode="seq-mean-token-sum"), 0.0),
        dict(old=False, ref=True),
        dict(compute_entropy=True),
    ),
    "token_sum_norm": (
        lambda: with_temperature(
            GRPOConfig(num_generations=2, beta=0.0, loss_agg_mode="sequence-mean-token-sum-norm"), 1.0
        ),
        dict(),
        {},
    ),
    # GMPO: the geometric mean per packed sequence, k3 KL
    "gmpo": (
        lambda: with_temperature(GRPOConfig(num_generations=2, beta=0.05, kl_loss_mode="low_var_kl"), 0.8),
        dict(ref=True),
        dict(objective=gmpo_jax.GMPO(epsilon_low=0.3, epsilon_high=0.35)),
    ),
}


@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_packed_matches_padded(case):
    """The same sequences packed (Tunix's pack_sequences) and padded give the same loss, metrics and
    gradients through the integration (same tolerances: only float32 summation orders differ)."""
    make_config, ex_kwargs, fn_kwargs = PACKED_CASES[case]
    config, model, ex = make_config(), tiny_qwen3(), example(**ex_kwargs)
    fn_kwargs = dict(fn_kwargs)
    objective = fn_kwargs.pop("objective", None)
    loss_fn = gtx.make_policy_loss_fn(objective, **fn_kwargs)
    padded = value_and_grad(loss_fn, model, ex, config)
    packed = value_and_grad(loss_fn, model, pack(ex), config)
    keys = ["kl", "pg_clipfrac", "log_ratio/min", "log_ratio/max"] + [
        k for k in ("kl_loss", "entropy") if k in padded[1]
    ]
    assert_same(padded, packed, keys=keys)


def sequence_spans(ex, by_row=False):
    """``[(row, live columns)]`` per sequence with a completion token (NumPy, from the concrete example);
    ``by_row``: one span per row, as Tunix's ``aggregate_loss`` sees a packed row."""
    seg, mask = np.asarray(ex.segment_ids), np.asarray(ex.completion_mask) != 0
    spans = []
    for r in range(seg.shape[0]):
        keys = [0] if by_row else sorted(set(seg[r][seg[r] > 0]))
        for k in keys:
            cols = np.flatnonzero(mask[r] & (seg[r] > 0) & ((seg[r] == k) | by_row))
            if cols.size:
                spans.append((r, cols))
    return spans


def reference_loss(logp, ex, spans, config, objective=None, norm=None):
    """Tunix's GRPO-family loss (or GMPO) with each span a sequence, from per-token log-probs ``[B, L]``:
    written per sequence with Python loops, independent of gmpo_jax."""
    old = jax.lax.stop_gradient(logp) if ex.old_per_token_logps is None else ex.old_per_token_logps
    beta = config.beta or 0.0
    per_seq = []  # (sum of per-token loss, token count) per sequence
    for r, cols in spans:
        lp, o, a = logp[r, cols], old[r, cols], ex.advantages[r, cols]
        kl = 0.0
        if beta:
            kl = common.compute_kl_divergence(lp, ex.ref_per_token_logps[r, cols], config.kl_loss_mode)
        if objective is not None:  # GMPO: one advantage per sequence, log-space clip, geometric mean
            A = jnp.mean(a)
            d = lp - o
            c = jnp.where(A > 0, jnp.minimum(d, objective.epsilon_high), jnp.maximum(d, -objective.epsilon_low))
            per_seq.append(((-A * jnp.exp(jnp.mean(c)) + beta * jnp.mean(kl)) * cols.size, cols.size))
            continue
        ratio = jnp.exp(lp - o)
        clipped = jnp.clip(ratio, 1 - config.epsilon, 1 + getattr(config, "epsilon_high", config.epsilon))
        ptl = jnp.maximum(-a * ratio, -a * clipped) + beta * kl
        per_seq.append((jnp.sum(ptl), cols.size))
    agg, n = config.loss_agg_mode, len(per_seq)
    if agg == "token-mean":
        return sum(s for s, _ in per_seq) / sum(c for _, c in per_seq)
    if agg == "sequence-mean-token-mean":
        return sum(s / c for s, c in per_seq) / n
    if agg == "sequence-mean-token-scale":
        return sum(s for s, _ in per_seq) / norm / n
    return sum(s for s, _ in per_seq) / n


def tunix_packed_logps(model, ex, temperature):
    graphdef, state = nnx.split(model)
    return common.compute_per_token_logps(
        graphdef,
        state,
        ex.prompt_ids,
        ex.completion_ids,
        PAD,
        EOS,
        stop_gradient=False,
        segment_ids=ex.segment_ids,
        segment_positions=ex.segment_positions,
        temperature=temperature,
    )


REFERENCE_CASES = {
    # token-mean with Tunix's "kl" estimator (our second pass), rollout temperature
    "grpo_token_mean": (
        lambda: GRPOConfig(num_generations=2, beta=0.1, kl_loss_mode="kl", loss_agg_mode="token-mean"),
        None,
        None,
    ),
    # the GRPO default: per-sequence mean, k3 KL folded into the fused pass
    "grpo_sequence_mean": (lambda: GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl"), None, None),
    "drgrpo_token_scale": (lambda: DrGRPOConfig(num_generations=2, beta=0.0), None, 6),
    "gmpo": (
        lambda: GRPOConfig(num_generations=2, beta=0.05, kl_loss_mode="low_var_kl"),
        gmpo_jax.GMPO(epsilon_low=0.3, epsilon_high=0.35),
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_packed_matches_per_sequence_reference(case):
    """Packed loss and gradients == the per-sequence reference on Tunix's packed log-probs (dense logits)."""
    make_config, objective, norm = REFERENCE_CASES[case]
    config = with_temperature(make_config(), 0.9)
    model, ex = segment_masked_qwen3(seed=3), pack(example(ref=True, seed=3))
    spans = sequence_spans(ex)
    assert len(spans) == 3  # the empty-completion sequence is not counted

    def reference(model, ex, algo_config, pad_id, eos_id):
        logp = tunix_packed_logps(model, ex, algo_config.temperature)
        return reference_loss(logp, ex, spans, algo_config, objective, norm or ex.completion_ids.shape[1]), {}

    ours = gtx.make_policy_loss_fn(objective, max_completion_length=norm)
    assert_same(value_and_grad(reference, model, ex, config), value_and_grad(ours, model, ex, config), keys=())


def test_tunix_own_packed_loss_treats_a_row_as_one_sequence():
    """What docs/tunix.md says of Tunix's own packed loss (with attention masked as its splash kernel does):
    token-mean agrees with ours; sequence-mean-token-mean is the per-row token mean, not a sequence mean."""
    model, ex = segment_masked_qwen3(seed=4), pack(example(seed=4))
    logp = tunix_packed_logps(model, ex, 1.0)
    for agg in ("token-mean", "sequence-mean-token-mean"):
        config = with_temperature(GRPOConfig(num_generations=2, beta=0.0, loss_agg_mode=agg), 1.0)
        theirs, _ = algo_core.grpo_loss_fn(model, ex, config, PAD, EOS)
        ours, _ = gtx.make_policy_loss_fn()(model, ex, config, PAD, EOS)
        per_row = reference_loss(logp, ex, sequence_spans(ex, by_row=True), config)
        per_seq = reference_loss(logp, ex, sequence_spans(ex), config)
        np.testing.assert_allclose(theirs, per_row, rtol=LOSS_RTOL)
        np.testing.assert_allclose(ours, per_seq, rtol=LOSS_RTOL)
        if agg == "token-mean":
            np.testing.assert_allclose(ours, theirs, rtol=LOSS_RTOL)
        else:
            assert abs(float(ours) - float(theirs)) > 1e-3


def test_packed_first_row_is_zero_and_masked():
    """final_hidden_states: packed row 0 is zeros, row t is the model's state at t - 1 (Tunix's shift)."""
    model, ex = tiny_qwen3(), pack(example())
    hidden = gtx.final_hidden_states(
        model,
        ex.prompt_ids,
        ex.completion_ids,
        pad_id=PAD,
        eos_id=EOS,
        segment_ids=ex.segment_ids,
        segment_positions=ex.segment_positions,
    )
    assert hidden.shape == ex.completion_ids.shape + (16,)
    assert not np.any(np.asarray(hidden[:, 0]))
    assert np.all(np.any(np.asarray(hidden[:, 1:]) != 0, axis=-1))
    assert not np.any(np.asarray(ex.completion_mask)[:, 0])


def _packed_error_cases():
    def fhs(change=None, **changes):
        def call(ex):
            kw = dict(segment_ids=ex.segment_ids, segment_positions=ex.segment_positions, prompt_ids=ex.prompt_ids)
            kw.update(change(ex) if change else changes)
            prompt = kw.pop("prompt_ids")
            return gtx.final_hidden_states(tiny_qwen3(), prompt, ex.completion_ids, pad_id=PAD, eos_id=EOS, **kw)

        return call

    def args(change, **kw):
        return lambda ex: gtx.loss_arguments(GRPOConfig(num_generations=2, beta=0.0), change(ex), **kw)

    return {
        "no_positions": (fhs(segment_positions=None), "segment_positions must be given with segment_ids"),
        "positions_only": (fhs(segment_ids=None), "segment_positions is given without segment_ids"),
        "prompt_ids": (fhs(lambda ex: dict(prompt_ids=jnp.ones((2, 3), jnp.int32))), "prompt_ids must be"),
        "positions_shape": (fhs(lambda ex: dict(segment_positions=ex.segment_positions[:, :-1])), "segment_positions"),
        "first_token_unmasked": (
            args(lambda ex: ex.replace(completion_mask=ex.completion_mask.at[0, 8].set(1))),
            r"completion_mask\[0, 8\] is 1 at the first token",
        ),
        "advantages_shape": (args(lambda ex: ex.replace(advantages=ex.advantages[:, :-1])), "advantages must be"),
        "max_completion_length": (args(lambda ex: ex, max_completion_length=0), "max_completion_length"),
    }


@pytest.mark.parametrize("case", sorted(_packed_error_cases()))
def test_packed_errors_name_the_argument(case):
    call, match = _packed_error_cases()[case]
    with pytest.raises(ValueError, match=match):
        call(pack(example()))


def test_packed_loss_fn_requires_segment_positions():
    """Through the loss function Tunix calls: a packed example without segment_positions."""
    ex = pack(example())
    ex = ex.replace(segment_positions=None)
    config = with_temperature(GRPOConfig(num_generations=2, beta=0.0), 1.0)
    with pytest.raises(ValueError, match="segment_positions must be given"):
        gtx.make_policy_loss_fn()(tiny_qwen3(), ex, config, PAD, EOS)


def tiny_gemma2(vocab=97, softcap=2.0, seed=0):
    """A one-layer Gemma-2-style model (tied embedding, final-logit soft cap ``softcap``)."""
    from tunix.models.gemma import model as gemma

    cfg = gemma.ModelConfig(
        num_layers=1,
        num_embed=vocab,
        embed_dim=16,
        hidden_dim=32,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        final_logit_softcap=softcap,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(gemma.AttentionType.GLOBAL,),
    )
    return gemma.Gemma(cfg, rngs=nnx.Rngs(seed))


def test_matches_tunix_grpo_loss_gemma2_softcap():
    """Gemma 2's final-logit soft cap (here 2.0, so that it bends the logits) through the fused loss (its
    ``HeadOptions.softcap``, read by ``logit_softcap``) equals Tunix's own loss on the model's capped logits."""
    config = with_temperature(GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl"), 0.9)
    model, ex = tiny_gemma2(), example(ref=True, seed=3)
    assert gtx.logit_softcap(model) == 2.0 and gtx.lm_head(model)[1] == "vh"
    assert gtx.logit_softcap(tiny_qwen3()) is None
    assert_same(
        value_and_grad(algo_core.grpo_loss_fn, model, ex, config),
        value_and_grad(gtx.make_policy_loss_fn(), model, ex, config),
    )
