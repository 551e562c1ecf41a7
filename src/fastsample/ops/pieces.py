"""Cache-sized row pieces for CPU passes that need a scratch as large as their input.

On CPU a batch-sized temporary (32 MB for ``(64, 128256)`` float32) is a fresh block from
the OS on every call (glibc maps blocks that large directly), and its page faults cost as much
as the arithmetic; it also falls out of cache between the ops that use it. Such passes run a
few rows at a time into one reused scratch instead: each row's results are the same whatever
rows share its piece. Off CPU, where every op is a kernel launch, the whole batch is one piece.
"""

from __future__ import annotations

import torch


def piece_rows(batch: int, row_elements: int, device: torch.device, budget: int) -> int:
    """Rows per piece: the whole batch off CPU; on CPU as many rows as keep a piece near
    ``budget`` elements (at least one)."""
    if device.type != "cpu":
        return max(batch, 1)
    return max(1, budget // max(row_elements, 1))


def row_pieces(batch: int, row_elements: int, device: torch.device, budget: int) -> list[slice]:
    """The static row ranges of :func:`piece_rows` covering ``range(batch)``."""
    rows = piece_rows(batch, row_elements, device, budget)
    return [slice(start, min(start + rows, batch)) for start in range(0, batch, rows)]
