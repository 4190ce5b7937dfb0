"""The bad-input table's machinery: the context each row runs in, the seeded state, snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate import (
    EARLIEST,
    AgentRecoveryManager,
    AgentStateStore,
    IndexingProgress,
    KnowledgeStateManager,
    OrchestrationStateManager,
    SpeechStateManager,
    StateManager,
    TeamState,
    ToolStateManager,
    WorkflowState,
    WorkflowStateManager,
)
from tests.helpers import BACKEND_MAKERS

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    import pytest

    from agenticstate import AgenticStateError
    from agenticstate.backends import Backend


def anything(value: object) -> Any:
    """Mark an argument as deliberately of the wrong type (the row is about that)."""
    return value


@dataclass
class Ctx:
    """What a row's call can use: the manager and backend under test, and every manager on it."""

    kind: str
    backend: Backend
    state: StateManager
    tmp_path: Path
    request: pytest.FixtureRequest | None = None  # to open another store of the same kind
    workflows: WorkflowStateManager = field(init=False)
    speech: SpeechStateManager = field(init=False)
    teams: OrchestrationStateManager = field(init=False)
    tools: ToolStateManager = field(init=False)
    knowledge: KnowledgeStateManager = field(init=False)
    recovery: AgentRecoveryManager = field(init=False)

    def __post_init__(self) -> None:
        self.workflows = WorkflowStateManager(state_manager=self.state)
        self.speech = SpeechStateManager(state_manager=self.state)
        self.teams = OrchestrationStateManager(state_manager=self.state)
        self.tools = ToolStateManager(state_manager=self.state)
        self.knowledge = KnowledgeStateManager(state_manager=self.state)
        self.recovery = AgentRecoveryManager(AgentStateStore(state_manager=self.state))


@dataclass(frozen=True)
class Bad:
    """One row: a call with one bad input, the error it must raise, and a fragment of its message.

    Attributes:
        call: The call, given the context.
        error: The exact exception class.
        fragment: Text the message must contain (what a user needs to fix the call).
        check: More to assert about the exception (ConflictError's versions, say).
        raw: `(key, bytes)` written through the backend before the call (stored corruption).
        only: Run on this backend only (rows that do not touch the store run on memory).
    """

    call: Callable[[Ctx], Awaitable[object]]
    error: type[AgenticStateError]
    fragment: str
    check: Callable[[BaseException], None] | None = None
    raw: tuple[str, bytes] | None = None
    only: str | None = None


def sync(fn: Callable[[Ctx], object]) -> Callable[[Ctx], Awaitable[object]]:
    """Make a row's call from a synchronous one (constructors, subscribe, watch)."""

    async def call(ctx: Ctx) -> object:
        return fn(ctx)

    return call


async def seed(ctx: Ctx) -> None:
    """The state every row starts from: plain keys, a TTL, an index and a record per manager.

    Independent chains run concurrently, so the file backend commits them in shared fsyncs.
    """
    state, workflows, speech = ctx.state, ctx.workflows, ctx.speech

    async def plain() -> None:
        await state.save_many({"seed:a": {"n": 1}, "seed:b": [1, "two", None, 2.5], "int": 5})
        await state.save("seed:a", {"n": 2})  # version 2
        await state.save("seed:ttl", "expires", ttl=timedelta(hours=1))
        await state.index_add("seed:index", {"m1": 1.0, "m2": 2.0})

    async def workflow(workflow_id: str) -> None:
        await workflows.create(WorkflowState(workflow_id=workflow_id, total_steps=3))
        if workflow_id == "wf":
            return
        await workflows.start(workflow_id)
        if workflow_id == "wf-done":
            await workflows.complete(workflow_id)
        elif workflow_id == "wf-cancelled":
            await workflows.cancel(workflow_id, reason="seeded")

    async def session(session_id: str) -> None:
        await speech.create_session(session_id=session_id)
        if session_id == "s-ended":
            await speech.end_session(session_id)

    async with anyio.create_task_group() as group:
        group.start_soon(plain)
        for workflow_id in ("wf", "wf-running", "wf-done", "wf-cancelled"):
            group.start_soon(workflow, workflow_id)
        for session_id in ("s-live", "s-ended"):
            group.start_soon(session, session_id)
        group.start_soon(ctx.teams.create_team, TeamState(team_id="t1"))
        group.start_soon(
            ctx.knowledge.update_indexing_progress,
            IndexingProgress(knowledge_base_id="kb", total_documents=10),
        )


@dataclass(frozen=True)
class Snapshot:
    """Everything stored: each key's bytes, version and expiry, and the seeded index."""

    entries: dict[str, tuple[bytes, int, datetime | None]]
    index: list[tuple[str, float]]


async def snapshot(backend: Backend) -> Snapshot:
    """Read everything the backend holds, below the StateManager (so corrupt values count too)."""
    keys = sorted({key async for key in backend.scan("*")})
    entries = await backend.get_many(keys)
    return Snapshot(
        {entry.key: (entry.value, entry.version, entry.expires_at) for entry in entries if entry},
        await backend.index_range("seed:index"),
    )


# The change feed (issue #23): cursors of other stores and other kinds, a feed that is off.


async def head_cursor(ctx: Ctx, kind: str, place: str, **options: Any) -> str:
    """The head cursor of a new store of `kind` (at `ctx.tmp_path / place`), after one write."""
    assert ctx.request is not None
    (ctx.tmp_path / place).mkdir()
    async with BACKEND_MAKERS[kind](ctx.request, ctx.tmp_path / place, **options) as other:
        await other.set("other", b"\x01\xc0")
        cursor = await other.feed_cursor()
    assert cursor is not None, f"{kind} keeps no feed"
    return cursor


async def changes_since(ctx: Ctx, since: object, **options: Any) -> None:
    """Enter `state.changes("*", since=since)` (where the cursor is checked) and leave."""
    async with ctx.state.changes("*", since=since, **options):  # type: ignore[arg-type]
        return


async def backend_changes_since(ctx: Ctx, since: object) -> None:
    """Enter the backend's `changes("*", since=since)` and leave."""
    async with ctx.backend.changes("*", since=since):  # type: ignore[arg-type]
        return


async def since_other_store(ctx: Ctx) -> None:
    """A well-formed cursor of another store of this kind: it has expired here."""
    await changes_since(ctx, await head_cursor(ctx, ctx.kind, "other-store"))


async def since_other_kind(ctx: Ctx) -> None:
    """A well-formed cursor of another kind of backend: not a cursor of this one."""
    other = "memory" if ctx.kind == "sqlite" else "sqlite"
    await changes_since(ctx, await head_cursor(ctx, other, "other-kind"))


async def since_mangled(ctx: Ctx, tail: str) -> None:
    """This store's head cursor with its last part replaced by `tail`."""
    cursor = await ctx.backend.feed_cursor()
    assert cursor is not None
    await changes_since(ctx, cursor.rpartition(":")[0] + ":" + tail)


async def since_feed_off(ctx: Ctx) -> None:
    """`since=` on a store of this kind opened with its feed off."""
    assert ctx.request is not None
    (ctx.tmp_path / "off").mkdir()
    async with (
        BACKEND_MAKERS[ctx.kind](ctx.request, ctx.tmp_path / "off", feed=None) as backend,
        StateManager(backend=backend, close_backend=False) as state,
        state.changes("*", since=EARLIEST),
    ):
        return
