"""What every manager shares: a StateManager, the `persistence=` shorthand, key helpers."""

from __future__ import annotations

import inspect
import os
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar

from pydantic import BaseModel

from agenticstate._keys import escape_glob
from agenticstate._log import get_logger
from agenticstate._registry import backend_names, check_backend_name
from agenticstate.config import StateConfig
from agenticstate.exceptions import ConfigurationError, InvalidArgumentError
from agenticstate.manager import StateManager

if TYPE_CHECKING:
    from types import TracebackType

    from agenticstate.manager import StateEntry

__all__ = [
    "DEFAULT_REDIS_URL",
    "Persistence",
    "StateManagerBase",
    "TaggedKeys",
    "conditional",
    "jitter",
    "sort_time",
    "utcnow",
]

M = TypeVar("M", bound=BaseModel)

Persistence = Literal["memory", "file", "sqlite", "redis"] | str
"""A registered backend name: the built-in ones, or one added with `register_backend`."""

DEFAULT_REDIS_URL = "redis://localhost:6379"
"""The Redis URL `persistence="redis"` uses when none is given (or `AGENTICSTATE_REDIS_URL`)."""


def utcnow() -> datetime:
    """Return the current time as an aware UTC datetime (the default for generated timestamps)."""
    return datetime.now(UTC)


def jitter(attempt: int) -> float:
    """A full-jitter backoff delay in seconds before retry `attempt` of a compare-and-set."""
    return random.uniform(0, min(0.05, 0.001 * 2**attempt))  # noqa: S311  # jitter, not crypto


def conditional(state: StateManager, entry: StateEntry | None) -> dict[str, int]:
    """The condition of a compare-and-set on what `entry` read (`None`: missing).

    The entry's revision where the backend keeps revisions (a key deleted and written again
    meanwhile is refused, whatever its version), else its version.
    """
    if state.backend.has_revisions:
        return {"expected_revision": 0 if entry is None else entry.revision}
    return {"expected_version": 0 if entry is None else entry.version}


def sort_time(value: datetime) -> float:
    """Return a sortable instant for naive (local time) and aware datetimes alike.

    Records keep the tz-awareness they were given, so one list may hold both; comparing them
    directly raises `TypeError`, their POSIX timestamps never do.
    """
    return value.timestamp()


def build_state_manager(
    *,
    state_manager: StateManager | None,
    persistence: Persistence | None,
    redis_url: str | None,
    base_path: str | Path | None,
    key_prefix: str,
) -> StateManager:
    """Return `state_manager`, or one built from the AgenticAI Framework shorthand arguments."""
    if state_manager is not None:
        if persistence is not None or redis_url is not None or base_path is not None:
            raise ConfigurationError(
                "pass either state_manager= or persistence=/redis_url=/base_path=, not both"
            )
        if not isinstance(state_manager, StateManager):
            raise ConfigurationError(
                f"state_manager must be a StateManager, not {type(state_manager).__name__}"
            )
        return state_manager
    kind = persistence or "memory"
    try:
        check_backend_name(kind)
    except ConfigurationError:
        known = ", ".join(repr(name) for name in backend_names())
        raise ConfigurationError(
            f"persistence must be one of {known}, not {persistence!r}"
        ) from None
    if kind == "file":
        path = Path(base_path) if base_path is not None else Path("./state")
        return StateManager(
            StateConfig(backend="file", file_path=path / "state.json", key_prefix=key_prefix)
        )
    if kind == "sqlite":
        path = Path(base_path) if base_path is not None else Path("./state")
        return StateManager(
            StateConfig(backend="sqlite", sqlite_path=path / "state.db", key_prefix=key_prefix)
        )
    if kind == "redis":
        url = redis_url or os.environ.get("AGENTICSTATE_REDIS_URL") or DEFAULT_REDIS_URL
        return StateManager(StateConfig(backend="redis", redis_url=url, key_prefix=key_prefix))
    return StateManager(StateConfig(backend=kind, key_prefix=key_prefix))


def key_part(value: str, what: str) -> str:
    """Check an id used inside a key: a non-empty str without `{`, `}` or control characters."""
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty str, not {value!r}")
    if "{" in value or "}" in value:
        # Ids sit inside a `{...}` hash tag so one record's keys share a Redis Cluster slot.
        raise InvalidArgumentError(f"{what} must not contain '{{' or '}}': {value!r}")
    return value


