"""The plugin inside SGLang's engine (``sglang.Engine``, CPU), against SGLang's own engine on
the same checkpoint.

* The plugin draws: every step of a plain batch (temperature, top-k, top-p and min-p rows
  side by side) is drawn by fastsample in SGLang's scheduler process, none handed to
  SGLang's code; SGLang's engine with the plugin installed but not named in
  ``SGLANG_PLUGINS`` records no call at all.
* Greedy decoding equals SGLang's own, token for token (SGLang's greedy rule: the first
  maximal logit).
* Frequency, presence and repetition penalties and logit bias stay SGLang's preprocessing:
  greedy tokens under each equal SGLang's own, and differ from the plain greedy tokens (so
  each setting acted).
* A seeded request (``sampling_seed``) draws the same tokens alone and inside two mixed
  batches (other prompts and settings, seeded and unseeded, greedy and penalized rows, the
  request twice), outside SGLang's deterministic mode; other seeds draw other tokens.
"""

from __future__ import annotations

import collections
import os
import time

import pytest
from sglang_helpers import HAVE_SGLANG, SKIP_REASON

if not HAVE_SGLANG:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from sglang_helpers import (
    PROMPT,
    CallLog,
    checkpoint,
    engine,
    generate,
    logging_config,
    plugin_env,
    plugin_records,
)

PROMPTS = [PROMPT, [5, 17, 42], [300, 301, 302, 303, 304], [1, 9, 99, 250, 500, 3]]
GREEDY = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)
PENALTIES = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.5),
    "repetition": dict(repetition_penalty=1.8),
    "logit_bias": dict(logit_bias={str(t): 3.0 for t in range(10, 60)}),
}
# Each case is run on both engines: (prompts, sampling params, one per prompt). The penalized
# rows share one batch with plain greedy rows, so per-row settings are exercised too.
CASES = {
    "greedy": (PROMPTS, [GREEDY] * len(PROMPTS)),
    "penalties": (
        PROMPTS * (len(PENALTIES) + 1),
        [{**GREEDY, **extra} for extra in PENALTIES.values() for _ in PROMPTS]
        + [GREEDY] * len(PROMPTS),
    ),
}


@pytest.fixture(scope="session")
def own(tmp_path_factory):
    """SGLang's own engine (the plugin installed, ``SGLANG_PLUGINS`` unset) on every case,
    then stopped: ``(outputs by case, its calls)``. Session-scoped so that it runs, and
    stops, before the shared engine with the plugin starts."""
    folder = tmp_path_factory.mktemp("sglang-own")
    calls = CallLog(folder / "calls-own.txt")
    config, _ = logging_config(folder)
    start = time.perf_counter()
    llm = engine(checkpoint(), plugin_env(False, calls.path, config))
    print(f"\nSGLang's own engine started in {time.perf_counter() - start:.1f} s")
    try:
        outputs = {name: generate(llm, *case) for name, case in CASES.items()}
    finally:
        llm.shutdown()
    return outputs, calls


def test_greedy_equals_sglangs_own(own, plugin):
    """Greedy decoding (temperature 0: SGLang's ``top_k = 1``), 4 prompts x 24 tokens."""
    outputs, _ = own
    mark = plugin.calls.mark()
    assert generate(plugin.engine, *CASES["greedy"]) == outputs["greedy"]
    assert plugin.calls.since(mark)["sampler"] >= GREEDY["max_new_tokens"]


def test_penalties_and_logit_bias_are_sglangs(own, plugin):
    """Each penalty and the bias, greedy: SGLang's own tokens, and not the plain greedy ones
    on every setting (the control: the setting reached the logits)."""
    outputs, _ = own
    got = generate(plugin.engine, *CASES["penalties"])
    assert got == outputs["penalties"]
    n = len(PROMPTS)
    plain = got[-n:]
    assert plain == outputs["greedy"]
    for i, name in enumerate(PENALTIES):
        rows = got[i * n : (i + 1) * n]
        assert rows != plain, f"{name} changed no greedy token: the test would see nothing"


def test_the_plugin_draws_and_sglang_alone_does_not(own, plugin):
    """A plain batch: one ``sampler`` call per step at least, no step ``handed`` to SGLang,
    no plugin warning; SGLang's own engine (plugin not named) counted nothing."""
    _, own_calls = own
    assert own_calls.since() == collections.Counter(), "the plugin acted without being named"
    settings = [
        dict(temperature=0.7), dict(temperature=1.0, top_k=40), dict(temperature=1.3, top_p=0.9),
        dict(temperature=1.0, min_p=0.1), dict(temperature=1.5, top_k=20, top_p=0.8, min_p=0.02),
        dict(temperature=0),
    ]  # fmt: skip
    params = [{**s, "max_new_tokens": 12, "ignore_eos": True} for s in settings]
    mark = plugin.calls.mark()
    out = generate(plugin.engine, [PROMPTS[i % 4] for i in range(len(params))], params)
    assert all(len(tokens) == 12 for tokens in out)
    calls = plugin.calls.since(mark)
    assert calls["sampler"] >= 12, calls
    assert calls["handed"] == 0, f"steps handed to SGLang's own code: {calls}"
    warnings = [m for pid, m in plugin_records(plugin.log) if pid != os.getpid()]
    assert not warnings, warnings


SEEDED = dict(temperature=1.5, top_k=50, top_p=0.95, max_new_tokens=16, ignore_eos=True,
              sampling_seed=1234)  # fmt: skip


def test_seeded_request_is_batch_invariant(plugin):
    """``SEEDED`` alone, then in two mixed batches (different companions, positions and
    prompt lengths; in the second twice): the same 16 tokens each time. Control: four other
    seeds do not all draw its tokens."""
    llm = plugin.engine
    alone = generate(llm, [PROMPT], [SEEDED])[0]
    companions = [
        (PROMPTS[1], dict(temperature=0.8, max_new_tokens=20, ignore_eos=True)),  # unseeded
        (PROMPTS[2], dict(temperature=0, max_new_tokens=9, ignore_eos=True)),
        (PROMPTS[3], dict(temperature=1.2, top_k=5, sampling_seed=7, max_new_tokens=16)),
        ([*PROMPT, 8, 9], dict(temperature=1.0, min_p=0.1, frequency_penalty=1.0,
                               max_new_tokens=5, ignore_eos=True)),
    ]  # fmt: skip
    first = [*companions[:2], (PROMPT, SEEDED), *companions[2:]]
    second = [(PROMPT, SEEDED), *companions[::-1], (PROMPT, SEEDED)]
    for batch, where in ((first, [2]), (second, [0, len(second) - 1])):
        out = generate(llm, [p for p, _ in batch], [s for _, s in batch])
        for i in where:
            assert out[i] == alone, f"row {i} of a mixed batch drew other tokens"
    others = generate(llm, [PROMPT] * 4, [{**SEEDED, "sampling_seed": s} for s in range(4)])
    assert any(o != alone for o in others), "other seeds drew the same tokens"
