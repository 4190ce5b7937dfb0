"""SessionManager on every backend: sessions, state, messages, summaries, render, deletion."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agenticstate import (
    ConfigurationError,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    SessionManager,
    SessionMessage,
    StateConfig,
    StateManager,
    UnsupportedTypeError,
    estimate_tokens,
)
from agenticstate.managers.sessions import render_template
from agenticstate.serialization import Serializer

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture
def sessions(state: StateManager) -> SessionManager:
    return SessionManager(state_manager=state, default_state={"shopping_list": []})


async def test_create_uses_default_state_and_merges_given_state(sessions: SessionManager) -> None:
    """A new session starts from a copy of default_state with the given state merged over it."""
    one = await sessions.create_session("u1", state={"user_name": "John"})
    two = await sessions.create_session("u1")
    assert await sessions.get_state(one.session_id) == {"shopping_list": [], "user_name": "John"}
    await sessions.update_state(two.session_id, lambda s: {**s, "shopping_list": ["milk"]})
    assert await sessions.get_state(one.session_id) == {"shopping_list": [], "user_name": "John"}
    assert sessions.default_state == {"shopping_list": []}
    got = await sessions.get_session(one.session_id)
    assert got is not None
    assert got.user_id == "u1"
    assert got.message_count == 0


async def test_duplicate_session_id_is_a_conflict(sessions: SessionManager) -> None:
    """Creating a session with a taken id raises ConflictError and changes nothing."""
    await sessions.create_session("u1", session_id="s1", state={"a": 1})
    with pytest.raises(ConflictError):
        await sessions.create_session("u2", session_id="s1", state={"a": 2})
    assert await sessions.get_state("s1") == {"shopping_list": [], "a": 1}
    assert await sessions.list_sessions("u2") == []
    assert await sessions.state.index_range("sessions:users:{u2}") == []


async def test_update_state_merges_and_set_state_overwrites(sessions: SessionManager) -> None:
    """update_state deep-merges (Agno's default); set_state replaces the whole state."""
    s = await sessions.create_session("u1", state={"profile": {"name": "Ann", "city": "Oslo"}})
    merged = await sessions.update_state(s.session_id, {"profile": {"city": "Rome"}})
    assert merged["profile"] == {"name": "Ann", "city": "Rome"}
    assert await sessions.set_state(s.session_id, {"fresh": True}) == {"fresh": True}
    assert await sessions.get_state(s.session_id) == {"fresh": True}


async def test_unknown_session_raises_not_found(sessions: SessionManager) -> None:
    """Every per-session call on an unknown id raises NotFoundError; get_session returns None."""
    assert await sessions.get_session("nope") is None
    for call in (
        sessions.get_state("nope"),
        sessions.update_state("nope", {"a": 1}),
        sessions.set_state("nope", {}),
        sessions.add_message("nope", "user", "hi"),
        sessions.get_messages("nope"),
        sessions.render("nope", "x"),
        sessions.rename_session("nope", "x"),
    ):
        with pytest.raises(NotFoundError):
            await call
    assert await sessions.state.list_keys("sessions:{nope}:*") == []


async def test_bad_input_is_refused(sessions: SessionManager) -> None:
    """Ids with braces, bad ttl, non-dict state and bad counts raise typed errors."""
    with pytest.raises(InvalidArgumentError):
        await sessions.create_session("u{1}")
    with pytest.raises(InvalidArgumentError):
        await sessions.create_session("u1", session_id="a}b")
    with pytest.raises(InvalidArgumentError):
        await sessions.create_session("u1", ttl=-1)
    s = await sessions.create_session("u1")

    def not_a_dict(state: dict[str, Any]) -> Any:
        return ["not", "a", "dict"]

    with pytest.raises(InvalidArgumentError):
        await sessions.update_state(s.session_id, not_a_dict)
    with pytest.raises(InvalidArgumentError):
        await sessions.get_messages(s.session_id, last=-1)
    with pytest.raises(InvalidArgumentError):
        await sessions.add_message(s.session_id, "", "empty role")
    assert await sessions.get_state(s.session_id) == {"shopping_list": []}
    assert await sessions.list_sessions("u1") == [s]


async def test_list_sessions_newest_first_with_limit_and_before(sessions: SessionManager) -> None:
    """list_sessions returns a user's sessions only, newest first, paged by limit and before."""
    made = [await sessions.create_session("u1", session_id=f"s{i}") for i in range(5)]
    await sessions.create_session("u2", session_id="other")
    listed = await sessions.list_sessions("u1")
    assert [s.session_id for s in listed] == ["s4", "s3", "s2", "s1", "s0"]
    page = await sessions.list_sessions("u1", limit=2)
    assert [s.session_id for s in page] == ["s4", "s3"]
    rest = await sessions.list_sessions("u1", before=page[-1].created_at)
    assert {s.session_id for s in rest} <= {s.session_id for s in made[:3]}
    assert rest == sorted(rest, key=lambda s: s.created_at, reverse=True)


async def test_rename_session(sessions: SessionManager) -> None:
    """rename_session sets the display name and keeps the rest."""
    s = await sessions.create_session("u1", name="draft")
    renamed = await sessions.rename_session(s.session_id, "Groceries")
    assert renamed.name == "Groceries"
    assert renamed.created_at == s.created_at
    assert (await sessions.get_session(s.session_id)) == renamed


async def test_messages_are_numbered_and_read_back(sessions: SessionManager) -> None:
    """add_message numbers messages from 1; get_messages returns them oldest first."""
    s = await sessions.create_session("u1")
    for i in range(7):
        message = await sessions.add_message(s.session_id, "user", f"m{i}", turn=i)
        assert message.seq == i + 1
    everything = await sessions.get_messages(s.session_id)
    assert [m.content for m in everything] == [f"m{i}" for i in range(7)]
    assert everything[2].metadata == {"turn": 2}
    assert [m.seq for m in await sessions.get_messages(s.session_id, last=3)] == [5, 6, 7]
    assert [m.seq for m in await sessions.get_messages(s.session_id, since=5)] == [6, 7]
    assert await sessions.get_messages(s.session_id, last=0) == []
    session = await sessions.get_session(s.session_id)
    assert session is not None
    assert session.message_count == 7


async def test_messages_are_separate_keys(sessions: SessionManager) -> None:
    """Each message is its own key: appending never rewrites an earlier message."""
    s = await sessions.create_session("u1", session_id="keys")
    await sessions.add_message("keys", "user", "a")
    first = await sessions.state.get_entry("sessions:{keys}:msg:000000000001")
    await sessions.add_message("keys", "assistant", "b")
    again = await sessions.state.get_entry("sessions:{keys}:msg:000000000001")
    assert first is not None
    assert again is not None
    assert again.version == first.version == 1
    assert await sessions.state.list_keys("sessions:{keys}:msg:*") == [
        "sessions:{keys}:msg:000000000001",
        "sessions:{keys}:msg:000000000002",
    ]
    assert s.session_id == "keys"


async def test_concurrent_appends_lose_nothing(sessions: SessionManager) -> None:
    """Many tasks appending at once get distinct numbers 1..N and every message is stored."""
    s = await sessions.create_session("u1")

    async def writer(w: int) -> None:
        for i in range(10):
            await sessions.add_message(s.session_id, "user", f"{w}-{i}")

    async with anyio.create_task_group() as tg:
        for w in range(5):
            tg.start_soon(writer, w)
    messages = await sessions.get_messages(s.session_id)
    assert [m.seq for m in messages] == list(range(1, 51))
    assert sorted(str(m.content) for m in messages) == sorted(
        f"{w}-{i}" for w in range(5) for i in range(10)
    )


async def test_max_tokens_keeps_the_newest_that_fit(sessions: SessionManager) -> None:
    """max_tokens keeps the newest messages whose tokens fit, counted by the token counter."""
    s = await sessions.create_session("u1")
    for i in range(100):
        await sessions.add_message(s.session_id, "user", "x" * (i % 7))

    def one_each(message: SessionMessage) -> int:
        return 1

    kept = await sessions.get_messages(s.session_id, max_tokens=10, token_counter=one_each)
    assert [m.seq for m in kept] == list(range(91, 101))
    default = await sessions.get_messages(s.session_id, max_tokens=60)
    assert sum(estimate_tokens(m) for m in default) <= 60
    assert default[-1].seq == 100
    older = (await sessions.get_messages(s.session_id))[-len(default) - 1]
    assert sum(estimate_tokens(m) for m in default) + estimate_tokens(older) > 60
    assert await sessions.get_messages(s.session_id, max_tokens=0) == []

    def broken(message: SessionMessage) -> int:
        return -1

    with pytest.raises(InvalidArgumentError):
        await sessions.get_messages(s.session_id, max_tokens=10, token_counter=broken)


async def test_summarize_covers_old_messages_and_goes_first(sessions: SessionManager) -> None:
    """summarize stores a running summary of all but keep_last; with_summary puts it first."""
    s = await sessions.create_session("u1")
    for i in range(10):
        await sessions.add_message(s.session_id, "user", f"m{i}")
    seen: list[tuple[str | None, list[int]]] = []

    async def summarizer(previous: str | None, messages: list[SessionMessage]) -> str:
        seen.append((previous, [m.seq for m in messages]))
        return f"{previous or ''}+{len(messages)}"

    summary = await sessions.summarize(s.session_id, summarizer, keep_last=4)
    assert summary is not None
    assert summary.covers_through == 6
    assert await sessions.summarize(s.session_id, summarizer, keep_last=4) is None
    for i in range(10, 13):
        await sessions.add_message(s.session_id, "user", f"m{i}")
    second = await sessions.summarize(s.session_id, summarizer, keep_last=4)
    assert second is not None
    assert seen == [(None, [1, 2, 3, 4, 5, 6]), ("+6", [7, 8, 9])]
    with_summary = await sessions.get_messages(s.session_id, with_summary=True)
    assert with_summary[0].seq == 0
    assert with_summary[0].content == "+6+3"
    assert with_summary[0].metadata == {"summary": True, "covers_through": 9}
    assert [m.seq for m in with_summary[1:]] == [10, 11, 12, 13]
    assert len(await sessions.get_messages(s.session_id)) == 13


async def test_summarize_refuses_a_non_str_summary(sessions: SessionManager) -> None:
    """A summarizer that returns something other than a str stores nothing."""
    s = await sessions.create_session("u1")
    await sessions.add_message(s.session_id, "user", "hi")

    def bad(previous: str | None, messages: list[SessionMessage]) -> Any:
        return 42

    with pytest.raises(InvalidArgumentError):
        await sessions.summarize(s.session_id, bad, keep_last=0)
    assert await sessions.get_summary(s.session_id) is None


async def test_render_substitutes_state(sessions: SessionManager) -> None:
    """render fills {key} and {key.sub} from the state and leaves non-placeholders alone."""
    s = await sessions.create_session(
        "u1", state={"user_name": "John", "profile": {"age": 30}, "shopping_list": ["milk"]}
    )
    text = await sessions.render(
        s.session_id,
        "Name {user_name}, age {profile.age}, list {shopping_list}, first {shopping_list.0}, "
        '{{literal}}, json {"a": 1}',
    )
    assert text == 'Name John, age 30, list ["milk"], first milk, {literal}, json {"a": 1}'
    with pytest.raises(NotFoundError, match="nickname"):
        await sessions.render(s.session_id, "Hi {nickname}")
    kept = await sessions.render(s.session_id, "Hi {nickname}", missing="keep")
    assert kept == "Hi {nickname}"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="{}ab._0 ", max_size=30))
