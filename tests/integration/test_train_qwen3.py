"""``gmpo-jax train --model qwen3 [--checkpoint DIR]``: Tunix's Qwen3 as the demo's policy (CPU, float32).

Skipped without the optional extra (``pip install -e '.[tunix]'``). The checkpoints are written here, in
Hugging Face's layout (``config.json``, ``model.safetensors`` with ``Qwen3ForCausalLM``'s tensor names and
PyTorch ``[out, in]`` weights, optionally a ``tokenizers``-format ``tokenizer.json``), from the
transformers conventions rather than from `gmpo_jax.train.hf_checkpoint.hf_tensor_shapes`, so the test checks the
names and shapes the loader is given as well as the loaded values. Every run is a tiny model (one or two
layers, H = 32), two steps: the file stays well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from gmpo_jax.train import cli  # noqa: E402
from gmpo_jax.train.config import TrainConfig  # noqa: E402
from gmpo_jax.train.hf_checkpoint import checkpoint_token_map, read_checkpoint  # noqa: E402
from gmpo_jax.train.plan import plan  # noqa: E402
from gmpo_jax.train.qwen3 import Qwen3Policy  # noqa: E402
from gmpo_jax.train.state import build_model  # noqa: E402
from gmpo_jax.train.tasks import TOKENIZER, TokenMap  # noqa: E402

# two steps of a tiny run: 2 prompts x 4 completions, 2 updates per batch (old_logps), a KL reference
_RUN = ["--steps", "2", "--batch-size", "8", "--group-size", "4", "--digits", "3", "--beta", "0.04", "--no-progress"]
_SIZE = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1", "--d-ff", "64"]
_ARCH = dict(vocab=64, H=32, L=2, N=2, K=1, D=16, F=64)
_CHAR_IDS = {c: 20 + i for i, c in enumerate(TOKENIZER.chars)}  # the test tokenizer's ids of 0-9 + = >
_EOS = 40


def hf_tensors(tied: bool, seed: int = 0, vocab=64, H=32, L=2, N=2, K=1, D=16, F=64) -> dict:
    """Random ``Qwen3ForCausalLM`` weights under transformers' names, PyTorch layout (float32)."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (0.1 * rng.normal(size=shape)).astype(np.float32)  # noqa: E731
    norm = lambda n: (1 + 0.1 * rng.normal(size=n)).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": w(vocab, H), "model.norm.weight": norm(H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(N * D, H)
        t[p + "self_attn.k_proj.weight"] = w(K * D, H)
        t[p + "self_attn.v_proj.weight"] = w(K * D, H)
        t[p + "self_attn.o_proj.weight"] = w(H, N * D)
        t[p + "self_attn.q_norm.weight"] = norm(D)
        t[p + "self_attn.k_norm.weight"] = norm(D)
        t[p + "mlp.gate_proj.weight"] = w(F, H)
        t[p + "mlp.up_proj.weight"] = w(F, H)
        t[p + "mlp.down_proj.weight"] = w(H, F)
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
    if not tied:
        t["lm_head.weight"] = w(vocab, H)
    return t


def write_checkpoint(d, *, tied=False, tokenizer=True, config_changes=None, drop=None, seed=0) -> dict:
    """A tiny Hugging Face Qwen3 directory at ``d``; returns the tensors written."""
    a = _ARCH
    d.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": a["vocab"],
        "hidden_size": a["H"],
        "intermediate_size": a["F"],
        "num_hidden_layers": a["L"],
        "num_attention_heads": a["N"],
        "num_key_value_heads": a["K"],
        "head_dim": a["D"],
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "use_sliding_window": False,
        "rope_scaling": None,
        "bos_token_id": 41,
        "eos_token_id": _EOS,
        "torch_dtype": "float32",
        **(config_changes or {}),
    }
    (d / "config.json").write_text(json.dumps(config))
    tensors = hf_tensors(tied, seed)
    save_file({k: v for k, v in tensors.items() if k != drop}, str(d / "model.safetensors"))
    if tokenizer:
        vocab = {"!": 0, '"': 1, "a": 5, **_CHAR_IDS, "<|endoftext|>": _EOS}
        (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab}}))
    return tensors


