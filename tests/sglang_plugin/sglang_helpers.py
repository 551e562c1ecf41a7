"""Models, engines and a server for the SGLang plugin's tests (SGLang 0.5.23's CPU engine; no
download, nothing on the network).

* :func:`checkpoint` -- a random Llama saved from a config, with a byte-level BPE tokenizer
  trained here beside it (the server's text endpoints and JSON schemas need one); built once
  per machine in the temporary directory. ``initializer_range`` 0.5 makes next-token laws
  peaked and prompt-dependent, which the law test needs.
* :func:`engine` -- ``sglang.Engine`` with the settings that run on this CPU (SGLang's CPU
  platform, torch attention, float32, a 4096-token KV cache, no CUDA graphs), the plugin on
  or off, its calls counted to a file.
* :func:`Server` -- ``python -m sglang.launch_server`` with the same settings, its log in a
  file.
* :func:`next_token_logits` -- the checkpoint's logits through transformers, the source of
  the exact laws.

Every SGLang process (the scheduler and detokenizer are child processes) appends its calls to
the plugin to ``FASTSAMPLE_SGLANG_CALLS`` (:class:`CallLog` reads them), and logs through
:func:`logging_config`: SGLang's log on stderr, and the plugin's own logger
(``fastsample.sglang``) also in a file, one line per record with the process id.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
SKIP_REASON = (
    "SGLang is not installed in this venv (its CPU recipe builds .venv-sglang: .ci/run, "
    "README's Tests section)"
)
"""Each module skips as a whole without SGLang. Where SGLang is installed it is imported
normally: a broken install fails the tests instead of skipping them."""

VOCAB = 512
PROMPT = [100, 200, 300, 7]

# SGLang 0.5.23 on this CPU (tests/sglang_plugin/conftest.py sets the environment): its CPU
# platform with torch's attention in float32, a KV cache small enough for the machine's
# memory check, no CUDA graphs. max_running_requests is the engine's batch limit.
SETTINGS = dict(
    device="cpu", attention_backend="torch_native", dtype="float32", mem_fraction_static=0.05,
    max_total_tokens=4096, max_running_requests=8, cuda_graph_backend_decode="disabled",
    cuda_graph_backend_prefill="disabled", random_seed=0,
)  # fmt: skip


def checkpoint() -> str:
    """The tests' model folder: a 2-layer random Llama (vocabulary 512) and its tokenizer."""
    path = os.path.join(tempfile.gettempdir(), "fastsample-sglang-tests-v1", "llama")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        _build(path)
    return path


def _build(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, initializer_range=0.5,
    )  # fmt: skip
    partial = path + f".partial-{os.getpid()}"  # built aside, then moved: no half folder
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.float32).save_pretrained(partial)
    _tokenizer().save_pretrained(partial)
    try:
        os.replace(partial, path)
    except OSError:  # another process built it meanwhile
        import shutil

        shutil.rmtree(partial, ignore_errors=True)


def _tokenizer():
    """A 512-token byte-level BPE (ids 0-2: ``<pad>``, ``<s>``, ``</s>``) trained on JSON-like
    lines of a few words, so that JSON and the words take few tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    words = ["color", "red", "green", "blue", "ok", "true", "false", "null", "count", "name",
             "the", "fox", "dog", "cat", "and", "a"]  # fmt: skip
    lines = [
        f'{{"{words[i % 16]}": "{words[(5 * i) % 16]}", "{words[(3 * i) % 16]}": {i % 10}}} '
        f"the {words[(7 * i) % 16]} {i}"
        for i in range(400)
    ]
    bpe.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")  # fmt: skip


def next_token_logits(path: str, contexts: list[list[int]]) -> torch.Tensor:
    """``(N, V)`` float64 logits of the next token after each context: transformers' float32
    forward of the same checkpoint, float64 afterwards."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [model(torch.tensor([c])).logits[0, -1].to(torch.float64) for c in contexts]
    return torch.stack(rows)


# ----------------------------------------------------------------------------- logs and calls


