"""``python -m fastsample selfcheck``: passes here, and its checks can fail."""

from __future__ import annotations

import torch

from fastsample.__main__ import main
from fastsample.tools import selfcheck

CPU = torch.device("cpu")


def test_selfcheck_passes_on_this_machine(capsys):
    assert main(["selfcheck", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "FAIL" not in out


def biased_sampler(batch, n, call):
    """Draws from the selfcheck row with 2% of the mass moved onto token 0."""
    weights = batch[0].double() / batch[0].double().sum() * 0.98
    weights[0] += 0.02
    return torch.multinomial(weights.float().expand(batch.shape[0], -1), n)


def test_checks_catch_a_biased_sampler():
    assert selfcheck.check_single_draws(biased_sampler, CPU) is not None
    assert selfcheck.check_pairs(biased_sampler, CPU) is not None


def test_checks_catch_zero_weight_draws_and_repeats():
    def leaky(batch, n, call):
        return torch.randint(0, batch.shape[1], (batch.shape[0], n))

    assert "zero-weight" in selfcheck.check_zero_weights(leaky, CPU)
    assert "drawn twice" in selfcheck.check_pairs(leaky, CPU)


def test_threshold_matches_scipy_where_available():
    try:
        from scipy.stats import chi2
    except ImportError:
        return
    for df in (1, 5, 30, 255):
        exact, approx = chi2.isf(1e-6, df), selfcheck.chi2_threshold(df)
        # Wilson-Hilferty errs high at small df: conservative (fewer false alarms).
        assert exact * 0.999 <= approx <= exact * 1.15


def test_shortcut_check_fails_without_the_counting_pass(monkeypatch):
    from fastsample.ops import small_top_k

    def candidates_only(logits, x_low):  # as if no tie lay outside the k best blocks
        return logits.new_zeros(logits.shape[0], -(-logits.shape[1] // 256))

    assert selfcheck.check_small_top_k(CPU) is None
    monkeypatch.setattr(small_top_k, "_count_at_least", candidates_only)
    assert "top-k shortcut" in selfcheck.check_small_top_k(CPU)


def test_long_row_check_fails_when_the_radix_skips_its_second_round(monkeypatch):
    from fastsample.ops import select

    first_round_only = select.add_digits

    def broken(hist, values, keys, by, **digit):
        if "mask" in digit:  # round 1 as usual; later rounds add nothing
            first_round_only(hist, values, keys, by, **digit)

    assert selfcheck.check_long_rows(CPU) is None
    monkeypatch.setattr(select, "add_digits", broken)
    assert "long rows" in selfcheck.check_long_rows(CPU)
