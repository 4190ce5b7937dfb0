"""The backend contract suite, public: run it against your own backend with a few lines.

Every backend agenticstate ships passes this suite, through this same entry; a backend that
passes it works under `StateManager` and every manager. In a test module of your project:

```python
import pytest_asyncio

from agenticstate.testing import BackendContract
from my_package import DictBackend


class TestDictBackend(BackendContract):
    @pytest_asyncio.fixture
    async def backend(self):
        async with DictBackend() as backend:  # a fresh, empty, open backend per test
            yield backend
```

pytest then collects every contract test (storage, expiry, events, scan, index, transactions, the
change feed, history, revisions, and `StateManager` over the backend) as methods of
`TestDictBackend`. The suite needs `pytest` and `pytest-asyncio` (the `testing` extra installs
both); it works in pytest-asyncio's `auto` and `strict` modes. Each test gets its own `backend`; a
backend over a shared server should give each test its own namespace (as
`RedisBackend(key_prefix=...)` does in our own run).

The parts are importable on their own (`StorageContract`, `ExpiryContract`, `EventsContract`,
`ScanContract`, `IndexContract`, `TransactContract`, `FeedContract`, `HistoryContract`,
`RevisionContract`, `ManagerContract`) for a backend that is built up in steps. A backend
without transactions, a change feed (`feed is None`), history or revisions (`has_revisions`
false) skips those parts. The feed's retention tests also take
a `feed_backend` fixture (see `FeedContract`), and skip without one. `BackendContract` is all
of them, and what "passes the contract" means.

See the docs page "Writing a backend".
"""

from __future__ import annotations

from agenticstate.exceptions import MissingDependencyError

try:
    import pytest
    import pytest_asyncio  # noqa: F401 (fail here, not at the first async fixture)
except ImportError as exc:
    raise MissingDependencyError(exc.name or "pytest", "testing") from exc

# pytest rewrites the asserts of test modules only; these are library modules, so ask for it (by
# their full names: this package is already importing, and naming it would warn). A failing
# contract test then shows the values it compared, as the author's own tests do.
pytest.register_assert_rewrite(
    *(
        f"agenticstate.testing._{part}"
        for part in (
            "events",
            "expiry",
            "feed",
            "history",
            "index",
            "manager",
            "revision",
            "scan",
            "storage",
            "txn",
        )
    )
)

# After the registration above, or the asserts stay plain.
from agenticstate.testing._events import EventsContract  # noqa: E402
from agenticstate.testing._expiry import ExpiryContract  # noqa: E402
from agenticstate.testing._feed import FeedContract  # noqa: E402
from agenticstate.testing._history import HistoryContract  # noqa: E402
from agenticstate.testing._index import IndexContract  # noqa: E402
from agenticstate.testing._manager import ManagerContract  # noqa: E402
from agenticstate.testing._revision import RevisionContract  # noqa: E402
from agenticstate.testing._scan import ScanContract  # noqa: E402
from agenticstate.testing._storage import StorageContract  # noqa: E402
from agenticstate.testing._txn import TransactContract  # noqa: E402

__all__ = [
    "BackendContract",
    "EventsContract",
    "ExpiryContract",
    "FeedContract",
    "HistoryContract",
    "IndexContract",
    "ManagerContract",
    "RevisionContract",
    "ScanContract",
    "StorageContract",
    "TransactContract",
]


@pytest.mark.asyncio
class BackendContract(
    StorageContract,
    ExpiryContract,
    EventsContract,
    ScanContract,
    IndexContract,
    TransactContract,
    FeedContract,
    HistoryContract,
    RevisionContract,
    ManagerContract,
):
    """The whole backend contract. Subclass it (name the subclass `Test...`) and give it a
    `backend` fixture that yields a fresh, empty, open backend; see the module docstring."""
