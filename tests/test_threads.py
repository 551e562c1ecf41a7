"""A call leaves the caller's threading alone (issue 27, item 2; fastsample.ops.threads).

The library never calls ``torch.set_num_threads`` (patched here to raise), and a thread
polling ``torch.get_num_threads()`` while calls run never sees the count change. The serial
mode (``FASTSAMPLE_CPU_SERIAL=1``) gives bitwise the default mode's results, and its passes
are made of ops under torch's parallel grain.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastsample as fs
from fastsample.ops import select, threads

GRAIN_TEST = 4 * threads.GRAIN


def _calls():
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 4, 40_000
    x = torch.randn(batch, vocab, generator=gen) * 3
    probs = torch.softmax(x, -1)
    t = torch.tensor([0.7, 1.0, 0.0, 1.3])
    k = torch.tensor([50, 20, 5, 100])
    p = torch.tensor([0.9, 0.95, 1.0, 0.8])
    seeds = torch.arange(batch) + 11
    stats = fs.TokenStats.from_prompts(
        [[1, 2, 3], [4, 5], [], [7]], vocab, outputs=[[9], [], [8, 8], []]
    )
    penalties = dict(
        repetition_penalty=1.1, frequency_penalty=torch.full((batch,), 0.2), presence_penalty=0.1
    )
    step_params = {
        mode: fs.StepParams(
            batch, vocab, temperature=t, top_k=k, top_p=p, seed=seeds, top_logprobs=5,
            logprobs_mode=mode, token_ranks=True, **penalties,
        )
        for mode in ("processed", "raw")
    }
    drafts = torch.randint(0, vocab, (batch, 2), generator=gen)
    target = torch.softmax(torch.randn(batch, 3, vocab, generator=gen), -1)
    return {
        "tensor controls": lambda: fs.sample(x, temperature=t, top_k=k, top_p=p, seed=seeds),
        "numbers": lambda: fs.sample(x, temperature=0.7, top_k=50, top_p=0.9, top_logprobs=3),
        "top-p alone": lambda: fs.sample(x, top_p=0.9, seed=3),
        "greedy": lambda: fs.sample(x, temperature=0.0),
        "step processed": lambda: fs.sample_step(
            x, params=step_params["processed"], state=stats, step=2
        ),
        "step raw": lambda: fs.sample_step(x, params=step_params["raw"], state=stats, step=2),
        "probs": lambda: fs.sample_from_probs(probs, seed=seeds),
        "race": lambda: fs.fast_sample(probs[:, :2000]),
        "process": lambda: fs.process(x, top_k=k, top_p=0.9),
        "verify": lambda: fs.verify_chain(target, drafts, seed=seeds),
    }  # fmt: skip


@pytest.mark.parametrize("serial", ["0", "1"])
def test_a_call_never_changes_the_thread_count(monkeypatch, serial):
    monkeypatch.setenv(threads.SERIAL_ENV, serial)
    calls = _calls()
    for call in calls.values():  # first calls (lazy setup) before the watch begins
        call()

    def refuse(*args, **kwargs):
        raise AssertionError("the library called torch.set_num_threads")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    before = torch.get_num_threads()
    seen: set[int] = set()
    started, done = threading.Event(), threading.Event()

    def watch():  # a thread started before the calls, reading the count throughout
        while not done.is_set():
            seen.add(torch.get_num_threads())
            started.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    started.wait()
    try:
        for _ in range(3):
            for call in calls.values():
                call()
    finally:
        done.set()
        watcher.join()
    assert seen == {before} and torch.get_num_threads() == before


@pytest.mark.skipif(
    torch.get_num_threads() < 2 or threads._loaded_openmp() is None,
    reason="needs two torch threads on an OpenMP runtime",
)
def test_a_serial_call_runs_on_its_thread_alone(monkeypatch):
    """An entry point's call runs with its thread's OpenMP count at 1 where the passes would
    run in pieces (small inputs, the serial setting, a hold), keeps torch's threads
    elsewhere (until one of its passes stalls), and gives the count back after returning or
    raising."""
    seen = []

    @threads.one_thread_calls
    def probe(x, fail=False, stall=False, idle=0.0):
        seen.append(torch.get_num_threads())
        time.sleep(idle)  # the calling thread off the CPU, as when its region waits
        if stall:  # a pass of this call saw its region stall: the rest runs on one thread
            threads.judge(1.0, 0.0)
            seen.append(torch.get_num_threads())
        if fail:
            raise ValueError("inside the call")

    before = torch.get_num_threads()
    big = torch.zeros(threads.PARALLEL_PASS_ELEMENTS)
    small = torch.zeros(threads.PARALLEL_PASS_ELEMENTS // 2)
    monkeypatch.setenv(threads.SERIAL_ENV, "")
    threads.forget_stalls()
    try:
        probe(big), probe(small), probe(torch.zeros(10))
        assert seen == [before, 1, before]  # the grain's small ops open no region anyway
        threads.judge(1.0, 0.0)  # a stalled region: the hold
        probe(big)
        with pytest.raises(ValueError, match="inside the call"):
            probe(big, fail=True)
        assert seen[3:] == [1, 1] and torch.get_num_threads() == before
        monkeypatch.setenv(threads.SERIAL_ENV, "0")
        probe(small)
        monkeypatch.setenv(threads.SERIAL_ENV, "1")
        probe(big)
        assert seen[5:] == [before, 1] and torch.get_num_threads() == before
        monkeypatch.setenv(threads.SERIAL_ENV, "")
        threads.forget_stalls()
        probe(big, stall=True)
        assert seen[7:] == [before, 1] and torch.get_num_threads() == before
        probe(big)  # held
        assert seen[9:] == [1] and torch.get_num_threads() == before
        threads.forget_stalls()
        probe(big, idle=0.01)  # the whole call is judged: it ran 0.01 s on ~no CPU time
        assert threads._STALLS.stalled == 1 and threads.serial_passes(big.device, big.numel())
        threads.forget_stalls()
        probe(big)  # negative control: a quick call is not judged, a busy one never stalls
        assert threads._STALLS.stalled == 0 and seen[10:] == [before, before]
    finally:
        threads.forget_stalls()


def _mkl_own_count():
    """MKL's thread count as the calling thread sees it (its own count if set, else MKL's
    global one), read through MKL's C interface, independently of the library's setter."""
    import ctypes

    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    library = ctypes.CDLL(os.path.join(folder, "libtorch_cpu.so"), mode=os.RTLD_NOLOAD)
    return library.MKL_Get_Max_Threads()


@pytest.mark.skipif(
    threads._loaded_openmp() is None or threads._mkl_local_setter() is None,
    reason="needs torch on an OpenMP runtime, built with MKL",
)
def test_a_serial_call_sets_mkls_own_count_too(monkeypatch):
    """``torch.set_num_threads(2)`` also gives the calling thread an MKL count of 2 that
    overrides OpenMP's for the ops MKL runs (beside two busy loops a one-thread B=64 call
    then took 50-100 ms instead of 7): a serial call sets it to 1 and puts it back, also when
    a pass stalls mid-call. Negative control: without the MKL setter the call sees 2."""
    seen = []

    @threads.one_thread_calls
    def probe(x, stall=False):
        if stall:
            threads.judge(1.0, 0.0)
        seen.append(_mkl_own_count())

    before, own_before = torch.get_num_threads(), threads._set_mkl_local(0)
    threads._set_mkl_local(own_before)
    small = torch.zeros(threads.PARALLEL_PASS_ELEMENTS // 2)
    big = torch.zeros(threads.PARALLEL_PASS_ELEMENTS)
    monkeypatch.setenv(threads.SERIAL_ENV, "")
    threads.forget_stalls()
    try:
        torch.set_num_threads(2)  # the engine's setting: MKL's own count 2 on this thread
        assert _mkl_own_count() == 2
        probe(small)
        probe(big, stall=True)  # threaded until its pass stalls, then on one thread
        assert seen == [1, 1] and _mkl_own_count() == 2 and torch.get_num_threads() == 2
        threads.forget_stalls()
        monkeypatch.setattr(threads, "_set_mkl_local", lambda count: 0)
        probe(small)
        assert seen[2:] == [2]  # the control: MKL's count left alone reaches the call
    finally:
        threads.forget_stalls()
        torch.set_num_threads(before)
        threads._mkl_local_setter()(own_before)


def test_serial_mode_gives_the_same_results(monkeypatch):
    results = {}
    for serial in ("0", "1"):
        monkeypatch.setenv(threads.SERIAL_ENV, serial)
        results[serial] = {}
        for name, call in _calls().items():
            torch.manual_seed(1)  # the unseeded calls draw from the default generator
            results[serial][name] = call()
    for name, out in results["0"].items():
        other = results["1"][name]
        if isinstance(out, torch.Tensor):
            assert torch.equal(out, other), name
            continue
        for a, b in zip(out, other, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), name


class _Reductions(TorchDispatchMode):
    """Records the element count of the largest tensor each reduction reads or writes."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith(("amax", "sum")):
            tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            self.sizes.append(max(t.numel() for t in tensors))
        return out


