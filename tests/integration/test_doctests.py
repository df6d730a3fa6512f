"""The docstring examples of the public API run and give the values they show."""

import doctest

import pytest

import gmpo_jax.flax_utils
import gmpo_jax.lm_head.api


@pytest.mark.parametrize("module", [gmpo_jax.lm_head.api, gmpo_jax.flax_utils], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module.__name__} has no docstring example"
    assert result.failed == 0
