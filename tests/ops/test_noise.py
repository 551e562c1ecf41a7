"""The noise behind the race: never 0 or inf, full resolution where far-tail tokens win.

The race's tail accuracy is a property of its Exp(1) noise near 0: a token 1e-9 as likely as
the top one wins only when its noise is below ~1e-9. A statistical test of that needs ~1e11
uniforms (run on CUDA in test_exactness); here we check the property directly.
"""

from __future__ import annotations

import math

import torch

from fastsample.ops.noise import GeneratorSource, exponential_from_uniform


def test_noise_is_finite_and_positive_at_the_grid_ends():
    u = torch.tensor([0.0, 2.0**-53, 2.0**-30, 0.5, 1 - 2.0**-53], dtype=torch.float64)
    e = exponential_from_uniform(u.clone())
    assert torch.isfinite(e).all() and (e > 0).all()
    assert e[0] == 2.0**-54  # u == 0 moves to its grid cell's midpoint, not to finfo.tiny
    assert math.isclose(e[-1].item(), 53 * math.log(2), rel_tol=1e-12)


def test_noise_resolves_the_far_tail():
    """P(E < x) = 1 - exp(-x) on the 2^-53 grid, to 1e-6 relative, for x down to 1e-12."""
    for x in [1e-12, 1e-10, 1e-9, 3e-9, 1e-6]:
        k = torch.arange(0, 2**21, dtype=torch.float64)  # a window of grid points around x
        start = math.floor(-math.expm1(-x) * 2.0**53) - 2**20
        u = (k + start).clamp_min(0) * 2.0**-53
        e = exponential_from_uniform(u.clone())
        assert (e[1:] >= e[:-1]).all()  # monotone in u
        below = start + int((e < x).sum())  # grid cells mapping below x
        exact = -math.expm1(-x) * 2.0**53
        assert abs(below - exact) <= 1 + 1e-6 * exact


def test_generator_uniforms_carry_53_bits():
    """Uniforms are not on a coarse grid: a 2^-24 grid would make the test above moot."""
    src = GeneratorSource(torch.Generator().manual_seed(0), 4, torch.device("cpu"))
    u = src.entry_uniforms(0, 100_000)
    assert ((u >= 0) & (u < 1)).all()
    scaled = u * 2.0**53
    assert torch.equal(scaled, scaled.round())  # on the 2^-53 grid
    assert float((u * 2.0**32 != (u * 2.0**32).round()).double().mean()) > 0.99
    assert u.shape == (4, 100_000) and src.row_uniforms(3).shape == (4, 3)


def test_coarse_noise_fails_the_resolution_check():
    """Negative control: float32 uniforms (2^-24 grid) cannot produce noise below ~6e-8."""
    u = torch.rand(1_000_000, generator=torch.Generator().manual_seed(0))
    e = -torch.log1p(-u.double())
    assert float(e[e > 0].min()) > 1e-9  # so a 1e-9 token could never win
