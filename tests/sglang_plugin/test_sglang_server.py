"""The plugin in SGLang's HTTP server: ``python -m sglang.launch_server`` with
``SGLANG_PLUGINS=fastsample``, the tests' checkpoint and its tokenizer, on this CPU.

* ``/v1/completions`` answers a text prompt with the tokens asked for, the plugin drew every
  step (its calls file, written by the server's scheduler process) and handed none to
  SGLang; the same seeded request twice gives the same text.
* JSON-schema requests (``json_schema`` through ``/generate``, SGLang's xgrammar backend,
  whitespace off so that a random model closes the object): every answer parses and follows
  the schema; SGLang put the grammar's mask into the logits before the plugin drew them.
* A feature the plugin leaves to SGLang (``return_sampling_mask``) over many steps and two
  batches: every such step is handed to SGLang's own sampler, and the plugin logs its
  warning once for the whole server, not per call: once in its logger's file (one record per
  process and reason at most) and once on the server's stderr.
"""

from __future__ import annotations

import collections
import json
import time

import pytest
from sglang_helpers import HAVE_SGLANG, SKIP_REASON

if not HAVE_SGLANG:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from sglang_helpers import (
    PROMPT,
    CallLog,
    Server,
    checkpoint,
    logging_config,
    plugin_env,
    plugin_records,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "name": {"enum": ["fox", "dog", "cat"]},
    },
    "required": ["color", "ok", "name"],
    "additionalProperties": False,
}


class Served:
    def __init__(self, server: Server, calls: CallLog, log):
        self.server, self.calls, self.log = server, calls, log


@pytest.fixture(scope="module")
def served(plugin, tmp_path_factory):
    """The server with the plugin; the session's engine is stopped first (an idle engine's
    scheduler polls, and the server needs the cores to start)."""
    plugin.close()
    folder = tmp_path_factory.mktemp("sglang-server")
    calls = CallLog(folder / "calls-server.txt")
    config, log = logging_config(folder)
    start = time.perf_counter()
    server = Server(checkpoint(), plugin_env(True, calls.path, config), folder / "server.log",
                    "--grammar-backend", "xgrammar",
                    "--constrained-json-disable-any-whitespace", timeout=600)  # fmt: skip
    print(f"\nSGLang server with the plugin started in {time.perf_counter() - start:.1f} s")
    yield Served(server, calls, log)
    server.close()


def test_v1_completions(served):
    """Text in, 8 tokens out (``ignore_eos``), drawn by the plugin; seeded twice: one text."""
    body = dict(model=checkpoint(), prompt="the fox", max_tokens=8, temperature=0.9,
                top_p=0.95, seed=11, ignore_eos=True)  # fmt: skip
    mark = served.calls.mark()
    first = served.server.post("/v1/completions", body)
    assert first["usage"]["completion_tokens"] == 8, first
    assert isinstance(first["choices"][0]["text"], str)
    calls = served.calls.since(mark)
    assert calls["sampler"] >= 8 and calls["handed"] == 0, calls
    again = served.server.post("/v1/completions", body)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_json_schema(served):
    """Eight prompts, one schema, sampled at temperature 1: each answer is JSON following it."""
    jsonschema = pytest.importorskip("jsonschema")
    body = {
        "text": ["the", "a", "the cat", "red", "the fox and", "ok", "dog", "blue"],
        "sampling_params": {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 64,
                            "temperature": 1.0},
    }  # fmt: skip
    mark = served.calls.mark()
    answers = served.server.post("/generate", body)
    for answer in answers:
        assert answer["meta_info"]["finish_reason"]["type"] == "stop", answer
        jsonschema.validate(json.loads(answer["text"]), SCHEMA)
    calls = served.calls.since(mark)
    assert calls["sampler"] > 0 and calls["handed"] == 0, calls


def test_handed_feature_warns_once(served):
    """``return_sampling_mask`` (SGLang asks for a finite top-k with it), 6 requests x 6
    tokens, twice: every step handed to SGLang (at least 2 x 6 steps), the plugin's warning
    for it logged once."""
    params = {"temperature": 1.0, "top_k": 50, "max_new_tokens": 6, "ignore_eos": True}
    body = {"input_ids": [PROMPT] * 6, "return_sampling_mask": True, "sampling_params": params}
    mark = served.calls.mark()
    for _ in range(2):
        for answer in served.server.post("/generate", body):
            assert len(answer["output_ids"]) == 6, answer
    calls = served.calls.since(mark)
    assert calls["sampler"] == 0 and calls["handed:return_sampling_mask"] >= 12, calls

    records = plugin_records(served.log)
    repeated = {k: n for k, n in collections.Counter(records).items() if n > 1}
    assert not repeated, f"a warning logged more than once by one process: {repeated}"
    about = [m for _, m in records if "return_sampling_mask" in m]
    assert len(about) == 1, about
    on_stderr = [line for line in served.server.tail(10**7).splitlines()
                 if "fastsample.sglang] WARNING" in line]  # fmt: skip
    assert len(on_stderr) == len(records), on_stderr
