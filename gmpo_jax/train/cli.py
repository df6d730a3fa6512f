"""Command line: ``gmpo-jax train [options]`` (also ``python -m gmpo_jax.train [train] [options]``).

Options mirror `TrainConfig` fields (``--group-size`` is ``group_size``). A preset (``--preset cpu``, the
default, or ``--preset gpu``) supplies the defaults, for the ``--model`` chosen (``toy`` or ``qwen3``);
options given explicitly win. ``--model qwen3 --checkpoint DIR`` takes the architecture from ``DIR``'s
config.json, so the size options (``--d-model``, ..., ``--vocab-size``) are refused with it. Any invalid value stops
the program with a one-line ``gmpo-jax train: error: --option ...`` message and exit status 2 before JAX
compiles anything.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gmpo_jax.train.config import (
    ARCHITECTURE_FIELDS,
    BUILTIN_TASKS,
    DTYPES,
    LOSS_TYPES,
    LR_SCHEDULES,
    MODELS,
    PRESETS,
    SCALE_REWARDS,
    ConfigError,
    TrainConfig,
    preset_config,
)

__all__ = ["main", "build_parser", "config_from_args"]

_D = TrainConfig()  # CPU-preset defaults, shown in --help


class _OneLineParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line (no usage block) and exit with status 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add(group, name: str, help: str, **kw):
    group.add_argument(f"--{name.replace('_', '-')}", dest=name, default=argparse.SUPPRESS, help=help, **kw)


def build_parser() -> argparse.ArgumentParser:
    """The ``gmpo-jax`` argument parser (subcommand ``train``)."""
    parser = _OneLineParser(prog="gmpo-jax", description="GMPO / GRPO-family RL with fused LM-head losses (JAX).")
    sub = parser.add_subparsers(dest="command", metavar="{train}", parser_class=_OneLineParser)
    p = sub.add_parser(
        "train",
        help="train a policy (a small Flax NNX transformer, or Tunix's Qwen3) with GMPO on a verifiable-reward task",
        description="On-policy RL (GMPO by default) of a decoder-only transformer on a built-in "
        "verifiable task: the demo's own small model (--model toy), or Tunix's Qwen3 (--model qwen3), "
        "randomly initialised or fine-tuned from a Hugging Face checkpoint (--checkpoint DIR). The "
        "defaults shown are the cpu preset's for the toy model (under a minute on an idle 2-core CPU); "
        "--preset gpu changes model size, batch and dtype, and explicit options win.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="cpu",
        help="defaults: cpu (small) or gpu (toy: H=512, 6 layers; qwen3: Qwen3-0.6B's layers, ~0.44B params; "
        "1024 completions/step, bf16)",
    )
    _run_args(p.add_argument_group("run"))
    _task_args(p.add_argument_group("task"))
    _policy_args(p.add_argument_group("policy"))
    _rollout_args(p.add_argument_group("rollout"))
    _objective_args(p.add_argument_group("objective"))
    _optimizer_args(p.add_argument_group("optimizer"))
    return parser


def _run_args(g) -> None:
    """The ``run`` options."""
    _add(g, "name", "run name (default <loss-type>-<task><digits>-s<seed>[-<preset>])", type=str)
    _add(g, "output_dir", "output folder (default runs/<name>)", type=str)
    _add(g, "seed", f"seed of the initialisation, prompts and sampling (default {_D.seed})", type=int)
    _add(g, "steps", f"optimizer steps, one rollout batch each (default {_D.steps})", type=int)
    _add(g, "save_every", f"checkpoint every N steps, 0 = at the end only (default {_D.save_every})", type=int)
    _add(g, "resume", "continue from the newest checkpoint in the output folder", action="store_true")
    _add(g, "plots", "write training.png at the end (default on)", action=argparse.BooleanOptionalAction)
    _add(g, "progress", "progress bar (default on)", action=argparse.BooleanOptionalAction)
    _add(
        g,
        "mesh",
        "data=D,model=M: split the batch over D devices and the LM head's vocabulary over M "
        "(fused loss sharded with jax.shard_map; V padded to a multiple of M and masked); D*M "
        "devices, D must divide --batch-size; on CPU simulate devices with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N (default: one device)",
        type=str,
    )


def _task_args(g) -> None:
    """The ``task`` options."""
    _add(
        g,
        "task",
        f"{' | '.join(BUILTIN_TASKS)} | module:function (a Task, or a reward function "
        f"(prompts, completions) -> rewards) (default {_D.task})",
        type=str,
    )
    _add(g, "digits", f"digits per operand: task difficulty (default {_D.digits})", type=int)
    _add(
        g,
        "partial_credit",
        f"reward per correct answer position; exact answer = 1 (default {_D.partial_credit})",
        type=float,
    )
    _add(g, "prompt_task", f"prompts scored by a module:function reward function (default {_D.prompt_task})", type=str)


def _policy_args(g) -> None:
    """The ``policy`` options."""
    _add(
        g,
        "model",
        f"{' | '.join(MODELS)}: the demo's own transformer, or Tunix's Qwen3 (its layers, KV cache and "
        f"loader; hidden states and LM head into the fused loss) (default {_D.model})",
        type=str,
    )
    _add(
        g,
        "checkpoint",
        "--model qwen3: fine-tune a Hugging Face Qwen3 directory (config.json + *.safetensors, loaded "
        "with Tunix's loader; its config.json sets the architecture, so the size options below do not "
        "apply; with a tokenizer.json the task's characters are the model's own tokens, else the task "
        "ids 0-14 are used as model ids) (default: random initialisation at the preset's size)",
        type=str,
        metavar="DIR",
    )
    _add(g, "d_model", f"hidden size H (default {_D.d_model})", type=int)
    _add(g, "n_layers", f"transformer blocks (default {_D.n_layers})", type=int)
    _add(g, "n_heads", f"attention heads (default {_D.n_heads})", type=int)
    _add(g, "d_ff", f"MLP width (default {_D.d_ff})", type=int)
    _add(g, "n_kv_heads", "--model qwen3: key/value heads, must divide --n-heads (default: cpu 2, gpu 8)", type=int)
    _add(g, "head_dim", "--model qwen3: size of each attention head, even (default: d_model / n_heads)", type=int)
    _add(
        g,
        "tie_embeddings",
        "LM head = input embedding (nnx.Embed, layout vh) instead of an nnx.Linear (hv)",
        action=argparse.BooleanOptionalAction,
    )
    _add(g, "vocab_size", "policy vocabulary (default: the tokenizer's 15; larger pads the head)", type=int)
    _add(g, "dtype", f"activation dtype: {' | '.join(DTYPES)} (default {_D.dtype})", type=str)


def _rollout_args(g) -> None:
    """The ``rollout`` options."""
    _add(g, "batch_size", f"completions per step = prompts x group size (default {_D.batch_size})", type=int)
    _add(g, "group_size", f"completions per prompt G, >= 2 (default {_D.group_size})", type=int)
    _add(g, "max_completion_length", "completion tokens T (default: answer length + 1 for EOS)", type=int)
    _add(g, "temperature", f"sampling temperature (default {_D.temperature})", type=float)
    _add(g, "top_p", f"nucleus sampling mass in (0, 1] (default {_D.top_p})", type=float)


def _objective_args(g) -> None:
    """The ``objective`` options."""
    _add(g, "loss_type", f"{' | '.join(LOSS_TYPES)} (default {_D.loss_type})", type=str)
    _add(g, "epsilon_low", "lower clip range (default: the objective's, 0.4 gmpo / 0.2 others)", type=float)
    _add(
        g,
        "epsilon_high",
        "upper clip range (default: the objective's; 5.0 for cispo, whose bound caps the ratio itself)",
        type=float,
    )
    _add(g, "beta", f"KL coefficient to the frozen initial policy (default {_D.beta})", type=float)
    _add(
        g,
        "scale_rewards",
        f"advantage scaling: {' | '.join(SCALE_REWARDS)} (none = Dr. GRPO) (default {_D.scale_rewards})",
        type=str,
    )
    _add(
        g,
        "num_iterations",
        f"optimizer passes per rollout batch; > 1 is off-policy (default {_D.num_iterations})",
        type=int,
    )


def _optimizer_args(g) -> None:
    """The ``optimizer`` options."""
    _add(g, "learning_rate", f"peak AdamW learning rate (default {_D.learning_rate})", type=float)
    _add(g, "lr_schedule", f"{' | '.join(LR_SCHEDULES)} after linear warmup (default {_D.lr_schedule})", type=str)
    _add(g, "warmup_steps", f"warmup updates (default {_D.warmup_steps})", type=int)
    _add(g, "weight_decay", f"AdamW weight decay (default {_D.weight_decay})", type=float)
    _add(g, "max_grad_norm", f"global gradient-norm clip (default {_D.max_grad_norm})", type=float)
    _add(g, "adam_b2", f"AdamW beta2 (default {_D.adam_b2})", type=float)


def config_from_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse ``train`` options into a validated `TrainConfig` (preset defaults, explicit options win).

    Raises:
      SystemExit: (status 2, one line on stderr) unknown option or invalid value.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["train", *argv]  # `python -m gmpo_jax.train [options]`
    args = vars(parser.parse_args(argv))
    if args.pop("command") != "train":
        parser.error("the only command is 'train'")
    if "checkpoint" in args:
        for field in ARCHITECTURE_FIELDS:
            if field in args:
                option = "--" + field.replace("_", "-")
                parser.exit(
                    2,
                    f"gmpo-jax train: error: {option} does not apply with --checkpoint (its config.json sets the architecture)\n",
                )
    try:
        return preset_config(args.pop("preset"), **args).validate()
    except ConfigError as e:
        parser.exit(2, f"gmpo-jax train: error: {e}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``gmpo-jax``: parse, validate, resolve the task and objective, then train.

    Returns:
      0 on success.

    Raises:
      SystemExit: status 2 with a one-line message on stderr for a configuration error.
    """
    config = config_from_args(argv)
    from gmpo_jax.train.loop import train
    from gmpo_jax.train.plan import plan

    try:
        plan(config)  # resolves --task and the objective: errors here are still pre-compilation
    except ConfigError as e:
        print(f"gmpo-jax train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    train(config, log=print)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
