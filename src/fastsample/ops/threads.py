"""CPU threads: a call changes no thread setting, and its chains of small ops open no parallel
region.

On CPU, torch runs an op over enough elements as an OpenMP parallel region on all its threads,
and every region ends at a barrier; an op over fewer elements runs on the calling thread
alone. "Enough" is ATen's grain: :data:`GRAIN` (32,768) for elementwise ops, reductions,
``gather``, ``scatter``, ``nonzero`` and ``cat``; :data:`INDEX_GRAIN` (3,000) for advanced
indexing (``x[rows, cols]``, ``index_put_``); :data:`VML_GRAIN` (2,048) for ``exp`` and ``log``;
``topk``, ``cumsum`` and ``sort`` split over rows. On a machine whose cores are shared (the
normal state of an inference server, and of the 2-core VM this project is measured on) a region
waits for its slowest thread, which may not be scheduled for milliseconds: measured there, a
``fill_`` of 50,000 floats took 22 ms with 2 threads and 4 us with one, a block-maxima pass at
B=1 took 5 ms instead of 13 us in a loaded spell, and a call made of a few dozen such ops ran
5-10x slower with 2 threads than with one.

The thread count is the caller's: the library never calls ``torch.set_num_threads`` (it is
process-wide, other threads would see it change during a call, and vLLM's CPU worker replaces
it with a warning). Instead:

* a public call (:func:`one_thread_calls`: ``sample``, ``sample_step``, ``verify_chain``, ...)
  runs on the calling thread alone where a second thread would risk more than it saves: its
  input is under :data:`PARALLEL_PASS_ELEMENTS` (B <= 8 at V = 128,256), ``FASTSAMPLE_CPU_SERIAL``
  is ``1``, or a hold is on (below). For the call's duration the calling thread's own OpenMP
  thread count is 1 (``omp_set_num_threads`` on the runtime torch already loaded: a setting
  of that thread only, put back when the call returns or raises; likewise MKL's count for
  that thread, which ``torch.set_num_threads`` sets and which overrides OpenMP's for the ops
  MKL runs), so no op of the call opens
  a region, every path included (the general path's weights pass and radix, the penalties,
  the logprobs, verification), and each op runs whole;
* larger calls keep torch's threads, and their passes over the whole input (the block maxima
  of the logits, the copy into the stages' buffer, the raw log normalizer, and the
  small-top-k path's candidate scan, which counts double: :func:`serial_scan`) watch
  themselves (:func:`watched`): a region whose threads did not run together (the calling
  thread's CPU time over the pass well under its wall time: it was descheduled, or it
  finished its share and slept waiting for a descheduled worker; on a quiet machine it works,
  then spins briefly, ~100% of the time) starts a hold (:data:`HOLD_S`, doubling while the
  next region tried stalls too, up to :data:`HOLD_MAX_S`) during which the calls run on one
  thread; on a quiet machine no region stalls and nothing changes. This is the library's own
  state (no torch setting), and it changes speed only;
* where torch runs on no OpenMP runtime this can find (another parallel backend), the chains
  of small ops still open no region: they are shaped to stay under those grains (per-row
  tables of a few hundred entries, candidate lists, rows in pieces, ``gather``/``scatter`` on
  flat views rather than advanced indexing, ``exp`` in pieces of :data:`VML_GRAIN`), and the
  passes above run in pieces under the grain instead (:func:`serial_passes`), the general
  path's full-row ops excepted;
* ``FASTSAMPLE_CPU_SERIAL`` (read at every call) overrides the choice: ``1`` runs every call
  on one thread, ``0`` keeps torch's threads always (never watched).

Results never depend on any of this: every reduction here sums or compares within a row (or a
block) in the same order whatever the pieces and the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

GRAIN = 32768
"""ATen's ``at::internal::GRAIN_SIZE``: elementwise ops, reductions, ``gather``, ``scatter``,
``nonzero``, ``cat`` over fewer elements run on the calling thread."""

INDEX_GRAIN = 3000
"""ATen's grain of advanced indexing (``index``, ``index_put_``): 3,000 elements."""

VML_GRAIN = 2048
"""ATen's grain of the vectorized math functions (``exp``, ``log``): 2,048 elements."""

PARALLEL_PASS_ELEMENTS = 1 << 20
"""Passes over at least this many elements keep torch's threads (unless
``FASTSAMPLE_CPU_SERIAL=1``); smaller ones run in pieces under the grain. Measured on the
2-core Xeon (block maxima of fresh float32 logits, V = 128,256): B=1 13 us in one op against 37
us in pieces, B=8 95 against 300 us, B=64 1.7 against 4.3 ms, while a region stalled by a
descheduled thread costs milliseconds (``docs/cpu-primitive-costs.md``)."""

