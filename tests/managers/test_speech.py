"""SpeechStateManager on every backend: sessions, STT/TTS state, turns, ending and expiry."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import (
    AudioSessionStatus,
    ConflictError,
    InvalidArgumentError,
    InvalidTransitionError,
    NotFoundError,
    SpeechStateManager,
    StateConfig,
    StateManager,
    StreamingMode,
    STTState,
    TranscriptionStatus,
    TTSState,
    VoiceConversationState,
)
from agenticstate.backends import Backend, TxnResult
from agenticstate.backends.memory import MemoryBackend

if TYPE_CHECKING:
    from collections.abc import Sequence

    from agenticstate.backends import TxnCompare, TxnOp


@pytest.fixture
def speech(state: StateManager) -> SpeechStateManager:
    return SpeechStateManager(state_manager=state)


async def test_seed_speech_examples(speech: SpeechStateManager) -> None:
    """The seed page's session, STT, TTS and conversation examples, as written."""
    speech_state = speech
    session_id = await speech_state.create_session(
        session_type="voice_conversation",
        streaming_mode=StreamingMode.BIDIRECTIONAL,
        config={"stt_provider": "openai", "tts_provider": "elevenlabs", "language": "en-US"},
    )
    await speech_state.update_session_status(
        session_id=session_id, status=AudioSessionStatus.ACTIVE
    )

    stt_state = STTState(
        session_id=session_id,
        status=TranscriptionStatus.TRANSCRIBING,
        audio_received_bytes=45000,
        transcription_progress=0.6,
        interim_transcript="Hello, I would like to...",
    )
    await speech_state.update_stt_state(stt_state)
    current_stt = await speech_state.get_stt_state(session_id)
    assert current_stt is not None
    assert f"{current_stt.transcription_progress:.0%}" == "60%"
    assert current_stt.interim_transcript == "Hello, I would like to..."

    tts_state = TTSState(
        session_id=session_id,
        text_queue=["Hello! How can I help you today?"],
        audio_generated_bytes=12000,
        audio_played_bytes=8000,
        is_speaking=True,
    )
    await speech_state.update_tts_state(tts_state)
    current_tts = await speech_state.get_tts_state(session_id)
    assert current_tts is not None
    assert current_tts.is_speaking

    conversation_state = VoiceConversationState(
        session_id=session_id,
        turn_count=5,
        current_speaker="user",
        stt_state=stt_state,
        tts_state=tts_state,
        transcript=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi! How can I help?"},
        ],
    )
    await speech_state.update_conversation_state(conversation_state)
    assert await speech_state.get_conversation_state(session_id) == conversation_state

    await speech_state.end_session(session_id=session_id, reason="user_ended")
    session = await speech_state.get_session(session_id)
    assert session is not None
    assert (session.status, session.end_reason) == (AudioSessionStatus.ENDED, "user_ended")
    assert await speech_state.list_active_sessions() == []


async def test_status_transitions_are_validated(speech: SpeechStateManager) -> None:
    """Illegal moves raise InvalidTransitionError and change nothing; ENDED is terminal."""
    session_id = await speech.create_session()
    with pytest.raises(InvalidTransitionError):
        await speech.update_session_status(session_id, AudioSessionStatus.PAUSED)
    await speech.update_session_status(session_id, "active")
    await speech.update_session_status(session_id, AudioSessionStatus.PAUSED)
    await speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)
    await speech.update_session_status(session_id, AudioSessionStatus.ENDED)
    for status in AudioSessionStatus:
        with pytest.raises(InvalidTransitionError):
            await speech.update_session_status(session_id, status)
    with pytest.raises(InvalidArgumentError):
        await speech.update_session_status(session_id, "singing")
    with pytest.raises(NotFoundError):
        await speech.update_session_status("nope", AudioSessionStatus.ACTIVE)


async def test_turns_appended_concurrently_are_all_kept(speech: SpeechStateManager) -> None:
    """40 turns appended at once from many tasks: all 40 are in the transcript."""
    session_id = await speech.create_session()

    async def speak(n: int) -> None:
        await speech.append_turn(session_id, "user" if n % 2 else "assistant", f"turn {n}")

    async with anyio.create_task_group() as tg:
        for n in range(40):
            tg.start_soon(speak, n)
    conversation = await speech.get_conversation_state(session_id)
    assert conversation is not None
    assert conversation.turn_count == 40
    assert sorted(turn["content"] for turn in conversation.transcript) == sorted(
        f"turn {n}" for n in range(40)
    )
    await speech.end_session(session_id)
    with pytest.raises(InvalidTransitionError):
        await speech.append_turn(session_id, "user", "too late")


