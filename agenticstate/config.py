"""StateConfig: how a StateManager stores state.

`FeedRetention` and `HistoryRules` (how much of the change feed, and which keys' versions, a
backend keeps) live here, below the backends, so that `StateConfig` can hold them; the backend
contract (`agenticstate.backends.base`) re-exports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agenticstate._checks import as_ttl as _as_ttl  # the one TTL check; this name stays
from agenticstate._checks import duration
from agenticstate._glob import compile_glob
from agenticstate._keys import validate_pattern
from agenticstate._registry import check_backend_name
from agenticstate.encryption import Encryption  # pydantic needs it at runtime
from agenticstate.exceptions import AgenticStateError, ConfigurationError, InvalidArgumentError
from agenticstate.serialization import DEFAULT_MAX_DEPTH, DEFAULT_MAX_SIZE

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["FeedRetention", "HistoryRules", "StateConfig", "redact_url"]


_PASSWORD_PARAMETER = re.compile(r"((?:^|&)password=)[^&]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """Return `url` with any password replaced by `***`, for logs and reprs.

    Both places a Redis URL can carry one are redacted: the user info (`redis://user:pw@host`)
    and a `password=` query parameter. A URL too malformed to parse is not echoed at all.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    # Work on the netloc and query as text: `parts.port` raises on a malformed port, and
    # rebuilding with urlunsplit would drop the `//` of `unix:///path`.
    userinfo, at, host = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.partition(":")[0]
        url = url.replace(parts.netloc, f"{user}:***@{host}", 1)
    if parts.query:
        before, hash_mark, fragment = url.partition("#")
        head, question_mark, query = before.partition("?")
        url = head + question_mark + _PASSWORD_PARAMETER.sub(r"\1***", query)
        url += hash_mark + fragment
    return url


@dataclass(frozen=True, slots=True)
class FeedRetention:
    """How much of the change feed a backend keeps (each bound applies; `None` lifts it).

    Attributes:
        max_changes: Keep at most this many of the newest changes (per stream: on Redis
            Cluster, per slot's stream). Trimming may keep somewhat more than this (Redis trims
            whole stream nodes), never fewer.
        max_age: Drop changes older than this (checked as writes happen, so an idle feed may
            hold older ones until the next write).
    """

    max_changes: int | None = 10_000
    max_age: timedelta | None = None

    def __post_init__(self) -> None:
        if self.max_changes is not None and (
            type(self.max_changes) is not int or self.max_changes < 1
        ):
            raise ConfigurationError(
                f"max_changes must be an int >= 1 or None, not {self.max_changes!r}"
            )
        try:
            duration(self.max_age, "max_age")
        except InvalidArgumentError as exc:
            # Configuration, refused as the other options of StateConfig are.
            raise ConfigurationError(str(exc)) from None


class HistoryRules:
    """Which keys keep how many versions: glob patterns to depths, the first match wins.

    `HistoryRules({"agent:*": 20, "*": 1})`: keys under `agent:` keep their last 20 versions;
    a depth of 1 keeps only the current one (the same as no rule). Depth is an int >= 1.
    """

    __slots__ = ("_cache", "_rules")

    def __init__(self, rules: Mapping[str, int] | None = None) -> None:
        checked = []
        for pattern, depth in dict(rules or {}).items():
            validate_pattern(pattern)
            if type(depth) is not int or depth < 1:
                raise ConfigurationError(
                    f"history depth for {pattern!r} must be an int >= 1, not {depth!r}"
                )
            checked.append((compile_glob(pattern), depth))
        self._rules = checked
        self._cache: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._rules)

    def depth(self, key: str) -> int:
        """How many versions `key` keeps (1: only the current one)."""
        found = self._cache.get(key)
        if found is None:
            found = next((d for matcher, d in self._rules if matcher.match(key)), 1)
            if len(self._cache) >= 4096:
                self._cache.clear()
            self._cache[key] = found
        return found


