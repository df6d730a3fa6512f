"""Adapters that plug gmpo_jax's fused losses into RL frameworks (optional extras).

Each submodule imports its framework lazily; importing this package needs nothing beyond gmpo_jax.
``gmpo_jax.integrations.tunix``: Tunix's GRPO / DAPO / Dr.GRPO learners (``pip install 'gmpo_jax[tunix]'``).
"""