SERIAL_ENV = "FASTSAMPLE_CPU_SERIAL"


def _auto_mode() -> bool:
    """``FASTSAMPLE_CPU_SERIAL`` unset (or ``auto``): the library chooses and watches."""
    return os.environ.get(SERIAL_ENV, "") in ("", "auto")


def serial_passes(device: torch.device, elements: int) -> bool:
    """Whether a pass over ``elements`` runs in pieces under the grain: CPU eager, more than
    one torch thread, and ``FASTSAMPLE_CPU_SERIAL`` is ``1`` (always), ``0`` (never) or unset
    (below :data:`PARALLEL_PASS_ELEMENTS`, or while a stalled region holds the passes
    serial: :func:`watched`). Read at every call."""
    if device.type != "cpu" or torch.compiler.is_compiling() or elements < GRAIN:
        return False
    if torch.get_num_threads() == 1:  # no region can open: one op is fewer dispatches
        return False
    if _auto_mode():
        return elements < PARALLEL_PASS_ELEMENTS or _now() < _STALLS.serial_until
    return os.environ[SERIAL_ENV] != "0"


HOLD_S = 0.5
"""Seconds the passes stay in pieces after a stalled region (:func:`watched`)."""

HOLD_MAX_S = 4.0
"""The longest hold: after each region tried at the end of a hold that stalls again, the
next hold doubles, up to this (so a machine that turns quiet gets its threads back within
this many seconds, and a busy one pays one stalled region every this many)."""

STALL_SHARE = 0.7
"""A region stalled if the calling thread's CPU time over it is below this share of its wall
time. Measured on the 2-core AMD VM, B=64, V=128,256 (block maxima, the stage copy): 0.99-1.0
on a quiet machine, 0.2-0.5 beside two busy processes. (The process's CPU time would be the
natural measure, but Linux adds the other threads' time to it in ticks, too coarse for a
millisecond region.)"""

WATCH_FROM_S = 2e-4
"""Regions shorter than this are not judged: the clocks' overhead and the op's serial part
weigh too much there."""


class _Stalls:
    """What the passes have seen of their own parallel regions (one per process: the load is
    the machine's). Plain attributes: a race between threads only shifts a hold."""

    def __init__(self) -> None:
        self.serial_until = 0.0  # time.monotonic() before which the passes run in pieces
        self.hold = HOLD_S
        self.stalled = 0  # regions judged stalled (for tests and the benchmark)
        self.watched = 0  # regions judged


_STALLS = _Stalls()
_now = time.monotonic  # the holds' clock (a name the tests replace)


def forget_stalls() -> None:
    """Forget every region seen so far (the next pass tries its threads): for benchmarks that
    time a quiet machine right after a loaded one."""
    global _STALLS
    _STALLS = _Stalls()


def watched(device: torch.device, run: Callable[[], T]) -> T:
    """``run()``, a pass run as one parallel op on ``device``, timed on CPU in eager mode: if
    its threads did not run together (the calling thread's CPU time under :data:`STALL_SHARE`
    of the wall time, over at least :data:`WATCH_FROM_S`), the passes run in pieces for the
    next hold (:func:`serial_passes`). Not watched where ``FASTSAMPLE_CPU_SERIAL`` is set."""
    if (
        device.type != "cpu"
        or torch.compiler.is_compiling()
        or torch.get_num_threads() == 1
        or not _auto_mode()
    ):
        return run()
    wall, cpu = time.perf_counter(), time.thread_time()
    out = run()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    if wall >= WATCH_FROM_S:
        judge(wall, cpu)
    return out


def judge(wall: float, cpu: float) -> bool:
    """Record one parallel region of ``wall`` seconds during which the calling thread ran
    ``cpu`` seconds; True if it stalled (then a hold starts)."""
    _STALLS.watched += 1
    if cpu >= STALL_SHARE * wall:
        _STALLS.hold = HOLD_S  # the threads ran together: a later stall starts short
        return False
    _STALLS.stalled += 1
    _STALLS.serial_until = _now() + _STALLS.hold
    _STALLS.hold = min(2 * _STALLS.hold, HOLD_MAX_S)
    if _CALL.count:  # the rest of this call on one thread too (its entry point restores it)
        _CALL.to_one_thread()
    return True


# ---------------------------------------------------------------- a call on one thread


_OPENMP_NAMES = ("libgomp", "libiomp", "libomp")


