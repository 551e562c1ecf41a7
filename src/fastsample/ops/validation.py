"""Argument checks that run before any work, and the opt-in value check.

Two kinds of bad input, two policies (see README, "Bad input"):

* Wrong arguments (type, rank, dtype, device, ranges of Python arguments) are the
  caller's bug: they raise ``TypeError``/``ValueError`` here, before any kernel runs,
  and the message names the argument, what was expected and what was given.
* Bad *values* inside a tensor (NaN, inf, negative weights, an all-zero row) are data:
  the samplers flag them per row in ``valid`` without syncing the host. Only when the
  caller asks for ``check=True`` does :func:`check_probs_values` read them on the host
  and raise, naming the first bad row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
METHODS = ("auto", "race", "inverse_cdf")

Control = float | int | Tensor | None

# float32 sums (the block sums of every input but float64) overflow at 2**128.
F32_OVERFLOW = 2.0**128


def detached(tensor: Tensor) -> Tensor:
    """``tensor`` without autograd history: sampling is not differentiable, and the samplers'
    in-place and ``out=`` ops refuse inputs that require grad (logits straight from a model
    outside ``torch.no_grad()``). Tensors that do not require grad are returned as they are,
    so the usual call pays nothing."""
    return tensor.detach() if tensor.requires_grad else tensor


def total_fits(total: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows whose float64 ``total`` of probabilities of ``dtype`` fits the accumulation dtype
    (float32 for all but float64): the one overflow rule of every sampler over probabilities."""
    return total < (math.inf if dtype == torch.float64 else F32_OVERFLOW)


def plain_total_fits(probs: Tensor) -> Tensor:
    """:func:`total_fits` of the plain row totals of ``probs`` (one read pass)."""
    from .inverse_cdf import row_summaries  # validation is imported by inverse_cdf's users

    return total_fits(row_summaries(probs)[0].sum(-1), probs.dtype)


def check_probs_tensor(probs: object, name: str = "probs") -> Tensor:
    """Raise unless ``probs`` is a floating ``(B, V)`` tensor with ``V >= 1``."""
    if not isinstance(probs, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of shape (batch, vocab), got {type(probs).__name__}"
        )
    if probs.dim() != 2:
        raise ValueError(
            f"{name} must have shape (batch, vocab), got {probs.dim()} dimensions "
            f"{tuple(probs.shape)}; use {name}.view(-1, {name}.shape[-1]) to flatten "
            "leading dimensions, or [None] to add a batch dimension"
        )
    if probs.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64, got {probs.dtype}; "
            f"convert with {name}.float()"
        )
    if probs.shape[1] < 1:
        raise ValueError(
            f"{name} must have at least one vocabulary entry, got shape {tuple(probs.shape)}"
        )
    return probs


def check_num_samples(num_samples: object, vocab: int) -> int:
    """Raise unless ``1 <= num_samples <= vocab`` (draws are without replacement)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int):
        raise TypeError(f"num_samples must be a Python int, got {type(num_samples).__name__}")
    if not 1 <= num_samples <= vocab:
        raise ValueError(
            f"num_samples must be between 1 and the vocabulary size {vocab} (draws are "
            f"without replacement), got {num_samples}"
        )
    return num_samples


def check_generator(generator: object, device: torch.device) -> None:
    """Raise unless ``generator`` is None or a ``torch.Generator`` on ``device``'s type."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    if generator.device.type != device.type:
        raise ValueError(
            f"generator is on {generator.device.type} but probs is on {device.type}; "
            f"create it with torch.Generator(device='{device.type}')"
        )


def check_method(method: object) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    return method  # type: ignore[return-value]


def check_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return value


