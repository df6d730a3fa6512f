"""Reading a Hugging Face Qwen3 checkpoint directory: ``gmpo-jax train --model qwen3 --checkpoint DIR``.

`read_checkpoint` checks a directory (``config.json`` + ``*.safetensors``, as
``Qwen3ForCausalLM.save_pretrained`` writes it) from ``config.json`` and the safetensors headers alone,
never the weights: it maps ``config.json``'s fields to Tunix's ``ModelConfig`` keyword arguments (a
`CheckpointInfo`), refuses what Tunix's Qwen3 cannot run (Tunix 0.1.7's Qwen3 rotates with `ROPE_THETA`
whatever its config says, so a checkpoint with another ``rope_theta`` is refused) and checks every tensor
of `hf_tensor_shapes`. `checkpoint_token_map` maps the task's characters to the checkpoint's vocabulary.
The run plan (`gmpo_jax.train.plan`) and the configuration's validation call these; the weights are loaded
by `gmpo_jax.train.qwen3.build_policy` with Tunix's loader.

Task tokens (`checkpoint_token_map`). The built-in tasks write 13 characters ``0-9 + = >`` plus pad and
EOS. A random policy's ids are the task's (identity). A checkpoint's vocabulary is the model's own: with a
``tokenizer.json`` beside the weights each character is its single-character token there and EOS is
``config.json``'s ``eos_token_id`` (Qwen3: ``"0"`` = 15, ..., ``"9"`` = 24, ``"+"`` = 10, ``"="`` = 28,
``">"`` = 29); prompts are encoded one token per character, which for Qwen's digit-splitting tokenizer is
its own encoding of the digits. Without a ``tokenizer.json`` the task ids 0-14 are used as the model's
ids 0-14 unchanged (for a pretrained model those tokens then mean something else; the run header says
which map is in use). Either way sampling covers the whole vocabulary and any other id decodes as ``?``,
a wrong character: nothing is truncated or renormalised.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

from gmpo_jax.train.config import ConfigError
from gmpo_jax.train.tasks import TOKENIZER, TokenMap

__all__ = ["CheckpointInfo", "ROPE_THETA", "checkpoint_token_map", "hf_tensor_shapes", "read_checkpoint"]

#: Qwen3's rotary base (Tunix 0.1.7's Qwen3 always rotates with it, whatever its config says)
ROPE_THETA = 1_000_000
_DTYPES = ("F32", "BF16", "F16", "F64")  # what Tunix's safetensors loader reads
# config.json field -> Tunix ModelConfig field (all required except those with a default in _HF_DEFAULTS)
_HF_FIELDS = {
    "num_hidden_layers": "num_layers",
    "vocab_size": "vocab_size",
    "hidden_size": "embed_dim",
    "intermediate_size": "hidden_dim",
    "num_attention_heads": "num_heads",
    "head_dim": "head_dim",
    "num_key_value_heads": "num_kv_heads",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "use_tied_embedding",
}
# transformers' Qwen3Config defaults for fields a config.json may leave out
_HF_DEFAULTS = {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What `read_checkpoint` found in a Hugging Face Qwen3 directory (no weights are read).

    Attributes:
      path: the directory.
      architecture: Tunix ``ModelConfig`` keyword arguments (``num_layers``, ``vocab_size``,
        ``embed_dim``, ``hidden_dim``, ``num_heads``, ``head_dim``, ``num_kv_heads``, ``rope_theta``,
        ``norm_eps``, ``use_tied_embedding``) as a dict.
      eos_token_id: ``config.json``'s (the first, if a list), or None.
      pad_token_id: ``config.json``'s, or None.
      files: the ``*.safetensors`` file names, sorted.
    """

    path: str
    architecture: dict
    eos_token_id: int | None
    pad_token_id: int | None
    files: tuple[str, ...]


def _bad(path: str, why: str) -> ConfigError:
    return ConfigError(f"--checkpoint {why}, got {path!r}")


