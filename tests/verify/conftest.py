"""Fixtures shared by the tests in tests/verify."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from verify_helpers import V_CHAIN, ToyModel


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(kind, vocab=V_CHAIN, seed=0):
        if (kind, vocab, seed) not in cache:
            cache[kind, vocab, seed] = ToyModel(kind, vocab, seed)
        return cache[kind, vocab, seed]

    return get


@pytest.fixture
def eager_equivalent_random():
    # Inductor normally swaps in its own RNG; fallback_random keeps torch.rand's stream so
    # compiled and eager results can be compared bitwise.
    old = torch._inductor.config.fallback_random
    torch._inductor.config.fallback_random = True
    torch._dynamo.reset()
    yield
    torch._inductor.config.fallback_random = old