def test_render_never_runs_code_and_never_fails_oddly(template: str) -> None:
    """Any template either renders or raises NotFoundError; nothing is evaluated."""
    state = {"a": {"b": "B"}, "b": [1, 2], "_0": "z"}
    try:
        out = render_template(template, state)
    except NotFoundError:
        return
    assert isinstance(out, str)
    assert render_template(template, state, missing="keep") == out


async def test_delete_session_erases_everything(sessions: SessionManager) -> None:
    """delete_session removes state, messages, summary and the user's index entry."""
    s = await sessions.create_session("u1", session_id="gone")
    for i in range(3):
        await sessions.add_message("gone", "user", f"m{i}")
    await sessions.summarize("gone", lambda prev, msgs: "sum", keep_last=1)
    keep = await sessions.create_session("u1", session_id="kept")
    assert await sessions.delete_session(s.session_id) is True
    assert await sessions.delete_session(s.session_id) is False
    assert await sessions.state.list_keys("sessions:{gone}:*") == []
    assert await sessions.list_sessions("u1") == [keep]


async def test_delete_user_erases_every_session_and_counts(sessions: SessionManager) -> None:
    """delete_user erases every session and message of one user and says how many."""
    for i in range(3):
        s = await sessions.create_session("u1", session_id=f"a{i}")
        for j in range(i + 1):
            await sessions.add_message(s.session_id, "user", f"m{j}")
    other = await sessions.create_session("u2", session_id="b0")
    await sessions.add_message(other.session_id, "user", "stay")
    result = await sessions.delete_user("u1")
    assert (result.sessions, result.messages) == (3, 6)
    assert result.keys == 3 * 2 + 6
    assert await sessions.list_sessions("u1") == []
    assert await sessions.state.list_keys("sessions:{a*") == []
    assert [m.content for m in await sessions.get_messages("b0")] == ["stay"]
    assert (await sessions.delete_user("u1")).sessions == 0


