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
left behind nor carried into the new session. A key written by a life is created by that life
(a key an earlier life left under the same name is deleted and written anew in the same step),
so a key's `create_revision` tells which life it belongs to. The delete removes the record and
writes a deletion marker in one step, erases the keys created before the marker (those of the
lives it ended), leaving alone those a session created again meanwhile wrote, then removes the
marker and the user's index entry. Killed half way, it leaves the marker and the index entry:
the next delete of the id, or the owner's `delete_user`, finishes it, and reads never show
what an earlier life left. On a backend without `transact` or revisions, appends and state
writes take the older multi-call path, where a write racing a delete can outlive it.

Key layout (the session id sits in a `{...}` hash tag, so one session lives in one Redis Cluster
slot):

| record | key |
|---|---|
| `Session` (user, name, times, message count) | `sessions:{<session_id>}:meta` |
| session state (a dict) | `sessions:{<session_id>}:state` |
| `SessionMessage` number `n` | `sessions:{<session_id>}:msg:<n, 12 digits>` |
| `SessionSummary` | `sessions:{<session_id>}:summary` |
| a delete under way (or stopped half way) | `sessions:{<session_id>}:deleting` |
| a user's sessions (sorted index, newest first) | `sessions:users:{<user_id>}` |

The user's index has one entry per life of a session id, `<session_id>}<created_at in µs>` (an
id holds no `}`); an entry an older release wrote names the id alone.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from copy import deepcopy
from datetime import UTC, datetime, timedelta
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
    optional_count,
    revise,
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


