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
from urllib.parse import parse_qsl, unquote, unquote_plus

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
    from collections.abc import Collection, Mapping

__all__ = ["FeedRetention", "HistoryRules", "StateConfig", "redact_url"]


# Query parameters whose values are shown by `redact_url` (names compared case-insensitively
# after percent-decoding): connection settings that are never secrets. Every other parameter's
# value is hidden, so a new driver option, a misspelt `password` or an encoded name
# (`pass%77ord`) never shows.
_SHOWN_PARAMETERS = frozenset(
    {
        "db",
        "protocol",
        "key_prefix",
        "feed",
        "feed_max_changes",
        "feed_max_age",
        "feed_max_bytes",
        "change_retention",
        "synchronous",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "retry_on_timeout",
        "health_check_interval",
        "max_connections",
        "decode_responses",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "sslmode",
        "connect_timeout",
    }
)
# A value shown must look like a setting (digits, words), not like free text.
_SHOWN_VALUE = re.compile(r"[A-Za-z0-9_.+-]{0,64}")
# A parameter name shown as written: letters, digits and percent-encodings only.
_SHOWN_NAME = re.compile(r"[A-Za-z0-9_.%+-]{1,64}")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# A user name shown before `:***@`: no URL delimiter, nothing a query or path could hold.
_SHOWN_USER = re.compile(r"[A-Za-z0-9._~%!$'()*+,-]{0,256}")
# A host or `host:port` (one of several in a cluster URL): a port, if any, is digits.
_HOST = re.compile(r"(?:\[[^\[\]@]*\]|[^\[\]@:]*)(?::[0-9]*)?")
_INVALID = "<invalid url>"
_HIDDEN = "***"


def _split_authority(url: str) -> tuple[str, str | None, str] | None:
    """`url` as (scheme and `//`, user info or `None`, the rest), or `None` if it has no scheme.

    The user info runs to the *last* `@` after the scheme, whatever comes between: a password
    may hold `/`, `?`, `#` or `@`, which end the authority for a URL parser. When an `@`
    belongs to a path or query instead (`redis://h/0?client_name=a@b`), more is hidden than
    needed, never less. An authority that starts with `/` (`unix:///tmp/a@b.sock`) is empty.
    """
    scheme = _SCHEME.match(url)
    if scheme is None:
        return None
    start = scheme.end() + 2 if url.startswith("//", scheme.end()) else scheme.end()
    rest = url[start:]
    if (rest.startswith("/") and start > scheme.end()) or "@" not in rest:
        return url[:start], None, rest
    userinfo, _, after = rest.rpartition("@")
    return url[:start], userinfo, after


def _parameter_name(raw: str) -> str:
    """A query parameter's name as a URL parser reads it (tabs and newlines dropped, decoded)."""
    name = re.sub(r"[\t\r\n]", "", raw)
    for _ in range(4):  # decoded repeatedly: `%2570` is still not shown as `db`
        decoded = unquote_plus(name)
        if decoded == name:
            break
        name = decoded
    return name.casefold()


def _redact_query(query: str) -> str:
    parts = []
    for parameter in query.split("&"):
        name, equals, value = parameter.partition("=")
        shown_name = name if _SHOWN_NAME.fullmatch(name) else _HIDDEN
        if not equals:
            parts.append(shown_name if name else "")
        elif _parameter_name(name) in _SHOWN_PARAMETERS and _SHOWN_VALUE.fullmatch(value):
            parts.append(f"{shown_name}={value}")
        else:
            parts.append(f"{shown_name}={_HIDDEN}")
    return "&".join(parts)