async def test_session_ttl_expires_every_key(sessions: SessionManager) -> None:
    """A session with ttl states its expiry on every key it writes."""
    s = await sessions.create_session("u1", ttl=timedelta(minutes=5))
    assert s.expires_at is not None
    await sessions.add_message(s.session_id, "user", "hi")
    await sessions.add_message(s.session_id, "assistant", "hello")
    await sessions.update_state(s.session_id, {"a": 1})
    await sessions.set_state(s.session_id, {"b": 2})
    await sessions.rename_session(s.session_id, "renamed")
    await sessions.summarize(s.session_id, lambda prev, msgs: "sum", keep_last=1)
    keys = await sessions.state.list_keys(f"sessions:{{{s.session_id}}}:*")
    assert len(keys) == 5  # meta, state, two messages, summary
    for key in keys:
        entry = await sessions.state.get_entry(key)
        assert entry is not None
        assert entry.expires_at is not None
        assert abs((entry.expires_at - s.expires_at).total_seconds()) < 2, key
    plain = await sessions.create_session("u1")
    assert plain.expires_at is None


async def test_render_json_for_non_strings() -> None:
    """Non-string values render as compact JSON, dates as their ISO text."""
    when = datetime(2026, 1, 2, tzinfo=UTC)
    assert render_template("{d} {n} {t}", {"d": {"x": [1]}, "n": None, "t": when}) == (
        '{"x": [1]} null "2026-01-02 00:00:00+00:00"'
    )