def glob_part(value: str) -> str:
    """Escape an id for use inside a glob pattern."""
    return escape_glob(value)


class TaggedKeys:
    """Keys shaped `<namespace>:{<id>}:<part>...`: one record family's ids sit in a hash tag.

    Every key of one id shares a Redis Cluster slot. Each manager builds its keys from one of
    these, in one `_Keys` class of its module, so its key layout is written down in one place.

    Args:
        namespace: The first part of every key (`"agents"`).
        id_name: What the id is called in error messages (`"agent_id"`).
    """

    def __init__(self, namespace: str, id_name: str) -> None:
        self.namespace = namespace
        self.id_name = id_name

    def key(self, id_: str, *parts: str) -> str:
        """`<namespace>:{<id>}:<parts joined by ':'>` (the id checked with `key_part`)."""
        return ":".join([f"{self.namespace}:{{{key_part(id_, self.id_name)}}}", *parts])

    def glob(self, id_: str, *parts: str) -> str:
        """A glob over one id's keys: `parts` are glob text (`"checkpoints", "*"`)."""
        tag = glob_part(key_part(id_, self.id_name))
        return ":".join([f"{self.namespace}:{{{tag}}}", *parts])

    def every(self, *parts: str) -> str:
        """A glob over every id's keys: `<namespace>:{*}:<parts>`."""
        return ":".join([f"{self.namespace}:{{*}}", *parts])

    def id_of(self, key: str) -> str:
        """The id in one of these keys (`agents:{a}:recovery` -> `a`)."""
        return key[len(self.namespace) + 2 :].split("}", 1)[0]

    async def ids(self, state: StateManager, *parts: str) -> list[str]:
        """The ids that have a key matching `every(*parts)` (any key: `"*"`), sorted."""
        return sorted({self.id_of(key) for key in await state.list_keys(self.every(*parts))})


async def maybe_await(value: object) -> Any:
    """Await `value` if it is awaitable (sync or async callbacks and hooks)."""
    if inspect.isawaitable(value):
        return await value
    return value


class StateManagerBase:
    """Base of the six managers: owns or borrows a `StateManager`.

    Args:
        state_manager: The StateManager to store records in. Managers built from the shorthand
            own theirs and close it on `aclose()`; one passed in is left open.
        persistence: The AgenticAI Framework shorthand: `"memory"` (default), `"file"`, `"sqlite"`,
            `"redis"`, or any backend name added with `register_backend`.
        redis_url: With `persistence="redis"`: the URL (default `AGENTICSTATE_REDIS_URL`, else
            `redis://localhost:6379`).
        base_path: With `persistence="file"` or `"sqlite"`: the directory of the store (default
            `./state`; the SQLite database is `state.db` in it).
        key_prefix: With the shorthand: a namespace before every key.
    """

    def __init__(
        self,
        *,
        state_manager: StateManager | None = None,
        persistence: Persistence | None = None,
        redis_url: str | None = None,
        base_path: str | Path | None = None,
        key_prefix: str = "",
    ) -> None:
        self._owns_state = state_manager is None
        self.state = build_state_manager(
            state_manager=state_manager,
            persistence=persistence,
            redis_url=redis_url,
            base_path=base_path,
            key_prefix=key_prefix,
        )
        self.log = get_logger(type(self).__module__).bind(manager=type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(state={self.state!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the StateManager if this manager created it."""
        if self._owns_state:
            await self.state.aclose()

    async def _load(self, key: str, model: type[M]) -> M | None:
        return await load(self.state, key, model)

    async def _load_many(self, pattern: str, model: type[M]) -> list[M]:
        return await load_many(self.state, pattern, model)


async def load(state: StateManager, key: str, model: type[M]) -> M | None:
    """The record at `key` as `model`, or `None`."""
    value: M | None = await state.get(key, model=model)
    return value


async def load_many(state: StateManager, pattern: str, model: type[M]) -> list[M]:
    """The records whose keys match `pattern`, as `model`, in key order."""
    keys = await state.list_keys(pattern)
    if not keys:
        return []
    found = await state.get_many(keys, model=model)
    return [found[key] for key in keys if key in found]
