"""Run the whole backend contract suite against DictBackend: `pytest dict_backend_test.py`.

Install: `pip install ".[testing]"` (from a checkout; see the README).
"""

import pytest_asyncio
from dict_backend import DictBackend

from agenticstate.testing import BackendContract


class TestDictBackend(BackendContract):
    @pytest_asyncio.fixture
    async def backend(self):
        async with DictBackend() as backend:  # a fresh, empty, open backend for each test
            yield backend
