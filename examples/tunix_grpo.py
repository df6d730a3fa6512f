"""Tunix's GRPO learner training with gmpo_jax's fused GMPO loss, end to end: a tiny random Qwen3 (Tunix's own
model code), Tunix's mock tokenizer, two prompts, two training steps on the CPU (seconds after the imports).

Needs ``pip install 'gmpo_jax[tunix]'``. Run: ``python examples/tunix_grpo.py``.
"""

import jax
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common  # MockVocab: Tunix's 22-word tokenizer for tests

import gmpo_jax
from gmpo_jax.integrations import tunix as gtx

tokenizer = test_common.MockVocab()
cfg = qwen3.ModelConfig(
    num_layers=1, vocab_size=tokenizer.GetPieceSize(), embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8,
    num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6, use_tied_embedding=False,
)  # fmt: skip
actor, reference = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)), qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
# Tunix's models shard over the axes "fsdp" and "tp" of type Auto (with jax.make_mesh's default, Explicit, its
# embedding lookup raises a ShardingTypeError)
mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
cluster = rl_cluster_lib.RLCluster(
    actor=actor,
    reference=reference,
    tokenizer=tokenizer,
    cluster_config=rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in roles},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=10, max_steps=2
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=4, max_prompt_length=8, kv_cache_size=16, temperature=0.9
        ),
    ),
)
# GMPO's clip range from the objective; the KL coefficient is Tunix's beta (the objective's own must be 0)
loss_name = gtx.register("gmpo", objective=gmpo_jax.GMPO(epsilon_low=0.4, epsilon_high=0.4))
config = GRPOConfig(num_generations=2, beta=0.04, kl_loss_mode="low_var_kl", policy_loss_fn=loss_name)


def reward(prompts, completions, **kwargs):  # fewer "!" is better
    return [-float(c.split().count("!")) for c in completions]


learner = GRPOLearner(rl_cluster=cluster, algo_config=config, reward_fns=reward)
before = jax.tree.map(np.asarray, nnx.state(cluster.actor_trainer.model, nnx.Param))
learner.train([{"prompts": np.array(["hello world", "input string"])}] * 2)  # 2 batches of 2 prompts: 2 steps
after = jax.tree.map(np.asarray, nnx.state(cluster.actor_trainer.model, nnx.Param))
# all but the MLP's 4 arrays (Tunix initialises the MLP to zeros: no gradient reaches it from this random start)
changed = sum(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
assert changed >= 10 and all(np.isfinite(a).all() for a in jax.tree.leaves(after)), changed
print(
    f"{learner.rl_cluster.global_steps} steps with {loss_name!r}: {changed} of {len(jax.tree.leaves(after))} parameter arrays changed"
)
