"""bench's llama.cpp contender (tools/bench/llama_cpp_chain.py): llama.cpp's own chain, built
from a setting, draws what that setting allows. Needs llama-cpp-python (built by .ci/run);
without it the contender is left out and these tests skip."""

from __future__ import annotations

import pytest
import torch

from fastsample.tools.bench import llama_cpp_chain

lc = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")


def _rows(batch: int = 6, vocab: int = 500, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_the_chain_keeps_to_top_k_and_greedy_is_the_argmax():
    logits = _rows()
    top = logits.topk(5).indices
    chain = llama_cpp_chain.chain_call(
        lambda: logits, logits.shape[1], llama_cpp_chain.controls_chain({"top_k": 5})
    )
    drawn = [d for _ in range(20) for d in zip(range(6), chain(), strict=True)]
    assert all(token in top[row].tolist() for row, token in drawn)
    assert len({token for _, token in drawn}) > 6  # it draws, not always the first of each
    greedy = llama_cpp_chain.chain_call(
        lambda: logits, logits.shape[1], llama_cpp_chain.controls_chain({"temperature": 0.0})
    )
    assert greedy() == logits.argmax(-1).tolist()


def test_the_penalties_see_the_history():
    """A token in the history, the row's best by a little, loses to the runner-up under a
    strong repetition penalty; without the history it stays the best."""
    logits = torch.zeros(1, 50)
    logits[0, 7], logits[0, 3] = 5.0, 4.9
    values = {"repetition_penalty": 2.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    greedy = {"temperature": 0.0}
    chain = llama_cpp_chain.controls_chain(greedy, values)
    seen = llama_cpp_chain.chain_call(lambda: logits, 50, chain, history=[7])
    fresh = llama_cpp_chain.chain_call(lambda: logits, 50, chain)
    assert seen() == [3] and fresh() == [7]


def test_no_contender_without_the_package(monkeypatch):
    monkeypatch.setattr(llama_cpp_chain, "load", lambda: None)
    assert llama_cpp_chain.chain_call(lambda: _rows(), 500, lambda lc, v: []) is None