@functools.cache
def _loaded_openmp() -> Any:
    """The ``ctypes`` handle of the OpenMP runtime torch uses, if it is already loaded and
    answers for torch (setting the calling thread's count through it changes what
    ``torch.get_num_threads()`` says on this thread; each runtime tried gets its own count
    back), or None (another parallel backend, or no such runtime). Searched once."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    folder = os.path.dirname(torch.__file__)
    paths = [
        path
        for pattern in (os.path.join(folder, "lib", "*"), os.path.join(folder + ".libs", "*"))
        for path in sorted(glob.glob(pattern))
        if os.path.basename(path).startswith(_OPENMP_NAMES)
    ]
    if os.path.exists("/proc/self/maps"):  # a runtime torch found outside its own folders
        with open("/proc/self/maps") as maps:
            named = {line.split()[-1] for line in maps if "/" in line}
            paths += sorted(p for p in named if os.path.basename(p).startswith(_OPENMP_NAMES))
    before = torch.get_num_threads()  # also torch's own first setting of this thread's count
    for path in paths:
        try:  # RTLD_NOLOAD: only a runtime already in the process, never a second one
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            own = library.omp_get_max_threads()
            library.omp_set_num_threads(before + 1)
            answers = torch.get_num_threads() == before + 1
            library.omp_set_num_threads(own)
        except (OSError, AttributeError):
            continue
        if answers and torch.get_num_threads() == before:
            return library
    return None


@functools.cache
def _mkl_local_setter() -> Any:
    """MKL's ``MKL_Set_Num_Threads_Local`` (by value; the lowercase name is the Fortran
    interface, by reference) where torch was built with MKL and exports it, else None.

    Why: ``torch.set_num_threads(n)`` also sets MKL's count for the calling thread
    (``mkl_set_num_threads_local``), and that count overrides OpenMP's, so the ops torch
    hands to MKL (``log``, ``exp`` and the like through its vector math) still opened
    n-thread regions in a call run on one thread. Beside two busy loops a B=64 T/k/p call
    on one thread took 50-100 ms instead of 7 after a single ``torch.set_num_threads(2)``
    (2026-12-07, 2-core Xeon); engines and users call it."""
    if "Math Kernel Library" not in torch.__config__.parallel_info():
        return None
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in sorted(glob.glob(os.path.join(folder, "libtorch_cpu*"))):
        try:
            setter = ctypes.CDLL(path, mode=os.RTLD_NOLOAD).MKL_Set_Num_Threads_Local
        except (OSError, AttributeError):
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
        return setter
    return None


def _set_mkl_local(count: int) -> int:
    """Set MKL's thread count for the calling thread; the one it had (0: none of its own,
    MKL's global count applies), for putting it back. 0 without MKL."""
    setter = _mkl_local_setter()
    return setter(count) if setter is not None else 0