def check_probs_values(probs: Tensor, name: str = "probs") -> None:
    """Host-side value check for ``check=True``: raise naming the first bad row.

    This reads per-row flags back to the host, so it syncs; it is never on the default path.
    """
    if probs.shape[0] == 0:
        return
    has_nan = torch.isnan(probs).any(-1)
    has_inf = torch.isinf(probs).any(-1)
    has_negative = (probs < 0).any(-1)
    total = probs.sum(-1, dtype=torch.float64)
    no_mass = ~(total > 0)
    reasons = (
        (has_nan, "contains NaN"),
        (has_inf, "contains +-inf"),
        (has_negative, "contains negative weights"),
        (no_mass, "has zero total weight (no token can be drawn)"),
        # Finite entries whose sum overflows the float32 block sums (any finite sum is fine
        # for float64): the samplers flag those rows too.
        (~has_nan & ~has_inf & ~total_fits(total, probs.dtype), "has a total of 2**128 or more"),
    )
    bad = torch.stack([flag for flag, _ in reasons], dim=1).cpu()
    bad_rows = bad.any(1)
    if bool(bad_rows.any()):
        row = int(bad_rows.to(torch.uint8).argmax())
        why = [text for (_, text), flag in zip(reasons, bad[row].tolist(), strict=True) if flag]
        count = int(bad_rows.sum())
        raise ValueError(
            f"{name} row {row} {' and '.join(why)} ({count} bad row(s) in all); weights must "
            "be finite and non-negative with a positive sum below 2**128 (float32 sums; any "
            "finite sum for float64 input). Without check=True such rows "
            "are reported as valid=False instead of raising."
        )