def read_checkpoint(path: str) -> CheckpointInfo:
    """Check a Hugging Face Qwen3 checkpoint directory and read its architecture (pure Python).

    Reads ``config.json`` and the JSON headers of the ``*.safetensors`` files, never the weights, and
    checks what Tunix's loader would otherwise fail on late or read wrongly: ``model_type`` is
    ``"qwen3"`` (dense; not ``qwen3_moe``), no ``rope_scaling`` / sliding window / attention bias (Tunix's
    Qwen3 has none), every tensor of `hf_tensor_shapes` present with its shape, and one dtype per file
    (Tunix's fast loader reads a whole file with the first tensor's dtype).

    Args:
      path: the directory.

    Returns:
      A `CheckpointInfo`.

    Raises:
      ConfigError: one line starting ``--checkpoint``: not a directory, no or unreadable ``config.json``,
        a missing / wrong field, no ``*.safetensors``, a malformed header, a missing tensor or wrong
        shape, mixed or unsupported dtypes.
    """
    if not os.path.isdir(path):
        raise _bad(path, "must be a Hugging Face checkpoint directory (config.json + *.safetensors); not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise _bad(path, "has no config.json (a Hugging Face checkpoint directory: config.json + *.safetensors)")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise _bad(path, f"config.json cannot be read as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(hf, dict):
        raise _bad(path, "config.json must hold a JSON object")
    arch = _architecture_from_hf(path, hf)
    files = tuple(sorted(n for n in os.listdir(path) if n.endswith(".safetensors")))
    if not files:
        raise _bad(path, "has no *.safetensors file")
    found: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for name in files:
        for key, (shape, dtype) in _safetensors_header(path, name).items():
            found[key] = (shape, dtype, name)
    for key, shape in hf_tensor_shapes(arch).items():
        if key not in found:
            raise _bad(path, f"has no tensor {key!r} in {', '.join(files)}")
        if found[key][0] != shape:
            raise _bad(path, f"tensor {key!r} has shape {list(found[key][0])}, config.json implies {list(shape)}")
    return CheckpointInfo(path, arch, _token_id(path, hf, "eos_token_id"), _token_id(path, hf, "pad_token_id"), files)


def _architecture_from_hf(path: str, hf: dict) -> dict:
    """Tunix ``ModelConfig`` kwargs of a Qwen3 ``config.json`` (see `read_checkpoint`)."""
    if hf.get("model_type") != "qwen3":
        raise _bad(path, f"config.json model_type must be 'qwen3' (a dense Qwen3), found {hf.get('model_type')!r}")
    for field, why in (
        ("rope_scaling", "rope_scaling"),
        ("use_sliding_window", "a sliding window"),
        ("attention_bias", "attention biases"),
    ):
        if hf.get(field):
            raise _bad(path, f"config.json sets {field}={hf[field]!r}: Tunix's Qwen3 has no {why}")
    for key in ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"):
        if key not in hf:
            raise _bad(path, f"config.json has no {key}")
    values = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if k in _HF_FIELDS and v is not None}}
    if isinstance(hf.get("rope_parameters"), dict) and "rope_theta" not in hf:  # transformers >= 5 layout
        values["rope_theta"] = hf["rope_parameters"].get("rope_theta", values["rope_theta"])
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    arch = {_HF_FIELDS[k]: v for k, v in values.items()}
    for key in ("num_layers", "vocab_size", "embed_dim", "hidden_dim", "num_heads", "num_kv_heads", "head_dim"):
        if key == "head_dim" and key not in arch:  # transformers' default
            arch[key] = arch["embed_dim"] // arch["num_heads"]
        if not isinstance(arch[key], int) or isinstance(arch[key], bool) or arch[key] < 1:
            raise _bad(path, f"config.json {_hf_name(key)} must be a positive integer, found {arch[key]!r}")
    if arch["num_heads"] % arch["num_kv_heads"] or arch["head_dim"] % 2:
        raise _bad(path, "config.json needs num_attention_heads % num_key_value_heads == 0 and an even head_dim")
    v = arch["norm_eps"]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise _bad(path, f"config.json rms_norm_eps must be a positive number, found {v!r}")
    if arch["rope_theta"] != ROPE_THETA:
        raise _bad(
            path,
            f"config.json rope_theta={arch['rope_theta']!r}: Tunix 0.1.7's Qwen3 rotates with {ROPE_THETA:.0e} "
            "whatever its config says, so this checkpoint would run with the wrong positions",
        )
    arch["rope_theta"] = ROPE_THETA
    if not isinstance(arch["use_tied_embedding"], bool):
        raise _bad(path, f"config.json tie_word_embeddings must be true or false, found {arch['use_tied_embedding']!r}")
    return arch


def _hf_name(field: str) -> str:
    return next(k for k, v in _HF_FIELDS.items() if v == field)


def _token_id(path: str, hf: dict, key: str) -> int | None:
    v = hf.get(key)
    if isinstance(v, list):
        v = v[0] if v else None
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < hf["vocab_size"]:
        raise _bad(path, f"config.json {key} must be an id in [0, vocab_size), found {hf.get(key)!r}")
    return v