class StateConfig(BaseModel):
    """How a `StateManager` stores state.

    ```python
    StateConfig(backend="memory")
    StateConfig(backend="file", file_path="./state/app_state.json", auto_save=True)
    StateConfig(backend="sqlite", sqlite_path="./state/app.db")
    StateConfig(backend="redis", redis_url="redis://localhost:6379", key_prefix="agenticai:",
                ttl=3600)
    StateConfig(feed=FeedRetention(max_changes=100_000), history={"agent:*": 20})
    ```

    Invalid values raise `ConfigurationError` (a `ValueError`). The Redis URL's password never
    appears in `repr()` or logs.
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, arbitrary_types_allowed=True
    )

    backend: str = "memory"
    """Where state lives, by registered backend name: `"memory"` (this process), `"file"` (a
    crash-safe local store, one process), `"sqlite"` (an SQLite database several processes on one
    host share), `"redis"`, or a name added with `register_backend`."""
    auto_save: bool = True
    """File backend: rewrite the snapshot in the background every `save_interval` seconds (the log
    makes every acknowledged write durable either way)."""
    save_interval: float = Field(default=30.0, gt=0)
    """Seconds between background snapshot rewrites when `auto_save` is on."""
    file_path: Path | None = None
    """File backend: the snapshot path (`./state/app_state.json`); default `./state/state.json`."""
    sqlite_path: Path | None = None
    """SQLite backend: the database file (`./state/app.db`); default `./state/state.db`."""
    redis_url: str | None = Field(default=None, repr=False)
    """Redis backend: `redis://[user:password@]host:port/db`, `rediss://` for TLS, `unix://`, or
    `redis+cluster://host:port,host:port` for Redis Cluster."""
    key_prefix: str = ""
    """A namespace put before every key in the backend; keys are given and listed without it."""
    ttl: timedelta | None = None
    """Default time to live for every write, in seconds or as a timedelta; `None` never expires."""
    format: Literal["msgpack", "json"] | None = None
    """How values are encoded: compact msgpack or readable JSON; by default the backend's
    preference (JSON for a file store opened with `format="json"`), else msgpack."""
    compression: bool = False
    """Compress values larger than `compression_threshold` bytes with zlib."""
    compression_threshold: int = Field(default=1024, ge=0)
    """Smallest encoded value, in bytes, worth compressing."""
    max_value_size: int = Field(default=DEFAULT_MAX_SIZE, gt=0)
    """Largest encoded value accepted, in bytes."""
    max_depth: int = Field(default=DEFAULT_MAX_DEPTH, gt=0, le=500)
    """Deepest nesting of containers accepted in a value."""
    subscriber_buffer: int = Field(default=1000, ge=1)
    """Changes each subscription buffers before it overflows."""
    update_max_attempts: int = Field(default=64, ge=1)
    """Compare-and-set attempts `update` makes under contention before raising `ConflictError`."""
    db: int = Field(default=0, ge=0)
    """Redis backend: the database number, when the URL does not name one."""
    connection_pool_size: int = Field(default=10, ge=1)
    """Redis backend: the most connections held open."""
    encryption: Encryption | None = None
    """Encrypt values at rest (AES-GCM, bound to each value's key): see `Encryption`."""
    commit_retention: int = Field(default=50, ge=1)
    """Commits of a scope kept by `StateManager.commit` (besides pinned ones): see
    `agenticstate.commits`."""
    feed: FeedRetention | None = FeedRetention()
    """The durable change feed behind `changes(since=cursor)`: how many changes (and how old)
    the backend keeps, or `None` to keep none (the SQLite backend cannot turn it off). Passed to
    the built-in backends; a backend given to `StateManager(backend=...)` keeps its own."""
    history: dict[str, int] = Field(default_factory=dict)
    """Keep past versions of keys by glob pattern, the first match winning:
    `{"agent:*": 20}` keeps each `agent:` key's last 20 versions, for `history`, `get(...,
    version=)` and `revert`. The manager hands the rules to its backend on open (every process
    that writes such keys must set the same rules: the writer keeps the history)."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc']) or 'config'}: {error['msg']}"
                for error in exc.errors(include_url=False, include_input=False)
            )
            raise ConfigurationError(f"invalid StateConfig: {problems}") from None

    @field_validator("backend", mode="before")
    @classmethod
    def _check_backend(cls, value: object) -> str:
        try:
            return check_backend_name(value)
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("feed", mode="before")
    @classmethod
    def _check_feed(cls, value: object) -> FeedRetention | None:
        if value is None or isinstance(value, FeedRetention):
            return value
        raise ValueError(f"must be a FeedRetention or None, not {type(value).__name__}")

    @field_validator("history", mode="before")
    @classmethod
    def _check_history(cls, value: object) -> object:
        if not isinstance(value, dict):
            raise ValueError(f"must be a dict of glob patterns to depths, not {value!r}")
        try:
            HistoryRules(value)  # the patterns and depths, checked once here
        except AgenticStateError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("ttl", mode="before")
    @classmethod
    def _check_ttl(cls, value: object) -> timedelta | None:
        return _as_ttl(value)

    def __repr_args__(self) -> Any:
        yield from super().__repr_args__()
        if self.redis_url is not None:
            yield "redis_url", redact_url(self.redis_url)
