"""Configuration of the training demo: one frozen dataclass, two presets, validation before any compile.

`TrainConfig` holds every knob of `gmpo-jax train`. `TrainConfig.validate` checks it with plain Python
(no JAX tracing, no compilation) and raises `ConfigError` whose one-line message names the command-line
option at fault, so a bad command line stops immediately with e.g.
``gmpo-jax train: error: --group-size must be >= 2 (group-normalised advantages need two samples), got 1``.

``--model`` picks the policy: ``toy`` (`gmpo_jax.train.model.Transformer`, the default) or ``qwen3``
(Tunix's Qwen3, `gmpo_jax.train.qwen3`), randomly initialised at the preset's size or loaded from a
Hugging Face ``--checkpoint`` directory (checked here, file headers only: nothing is loaded).

`make_objective` turns ``loss_type`` and its hyper-parameters into a `gmpo_jax` objective
(`GMPO`, `GRPO`, `CISPO`, `SAPO`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

__all__ = [
    "ConfigError",
    "LOSS_TYPES",
    "MODELS",
    "MODEL_PRESETS",
    "PRESETS",
    "TrainConfig",
    "make_objective",
    "preset_config",
]

#: every ``--loss-type`` value; ``gmpo`` first (the default)
CISPO_EPSILON_HIGH = 5.0  # the demo's CISPO cap on the importance weight (see make_objective)
LOSS_TYPES = ("gmpo", "grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo")
BUILTIN_TASKS = ("reverse", "add")
SCALE_REWARDS = ("group", "none")
LR_SCHEDULES = ("cosine", "constant")
DTYPES = ("float32", "bfloat16")
#: every ``--model`` value; ``toy`` first (the default)
MODELS = ("toy", "qwen3")
#: the options that size a randomly initialised policy (``--checkpoint`` takes them from its config.json)
ARCHITECTURE_FIELDS = (
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "d_ff",
    "tie_embeddings",
    "vocab_size",
)


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line and names the command-line option."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything `gmpo-jax train` needs; the field ``foo_bar`` is the option ``--foo-bar``.

    Defaults are the CPU preset, tuned so that ``gmpo-jax train`` with no arguments finishes in
    about a minute on a 2-core CPU with a clearly rising reward (docs/performance.md, "The training demo"). ``preset_config("gpu")`` is the H200 preset.

    Attributes (grouped):
      Run: ``name`` (``None`` -> ``"<loss_type>-<task><digits>-s<seed>"``), ``output_dir`` (``None`` ->
        ``runs/<name>``), ``seed``, ``steps`` (optimizer steps, one rollout batch each),
        ``save_every`` (checkpoint period in steps; 0 = only at the end), ``resume``, ``plots``,
        ``progress`` (tqdm bar), ``preset`` (informational), ``mesh`` (``None``: one device; else
        ``"data=D,model=M"``: the batch split over ``D`` devices and the LM head's vocabulary over ``M``,
        see `gmpo_jax.train.parallel`).
      Task: ``task`` (``"reverse"``, ``"add"`` or ``"module:function"``), ``digits`` (operand length,
        the task difficulty), ``partial_credit`` (reward per correct answer position),
        ``prompt_task`` (built-in task whose prompts a ``module:function`` reward function scores).
      Policy: ``model`` (``"toy"``: the demo's own transformer; ``"qwen3"``: Tunix's Qwen3),
        ``checkpoint`` (``--model qwen3`` only: a Hugging Face directory, ``config.json`` +
        ``*.safetensors``, whose architecture and weights replace the size options below; ``None``:
        random initialisation), ``d_model``, ``n_layers``, ``n_heads``, ``d_ff``,
        ``n_kv_heads`` / ``head_dim`` (qwen3 only; ``None`` -> ``n_heads`` / ``d_model // n_heads``),
        ``tie_embeddings`` (LM head = the input embedding, weight layout ``"vh"``; otherwise an untied
        head, layout ``"hv"``), ``vocab_size`` (``None`` -> tokenizer size; larger pads the head with
        never-targeted ids), ``dtype`` (activation / LM-head compute dtype; parameters stay float32).
      Rollout: ``batch_size`` (completions per step = prompts x ``group_size``), ``group_size`` (G),
        ``max_completion_length`` (``None`` -> the task's answer length + 1 for EOS),
        ``temperature``, ``top_p``.
      Objective: ``loss_type``, ``epsilon_low`` / ``epsilon_high`` (``None`` -> the objective's
        default: 0.4 for GMPO, 0.2 for the GRPO family; CISPO's ``epsilon_high``: 5.0, see
        ``make_objective``), ``beta`` (KL to the frozen initial policy),
        ``scale_rewards`` (``"group"``: divide by the group std; ``"none"``: Dr. GRPO, centre only),
        ``num_iterations`` (optimizer passes over each rollout batch; > 1 makes the updates
        off-policy and the importance ratios non-trivial).
      Optimizer: ``learning_rate``, ``lr_schedule`` (``"cosine"`` decays to 10% after warmup, or
        ``"constant"``), ``warmup_steps``, ``weight_decay``, ``max_grad_norm``, ``adam_b2``.
    """

    # run
    name: str | None = None
    output_dir: str | None = None
    seed: int = 0
    steps: int = 150
    save_every: int = 50
    resume: bool = False
    plots: bool = True
    progress: bool = True
    preset: str = "cpu"
    mesh: str | None = None
    # task
    task: str = "reverse"
    digits: int = 6
    partial_credit: float = 0.1
    prompt_task: str = "reverse"
    # policy
    model: str = "toy"
    checkpoint: str | None = None
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    n_kv_heads: int | None = None
    head_dim: int | None = None
    tie_embeddings: bool = False
    vocab_size: int | None = None
    dtype: str = "float32"
    # rollout
    batch_size: int = 256
    group_size: int = 16
    max_completion_length: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    # objective
    loss_type: str = "gmpo"
    epsilon_low: float | None = None
    epsilon_high: float | None = None
    beta: float = 0.0
    scale_rewards: str = "group"
    num_iterations: int = 2
    # optimizer
    learning_rate: float = 3e-3
    lr_schedule: str = "cosine"
    warmup_steps: int = 10
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    adam_b2: float = 0.99

    # ------------------------------------------------------------------------------------------
    @property
    def run_name(self) -> str:
        """``name`` or ``"<loss_type>-<task><digits>-s<seed>"`` (+ ``-<model>`` unless toy, + ``-<preset>``
        unless cpu; a hook's ``module:function`` becomes ``module-function``)."""
        if self.name:
            return self.name
        task = f"{self.task}{self.digits}" if self.task in BUILTIN_TASKS else self.task.replace(":", "-")
        suffix = ("" if self.model == "toy" else f"-{self.model}") + ("" if self.preset == "cpu" else f"-{self.preset}")
        return f"{self.loss_type}-{task.replace('.', '-')}-s{self.seed}{suffix}"

    @property
    def run_dir(self) -> str:
        """``output_dir`` or ``runs/<run_name>``."""
        return self.output_dir or f"runs/{self.run_name}"

    @property
    def num_prompts(self) -> int:
        """Prompts per step, ``batch_size // group_size``."""
        return self.batch_size // self.group_size

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (not validated; call `validate`)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """The configuration as a JSON object (one line)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def mesh_shape(self) -> tuple[int, int] | None:
        """``(D, M)`` of ``--mesh data=D,model=M``, checked against the devices and the batch; None
        without ``--mesh``. Asks JAX for its device count (initialises the backend, compiles nothing).

        Raises:
          ConfigError: a malformed string, more devices than JAX sees, or ``batch_size % D != 0``.
        """
        if self.mesh is None:
            return None
        from gmpo_jax.train.parallel import parse_mesh

        try:
            d, m = parse_mesh(self.mesh)
        except ValueError as e:
            raise ConfigError(f"--mesh {e}, got {self.mesh!r}") from None
        import jax

        n = jax.device_count()
        if d * m > n:
            raise ConfigError(
                f"--mesh data={d},model={m} needs {d * m} devices but JAX sees {n} ({jax.default_backend()}); "
                f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={d * m} before starting"
            )
        if self.batch_size % d:
            raise ConfigError(f"--mesh data={d} must divide --batch-size={self.batch_size}, got {self.mesh!r}")
        return d, m

    def validate(self) -> TrainConfig:
        """Check every field with plain Python; nothing compiles (``--mesh`` asks JAX for its device count;
        ``--checkpoint`` reads the directory's config.json and safetensors headers, no weights).

        Returns:
          ``self``, for chaining.

        Raises:
          ConfigError: the first invalid field, as a one-line message naming its ``--option``.
        """
        f = _Fields(self)
        f.need_int("seed", 0)
        f.need_int("steps", 1)
        f.need_int("save_every", 0)
        f.need_choice("loss_type", LOSS_TYPES)
        if not (self.task in BUILTIN_TASKS or _looks_like_hook(self.task)):
            raise f.bad("task", f"must be one of {', '.join(BUILTIN_TASKS)} or 'module:function'")
        f.need_choice("prompt_task", BUILTIN_TASKS)
        f.need_int("digits", 1)
        f.need_float("partial_credit", 0.0)
        self._validate_policy(f)
        self._validate_rl(f)
        if self.mesh is not None:
            self.mesh_shape()
        return self

    def _validate_policy(self, f: _Fields) -> None:
        f.need_choice("model", MODELS)
        for field in ("d_model", "n_layers", "n_heads", "d_ff"):
            f.need_int(field, 1)
        if self.model == "toy":
            for field in ("checkpoint", "n_kv_heads", "head_dim"):
                if getattr(self, field) is not None:
                    raise f.bad(field, "applies to --model qwen3 only")
        else:
            self._validate_qwen3(f)
        if self.d_model % self.n_heads and (self.model == "toy" or self.head_dim is None):
            raise f.bad("n_heads", f"must divide --d-model={self.d_model}")
        if self.vocab_size is not None:
            f.need_int("vocab_size", 1)
        f.need_choice("dtype", DTYPES)

    def _validate_qwen3(self, f: _Fields) -> None:
        if self.mesh is not None:
            raise f.bad("mesh", "is not supported with --model qwen3 (one device)")
        if self.n_kv_heads is not None:
            f.need_int("n_kv_heads", 1)
            if self.n_heads % self.n_kv_heads:
                raise f.bad("n_kv_heads", f"must divide --n-heads={self.n_heads}")
        if self.head_dim is not None:
            f.need_int("head_dim", 2)
            if self.head_dim % 2:
                raise f.bad("head_dim", "must be even (rotary embeddings rotate pairs of dimensions)")
        elif self.d_model % self.n_heads == 0 and (self.d_model // self.n_heads) % 2:
            raise f.bad(
                "n_heads", f"must leave an even head size --d-model={self.d_model} / n_heads (rotary embeddings)"
            )
        if self.checkpoint is not None:
            if not isinstance(self.checkpoint, str) or not self.checkpoint:
                raise f.bad("checkpoint", "must be a directory path")
            from gmpo_jax.train.hf_checkpoint import read_checkpoint

            read_checkpoint(self.checkpoint)  # ConfigError naming --checkpoint

    def _validate_rl(self, f: _Fields) -> None:
        f.need_int("group_size", 2)  # group-normalised advantages need two samples per prompt
        f.need_int("batch_size", 2)
        if self.batch_size % self.group_size:
            raise f.bad("batch_size", f"must be divisible by --group-size={self.group_size}")
        if self.max_completion_length is not None:
            f.need_int("max_completion_length", 1)
        f.need_float("temperature", 0.0, lo_open=True)
        f.need_float("top_p", 0.0, 1.0, lo_open=True)
        for field in ("epsilon_low", "epsilon_high"):
            if getattr(self, field) is not None:
                f.need_float(field, 0.0)
        f.need_float("beta", 0.0)
        f.need_choice("scale_rewards", SCALE_REWARDS)
        f.need_int("num_iterations", 1)
        f.need_float("learning_rate", 0.0, lo_open=True)
        f.need_choice("lr_schedule", LR_SCHEDULES)
        f.need_int("warmup_steps", 0)
        f.need_float("weight_decay", 0.0)
        f.need_float("max_grad_norm", 0.0, lo_open=True)
        f.need_float("adam_b2", 0.0, 1.0)
        if self.loss_type == "sapo" and (self.epsilon_low is not None or self.epsilon_high is not None):
            raise f.bad(
                "epsilon_high" if self.epsilon_high is not None else "epsilon_low",
                "does not apply to --loss-type sapo (it has no clip range)",
            )
        if self.loss_type == "cispo" and self.epsilon_low is not None:
            raise f.bad("epsilon_low", "does not apply to --loss-type cispo (it clips the ratio from above only)")


class _Fields:
    """Field checks of :meth:`TrainConfig.validate`: each raises a ConfigError naming the ``--option``."""

    def __init__(self, config: TrainConfig):
        self.config = config

    def bad(self, field: str, why: str) -> ConfigError:
        value = getattr(self.config, field)
        return ConfigError(f"--{field.replace('_', '-')} {why}, got {value!r}")

    def need_int(self, field: str, lo: int) -> None:
        value = getattr(self.config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise self.bad(field, f"must be an integer >= {lo}")

    def need_float(self, field: str, lo: float, hi: float = float("inf"), lo_open: bool = False) -> None:
        value = getattr(self.config, field)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > lo if lo_open else value >= lo) and value <= hi
        if not ok:
            rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise self.bad(field, f"must be a finite number in {rng}")

    def need_choice(self, field: str, choices: tuple[str, ...]) -> None:
        if getattr(self.config, field) not in choices:
            raise self.bad(field, f"must be one of {', '.join(choices)}")


def _looks_like_hook(task: str) -> bool:
    module, sep, attr = task.partition(":")
    return bool(sep and module and attr)


#: preset name -> field overrides applied on top of the `TrainConfig` defaults
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},
    # H200: a ~20M-parameter policy, 1024 completions per step, bf16 activations (Pallas LM-head path).
    "gpu": dict(
        preset="gpu",
        d_model=512,
        n_layers=6,
        n_heads=8,
        d_ff=2048,
        vocab_size=128,  # V % 64 == 0 lets the Mosaic GPU kernels read the weight in place; H % 64 == 0 needed
        dtype="bfloat16",
        batch_size=1024,
        group_size=16,
        learning_rate=1e-3,
        steps=200,
        warmup_steps=20,
    ),
}


#: ``(preset, model)`` -> field overrides applied on top of ``PRESETS[preset]`` for that ``--model``
MODEL_PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    # CPU: the cpu preset's sizes (H=64, 2 layers, 4 heads of 16, MLP 256) as a Qwen3 with grouped-query
    # attention (2 KV heads): ~0.1 M parameters, a fraction of a second per step on 2 cores.
    ("cpu", "qwen3"): dict(n_kv_heads=2),
    # H200: the architecture of Qwen3-0.6B (28 layers, H=1024, 16 query / 8 KV heads of 128, MLP 3072,
    # rope_theta 1e6) without its 151,936-row embedding: ~0.44 B parameters with the task's vocabulary
    # (padded to 128). Lower learning rate for the deeper model. Not run in CI (no GPU there).
    ("gpu", "qwen3"): dict(
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        d_ff=3072,
        learning_rate=1e-4,
    ),
}


def preset_config(preset: str = "cpu", **overrides: Any) -> TrainConfig:
    """The `TrainConfig` of a preset with ``overrides`` applied (not yet validated).

    The fields are ``TrainConfig``'s defaults, then ``PRESETS[preset]``, then
    ``MODEL_PRESETS[(preset, model)]`` (``model`` from ``overrides``, default ``"toy"``), then ``overrides``.

    Args:
      preset: ``"cpu"`` (the defaults) or ``"gpu"``.
      **overrides: field values that win over the preset.

    Raises:
      ConfigError: unknown preset or unknown field name.
    """
    if preset not in PRESETS:
        raise ConfigError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"unknown configuration field {unknown[0]!r}")
    model_preset = MODEL_PRESETS.get((preset, overrides.get("model", "toy")), {})
    return TrainConfig(**{**PRESETS[preset], **model_preset, "preset": preset, **overrides})


def make_objective(config: TrainConfig, max_completion_length: int):
    """The `gmpo_jax` objective selected by ``config.loss_type``.

    Args:
      config: a validated configuration.
      max_completion_length: ``T`` of the rollouts (the ``dr_grpo`` normaliser).

    Returns:
      ``GMPO``, ``GRPO(loss_type=...)``, ``CISPO`` or ``SAPO``; epsilons left at ``None`` keep the
      objective's own default (0.4 for GMPO, 0.2 otherwise), except CISPO's ``epsilon_high``: 5.0
      (``CISPO_EPSILON_HIGH``; its bound applies to the ratio itself, not to ``1 + eps``).

    Raises:
      ConfigError: the objective rejects a hyper-parameter (message names the option).
    """
    import gmpo_jax

    eps = {}
    if config.epsilon_low is not None:
        eps["epsilon_low"] = float(config.epsilon_low)
    if config.epsilon_high is not None:
        eps["epsilon_high"] = float(config.epsilon_high)
    elif config.loss_type == "cispo":
        # CISPO's epsilon_high caps the importance weight itself: the library's 0.2 (TRL / Liger's
        # shared default) would scale every on-policy gradient by 0.2. 5.0 leaves on-policy tokens alone.
        eps["epsilon_high"] = CISPO_EPSILON_HIGH
    beta = float(config.beta)
    lt = config.loss_type
    try:
        if lt == "gmpo":
            return gmpo_jax.GMPO(beta=beta, **eps)
        if lt in ("grpo", "dapo", "bnpo", "dr_grpo"):
            extra = {"max_completion_length": int(max_completion_length)} if lt == "dr_grpo" else {}
            return gmpo_jax.GRPO(loss_type=lt, beta=beta, **eps, **extra)
        if lt == "cispo":
            return gmpo_jax.CISPO(beta=beta, **eps)
        if lt == "sapo":
            return gmpo_jax.SAPO(beta=beta)
    except ValueError as e:  # the objective's own check, e.g. "epsilon_low must be >= 0, got ..."
        first = str(e).splitlines()[0]
        raise ConfigError(f"--loss-type {lt}: {first}") from e
    raise ConfigError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}, got {lt!r}")
