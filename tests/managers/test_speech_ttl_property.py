"""TTL renewal of a live speech session by writes to any of its records (hypothesis).

Generated schedules write a session's STT, TTS and conversation records, append turns and
change its status, with pauses shorter than `session_ttl` between them. After every write, the
session and every record written so far must have at least `session_ttl` left, counted from
the moment the write began, and every record must still exist whenever the previous write's
measured guarantee covered this one: a live call never loses a record while it is written to.
(A write that a loaded machine delays past that guarantee may find a record expired; the check
then asks only that what exists has its full time left.)
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agenticstate import (
    AudioSessionStatus,
    SpeechStateManager,
    STTState,
    TTSState,
    VoiceConversationState,
)
from tests.managers._portal import BACKEND_NAMES, open_state

if TYPE_CHECKING:
    from pathlib import Path

SESSION_TTL = timedelta(milliseconds=100)
ROUNDING = timedelta(milliseconds=2)  # stores keep expiry in whole milliseconds

WRITES = ["stt", "tts", "conversation", "turn", "status"]
SCHEDULE = st.lists(
    st.tuples(st.sampled_from(WRITES), st.sampled_from([0.0, 0.03, 0.06, 0.09])),
    min_size=1,
    max_size=6,
)


async def _write(speech: SpeechStateManager, session_id: str, kind: str, n: int) -> str | None:
    """Make one write; return the record it writes (None for the session's own)."""
    if kind == "stt":
        await speech.update_stt_state(STTState(session_id=session_id, interim_transcript=f"{n}"))
        return "stt"
    if kind == "tts":
        await speech.update_tts_state(TTSState(session_id=session_id, current_text=f"{n}"))
        return "tts"
    if kind == "conversation":
        await speech.update_conversation_state(
            VoiceConversationState(session_id=session_id, turn_count=n)
        )
        return "conversation"
    if kind == "turn":
        await speech.append_turn(session_id, "user", f"{n}")
        return "conversation"
    session = await speech.get_session(session_id)  # "status": toggle active and paused
    assert session is not None
    active = session.status is AudioSessionStatus.ACTIVE
    target = AudioSessionStatus.PAUSED if active else AudioSessionStatus.ACTIVE
    await speech.update_session_status(session_id, target)
    return None


async def _run(
    speech: SpeechStateManager, session_id: str, schedule: list[tuple[str, float]]
) -> int:
    """Run a schedule; return how many writes the existence check covered."""
    await speech.create_session(session_id=session_id)
    written = {"session"}
    # Until when every record written so far is known (measured) to exist: the guarantee the
    # previous write left. A write that ends before it must find every record and renew them.
    alive_until = time.monotonic() + SESSION_TTL.total_seconds()
    covered = 0
    for n, (kind, pause) in enumerate(schedule):
        await anyio.sleep(pause)  # the call's pace: time passing is what renewal is about
        began = time.monotonic()
        part = await _write(speech, session_id, kind, n)
        if part is not None:
            written.add(part)
        read_from = time.monotonic()
        entries = {
            name: await speech.state.get_entry(f"speech:{{{session_id}}}:{name}")
            for name in sorted(written)
        }
        done = time.monotonic()
        if done < alive_until:  # nothing could have expired before this write renewed it
            covered += 1
            missing = [name for name, entry in entries.items() if entry is None]
            assert not missing, (missing, schedule[: n + 1])
        elapsed = timedelta(seconds=done - began)
        lefts = []
        for name, entry in entries.items():
            if entry is None:
                written.discard(name)  # expired before a late write: legitimately gone
                continue
            assert entry.ttl is not None
            # Alive at least session_ttl after the write began (read up to `elapsed` later).
            assert entry.ttl >= SESSION_TTL - elapsed - ROUNDING, (name, entry.ttl, elapsed)
            lefts.append(entry.ttl.total_seconds())
        alive_until = read_from + min(lefts) - ROUNDING.total_seconds()
    return covered


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_writes_to_any_record_renew_the_whole_live_session(
    backend_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """After any write, the session and all its records outlive it by session_ttl."""
    ids = itertools.count()
    with open_state(backend_name, request, tmp_path) as (portal, state):
        speech = SpeechStateManager(state_manager=state, session_ttl=SESSION_TTL)
        covered: list[int] = []

        @settings(
            max_examples=12,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(schedule=SCHEDULE)
        def check(schedule: list[tuple[str, float]]) -> None:
            covered.append(portal.call(_run, speech, f"call-{next(ids)}", schedule))

        check()
        assert sum(covered) >= len(covered)  # the existence check ran, not only the TTL one
