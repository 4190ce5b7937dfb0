"""Sessions: per-user sessions with a session state, a message history and a running summary.

```python
sessions = SessionManager(persistence="redis", default_state={"shopping_list": []})
session = await sessions.create_session("u1")
await sessions.update_state(session.session_id, {"shopping_list": ["milk"]})
await sessions.add_message(session.session_id, "user", "Add milk")
history = await sessions.get_messages(session.session_id, last=20, max_tokens=2000)
prompt = await sessions.render(session.session_id, "Current list: {shopping_list}")
```

Each message is a record of its own, numbered by a per-session sequence: one atomic step bumps
the session's count and writes the message under its number, so appending costs the same at the
10th and the 100,000th message, writers in several processes never lose a message or disagree
on the order, and no number is ever given without its message. Reading the last N messages is
one read of the session and one batch read of N keys.

Deleting a session erases every write that races it. Each write of a session key is one step
compared on revisions (`Revision`): on the key itself when it is there, else on the session
record, which a delete removes first; a write that began in one life of a session (before it was
deleted, and perhaps created again under the same id) is refused with `NotFoundError`, never
left behind nor carried into the new session. The delete then erases the keys of the life it
ended (those created before its own revision), and leaves alone those a session created again
meanwhile wrote. On a backend without `transact` or revisions, appends and state writes take
the older multi-call path, where a write racing a delete can outlive it.

Key layout (the session id sits in a `{...}` hash tag, so one session lives in one Redis Cluster
slot):

| record | key |
|---|---|
| `Session` (user, name, times, message count) | `sessions:{<session_id>}:meta` |
| session state (a dict) | `sessions:{<session_id>}:state` |
| `SessionMessage` number `n` | `sessions:{<session_id>}:msg:<n, 12 digits>` |
| `SessionSummary` | `sessions:{<session_id>}:summary` |
| a user's sessions (sorted index, newest first) | `sessions:users:{<user_id>}` |
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from copy import deepcopy
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal
from uuid import uuid4

import anyio
from pydantic import BaseModel, ConfigDict, Field, JsonValue

from agenticstate._checks import as_ttl
from agenticstate._merge import deep_merge, updater
from agenticstate.exceptions import (
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedOperationError,
)
from agenticstate.managers._base import (
    StateManagerBase,
    TaggedKeys,
    jitter,
    key_part,
    maybe_await,
    sort_time,
    utcnow,
)
from agenticstate.txn import Delete, Get, Put, Revision

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.manager import StateEntry, StateManager
    from agenticstate.managers._base import Persistence

__all__ = [
    "Session",
    "SessionDeletion",
    "SessionManager",
    "SessionMessage",
    "SessionSummary",
    "Summarizer",
    "TokenCounter",
    "estimate_tokens",
]

TokenCounter = Callable[["SessionMessage"], int]
"""Counts the tokens of one message, for `get_messages(max_tokens=...)`."""
Summarizer = Callable[[str | None, list["SessionMessage"]], "Awaitable[str] | str"]
"""`summarizer(previous_summary, new_messages) -> summary`, sync or async."""

_PAGE = 500  # keys read per batch when a read walks a long history
_BACKWARD_PAGE = 64  # keys read per batch when max_tokens walks back from the newest
_EXPIRIES_KEPT = 10_000  # sessions whose expiry add_message remembers
_CREATION_GRACE = timedelta(minutes=1)  # an index entry younger than this may be mid-creation


class _StaleExpiryError(Exception):
    """A cached session expiry no longer matches the stored session (internal)."""


class _NoSteps(Exception):  # noqa: N818  # internal signal, never raised to callers
    """The backend has no `transact` or no revisions: take the multi-call path."""


_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)\}")


def estimate_tokens(message: SessionMessage) -> int:
    """Estimate a message's tokens: 4 for the role and framing, plus one per 4 characters.

    Text is the content itself; other content counts as its compact JSON. It is the usual rule
    of thumb for English with GPT-style tokenizers and needs no dependency; pass a real tokenizer
    (`token_counter=`) when budgets must be exact.
    """
    content = message.content
    text = content if isinstance(content, str) else json.dumps(content, separators=(",", ":"))
    return 4 + math.ceil(len(text) / 4)


class Session(BaseModel):
    """A session of one user: who owns it, its name, times and how many messages it holds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    user_id: str
    name: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    """The last message, rename or creation."""
    expires_at: datetime | None = None
    """When every key of the session expires, or `None` for never."""
    message_count: int = Field(default=0, ge=0)
    """The last message number given out (messages are numbered from 1)."""


