"""What every manager shares: a StateManager, the `persistence=` shorthand, key helpers."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from types import UnionType
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    Literal,
    Self,
    TypeVar,
    Union,
    get_args,
    get_origin,
)

from pydantic import BaseModel, TypeAdapter, ValidationError

from agenticstate._checks import wrong_object
from agenticstate._keys import escape_glob
from agenticstate._log import get_logger
from agenticstate._registry import backend_names, check_backend_name
from agenticstate._retry import backoff
from agenticstate.config import StateConfig
from agenticstate.exceptions import (
    ConfigurationError,
    DecodeError,
    ForeignRecordError,
    InvalidArgumentError,
    InvalidNumberError,
    NonStringKeyError,
    SerializationError,
    UnsupportedOperationError,
)
from agenticstate.manager import StateManager
from agenticstate.txn import Get

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import TracebackType

    from agenticstate.manager import StateEntry

__all__ = [
    "DEFAULT_REDIS_URL",
    "Persistence",
    "StateManagerBase",
    "TaggedKeys",
    "conditional",
    "jitter",
    "read_entries",
    "revise",
    "skipping_bad_records",
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
    return backoff(attempt, base=0.001, cap=0.05)


def conditional(state: StateManager, entry: StateEntry | None) -> dict[str, int]:
    """The condition of a compare-and-set on what `entry` read (`None`: missing).

    The entry's revision where the backend keeps revisions (a key deleted and written again
    meanwhile is refused, whatever its version), else its version.
    """
    if state.backend.has_revisions:
        return {"expected_revision": 0 if entry is None else entry.revision}
    return {"expected_version": 0 if entry is None else entry.version}


def revise(record: M, /, **changes: Any) -> M:
    """`record.model_copy(update=changes)`, with every change validated as its field.

    `model_copy` does not validate: a wrongly typed argument (`fail(error=42)`) would be stored
    in a typed field and the record could never be read again. Each change is validated as its
    field's annotation and constraints (coerced as pydantic coerces, `"failed"` to the status
    enum), so every manager writes only records that read back. Costs one validation per changed
    field (the field's own, not the whole record's).

    Raises:
        InvalidArgumentError: A change does not validate as its field (nothing was changed).
    """
    model = type(record)
    checked: dict[str, Any] = {}
    for name, value in changes.items():
        try:
            checked[name] = _field_adapter(model, name).validate_python(value)
        except ValidationError as exc:
            reason = exc.errors(include_url=False, include_input=False)[0]["msg"]
            # The type, never the value: it may be anything the caller holds.
            raise InvalidArgumentError(
                f"{model.__name__}.{name} cannot be a {type(value).__name__}: {reason}"
            ) from None
    return record.model_copy(update=checked)


@functools.cache
def _field_adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    """A validator of one field of `model`: its annotation with its constraints (`ge=0`)."""
    field = model.model_fields.get(name)
    if field is None:
        raise InvalidArgumentError(f"{model.__name__} has no field {name!r}")
    annotation: Any = field.annotation
    if field.metadata:
        annotation = Annotated[annotation, *field.metadata]
    return TypeAdapter(annotation)


async def read_entries(
    state: StateManager, keys: list[str], model: type[BaseModel] | None = None
) -> list[StateEntry | None]:
    """The entries at `keys` (with their revisions), in one step where the backend can.

    The keys share one hash tag (one record family's keys): on Redis Cluster one step reads
    them all. A backend without `transact` reads them one by one.
    """
    if not keys:
        return []
    try:
        done = await state.transact([], [Get(key, model=model) for key in keys])
    except UnsupportedOperationError:
        return [await state.get_entry(key, model=model) for key in keys]
    return list(done.results)


def optional_count(value: object, what: str, *, minimum: int) -> int | None:
    """Check a count argument (`limit=`): an int >= `minimum`, or None.

    Raises:
        InvalidArgumentError: Anything else (a bool, a float, a str, a negative number).
    """
    if value is not None and (type(value) is not int or value < minimum):
        raise InvalidArgumentError(f"{what} must be an int >= {minimum} or None, not {value!r}")
    return value


def mapping_argument(value: object, what: str) -> Mapping[str, Any]:
    """Check a mapping argument (`parameters=`, `changes=`).

    Raises:
        InvalidArgumentError: `value` is not a mapping.
    """
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{what} must be a mapping, not a {type(value).__name__}")
    return value


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
    owner: str = "a manager",
) -> StateManager:
    """Return `state_manager`, or one built from the AgenticAI Framework shorthand arguments."""
    if state_manager is not None:
        if persistence is not None or redis_url is not None or base_path is not None:
            raise ConfigurationError(
                "pass either state_manager= or persistence=/redis_url=/base_path=, not both"
            )
        if not isinstance(state_manager, StateManager):
            raise ConfigurationError(
                wrong_object(
                    state_manager,
                    parameter="state_manager",
                    expected="agenticstate.StateManager",
                    owner=owner,
                )
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
        """The ids that have a key matching `every(*parts)`, sorted.

        `ids(state, "*")`, the ids with any key, reads one key per id (`list_tags`), never
        every key of every id: O(ids x log n) on the built-in backends.
        """
        if parts == ("*",):
            return await state.list_tags(self.namespace + ":")
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
            owner=type(self).__name__,
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

    def _check_value(self, value: object, path: str) -> None:
        """Refuse a free-form value that cannot be stored, naming where it would go.

        Raises:
            SerializationError: As `StateManager.save` would for `value`, with `path` (the
                place in the record, `$.steps.1.result`) in place of the value's own root.
        """
        check_value(self.state, value, path)

    def _check_mapping(self, mapping: object, root: str) -> None:
        """Check a dict of free-form values key by key, so each is named by its own path.

        (A value over the size limit is then named by its key, not by the whole dict.)
        """
        if not isinstance(mapping, Mapping):
            check_value(self.state, mapping, root)
            return
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise NonStringKeyError(
                    f"dict key {key!r} is a {type(key).__qualname__}, not a str", path=root
                )
            check_value(self.state, value, f"{root}.{key}")

    def _check_record(self, record: BaseModel, root: str = "$") -> None:
        """Refuse a record whose free-form fields hold a value that cannot be stored.

        See `check_record`.
        """
        check_record(self.state, record, root)

    async def _load_many(self, pattern: str, model: type[M]) -> list[M]:
        return await load_many(self.state, pattern, model)


def check_value(state: StateManager, value: object, path: str) -> None:
    """Encode `value` as `state.save` would; a value it refuses raises here, named by `path`.

    Costs one encoding of the value, before anything is written.

    Raises:
        SerializationError: The value cannot be stored (the same subclass `save` raises), with
            its place given as `path` plus where in the value the problem is.
    """
    try:
        state.serializer.dumps(value)
    except SerializationError as exc:
        raise at_path(exc, path) from None


def encode_error(state: StateManager, record: object, path: str) -> SerializationError | None:
    """Why `record` (a whole record about to be written) cannot be stored, or `None`.

    Checking a new value alone is not enough: it may fit `max_value_size` while the record that
    holds it (with its other fields) does not. A failure of the whole record (too large) is
    named by `path`, the value the change put in; one inside the value keeps its own path.
    Costs one encoding of the record.
    """
    try:
        state.serializer.dumps(record)
    except SerializationError as exc:
        return at_path(exc, path) if exc.path in ("", "$") else exc
    return None


def unstorable(error: SerializationError) -> str:
    """What a record's `error` says of a value that could not be stored: its type and place.

    Never the message: it may quote part of the value.
    """
    return f"{type(error).__name__} at {error.path}"


def at_path(error: SerializationError, root: str) -> SerializationError:
    """The same error with its path moved under `root` (`$.a` under `$.result` is `$.result.a`)."""
    path = root + error.path[1:] if error.path.startswith("$") else root
    text = str(error.args[0]) if error.args else ""
    moved = text.replace(f" at {error.path}", f" at {path}", 1) if error.path else text
    copy = type(error).__new__(type(error))
    Exception.__init__(copy, moved)
    copy.path = path
    return copy


def check_record(state: StateManager, record: BaseModel, root: str = "$") -> None:
    """Check the free-form values of `record` (and of the records inside it) before a write.

    A field typed `Any` (or a `dict`/`list` of `Any`, or a JSON value) keeps whatever it was
    given, and pydantic's JSON form would turn what `save` refuses into something else on the
    way to the store (a set into a list, NaN into null, `{1: ...}` into `{"1": ...}`): such
    values are checked as `save` checks a value, so they are refused with their place in the
    record instead. Typed fields (a `set[str]`, a `dict[int, StepState]`) are read back into
    their type, and are not checked, but for a float that is not finite (written as null).

    Raises:
        SerializationError: A free-form value cannot be stored; its path in the record is named.
    """
    for name, value in record:
        annotation = type(record).model_fields[name].annotation
        _check_field(state, annotation, value, f"{root}.{name}")


def _free_form(annotation: object) -> bool:
    return annotation is Any or "JsonValue" in str(annotation)


def _check_field(state: StateManager, annotation: object, value: object, path: str) -> None:
    if value is None:
        return
    if type(value) is float:
        # A typed float too: pydantic's JSON form writes NaN and infinities as null.
        if not math.isfinite(value):
            raise InvalidNumberError(f"float {value!r} is not finite", path=path)
        return
    if _free_form(annotation):
        check_value(state, value, path)
        return
    if isinstance(value, BaseModel):
        check_record(state, value, path)
        return
    args = [arg for arg in get_args(annotation) if arg is not type(None)]
    origin = get_origin(annotation)
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        for key, item in value.items():
            _check_field(state, args[1], item, f"{path}.{key}")
    elif origin is list and args and isinstance(value, list):
        for index, item in enumerate(value):
            _check_field(state, args[0], item, f"{path}[{index}]")
    elif origin in (Union, UnionType):
        # `X | None` (None was handled above): check the value as an X.
        if any(_free_form(arg) for arg in args):
            check_value(state, value, path)
        elif len(args) == 1:
            _check_field(state, args[0], value, path)


async def load(state: StateManager, key: str, model: type[M]) -> M | None:
    """The record at `key` as `model`, or `None`."""
    value: M | None = await state.get(key, model=model)
    return value


_SKIPPED: ContextVar[list[tuple[str, str]] | None] = ContextVar("_SKIPPED", default=None)


@contextlib.contextmanager
def skipping_bad_records() -> Iterator[list[tuple[str, str]]]:
    """Within it, a listing skips a record that does not decode or validate, noting it.

    A foreign value, or a field from a newer release: the listing leaves it out and appends
    `(key, reason)` to the list this yields. For readers that show what they can (the
    inspector, `agenticstate inspect`): one bad record hides only itself. Outside it, a listing
    raises `DecodeError` as before. A listing that met one reads its keys again one by one (a
    round trip each) to find the rest.
    """
    skipped: list[tuple[str, str]] = []
    token = _SKIPPED.set(skipped)
    try:
        yield skipped
    finally:
        _SKIPPED.reset(token)


async def load_many(state: StateManager, pattern: str, model: type[M]) -> list[M]:
    """The records whose keys match `pattern`, as `model`, in key order."""
    keys = await state.list_keys(pattern)
    if not keys:
        return []
    try:
        found = await state.get_many(keys, model=model)
    except (DecodeError, ForeignRecordError):
        skipped = _SKIPPED.get()
        if skipped is None:
            raise
        found = {}
        for key in keys:
            try:
                value = await state.get(key, model=model)
            except (DecodeError, ForeignRecordError) as exc:
                skipped.append((key, str(exc)))
                continue
            if value is not None:
                found[key] = value
    return [found[key] for key in keys if key in found]