async def test_shorthand_constructor(tmp_path: Path) -> None:
    """SessionManager takes state_manager= or the shorthand, and refuses both at once."""
    async with SessionManager(persistence="memory", default_state={"n": 0}) as sessions:
        s = await sessions.create_session("u1")
        assert await sessions.get_state(s.session_id) == {"n": 0}
    async with SessionManager(persistence="file", base_path=tmp_path) as sessions:
        await sessions.create_session("u1", session_id="kept")
    async with SessionManager(persistence="file", base_path=tmp_path) as sessions:
        assert await sessions.get_session("kept") is not None
    shared = StateManager()
    async with SessionManager(state_manager=shared) as borrowed:
        assert borrowed.state is shared
    assert await shared.get("nothing") is None  # a borrowed StateManager stays open
    with pytest.raises(ConfigurationError):
        SessionManager(state_manager=shared, persistence="memory")
    with pytest.raises(InvalidArgumentError):
        SessionManager(default_state=["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(UnsupportedTypeError):
        SessionManager(default_state={"s": {1, 2}})
    await shared.aclose()


def _model_history(
    contents: list[str],
    covered: int,
    *,
    last: int | None,
    since: int | None,
    max_tokens: int | None,
    with_summary: bool,
) -> list[int]:
    """What get_messages must return (as numbers, 0 for the summary), computed directly."""
    numbers = list(range(1, len(contents) + 1))
    head = [0] if with_summary and covered else []
    low = 1 if since is None else since + 1
    if head:
        low = max(low, covered + 1)
    if last is not None:
        low = max(low, len(contents) - last + 1)
    numbers = [n for n in numbers if n >= low]
    if max_tokens is None:
        return head + numbers
    budget = max_tokens - (len(head) * 3)
    if budget < 0:
        return []
    kept: list[int] = []
    for n in reversed(numbers):
        budget -= 1 + len(contents[n - 1])
        if budget < 0:
            break
        kept.append(n)
    return head + kept[::-1]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), max_size=40),
    keep_last=st.none() | st.integers(0, 10),
    last=st.none() | st.integers(0, 45),
    since=st.none() | st.integers(0, 45),
    max_tokens=st.none() | st.integers(0, 60),
    with_summary=st.booleans(),
)
def test_get_messages_matches_a_model(
    sizes: list[int],
    keep_last: int | None,
    last: int | None,
    since: int | None,
    max_tokens: int | None,
    with_summary: bool,
) -> None:
    """Every mix of last, since, max_tokens and a summary returns what a direct model says."""
    contents = ["w" * size for size in sizes]

    def counter(message: SessionMessage) -> int:
        # The summary's text is "sum" (3); a message costs 1 plus its length.
        return 3 if message.seq == 0 else 1 + len(str(message.content))

    async def main() -> list[int]:
        async with SessionManager(persistence="memory", token_counter=counter) as sessions:
            s = await sessions.create_session("u1")
            for content in contents:
                await sessions.add_message(s.session_id, "user", content)
            covered = 0
            if keep_last is not None:
                summary = await sessions.summarize(
                    s.session_id, lambda p, m: "sum", keep_last=keep_last
                )
                covered = 0 if summary is None else summary.covers_through
            got = await sessions.get_messages(
                s.session_id,
                last=last,
                since=since,
                max_tokens=max_tokens,
                with_summary=with_summary,
            )
            expected = _model_history(
                contents,
                covered,
                last=last,
                since=since,
                max_tokens=max_tokens,
                with_summary=with_summary,
            )
            assert [m.seq for m in got] == expected
            return expected

    anyio.run(main)


