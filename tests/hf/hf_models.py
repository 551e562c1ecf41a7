"""Small test models for the transformers integration, built from configs (no downloads).

* :func:`tiny_llama` -- a random Llama-style model; its output head is scaled up so that
  next-token laws are far from uniform (a law test on near-uniform logits proves little).
* :func:`truncated_draft` -- the first layer of a target with the target's embeddings,
  final norm and head: a draft that agrees with its target often enough to be useful.
* :func:`stub_model` -- a model whose logits are a fixed function of each row's own token
  and position (no attention at all), so any difference between a request alone and in a
  batch can only come from the decoding loop.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast


def llama_config(vocab: int = 64, layers: int = 2, hidden: int = 32) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )


def tiny_llama(seed: int = 0, vocab: int = 64, layers: int = 2, head_scale: float = 40.0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(vocab, layers)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.generation_config.pad_token_id = 0
    return model


def truncated_draft(target: LlamaForCausalLM, layers: int = 1) -> LlamaForCausalLM:
    config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": layers})
    draft = LlamaForCausalLM(config).eval()
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing, missing
    draft.generation_config.pad_token_id = target.generation_config.pad_token_id
    return draft


class StubLM(LlamaForCausalLM):
    """Logits = token table[token] + position table[position]: each row's logits depend on
    its own last token and position only. A Llama underneath, so generate's preparation
    (config, cache) runs as for a real model; the layers are never called."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        logits = self.token_table[input_ids] + self.position_table[position_ids]
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=logits)


def stub_model(seed: int, vocab: int = 64, scale: float = 2.0) -> StubLM:
    torch.manual_seed(seed)
    model = StubLM(llama_config(vocab, layers=1, hidden=8)).eval()
    model.token_table = scale * torch.randn(vocab, vocab)
    model.position_table = scale * torch.randn(256, vocab)
    model.generation_config.pad_token_id = 0
    return model


def warpers(temperature=None, top_k=None, top_p=None, min_p=None, typical_p=None,
            epsilon_cutoff=None, eta_cutoff=None):  # fmt: skip
    """transformers' own warpers for these controls, in the order generate applies them."""
    from transformers.generation.logits_process import (
        EpsilonLogitsWarper,
        EtaLogitsWarper,
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    chain = LogitsProcessorList()
    if temperature is not None:
        chain.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        chain.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        chain.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        chain.append(MinPLogitsWarper(min_p))
    if typical_p is not None:
        chain.append(TypicalLogitsWarper(typical_p))
    if epsilon_cutoff is not None:
        chain.append(EpsilonLogitsWarper(epsilon_cutoff))
    if eta_cutoff is not None:
        chain.append(EtaLogitsWarper(eta_cutoff))
    return chain


@torch.no_grad()
def next_token_law(model, prefix: list[int], controls: dict):
    """float64 ``(V,)``: the law of the next token after ``prefix`` under transformers'
    warpers, from the model's own float32 logits."""
    ids = torch.tensor([prefix])
    logits = model(ids).logits[:, -1].float()
    warped = warpers(**controls)(ids, logits)
    return torch.softmax(warped.double(), -1)[0]


def first_two_law(model, prompt: list[int], controls: dict):
    """float64 ``(V * V,)``: the joint law of the first two tokens, index ``x1 * V + x2``."""
    first = next_token_law(model, prompt, controls)
    vocab = first.shape[0]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for x1 in torch.nonzero(first).flatten().tolist():
        joint[x1] = first[x1] * next_token_law(model, [*prompt, x1], controls)
    return joint.flatten()


def left_pad(prompts: list[list[int]], pad: int = 0):
    """``(input_ids, attention_mask)`` for prompts of different lengths, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask
