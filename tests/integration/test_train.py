"""Tests of the training demo (gmpo_jax.train): configuration errors, advantages, sampler, loss gradient,
a short training run, checkpoint round trip / resume, the CLI and the --task hook.

Every run uses the same tiny configuration (`_TINY`), so the compiled sampler / log-prob / update programs
are shared by all tests of the module and the file stays well under two minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gmpo_jax
from gmpo_jax.train import TrainConfig, cli, rollout, train
from gmpo_jax.train.checkpoint import Checkpointer
from gmpo_jax.train.model import Transformer
from gmpo_jax.train.plan import plan
from gmpo_jax.train.state import build_model, make_optimizer
from gmpo_jax.train.step import training_loss
from gmpo_jax.train.tasks import TOKENIZER, make_task

# beta > 0 and num_iterations > 1: the run exercises the reference policy and old_logps too
_TINY = dict(
    d_model=32,
    n_layers=1,
    n_heads=2,
    d_ff=64,
    batch_size=16,
    group_size=4,
    num_iterations=2,
    beta=0.04,
    learning_rate=3e-3,
    warmup_steps=1,
    progress=False,
)


# ---------------------------------------------------------------------------------------------
# configuration errors: one line naming the option, nothing compiled
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, option",
    [
        (["--group-size", "1"], "--group-size"),
        (["--batch-size", "100", "--group-size", "8"], "--batch-size"),
        (["--loss-type", "ppo"], "--loss-type"),
        (["--max-completion-length", "-3"], "--max-completion-length"),
        (["--digits", "-1"], "--digits"),
        (["--steps", "0"], "--steps"),
        (["--temperature", "0"], "--temperature"),
        (["--top-p", "1.5"], "--top-p"),
        (["--n-heads", "5"], "--n-heads"),
        (["--epsilon-low", "-0.1"], "--epsilon-low"),
        (["--task", "no_such_module_xyz:reward"], "--task"),
        (["--group-size", "two"], "--group-size"),
    ],
)
def test_bad_configuration_is_one_line_error_before_compiling(argv, option, capsys, compile_counter):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("gmpo-jax") and "error" in err and option in err, err
    assert compile_counter == []


# ---------------------------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------------------------
def test_group_advantages_hand_computed():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0]
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 2: constant -> 0; group 3: mean 0.75,
    # std sqrt((3 * 0.75**2 + 2.25**2) / 3) = 1.5
    s1 = math.sqrt(1.0 / 3.0)
    expected = [
        0.5 / (s1 + 1e-4),
        -0.5 / (s1 + 1e-4),
        -0.5 / (s1 + 1e-4),
        0.5 / (s1 + 1e-4),
        0,
        0,
        0,
        0,
        -0.75 / 1.5001,
        -0.75 / 1.5001,
        -0.75 / 1.5001,
        2.25 / 1.5001,
    ]
    np.testing.assert_allclose(rollout.group_advantages(rewards, 4), expected, rtol=1e-6)
    dr = rollout.group_advantages(rewards, 4, scale="none")  # Dr. GRPO: centre only
    np.testing.assert_allclose(dr, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.75, -0.75, -0.75, 2.25], rtol=1e-6)
    with pytest.raises(ValueError):
        rollout.group_advantages(rewards, 5)


# ---------------------------------------------------------------------------------------------
# model / sampler
# ---------------------------------------------------------------------------------------------
def _uniform_model(vocab=4, max_len=12):
    """A tiny policy whose LM head is zero: every token, EOS included, has probability 1 / vocab."""
    m = Transformer(vocab, max_len, 16, 1, 2, 32, rngs=nnx.Rngs(0))
    m.lm_head.kernel[...] = jnp.zeros_like(m.lm_head.kernel[...])
    return m


def test_sampler_respects_eos_and_max_length():
    model = _uniform_model()
    prompts = jnp.full((64, 3), 2, jnp.int32)
    ids, mask = rollout.sample_completions(
        model, prompts, jax.random.PRNGKey(0), jnp.float32(1.0), max_new_tokens=6, eos_id=1, pad_id=0
    )
    ids, mask = np.asarray(ids), np.asarray(mask)
    assert ids.shape == mask.shape == (64, 6)
    n_eos = 0
    for row, m in zip(ids, mask):
        eos = np.flatnonzero(row == 1)
        if eos.size:  # valid up to and including the first EOS, padding after it
            n_eos += 1
            first = eos[0]
            assert m[: first + 1].all() and not m[first + 1 :].any()
            assert (row[first + 1 :] == 0).all()
        else:  # truncated at max length: every position valid
            assert m.all()
    assert 0 < n_eos < 64  # both cases occurred (P(EOS) = 1/4 per token)


def test_top_p_tiny_is_greedy_and_matches_the_full_forward():
    model = Transformer(6, 12, 16, 1, 2, 32, rngs=nnx.Rngs(1))
    prompts = jax.random.randint(jax.random.PRNGKey(1), (8, 3), 2, 6)
    ids, _ = rollout.sample_completions(
        model, prompts, jax.random.PRNGKey(2), jnp.float32(1.0), max_new_tokens=4, top_p=1e-6, eos_id=-1, pad_id=0
    )
    # the nucleus of mass 1e-6 is the top token: decoding is greedy, so every sampled token is the argmax
    # of the cache-free forward pass over the prompt and the tokens before it
    logits = nnx.jit(lambda m, x: m.logits(m(x)))(model, jnp.concatenate([prompts, ids], axis=1))
    np.testing.assert_array_equal(ids, jnp.argmax(logits[:, 2:-1], axis=-1))


def test_kv_cache_decode_matches_full_forward():
    model = Transformer(9, 10, 16, 2, 2, 32, tie_embeddings=True, rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (3, 7), 0, 9)
    full = nnx.jit(lambda m, x: m(x))(model, tokens)
    decode = nnx.jit(lambda m, x, c, start: m.decode(x, c, start))
    h0, cache = decode(model, tokens[:, :4], model.init_cache(3, 10), 0)
    steps = [h0]
    for t in range(4, 7):
        h, cache = decode(model, tokens[:, t : t + 1], cache, t)
        steps.append(h)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------
# the training loss == the same loss written with the dense reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "objective, tied",
    [
        (gmpo_jax.GMPO(epsilon_low=0.1, epsilon_high=0.1, beta=0.05), False),
        (gmpo_jax.GRPO(loss_type="dapo"), True),
    ],
)
def test_training_loss_gradient_matches_dense_reference(objective, tied):
    V, P, T, N = 15, 4, 5, 8
    model = Transformer(V, P + T, 32, 2, 2, 64, tie_embeddings=tied, rngs=nnx.Rngs(0))
    k = jax.random.split(jax.random.PRNGKey(7), 6)
    prompt_ids = jax.random.randint(k[0], (N, P), 2, V)
    ids = jax.random.randint(k[1], (N, T), 0, V)
    mask = jnp.arange(T)[None, :] < jax.random.randint(k[2], (N, 1), 0, T + 1)  # incl. an empty row maybe
    adv = jax.random.normal(k[3], (N,))
    old = jnp.where(mask, -2.5 + 0.3 * jax.random.normal(k[4], (N, T)), 0.0)
    ref = jnp.where(mask, -2.5 + 0.3 * jax.random.normal(k[5], (N, T)), 0.0)
    batch = rollout.RolloutBatch(prompt_ids, ids, mask, adv, old, ref if objective.beta else None)

    def dense_loss(m):
        hidden = m(jnp.concatenate([prompt_ids, ids], axis=1))[:, P - 1 : -1]
        head = m.embed if tied else m.lm_head
        weight = head.embedding[...] if tied else head.kernel[...]
        return gmpo_jax.reference.policy_loss(
            hidden,
            weight,
            gmpo_jax.PolicyBatch(ids, mask, adv, old_logps=batch.old_logps, ref_logps=batch.ref_logps),
            objective=objective,
            temperature=0.9,
            head=gmpo_jax.HeadOptions(weight_layout="vh" if tied else "hv"),
        )

    fused = nnx.jit(
        lambda m: nnx.value_and_grad(lambda m: training_loss(m, batch, objective, temperature=0.9), has_aux=True)(m)
    )
    dense = nnx.jit(lambda m: nnx.value_and_grad(dense_loss, has_aux=True)(m))
    (l1, aux1), g1 = fused(model)
    (l2, aux2), g2 = dense(model)
    np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(aux1.clip_fraction, aux2.clip_fraction, atol=1e-7)
    leaves1, leaves2 = jax.tree.leaves(g1), jax.tree.leaves(g2)
    assert len(leaves1) == len(leaves2) > 10
    assert max(float(jnp.abs(g).max()) for g in leaves1) > 1e-4  # not trivially zero
    for a, b in zip(leaves1, leaves2):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# a short run, checkpoints, resume, CLI, task hook (shared compiled programs: same tiny config)
# ---------------------------------------------------------------------------------------------
_FINITE_KEYS = (
    "reward_mean",
    "reward_std",
    "loss",
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "kl",
    "log_ratio_min",
    "log_ratio_max",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "lr",
)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(steps=4, save_every=2, output_dir=str(out), **_TINY)
    return train(cfg)


def test_short_training_run_has_finite_metrics_and_outputs(short_run):
    hist = short_run.history
    assert [h["step"] for h in hist] == [1, 2, 3, 4]
    for h in hist:
        for key in _FINITE_KEYS:
            assert math.isfinite(h[key]), (key, h)
        assert 0.0 <= h["clip_fraction"] <= 1.0 and h["log_ratio_min"] <= h["log_ratio_max"]
    assert any(h["kl"] > 0 for h in hist[1:])  # the policy moved away from the frozen reference
    d = short_run.run_dir
    with open(os.path.join(d, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]
    assert os.path.getsize(os.path.join(d, "training.png")) > 10_000
    assert sorted(os.listdir(os.path.join(d, "checkpoints"))) == ["2", "4"]
    assert short_run.summary["steps_per_s"] > 0 and short_run.summary["tokens_per_s"] > 0


def _params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_checkpoint_round_trip(short_run):
    p = plan(short_run.config)
    model = build_model(p, seed=123)  # different init: the restore must overwrite it
    opt = make_optimizer(p.config, model)
    ckpt = Checkpointer(os.path.join(short_run.run_dir, "checkpoints"))
    meta = ckpt.restore(model, opt)
    ckpt.close()
    assert meta["step"] == 4 and meta["config"]["seed"] == short_run.config.seed
    for a, b in zip(_params(model), _params(short_run.model)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(nnx.state(opt)), jax.tree.leaves(nnx.state(short_run.optimizer))):
        np.testing.assert_array_equal(a, b)
    assert int(opt.step[...]) == 4 * short_run.config.num_iterations


def test_resume_reproduces_the_uninterrupted_run(short_run, tmp_path):
    d = tmp_path / "resumed"
    shutil.copytree(short_run.run_dir, d)
    shutil.rmtree(d / "checkpoints" / "4")  # as if the run had stopped after the step-2 checkpoint
    res = train(short_run.config.replace(output_dir=str(d), resume=True, plots=False))
    assert [h["step"] for h in res.history] == [1, 2, 3, 4]
    assert [h["reward_mean"] for h in res.history] == [h["reward_mean"] for h in short_run.history]
    for a, b in zip(_params(res.model), _params(short_run.model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_cli_runs_and_reports_throughput(tmp_path, capsys):
    args = ["train", "--steps", "2", "--output-dir", str(tmp_path), "--no-plots"]
    for key, value in _TINY.items():
        flag = "--" + key.replace("_", "-")
        args += [f"--no-{key}"] if value is False else [flag, str(value)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "steps/s" in out and "tokens/s" in out and "reward" in out
    assert json.loads((tmp_path / "config.json").read_text())["group_size"] == _TINY["group_size"]


def test_task_hook_with_user_reward_function(tmp_path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text(
        textwrap.dedent("""
        def count_sevens(prompts, completions):
            return [c.count("7") for c in completions]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task("my_reward_mod:count_sevens")
    assert task.rewards(["123>", "456>"], ["77", "1"]).tolist() == [2.0, 0.0]
    assert math.isnan(task.exact_match(["123>"], ["321"]))
    res = train(
        TrainConfig(task="my_reward_mod:count_sevens", steps=2, output_dir=str(tmp_path / "run"), plots=False, **_TINY)
    )
    assert len(res.history) == 2 and all(math.isfinite(h["loss"]) for h in res.history)


