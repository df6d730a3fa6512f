"""``python -m gmpo_jax.train [train] [options]`` -- same as the ``gmpo-jax`` console script."""

import sys

from gmpo_jax.train.cli import main

sys.exit(main())