@pytest.mark.parametrize("batch", [1, 7])
def test_serial_block_maxima_open_no_parallel_region(monkeypatch, batch):
    """In the serial mode the block-maxima pass reduces pieces under the grain, and equals the
    one-op pass (a short last block and strided rows included)."""
    x = torch.randn(batch, 3 * 25_600 + 77)
    for values in (x, x[:, :76_800], x[:, 5:]):
        monkeypatch.setenv(threads.SERIAL_ENV, "0")
        whole = select.block_maxima(values)
        monkeypatch.setenv(threads.SERIAL_ENV, "1")
        with _Reductions() as log:
            pieces = select.block_maxima(values)
        assert log.sizes and max(log.sizes) < threads.GRAIN
        assert torch.equal(pieces, whole)


# The wake-up check runs in a fresh interpreter: in the test process other threads (torch.compile's
# workers, earlier tests' pools) switch context on their own and would be counted as workers.
_WAKEUPS = r"""
import os, sys, threading, time
import torch
import fastsample as fs
from fastsample.ops import threads

GRAIN_TEST = int(sys.argv[1])


def sleeps():
    # Voluntary context switches of the threads other than this one (torch's OpenMP
    # workers): a worker blocks again after each region that woke it, after spinning a while;
    # being preempted while it spins is not counted.
    me = threading.get_native_id()
    total = 0
    for task in os.listdir("/proc/self/task"):
        if int(task) != me:
            try:
                with open(f"/proc/self/task/{task}/status") as status:
                    total += sum(int(line.split()[1]) for line in status
                                 if line.startswith("voluntary_ctxt_switches"))
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
    return total


def settled():
    # sleeps() once the workers have settled (the same count twice, 0.1 s apart)
    count = sleeps()
    for _ in range(30):
        time.sleep(0.1)
        again = sleeps()
        if again == count:
            break
        count = again
    return count


batch, workload = int(sys.argv[2]), sys.argv[3]
gen = torch.Generator().manual_seed(batch)
vocab = 128_256
x = torch.randn(batch, vocab, generator=gen) * 3
rows = torch.full((batch,), 1.0)
if workload == "engine":
    stats = fs.TokenStats.from_prompts(
        torch.randint(0, vocab, (batch, 512), generator=gen), vocab,
        outputs=torch.randint(0, vocab, (batch, 128), generator=gen),
    )
    calls = [
        lambda: fs.sample(x, temperature=rows * 0.7, top_k=torch.full((batch,), 50),
                          top_p=rows * 0.9, seed=torch.arange(batch), top_logprobs=5),
    ]
    for mode in ("processed", "raw"):
        params = fs.StepParams(
            batch, vocab, temperature=rows * 0.7, top_k=torch.full((batch,), 50),
            top_p=rows * 0.9, seed=torch.arange(batch), repetition_penalty=rows * 1.1,
            frequency_penalty=rows * 0.2, presence_penalty=rows * 0.1, top_logprobs=5,
            logprobs_mode=mode, token_ranks=True,
        )
        calls.append(lambda params=params: fs.sample_step(x, params=params, state=stats, step=1))
    # The general path (no top-k: the weights of every entry, top-p's radix), min-p's
    # candidates and verification: whole-row ops the passes' pieces never covered.
    target = torch.softmax(torch.randn(batch, 3, vocab, generator=gen), -1)
    drafts = torch.randint(0, vocab, (batch, 2), generator=gen)
    calls += [
        lambda: fs.sample(x, temperature=0.7),
        lambda: fs.sample(x, temperature=0.8, top_p=0.9, seed=5),
        lambda: fs.sample(x, temperature=rows * 0.8, min_p=rows * 0.05),
    ]
    # Verification reads 3 positions a row: in pieces by default below the passes' size only
    # (or in the serial mode, or held: sys.argv[4]).
    serial = os.environ[threads.SERIAL_ENV] == "1" or len(sys.argv) > 4
    if target.numel() < threads.PARALLEL_PASS_ELEMENTS or serial:
        calls.append(lambda: fs.verify_chain(target, drafts, seed=torch.arange(batch)))
else:  # the negative control: the default mode's one-region pass over the logits
    calls = [lambda: fs.sample(x, top_k=50, temperature=0.7)]
for call in calls:
    call()  # lazy set-up first
torch.ones(GRAIN_TEST).sum()  # a region, then let the workers go to sleep
before = settled()
if len(sys.argv) > 4:  # a stalled region seen just now: the passes are held in pieces
    threads._STALLS.hold = 600.0  # the whole test, however slow the machine
    assert threads.judge(1.0, 0.0)
for call in calls:
    call()
print(before, settled())
"""