async def test_a_half_created_session_reads_the_default_state(sessions: SessionManager) -> None:
    """If creation stopped after the session record, the state reads and updates as default."""
    s = await sessions.create_session("u1", session_id="half")
    await sessions.state.delete("sessions:{half}:state")  # as if the process died in between
    assert await sessions.get_state(s.session_id) == {"shopping_list": []}
    updated = await sessions.update_state(s.session_id, {"shopping_list": ["tea"]})
    assert updated == {"shopping_list": ["tea"]}


async def test_append_after_the_session_was_replaced_elsewhere(state: StateManager) -> None:
    """A manager that cached a session's expiry writes with the new one after a replace."""
    one = SessionManager(state_manager=state)
    other = SessionManager(state_manager=state)  # another process, in effect
    await one.create_session("u1", session_id="s")
    await one.add_message("s", "user", "first life")
    await other.delete_session("s")
    replaced = await other.create_session("u1", session_id="s", ttl=timedelta(minutes=5))
    message = await one.add_message("s", "user", "second life")
    assert message.seq == 1
    entry = await state.get_entry("sessions:{s}:msg:000000000001")
    assert entry is not None
    assert entry.expires_at is not None
    assert replaced.expires_at is not None
    assert abs((entry.expires_at - replaced.expires_at).total_seconds()) < 2
    meta = await state.get_entry("sessions:{s}:meta")
    assert meta is not None
    assert meta.expires_at is not None
    await other.delete_session("s")
    with pytest.raises(NotFoundError):
        await one.add_message("s", "user", "no life")


