"""The one registry of backend names and URL schemes.

Everything that picks a backend by name reads it: `StateConfig.backend`, the managers'
`persistence=` shorthand, `open_backend(url)` and the CLI's `--url`. A backend registers once, with
`agenticstate.backends.register_backend`, and is then known to all four.

- A **URL scheme** maps to a factory called as `factory(url, **options)` (`open_backend`).
- A **backend name** (`StateConfig(backend=...)`, `persistence=...`) maps to a factory called as
  `factory(config)` with the `StateConfig`. Every registered scheme is also a name unless it is an
  alias of another backend (`rediss`, `unix` and `redis+cluster` are spellings of `redis`).

The built-in backends are registered here by import path and imported on first use, so this
module imports no backend and `config.py` can read it without an import cycle.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

from agenticstate.exceptions import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Callable

    from agenticstate.backends.base import Backend
    from agenticstate.config import StateConfig

__all__ = [
    "add_backend",
    "backend_names",
    "check_backend_name",
    "config_factory",
    "remove_backend",
    "takes_create",
    "url_factory",
    "url_schemes",
]

# "module:attribute.path" strings are resolved (and cached) on first use.
_schemes: dict[str, Callable[..., Backend] | str] = {}
_names: dict[str, Callable[[StateConfig], Backend] | str] = {}

_BUILTIN_URLS = {
    "memory": "agenticstate.backends.memory:MemoryBackend.from_url",
    "file": "agenticstate.backends._shared:SharedFileBackend.from_url",  # one store per path
    "sqlite": "agenticstate.backends.sqlite:SQLiteBackend.from_url",
    "redis": "agenticstate.backends.redis:RedisBackend.from_url",
    "postgres": "agenticstate.backends.postgres:PostgresBackend.from_url",
}
_BUILTIN_ALIASES = {
    "rediss": "redis",
    "unix": "redis",
    "redis+cluster": "redis",
    "rediss+cluster": "redis",
    "postgresql": "postgres",
}


def _resolve(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


def add_backend(
    scheme: str,
    url: Callable[..., Backend] | str,
    config: Callable[[StateConfig], Backend] | str | None = None,
    *,
    is_name: bool = True,
) -> None:
    """Register `url` for the URL scheme `scheme` and, unless an alias, `config` for the name.

    Without a `config` factory, `StateConfig(backend=scheme)` calls the URL factory with
    `scheme://` and the config's `key_prefix`.
    """
    if not isinstance(scheme, str) or not scheme or "://" in scheme:
        raise ConfigurationError(f"a backend scheme must be a non-empty name, not {scheme!r}")
    scheme = scheme.lower()
    _schemes[scheme] = url
    if is_name:
        _names[scheme] = config if config is not None else _from_url_factory(scheme)


def remove_backend(scheme: str) -> None:
    """Forget a scheme and the name it added (tests register backends and clean up)."""
    _schemes.pop(scheme.lower(), None)
    _names.pop(scheme.lower(), None)


def _from_url_factory(scheme: str) -> Callable[[StateConfig], Backend]:
    def build(config: StateConfig) -> Backend:
        factory = url_factory(scheme)
        assert factory is not None  # noqa: S101  # registered together
        return factory(f"{scheme}://", key_prefix=config.key_prefix)

    return build


def url_schemes() -> list[str]:
    """Every registered URL scheme, sorted."""
    return sorted(_schemes)


def backend_names() -> list[str]:
    """Every registered backend name, sorted."""
    return sorted(_names)


def url_factory(scheme: str) -> Callable[..., Backend] | None:
    """The factory for URLs with `scheme`, or `None` if none is registered."""
    found = _schemes.get(scheme.lower())
    if isinstance(found, str):
        found = _schemes[scheme.lower()] = _resolve(found)
    return found


def takes_create(factory: Callable[..., Backend]) -> bool:
    """Whether a URL factory takes `create=False` (its stores are created on open, if missing).

    That is, whether the factory, or the class whose `from_url` it is, has a `create`
    parameter: the file and SQLite backends do; memory (always new) and Redis (a server holds
    no store to create) do not, and `open_backend(url, create=False)` then has nothing to pass.
    """
    owner = getattr(factory, "__self__", None)
    candidates: list[Any] = [factory]
    if isinstance(owner, type):  # a classmethod: its class's __init__, and its bases'
        candidates += [
            cls.__dict__["__init__"] for cls in owner.__mro__ if "__init__" in cls.__dict__
        ]
    for candidate in candidates:
        try:
            parameters = inspect.signature(candidate).parameters
        except (TypeError, ValueError):
            continue
        if "create" in parameters:
            return True
    return False


def config_factory(name: str) -> Callable[[StateConfig], Backend]:
    """The factory that builds the backend named `name` from a `StateConfig`.

    Raises:
        ConfigurationError: No backend has that name.
    """
    found = _names.get(check_backend_name(name))
    assert found is not None  # noqa: S101  # checked above
    if isinstance(found, str):
        found = _names[name] = _resolve(found)
    return found


def check_backend_name(name: object) -> str:
    """Return `name` if a backend is registered under it.

    Raises:
        ConfigurationError: It is not a str, or no backend has that name; the message lists
            the known names.
    """
    if isinstance(name, str) and name in _names:
        return name
    known = ", ".join(repr(known) for known in backend_names())
    raise ConfigurationError(f"unknown backend {name!r}; known: {known}")


for _scheme, _target in _BUILTIN_URLS.items():
    add_backend(_scheme, _target, f"agenticstate.backends:_{_scheme}_from_config")
for _alias, _of in _BUILTIN_ALIASES.items():
    add_backend(_alias, _BUILTIN_URLS[_of], is_name=False)