def _wakeups(serial: str, batch: int, workload: str, held: bool = False) -> tuple[int, int]:
    """The workers' settled context-switch counts before and after the calls, in a fresh
    interpreter on two torch threads (``held``: right after a stalled region)."""
    env = dict(os.environ, OMP_NUM_THREADS="2", **{threads.SERIAL_ENV: serial})
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(fs.__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    args = [str(GRAIN_TEST), str(batch), workload] + (["held"] if held else [])
    done = subprocess.run(
        [sys.executable, "-c", _WAKEUPS, *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = map(int, done.stdout.split()[-2:])
    return before, after


_LINUX = os.path.exists("/proc/self/task") and (os.cpu_count() or 1) >= 2


@pytest.mark.skipif(not _LINUX, reason="needs Linux /proc and two CPUs")
@pytest.mark.parametrize(("serial", "batch"), [("1", 64), ("", 1), ("", 8)])
def test_calls_open_no_parallel_region(serial, batch):
    """No op of these calls wakes torch's worker threads: in the serial mode at B=64, and by
    default at B <= 8 (passes under PARALLEL_PASS_ELEMENTS run in pieces). The check: the
    workers' context switches do not move during the calls (each region wakes them)."""
    before, after = _wakeups(serial, batch, "engine")
    assert after == before


@pytest.mark.skipif(not _LINUX, reason="needs Linux /proc and two CPUs")
def test_the_wakeup_count_sees_a_region():
    """Negative control of the test above: the default mode's B=64 pass over the logits
    (one parallel region) moves the count."""
    before, after = _wakeups("0", 64, "control")
    assert after > before


@pytest.mark.skipif(not _LINUX, reason="needs Linux /proc and two CPUs")
def test_after_a_stalled_region_the_calls_open_none():
    """By default at B=64 the passes over the logits are parallel regions (the control
    above); right after a region whose threads did not run together they run in pieces, as
    in the serial mode: no worker wakes during the engine calls."""
    before, after = _wakeups("", 64, "engine", held=True)
    assert after == before
    before, after = _wakeups("", 64, "engine")  # negative control: no stall seen
    assert after > before


@pytest.fixture
def clock(monkeypatch):
    """A fresh record of regions and a clock the test moves (seconds)."""
    now = [1000.0]
    monkeypatch.setattr(threads, "_STALLS", threads._Stalls())
    monkeypatch.setattr(threads, "_now", lambda: now[0])
    monkeypatch.delenv(threads.SERIAL_ENV, raising=False)
    return now


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread opens no region")
def test_a_stalled_region_holds_the_passes_in_pieces(clock):
    cpu, big = torch.device("cpu"), threads.PARALLEL_PASS_ELEMENTS
    hold = threads.HOLD_S
    assert not threads.serial_passes(cpu, big)
    assert not threads.judge(wall=0.010, cpu=0.0099)  # the calling thread ran throughout
    assert not threads.serial_passes(cpu, big)
    assert threads.judge(wall=0.010, cpu=0.004)  # it slept, waiting for a worker
    assert threads.serial_passes(cpu, big)
    assert threads.serial_passes(cpu, big // 2)  # small passes run in pieces anyway
    assert not threads.serial_passes(torch.device("meta"), big)  # CPU only
    clock[0] += hold * 1.01
    assert not threads.serial_passes(cpu, big)  # the hold is over: the next pass tries
    assert threads.judge(wall=0.010, cpu=0.006)  # stalls again: twice as long
    clock[0] += hold * 1.5
    assert threads.serial_passes(cpu, big)
    clock[0] += hold * 0.6
    assert not threads.serial_passes(cpu, big)
    assert not threads.judge(wall=0.010, cpu=0.0095)  # quiet again
    assert threads.judge(wall=0.010, cpu=0.005)  # a new stall starts short
    clock[0] += hold * 1.01
    assert not threads.serial_passes(cpu, big)
    for _ in range(20):  # the hold grows to its cap
        threads.judge(wall=0.010, cpu=0.005)
    assert threads._STALLS.hold == threads.HOLD_MAX_S
    assert threads._STALLS.stalled == 23 and threads._STALLS.watched == 25


def test_the_setting_overrides_the_watch(clock, monkeypatch):
    cpu, big = torch.device("cpu"), threads.PARALLEL_PASS_ELEMENTS
    threads.judge(wall=0.010, cpu=0.0)
    monkeypatch.setenv(threads.SERIAL_ENV, "0")
    assert not threads.serial_passes(cpu, big)
    ran = threads.watched(cpu, lambda: 7)  # not timed: nothing recorded
    assert ran == 7 and threads._STALLS.watched == 1


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread opens no region")
def test_watched_judges_long_regions_only(clock, monkeypatch):
    cpu = torch.device("cpu")
    times = iter([0.0, 1e-5])  # the wall clock at the start and at the end
    monkeypatch.setattr(threads.time, "perf_counter", lambda: next(times))
    threads.watched(cpu, lambda: None)
    assert threads._STALLS.watched == 0  # 10 us: too short to judge
    times = iter([0.0, 0.0, 0.01, 0.003])  # 10 ms of wall time, 3 ms of this thread's CPU
    monkeypatch.setattr(threads.time, "thread_time", lambda: next(times))
    monkeypatch.setattr(threads.time, "perf_counter", lambda: next(times))
    threads.watched(cpu, lambda: None)
    assert threads._STALLS.stalled == 1 and threads.serial_passes(cpu, 1 << 22)
