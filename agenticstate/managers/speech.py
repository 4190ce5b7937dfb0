"""Speech sessions: lifecycle, speech-to-text and text-to-speech state, conversation turns.

```python
speech_state = SpeechStateManager(persistence="redis")
session_id = await speech_state.create_session(session_type="voice_conversation",
                                               streaming_mode=StreamingMode.BIDIRECTIONAL)
await speech_state.update_session_status(session_id=session_id, status=AudioSessionStatus.ACTIVE)
await speech_state.update_stt_state(STTState(session_id=session_id, interim_transcript="Hel"))
await speech_state.append_turn(session_id, "user", "Hello")
await speech_state.end_session(session_id=session_id, reason="user_ended")
```

STT and TTS updates are single writes of small records (no read-modify-write): while the session
is live, one atomic step (`StateManager.transact`, one command on Redis) writes the record if the
session's live marker is there, so interim transcripts can stream at high frequency. The marker
(`speech:{<session_id>}:live`) exists exactly while the session is live, with the session's own
time to live: it is written in the same step as every write of a live session record, and
deleted in the same step as the session ends. Without it (ended, expired, never created, or a
session stored before markers existed) the same step writes the record and reads the session
instead, and the update is handled as a late one (below); a live session found that way gets
its marker. A backend without `transact` writes, then reads the session, as two calls. Conversation
turns are appended atomically, so turns from several writers are never lost. An ended session's
keys expire after `ended_session_ttl`, and so does any STT, TTS or conversation update that
arrives after the session ended or expired: it is kept, and expires with the ended session.

With `session_ttl`, a live session and its records live at least `session_ttl` after the last
write to any of them (at most twice that): every record is written with a lease of 2 x
`session_ttl`, and a write that finds the session with less than 1.5 x `session_ttl` left renews
the lease of the session and of all its records at once. So a stream of updates renews about
every half `session_ttl`, not on every write, and a write has half a `session_ttl` of slack to
reach its renewal before a sibling record could run out.

Key layout (the session id sits in a `{...}` hash tag, so one session lives in one Redis Cluster
slot): `speech:{<session_id>}:session`, `:stt`, `:tts`, `:conversation`, and the live marker
`:live`.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import uuid4

import anyio
from pydantic import BaseModel, ConfigDict, Field

from agenticstate import txn
from agenticstate._checks import duration
from agenticstate.exceptions import (
    ConflictError,
    InvalidArgumentError,
    InvalidTransitionError,
    NotFoundError,
    UnsupportedOperationError,
)
from agenticstate.managers._base import StateManagerBase, TaggedKeys, revise, utcnow

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from agenticstate.manager import StateManager
    from agenticstate.managers._base import Persistence

__all__ = [
    "AudioSession",
    "AudioSessionStatus",
    "STTState",
    "SpeechStateManager",
    "StreamingMode",
    "TTSState",
    "TranscriptionStatus",
    "VoiceConversationState",
]


class AudioSessionStatus(StrEnum):
    """Where a speech session is."""

    INITIALIZING = "initializing"
    """Created, audio not flowing yet."""
    ACTIVE = "active"
    PAUSED = "paused"
    ERROR = "error"
    """Something failed; the session may become active again or end."""
    ENDED = "ended"
    """Finished (terminal); its keys expire after `ended_session_ttl`."""


SESSION_TRANSITIONS: dict[AudioSessionStatus, frozenset[AudioSessionStatus]] = {
    AudioSessionStatus.INITIALIZING: frozenset(
        {AudioSessionStatus.ACTIVE, AudioSessionStatus.ERROR, AudioSessionStatus.ENDED}
    ),
    AudioSessionStatus.ACTIVE: frozenset(
        {AudioSessionStatus.PAUSED, AudioSessionStatus.ERROR, AudioSessionStatus.ENDED}
    ),
    AudioSessionStatus.PAUSED: frozenset(
        {AudioSessionStatus.ACTIVE, AudioSessionStatus.ERROR, AudioSessionStatus.ENDED}
    ),
    AudioSessionStatus.ERROR: frozenset({AudioSessionStatus.ACTIVE, AudioSessionStatus.ENDED}),
    AudioSessionStatus.ENDED: frozenset(),
}
"""The legal moves between session statuses."""


class StreamingMode(StrEnum):
    """Which directions audio streams in."""

    BATCH = "batch"
    """Whole utterances, no streaming."""
    STT_ONLY = "stt_only"
    """Streaming speech-to-text only."""
    TTS_ONLY = "tts_only"
    """Streaming text-to-speech only."""
    BIDIRECTIONAL = "bidirectional"
    """Both at once (a live voice conversation)."""


class TranscriptionStatus(StrEnum):
    """Where speech-to-text is."""

    IDLE = "idle"
    LISTENING = "listening"
    TRANSCRIBING = "transcribing"
    COMPLETED = "completed"
    ERROR = "error"


class AudioSession(BaseModel):
    """A speech session."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    session_type: str = "voice_conversation"
    streaming_mode: StreamingMode = StreamingMode.BIDIRECTIONAL
    status: AudioSessionStatus = AudioSessionStatus.INITIALIZING
    config: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)
    ended_at: datetime | None = None
    end_reason: str | None = None


