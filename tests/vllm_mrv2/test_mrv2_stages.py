"""fastsample's stages (``SamplingParams.extra_args["fastsample"]``) through Model Runner V2,
end to end: the checks of ``tests/vllm_plugin/stage_requests.py`` (DRY and XTC act, every
stage is batch-invariant for a seeded request, the history widens with the context, bad
settings are the request's error), with the history read from MRV2's own ``all_token_ids``
and mirostat's ``mu`` kept per slot."""

from __future__ import annotations

import pytest
from mrv2_helpers import engine_mrv2
from stage_requests import ENGINE_CHECKS, MODEL
from vllm_helpers import checkpoint, close


@pytest.fixture(scope="module")
def llm():
    llm = engine_mrv2(checkpoint(MODEL))
    yield llm
    close(llm)


@pytest.mark.parametrize("check", ENGINE_CHECKS.values(), ids=ENGINE_CHECKS.keys())
def test_stages_through_the_engine(llm, check):
    check(llm, checkpoint(MODEL))
