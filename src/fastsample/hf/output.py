"""What ``generate`` returns: a tensor of sequences, or an output object like transformers'.

With ``return_dict_in_generate=True`` the loops return :class:`FastsampleGenerateOutput`, a
``GenerateDecoderOnlyOutput`` (so ``out.sequences``, ``out.scores``, ``out.logits`` work as
with transformers) with two more fields for speculative decoding: how many draft tokens each
row had verified and how many of them it accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor
from transformers.generation import GenerateDecoderOnlyOutput


@dataclass
class FastsampleGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus speculative-decoding counts.

    Attributes (beyond transformers' ``sequences``, ``scores``, ``logits``):
        num_drafted: ``(B,)`` draft tokens verified per row (None without a draft model).
        num_accepted: ``(B,)`` of those, how many the target accepted.
    """

    num_drafted: Tensor | None = None
    num_accepted: Tensor | None = None


def finish(
    config: Any,
    sequences: Tensor,
    scores: tuple[Tensor, ...] | None = None,
    logits: tuple[Tensor, ...] | None = None,
    num_drafted: Tensor | None = None,
    num_accepted: Tensor | None = None,
) -> Tensor | FastsampleGenerateOutput:
    """The sequences alone, or the output object when the config asks for a dict."""
    if not config.return_dict_in_generate:
        return sequences
    return FastsampleGenerateOutput(
        sequences=sequences,
        scores=scores if config.output_scores else None,
        logits=logits if config.output_logits else None,
        num_drafted=num_drafted,
        num_accepted=num_accepted,
    )