def check_source_values(logits: Tensor | None, probs: Tensor | None) -> None:
    """Opt-in (``check=True``, syncs): raise ``ValueError`` naming the first bad row.

    Logits: NaN or ``+inf`` anywhere, or every entry ``-inf``. Probabilities: as
    :func:`check_probs_values`.
    """
    if probs is not None:
        check_probs_values(probs)
        return
    assert logits is not None
    bad = logits.isnan().any(-1) | (logits == torch.inf).any(-1) | (logits == -torch.inf).all(-1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        values = logits[row]
        if bool(values.isnan().any()):
            why = "contains NaN"
        elif bool((values == torch.inf).any()):
            why = "contains +inf"
        else:
            why = "is all -inf (every token masked)"
        raise ValueError(f"logits row {row} {why}")


def check_control_values(controls: object) -> None:
    """Opt-in (``check=True``, syncs): raise naming the first out-of-range tensor control."""
    rules = {
        "temperature": (lambda t: (t >= 0) & (t < torch.inf), "must be >= 0 and finite"),
        "top_k": (lambda k: k >= 0, "must be >= 0"),
        "top_p": (lambda p: (p > 0) & (p <= 1), "must be in (0, 1]"),
        "min_p": (lambda m: (m >= 0) & (m <= 1), "must be in [0, 1]"),
    }
    for name, (ok, rule) in rules.items():
        value = getattr(controls, name)
        if isinstance(value, Tensor):
            bad = ~ok(value)
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise ValueError(f"{name}[{row}] = {value[row].item()} {rule}")


# ---------------------------------------------------------------------------- controls


CUT_ORDERS = ("transformers", "vllm", "joint")
"""Which tokens top-p's mass is taken over (see :func:`fastsample.sample`): ``"transformers"``
judges top-p on the top-k survivors and min-p after both (Hugging Face's warpers); ``"vllm"``
applies min-p first, so top-p's mass is that of the tokens surviving min-p and top-k (vLLM's
``MinPLogitsProcessor`` before ``apply_top_k_top_p``); ``"joint"`` takes top-p on the whole
tempered row, like top-k, and intersects the kept sets, min-p after both (SGLang's sampler and
FlashInfer's ``filter_apply_order="joint"``)."""


@dataclass(frozen=True)
class Controls:
    """Checked per-row controls: None (stage off), a Python number, or a ``(B,)`` tensor."""

    temperature: float | Tensor | None = None
    top_k: int | Tensor | None = None
    top_p: float | Tensor | None = None
    min_p: float | Tensor | None = None
    cut_order: str = "transformers"

    @property
    def min_p_first(self) -> bool:
        """Top-p's mass counts only the tokens that min-p keeps (the ``"vllm"`` order); the
        order changes nothing unless both top-p and min-p are on."""
        return self.cut_order == "vllm" and self.min_p is not None and self.top_p is not None

    @property
    def top_p_on_whole_row(self) -> bool:
        """Top-p's mass is the whole row's, not the top-k survivors' (the ``"joint"`` order);
        the order changes nothing unless both top-k and top-p are on."""
        return self.cut_order == "joint" and self.top_k is not None and self.top_p is not None

    @property
    def all_greedy(self) -> bool:
        """Every row is greedy (a Python ``temperature=0``): nothing to sample."""
        return isinstance(self.temperature, float) and self.temperature == 0.0

    @property
    def filters(self) -> bool:
        """At least one of top-k, top-p, min-p is on (or may be, for tensors)."""
        return any(c is not None for c in (self.top_k, self.top_p, self.min_p))


def _check_tensor(value: Tensor, name: str, batch: int, device: torch.device, kind: str) -> Tensor:
    integral = not value.dtype.is_floating_point and value.dtype != torch.bool
    if kind == "int" and not integral:
        raise TypeError(f"{name} must be an integer tensor (int32/int64), got {value.dtype}")
    if kind == "float" and not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {value.dtype}; use {name}.float()")
    if value.device != device:
        raise ValueError(
            f"{name} is on {value.device} but the data is on {device}; move it with "
            f"{name}.to('{device}') once, outside the sampling loop"
        )
    value = detached(value)  # a learned temperature, say: its values only
    if value.dim() == 0:
        return value.expand(batch)
    if tuple(value.shape) != (batch,):
        raise ValueError(
            f"{name} must be a Python number or a tensor of shape ({batch},) (one per row), "
            f"got shape {tuple(value.shape)}"
        )
    return value


def _check_number(value: object, name: str, kind: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{name} must be None, a Python {'int' if kind == 'int' else 'float'} or a tensor "
            f"of shape (batch,), got {type(value).__name__}"
        )
    if kind == "int" and not isinstance(value, int):
        raise TypeError(f"{name} must be an int (0 switches it off), got {value!r}")
    if value != value or value in (math.inf, -math.inf):  # math.isfinite breaks dynamo
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_cut_order(cut_order: object) -> str:
    if cut_order not in CUT_ORDERS:
        raise ValueError(
            f"cut_order must be one of {', '.join(map(repr, CUT_ORDERS))}, got {cut_order!r}"
        )
    return cut_order  # type: ignore[return-value]


def check_controls(
    temperature: object,
    top_k: object,
    top_p: object,
    min_p: object,
    batch: int,
    vocab: int,
    device: torch.device,
    cut_order: object = "transformers",
) -> Controls:
    """Check the four controls and their order before any work; Python off-values become None.

    Raises ``TypeError``/``ValueError`` naming the control, its range and its off-value.
    """
    check_cut_order(cut_order)
    found: dict[str, float | int | Tensor | None] = {}
    specs = (
        ("temperature", temperature, "float", "temperature must be >= 0 (0 = greedy, 1 = off)"),
        ("top_k", top_k, "int", "top_k must be >= 0 (0 or >= vocabulary size = off)"),
        ("top_p", top_p, "float", "top_p must be in (0, 1] (1 = off)"),
        ("min_p", min_p, "float", "min_p must be in [0, 1] (0 = off)"),
    )
    for name, value, kind, rule in specs:
        if value is None:
            found[name] = None
        elif isinstance(value, Tensor):
            found[name] = _check_tensor(value, name, batch, device, kind)
        else:
            number = _check_number(value, name, kind)
            ok = {
                "temperature": number >= 0,
                "top_k": number >= 0,
                "top_p": 0 < number <= 1,
                "min_p": 0 <= number <= 1,
            }[name]
            if not ok:
                raise ValueError(f"{rule}, got {number!r}")
            off = {
                "temperature": number == 1,
                "top_k": number == 0 or number >= vocab,
                "top_p": number == 1,
                "min_p": number == 0,
            }[name]
            found[name] = None if off else (float(number) if kind == "float" else int(number))
    return Controls(**found, cut_order=cut_order)  # type: ignore[arg-type]


def check_source(logits: object, probs: object) -> Tensor:
    """Exactly one of ``logits``/``probs``, a floating ``(B, V)`` tensor; returns it."""
    if (logits is None) == (probs is None):
        raise ValueError(
            "pass exactly one of logits= or probs= (got "
            + ("neither" if logits is None else "both")
            + ")"
        )
    name = "logits" if logits is not None else "probs"
    return check_probs_tensor(logits if logits is not None else probs, name)
