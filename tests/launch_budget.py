"""Device work per call, as the launch budgets count it: aten ops dispatched (views and empty
allocations not counted) plus the kernel launches recorded by :mod:`fastsample.kernels.launch`.

Lives in tests/ (on ``sys.path`` through ``pythonpath``) under a name unique in the tree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

# Allocations without a fill: no device work.
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class AtenOps(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher (custom operators run unobserved)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and not func.is_view and name not in FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def device_work(call: Callable[[], object]) -> tuple[int, Counter[str], int]:
    """``(total, aten ops by name, kernel launches)`` of one ``call()``."""
    from fastsample.kernels import launch

    before = launch.launches()
    with AtenOps() as mode:
        call()
    launches = launch.launches() - before
    return sum(mode.ops.values()) + launches, mode.ops, launches
