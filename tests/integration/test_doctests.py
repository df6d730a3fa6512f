"""The docstring examples of the public API run and give the values they show."""

import doctest

import pytest

import gmpo_jax.batch
import gmpo_jax.flax_utils
import gmpo_jax.lm_head.api
import gmpo_jax.lm_head.sharding
import gmpo_jax.logits.api
import gmpo_jax.options

MODULES = [
    gmpo_jax.lm_head.api,
    gmpo_jax.logits.api,
    gmpo_jax.lm_head.sharding,
    gmpo_jax.batch,
    gmpo_jax.options,
    gmpo_jax.flax_utils,
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module.__name__} has no docstring example"
    assert result.failed == 0
