"""A voice session: streaming interim transcripts, turns, and an end that expires the state.

Install: `pip install .` (from a checkout; see the README).
"""

from datetime import timedelta

import anyio

from agenticstate import (
    AudioSessionStatus,
    SpeechStateManager,
    StreamingMode,
    STTState,
    TranscriptionStatus,
    TTSState,
)


async def main() -> None:
    async with SpeechStateManager(
        persistence="memory", ended_session_ttl=timedelta(minutes=10)
    ) as speech:
        session_id = await speech.create_session(
            session_type="voice_conversation",
            streaming_mode=StreamingMode.BIDIRECTIONAL,
            config={"language": "en-US"},
        )
        await speech.update_session_status(session_id, AudioSessionStatus.ACTIVE)

        words = ["Hello", "I", "would", "like", "to", "book", "a", "table"]
        for n in range(1, len(words) + 1):
            await speech.update_stt_state(
                STTState(
                    session_id=session_id,
                    status=TranscriptionStatus.TRANSCRIBING,
                    interim_transcript=" ".join(words[:n]),
                    transcription_progress=n / len(words),
                )
            )
        await speech.append_turn(session_id, "user", " ".join(words))
        await speech.update_tts_state(
            TTSState(session_id=session_id, text_queue=["For how many people?"], is_speaking=True)
        )
        await speech.append_turn(session_id, "assistant", "For how many people?")

        conversation = await speech.get_conversation_state(session_id)
        print(f"{conversation.turn_count} turns, last speaker: {conversation.current_speaker}")
        print("active sessions:", [s.session_id for s in await speech.list_active_sessions()])
        ended = await speech.end_session(session_id, reason="user_ended")
        print(f"ended ({ended.end_reason}); state expires in 10 minutes")
        assert await speech.list_active_sessions() == []


if __name__ == "__main__":
    anyio.run(main)