# ---------------------------------------------------------------------------------------------
# (a) random initialisation, CLI, two steps
# ---------------------------------------------------------------------------------------------
def test_cli_trains_random_qwen3_two_steps(tmp_path, capsys):
    assert cli.main(["train", "--model", "qwen3", *_RUN, *_SIZE, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Tunix Qwen3" in out and "random init" in out and "identity" in out and "steps/s" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("reward_mean", "loss", "kl", "grad_norm", "clip_fraction", "log_ratio_min", "log_ratio_max"):
            assert math.isfinite(r[key]), (key, r)
    assert rows[0]["grad_norm"] > 0 and rows[1]["kl"] > 0  # gradients flow; the policy left its reference
    assert (tmp_path / "training.png").stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
    assert json.loads((tmp_path / "config.json").read_text())["model"] == "qwen3"


def test_random_init_is_hugging_faces():
    """Every matrix N(0, 0.02) (Qwen3Config.initializer_range), norms 1: Tunix's own initialisers expect
    a checkpoint (zero MLP kernels would get zero gradients forever)."""
    p = plan(TrainConfig(model="qwen3", d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64).validate())
    leaves = jax.tree.leaves(nnx.state(build_model(p), nnx.Param))
    assert len(leaves) == 14  # embedding, final norm, head; 11 per layer
    for x in map(np.asarray, leaves):
        if x.ndim == 1:
            np.testing.assert_array_equal(x, 1.0)
        else:
            assert abs(x.mean()) < 0.005 and 0.018 < x.std() < 0.022, (x.shape, x.mean(), x.std())
    other = jax.tree.leaves(nnx.state(build_model(p, seed=1), nnx.Param))
    assert all(not np.array_equal(a, b) for a, b in zip(leaves, other) if a.ndim > 1)  # the seed matters


# ---------------------------------------------------------------------------------------------
# (b) a Hugging Face checkpoint: loaded weights == written weights; two steps through the CLI
# ---------------------------------------------------------------------------------------------
def _loaded_and_written(policy: Qwen3Policy, t: dict, tied: bool) -> list:
    """``(loaded Tunix parameter, expected value from the HF tensors)`` pairs, every parameter."""
    a, m = _ARCH, policy.model
    H, N, K, D = a["H"], a["N"], a["K"], a["D"]
    pairs = [(m.embedder.input_embedding, t["model.embed_tokens.weight"]), (m.final_norm.w, t["model.norm.weight"])]
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        pairs += [
            (layer.attn.q_proj.w, t[p + "self_attn.q_proj.weight"].T.reshape(H, N, D)),
            (layer.attn.k_proj.w, t[p + "self_attn.k_proj.weight"].T.reshape(H, K, D)),
            (layer.attn.v_proj.w, t[p + "self_attn.v_proj.weight"].T.reshape(H, K, D)),
            (layer.attn.o_proj.w, t[p + "self_attn.o_proj.weight"].T.reshape(N, D, H)),
            (layer.attn.q_norm.w, t[p + "self_attn.q_norm.weight"]),
            (layer.attn.k_norm.w, t[p + "self_attn.k_norm.weight"]),
            (layer.mlp.gate_proj.kernel, t[p + "mlp.gate_proj.weight"].T),
            (layer.mlp.up_proj.kernel, t[p + "mlp.up_proj.weight"].T),
            (layer.mlp.down_proj.kernel, t[p + "mlp.down_proj.weight"].T),
            (layer.input_layernorm.w, t[p + "input_layernorm.weight"]),
            (layer.post_attention_layernorm.w, t[p + "post_attention_layernorm.weight"]),
        ]
    if not tied:
        pairs.append((m.lm_head.w, t["lm_head.weight"].T))
    return pairs


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_loads_the_written_weights(tmp_path, tied):
    t = write_checkpoint(tmp_path / "ckpt", tied=tied)
    cfg = cli.config_from_args(["train", "--model", "qwen3", "--checkpoint", str(tmp_path / "ckpt")])
    p = plan(cfg)
    assert p.vocab_size == _ARCH["vocab"] and p.architecture["use_tied_embedding"] is tied
    policy = build_model(p)
    pairs = _loaded_and_written(policy, t, tied)
    assert len(pairs) == 2 + 11 * _ARCH["L"] + (not tied)
    for loaded, written in pairs:
        assert loaded[...].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(loaded[...]), written)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))
    assert n_params == sum(v.size for v in t.values())  # nothing left at its random initialisation
    weight, layout = policy.head_weight()
    assert layout == ("vh" if tied else "hv") and weight.shape == ((64, 32) if tied else (32, 64))


