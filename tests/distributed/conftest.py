"""The process-group fixture shared by the test modules of tests/distributed/."""

from __future__ import annotations

import pytest

from distributed_helpers import WORLDS, run_group


# Session scope: one run of every scenario per world size, shared by every module here.
@pytest.fixture(scope="session", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def group(request):
    """``(world, results)``: results[rank][scenario] from one run of every scenario."""
    return request.param, run_group(request.param)
