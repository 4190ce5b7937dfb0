"""Backends: where state lives, behind one contract (`Backend`).

Construct one directly, or by URL with `open_backend`:

```python
open_backend("memory://")
open_backend("file:///var/lib/app/state")          # FileBackend(base_path=...)
open_backend("redis://localhost:6379/0")           # RedisBackend(url=...)
```

Schemes map to factories registered with `register_backend`; third-party backends register their
own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from agenticstate.backends._shared import SharedFileBackend
from agenticstate.backends.base import Backend, Change, ChangeOp, Entry
from agenticstate.backends.file import FileBackend
from agenticstate.backends.memory import MemoryBackend
from agenticstate.backends.redis import RedisBackend
from agenticstate.config import redact_url
from agenticstate.exceptions import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Callable

    from agenticstate.config import StateConfig

__all__ = [
    "Backend",
    "Change",
    "ChangeOp",
    "Entry",
    "FileBackend",
    "MemoryBackend",
    "RedisBackend",
    "open_backend",
    "open_config_backend",
    "register_backend",
]


_factories: dict[str, Callable[..., Backend]] = {
    "memory": MemoryBackend.from_url,
    "file": SharedFileBackend.from_url,  # one open store per path in this process
    "redis": RedisBackend.from_url,
    "rediss": RedisBackend.from_url,
    "unix": RedisBackend.from_url,
    "redis+cluster": RedisBackend.from_url,
    "rediss+cluster": RedisBackend.from_url,
}


def register_backend(scheme: str, factory: Callable[..., Backend]) -> None:
    """Make `open_backend` call `factory(url, **options)` for URLs with `scheme`."""
    _factories[scheme.lower()] = factory


def open_backend(url: str, **options: Any) -> Backend:
    """Build a backend from a URL: `memory://`, `file://PATH`, `redis://...`, `rediss://...`.

    No connection is made and no file is touched until the backend is first used.

    Raises:
        ConfigurationError: The URL is malformed or its scheme is unknown.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(f"backend URL must look like scheme://..., not {url!r}")
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as exc:
        raise ConfigurationError(f"malformed backend URL {redact_url(url)!r}: {exc}") from None
    factory = _factories.get(scheme)
    if factory is None:
        known = ", ".join(sorted(f"{name}://" for name in _factories))
        raise ConfigurationError(f"unknown backend scheme {scheme!r}; known: {known}")
    return factory(url, **options)


def open_config_backend(config: StateConfig) -> Backend:
    """Build the backend a `StateConfig` describes."""
    if config.backend == "memory":
        return MemoryBackend(key_prefix=config.key_prefix)
    if config.backend == "file":
        path = Path(config.file_path) if config.file_path is not None else Path("state/state.json")
        return SharedFileBackend(  # one open store per path in this process
            base_path=path.parent,
            file_name=path.name,
            format=config.format or "json",
            compression=config.compression,
            key_prefix=config.key_prefix,
            auto_save=config.auto_save,
            save_interval=config.save_interval,
        )
    if config.backend == "redis":
        return RedisBackend(
            url=config.redis_url or "redis://localhost:6379",
            db=config.db if config.db else None,
            key_prefix=config.key_prefix,
            connection_pool_size=config.connection_pool_size,
        )
    raise ConfigurationError(f"the {config.backend!r} backend is not available in this build")