async def test_ended_session_expires(state: StateManager) -> None:
    """An ended session's state is gone after ended_session_ttl."""
    speech = SpeechStateManager(state_manager=state, ended_session_ttl=timedelta(milliseconds=200))
    session_id = await speech.create_session()
    await speech.update_stt_state(STTState(session_id=session_id, interim_transcript="hi"))
    await speech.append_turn(session_id, "user", "hi")
    await speech.end_session(session_id, "done")
    assert await speech.get_session(session_id) is not None
    await anyio.sleep(0.35)  # wall-clock expiry: wait for the time itself
    assert await speech.get_session(session_id) is None
    assert await speech.get_stt_state(session_id) is None
    assert await speech.get_conversation_state(session_id) is None
    assert await state.list_keys("speech:*") == []


async def test_list_active_sessions(speech: SpeechStateManager) -> None:
    """Active listing excludes ended sessions; the full listing includes them."""
    first = await speech.create_session(session_id="a")
    await speech.create_session(session_id="b", streaming_mode="stt_only")
    await speech.end_session(first)
    assert [s.session_id for s in await speech.list_active_sessions()] == ["b"]
    assert {s.session_id for s in await speech.list_sessions(active_only=False)} == {"a", "b"}
    with pytest.raises(InvalidArgumentError):
        await speech.create_session(streaming_mode="sideways")


async def test_high_frequency_interim_updates(speech: SpeechStateManager) -> None:
    """500 interim updates to one session: the last one wins, every one is a single write."""
    session_id = await speech.create_session()
    for n in range(500):
        await speech.update_stt_state(
            STTState(session_id=session_id, interim_transcript=f"word {n}", audio_received_bytes=n)
        )
    stt = await speech.get_stt_state(session_id)
    assert stt is not None
    assert stt.interim_transcript == "word 499"
    entry = await speech.state.get_entry(f"speech:{{{session_id}}}:stt")
    assert entry is not None
    assert entry.version == 500


async def test_late_updates_expire_with_the_ended_session(state: StateManager) -> None:
    """STT, TTS and conversation updates after end_session are kept and expire with the
    session, even when live sessions never expire (session_ttl=None)."""
    speech = SpeechStateManager(state_manager=state, ended_session_ttl=timedelta(milliseconds=300))
    session_id = await speech.create_session()
    await speech.end_session(session_id, "user_ended")
    final = STTState(session_id=session_id, final_transcript="thanks, bye")
    assert await speech.update_stt_state(final) == final
    await speech.update_tts_state(TTSState(session_id=session_id, is_speaking=False))
    await speech.update_conversation_state(VoiceConversationState(session_id=session_id))
    assert await speech.get_stt_state(session_id) == final
    session = await state.get_entry(f"speech:{{{session_id}}}:session")
    assert session is not None
    assert session.expires_at is not None
    for part in ("stt", "tts", "conversation"):
        entry = await state.get_entry(f"speech:{{{session_id}}}:{part}")
        assert entry is not None
        assert entry.expires_at is not None
        # The session's time left, read after the write: a few milliseconds later at most.
        assert entry.expires_at <= session.expires_at + timedelta(milliseconds=100)
    await anyio.sleep(0.4)  # wall-clock expiry
    assert await state.list_keys("speech:*") == []


async def test_updates_for_an_expired_or_unknown_session_expire(state: StateManager) -> None:
    """An update for a session that expired (or never existed) expires after
    ended_session_ttl instead of staying forever."""
    speech = SpeechStateManager(state_manager=state, ended_session_ttl=timedelta(milliseconds=200))
    await speech.update_stt_state(STTState(session_id="gone", interim_transcript="late"))
    entry = await state.get_entry("speech:{gone}:stt")
    assert entry is not None
    assert entry.ttl is not None
    assert entry.ttl <= timedelta(milliseconds=201)  # stores round expiry to milliseconds
    await anyio.sleep(0.3)  # wall-clock expiry
    assert await speech.get_stt_state("gone") is None


async def test_updates_to_a_live_session_keep_its_ttl(state: StateManager) -> None:
    """While the session is live, its parts follow session_ttl (none by default)."""
    speech = SpeechStateManager(state_manager=state)
    session_id = await speech.create_session()
    await speech.update_stt_state(STTState(session_id=session_id))
    entry = await state.get_entry(f"speech:{{{session_id}}}:stt")
    assert entry is not None
    assert entry.expires_at is None
    timed = SpeechStateManager(state_manager=state, session_ttl=timedelta(minutes=5))
    live = await timed.create_session()
    await timed.update_tts_state(TTSState(session_id=live))
    entry = await state.get_entry(f"speech:{{{live}}}:tts")
    assert entry is not None
    assert entry.ttl is not None
    # A live record's lease: at least session_ttl, at most twice that (plus ms rounding).
    assert timedelta(minutes=5) <= entry.ttl <= timedelta(minutes=10, seconds=1)


