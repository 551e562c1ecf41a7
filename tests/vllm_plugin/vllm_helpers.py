"""Small models and engines for the vLLM plugin's tests (no download, nothing on the network).

* :func:`tiny_llama` -- a random Llama checkpoint saved from a config (head_dim 64: vLLM's
  CPU attention refuses 16); ``init_std`` 0.5 makes next-token laws peaked and
  input-dependent, which law tests need. Built once per path (idempotent).
* :func:`add_tokenizer` -- a byte-level BPE tokenizer trained on a built-in corpus and saved
  beside the model: structured outputs need a tokenizer.
* :func:`engine` -- ``vllm.LLM`` with the settings that start in seconds on 2 cores:
  in-process, eager, a 64 MiB KV cache, token-id prompts.
* :func:`next_token_logits` -- the same checkpoint's logits through transformers, the
  source of the exact laws.
"""

from __future__ import annotations

import gc
import os
import tempfile

import torch

VOCAB = 512


def checkpoint(name: str, **settings) -> str:
    """A test checkpoint shared by the modules (and the law registry), built once per
    machine in the temporary directory."""
    folder = os.path.join(tempfile.gettempdir(), "fastsample-vllm-tests-v1", name)
    return tiny_llama(folder, **settings)


def tiny_llama(path: str, *, seed: int = 0, init_std: float = 0.5, layers: int = 2) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, initializer_range=init_std, torch_dtype=torch.float32,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return path


def add_tokenizer(path: str) -> str:
    """A 512-token byte-level BPE tokenizer (ids 0-2: pad, bos, eos) beside the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    words = ["yes", "no", "true", "false", "null", "name", "value", "id", "items", "red",
             "green", "blue", "cat", "dog", "fox"]
    corpus = [
        f'{{"{w}": {i}, "{words[(3 * i) % len(words)]}": [{i % 7}, "{w}"]}} {w} {i}'
        for i, w in ((i, words[i % len(words)]) for i in range(300))
    ]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)  # fmt: skip
    return path


PROMPT_SPEC = [100, 200, 300, 7]


def speculative(path: str, drafts: int = 2) -> dict:
    """The draft model is the target itself (greedy drafts): drafts at every step, most of
    them accepted, so the verification of every position is exercised."""
    return {"model": path, "num_speculative_tokens": drafts}


def engine(path: str, **overrides):
    from vllm import LLM

    settings = dict(
        model=path, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
        max_num_seqs=64, max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20,
        dtype="float32", seed=0,
    )  # fmt: skip
    settings.update(overrides)
    return LLM(**settings)


def close(llm) -> None:
    """Shut an in-process engine down now. Left to the garbage collector, its finalizer can
    run while the next module's engine is alive and tear down the process-wide distributed
    state that engine uses."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def tokens_prompt(ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))


def next_token_logits(path: str, contexts: list[list[int]]) -> torch.Tensor:
    """``(N, V)`` float64 logits of the next token after each context, through transformers."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for context in contexts:
            out = model(torch.tensor([context]))
            rows.append(out.logits[0, -1].to(torch.float64))
    return torch.stack(rows)


def generated(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]
