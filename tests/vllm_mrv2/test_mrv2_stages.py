"""fastsample's stages (``SamplingParams.extra_args["fastsample"]``) through Model Runner V2,
end to end: the checks of ``tests/vllm_plugin/stage_requests.py`` (DRY and XTC act, every
stage is batch-invariant for a seeded request, bad settings are the request's error), with
the history read from MRV2's own ``all_token_ids`` and mirostat's ``mu`` kept per slot."""

from __future__ import annotations

import pytest
from mrv2_helpers import engine_mrv2
from stage_requests import (
    check_bad_settings_are_the_requests_error,
    check_dry_and_xtc_act,
    check_every_stage_is_batch_invariant,
    check_the_history_widens_with_the_context,
)
from vllm_helpers import checkpoint, close


@pytest.fixture(scope="module")
def llm():
    llm = engine_mrv2(checkpoint("stages"))
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