async def test_index_entries_of_unfinished_creations(sessions: SessionManager) -> None:
    """list_sessions tidies old orphan index entries but keeps young ones; delete_user erases."""
    now = datetime.now(UTC)
    index = "sessions:users:{u1}"
    await sessions.state.index_add(index, {"young": -now.timestamp()})
    await sessions.state.index_add(index, {"old": -(now - timedelta(hours=1)).timestamp()})
    await sessions.state.save("sessions:{young}:state", {"half": True})  # creation under way
    assert await sessions.list_sessions("u1") == []
    assert [sid for sid, _ in await sessions.state.index_range(index)] == ["young"]
    result = await sessions.delete_user("u1")
    assert result.sessions == 0
    assert result.keys == 1
    assert await sessions.state.list_keys("sessions:{young}:*") == []
    assert await sessions.state.index_range(index) == []


async def test_delete_user_never_erases_another_users_session(sessions: SessionManager) -> None:
    """An index entry of u2 naming u1's session (a leftover) does not let u2 erase it."""
    theirs = await sessions.create_session("u1", session_id="theirs")
    await sessions.add_message(theirs.session_id, "user", "private")
    await sessions.state.index_add("sessions:users:{u2}", {"theirs": -1.0})
    result = await sessions.delete_user("u2")
    assert (result.sessions, result.keys) == (0, 0)
    assert [m.content for m in await sessions.get_messages("theirs")] == ["private"]
    assert [s.session_id for s in await sessions.list_sessions("u1")] == [theirs.session_id]
    assert await sessions.state.index_range("sessions:users:{u2}") == []


async def test_append_and_last_n_cost_the_same_at_any_length(sessions: SessionManager) -> None:
    """add_message and get_messages(last=N) do the same backend work at 10 and 2,000 messages."""
    s = await sessions.create_session("u1")

    async def cost(call: Any) -> tuple[int, int, int]:
        before = sessions.state.stats()
        await call
        after = sessions.state.stats()
        return (
            after.reads - before.reads,
            after.saves - before.saves,
            after.updates - before.updates,
        )

    for i in range(10):
        await sessions.add_message(s.session_id, "user", f"m{i}")
    short_add = await cost(sessions.add_message(s.session_id, "user", "x"))
    short_read = await cost(sessions.get_messages(s.session_id, last=5))
    await sessions.state.save_many(
        {
            f"sessions:{{{s.session_id}}}:msg:{n:012d}": SessionMessage(
                session_id=s.session_id, seq=n, role="user", content="filler"
            )
            for n in range(12, 2001)
        }
    )
    await sessions.state.update(
        f"sessions:{{{s.session_id}}}:meta", lambda meta: {**meta, "message_count": 2000}
    )
    await sessions.add_message(s.session_id, "user", "y")  # reads the record changed above
    long_add = await cost(sessions.add_message(s.session_id, "user", "z"))
    long_read = await cost(sessions.get_messages(s.session_id, last=5))
    # One step: the session's count and the message (two puts), on the record as last seen.
    assert short_add == long_add == (0, 2, 0)
    assert short_read == long_read == (1 + 5, 0, 0)  # the session, then five messages


async def test_concurrent_state_updates_lose_nothing(sessions: SessionManager) -> None:
    """Tools updating one session's state at once (Agno's add_item) lose no item."""
    s = await sessions.create_session("u1")

    async def add(item: str) -> None:
        await sessions.update_state(
            s.session_id, lambda state: {**state, "shopping_list": [*state["shopping_list"], item]}
        )

    async with anyio.create_task_group() as tg:
        for n in range(20):
            tg.start_soon(add, f"item{n}")
    items = (await sessions.get_state(s.session_id))["shopping_list"]
    assert sorted(items) == sorted(f"item{n}" for n in range(20))