def logging_config(folder: Path) -> tuple[Path, Path]:
    """A logging configuration for every SGLang process (``SGLANG_LOGGING_CONFIG_PATH``):
    SGLang's warnings and errors on stderr (its INFO lines, one per batch, would bury them),
    and the plugin's logger from INFO up also in a file, ``<pid> <level> <message>`` per
    record. Returns (config, the plugin's log)."""
    log = folder / "fastsample-sglang.log"
    config = {
        "version": 1,
        "disable_existing_loggers": False,  # SGLang's loggers exist before it configures
        "formatters": {
            "sglang": {"format": "[%(asctime)s %(name)s] %(levelname)s %(message)s"},
            "plugin": {"format": "%(process)d %(levelname)s %(message)s"},
        },
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "sglang",
                       "stream": "ext://sys.stderr"},
            "plugin": {"class": "logging.FileHandler", "formatter": "plugin",
                       "filename": str(log), "level": "INFO"},
        },
        "root": {"level": "WARNING", "handlers": ["stderr"]},
        "loggers": {"fastsample.sglang": {"level": "INFO", "handlers": ["plugin"]}},
    }
    path = folder / "logging.json"
    path.write_text(json.dumps(config))
    return path, log


def plugin_records(log: Path, level: str = "WARNING") -> list[tuple[int, str]]:
    """``(pid, message)`` of the plugin's records at ``level`` in :func:`logging_config`'s
    file."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        pid, found, message = line.split(" ", 2) if line.count(" ") >= 2 else ("", "", "")
        if found == level:
            out.append((int(pid), message))
    return out


class CallLog:
    """The lines the plugin appends to ``FASTSAMPLE_SGLANG_CALLS`` (``kind detail``), read
    from a mark on: ``since(mark)`` counts kinds (``sampler``, ``handed``, ``fast_sample``,
    ``verify``) and ``handed:<reason>``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.touch()

    def lines(self) -> list[str]:
        return [line for line in self.path.read_text().splitlines() if line.strip()]

    def mark(self) -> int:
        return len(self.lines())

    def since(self, mark: int = 0) -> collections.Counter[str]:
        counts: collections.Counter[str] = collections.Counter()
        for line in self.lines()[mark:]:
            kind, _, detail = line.partition(" ")
            counts[kind] += 1
            if kind == "handed":
                counts[f"handed:{detail}"] += 1
        return counts


# ----------------------------------------------------------------------------- engine, server


def plugin_env(on: bool, calls: Path, logging_json: Path) -> dict[str, str]:
    """The environment variables an engine's or server's processes read at start-up.
    Without the plugin ``SGLANG_PLUGINS`` is unset: SGLang then loads every installed
    plugin, and fastsample's stays out of the way (its calls file must stay empty)."""
    env = {"FASTSAMPLE_SGLANG_CALLS": str(calls), "SGLANG_LOGGING_CONFIG_PATH": str(logging_json)}
    if on:
        env["SGLANG_PLUGINS"] = "fastsample"
    return env


def engine(path: str, env: dict[str, str], **overrides):
    """``sglang.Engine`` with :data:`SETTINGS` (``overrides`` win) and token-id prompts
    (``skip_tokenizer_init``). The environment is set for its start-up (its child processes
    read it) and put back afterwards."""
    import sglang

    settings = {**SETTINGS, "skip_tokenizer_init": True, **overrides}
    saved = {name: os.environ.get(name) for name in [*env, "SGLANG_PLUGINS"]}
    os.environ.pop("SGLANG_PLUGINS", None)
    os.environ.update(env)
    try:
        return sglang.Engine(model_path=path, **settings)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def generate(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """The output token ids of each prompt (``params``: one dict, or one per prompt)."""
    outputs = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=params)
    return [list(o["output_ids"]) for o in outputs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m sglang.launch_server`` on the checkpoint with :data:`SETTINGS` (and its
    tokenizer), in a child process whose stdout and stderr go to ``log``; ``env`` is added to
    this process's environment. ``post`` sends JSON and returns the decoded answer."""

    def __init__(self, path: str, env: dict[str, str], log: Path, *extra: str,
                 timeout: float = 300.0):  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", path,
                "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        for name, value in SETTINGS.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        full_env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
        full_env.update(env)
        with open(self.log, "wb") as out:
            # Its own process group: whatever it leaves behind is stopped with it.
            self.process = subprocess.Popen([*args, *extra], env=full_env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait(timeout)
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n"
                                   + self.tail())  # fmt: skip
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"the server did not answer in {timeout:.0f} s:\n" + self.tail())

    def post(self, route: str, body: dict, timeout: float = 120.0) -> dict:
        request = urllib.request.Request(
            self.url + route, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{route}: HTTP {error.code}: {error.read()[:2000]!r}") from None

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # launch_server's handler stops its child processes
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its children, if they outlived it
