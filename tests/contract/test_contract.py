"""Our backends through the public contract suite, the same entry a third-party backend uses.

The tests live in `agenticstate.testing`; `backend` here is the fixture from `tests/conftest.py`,
parametrized over every backend agenticstate ships (memory, file, sqlite, redis, redis-cluster).
"""

from __future__ import annotations

from agenticstate.testing import BackendContract


class TestContract(BackendContract):
    """Every contract test on every backend of ours (the `backend` fixture is conftest's)."""