class STTState(BaseModel):
    """Speech-to-text progress."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    status: TranscriptionStatus = TranscriptionStatus.IDLE
    audio_received_bytes: int = Field(default=0, ge=0)
    transcription_progress: float = Field(default=0.0, ge=0.0, le=1.0)
    interim_transcript: str = ""
    final_transcript: str = ""
    language: str | None = None
    confidence: float | None = None
    updated_at: datetime = Field(default_factory=utcnow)


class TTSState(BaseModel):
    """Text-to-speech progress."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    text_queue: list[str] = Field(default_factory=list)
    current_text: str | None = None
    audio_generated_bytes: int = Field(default=0, ge=0)
    audio_played_bytes: int = Field(default=0, ge=0)
    is_speaking: bool = False
    voice: str | None = None
    updated_at: datetime = Field(default_factory=utcnow)


class VoiceConversationState(BaseModel):
    """The conversation in a session: turns so far, who speaks, the latest STT and TTS state."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    turn_count: int = Field(default=0, ge=0)
    current_speaker: str | None = None
    stt_state: STTState | None = None
    tts_state: TTSState | None = None
    transcript: list[dict[str, Any]] = Field(default_factory=list)
    updated_at: datetime = Field(default_factory=utcnow)


E = TypeVar("E", bound=StrEnum)

_PARTS = ("stt", "tts", "conversation")
"""The records a session has besides its own."""

_LIVE = "live"
"""The marker key's part: present exactly while the session is live."""

_MARK_MARGIN = timedelta(milliseconds=50)
"""A marker added to a session found without one expires this much before the session."""


def _enum(kind: type[E], value: str) -> E:
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(member.value for member in kind)
        raise InvalidArgumentError(f"{value!r} is not a {kind.__name__} ({known})") from None


