"""Backends: where state lives, behind one contract (`Backend`).

Construct one directly, or by URL with `open_backend`:

```python
open_backend("memory://")
open_backend("file:///var/lib/app/state")          # FileBackend(base_path=...)
open_backend("sqlite:///var/lib/app/state.db")     # SQLiteBackend(path=...)
open_backend("redis://localhost:6379/0")           # RedisBackend(url=...)
open_backend("postgresql://app@db.internal/app")   # PostgresBackend(url=...)
```

Schemes map to factories in one registry (`agenticstate._registry`), which `StateConfig.backend`,
the managers' `persistence=` and the CLI's `--url` read too; third-party backends add theirs with
`register_backend`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from agenticstate._glob import glob_match
from agenticstate._keys import validate_key, validate_pattern
from agenticstate._registry import (
    add_backend,
    config_factory,
    takes_create,
    url_factory,
    url_schemes,
)
from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends._shared import SharedFileBackend
from agenticstate.backends._urls import check_url
from agenticstate.backends.base import (
    EARLIEST,
    Backend,
    Change,
    ChangeOp,
    Delete,
    Entry,
    EntryStat,
    Exists,
    FeedRetention,
    Get,
    HistoryRules,
    IndexAdd,
    IndexIncr,
    IndexRange,
    IndexRemove,
    Put,
    Revision,
    TxnCompare,
    TxnOp,
    TxnResult,
    Version,
)
from agenticstate.backends.file import FileBackend, FileRepairReport
from agenticstate.backends.memory import MemoryBackend
from agenticstate.backends.postgres import PostgresBackend
from agenticstate.backends.redis import RedisBackend
from agenticstate.backends.sqlite import SQLiteBackend
from agenticstate.config import hide_url_secrets, redact_url
from agenticstate.exceptions import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Callable

    from agenticstate.config import StateConfig

__all__ = [
    "EARLIEST",
    "Backend",
    "Change",
    "ChangeFanout",
    "ChangeOp",
    "ChangeStream",
    "Delete",
    "Entry",
    "EntryStat",
    "Exists",
    "FeedRetention",
    "FileBackend",
    "FileRepairReport",
    "Get",
    "HistoryRules",
    "IndexAdd",
    "IndexIncr",
    "IndexRange",
    "IndexRemove",
    "MemoryBackend",
    "PostgresBackend",
    "Put",
    "RedisBackend",
    "Revision",
    "SQLiteBackend",
    "TxnCompare",
    "TxnOp",
    "TxnResult",
    "Version",
    "glob_match",
    "open_backend",
    "open_config_backend",
    "register_backend",
    "validate_key",
    "validate_pattern",
]


def register_backend(
    scheme: str,
    factory: Callable[..., Backend],
    *,
    from_config: Callable[[StateConfig], Backend] | None = None,
) -> None:
    """Register a backend under a URL scheme, which is also its backend name.

    `open_backend("scheme://...")` and the CLI's `--url` then call `factory(url, **options)`;
    `StateConfig(backend="scheme")` and the managers' `persistence="scheme"` call
    `from_config(config)`, by default `factory("scheme://", key_prefix=config.key_prefix)`.
    """
    add_backend(scheme, factory, from_config)


def open_backend(url: str, *, create: bool = True, **options: Any) -> Backend:
    """Build a backend from a URL: `memory://`, `file://PATH`, `sqlite://FILE`, `redis://...`.

    `postgresql://...` (or `postgres://`) opens a `PostgresBackend`.

    No connection is made and no file is touched until the backend is first used.

    Args:
        url: The store's URL.
        create: With `False`, a store that does not exist is not created when the backend
            opens: opening it raises `NotFoundError` (file and SQLite stores; a backend whose
            factory takes no `create` option has nothing to create, as memory and Redis).
        **options: Passed to the backend's factory (`key_prefix`, `feed`, ...).

    Raises:
        ConfigurationError: The URL is malformed, its scheme is unknown, or it has a part that
            would be ignored: a fragment (`#...`) or a query item without `=` (a `#` or `?` in a
            path or password is written `%23`, `%3F`), or a parameter given twice.
    """
    if not isinstance(url, str) or "://" not in url:
        shown = redact_url(url) if isinstance(url, str) else type(url).__name__
        raise ConfigurationError(f"backend URL must look like scheme://..., not {shown!r}")
    check_url(url)  # nothing dropped: two different URLs never share a store by accident
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as exc:
        raise ConfigurationError(
            f"malformed backend URL {redact_url(url)!r}: {hide_url_secrets(str(exc), url)}"
        ) from None
    _check_local_path(url, scheme)
    factory = url_factory(scheme)
    if factory is None:
        known = ", ".join(f"{name}://" for name in url_schemes())
        raise ConfigurationError(f"unknown backend scheme {scheme!r}; known: {known}")
    if not create and takes_create(factory):
        options["create"] = False
    return factory(url, **options)


def _check_local_path(url: str, scheme: str) -> None:
    """Refuse the file and SQLite paths that would not open what they seem to name.

    `~` is a shell's, expanded only at the start of a word: in `sqlite://~/x.db` it would make
    a folder named `~` here, so it is refused with the path written out. `:memory:` is
    SQLite's in-memory database, which would be gone when the command ends: `memory://` is
    the store for that.
    """
    if scheme not in ("sqlite", "file"):
        return
    path = url.partition("://")[2].partition("?")[0]
    if path == "~" or path.startswith("~/"):
        home = os.path.expanduser("~")
        raise ConfigurationError(
            f"a {scheme}:// path is not expanded as a shell would expand '~': write it in full, "
            f"{scheme}://{home}{path[1:]}"
        )
    if scheme == "sqlite" and path == ":memory:":
        raise ConfigurationError(
            "sqlite://:memory: would be an SQLite database gone with this process: for a "
            "store in memory use memory://, for one that lasts sqlite://FILE"
        )


def open_config_backend(config: StateConfig) -> Backend:
    """Build the backend a `StateConfig` describes (by its registered name)."""
    return config_factory(config.backend)(config)


def _memory_from_config(config: StateConfig) -> Backend:
    return MemoryBackend(key_prefix=config.key_prefix, feed=config.feed)


def _file_from_config(config: StateConfig) -> Backend:
    path = Path(config.file_path) if config.file_path is not None else Path("state/state.json")
    return SharedFileBackend(  # one open store per path in this process
        base_path=path.parent,
        file_name=path.name,
        format=config.format or "json",
        compression=config.compression,
        key_prefix=config.key_prefix,
        auto_save=config.auto_save,
        save_interval=config.save_interval,
        feed=config.feed,
    )


def _sqlite_from_config(config: StateConfig) -> Backend:
    path = config.sqlite_path if config.sqlite_path is not None else Path("state/state.db")
    return SQLiteBackend(path=path, key_prefix=config.key_prefix, feed=config.feed)


def _postgres_from_config(config: StateConfig) -> Backend:
    # No URL: libpq's defaults and environment (PGHOST, PGUSER, PGPASSWORD, ...), as psql.
    return PostgresBackend.from_url(
        config.postgres_url or "postgresql://", key_prefix=config.key_prefix, feed=config.feed
    )


def _redis_from_config(config: StateConfig) -> Backend:
    return RedisBackend(
        url=config.redis_url or "redis://localhost:6379",
        db=config.db if config.db else None,
        key_prefix=config.key_prefix,
        connection_pool_size=config.connection_pool_size,
        feed=config.feed,
    )