def one_thread_calls(function: Callable[..., T]) -> Callable[..., T]:
    """A public entry point whose CPU calls run on the calling thread alone where
    :func:`serial_passes` says so for its input (the largest tensor argument): small inputs,
    ``FASTSAMPLE_CPU_SERIAL=1``, and during a hold after a stalled region.

    For the call's duration the calling thread's own OpenMP thread count is 1 (the OpenMP
    setting of that thread alone: other threads, and ``torch.get_num_threads()`` everywhere
    once the call returns, see no change), and so is its MKL count where torch has MKL
    (:func:`_mkl_local_setter`: ``torch.set_num_threads`` gives each thread one that
    overrides OpenMP's for the ops MKL runs), so no op of the call opens a parallel region:
    every path, not only the passes shaped into pieces, and each op whole (no pieces to
    dispatch). Where torch runs on no OpenMP runtime that can be found this way, the passes
    fall back to their pieces. The results do not depend on it (module docstring)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> T:
        if torch.compiler.is_compiling():
            return function(*args, **kwargs)
        if _CALL.count:  # inside another entry point's call: its choice stands
            return function(*args, **kwargs)
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]
        source = max(tensors, key=Tensor.numel, default=None)
        if source is None or source.device.type != "cpu" or source.numel() < GRAIN:
            return function(*args, **kwargs)
        runtime = _loaded_openmp()
        count = torch.get_num_threads()
        if runtime is None or count == 1:
            return function(*args, **kwargs)
        _CALL.count, _CALL.runtime = count, runtime
        if serial_passes(source.device, source.numel()):
            _CALL.to_one_thread()
            try:
                return function(*args, **kwargs)
            finally:
                _CALL.put_back()
        wall, cpu = time.perf_counter(), time.thread_time()  # a threaded call is watched
        try:
            return function(*args, **kwargs)
        finally:
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            stalled = _CALL.mkl_local is not None  # a pass stalled: the rest ran on one thread
            _CALL.put_back()
            if not stalled and wall >= WATCH_FROM_S and _auto_mode():
                judge(wall, cpu)  # the whole call, as a pass's region is judged

    return call


class _Call(threading.local):
    """The entry point's call running on this thread: the thread count it found (0: none
    running) and the runtime that sets it, so that a pass that stalls can send the rest of the
    call to one thread (:func:`judge`)."""

    count = 0
    runtime: Any = None
    mkl_local: int | None = None  # MKL's own count for this thread while set aside, else None

    def to_one_thread(self) -> None:
        """The rest of the call on this thread alone: OpenMP's count 1, and MKL's."""
        self.runtime.omp_set_num_threads(1)
        if self.mkl_local is None:
            self.mkl_local = _set_mkl_local(1)

    def put_back(self) -> None:
        """The call ends: the counts it found, where it changed them."""
        if self.mkl_local is not None:
            self.runtime.omp_set_num_threads(self.count)
            _set_mkl_local(self.mkl_local)
            self.mkl_local = None
        self.count = 0


_CALL = _Call()


def serial_scan(device: torch.device, entries: int) -> bool:
    """:func:`serial_passes` for the candidate scan of the small-top-k path (a copy of the
    candidate blocks, ``entries`` of them, and their group maxima): per entry it costs ~2.5x a
    block-maxima pass in pieces (B=64, k=50: 0.8 ms for 835K entries, 0.3 ms a 2^20 pass), so
    it keeps torch's threads from half the pass's size."""
    return serial_passes(device, 2 * entries)


def copy_(out: Tensor, values: Tensor) -> Tensor:
    """``out.copy_(values)`` for a pass over the input: in row pieces under the grain where
    :func:`serial_passes` says so (the same values either way)."""
    count = values.numel()
    if not serial_passes(values.device, count) or values.dim() != 2:
        return watched(values.device, lambda: out.copy_(values))
    batch, width = values.shape
    if width >= GRAIN:  # long rows: pieces of each row
        for row in range(batch):
            for start in range(0, width, GRAIN - 1):
                out[row, start : start + GRAIN - 1].copy_(values[row, start : start + GRAIN - 1])
        return out
    step = grain_rows(batch, width)
    for start in range(0, batch, step):
        out[start : start + step].copy_(values[start : start + step])
    return out


def exp_(values: Tensor) -> Tensor:
    """``values.exp_()`` for the chains of small ops: in pieces of :data:`VML_GRAIN` elements
    on CPU (eager), so it opens no parallel region; the same numbers (the function is applied
    element by element, and torch's CPU ``exp`` rounds the same value the same way wherever
    it sits in its loop)."""
    count = values.numel()
    if count <= VML_GRAIN or values.device.type != "cpu" or torch.compiler.is_compiling():
        return values.exp_()
    flat = values.view(-1)
    for start in range(0, count, VML_GRAIN):
        flat[start : start + VML_GRAIN].exp_()
    return values


def grain_rows(batch: int, row_elements: int) -> int:
    """Rows per piece so that a piece of ``row_elements`` per row stays under the grain (at
    least one)."""
    return max(1, min(batch, (GRAIN - 1) // max(row_elements, 1)))


def blockwise_(values: Tensor, out: Tensor, block: int, reduce: str) -> Tensor:
    """``out[b, j] = reduce(values[b, j * block : (j + 1) * block])`` (``reduce``: ``"amax"`` or
    ``"sum"``) for the ``(B, blocks)`` contiguous ``out``, in pieces of fewer than
    :data:`GRAIN` elements (the serial mode): each piece is the same reduction over the same
    blocks, so ``out`` is bitwise what the whole op gives."""
    batch, blocks = out.shape
    op = torch.amax if reduce == "amax" else torch.sum
    step = max(1, (GRAIN - 1) // block)
    if values.is_contiguous() and values.shape[1] == blocks * block:
        pieces = [(values.view(batch * blocks, block), out.view(batch * blocks))]
    else:  # row by row (a short last block, or strided rows)
        rows = values[:, : blocks * block]
        pieces = [(rows[b].reshape(blocks, block), out[b]) for b in range(batch)]
    for source, result in pieces:
        count = source.shape[0]
        sizes = [step] * (count // step) + ([count % step] if count % step else [])
        # split_with_sizes: every piece's view from one call (slicing costs ~1 us a view)
        parts = zip(source.split_with_sizes(sizes), result.split_with_sizes(sizes), strict=True)
        for part, into in parts:
            op(part, -1, out=into)
    return out
