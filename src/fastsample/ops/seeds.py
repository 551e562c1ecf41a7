"""Counter-based per-request randomness: same request, same token, whatever the batch.

Every uniform is a pure function of ``(seed, step, stream, purpose, position)`` through
Philox-4x32-10 (:mod:`fastsample.philox`), computed with device tensor ops:

* key (2 x 32 bits) = the row's 64-bit ``seed``;
* counter word 0 = ``position // 2`` (each Philox block yields two 53-bit uniforms),
  word 1 = ``purpose << 24 | stream``, words 2-3 = the row's 64-bit ``step``.

So row ``b``'s draws never depend on its index in the batch, the batch size or the other
rows; different ``stream`` values (draft, target, acceptance, recovery, the i-th parallel
sample of a request) and different purposes inside one sampler (per-entry race noise, per-draw
uniforms) never share a counter, hence never share noise. The race keys its noise by the
*global* vocabulary index, so a vocabulary shard can reproduce its part of the same race.

Steps advance on the device (:func:`advance_step`), so a captured CUDA graph draws fresh
numbers on every replay instead of replaying frozen generator state.
"""

from __future__ import annotations

from array import array
from contextlib import AbstractContextManager, nullcontext
from enum import IntEnum
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .noise import GeneratorSource
from .philox import (
    lane_ones,
    philox4x32,
    philox4x32_host,
    philox4x32_pairs,
)

_MASK32 = 0xFFFFFFFF
_MASK64 = 2**64 - 1
_STREAM_LIMIT = 1 << 24
# 2^-53: scale of a 53-bit integer to [0, 1).
_INV_2_53 = 2.0**-53


class Stream(IntEnum):
    """Named streams: independent uses of randomness for one request never share noise.

    ``SAMPLE + i`` (``0 <= i < 2**20``) is the stream of the i-th parallel sample of a
    request (``n > 1`` sequences sharing a seed); the other names are for speculative
    decoding. Any int in ``[0, 2**24)`` is a valid stream.
    """

    SAMPLE = 0
    DRAFT = 1 << 20
    TARGET = 2 << 20
    ACCEPT = 3 << 20
    RECOVERY = 4 << 20
    BONUS = 5 << 20


class Purpose(IntEnum):
    """What a uniform is for inside one sampler call (the top byte of counter word 1)."""

    ENTRY = 0  # one per vocabulary entry: the race's noise
    DRAW = 1  # one per row per draw: the inverse CDF
    STAGE = 2  # one per row per random stage of the sampler chain (XTC's coin)


def advance_step(step: Tensor, by: int | Tensor = 1) -> Tensor:
    """Advance per-request steps in place, on the device (no host round trip).

    Call it inside a captured CUDA graph (or a compiled step) so every replay uses new
    counters. Returns ``step`` for chaining.

    Example:
        >>> step = torch.zeros(3, dtype=torch.int64)
        >>> advance_step(step).tolist()
        [1, 1, 1]
    """
    return step.add_(by)