def test_builtin_task_rewards():
    rev = make_task("reverse", digits=3, partial_credit=0.1)
    # exact (1) + 3 digits + the end; 2 digits + end; 3 digits, too long; 1 digit, too short
    np.testing.assert_allclose(rev.rewards(["123>"] * 4, ["321", "311", "3214", "3"]), [1.4, 0.3, 0.3, 0.1])
    add = make_task("add", digits=3)
    prompts = add.make_prompts(np.random.default_rng(0), 5)
    answers = [f"{int(p[:3]) + int(p[4:7]):04d}" for p in prompts]
    np.testing.assert_allclose(add.rewards(prompts, answers), 1.5, rtol=1e-6)
    assert add.exact_match(prompts, answers) == 1.0
    assert TOKENIZER.decode(TOKENIZER.encode("12+3=") + [TOKENIZER.eos_id, 5]) == "12+3="


def test_make_objective_epsilons():
    """The CLI's objectives: epsilons given are passed on; left out, the objective's default, except
    CISPO's cap on the importance weight (5.0: the library's 0.2 would scale on-policy gradients by 0.2)."""
    from gmpo_jax.train.config import CISPO_EPSILON_HIGH, make_objective

    assert make_objective(TrainConfig(loss_type="cispo"), 8) == gmpo_jax.CISPO(epsilon_high=CISPO_EPSILON_HIGH)
    assert make_objective(TrainConfig(loss_type="cispo", epsilon_high=0.3), 8) == gmpo_jax.CISPO(epsilon_high=0.3)
    assert make_objective(TrainConfig(loss_type="gmpo"), 8) == gmpo_jax.GMPO()
    assert make_objective(TrainConfig(loss_type="dapo", epsilon_low=0.1), 8) == gmpo_jax.GRPO(
        loss_type="dapo", epsilon_low=0.1
    )