class SpeechStateManager(StateManagerBase):
    """Speech sessions and their STT, TTS and conversation state.

    Args:
        state_manager: Where to store records (or use the shorthand below).
        persistence: `"memory"`, `"file"`, `"sqlite"`, `"redis"` or any registered backend
            name (the AgenticAI Framework shorthand).
        redis_url: With `persistence="redis"`.
        base_path: With `persistence="file"`.
        key_prefix: With the shorthand: a namespace before every key.
        ended_session_ttl: How long an ended session's state is kept.
        session_ttl: A time to live for live sessions, renewed by every write to them: a
            status change, an STT or TTS update, a conversation update or a turn. A live
            session and all its records live at least this long after the last write (at most
            twice that). None: live sessions never expire.
    """

    def __init__(
        self,
        *,
        state_manager: StateManager | None = None,
        persistence: Persistence | None = None,
        redis_url: str | None = None,
        base_path: str | Path | None = None,
        key_prefix: str = "",
        ended_session_ttl: timedelta = timedelta(hours=1),
        session_ttl: timedelta | None = None,
    ) -> None:
        duration(ended_session_ttl, "ended_session_ttl", optional=False)
        duration(session_ttl, "session_ttl")
        super().__init__(
            state_manager=state_manager,
            persistence=persistence,
            redis_url=redis_url,
            base_path=base_path,
            key_prefix=key_prefix,
        )
        self.ended_session_ttl = ended_session_ttl
        self.session_ttl = session_ttl
        # Every write gives a live session's records this long; renewal comes due once less
        # than 1.5 x session_ttl is left, so a record outlives the last write by session_ttl
        # with half a session_ttl to spare for the write's own latency.
        self._lease = session_ttl * 2 if session_ttl is not None else None
        self._renew_below = session_ttl * 1.5 if session_ttl is not None else None
        self._transact = True
        """Whether the backend has `transact`; False once it raised UnsupportedOperationError."""

    # keys: every key this manager writes is built here (the layout is in the module docstring)

    _keys = TaggedKeys("speech", "session_id")

    @staticmethod
    def _key(session_id: str, part: str) -> str:
        return SpeechStateManager._keys.key(session_id, part)

    # sessions

    async def create_session(
        self,
        session_type: str = "voice_conversation",
        streaming_mode: StreamingMode | str = StreamingMode.BIDIRECTIONAL,
        config: dict[str, Any] | None = None,
        *,
        session_id: str | None = None,
    ) -> str:
        """Create a session and return its id.

        Raises:
            ConflictError: A session with this id exists.
            SerializationError: `config` holds a value that cannot be stored (the path names
                it, `$.config.<key>`); nothing was written.
        """
        session = AudioSession(
            session_id=session_id or uuid4().hex,
            session_type=session_type,
            streaming_mode=_enum(StreamingMode, streaming_mode),
            config=config or {},
        )
        self._check_record(session)
        key = self._key(session.session_id, "session")
        done = await self._try_transact(
            [txn.Version(key, 0)],
            [
                txn.Put(key, session, ttl=self._lease),
                txn.Put(self._key(session.session_id, _LIVE), 1, ttl=self._lease),
            ],
        )
        if done is None or not done.succeeded:
            # No transact, or the id is taken: the plain write (it raises the ConflictError).
            await self.state.save(key, session, ttl=self._lease, expected_version=0)
        return session.session_id

    async def _try_transact(
        self,
        compare: list[txn.Version | txn.Revision | txn.Exists],
        then: list[txn.Op],
        orelse: list[txn.Op] | None = None,
    ) -> txn.TransactResult | None:
        """`state.transact(...)`, or None if the backend cannot (asked only once).

        It cannot when it has no `transact`, or keeps no revisions to compare.
        """
        if not self._transact:
            return None
        try:
            return await self.state.transact(compare, then, orelse or [])
        except UnsupportedOperationError:
            self._transact = False
            return None

    async def _write_session(
        self,
        session_id: str,
        fn: Callable[[AudioSession], AudioSession],
        *,
        ttl: timedelta | None,
    ) -> AudioSession:
        """Replace the session with `fn(session)`, its live marker following in the same step.

        A compare-and-set on the session's revision: the marker is written with the session's
        TTL while it is live and deleted when it ends, so it never outlives a live session nor
        survives its end. Without `transact`, an atomic update of the session alone.

        Raises:
            NotFoundError: No such session.
            ConflictError: Every attempt lost a race (`update_max_attempts` of them).
        """
        key = self._key(session_id, "session")
        live = self._key(session_id, _LIVE)
        attempts = self.state.config.update_max_attempts
        for attempt in range(attempts):
            if not self._transact:
                break
            entry = await self.state.get_entry(key, model=AudioSession)
            if entry is None:
                raise NotFoundError(f"no speech session {session_id!r}")
            session = fn(entry.value)
            ended = session.status is AudioSessionStatus.ENDED
            marker = txn.Delete(live) if ended else txn.Put(live, 1, ttl=ttl)
            done = await self._try_transact(
                [txn.Revision(key, entry.revision)], [txn.Put(key, session, ttl=ttl), marker]
            )
            if done is None:
                break
            if done.succeeded:
                return session
            await anyio.sleep(random.uniform(0, 0.001 * 2 ** min(attempt, 6)))  # noqa: S311  # jitter
        else:
            raise ConflictError(
                f"session {session_id!r} changed {attempts} times in a row; try again", key=key
            )

        def step(current: Any) -> Any:
            return fn(AudioSession.model_validate(current))

        return AudioSession.model_validate(await self._update(session_id, "session", step, ttl=ttl))

    async def get_session(self, session_id: str) -> AudioSession | None:
        """Return the session, or None (also once an ended session has expired)."""
        return await self._load(self._key(session_id, "session"), AudioSession)

    async def update_session_status(
        self, session_id: str, status: AudioSessionStatus | str
    ) -> AudioSession:
        """Move the session to `status` (legal moves only; see `SESSION_TRANSITIONS`).

        Raises:
            NotFoundError: No such session.
            InvalidTransitionError: The move is not allowed; nothing changed.
        """
        target = _enum(AudioSessionStatus, status)
        if target is AudioSessionStatus.ENDED:
            return await self.end_session(session_id)

        def move(session: AudioSession) -> AudioSession:
            if target not in SESSION_TRANSITIONS[session.status]:
                raise InvalidTransitionError(
                    f"session {session_id!r} cannot go from {session.status.value} "
                    f"to {target.value}"
                )
            return revise(session, status=target, updated_at=utcnow())

        moved = await self._write_session(session_id, move, ttl=self._lease)
        if self._lease is not None:
            await self._renew_parts(session_id)  # the session got a fresh lease: so do they
        return moved

    async def end_session(self, session_id: str, reason: str | None = None) -> AudioSession:
        """End the session; its state expires after `ended_session_ttl`.

        Raises:
            NotFoundError: No such session.
            InvalidTransitionError: It has ended already.
        """

        def end(session: AudioSession) -> AudioSession:
            if session.status is AudioSessionStatus.ENDED:
                raise InvalidTransitionError(f"session {session_id!r} has ended already")
            now = utcnow()
            return revise(
                session,
                status=AudioSessionStatus.ENDED,
                ended_at=now,
                updated_at=now,
                end_reason=reason,
            )

        ended = await self._write_session(session_id, end, ttl=self.ended_session_ttl)
        for part in _PARTS:
            await self._expire_part(session_id, part, self.ended_session_ttl)
        self.log.info("speech_session_ended", session_id=session_id, reason=reason)
        return ended

    async def _expire_part(self, session_id: str, part: str, ttl: timedelta | None) -> None:
        """Rewrite a part as it is now, with `ttl` (an update: a newer write is never undone)."""
        try:
            await self.state.update(self._key(session_id, part), lambda current: current, ttl=ttl)
        except NotFoundError:
            return  # never written, or expired

    async def _save_part(self, session_id: str, part: str, value: BaseModel) -> None:
        """Write a part, then make sure it does not outlive a session that has ended.

        One atomic step: while the live marker is there, write the part (the session is live);
        otherwise write it and read the session. A concurrent `end_session` is always seen by
        one of the two: either this step finds the session ended (marker gone) and the part
        gets the session's remaining time, or `end_session` rewrites the part with its TTL
        after this write. Without `transact`: the write, then the read of the session.
        """
        key = self._key(session_id, part)
        session_key = self._key(session_id, "session")
        live = self._key(session_id, _LIVE)
        write = txn.Put(key, value, ttl=self._lease)
        # The marker's time left is the session's: read it only where renewal needs it.
        then: list[txn.Op] = [write, txn.Get(live)] if self._renew_below is not None else [write]
        done = await self._try_transact(
            [txn.Exists(live)], then, [write, txn.Get(session_key, model=AudioSession)]
        )
        if done is None:
            written = {"expected_version": await self.state.save(key, value, ttl=self._lease)}
            entry = await self.state.get_entry(session_key, model=AudioSession)
        elif done.succeeded:
            if len(done.results) > 1 and done.results[1] is not None:
                await self._renew_if_due(session_id, done.results[1].ttl)
            return  # a live session: the part lives as the session does
        else:
            written = (
                {"expected_revision": done.revisions[0]}
                if self.state.backend.has_revisions
                else {"expected_version": done.results[0]}
            )
            entry = done.results[1]
            if entry is not None and entry.value.status is not AudioSessionStatus.ENDED:
                await self._mark_live(session_id, entry.revision, entry.ttl)
        if entry is None:
            life: timedelta | None = self.ended_session_ttl  # expired, or never created
        elif entry.value.status is AudioSessionStatus.ENDED:
            life = entry.ttl
        else:
            await self._renew_if_due(session_id, entry.ttl)
            return  # a live session: the part lives as the session does
        if life is None:
            return  # the ended session never expires either
        life = max(life, timedelta(milliseconds=1))
        try:
            await self.state.save(key, value, ttl=life, **written)
        except ConflictError:
            return  # written again meanwhile: that write checks the session itself
        self.log.debug("speech_late_update", session_id=session_id, part=part)

    async def _mark_live(self, session_id: str, revision: int, left: timedelta | None) -> None:
        """Give a live session found without a marker its marker, if still at `revision`.

        Such a session was stored before markers existed, or its marker just ran out. The
        marker lives a little less than the session's `left` (read a moment ago), so it never
        outlives the session.
        """
        if left is not None:
            left -= _MARK_MARGIN
            if left <= timedelta(0):
                return
        await self._try_transact(
            [txn.Revision(self._key(session_id, "session"), revision)],
            [txn.Put(self._key(session_id, _LIVE), 1, ttl=left)],
        )

    async def _renew_if_due(self, session_id: str, left: timedelta | None) -> None:
        """Renew the lease of a live session and its records once it runs low (1.5 x session_ttl).

        `left` is the session's time to live as read just after a write to the session.
        """
        if self._renew_below is None or left is None or left >= self._renew_below:
            return

        def renew(session: AudioSession) -> AudioSession:
            if session.status is AudioSessionStatus.ENDED:
                raise InvalidTransitionError(f"session {session_id!r} has ended")
            return session

        try:
            await self._write_session(session_id, renew, ttl=self._lease)
        except (InvalidTransitionError, NotFoundError):
            return  # ended or expired meanwhile: the write's own check handled it
        await self._renew_parts(session_id)

    async def _renew_parts(self, session_id: str) -> None:
        """Give a live session's records a fresh lease (after the session got one)."""
        for part in _PARTS:
            await self._expire_part(session_id, part, self._lease)
        # A session that ended while its records were renewed must not leave them a lease
        # longer than its own time left: give them that time again.
        after = await self.state.get_entry(self._key(session_id, "session"), model=AudioSession)
        if after is None or after.value.status is AudioSessionStatus.ENDED:
            life = after.ttl if after is not None else self.ended_session_ttl
            if life is not None:
                for part in _PARTS:
                    await self._expire_part(session_id, part, max(life, timedelta(milliseconds=1)))
        self.log.debug("speech_session_renewed", session_id=session_id)

    async def list_sessions(self, *, active_only: bool = True) -> list[AudioSession]:
        """Return sessions (by default those not ended), oldest first."""
        found = await self._load_many(self._keys.every("session"), AudioSession)
        if active_only:
            found = [s for s in found if s.status is not AudioSessionStatus.ENDED]
        return sorted(found, key=lambda s: (s.created_at.timestamp(), s.session_id))

    async def list_session_ids(self) -> list[str]:
        """Return the ids of every session (ended ones too, until their keys expire), sorted."""
        return await self._keys.ids(self.state, "session")

    async def list_active_sessions(self) -> list[AudioSession]:
        """Return the sessions that have not ended."""
        return await self.list_sessions(active_only=True)

    async def _update(
        self, session_id: str, part: str, fn: Any, *, ttl: timedelta | None = None
    ) -> Any:
        try:
            return await self.state.update(
                self._key(session_id, part), fn, ttl=ttl if ttl is not None else self._lease
            )
        except NotFoundError:
            raise NotFoundError(f"no speech session {session_id!r}") from None

    # STT and TTS

    async def update_stt_state(self, stt_state: STTState) -> STTState:
        """Store the session's speech-to-text state (one write: fit for interim transcripts).

        An update that arrives after the session ended is still stored (a final transcript
        often comes just after the call ends) and expires with the ended session; one for a
        session that expired, or was never created, expires after `ended_session_ttl`.
        """
        if not isinstance(stt_state, STTState):
            raise InvalidArgumentError("update_stt_state takes an STTState")
        self._check_record(stt_state)
        await self._save_part(stt_state.session_id, "stt", stt_state)
        return stt_state

    async def get_stt_state(self, session_id: str) -> STTState | None:
        """Return the session's speech-to-text state, or None."""
        return await self._load(self._key(session_id, "stt"), STTState)

    async def update_tts_state(self, tts_state: TTSState) -> TTSState:
        """Store the session's text-to-speech state (one write).

        After the session ended (or expired), as `update_stt_state`: stored, and expiring with
        the ended session.
        """
        if not isinstance(tts_state, TTSState):
            raise InvalidArgumentError("update_tts_state takes a TTSState")
        self._check_record(tts_state)
        await self._save_part(tts_state.session_id, "tts", tts_state)
        return tts_state

    async def get_tts_state(self, session_id: str) -> TTSState | None:
        """Return the session's text-to-speech state, or None."""
        return await self._load(self._key(session_id, "tts"), TTSState)

    # the conversation

    async def update_conversation_state(
        self, conversation_state: VoiceConversationState
    ) -> VoiceConversationState:
        """Store the conversation state as given (replacing it).

        After the session ended (or expired), as `update_stt_state`: stored, and expiring with
        the ended session.
        """
        if not isinstance(conversation_state, VoiceConversationState):
            raise InvalidArgumentError("update_conversation_state takes a VoiceConversationState")
        self._check_record(conversation_state)
        await self._save_part(conversation_state.session_id, "conversation", conversation_state)
        return conversation_state

    async def get_conversation_state(self, session_id: str) -> VoiceConversationState | None:
        """Return the conversation state, or None."""
        return await self._load(self._key(session_id, "conversation"), VoiceConversationState)

    async def append_turn(
        self, session_id: str, role: str, content: str, **extra: Any
    ) -> VoiceConversationState:
        """Append a turn to the transcript atomically (concurrent appends are all kept).

        Raises:
            NotFoundError: No such session.
            InvalidTransitionError: The session has ended.
            SerializationError: A value in `extra` cannot be stored (the path names it,
                `$.transcript[<n>].<key>`); nothing was written.
        """
        session = await self.get_session(session_id)
        if session is None:
            raise NotFoundError(f"no speech session {session_id!r}")
        if session.status is AudioSessionStatus.ENDED:
            raise InvalidTransitionError(f"session {session_id!r} has ended")
        turn = {"role": role, "content": content, "at": utcnow().isoformat(), **extra}

        def append(current: Any) -> Any:
            conversation = VoiceConversationState.model_validate(current)
            self._check_mapping(turn, f"$.transcript[{len(conversation.transcript)}]")
            return revise(
                conversation,
                transcript=[*conversation.transcript, turn],
                turn_count=conversation.turn_count + 1,
                current_speaker=role,
                updated_at=utcnow(),
            )

        value = await self.state.update(
            self._key(session_id, "conversation"),
            append,
            default={"session_id": session_id},
            ttl=self._lease,
        )
        # The session may have ended between the check above and the append: then the
        # conversation must not outlive it (end_session may have rewritten it before the append).
        after = await self.state.get_entry(self._key(session_id, "session"), model=AudioSession)
        if after is None or after.value.status is AudioSessionStatus.ENDED:
            life = after.ttl if after is not None else self.ended_session_ttl
            if life is not None:
                await self._expire_part(
                    session_id, "conversation", max(life, timedelta(milliseconds=1))
                )
        else:
            await self._renew_if_due(session_id, after.ttl)
        return VoiceConversationState.model_validate(value)
