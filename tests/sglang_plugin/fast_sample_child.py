"""Child process of test_sglang_fast_sample.py: SGLang's draft proposal with the plugin loaded.

Loads SGLang's plugins (``SGLANG_PLUGINS=fastsample`` set by the parent) the way every SGLang
process does, then calls SGLang's own ``spec_utils.sample_draft_proposal`` (which calls the
module's ``fast_sample``: the plugin's once hooked) and prints one JSON line: the token
counts of ``rows`` seeded proposals from one row of logits, whether
the returned ``q`` is ``softmax(logits / T)``, whether the seeded proposals are the same in a
shuffled batch, and what SGLang's own seeded ``fast_sample`` does on CPU tensors.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    logits_row = torch.tensor(json.loads(sys.argv[1]), dtype=torch.float32)
    temperature, rows = float(sys.argv[2]), int(sys.argv[3])
    from sglang.srt.speculative import spec_utils

    original = spec_utils.fast_sample
    from sglang.srt.plugins import load_plugins

    load_plugins()
    vocab = logits_row.shape[0]
    logits = logits_row.expand(rows, vocab).contiguous()
    temperatures = torch.full((rows, 1), temperature)
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 12345
    positions = torch.full((rows,), 17, dtype=torch.int64)
    q, q_x, x = spec_utils.sample_draft_proposal(
        logits, temperatures, sampling_seed=seeds, positions=positions, draft_step=1
    )
    counts = torch.bincount(x.reshape(-1), minlength=vocab).tolist()
    exact_q = bool(torch.allclose(q, torch.softmax(logits / temperature, -1), rtol=1e-6, atol=0))
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    _, _, shuffled = spec_utils.sample_draft_proposal(
        logits[order], temperatures[order], sampling_seed=seeds[order],
        positions=positions[order], draft_step=1,
    )  # fmt: skip
    invariant = bool(torch.equal(shuffled.reshape(-1), x.reshape(-1)[order]))
    _, _, other_step = spec_utils.sample_draft_proposal(
        logits, temperatures, sampling_seed=seeds, positions=positions, draft_step=2
    )
    try:
        original(q[:4], 1, sampling_seed=seeds[:4], positions=positions[:4])
        own = "ran"
    except Exception as error:  # SGLang's seeded call needs a GPU Triton driver
        own = f"{type(error).__name__}: {error}"[:200]
    print(json.dumps({
        "counts": counts, "exact_q": exact_q,
        "invariant": invariant, "q_x_matches": bool(torch.equal(q_x, q.gather(1, x))),
        "same_as_other_step": float((other_step == x).float().mean()), "sglang_own": own,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