class _Deleting(BaseModel):
    """The deletion marker: a delete of the id is under way, or stopped half way (internal).

    Its revision parts the keys of the lives that delete ended from a later life's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    user_id: str | None = None
    """The user whose index still names the ended life until the delete is finished."""
    member: str | None = None
    """That index entry."""


class SessionDeletion(BaseModel):
    """What `delete_user` erased."""

    model_config = ConfigDict(frozen=True)

    sessions: int = 0
    messages: int = 0
    keys: int = 0
    """Every key deleted: session records, states, messages and summaries."""


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _life(session: Session) -> str:
    """What tells this life of a session's id from another: its creation, in microseconds."""
    created = session.created_at
    if created.tzinfo is None:
        created = created.replace(tzinfo=UTC)
    return str((created - _EPOCH) // timedelta(microseconds=1))


def _member(session: Session) -> str:
    """The user-index entry of one life of a session: `<session_id>}<life>`.

    An id holds no `}` (see `key_part`): the first one ends it. An entry an older release wrote
    is the id alone (its life unknown).
    """
    return f"{session.session_id}}}{_life(session)}"


def _parse_member(member: str) -> tuple[str, str | None]:
    """The session id and life (`None`: unknown) of a user-index entry."""
    sid, brace, life = member.partition("}")
    return sid, life if brace else None


def _as_datetime(value: object) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


def _positive_ttl(ttl: timedelta | float | None) -> timedelta | None:
    return as_ttl(ttl)


_optional_count = optional_count


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
        # The user's index first: whatever happens next, delete_user finds this session. The
        # entry names this life of the id, so a delete of an earlier life never removes it.
        member = _member(session)
        added = await self.state.index_add(index, {member: -sort_time(now)})
        try:
            await self._store_new(session, first, life)
        except ConflictError:
            if added:
                await self.state.index_remove(index, [member])
            raise ConflictError(f"session {sid!r} already exists", key=sid) from None
        self.log.debug("session_created", session_id=sid)
        return session

    async def _store_new(
        self, session: Session, first: dict[str, Any], life: timedelta | None
    ) -> None:
        """Write a new session's record and first state, in one step where the backend can.

        The state key is deleted and written anew in the step: a key an earlier life of the id
        left (its delete still under way) then never passes for this life's (see
        `_delete_session`).

        Raises:
            ConflictError: A session with this id exists.
        """
        sid = session.session_id
        meta_key, state_key = self._key(sid, "meta"), self._key(sid, "state")
        try:
            done = await self._step(
                [Revision(meta_key, 0)],
                [
                    Put(meta_key, session, ttl=life),
                    Delete(state_key),
                    Put(state_key, first, ttl=life),
                ],
            )
        except _NoSteps:
            await self.state.save(meta_key, session, ttl=life, expected_version=0)
            await self.state.save(state_key, first, ttl=life)
            return
        if not done.succeeded:
            raise ConflictError(f"session {sid!r} already exists", key=sid)

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
            members = [(member, score) for member, score in members if -score < cutoff]
        sessions: list[Session] = []
        listed: set[str] = set()
        stale: list[str] = []
        stale_before = sort_time(utcnow() - _CREATION_GRACE)
        for start in range(0, len(members), _PAGE):
            page = [
                (member, score, *_parse_member(member))
                for member, score in members[start : start + _PAGE]
            ]
            found = await self.state.get_many(
                [self._key(sid, "meta") for _, _, sid, _ in page], model=Session
            )
            for member, score, sid, life in page:
                session = found.get(self._key(sid, "meta"))
                ours = (
                    session is not None
                    and session.user_id == user_id
                    and life in (None, _life(session))
                )
                if ours and session is not None:
                    if sid not in listed:  # an entry of an older release may name it too
                        listed.add(sid)
                        sessions.append(session)
                # The index outlives expired sessions, creations that stopped half way and
                # deletes that stopped before their last step: tidy those, but not one whose
                # creation may still be under way.
                elif session is not None or -score < stale_before:
                    stale.append(member)
            if limit is not None and len(sessions) >= limit:
                break
        if stale:
            # An entry whose session's delete stopped half way stays: delete_user finishes it.
            marks = await self.state.get_many(
                [self._key(_parse_member(member)[0], "deleting") for member in stale],
                model=_Deleting,
            )
            stale = [
                member
                for member in stale
                if marks.get(self._key(_parse_member(member)[0], "deleting")) is None
            ]
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
        existed, _, _, unindex = await self._delete_session(session_id, None)
        if unindex is not None:
            user_id, member = unindex
            # The ended life's entry (and one an older release wrote, naming the id alone).
            await self.state.index_remove(self._user_index(user_id), [member, session_id])
        return existed

    async def _delete_session(
        self, session_id: str, user_id: str | None
    ) -> tuple[bool, int, int, tuple[str, str] | None]:
        """Delete a session's keys.

        Returns whether it existed, the keys and messages erased, and the user whose index
        still names the ended life with that entry (`None`: unknown). With `user_id`, a session
        that belongs to someone else is left alone (an index entry that outlived a refused
        `create_session` must not let one user erase another's); what an unfinished delete of
        an earlier life left behind is erased all the same.

        In three parts, each safe to stop after and resumed by the next delete of the id (a
        `delete_session`, or the `delete_user` whose index still names it):

        1. One step compared on the session record as read: the record is deleted and the
           deletion marker (`sessions:{<id>}:deleting`) written. Every write of the ended life
           is refused from then on (see the module docstring), and the marker's revision parts
           the keys of the lives ended by then (created before it) from those of a session
           created again since (created after it).
        2. Every key of the id created before the marker is deleted, each compared on its
           revision as read.
        3. The marker is deleted (the caller then removes the id from its user's index).

        Reads ignore what an earlier life left (`get_state`, `get_summary`, `get_messages`
        compare each key's `create_revision` with the record's), so a delete stopped half way
        never shows in a session created again under the id.
        """
        self._expiries.pop(session_id, None)
        self._metas.pop(session_id, None)
        meta_key, mark_key = self._key(session_id, "meta"), self._key(session_id, "deleting")
        try:
            for attempt in self._retries():
                meta, mark = (
                    await self._step([], [Get(meta_key, model=Session), Get(mark_key, _Deleting)])
                ).results
                if meta is not None and user_id is not None and meta.value.user_id != user_id:
                    # Someone else's session: finish only an earlier life's unfinished delete.
                    if mark is None:
                        return False, 0, 0, None
                    keys, messages = await self._erase_before(session_id, mark.revision)
                    await self._unmark(mark_key, mark.revision)
                    return False, keys, messages, None
                if meta is not None:
                    mark_value = _Deleting(user_id=meta.value.user_id, member=_member(meta.value))
                elif mark is not None:
                    mark_value = mark.value
                else:
                    mark_value = _Deleting(user_id=user_id)
                if (
                    meta is None
                    and mark is None
                    and not await self.state.list_keys(self._keys.glob(session_id, "*"))
                ):
                    return False, 0, 0, None  # nothing of it is stored
                done = await self._step(
                    [
                        Revision(meta_key, 0 if meta is None else meta.revision),
                        Revision(mark_key, 0 if mark is None else mark.revision),
                    ],
                    [
                        Delete(meta_key),
                        Put(mark_key, mark_value, ttl=self._marker_ttl(meta)),
                    ],
                )
                if done.succeeded:
                    break
                await anyio.sleep(jitter(attempt))  # it changed meanwhile: read it again
            else:
                raise ConflictError(f"session {session_id!r} kept changing; try again")
        except _NoSteps:
            return await self._delete_plain(session_id, user_id)
        ended = done.revisions[1]
        keys, messages = await self._erase_before(session_id, ended)
        await self._unmark(mark_key, ended)
        existed = meta is not None
        keys += existed
        if existed:
            self.log.debug("session_deleted", session_id=session_id, keys=keys)
        unindex = None
        if mark_value.user_id is not None and mark_value.member is not None:
            unindex = (mark_value.user_id, mark_value.member)
        return existed, keys, messages, unindex

    @staticmethod
    def _marker_ttl(meta: StateEntry | None) -> timedelta | None:
        # Every key of a session with a lifetime expires with it: so may the marker.
        expires: datetime | None = None if meta is None else meta.value.expires_at
        if expires is None:
            return None
        return max(expires - utcnow(), timedelta(seconds=1))

    async def _unmark(self, mark_key: str, revision: int) -> None:
        """Delete the deletion marker written at `revision` (another delete's is left alone)."""
        with contextlib.suppress(ConflictError):
            await self.state.delete(mark_key, expected_revision=revision)

    async def _erase_before(self, session_id: str, ended: int) -> tuple[int, int]:
        """Delete every key of the id created before revision `ended`.

        Returns the keys and messages deleted (the deletion marker aside).
        """
        mark_key = self._key(session_id, "deleting")
        listed = [
            key
            for key in await self.state.list_keys(self._keys.glob(session_id, "*"))
            if key != mark_key
        ]
        keys = messages = 0
        for start in range(0, len(listed), _PAGE):
            for key in await self._erase(listed[start : start + _PAGE], ended):
                keys += 1
                messages += ":msg:" in key
        return keys, messages

    async def _erase(self, keys: list[str], ended: int) -> list[str]:
        """Delete the keys created before revision `ended`; return those deleted.

        Each is read, then deleted only as read (`expected_revision`), so a key a session
        created again since wrote (created after `ended`) is left alone.
        """
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

    async def _delete_plain(
        self, session_id: str, user_id: str | None
    ) -> tuple[bool, int, int, tuple[str, str] | None]:
        """`_delete_session` on a backend without `transact` or revisions: every key as it is."""
        session = await self.get_session(session_id)
        if session is not None and user_id is not None and session.user_id != user_id:
            return False, 0, 0, None
        existed = await self.state.delete(self._key(session_id, "meta"))
        keys, messages = int(existed), 0
        for key in await self.state.list_keys(self._keys.glob(session_id, "*")):
            if await self.state.delete(key):
                keys += 1
                messages += ":msg:" in key
        unindex = None if session is None else (session.user_id, _member(session))
        return existed, keys, messages, unindex

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
            for sid in dict.fromkeys(_parse_member(member)[0] for member, _ in members):
                existed, erased, erased_messages, _ = await self._delete_session(sid, user_id)
                sessions += existed
                keys += erased
                messages += erased_messages
            # Only once each is erased: a delete stopped half way is found here again. The
            # entries as read: a session created again since has an entry of its own.
            await self.state.index_remove(index, [member for member, _ in members])
        self.log.debug("user_deleted", sessions=sessions, messages=messages)
        return SessionDeletion(sessions=sessions, messages=messages, keys=keys)

    # ---------------------------------------------------------------- session state

    async def get_state(self, session_id: str) -> dict[str, Any]:
        """Return the session state (a dict).

        Raises:
            NotFoundError: No such session.
        """
        key = self._key(session_id, "state")
        try:
            meta, entry = (
                await self._step([], [Get(self._key(session_id, "meta"), model=Session), Get(key)])
            ).results
        except _NoSteps:
            value = await self.state.get(key)
            if value is None:
                # A session whose creation stopped between its two writes has the default state.
                await self._session(session_id)
                return deepcopy(self.default_state)
            return dict(value)
        if meta is None:
            raise NotFoundError(f"no session {session_id!r}")
        if entry is None or entry.create_revision < meta.create_revision:
            # None stored, or only what an earlier life of the id left (its delete under way).
            return deepcopy(self.default_state)
        return dict(entry.value)

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
        if isinstance(change, Mapping):
            # Key by key, so a value that cannot be stored is named by its own path.
            self._check_mapping(change, "$")
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
            then: list[Any] = [Put(key, new, ttl=ttl)]
            if not ours:
                compare.append(Revision(meta_key, meta.revision))
                if current is not None:  # an earlier life's: this life's key starts anew
                    then.insert(0, Delete(key))
            if (await self._step(compare, then)).succeeded:
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
        message = revise(message, seq=stored["message_count"])
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
            numbered = revise(message, seq=seq)
            counted = revise(session, message_count=seq, updated_at=message.created_at)
            done = await self._step(
                [Revision(meta_key, entry.revision)],
                [
                    Put(meta_key, counted, ttl=ttl),
                    # A key under this number is an earlier life's (its delete under way): this
                    # life's message starts anew, so that delete leaves it alone.
                    Delete(self._msg_key(session_id, seq)),
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

        summary: SessionSummary | None = None
        if with_summary:
            found, summary = await self._with_summary(session_id)
            if found is None:
                raise NotFoundError(f"no session {session_id!r}")
            session = found
        else:
            session = await self._session(session_id)
        high = session.message_count
        low = 1 if since is None else since + 1
        head: list[SessionMessage] = []
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
        """Return the session's running summary, or `None` if it has none (or no session)."""
        return (await self._with_summary(session_id))[1]

    async def _with_summary(self, session_id: str) -> tuple[Session | None, SessionSummary | None]:
        """The session and its summary, read together.

        A summary an earlier life of the id left (its delete under way, or stopped half way) is
        not this session's: `None`.
        """
        meta_key, key = self._key(session_id, "meta"), self._key(session_id, "summary")
        try:
            meta, entry = (
                await self._step([], [Get(meta_key, model=Session), Get(key, SessionSummary)])
            ).results
        except _NoSteps:
            session = await self._load(meta_key, Session)
            return session, await self._load(key, SessionSummary)
        if meta is None:
            return None, None
        if entry is None or entry.create_revision < meta.create_revision:
            return meta.value, None
        return meta.value, entry.value

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
                then: list[Any] = []
                if entry is None or entry.create_revision < meta.create_revision:
                    compare.append(Revision(meta_key, meta.revision))
                    if entry is not None:  # an earlier life's: this life's starts anew
                        then.append(Delete(key))
                ttl = self._time_left(session_id, meta.value.expires_at)
                then.append(Put(key, summary, ttl=ttl))
                done = await self._step(compare, then, [Get(key), Get(meta_key, model=Session)])
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