async def test_a_live_call_keeps_its_session(state: StateManager) -> None:
    """STT updates every quarter of session_ttl, for 2.5 session_ttls: nothing expires."""
    speech = SpeechStateManager(state_manager=state, session_ttl=timedelta(milliseconds=400))
    session_id = await speech.create_session()
    await speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)
    await speech.append_turn(session_id, "user", "hello")  # the conversation, written once
    await speech.update_tts_state(TTSState(session_id=session_id, voice="alloy"))
    for n in range(10):
        await anyio.sleep(0.1)  # the call's pace (wall-clock expiry is what is tested)
        await speech.update_stt_state(STTState(session_id=session_id, interim_transcript=f"w{n}"))
    session = await speech.get_session(session_id)
    assert session is not None
    assert session.status is AudioSessionStatus.ACTIVE
    assert await speech.get_tts_state(session_id) is not None
    conversation = await speech.append_turn(session_id, "assistant", "hi")
    assert [turn["content"] for turn in conversation.transcript] == ["hello", "hi"]
    await anyio.sleep(1.1)  # no writes for longer than the lease (0.8 s): now it all expires
    for part in ("session", "stt", "tts", "conversation"):
        assert await state.get_entry(f"speech:{{{session_id}}}:{part}") is None, part


async def test_updates_racing_end_session_never_outlive_it(state: StateManager) -> None:
    """Interim updates streaming while the session ends: every part ends up expiring."""
    speech = SpeechStateManager(state_manager=state, ended_session_ttl=timedelta(minutes=5))
    for n in range(5):
        session_id = await speech.create_session(session_id=f"race-{n}")

        async def stream(session_id: str = session_id) -> None:
            for word in range(20):
                await speech.update_stt_state(
                    STTState(session_id=session_id, interim_transcript=f"word {word}")
                )
                await speech.update_tts_state(TTSState(session_id=session_id))

        async def turns(session_id: str = session_id) -> None:
            for _ in range(5):
                try:
                    await speech.append_turn(session_id, "user", "hi")
                except InvalidTransitionError:
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            tg.start_soon(turns)
            await anyio.sleep(0.001 * n)
            await speech.end_session(session_id)
        for part in ("session", "stt", "tts", "conversation"):
            entry = await state.get_entry(f"speech:{{{session_id}}}:{part}")
            assert entry is None or entry.expires_at is not None, (session_id, part)


async def test_renewals_racing_end_session_never_outlive_it(state: StateManager) -> None:
    """Lease renewals (status changes, turns) racing end_session: no record keeps a live
    lease past the ended session's expiry."""
    speech = SpeechStateManager(
        state_manager=state,
        session_ttl=timedelta(minutes=10),
        ended_session_ttl=timedelta(seconds=30),
    )
    for n in range(5):
        session_id = await speech.create_session(session_id=f"renew-{n}")
        await speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)

        async def churn(session_id: str = session_id) -> None:
            for word in range(10):
                try:
                    await speech.update_session_status(session_id, AudioSessionStatus.PAUSED)
                    await speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)
                    await speech.append_turn(session_id, "user", f"w{word}")
                except InvalidTransitionError:
                    return  # ended
                await speech.update_stt_state(STTState(session_id=session_id))

        async with anyio.create_task_group() as tg:
            tg.start_soon(churn)
            await anyio.sleep(0.002 * n)
            await speech.end_session(session_id)
        session = await state.get_entry(f"speech:{{{session_id}}}:session")
        assert session is not None
        assert session.expires_at is not None
        for part in ("stt", "tts", "conversation"):
            entry = await state.get_entry(f"speech:{{{session_id}}}:{part}")
            if entry is not None:
                assert entry.expires_at is not None, (session_id, part)
                # Ended: at most the ended session's time (read a moment apart), never the
                # 20-minute lease of a live one.
                assert entry.expires_at <= session.expires_at + timedelta(seconds=1), part


async def test_a_renewal_that_lost_the_race_to_end_session_is_undone(state: StateManager) -> None:
    """The worst interleaving, made deterministic: a renewal whose session write came just
    before end_session renews the records after it; its check puts them back on the ended
    session's time."""
    speech = SpeechStateManager(
        state_manager=state,
        session_ttl=timedelta(minutes=10),
        ended_session_ttl=timedelta(seconds=30),
    )
    session_id = await speech.create_session()
    await speech.update_stt_state(STTState(session_id=session_id))
    await speech.append_turn(session_id, "user", "bye")
    await speech.end_session(session_id)
    await speech._renew_parts(session_id)  # the second half of a renewal that began earlier
    session = await state.get_entry(f"speech:{{{session_id}}}:session")
    assert session is not None
    assert session.expires_at is not None
    for part in ("stt", "conversation"):
        entry = await state.get_entry(f"speech:{{{session_id}}}:{part}")
        assert entry is not None
        assert entry.expires_at is not None
        assert entry.expires_at <= session.expires_at + timedelta(seconds=1), part