def redact_url(url: str) -> str:
    """Return `url` with everything that could be a secret replaced by `***`, for logs and reprs.

    Scheme-agnostic (`redis://`, `rediss://`, `unix://`, `redis+cluster://`, `sqlite://`,
    `postgresql://`, ...) and done on the text, before any URL parsing, so that it cannot fail
    open:

    - the user info, everything between `://` and the last `@`, is hidden, whatever it holds
      (`/`, `?`, `#` or `@` included); a plain user name before the first `:` stays
      (`redis://app:***@host:6379/0`);
    - every query parameter's value is hidden except a few known settings (`db`, timeouts,
      `key_prefix`, the feed's retention, ...), compared after percent-decoding, so neither
      `password=` nor `pass%77ord=` shows; a fragment is hidden;
    - a URL that does not parse (no scheme, a host that is not `host[:port]`) is not echoed
      at all: `<invalid url>`.
    """
    if not isinstance(url, str):
        return _INVALID
    split = _split_authority(url)
    if split is None:
        return _INVALID
    head, userinfo, rest = split
    shown = head
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        shown += f"{user}:{_HIDDEN}@" if colon and _SHOWN_USER.fullmatch(user) else f"{_HIDDEN}@"
    before_fragment, hash_mark, fragment = rest.partition("#")
    path, question_mark, query = before_fragment.partition("?")
    if head.endswith("//"):
        authority_end = len(path) if "/" not in path else path.index("/")
        hosts = path[:authority_end]
        # Without user info, a host that is not `host[:port]` may be a password typed without
        # its `@host` (`redis://:pass/word`); after user info it is only shown as written.
        if (
            userinfo is None and not all(_HOST.fullmatch(host) for host in hosts.split(","))
        ) or hosts.count("[") != hosts.count("]"):
            return _INVALID
    shown += path
    if question_mark:
        shown += "?" + _redact_query(query)
    if hash_mark:
        shown += "#" + (_HIDDEN if fragment else "")
    return shown


def check_user_info(url: str) -> None:
    """Refuse a URL whose user info a URL parser would cut short, before anything connects.

    A `/`, `?` or `#` ends a URL's authority, so in `redis://app:ab/cd@host` a parser sees the
    host `app`, the port `ab` and the path `/cd@host`: the password would reach error messages
    as a port or a path. `redact_url` hides everything up to the last `@`; this check makes
    sure the connection reads the same user info, or nothing is sent at all.

    Raises:
        ConfigurationError: The user info holds an unencoded `/`, `?`, `#` or `@`, or an `@`
            sits in the path, query or fragment (percent-encode it as `%40` there).
    """
    split = _split_authority(url)
    if split is None or split[1] is None:
        return
    head, userinfo, _ = split
    authority = re.split(r"[/?#]", url[len(head) :], maxsplit=1)[0]
    if authority.rpartition("@")[0] != userinfo:
        raise ConfigurationError(
            f"the URL {redact_url(url)!r} has an '@' after a '/', '?' or '#': percent-encode "
            "'/', '?', '#' and '@' in a user name or password (%2F, %3F, %23, %40), and an "
            "'@' in a path or query value as %40"
        )


def check_url(url: str) -> None:
    """Refuse a store URL with a fragment, a query item without `=`, or a repeated parameter.

    `urllib.parse` drops a fragment and a query item without `=`: two URLs that differ only
    there would open the same store.

    Raises:
        ConfigurationError: Naming the part, and how to write a `#` or `?` it meant.
    """
    scheme = url.partition("://")[0]
    if "#" in url:
        raise ConfigurationError(
            f"a {scheme}:// URL cannot have a fragment ('#...'), which would be ignored: write a "
            "'#' that belongs to a path or a password as %23"
        )
    _, question_mark, query = url.partition("?")
    names: set[str] = set()
    for item in query.split("&") if question_mark else ():
        if "=" not in item:  # an empty one too: `path?`, `?a=1&&b=2`
            raise ConfigurationError(
                f"a {scheme}:// URL has a query item without '=', which would be ignored: give "
                "parameters as name=value, and write a '?' that belongs to a path or a password "
                "as %3F"
            )
        name, _, value = item.partition("=")
        if not name or not value:
            raise ConfigurationError(
                f"a {scheme}:// URL has a query parameter with no "
                f"{'name' if not name else 'value'}, which would be ignored: give parameters "
                "as name=value, and write a '?' that belongs to a path or a password as %3F"
            )
        name = parse_qsl(item, keep_blank_values=True)[0][0]
        if name in names:
            raise ConfigurationError(
                f"the {scheme}:// URL gives the parameter {_shown_name(name)} twice"
            )
        names.add(name)


def _shown_name(name: str) -> str:
    """A parameter's name for an error message: quoted, or hidden if it could be a secret."""
    return repr(name) if _SHOWN_NAME.fullmatch(name) else "(a name that is not shown)"