def _safetensors_header(path: str, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{tensor name: (shape, dtype)}`` from a safetensors file's header (8-byte length, then JSON)."""
    file = os.path.join(path, name)
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
        out = {
            k: (tuple(int(d) for d in v["shape"]), str(v["dtype"])) for k, v in header.items() if k != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise _bad(path, f"{name} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    dtypes = sorted({d for _, d in out.values()})
    if len(dtypes) > 1 or (dtypes and dtypes[0] not in _DTYPES):
        raise _bad(
            path,
            f"{name} holds dtypes {dtypes}: Tunix's loader needs one of {', '.join(_DTYPES)} per file "
            "(it reads a whole file with the first tensor's dtype)",
        )
    return out


def hf_tensor_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    """The Hugging Face ``Qwen3ForCausalLM`` tensors of an architecture and their shapes.

    With ``V`` vocabulary, ``H`` hidden size, ``F`` MLP width, ``N`` / ``K`` query / key-value heads of
    ``D`` dimensions: ``model.embed_tokens.weight [V, H]``; per layer ``i`` (prefix
    ``model.layers.{i}.``) ``self_attn.q_proj.weight [N*D, H]``, ``k_proj`` / ``v_proj [K*D, H]``,
    ``o_proj [H, N*D]``, ``q_norm`` / ``k_norm [D]``, ``mlp.gate_proj`` / ``up_proj [F, H]``,
    ``down_proj [H, F]``, ``input_layernorm`` / ``post_attention_layernorm [H]`` (all ``.weight``);
    ``model.norm.weight [H]``; ``lm_head.weight [V, H]`` unless the embedding is tied. (PyTorch
    ``Linear`` weights are ``[out, in]``; Tunix's loader transposes them.)

    Args:
      arch: Tunix ``ModelConfig`` keyword arguments (`CheckpointInfo.architecture`).

    Returns:
      ``{name: shape}``.
    """
    V, H, F = arch["vocab_size"], arch["embed_dim"], arch["hidden_dim"]
    N, K, D = arch["num_heads"], arch["num_kv_heads"], arch["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(arch["num_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (N * D, H),
                p + "self_attn.k_proj.weight": (K * D, H),
                p + "self_attn.v_proj.weight": (K * D, H),
                p + "self_attn.o_proj.weight": (H, N * D),
                p + "self_attn.q_norm.weight": (D,),
                p + "self_attn.k_norm.weight": (D,),
                p + "mlp.gate_proj.weight": (F, H),
                p + "mlp.up_proj.weight": (F, H),
                p + "mlp.down_proj.weight": (H, F),
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
            }
        )
    if not arch["use_tied_embedding"]:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def checkpoint_token_map(info: CheckpointInfo) -> TokenMap:
    """How the task's tokens map to a checkpoint's vocabulary (module docstring, "Task tokens").

    With ``DIR/tokenizer.json`` (Hugging Face ``tokenizers`` format): each of ``0-9 + = >`` is the id of
    that one-character entry of ``model.vocab``; EOS is ``config.json``'s ``eos_token_id``; pad (written
    after EOS, masked out of the loss) is its ``pad_token_id``, else the EOS id (harmless: the first EOS
    ends a completion, and the loss treats no id as padding). Without it: the
    identity, task id ``k`` = model id ``k``.

    Args:
      info: `read_checkpoint`'s result.

    Returns:
      A `TokenMap` whose ids are all ``< vocab_size``.

    Raises:
      ConfigError: (naming ``--checkpoint``) an unreadable ``tokenizer.json``, a character without its
        own token, no ``eos_token_id``, or a vocabulary smaller than the task's 15 ids (identity map).
    """
    vocab = info.architecture["vocab_size"]
    tok_path = os.path.join(info.path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        if vocab < TOKENIZER.vocab_size:
            raise _bad(info.path, f"vocab_size {vocab} is smaller than the task's {TOKENIZER.vocab_size} token ids")
        return TokenMap(tuple(range(TOKENIZER.vocab_size)), "identity: no tokenizer.json, task ids 0-14 = model ids")
    try:
        with open(tok_path) as f:
            table = json.load(f)["model"]["vocab"]
        if not isinstance(table, dict):
            raise TypeError("model.vocab is not a token -> id object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _bad(info.path, f"tokenizer.json has no readable model.vocab ({type(e).__name__}: {e})") from None
    if info.eos_token_id is None:
        raise _bad(info.path, "config.json has no eos_token_id (needed to end completions)")
    ids = []
    for ch in TOKENIZER.chars:
        i = table.get(ch)
        if not isinstance(i, int) or not 0 <= i < vocab:
            raise _bad(info.path, f"tokenizer.json has no single token for the task character {ch!r}")
        ids.append(i)
    eos = info.eos_token_id
    pad = eos if info.pad_token_id is None else info.pad_token_id
    if eos in ids or pad in ids:
        raise _bad(info.path, f"eos_token_id {eos} / pad_token_id {pad} is also the token of a task character")
    return TokenMap((pad, eos, *ids), f"tokenizer.json ('0'={ids[0]} ... '>'={ids[-1]}, eos={eos})")
