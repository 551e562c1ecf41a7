"""Philox in Triton (interpreted on CPU) reproduces the torch path's uniform bits exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fastsample.kernels import philox as kp
from fastsample.ops.noise import exponential_from_uniform
from fastsample.ops.seeds import CounterSource, Purpose

EDGE_SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 0xFFFFFFFF, 2**32]


def counters(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    seed = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen)
    step = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen)
    step[: batch // 3] %= 1000  # small steps, as in practice
    seed[: len(EDGE_SEEDS)] = torch.tensor(EDGE_SEEDS)
    # Streams above 2^24 carry garbage above the purpose byte: both sides keep the low 24 bits.
    stream = torch.randint(0, 2**26, (batch,), generator=gen)
    return seed, step, stream


@pytest.mark.parametrize("purpose", list(Purpose))
@pytest.mark.parametrize("start,length", [(0, 1), (1, 2), (3, 700), (2**31 + 5, 33)])
def test_uniform_bits_identical_to_torch_path(purpose, start, length):
    gen = torch.Generator().manual_seed(start + length + int(purpose))
    seed, step, stream = counters(50, gen)
    ours = kp.counter_uniforms(seed, step, stream, purpose, start, length)
    reference = CounterSource(seed, step, stream).uniforms(purpose, start, length)
    assert ours.dtype == torch.float64
    assert torch.equal(ours, reference)


def test_exponential_noise_within_an_ulp_of_torch_path():
    gen = torch.Generator().manual_seed(9)
    seed, step, stream = counters(20, gen)
    noise = kp.counter_uniforms(seed, step, stream, Purpose.ENTRY, 0, 600, noise=True)
    reference = exponential_from_uniform(
        CounterSource(seed, step, stream).uniforms(Purpose.ENTRY, 0, 600)
    )
    assert (noise > 0).all() and noise.isfinite().all()
    assert torch.allclose(noise, reference, rtol=4.5e-16, atol=0)