class SessionMessage(BaseModel):
    """One message of a session's history."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    seq: int = Field(ge=0)
    """The message's number in its session, from 1; 0 marks the summary `get_messages` puts
    first."""
    role: str
    content: JsonValue
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=utcnow)


class SessionSummary(BaseModel):
    """A running summary of a session's older messages."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    content: str
    covers_through: int = Field(ge=0)
    """The summary covers every message numbered up to this one."""
    updated_at: datetime = Field(default_factory=utcnow)


class SessionDeletion(BaseModel):
    """What `delete_user` erased."""

    model_config = ConfigDict(frozen=True)

    sessions: int = 0
    messages: int = 0
    keys: int = 0
    """Every key deleted: session records, states, messages and summaries."""


def _as_datetime(value: object) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


def _positive_ttl(ttl: timedelta | float | None) -> timedelta | None:
    return as_ttl(ttl)


def _optional_count(value: int | None, what: str, *, minimum: int) -> int | None:
    if value is not None and (type(value) is not int or value < minimum):
        raise InvalidArgumentError(f"{what} must be an int >= {minimum} or None, not {value!r}")
    return value


class SessionManager(StateManagerBase):
    """Per-user sessions: a session state, a message history, a running summary.

    Args:
        default_state: The state a new session starts from (copied for each session); the
            `state` given to `create_session` is merged over it.
        token_counter: Counts a message's tokens for `max_tokens` (default `estimate_tokens`).
        state_manager: See `StateManagerBase`, as are `persistence`, `redis_url`, `base_path` and
            `key_prefix`.
    """

    def __init__(
        self,
        *,
        default_state: Mapping[str, Any] | None = None,
        token_counter: TokenCounter | None = None,
        state_manager: StateManager | None = None,
        persistence: Persistence | None = None,
        redis_url: str | None = None,
        base_path: str | Path | None = None,
        key_prefix: str = "",
    ) -> None:
        if default_state is not None and not isinstance(default_state, Mapping):
            raise InvalidArgumentError("default_state must be a dict")
        if token_counter is not None and not callable(token_counter):
            raise InvalidArgumentError("token_counter must be callable")
        super().__init__(
            state_manager=state_manager,
            persistence=persistence,
            redis_url=redis_url,
            base_path=base_path,
            key_prefix=key_prefix,
        )
        # Encode once now, so a template that cannot be stored fails here, not at first use.
        self.default_state: dict[str, Any] = dict(
            self.state.serializer.loads(self.state.serializer.dumps(dict(default_state or {})))
        )
        self.token_counter: TokenCounter = token_counter or estimate_tokens
        self._expiries: dict[str, datetime | None] = {}
        # Session records as this process last wrote or read them (an append compares on the
        # revision: one round trip when nobody else wrote meanwhile).
        self._metas: dict[str, StateEntry] = {}
        self._steps = True  # False once the backend has no transact or no revisions

    # ---------------------------------------------------------------- keys
    # Every key this manager writes is built here (the layout is in the module docstring).

    _keys = TaggedKeys("sessions", "session_id")

    @staticmethod
    def _key(session_id: str, part: str) -> str:
        return SessionManager._keys.key(session_id, part)

    @staticmethod
    def _msg_key(session_id: str, seq: int) -> str:
        return f"sessions:{{{session_id}}}:msg:{seq:012d}"

    @staticmethod
    def _user_index(user_id: str) -> str:
        return f"sessions:users:{{{key_part(user_id, 'user_id')}}}"

    def _remaining(self, session: Session) -> timedelta | None:
        # Every key of a session expires with it: each write states the time left.
        return self._time_left(session.session_id, session.expires_at)

    async def _session(self, session_id: str) -> Session:
        session = await self._load(self._key(session_id, "meta"), Session)
        if session is None:
            raise NotFoundError(f"no session {session_id!r}")
        return session

    async def _step(
        self, compare: Sequence[Revision], then: Sequence[Any], orelse: Sequence[Any] = ()
    ) -> Any:
        """One `StateManager.transact` compared on revisions.

        Raises:
            _NoSteps: The backend has no `transact` or keeps no revisions (then never again).
        """
        if not self._steps or not self.state.backend.has_revisions:
            self._steps = False
            raise _NoSteps
        try:
            return await self.state.transact(compare, then, orelse)
        except UnsupportedOperationError:
            self._steps = False
            raise _NoSteps from None

    def _retries(self) -> range:
        return range(self.state.config.update_max_attempts)

    @staticmethod
    def _gone(session_id: str) -> NotFoundError:
        return NotFoundError(f"no session {session_id!r} (it was deleted)")

    # ---------------------------------------------------------------- sessions

    async def create_session(
        self,
        user_id: str,
        *,
        session_id: str | None = None,
        state: Mapping[str, Any] | None = None,
        name: str | None = None,
        ttl: timedelta | float | None = None,
    ) -> Session:
        """Create a session for `user_id` and return it.

        Args:
            user_id: The owner; `list_sessions(user_id)` and `delete_user(user_id)` find it.
            session_id: The id to use (default: a random hex id). Ids are unique per store.
            state: Merged (deep) over a copy of `default_state` to make the first state.
            name: A display name.
            ttl: The session's lifetime: every key of the session (state, messages, summary)
                expires this long after creation. `None` keeps it until deleted.

        Raises:
            ConflictError: A session with this id exists.
        """
        index = self._user_index(user_id)
        sid = key_part(session_id, "session_id") if session_id is not None else uuid4().hex
        if state is not None and not isinstance(state, Mapping):
            raise InvalidArgumentError("state must be a dict")
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError("name must be a str or None")
        life = _positive_ttl(ttl)
        first = deepcopy(self.default_state)
        if state:
            first = deep_merge(first, deepcopy(dict(state)))
        now = utcnow()
        session = Session(
            session_id=sid,
            user_id=user_id,
            name=name,
            created_at=now,
            updated_at=now,
            expires_at=None if life is None else now + life,
        )
        # Check the state first: a state that cannot be stored creates nothing.
        self._check_mapping(first, "$")
        self.state.serializer.dumps(first)
        # The user's index first: whatever happens next, delete_user finds this session.
        added = await self.state.index_add(index, {sid: -sort_time(now)})
        try:
            await self.state.save(self._key(sid, "meta"), session, ttl=life, expected_version=0)
        except ConflictError:
            if added:
                await self.state.index_remove(index, [sid])
            raise ConflictError(f"session {sid!r} already exists", key=sid) from None
        await self.state.save(self._key(sid, "state"), first, ttl=life)
        self.log.debug("session_created", session_id=sid)
        return session

    async def get_session(self, session_id: str) -> Session | None:
        """Return the session, or `None` if it does not exist (or expired)."""
        return await self._load(self._key(session_id, "meta"), Session)

    async def list_sessions(
        self, user_id: str, *, limit: int | None = None, before: datetime | None = None
    ) -> list[Session]:
        """Return a user's sessions, newest first.

        Args:
            user_id: The owner.
            limit: At most this many.
            before: Only sessions created strictly before this instant (page with the
                `created_at` of the last session of the previous page).
        """
        _optional_count(limit, "limit", minimum=1)
        if before is not None and not isinstance(before, datetime):
            raise InvalidArgumentError("before must be a datetime or None")
        index = self._user_index(user_id)
        members = await self.state.index_range(index)
        if before is not None:
            cutoff = sort_time(before)
            members = [(sid, score) for sid, score in members if -score < cutoff]
        sessions: list[Session] = []
        stale: list[str] = []
        stale_before = sort_time(utcnow() - _CREATION_GRACE)
        for start in range(0, len(members), _PAGE):
            page = [sid for sid, _ in members[start : start + _PAGE]]
            found = await self.state.get_many(
                [self._key(sid, "meta") for sid in page], model=Session
            )
            for sid, score in members[start : start + _PAGE]:
                session = found.get(self._key(sid, "meta"))
                if session is not None and session.user_id == user_id:
                    sessions.append(session)
                # The index outlives expired sessions and creations that stopped half way:
                # tidy those, but not one whose creation may still be under way.
                elif session is not None or -score < stale_before:
                    stale.append(sid)
            if limit is not None and len(sessions) >= limit:
                break
        if stale:
            await self.state.index_remove(index, stale)
        return sessions[:limit] if limit is not None else sessions

    async def list_session_ids(self, *, limit: int | None = None) -> list[str]:
        """Return the ids of every session, of every user, sorted.

        Args:
            limit: At most this many (the first ones in that order).
        """
        _optional_count(limit, "limit", minimum=1)
        ids = await self._keys.ids(self.state, "meta")
        return ids[:limit] if limit is not None else ids

    async def get_sessions(self, session_ids: Sequence[str]) -> list[Session]:
        """Return the sessions with these ids that exist, in the order given (read in pages)."""
        sessions: list[Session] = []
        for start in range(0, len(session_ids), _PAGE):
            keys = [self._key(sid, "meta") for sid in session_ids[start : start + _PAGE]]
            found = await self.state.get_many(keys, model=Session)
            sessions.extend(found[key] for key in keys if key in found)
        return sessions

    async def rename_session(self, session_id: str, name: str | None) -> Session:
        """Set the session's display name; return the session.

        Raises:
            NotFoundError: No such session.
        """
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError("name must be a str or None")
        session = await self._session(session_id)

        def rename(current: Any) -> Any:
            current.update(name=name, updated_at=utcnow().isoformat())
            return current

        stored = await self.state.update(
            self._key(session_id, "meta"), rename, ttl=self._remaining(session)
        )
        return Session.model_validate(stored)

    async def delete_session(self, session_id: str) -> bool:
        """Delete a session with its state, messages and summary; return whether it existed."""
        existed, _, _ = await self._delete_session(session_id, None)
        return existed

    async def _delete_session(self, session_id: str, user_id: str | None) -> tuple[bool, int, int]:
        """Delete a session's keys; return whether it existed, and the keys and messages erased.

        With `user_id`, a session that belongs to someone else is left alone (an index entry
        that outlived a refused `create_session` must not let one user erase another's).
        """
        session = await self.get_session(session_id)
        if session is not None and user_id is not None and session.user_id != user_id:
            return False, 0, 0
        self._expiries.pop(session_id, None)
        self._metas.pop(session_id, None)
        # The session record goes first: every write racing the delete then fails (see the
        # module docstring). Its revision tells this life's keys from a new life's.
        meta_key = self._key(session_id, "meta")
        ended: int | None = None
        try:
            done = await self._step([], [Delete(meta_key)])
            existed = bool(done.results[0])
            ended = done.revisions[0] or None
        except _NoSteps:
            existed = await self.state.delete(meta_key)
        owner = session.user_id if session is not None else user_id
        if owner is not None:
            await self.state.index_remove(self._user_index(owner), [session_id])
        keys = int(existed)
        messages = 0
        listed = await self.state.list_keys(self._keys.glob(session_id, "*"))
        for start in range(0, len(listed), _PAGE):
            for key in await self._erase(listed[start : start + _PAGE], ended):
                keys += 1
                messages += ":msg:" in key
        if existed:
            self.log.debug("session_deleted", session_id=session_id, keys=keys)
        return existed, keys, messages

    async def _erase(self, keys: list[str], ended: int | None) -> list[str]:
        """Delete the keys of the life a delete ended (at revision `ended`); return the deleted.

        Each is read, then deleted only as read (`expected_revision`), unless a session created
        again since wrote it (created after `ended`). Without steps, or when the session record
        was gone already (`ended` None), every key is deleted as it is.
        """
        if ended is None or not self._steps:
            return [key for key in keys if await self.state.delete(key)]
        deleted: list[str] = []
        done = await self._step([], [Get(key) for key in keys])
        for key, entry in zip(keys, done.results, strict=True):
            while entry is not None and entry.create_revision < ended:
                try:
                    await self.state.delete(key, expected_revision=entry.revision)
                except ConflictError:  # a write of the ended life landed meanwhile: again
                    entry = await self.state.get_entry(key)
                else:
                    deleted.append(key)
                    break
        return deleted

    async def delete_user(self, user_id: str) -> SessionDeletion:
        """Erase every session of a user, with their states, messages and summaries.

        Returns:
            How many sessions, messages and keys were deleted.
        """
        index = self._user_index(user_id)
        sessions = messages = keys = 0
        while True:
            members = await self.state.index_range(index, limit=_PAGE)
            if not members:
                break
            for sid, _ in members:
                existed, erased, erased_messages = await self._delete_session(sid, user_id)
                sessions += existed
                keys += erased
                messages += erased_messages
            await self.state.index_remove(index, [sid for sid, _ in members])
        self.log.debug("user_deleted", sessions=sessions, messages=messages)
        return SessionDeletion(sessions=sessions, messages=messages, keys=keys)

    # ---------------------------------------------------------------- session state

    async def get_state(self, session_id: str) -> dict[str, Any]:
        """Return the session state (a dict).

        Raises:
            NotFoundError: No such session.
        """
        value = await self.state.get(self._key(session_id, "state"))
        if value is None:
            # A session whose creation stopped between its two writes has the default state.
            await self._session(session_id)
            return deepcopy(self.default_state)
        return dict(value)

    async def update_state(
        self,
        session_id: str,
        change: Mapping[str, Any] | Callable[[dict[str, Any]], dict[str, Any]],
    ) -> dict[str, Any]:
        """Change the session state atomically and return the new state.

        A dict is deep-merged into the state (Agno's default); a function receives a copy of
        the state and returns the new one (it may run more than once under contention, so it
        must have no side effects). Concurrent updates from any number of processes lose nothing.

        Raises:
            NotFoundError: No such session (or it was deleted while the update ran: a write
                racing a delete never outlives it).
            InvalidArgumentError: A function returned something other than a dict.
        """
        if isinstance(change, Mapping) or callable(change):
            try:
                return await self._write_state(session_id, updater("state", change))
            except _NoSteps:
                pass
        session = await self._session(session_id)
        if isinstance(change, Mapping):
            self._check_mapping(change, "$")
            apply: Mapping[str, Any] | Callable[[Any], Any] = change
        elif callable(change):
            fn = change

            def apply(current: Any) -> Any:
                new = fn(current)
                if not isinstance(new, dict):
                    raise InvalidArgumentError(
                        f"a session state is a dict; the function returned {type(new).__name__}"
                    )
                return new

        else:
            raise InvalidArgumentError(
                f"update_state() takes a dict or a function, not {type(change).__name__}"
            )
        new = await self.state.update(
            self._key(session_id, "state"),
            apply,
            default=self.default_state,
            ttl=self._remaining(session),
        )
        return dict(new)

    async def set_state(self, session_id: str, state: Mapping[str, Any]) -> dict[str, Any]:
        """Replace the session state with `state` (Agno's overwrite) and return it.

        Raises:
            NotFoundError: No such session.
        """
        if not isinstance(state, Mapping):
            raise InvalidArgumentError("state must be a dict")
        self._check_mapping(state, "$")
        new = dict(state)
        try:
            return await self._write_state(session_id, lambda current: new)
        except _NoSteps:
            pass
        session = await self._session(session_id)
        await self.state.save(self._key(session_id, "state"), new, ttl=self._remaining(session))
        return new

    async def _write_state(self, session_id: str, change: Callable[[Any], Any]) -> dict[str, Any]:
        """Write `change(current state)` in one step compared on revisions.

        On the state as read, if this life of the session wrote it, else on the session record
        as read (which a delete removes first, so a delete since refuses the write).

        Raises:
            _NoSteps: The backend cannot (then the caller takes the multi-call path).
            NotFoundError: The session is gone, or was deleted since the first read.
        """
        meta_key, key = self._key(session_id, "meta"), self._key(session_id, "state")
        life = 0
        for attempt in self._retries():
            meta, current = (await self._step([], [Get(meta_key, model=Session), Get(key)])).results
            if meta is None or life not in (0, meta.create_revision):
                raise self._gone(session_id)
            life = meta.create_revision
            ttl = self._time_left(session_id, meta.value.expires_at)
            ours = current is not None and current.create_revision > life  # not an older life's
            new = change(current.value if ours else deepcopy(self.default_state))
            if not isinstance(new, dict):
                raise InvalidArgumentError(
                    f"a session state is a dict; the function returned {type(new).__name__}"
                )
            compare = [Revision(key, 0 if current is None else current.revision)]
            if not ours:
                compare.append(Revision(meta_key, meta.revision))
            if (await self._step(compare, [Put(key, new, ttl=ttl)])).succeeded:
                return new
            await anyio.sleep(jitter(attempt))
        raise ConflictError(f"the state of session {session_id!r} kept changing; try again")

    async def render(
        self,
        session_id: str,
        template: str,
        *,
        missing: Literal["error", "keep"] = "error",
    ) -> str:
        """Substitute `{key}` and `{key.sub}` in `template` from the session state.

        Only names (letters, digits, `_`) joined by dots are placeholders: `{user_name}`,
        `{profile.city}`, `{items.0}` (a list index). Anything else in braces, such as JSON in
        the instructions, stays as written, and `{{`/`}}` give literal braces. Strings are
        inserted as they are, other values as compact JSON. Nothing in the template is
        evaluated: no attribute access, indexing expressions, format specs or calls.

        Args:
            session_id: The session whose state fills the placeholders.
            template: The text, such as an agent's instructions.
            missing: `"error"` raises on a placeholder the state lacks; `"keep"` leaves it as is.

        Raises:
            NotFoundError: No such session, or (with `missing="error"`) a placeholder is missing.
        """
        if not isinstance(template, str):
            raise InvalidArgumentError("template must be a str")
        if missing not in ("error", "keep"):
            raise InvalidArgumentError(f"missing must be 'error' or 'keep', not {missing!r}")
        state = await self.get_state(session_id)
        return render_template(template, state, missing=missing)

    # ---------------------------------------------------------------- messages

    async def add_message(
        self, session_id: str, role: str, content: JsonValue, **metadata: JsonValue
    ) -> SessionMessage:
        """Append a message to the session's history and return it (with its number).

        One atomic step whatever the history's length: it bumps the session's message count
        and writes the message under its number, compared on the session record's revision as
        this process last saw it, so one round trip when no other writer came in between (else
        it reads the record and tries again). Appends from many processes get distinct,
        increasing numbers, each written with its message; none is lost. An append racing a
        `delete_session` is refused (`NotFoundError`) and leaves nothing behind.

        Raises:
            NotFoundError: No such session (or it was deleted while the append ran).
        """
        if not isinstance(role, str) or not role:
            raise InvalidArgumentError(f"role must be a non-empty str, not {role!r}")
        # As the core refuses them (pydantic would take NaN, and write it as null).
        self._check_value(content, "$.content")
        self._check_mapping(metadata, "$.metadata")
        meta_key = self._key(session_id, "meta")
        now = utcnow()
        message = SessionMessage(
            session_id=session_id,
            seq=1,
            role=role,
            content=content,
            metadata=metadata,
            created_at=now,
        )
        # Encode before allocating a number, so a value that cannot be stored leaves no gap.
        self.state.serializer.dumps(message)
        try:
            return await self._append(session_id, message)
        except _NoSteps:
            pass
        while True:
            expiry = await self._expiry(session_id)

            def allocate(current: Any, expiry: datetime | None = expiry) -> Any:
                if _as_datetime(current.get("expires_at")) != expiry:
                    # The session was replaced (deleted and created again) since the expiry
                    # was cached: write nothing, read it again.
                    raise _StaleExpiryError
                current["message_count"] = current.get("message_count", 0) + 1
                current["updated_at"] = now.isoformat()
                return current

            life = self._time_left(session_id, expiry)
            try:
                stored = await self.state.update(meta_key, allocate, ttl=life)
            except _StaleExpiryError:
                self._expiries.pop(session_id, None)
                continue
            except NotFoundError:
                self._expiries.pop(session_id, None)
                raise NotFoundError(f"no session {session_id!r}") from None
            break
        message = message.model_copy(update={"seq": stored["message_count"]})
        await self.state.save(
            self._msg_key(session_id, message.seq), message, ttl=life, expected_version=0
        )
        return message

    async def _append(self, session_id: str, message: SessionMessage) -> SessionMessage:
        """Number and write `message` in one step (see `add_message`).

        Raises:
            _NoSteps: The backend cannot (then `add_message` takes the multi-call path).
        """
        meta_key = self._key(session_id, "meta")
        entry = self._metas.pop(session_id, None)
        life = 0  # the life of the session this call saw first (a cached record is not seen)
        for attempt in self._retries():
            if entry is None:
                # A read on its own (not a step): on SQLite it takes no write lock.
                entry = await self.state.get_entry(meta_key, model=Session)
                if entry is None or life not in (0, entry.create_revision):
                    raise self._gone(session_id)
                life = entry.create_revision
            session: Session = entry.value
            ttl = self._time_left(session_id, session.expires_at)
            seq = session.message_count + 1
            numbered = message.model_copy(update={"seq": seq})
            counted = session.model_copy(
                update={"message_count": seq, "updated_at": message.created_at}
            )
            done = await self._step(
                [Revision(meta_key, entry.revision)],
                [
                    Put(meta_key, counted, ttl=ttl),
                    Put(self._msg_key(session_id, seq), numbered, ttl=ttl),
                ],
                [Get(meta_key, model=Session)],
            )
            if done.succeeded:
                if len(self._metas) >= _EXPIRIES_KEPT:
                    self._metas.clear()
                self._metas[session_id] = entry.model_copy(
                    update={"value": counted, "revision": done.revisions[0]}
                )
                return numbered
            entry = done.results[0]  # read in the same step: the record as it is now
            if entry is None or life not in (0, entry.create_revision):
                raise self._gone(session_id)
            life = entry.create_revision
            if attempt:
                await anyio.sleep(jitter(attempt))
        raise ConflictError(f"appending to session {session_id!r} lost every race; try again")

    async def _expiry(self, session_id: str) -> datetime | None:
        """The session's expiry, cached: it never changes while the session exists."""
        if session_id in self._expiries:
            cached = self._expiries[session_id]
            if cached is None or cached > utcnow():
                return cached
        session = await self._session(session_id)
        if len(self._expiries) >= _EXPIRIES_KEPT:
            self._expiries.clear()
        self._expiries[session_id] = session.expires_at
        return session.expires_at

    @staticmethod
    def _time_left(session_id: str, expires_at: datetime | None) -> timedelta | None:
        if expires_at is None:
            return None
        left = expires_at - utcnow()
        if left <= timedelta(0):
            raise NotFoundError(f"session {session_id!r} has expired")
        return left

    async def get_messages(
        self,
        session_id: str,
        *,
        last: int | None = None,
        since: int | None = None,
        max_tokens: int | None = None,
        with_summary: bool = False,
        token_counter: TokenCounter | None = None,
    ) -> list[SessionMessage]:
        """Return the session's messages, oldest first.

        Args:
            session_id: The session.
            last: Only the newest `last` messages.
            since: Only messages numbered after `since` (a cursor: pass the last `seq` seen).
            max_tokens: Keep the newest messages whose tokens fit in this budget together
                (counted by `token_counter`, default the manager's). A message that does not
                fit ends the history there: older ones are left out even if they would fit.
            with_summary: Put the running summary first (as a `system` message numbered 0 with
                `metadata={"summary": True, "covers_through": n}`) and leave out the messages it
                covers. Its tokens count against `max_tokens`; without a summary, nothing is
                added.
            token_counter: Overrides the manager's counter for this call.

        A message whose number was given out but whose write has not landed yet (a concurrent
        append, or a writer that crashed in between) is absent; the others keep their order.

        Raises:
            NotFoundError: No such session.
        """
        _optional_count(last, "last", minimum=0)
        _optional_count(since, "since", minimum=0)
        _optional_count(max_tokens, "max_tokens", minimum=0)
        counter = token_counter or self.token_counter
        if not callable(counter):
            raise InvalidArgumentError("token_counter must be callable")

        def count_tokens(message: SessionMessage) -> int:
            tokens = counter(message)
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise InvalidArgumentError(f"token_counter must return an int >= 0, not {tokens!r}")
            return tokens

        session = await self._session(session_id)
        high = session.message_count
        low = 1 if since is None else since + 1
        head: list[SessionMessage] = []
        if with_summary:
            summary = await self.get_summary(session_id)
            if summary is not None:
                low = max(low, summary.covers_through + 1)
                head = [
                    SessionMessage(
                        session_id=session_id,
                        seq=0,
                        role="system",
                        content=summary.content,
                        metadata={"summary": True, "covers_through": summary.covers_through},
                        created_at=summary.updated_at,
                    )
                ]
        if last is not None:
            low = max(low, high - last + 1)
        budget = None if max_tokens is None else max_tokens - sum(map(count_tokens, head))
        if budget is not None and budget < 0:
            return []
        if budget is None:
            return head + await self._read_range(session_id, low, high)
        # Walk back from the newest in small batches until the budget is spent.
        kept: list[SessionMessage] = []
        top = high
        while top >= low:
            bottom = max(low, top - _BACKWARD_PAGE + 1)
            for message in reversed(await self._read_range(session_id, bottom, top)):
                budget -= count_tokens(message)
                if budget < 0:
                    kept.reverse()
                    return head + kept
                kept.append(message)
            top = bottom - 1
        kept.reverse()
        return head + kept

    async def _read_range(self, session_id: str, low: int, high: int) -> list[SessionMessage]:
        messages: list[SessionMessage] = []
        for start in range(low, high + 1, _PAGE):
            stop = min(high, start + _PAGE - 1)
            keys = [self._msg_key(session_id, n) for n in range(start, stop + 1)]
            found = await self.state.get_many(keys, model=SessionMessage)
            messages.extend(found[key] for key in keys if key in found)
        return messages

    async def get_summary(self, session_id: str) -> SessionSummary | None:
        """Return the session's running summary, or `None` if it has none."""
        return await self._load(self._key(session_id, "summary"), SessionSummary)

    async def summarize(
        self, session_id: str, summarizer: Summarizer, *, keep_last: int = 10
    ) -> SessionSummary | None:
        """Fold the messages older than the newest `keep_last` into the running summary.

        Calls `summarizer(previous_summary_or_None, messages_not_yet_covered)` (sync or async;
        typically an LLM call) and stores what it returns, marked as covering every message up to
        the last one it was given. Messages are kept; `get_messages(with_summary=True)` returns
        the summary followed by the messages it does not cover.

        It covers only what it read: the messages it gives the summarizer are numbered without
        a gap from the first one not yet covered, so a message whose number is taken but which
        is not stored yet (another process is appending it) stops the summary before it, and a
        later `summarize` covers it once it is there.

        Returns:
            The new summary, or `None` when no message beyond the summary is old enough.

        Raises:
            NotFoundError: No such session.
            ConflictError: Another `summarize` of the same session stored its summary first; the
                returned summary of that call stands (call again to extend it).
        """
        if type(keep_last) is not int or keep_last < 0:
            raise InvalidArgumentError(f"keep_last must be an int >= 0, not {keep_last!r}")
        if not callable(summarizer):
            raise InvalidArgumentError("summarizer must be callable")
        meta = await self.state.get_entry(self._key(session_id, "meta"), model=Session)
        if meta is None:
            raise NotFoundError(f"no session {session_id!r}")
        session: Session = meta.value
        key = self._key(session_id, "summary")
        entry = await self.state.get_entry(key, model=SessionSummary)
        previous: SessionSummary | None = None if entry is None else entry.value
        if entry is not None and entry.create_revision < meta.create_revision:
            previous = None  # an earlier life's summary, left behind: not this session's
        covered = 0 if previous is None else previous.covers_through
        through = session.message_count - keep_last
        if through <= covered:
            return None
        messages = _unbroken(await self._read_range(session_id, covered + 1, through), covered)
        if not messages:
            return None
        through = messages[-1].seq
        text = await maybe_await(
            summarizer(None if previous is None else previous.content, messages)
        )
        if not isinstance(text, str):
            raise InvalidArgumentError(
                f"the summarizer must return a str, not {type(text).__name__}"
            )
        summary = SessionSummary(session_id=session_id, content=text, covers_through=through)
        await self._store_summary(session_id, meta, entry, summary)
        return summary

    async def _store_summary(
        self,
        session_id: str,
        meta: StateEntry,
        entry: StateEntry | None,
        summary: SessionSummary,
    ) -> None:
        """Store `summary` where `entry` was read (`None`: none), in the session's life `meta`.

        One step compared on revisions: the summary as read, and unless this life of the
        session wrote it, the session record (appends move it on: then it is read again, in the
        same step).

        Raises:
            ConflictError: Another summary was stored since `entry` was read.
            NotFoundError: The session was deleted since `meta` was read.
        """
        key, meta_key = self._key(session_id, "summary"), self._key(session_id, "meta")
        read = 0 if entry is None else entry.revision
        try:
            for attempt in self._retries():
                compare = [Revision(key, read)]
                if entry is None or entry.create_revision < meta.create_revision:
                    compare.append(Revision(meta_key, meta.revision))
                ttl = self._time_left(session_id, meta.value.expires_at)
                done = await self._step(
                    compare, [Put(key, summary, ttl=ttl)], [Get(key), Get(meta_key, model=Session)]
                )
                if done.succeeded:
                    return
                now, fresh = done.results
                if fresh is None or fresh.create_revision != meta.create_revision:
                    raise self._gone(session_id)
                if (0 if now is None else now.revision) != read:
                    raise ConflictError(
                        f"another summarize of session {session_id!r} stored its summary first",
                        key=key,
                    )
                meta = fresh
                await anyio.sleep(jitter(attempt))
            raise ConflictError(f"session {session_id!r} kept changing; try again", key=key)
        except _NoSteps:
            await self.state.save(
                key,
                summary,
                ttl=self._time_left(session_id, meta.value.expires_at),
                expected_version=0 if entry is None else entry.version,
            )


def _unbroken(messages: list[SessionMessage], covered: int) -> list[SessionMessage]:
    """The messages numbered `covered + 1`, `covered + 2`, ... up to the first one missing."""
    run: list[SessionMessage] = []
    for message in messages:
        if message.seq != covered + len(run) + 1:
            break
        run.append(message)
    return run


def render_template(
    template: str, state: Mapping[str, Any], *, missing: Literal["error", "keep"] = "error"
) -> str:
    """Substitute `{key}` and `{key.sub}` placeholders from `state` (see `SessionManager.render`).

    Raises:
        NotFoundError: A placeholder names something `state` lacks (with `missing="error"`).
    """

    def substitute(match: re.Match[str]) -> str:
        text = match.group(0)
        if text == "{{":
            return "{"
        if text == "}}":
            return "}"
        value: Any = state
        for part in match.group(1).split("."):
            if isinstance(value, Mapping) and part in value:
                value = value[part]
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                if missing == "keep":
                    return text
                raise NotFoundError(f"the session state has no {match.group(1)!r} for {text}")
        if isinstance(value, str):
            return value
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)

    return _PLACEHOLDER.sub(substitute, template)