@pytest.mark.parametrize("persistence", ["memory", "file"])
def test_sessions_run_under_trio(persistence: str, tmp_path: Path) -> None:
    """Sessions, messages, summaries and scopes work on trio too (memory and file backends)."""
    pytest.importorskip("trio")

    async def main() -> list[int]:
        async with SessionManager(
            persistence=persistence,
            base_path=tmp_path if persistence == "file" else None,
            default_state={"n": 0},
        ) as sessions:
            s = await sessions.create_session("u1")
            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(sessions.add_message, s.session_id, "user", f"m{i}")
            await sessions.update_state(s.session_id, lambda state: {"n": state["n"] + 1})
            await sessions.summarize(s.session_id, lambda prev, msgs: "sum", keep_last=2)
            scope = sessions.state.scope("extra:")
            await scope.save("k", 1)
            assert await scope.get_all() == {"k": 1}
            assert await sessions.render(s.session_id, "{n}") == "1"
            messages = await sessions.get_messages(s.session_id, with_summary=True)
            return [m.seq for m in messages]

    assert anyio.run(main, backend="trio") == [0, 9, 10]


async def test_every_key_of_a_session_shares_its_hash_tag(sessions: SessionManager) -> None:
    """Each key of a session has `{session_id}` as its Redis Cluster hash tag (one slot)."""
    s = await sessions.create_session("u1", session_id="tagged")
    await sessions.add_message(s.session_id, "user", "hi")
    await sessions.summarize(s.session_id, lambda prev, msgs: "sum", keep_last=0)
    keys = await sessions.state.list_keys("sessions:*")
    assert len(keys) == 4  # meta, state, one message, summary
    for key in keys:
        opening = key.index("{")
        assert key[opening + 1 : key.index("}", opening)] == "tagged", key


class _PausedAppend(Serializer):
    """Blocks the write of the message "in flight" once its number is taken, until released:
    another process stopped between the two steps of its append."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = threading.Event()
        self.release = threading.Event()

    def dumps(self, value: object) -> bytes:
        if isinstance(value, SessionMessage) and value.content == "in flight" and value.seq > 1:
            self.taken.set()
            assert self.release.wait(30)
        return super().dumps(value)


async def test_summarize_covers_only_the_messages_it_read(tmp_path: Path) -> None:
    """A message whose number is taken but which is not stored yet (its writer, in another
    thread and event loop on the same SQLite file, is between its two steps) is not covered by
    a summary made meanwhile: it shows in get_messages(with_summary=True) once written."""
    db = tmp_path / "sessions.db"
    config = StateConfig(backend="sqlite", sqlite_path=db)
    async with StateManager(config) as state:
        sessions = SessionManager(state_manager=state)
        session = await sessions.create_session("u", session_id="s")
        await sessions.add_message("s", "user", "first")
        paused = _PausedAppend()

        async def append() -> None:
            async with StateManager(config) as writer:
                writer.serializer = paused
                appender = SessionManager(state_manager=writer)
                # The multi-call path (a backend without transact): there a number is taken
                # in one step and its message written in the next. (The single step never
                # gives a number without its message.)
                appender._steps = False
                await appender.add_message("s", "user", "in flight")

        thread = threading.Thread(target=anyio.run, args=(append,))
        thread.start()
        try:
            assert await anyio.to_thread.run_sync(paused.taken.wait, 30)
            await sessions.add_message("s", "user", "third")
            seen: list[str] = []

            def summarizer(previous: str | None, messages: list[SessionMessage]) -> str:
                seen.extend(str(m.content) for m in messages)
                return "summary"

            summary = await sessions.summarize(session.session_id, summarizer, keep_last=0)
        finally:
            paused.release.set()
            await anyio.to_thread.run_sync(thread.join, 30)
        assert seen == ["first"]
        assert summary is not None
        assert summary.covers_through == 1
        shown = await sessions.get_messages("s", with_summary=True)
        assert [m.content for m in shown] == ["summary", "in flight", "third"]
        again = await sessions.summarize("s", summarizer, keep_last=0)
        assert again is not None
        assert again.covers_through == 3
        assert seen == ["first", "in flight", "third"]
