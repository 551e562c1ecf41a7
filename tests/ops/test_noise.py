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


def resolution_errors(noise, xs=(1e-12, 1e-10, 1e-9, 3e-9, 1e-6)) -> list[float]:
    """The resolution procedure: for each x, the grid cells of the 2^-53 uniform grid that
    ``noise`` maps below x, minus the exact count (1 - exp(-x)) * 2^53, over a window of 2^21
    grid points around it; also fails (inf) if ``noise`` is not monotone there."""
    errors = []
    for x in xs:
        k = torch.arange(0, 2**21, dtype=torch.float64)  # a window of grid points around x
        start = math.floor(-math.expm1(-x) * 2.0**53) - 2**20
        u = (k + start).clamp_min(0) * 2.0**-53
        e = noise(u.clone())
        if not bool((e[1:] >= e[:-1]).all()):
            errors.append(math.inf)
            continue
        below = start + int((e < x).sum())  # grid cells mapping below x
        exact = -math.expm1(-x) * 2.0**53
        errors.append(abs(below - exact) / (1 + 1e-6 * exact))
    return errors


def test_noise_resolves_the_far_tail():
    """P(E < x) = 1 - exp(-x) on the 2^-53 grid, to 1e-6 relative, for x down to 1e-12."""
    assert max(resolution_errors(exponential_from_uniform)) <= 1


def test_generator_uniforms_carry_53_bits():
    """Uniforms are not on a coarse grid: a 2^-24 grid would make the test above moot."""
    src = GeneratorSource(torch.Generator().manual_seed(0), 4, torch.device("cpu"))
    u = src.entry_uniforms(0, 100_000)
    assert u.shape == (4, 100_000) and src.row_uniforms(3).shape == (4, 3)
    assert uniform_bits_ok(u)


def uniform_bits_ok(u: torch.Tensor) -> bool:
    """In [0, 1), on the 2^-53 grid, and almost never on the 2^-32 grid."""
    scaled = u * 2.0**53
    in_range = bool(((u >= 0) & (u < 1)).all())
    fine = float((u * 2.0**32 != (u * 2.0**32).round()).double().mean()) > 0.99
    return in_range and torch.equal(scaled, scaled.round()) and fine


def test_coarse_noise_fails_the_resolution_check():
    """Negative controls through the same procedures: noise from float32 uniforms (2^-24
    grid, as ``torch.rand`` gives) fails the resolution check (at 1e-10 and 3e-9), and
    such uniforms fail the 53-bit check."""

    def coarse(u: torch.Tensor) -> torch.Tensor:
        return exponential_from_uniform(torch.floor(u * 2.0**24) * 2.0**-24)

    errors = resolution_errors(coarse, xs=(1e-10, 3e-9))
    assert min(errors) > 1, errors
    u = torch.rand(4, 100_000, generator=torch.Generator().manual_seed(0)).double()
    assert not uniform_bits_ok(u)