def test_cli_fine_tunes_a_checkpoint_two_steps(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt")
    out_dir = tmp_path / "run"
    args = ["train", "--model", "qwen3", "--checkpoint", str(tmp_path / "ckpt"), *_RUN, "--no-plots"]
    assert cli.main([*args, "--output-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert f"loaded from {tmp_path / 'ckpt'}" in out and "tokenizer.json ('0'=20" in out and "V=64" in out
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert rows[0]["grad_norm"] > 0
    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir()) == ["2"]


def test_sampler_decode_matches_the_training_forward(tmp_path):
    """The KV-cache decode (prefill + one token at a time) gives the hidden states that the loss reads
    through ``integrations.tunix.final_hidden_states``, so sampling and training see one policy."""
    write_checkpoint(tmp_path / "ckpt", tied=True)
    policy = build_model(plan(TrainConfig(model="qwen3", checkpoint=str(tmp_path / "ckpt"))))
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    prompt = jax.random.randint(k1, (3, 4), 0, 64)
    comp = jax.random.randint(k2, (3, 5), 0, 64)

    @nnx.jit
    def decoded(m, prompt, comp):
        cache = m.init_cache(3, 9)
        h, cache = m.decode(prompt, cache, 0)
        rows = [h[:, -1:]]
        for t in range(4):
            h, cache = m.decode(comp[:, t : t + 1], cache, 4 + t)
            rows.append(h)
        return jnp.concatenate(rows, axis=1)

    full = nnx.jit(lambda m, p, c: m.completion_hidden(p, c))(policy, prompt, comp)
    np.testing.assert_allclose(decoded(policy, prompt, comp), full, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(policy.logits(full), policy.model.embedder.decode(full), rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# task tokens -> model ids
# ---------------------------------------------------------------------------------------------
def test_token_maps(tmp_path):
    write_checkpoint(tmp_path / "tok")
    m = checkpoint_token_map(read_checkpoint(str(tmp_path / "tok")))
    assert m.eos_id == m.pad_id == _EOS and m.model_ids[2:] == tuple(_CHAR_IDS.values())
    ids = m.encode_batch(["12>", "3+4"])
    assert ids.tolist() == [[_CHAR_IDS["1"], _CHAR_IDS["2"], _CHAR_IDS[">"]], [_CHAR_IDS[c] for c in "3+4"]]
    assert m.decode([_CHAR_IDS["7"], 5, _CHAR_IDS["0"], _EOS, _CHAR_IDS["1"]]) == "7?0"  # 5: no task token
    write_checkpoint(tmp_path / "plain", tokenizer=False)
    ident = checkpoint_token_map(read_checkpoint(str(tmp_path / "plain")))
    assert ident.model_ids == TokenMap.identity().model_ids and "no tokenizer.json" in ident.source
    assert ident.decode([2, 3, 60, 0, 1, 4]) == TOKENIZER.decode([2, 3, 60, 0, 1, 4]) == "01?"
    with pytest.raises(ValueError, match="distinct"):
        TokenMap((0, 1, *range(2, 14), 2))


# ---------------------------------------------------------------------------------------------
# (c) errors: one line naming the option, before anything compiles
# ---------------------------------------------------------------------------------------------
def _make(tmp_path, case: str) -> str:
    d = tmp_path / "ckpt"
    if case == "missing":
        return str(tmp_path / "no_such_dir")
    if case == "file":
        (tmp_path / "f.json").write_text("{}")
        return str(tmp_path / "f.json")
    if case == "empty":
        d.mkdir()
        return str(d)
    changes = {
        "qwen2": {"model_type": "qwen2"},
        "moe": {"model_type": "qwen3_moe"},
        "rope": {"rope_theta": 10000},
        "no_layers": {"num_hidden_layers": None},
    }
    write_checkpoint(
        d,
        config_changes=changes.get(case),
        drop="model.layers.1.mlp.up_proj.weight" if case == "missing_tensor" else None,
    )
    if case == "no_layers":
        cfg = json.loads((d / "config.json").read_text())
        del cfg["num_hidden_layers"]
        (d / "config.json").write_text(json.dumps(cfg))
    if case == "bad_json":
        (d / "config.json").write_text("{not json")
    if case == "no_safetensors":
        (d / "model.safetensors").unlink()
    if case == "wrong_shape":
        t = hf_tensors(False)
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:, :16].copy()
        save_file(t, str(d / "model.safetensors"))
    if case == "mixed_dtype":
        t = hf_tensors(False)
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.float16)
        save_file(t, str(d / "model.safetensors"))
    return str(d)


@pytest.mark.parametrize(
    "case, why",
    [
        ("missing", "not a directory"),
        ("file", "not a directory"),
        ("empty", "has no config.json"),
        ("bad_json", "config.json cannot be read as JSON"),
        ("qwen2", "model_type must be 'qwen3'"),
        ("moe", "model_type must be 'qwen3'"),
        ("no_layers", "config.json has no num_hidden_layers"),
        ("rope", "rope_theta=10000"),
        ("no_safetensors", "has no *.safetensors"),
        ("missing_tensor", "has no tensor 'model.layers.1.mlp.up_proj.weight'"),
        ("wrong_shape", "'model.embed_tokens.weight' has shape [64, 16], config.json implies [64, 32]"),
        ("mixed_dtype", "holds dtypes ['F16', 'F32']"),
    ],
)
def test_bad_checkpoint_is_one_line_error_before_compiling(tmp_path, case, why, capsys, compile_counter):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--model", "qwen3", "--checkpoint", _make(tmp_path, case)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("gmpo-jax train: error: --checkpoint ") and why in err, err
    assert compile_counter == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt2"], "--model must be one of toy, qwen3, got 'gpt2'"),
        (["--checkpoint", "{ckpt}"], "--checkpoint applies to --model qwen3 only"),
        (["--n-kv-heads", "2"], "--n-kv-heads applies to --model qwen3 only"),
        (
            ["--model", "qwen3", "--checkpoint", "{ckpt}", "--d-model", "64"],
            "--d-model does not apply with --checkpoint",
        ),
        (["--model", "qwen3", "--checkpoint", "{ckpt}", "--tie-embeddings"], "--tie-embeddings does not apply"),
        (["--model", "qwen3", "--n-kv-heads", "3"], "--n-kv-heads must divide --n-heads=4, got 3"),
        (["--model", "qwen3", "--head-dim", "7"], "--head-dim must be even"),
        (["--model", "qwen3", "--mesh", "data=1,model=1"], "--mesh is not supported with --model qwen3"),
    ],
)
def test_bad_model_options_are_one_line_errors(tmp_path, argv, message, capsys, compile_counter):
    write_checkpoint(tmp_path / "ckpt")
    argv = [a.format(ckpt=tmp_path / "ckpt") for a in argv]
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gmpo-jax train: error: ") and message in err, err
    assert compile_counter == []


def test_gpu_preset_builds_at_its_size():
    """``--model qwen3 --preset gpu`` (never run here: no GPU) builds Qwen3-0.6B's architecture without its
    embedding rows: traced abstractly (nothing allocated), about 0.44 B float32 parameters, H and V multiples
    of 64 (the Mosaic kernels read the head in place)."""
    from tunix.models.qwen3 import model as qwen3_model

    from gmpo_jax.train.config import preset_config
    from gmpo_jax.train.qwen3 import architecture

    config = preset_config("gpu", model="qwen3")
    arch = architecture(config, config.vocab_size)
    cfg = qwen3_model.ModelConfig(**arch, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    model = nnx.eval_shape(lambda: qwen3_model.Qwen3(cfg, rngs=nnx.Rngs(0)))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    n = sum(math.prod(p.shape) for p in params)
    assert 0.40e9 < n < 0.48e9, n
    assert all(p.dtype == jnp.float32 for p in params)
    assert (arch["embed_dim"], arch["num_layers"], arch["num_kv_heads"]) == (1024, 28, 8)
    assert arch["embed_dim"] % 64 == 0 and arch["vocab_size"] % 64 == 0