class _NoTransactBackend(MemoryBackend):
    """A backend without `transact` (as a third-party one may be): the base raises for it."""

    async def transact(
        self, compare: Sequence[TxnCompare], then: Sequence[TxnOp], orelse: Sequence[TxnOp] = ()
    ) -> TxnResult:
        return await Backend.transact(self, compare, then, orelse)


async def test_the_live_marker_follows_the_session(state: StateManager) -> None:
    """The marker exists exactly while the session is live, with the session's time to live."""
    speech = SpeechStateManager(
        state_manager=state,
        session_ttl=timedelta(minutes=5),
        ended_session_ttl=timedelta(minutes=1),
    )
    session_id = await speech.create_session()
    marker = f"speech:{{{session_id}}}:live"

    session = await state.get_entry(f"speech:{{{session_id}}}:session")
    live = await state.get_entry(marker)
    assert session is not None
    assert live is not None
    assert session.expires_at is not None
    assert live.expires_at is not None
    # Written in one step with the same TTL (stores keep expiry in whole milliseconds).
    assert abs(live.expires_at - session.expires_at) <= timedelta(milliseconds=2)
    await speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)
    await speech.update_stt_state(STTState(session_id=session_id, interim_transcript="hi"))
    assert await state.get_entry(marker) is not None
    await speech.end_session(session_id)
    assert await state.get_entry(marker) is None
    await speech.update_stt_state(STTState(session_id=session_id, final_transcript="bye"))
    stt = await state.get_entry(f"speech:{{{session_id}}}:stt")
    assert stt is not None
    assert stt.ttl is not None
    assert stt.ttl <= timedelta(minutes=1, seconds=1)  # the ended session's time, not a lease
    assert await state.get_entry(marker) is None


async def test_a_session_stored_without_a_marker_gets_one(state: StateManager) -> None:
    """A live session written before markers existed: its first update is handled by reading
    the session (kept alive as before) and gives it the marker; an ended one gets none."""
    speech = SpeechStateManager(state_manager=state)
    for session_id, status in (("old-live", "active"), ("old-ended", "ended")):
        await state.save(
            f"speech:{{{session_id}}}:session",
            {"session_id": session_id, "status": status},
            ttl=timedelta(minutes=1) if status == "ended" else None,
        )
        await speech.update_stt_state(STTState(session_id=session_id, interim_transcript="x"))
    live = await state.get_entry("speech:{old-live}:stt")
    assert live is not None
    assert live.expires_at is None  # a live session's part, kept as the session is
    assert await state.get_entry("speech:{old-live}:live") is not None
    ended = await state.get_entry("speech:{old-ended}:stt")
    assert ended is not None
    assert ended.expires_at is not None
    assert await state.get_entry("speech:{old-ended}:live") is None
    await speech.end_session("old-live")
    assert await state.get_entry("speech:{old-live}:live") is None


async def test_speech_without_transact() -> None:
    """On a backend without `transact`: no marker, the write-then-read path, same outcomes."""
    async with StateManager(StateConfig(), backend=_NoTransactBackend()) as state:
        speech = SpeechStateManager(
            state_manager=state,
            session_ttl=timedelta(minutes=5),
            ended_session_ttl=timedelta(minutes=1),
        )
        session_id = await speech.create_session(session_id="plain")
        with pytest.raises(ConflictError):
            await speech.create_session(session_id="plain")
        await speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)
        await speech.update_stt_state(STTState(session_id=session_id, interim_transcript="hi"))
        assert speech._transact is False
        stt = await state.get_entry("speech:{plain}:stt")
        assert stt is not None
        assert stt.ttl is not None
        assert stt.ttl > timedelta(minutes=5)  # a live session's lease
        await speech.end_session(session_id)
        await speech.update_tts_state(TTSState(session_id=session_id))
        tts = await state.get_entry("speech:{plain}:tts")
        assert tts is not None
        assert tts.ttl is not None
        assert tts.ttl <= timedelta(minutes=1, seconds=1)
        assert await state.list_keys("speech:*:live") == []


async def test_create_session_refuses_a_taken_id(speech: SpeechStateManager) -> None:
    """A second session with the same id raises ConflictError and changes nothing."""
    await speech.create_session(session_id="taken", config={"n": 1})
    with pytest.raises(ConflictError):
        await speech.create_session(session_id="taken", config={"n": 2})
    session = await speech.get_session("taken")
    assert session is not None
    assert session.config == {"n": 1}