# The redis-py connection settings a Redis URL may give, by scheme (each is a parameter of
# the scheme's redis-py connection class, held by a test). Left out: settings that take Python
# objects, `decode_responses` and `encoding` (the backend reads bytes), `retry_on_timeout` and
# `retry_on_error` (a resent write could apply twice: retries are the backend's), and
# `max_connections` (the backend's `connection_pool_size`). A cluster URL takes none: its
# connections are made from the node list alone.
_REDIS_COMMON = (
    "client_name",
    "db",
    "health_check_interval",
    "password",
    "protocol",
    "socket_connect_timeout",
    "socket_read_size",
    "socket_timeout",
    "username",
)
_REDIS_SSL = (
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_ca_path",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_check_hostname",
    "ssl_ciphers",
    "ssl_exclude_verify_flags",
    "ssl_include_verify_flags",
    "ssl_keyfile",
    "ssl_min_version",
    "ssl_password",
)
REDIS_URL_PARAMETERS: Mapping[str, frozenset[str]] = {
    "redis": frozenset((*_REDIS_COMMON, "socket_keepalive")),
    "rediss": frozenset((*_REDIS_COMMON, "socket_keepalive", *_REDIS_SSL)),
    "unix": frozenset(_REDIS_COMMON),
    "redis+cluster": frozenset(),
    "rediss+cluster": frozenset(),
}
"""The redis-py settings a Redis URL's query may hold, by scheme (besides the backend's own)."""

# The settings above with a typed value, as redis-py reads them (held by a test against
# redis-py's own table): a value it cannot read fails here, not at the first command.
_WHOLE = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_BOOLEAN = re.compile(r"(?i:1|0|true|false|yes|no|t|f|y|n)")  # what redis-py reads right
REDIS_URL_VALUE_KINDS: Mapping[str, tuple[re.Pattern[str], str]] = {
    "db": (_WHOLE, "a whole number"),
    "health_check_interval": (_WHOLE, "a whole number of seconds"),
    "protocol": (_WHOLE, "a whole number (2 or 3)"),
    "socket_read_size": (_WHOLE, "a whole number of bytes"),
    "ssl_min_version": (_WHOLE, "a whole number"),
    "socket_connect_timeout": (_NUMBER, "a number of seconds"),
    "socket_timeout": (_NUMBER, "a number of seconds"),
    "socket_keepalive": (_BOOLEAN, "true or false (1 or 0)"),
    "ssl_check_hostname": (_BOOLEAN, "true or false (1 or 0)"),
}


def check_redis_url(url: str, *, own: Collection[str] = ()) -> None:
    """Refuse a Redis URL that redis-py would fail on at the first command, before connecting.

    Refused: an ambiguous user info (`check_user_info`), a part that would be dropped
    (`check_url`), a query parameter that is neither one of `own` (the backend's, which the
    caller takes out) nor one of `REDIS_URL_PARAMETERS[scheme]`, or a value redis-py cannot
    read (`db=x`). Names are shown, values never (a `password=` parameter is a secret).

    Raises:
        ConfigurationError: Naming the parameter and the ones the scheme knows.
    """
    check_user_info(url)
    check_url(url)
    scheme = url.partition("://")[0].lower()
    known = REDIS_URL_PARAMETERS.get(scheme)
    if known is None:
        return  # not a Redis scheme: the backend's own URL check refuses it
    for name, value in parse_qsl(url.partition("?")[2], keep_blank_values=True):
        if name in own:
            continue
        if name not in known:
            listed = ", ".join(sorted((*own, *known))) or "none"
            hint = " (a cluster URL takes only the backend's own)" if "cluster" in scheme else ""
            raise ConfigurationError(
                f"unknown {scheme}:// URL parameter {_shown_name(name)}{hint}; known: {listed}"
            )
        kind = REDIS_URL_VALUE_KINDS.get(name)
        if kind is not None and not kind[0].fullmatch(value):
            raise ConfigurationError(f"the {scheme}:// URL parameter {name!r} must be {kind[1]}")


def hide_url_secrets(text: str, url: str) -> str:
    """Return `text` (a foreign error message, say) with every secret part of `url` hidden.

    The secrets are what `redact_url` hides: the user info's password and the hidden query
    values, raw and percent-decoded, whole and in the pieces a URL parser may cut them into
    (at `/ ? # @ : & ; =`). Pieces of four characters or more are replaced by `***`; if a
    shorter one occurs, the whole text is dropped for a neutral one (it cannot be told apart
    from the words around it).
    """
    pieces: set[str] = set()
    for secret in _url_secrets(url):
        for form in {secret, unquote(secret), unquote_plus(secret)}:
            pieces.add(form)
            pieces.update(re.split(r"[/?#@:&;=]", form))
    pieces.discard("")
    for piece in sorted(pieces, key=len, reverse=True):
        if piece not in text:
            continue
        if len(piece) < 4:
            return "(details withheld: they may hold part of a password)"
        text = text.replace(piece, _HIDDEN)
    return text