class CounterSource:
    """Uniforms keyed by ``(seed[b], step[b], stream[b], purpose, position)``.

    Implements :class:`fastsample.noise.UniformSource`. ``seed``, ``step`` and ``stream``
    are ``(B,)`` int64 tensors on the data's device (already checked and broadcast).
    Philox-4x32-10 counter words: ``c0 = position // 2``, ``c1 = purpose << 24 | stream``,
    ``c2 = step mod 2**32``, ``c3 = step >> 32``; key ``(seed mod 2**32, seed >> 32)``.
    Position ``2p`` takes output words ``(x0, x3)``, position ``2p + 1`` ``(x2, x1)``:
    ``x << 21 | y >> 11``, 53 bits, scaled to ``[0, 1)``.
    """

    # Up to this many Philox blocks per row, the few-block layout is faster (overhead-bound).
    FEW_BLOCKS = 8

    def __init__(
        self,
        seed: Tensor | int,
        step: Tensor | int,
        stream: Tensor | int,
        rows: tuple[int, torch.device] | None = None,
    ):
        # Nothing is derived here: each call builds its own counter layout, and every tiny
        # op is ~1 us of a seeded single draw's budget. ``stream`` may stay a checked
        # Python int (the usual case), which then costs no op at all; so may ``seed`` and
        # ``step`` (with ``rows = (batch, device)``): they become ``(B,)`` tensors only when
        # first read, so a call that draws nothing (greedy) or whose kernel takes them some
        # other way launches no ``full``.
        self._seed, self._step, self.stream = seed, step, stream
        self._rows = rows

    def _as_rows(self, value: Tensor | int) -> Tensor:
        if isinstance(value, Tensor):
            return value
        assert self._rows is not None, "Python seed/step need rows=(batch, device)"
        batch, device = self._rows
        return torch.full((batch,), value, dtype=torch.int64, device=device)

    def given(self) -> tuple[Tensor | int, Tensor | int]:
        """``(seed, step)`` as they were given: checked ``(B,)`` tensors or Python ints.
        Kernels that broadcast a number themselves read these instead of :attr:`seed`."""
        return self._seed, self._step

    @property
    def seed(self) -> Tensor:
        """``(B,)`` int64 seeds (built on first read from a Python int)."""
        self._seed = self._as_rows(self._seed)
        return self._seed

    @property
    def step(self) -> Tensor:
        """``(B,)`` int64 steps (built on first read from a Python int)."""
        self._step = self._as_rows(self._step)
        return self._step

    def _stream_word(self, purpose: Purpose) -> Tensor | int:
        """Counter word ``c1``: the purpose byte above the 24-bit stream."""
        if isinstance(self.stream, int):
            return self.stream | int(purpose) << 24
        # Tensor streams cannot be range-checked without a sync: keep their low 24 bits so
        # the purpose byte above them stays intact.
        return (self.stream & (_STREAM_LIMIT - 1)).bitwise_or_(int(purpose) << 24)

    def uniforms(self, purpose: Purpose, start: int, length: int) -> Tensor:
        """``(B, length)`` float64 uniforms for positions ``start .. start + length - 1``."""
        first, last = start // 2, (start + length - 1) // 2
        on_host = self._host_words(last - first + 1)
        if on_host is not None:  # a few rows on CPU, eager: Philox in Python, few tensor ops
            return _host_uniforms(on_host, int(purpose), start, length)
        if last - first + 1 <= self.FEW_BLOCKS:
            with _small_op_mode():
                bits = self._few_block_bits(purpose, first, last)
        else:
            bits = self._per_word_bits(purpose, first, last)
        # Outside the small-op mode: the result is an ordinary tensor again.
        flat = bits.to(torch.float64).mul_(_INV_2_53).flatten(1)
        offset = start - 2 * first
        return flat.narrow(1, offset, length)

    def _host_words(self, blocks: int) -> _HostWords | None:
        """The rows' seeds, steps and streams read on the host (:class:`_HostWords`) where
        computing the uniforms there is cheaper than the ~70 small tensor ops of the packed
        layout: CPU values in eager mode, at most :data:`HOST_MAX_BLOCKS` Philox blocks in
        all (the host reads are free there)."""
        if self._rows is not None:
            batch, device = self._rows
        else:
            batch, device = self.seed.shape[0], self.seed.device
        if batch * blocks > HOST_MAX_BLOCKS or device.type != "cpu":
            return None
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return None
        values = []
        for value in (self._seed, self._step, self.stream):
            if isinstance(value, Tensor):
                if value.device.type != "cpu":
                    return None
                values.append(value.tolist())
            else:
                values.append([value] * batch)
        return _HostWords(batch, *values, device)

    def _few_block_bits(self, purpose: Purpose, first: int, last: int) -> Tensor:
        """``(B, blocks, 2)`` 53-bit integers, packed layout: overhead-bound, so few ops."""
        lanes = _lane_constants(self.seed.device)
        seed, step = self.seed.view(-1, 1, 1), self.step.view(-1, 1, 1)
        key = seed >> lanes.shifts_32_0  # (k1, k0) = (seed >> 32, seed)
        multiplied = step & lanes.mask_0_low  # (c0, c2) = (0, step mod 2**32)
        if last > 0:  # the block index goes into the zero lane c0
            blocks = torch.arange(first, last + 1, dtype=torch.int64, device=key.device)
            multiplied = multiplied | blocks[:, None] * lanes.ones_1_0
        # (c3, c1) = (step >> 32, stream word): the step's high word, then the word in lane 1.
        word = self._stream_word(purpose)
        xored = (step >> lanes.shifts_32_0).mul_(lanes.ones_1_0)
        if isinstance(word, int):
            xored.add_(lanes.ones_0_1, alpha=word)
        else:
            xored.add_(lanes.ones_0_1 * word.view(-1, 1, 1))
        even, odd = philox4x32_pairs(multiplied, xored, key)  # (x0, x2), (x3, x1)
        return torch.bitwise_left_shift(even, lanes.shift21).bitwise_or_(
            torch.bitwise_right_shift(odd, lanes.shift11)
        )

    def _per_word_bits(self, purpose: Purpose, first: int, last: int) -> Tensor:
        """``(B, blocks, 2)`` 53-bit integers, one tensor per word: memory-bound, long rows."""
        blocks = torch.arange(first, last + 1, dtype=torch.int64, device=self.seed.device)
        seed, step = self.seed[:, None], self.step[:, None]
        # Words that only enter XORs may carry garbage above bit 31 (see fastsample.philox).
        x0, x1, x2, x3 = philox4x32(
            (blocks, _column(self._stream_word(purpose), seed), step & _MASK32, step >> 32),
            (seed, seed >> 32),
        )
        even, odd = torch.stack((x0, x2), -1), torch.stack((x3, x1), -1)
        return torch.bitwise_left_shift(even, 21).bitwise_or_(odd >> 11)

    def stream_ok(self) -> Tensor | None:
        """``(B,)`` bool: rows whose tensor ``stream`` is in ``[0, 2**24)``; None for a Python
        int (checked when given). An out-of-range tensor value is data, like a bad control:
        its row draws with the value's low 24 bits (in range) and the samplers flag it."""
        if isinstance(self.stream, int):
            return None
        return (self.stream >= 0) & (self.stream < _STREAM_LIMIT)

    def row_uniforms(self, num: int) -> Tensor:
        return self.uniforms(Purpose.DRAW, 0, num)

    def host_row_uniforms(self, num: int) -> list[list[float]]:
        """:meth:`row_uniforms` as Python floats, computed on the host where that is free
        (a few rows on CPU, eager), else read from the tensor."""
        on_host = self._host_words((num + 1) // 2)
        if on_host is None:
            return self.row_uniforms(num).tolist()
        if num == 1:  # one draw a row, step after step: computed ahead (_first_draws)
            return _first_draws(on_host)
        return _host_values(on_host, int(Purpose.DRAW), 0, num)

    def entry_uniforms(self, start: int, length: int) -> Tensor:
        return self.uniforms(Purpose.ENTRY, start, length)

    def stage_uniforms(self, num: int) -> Tensor:
        return self.uniforms(Purpose.STAGE, 0, num)


HOST_MAX_BLOCKS = 128
"""Philox blocks (rows x blocks per row) up to which :class:`CounterSource` computes the
uniforms with Python ints on CPU: every block a 64-bit lane of one big-int computation
(:func:`~fastsample.ops.philox.philox4x32_host`), 9 us for one block, 36 us for 64 (one a
row), 98 us for 128 (eight a row), against ~75-120 us for the ~70-op tensor layout (2-core
Xeon, torch 2.13; the host cost grows with the lanes, the tensor layout's barely: crossover
~250 blocks)."""


LOOKAHEAD = 16
"""Steps whose first draw uniform one host Philox computation gives (:func:`_first_draws`):
a request drawing one token a step, steps ``s .. s + 15``, from the call at step ``s``. The
16 lanes cost ~2.4x one (11 against 4.7 us on the 2-core Xeon, warm), so 15 calls in 16 look
their uniform up (~1 us) instead of paying ~5-9 us of Python Philox warm, ~30 us right after
the engine's own passes evicted it."""

# (seed, stream, step) -> the uniform of position 0 of the DRAW purpose: a pure function of
# the key, so the table is never stale; cleared when full (it only saves work).
_FIRST_DRAWS: dict[tuple[int, int, int], float] = {}
_FIRST_DRAWS_MAX = 1 << 12  # ~0.6 MB; 128 windows of 16 steps for two rows


def _first_draws(words: _HostWords) -> list[list[float]]:
    """Each row's uniform of position 0 of :attr:`Purpose.DRAW` (``_host_values(words, DRAW,
    0, 1)``), from :data:`_FIRST_DRAWS`, where a missing row fills its next
    :data:`LOOKAHEAD` steps (every row's, in one Philox computation of that many lanes)."""
    keys = list(zip(words.seeds, words.streams, words.steps, strict=True))
    found = list(map(_FIRST_DRAWS.get, keys))
    if None not in found:
        return [[u] for u in found]
    rows = words.rows
    ahead = max(1, min(LOOKAHEAD, HOST_MAX_BLOCKS // rows))
    if max(words.steps) >= 2**63 - ahead:  # the steps stay int64
        ahead = 1
    steps = [step + j for j in range(ahead) for step in words.steps]
    lanes = _HostWords(rows * ahead, words.seeds * ahead, steps, words.streams * ahead,
                       words.device)  # fmt: skip
    values = _host_values(lanes, int(Purpose.DRAW), 0, 1)  # lane j * rows + b: step + j
    if len(_FIRST_DRAWS) + len(steps) > _FIRST_DRAWS_MAX:
        _FIRST_DRAWS.clear()
    for key, value in zip(zip(lanes.seeds, lanes.streams, steps, strict=True), values,
                          strict=True):  # fmt: skip
        _FIRST_DRAWS[key] = value[0]
    return values[:rows]


class _HostWords(NamedTuple):
    """A batch's seeds, steps and streams as Python ints, one per row."""

    rows: int
    seeds: list[int]
    steps: list[int]
    streams: list[int]
    device: torch.device


def _lanes(values: list[int], repeats: int) -> int:
    """``values`` (int64 range), repeated ``repeats`` times, as the 64-bit lanes of one int
    (two's complement); a single value is itself (its low 64 bits)."""
    if len(values) == 1 and repeats == 1:
        return values[0] & _MASK64
    return int.from_bytes(array("q", values * repeats).tobytes(), "little")


def _host_uniforms(words: _HostWords, purpose: int, start: int, length: int) -> Tensor:
    """:meth:`CounterSource.uniforms` computed with Python ints: the same Philox-4x32-10
    words, the same 53-bit integers, exactly the same float64 uniforms."""
    return _host_bits(words, purpose, start, length).to(torch.float64).mul_(_INV_2_53)


def _host_values(words: _HostWords, purpose: int, start: int, length: int) -> list[list[float]]:
    """The uniforms of :func:`_host_uniforms` as Python floats, row by row (one uniform a
    row, the host paths' draw, without a tensor op)."""
    rows = words.rows
    if length == 1 and start % 2 == 0:  # one uniform a row: the even words
        even = _host_lanes(words, purpose, start, length)[0]
        if rows == 1:
            return [[even * _INV_2_53]]
        return [[v * _INV_2_53] for v in memoryview(even.to_bytes(8 * rows, "little")).cast("Q")]
    bits = _host_bits(words, purpose, start, length).tolist()
    return [[v * _INV_2_53 for v in row] for row in bits]


def _host_bits(words: _HostWords, purpose: int, start: int, length: int) -> Tensor:
    """``(rows, length)`` int64: the uniforms' 53-bit integers, from :func:`_host_lanes`
    (the tensor ops only put the lanes in row order)."""
    rows = words.rows
    even, odd, offset = _host_lanes(words, purpose, start, length)
    per_row = (offset + length + 1) // 2
    lanes = rows * per_row
    if lanes == 0:
        return torch.empty((rows, length), dtype=torch.int64, device=words.device)
    if per_row == 1 and length == 1 and offset == 0:  # one uniform a row: the even words
        return _lanes_tensor(even, lanes).view(rows, 1)
    both = torch.stack((_lanes_tensor(even, lanes), _lanes_tensor(odd, lanes)), -1)
    both = both.view(per_row, rows, 2).transpose(0, 1)
    return both.reshape(rows, 2 * per_row).narrow(1, offset, length)


def _host_lanes(words: _HostWords, purpose: int, start: int, length: int) -> tuple[int, int, int]:
    """``(even, odd, offset)``: the 53-bit integers of positions ``2 p`` and ``2 p + 1`` as
    Python-int lanes, and where ``start`` sits in the first block (``start - 2 first``).

    Every Philox block of every row is a 64-bit lane of one computation
    (:func:`~fastsample.ops.philox.philox4x32_host`), the lanes block after block: lane
    ``j * rows + b`` is row ``b``'s block ``first + j``, so a row's word reaches its blocks'
    lanes by repeating the rows' list."""
    rows = words.rows
    first, last = start // 2, (start + length - 1) // 2
    per_row = last - first + 1
    ones = lane_ones(rows * per_row)
    word = (_lanes(words.streams, per_row) & ones * (_STREAM_LIMIT - 1)) | ones * (purpose << 24)
    blocks = _lanes([first + j for j in range(per_row) for _ in range(rows)], 1)
    step, seed = _lanes(words.steps, per_row), _lanes(words.seeds, per_row)
    x0, x1, x2, x3 = philox4x32_host(
        blocks, word, step, step >> 32, seed, seed >> 32, lanes=rows * per_row
    )  # the garbage that >> 32 brings into a lane's high half is masked there
    # Position 2p takes (x0, x3), 2p + 1 (x2, x1): x << 21 | y >> 11, 53 bits a lane.
    low21 = ones * ((1 << 21) - 1)
    even = (x0 << 21) | ((x3 >> 11) & low21)
    odd = (x2 << 21) | ((x1 >> 11) & low21) if length > 1 or start % 2 else 0
    return even, odd, start - 2 * first


def _lanes_tensor(packed: int, lanes: int) -> Tensor:
    """The 64-bit lanes of ``packed`` as a CPU int64 tensor (each lane below ``2**63``)."""
    # bytearray: a writable buffer, so the tensor needs no copy (it keeps the buffer alive)
    return torch.frombuffer(bytearray(packed.to_bytes(8 * lanes, "little")), dtype=torch.int64)


class _LaneConstants(NamedTuple):
    """Per-device constants of the packed ``(..., 2)`` layout, named by their two lanes."""

    shifts_32_0: Tensor  # seed -> key words (k1, k0); step -> (step >> 32, step)
    mask_0_low: Tensor  # step -> counter words (c0 = 0, c2 = step mod 2**32)
    ones_1_0: Tensor  # keeps lane 0 / puts a block index in lane 0
    ones_0_1: Tensor  # puts the stream word in lane 1
    shift21: Tensor  # 0-d tensor operands: a Python int is wrapped into a new tensor per op
    shift11: Tensor


_LANE_CONSTANTS: dict[torch.device, _LaneConstants] = {}


def _lane_constants(device: torch.device) -> _LaneConstants:
    """Made once per device with arange/full (no host-to-device copy: capturable)."""
    cached = _LANE_CONSTANTS.get(device)
    if cached is None:
        with torch.inference_mode(False):  # ordinary tensors, usable in any mode
            lanes = torch.arange(2, device=device)
            cached = _LaneConstants(
                shifts_32_0=32 - 32 * lanes,
                mask_0_low=_MASK32 * lanes,
                ones_1_0=1 - lanes,
                ones_0_1=lanes,
                shift21=torch.full((), 21, dtype=torch.int64, device=device),
                shift11=torch.full((), 11, dtype=torch.int64, device=device),
            )
        _LANE_CONSTANTS[device] = cached
    return cached


def _column(word: Tensor | int, like: Tensor) -> Tensor:
    """A stream word as a ``(B, 1)`` column (a Python int is broadcast to ``like``)."""
    return word[:, None] if isinstance(word, Tensor) else torch.full_like(like, word)


def _small_op_mode() -> AbstractContextManager:
    """Inference mode for chains of tiny ops in eager mode: it skips the autograd and
    version-counter bookkeeping, ~20% of a 1 us op. Under ``torch.compile`` the ops fuse
    anyway, so nothing is entered there."""
    if torch.compiler.is_compiling():
        return nullcontext()
    return torch.inference_mode()


def make_source(
    generator: torch.Generator | None,
    seed: object,
    step: object,
    stream: object,
    batch: int,
    device: torch.device,
) -> GeneratorSource | CounterSource:
    """The uniform source for a sampler call: counter-based if ``seed`` is given."""
    if seed is None:
        if step is not None:
            raise ValueError("step was given without seed; pass seed=... as well")
        if stream is not None and not (isinstance(stream, int) and stream == 0):
            raise ValueError("stream was given without seed; pass seed=... as well")
        return GeneratorSource(generator, batch, device)
    if generator is not None:
        raise ValueError(
            "generator and seed are mutually exclusive: pass seed (and step) for per-request "
            "counter-based randomness, or generator for a torch.Generator stream"
        )
    seed, step, stream = check_counter_args(seed, step, stream, batch, device, keep_ints=True)
    return CounterSource(seed, step, stream, rows=(batch, device))


def stream_ok(source: object) -> Tensor | None:
    """:meth:`CounterSource.stream_ok` for any uniform source (None: every row is fine)."""
    return source.stream_ok() if isinstance(source, CounterSource) else None


def check_stream_values(source: object) -> None:
    """``check=True`` (syncs): raise naming the first row whose tensor ``stream`` is out of
    range; without it such rows are flagged invalid."""
    ok = stream_ok(source)
    if ok is not None and not bool(ok.all()):
        assert isinstance(source, CounterSource) and isinstance(source.stream, Tensor)
        row = int((~ok).to(torch.uint8).argmax())
        raise ValueError(f"stream[{row}] = {int(source.stream[row])} must be in [0, 2**24)")


def check_counter_args(
    seed: object,
    step: object,
    stream: object,
    batch: int,
    device: torch.device,
    *,
    int_stream: bool = False,
    keep_ints: bool = False,
) -> tuple[Tensor | int, Tensor | int, Tensor | int]:
    """Check ``seed``/``step``/``stream`` and broadcast them to ``(B,)`` int64 tensors.

    Python ints become tensors on ``device`` (with ``int_stream``, a Python int ``stream``
    is returned as it is: a constant costs no tensor op; with ``keep_ints``, so are ``seed``
    and ``step``, for a :class:`CounterSource` that builds them only when read); tensors
    must already be int64, ``(B,)`` (or 0-d) and on ``device``. Raises
    ``TypeError``/``ValueError`` naming the argument.
    """

    def as_rows(value: object, name: str, default: int | None, keep_int: bool = False) -> Any:
        if value is None:
            if default is None:
                raise ValueError(f"{name} is required")
            value = default
        if isinstance(value, bool):
            raise TypeError(f"{name} must be an int or an int64 tensor, got bool")
        if isinstance(value, int):
            if name == "stream" and not 0 <= value < _STREAM_LIMIT:
                raise ValueError(f"stream must be in [0, 2**24), got {value}")
            if not -(2**63) <= value < 2**63:
                raise ValueError(f"{name} must fit in int64, got {value}")
            if keep_int:
                return value
            return torch.full((batch,), value, dtype=torch.int64, device=device)
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be an int or an int64 tensor of shape ({batch},), "
                f"got {type(value).__name__}"
            )
        if value.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {value.dtype}; use {name}.long()")
        if value.device != device:
            raise ValueError(
                f"{name} is on {value.device} but the data is on {device}; move it with "
                f"{name}.to('{device}') once, outside the sampling loop"
            )
        if value.dim() == 0:
            return value.expand(batch)
        if tuple(value.shape) != (batch,):
            raise ValueError(
                f"{name} must have shape ({batch},) (one per row), got {tuple(value.shape)}"
            )
        return value

    return (
        as_rows(seed, "seed", None, keep_int=keep_ints),
        as_rows(step, "step", 0, keep_int=keep_ints),
        as_rows(stream, "stream", 0, keep_int=int_stream or keep_ints),
    )
