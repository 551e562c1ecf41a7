"""``fastsample.vllm.request_stages`` without an engine: a batch's rows as ``StepParams``
keywords, the history's width, and the front end's check."""

from __future__ import annotations

import pytest
import torch

import fastsample as fs
from fastsample.vllm.request_stages import batch_settings, check, fitted_width, history_width

CPU = torch.device("cpu")


def test_rows_that_agree_are_numbers_and_others_tensors_with_off_values():
    rows = [{"dry_multiplier": 0.8, "xtc_probability": 0.5}, None,
            {"xtc_probability": 0.5, "mirostat_tau": 3.0, "no_repeat_ngram_size": 3}]  # fmt: skip
    got = batch_settings(rows, CPU)
    assert got["dry_multiplier"].tolist() == pytest.approx([0.8, 0.0, 0.0])
    assert got["mirostat_tau"].tolist() == [0.0, 0.0, 3.0]
    assert got["no_repeat_ngram_size"].dtype == torch.int64
    assert got["xtc_probability"].tolist() == pytest.approx([0.5, 0.0, 0.5])
    assert batch_settings([{"typical_p": 0.9}] * 2, CPU) == {"typical_p": 0.9}
    assert batch_settings([None, None], CPU) == {}
    # The off values are in range: every row is valid, and the rows without a stage draw as
    # a batch without it (same key, same position).
    params = fs.StepParams(3, 50, temperature=1.0, seed=torch.tensor([1, 2, 3]), **got)
    state = fs.TokenStats.from_prompts([[1, 2, 1, 2]] * 3, 50, history=8)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = fs.sample_step(logits, params=params, state=state, step=torch.zeros(3, dtype=torch.int64))
    assert bool(out.valid.all())
    plain = fs.sample_step(logits[1:2], params=fs.StepParams(1, 50, temperature=1.0, seed=2),
                           step=torch.zeros(1, dtype=torch.int64))  # fmt: skip
    assert out.token_ids[1].tolist() == plain.token_ids[0].tolist()


def test_history_width_is_the_longest_window_capped_by_the_context():
    assert history_width([None, {"typical_p": 0.5}], 256) == 0
    windows = [{"penalty_last_n": 16}, {"dry_multiplier": 1.0, "dry_penalty_last_n": 40}]
    assert history_width(windows, 256) == 40
    assert history_width([{"dry_multiplier": 1.0}], 256) == 256  # -1 by default
    assert history_width([{"no_repeat_ngram_size": 2}], 128) == 128
    assert history_width([{"penalty_last_n": 1000}], 256) == 256
    assert history_width([{"dry_multiplier": 0.0, "dry_penalty_last_n": 40}], 256) == 0


@pytest.mark.parametrize(("args", "named"), [
    ({"dry_multipler": 1.0}, "dry_multipler"), ({"typical_p": 0.0}, "typical_p"),
    ({"mirostat_tau": -1.0}, "mirostat_tau"), ({"penalty_last_n": 1.5}, "penalty_last_n"),
    ({"dry_sequence_breakers": [[50]]}, "dry_sequence_breakers"), ([1], "dict"),
])  # fmt: skip
def test_check_names_the_bad_setting(args, named):
    with pytest.raises(ValueError, match=named):
        check({"fastsample": args}, vocab=50)


def test_check_passes_good_settings_and_other_extra_args():
    assert check(None) is None and check({"other": 1}) is None
    good = {"dry_multiplier": 0.8, "dry_sequence_breakers": [[1], [2, 3]], "top_n_sigma": 1.0}
    assert check({"fastsample": good, "other": 1}, vocab=50) == good


def test_the_history_is_as_wide_as_the_contexts():
    assert fitted_width(0, 500) == 0
    assert fitted_width(256, 10) == 64 and fitted_width(256, 65) == 128
    assert fitted_width(256, 300) == 256 and fitted_width(40, 10) == 40


def test_a_setting_given_as_none_takes_its_default():
    got = check({"fastsample": {"dry_multiplier": 1.0, "dry_penalty_last_n": None,
                                "mirostat_tau": None}}, vocab=50)  # fmt: skip
    assert got == {"dry_multiplier": 1.0}
    assert history_width([got], 256) == 256  # dry_penalty_last_n's default: -1