def _url_secrets(url: str) -> list[str]:
    if not isinstance(url, str):
        return []
    split = _split_authority(url)
    if split is None or redact_url(url) == _INVALID:  # not echoed: all of it may be secret
        return [url if split is None else url[len(split[0]) :]]
    _, userinfo, rest = split
    secrets = []
    if userinfo is not None:
        user, colon, password = userinfo.partition(":")
        secrets.append(password if colon and _SHOWN_USER.fullmatch(user) else userinfo)
    before_fragment, _, fragment = rest.partition("#")
    query = before_fragment.partition("?")[2]
    for parameter in query.split("&"):
        name, equals, value = parameter.partition("=")
        if not _SHOWN_NAME.fullmatch(name):
            secrets.append(name)
        if equals and not (
            _parameter_name(name) in _SHOWN_PARAMETERS and _SHOWN_VALUE.fullmatch(value)
        ):
            secrets.append(value)
    if fragment:
        secrets.append(fragment)
    return secrets


DEFAULT_FEED_BYTES = 64 * 1024 * 1024
"""`FeedRetention.max_bytes` by default: 64 MiB per feed (per stream on Redis)."""


@dataclass(frozen=True, slots=True)
class FeedRetention:
    """How much of the change feed a backend keeps (each bound applies; `None` lifts it).

    Attributes:
        max_changes: Keep at most this many of the newest changes (per stream: on Redis
            Cluster, per slot's stream). Trimming runs in batches and may keep somewhat more
            than this (on Redis up to 1% or 32 more, on SQLite up to an eighth), never fewer.
        max_age: Drop changes older than this (checked as writes happen, so an idle feed may
            hold older ones until the next write).
        max_bytes: Keep the feed's bytes (what its changes hold: keys, old values, the values
            carried inline, headers; see "What a change costs" in the subscriptions docs) at
            most this, dropping the oldest changes first (per stream on Redis, per database
            file on SQLite). The newest change is always kept, whatever its size. 64 MiB by
            default: with values held by reference, that bounds the feed by what a burst of
            overwrites and deletes displaced, never by the size of the store.
    """

    max_changes: int | None = 10_000
    max_age: timedelta | None = None
    max_bytes: int | None = DEFAULT_FEED_BYTES

    def __post_init__(self) -> None:
        if self.max_changes is not None and (
            type(self.max_changes) is not int or self.max_changes < 1
        ):
            raise ConfigurationError(
                f"max_changes must be an int >= 1 or None, not {self.max_changes!r}"
            )
        if self.max_bytes is not None and (type(self.max_bytes) is not int or self.max_bytes < 1):
            raise ConfigurationError(
                f"max_bytes must be an int >= 1 (bytes) or None, not {self.max_bytes!r}"
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
    host share), `"redis"`, `"postgres"` (a PostgreSQL database), or a name added with
    `register_backend`."""
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
    postgres_url: str | None = Field(default=None, repr=False)
    """Postgres backend: `postgresql://[user[:password]@]host[:port]/dbname[?param=...]` (libpq's
    URL; `schema=` names the Postgres schema). `None`: libpq's defaults and environment
    (`PGHOST`, `PGUSER`, `PGPASSWORD`, ...)."""
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

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is not None:
            if value.partition("://")[0].lower() not in REDIS_URL_PARAMETERS or "://" not in value:
                raise ValueError(
                    f"must be a {', '.join(f'{name}://' for name in REDIS_URL_PARAMETERS)} URL"
                )
            try:
                check_redis_url(value)  # what redis-py would fail on at the first command
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("postgres_url")
    @classmethod
    def _check_postgres_url(cls, value: str | None) -> str | None:
        if value is not None:
            if value.partition("://")[0].lower() not in ("postgresql", "postgres"):
                raise ValueError("must be a postgresql:// URL")
            try:
                check_url(value)
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        return value

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
