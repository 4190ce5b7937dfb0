"""The `agenticstate` command: look at and change state from a shell.

```console
agenticstate --url sqlite://./state/state.db keys 'agent:*'
agenticstate --url redis://localhost:6379/0 --prefix agenticai: get agent:researcher
agenticstate set agent:researcher '{"status": "idle"}' --ttl 3600
agenticstate watch 'agent:*'
agenticstate inspect workflows
agenticstate usage 'agent:*'
agenticstate history agent:researcher --limit 5
agenticstate changes 'agent:*' --since CURSOR --follow
agenticstate log agent:researcher:
agenticstate diff COMMIT_A COMMIT_B
agenticstate demo
agenticstate copy sqlite://./state/state.db redis://localhost:6379/0 'agent:*'
agenticstate export redis://localhost:6379/0 backup.jsonl
agenticstate import backup.jsonl sqlite://./restored.db
agenticstate --url file://./state repair
agenticstate --url redis://localhost:6379/0 --prefix app: reindex
agenticstate ui --allow-writes
```

The store comes from `--url` (or `AGENTICSTATE_URL`, else `sqlite://./state/state.db`):
`sqlite://FILE`, `file://DIR` or `file://DIR/NAME.json`, `memory://` (read-only here: what a command
wrote into it would be lost when it exits), `redis://...`, `rediss://...`, `unix://...`,
`redis+cluster://...`, `postgresql://...`, or any scheme a backend registered. `--json` prints
machine-readable output (data: `inspect`'s numbers as numbers). Global options go before or after
the command, alike; a command that does not take one (`--url` of `copy`, `export` and `import`,
which name their stores; all but `--no-progress` of `demo`) refuses it, wherever it is. Long
operations (`keys`, `inspect`, `demo`) show a live counter on stderr when it is a terminal, unless
`--json` or `--no-progress` is given; stdout never carries it. A command
creates only a store it writes into (`set`, `import`, `copy`'s destination, `demo`'s own): any
other on a store that does not exist says so and exits 1, creating nothing.

Exit codes: 0 success, 1 the key, record or store was not found, 2 bad usage or input, 3 the
backend failed (unreachable, in use by another process, corrupt, unsupported server).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import math
import os
import signal
import sys
import time
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from uuid import UUID

import anyio

from agenticstate._checks import as_ttl
from agenticstate._keys import validate_pattern
from agenticstate._progress import Progress, is_terminal
from agenticstate._version import __version__
from agenticstate.backends import ChangeOp, FileBackend, MemoryBackend, open_backend
from agenticstate.config import redact_url
from agenticstate.exceptions import (
    AgenticStateError,
    BackendError,
    ConfigurationError,
    DecodeError,
    ForeignRecordError,
    InvalidArgumentError,
    NotFoundError,
    SerializationError,
)
from agenticstate.manager import StateManager

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

    from agenticstate.backends import Backend

__all__ = ["configure_logging", "main"]

EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_BACKEND = 0, 1, 2, 3
DEFAULT_URL = "sqlite://./state/state.db"
_CREATES = frozenset({"set"})
"""The commands on --url that create the store when it does not exist: only those that add to
it. Every other one (reads, `delete`, `watch`, `ui`, ...) on a missing store says so and exits
1, so a typo in --url never looks like an empty store. (`import` and `copy` create the store
they write into, `demo` its own; `export`, `copy`'s source and `repair` create nothing.)"""
_CREATE_HINT = "only `set`, `import`, `copy` (its destination) and `demo` create a store"


class _CommandError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, bytes):
        return {"$base64": base64.b64encode(value).decode()}
    if value is Ellipsis:
        return "..."
    raise TypeError(f"cannot show {type(value).__name__}")


def _dump(value: Any, *, pretty: bool = False) -> str:
    return json.dumps(value, default=_plain, ensure_ascii=False, indent=2 if pretty else None)


_OUT_CHUNK = 16_384
"""Characters written to stdout at a time. One large write to a pipe whose reader goes away
part-way returns short without an error (CPython then drops the rest), so a cut-off `--json`
listing would end with exit 0; the next chunk's write meets the closed pipe and raises
`BrokenPipeError` instead (exit 141, as for every command)."""


def _out(text: str) -> None:
    text += "\n"
    for start in range(0, len(text), _OUT_CHUNK):
        sys.stdout.write(text[start : start + _OUT_CHUNK])
        sys.stdout.flush()


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[str(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(column), *(len(c[i]) for c in cells)) for i, column in enumerate(columns)]
    lines = ["  ".join(column.ljust(widths[i]) for i, column in enumerate(columns)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend(
        "  ".join(c[i].ljust(widths[i]) for i in range(len(columns))).rstrip() for c in cells
    )
    return "\n".join(lines)


def _url(args: argparse.Namespace) -> str:
    return str(args.url or os.environ.get("AGENTICSTATE_URL") or DEFAULT_URL)


def _manager(args: argparse.Namespace) -> StateManager:
    return StateManager(backend=_open_url(_url(args), args.prefix, create=args.command in _CREATES))


def _missing(url: str, exc: NotFoundError, what: str = "--url") -> _CommandError:
    """The error for a store that does not exist, opened by a command that does not create."""
    return _CommandError(
        f"no store at {redact_url(url)} ({exc}); check {what}: {_CREATE_HINT}", EXIT_NOT_FOUND
    )


@contextlib.asynccontextmanager
async def _opened(url: str, backend: Backend) -> AsyncIterator[Backend]:
    """`async with backend`, a store that does not exist reported as such."""
    try:
        await backend.open()
    except NotFoundError as exc:
        await backend.aclose()
        raise _missing(url, exc, "the URL") from None
    async with backend:
        yield backend


async def _keys(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    # state.list_keys(pattern), counting the keys as the scan finds them.
    pattern = validate_pattern(args.pattern)
    await state.open()
    found: set[str] = set()
    try:
        async for key in state.backend.scan(pattern):
            found.add(key)
            progress.update("scanning", len(found), "key")
    finally:
        progress.clear()
    keys = sorted(found)
    if args.json:
        _out(_dump(keys))
    else:
        for key in keys:
            _out(key)
    return EXIT_OK


async def _usage(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    # state.usage(pattern): keys and stored bytes, per namespace, with the count on stderr.
    pattern = validate_pattern(args.pattern)
    try:
        usage = await state.usage(
            pattern,
            max_time=args.max_time,
            progress=lambda running: progress.update("measuring", running.keys, "key"),
        )
    finally:
        progress.clear()
    if args.json:
        _out(_dump(usage.model_dump(mode="json")))
        return EXIT_OK
    rows = [
        {"namespace": name or '""', "keys": f"{part.keys:,}", "bytes": f"{part.bytes:,}"}
        for name, part in sorted(usage.namespaces.items(), key=lambda item: -item[1].bytes)
    ]
    _out(_table(rows, ["namespace", "keys", "bytes"]))
    _out(f"total: {usage.keys:,} keys, {usage.bytes:,} bytes of values ({pattern})")
    if not usage.complete:
        _out(f"stopped after {args.max_time:g} s: the figures are a lower bound")
    return EXIT_OK


async def _get(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    entry = await state.get_entry(args.key)
    if entry is None:
        raise _CommandError(f"no state at key {args.key!r}", EXIT_NOT_FOUND)
    if args.json:
        _out(_dump(entry.model_dump()))  # ttl in seconds
    else:
        _out(_dump(entry.value, pretty=True))
        ttl = f", expires in {_remaining(entry.ttl)}" if entry.ttl is not None else ""
        updated = entry.updated_at.isoformat(timespec="milliseconds")
        _out(f"(version {entry.version}, updated {updated}{ttl})")
    return EXIT_OK


def _remaining(ttl: timedelta) -> str:
    """A time to live in whole seconds, as `0:59:59` or `2 days, 3:00:00`."""
    return str(timedelta(seconds=math.ceil(ttl.total_seconds())))


def _refuse_memory(backend: Backend, url: str, command: str) -> None:
    """Refuse to write into a `memory://` store: it is gone when the command exits."""
    if isinstance(backend, MemoryBackend):
        raise _CommandError(
            f"{command} into {redact_url(url)} would be lost: a memory store lives only as long "
            "as this one command; use sqlite://FILE (the default) or file://DIR to keep it, or "
            "redis://... to share it",
            EXIT_USAGE,
        )


async def _set(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    try:
        value = json.loads(args.value)
    except json.JSONDecodeError as exc:
        hint = ""
        if not args.value.lstrip().startswith(("{", "[", '"')):
            # A bare word: what was meant is almost always a string.
            quoted = json.dumps(args.value, ensure_ascii=False)
            hint = f"; to store it as a string, put JSON's quotes inside the shell's: '{quoted}'"
        raise _CommandError(
            f"VALUE is not valid JSON: {exc.msg} (column {exc.colno}){hint}", EXIT_USAGE
        ) from None
    version = await state.save(args.key, value, ttl=args.ttl)
    _out(
        _dump({"key": args.key, "version": version})
        if args.json
        else f"saved {args.key} (version {version})"
    )
    return EXIT_OK


async def _delete(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    if not await state.delete(args.key):
        raise _CommandError(f"no state at key {args.key!r}", EXIT_NOT_FOUND)
    _out(_dump({"key": args.key, "deleted": True}) if args.json else f"deleted {args.key}")
    return EXIT_OK


def _change_line(change: Any) -> str:
    head = f"{change.timestamp.isoformat()}  {change.op.value:<6} {change.key}  v{change.version}"
    if change.op == ChangeOp.DELETE:
        return f"{head}  {_dump(change.old_value)} -> (deleted)"
    if change.op == ChangeOp.RESYNC:
        # Re-read after a gap in delivery (a reconnect): the old value is unknown, and a key
        # with no value now was deleted while the connection was down.
        if change.new_value is None:
            return f"{head}  (gone: deleted while the connection was down)"
        return f"{head}  (old value unknown) -> {_dump(change.new_value)}"
    return f"{head}  {_dump(change.old_value)} -> {_dump(change.new_value)}"


async def _watch(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    seen = 0
    if not isinstance(state.backend, FileBackend):
        # One plain read first: a server that is down, refuses us or is unsupported is reported
        # with its reason, rather than as a subscription that never confirmed.
        await state.exists("agenticstate-cli-probe")
    async with state.watch(args.pattern) as changes:
        # On stderr, once subscribed: from here on no change is missed.
        note = f"watching {args.pattern!r} (Ctrl-C to stop)"
        if isinstance(state.backend, FileBackend):
            note += (
                f"; this process now holds the file store {state.backend.base_path}: other "
                "processes cannot open it, so cannot write, until watch stops"
            )
        sys.stderr.write(note + "\n")
        sys.stderr.flush()
        async for change in changes:
            # _out flushes each line: a pipe (`| grep`) sees every change as it happens.
            _out(_dump(change.model_dump()) if args.json else _change_line(change))
            seen += 1
            if args.count and seen >= args.count:
                break
    return EXIT_OK


async def _inspect(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    from agenticstate.managers._base import skipping_bad_records

    # The managers read many records in few calls: count the reads while they run. A record
    # that does not read as its manager's (foreign, or from a newer release) is left out and
    # named on stderr: the others are still shown.
    with skipping_bad_records() as skipped:
        async with progress.ticking(
            f"reading {args.target}", lambda: state.stats().reads, "record"
        ):
            rows = await _inspected(state, args.target, skipped)
    _out(_dump(rows) if args.json else _records_table(rows, _INSPECTORS[args.target].columns))
    for key, reason in skipped:
        sys.stderr.write(f"agenticstate: left out {key or 'a record'}: {reason}\n")
    return EXIT_OK


async def _inspected(
    state: StateManager, target: str, skipped: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    """The records `inspect <target>` shows, as data: one manager's, read by its list methods.

    `skipped` gains `(key, reason)` for each record that does not read.
    """
    return await _INSPECTORS[target].read(state, skipped)


async def _each(
    ids: Iterable[str],
    row: Callable[[str], Awaitable[dict[str, Any]]],
    skipped: list[tuple[str, str]],
) -> list[dict[str, Any]]:
    """`row(id)` for each id, leaving out one whose records do not read (noted in `skipped`)."""
    rows = []
    for id_ in ids:
        try:
            rows.append(await row(id_))
        except NotFoundError:
            continue  # deleted between the listing and the read
        except (DecodeError, ForeignRecordError) as exc:
            skipped.append((getattr(exc, "key", ""), str(exc)))
    return rows


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


@dataclasses.dataclass(frozen=True)
class _Column:
    """A column of an `inspect` table: its header and how it shows a record."""

    header: str
    show: Callable[[dict[str, Any]], str]


def _col(header: str, field: str, show: Callable[[Any], str] = _cell) -> _Column:
    """The column `header` showing one field of each record (`show` formats it)."""
    return _Column(header, lambda row: show(row[field]))


def _percent(value: float) -> str:
    return f"{value:.0%}"


def _ms(value: float) -> str:
    return f"{value:.1f}"


def _records_table(rows: list[dict[str, Any]], columns: Sequence[_Column]) -> str:
    """The table of `inspect`'s records: `--json` prints the same records as data."""
    shown = [{c.header: c.show(row) for c in columns} for row in rows]
    return _table(shown, [c.header for c in columns])


async def _inspect_agents(
    state: StateManager, skipped: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    from agenticstate.managers import AgentStateStore  # only `inspect` needs the managers

    agents = AgentStateStore(state_manager=state)

    async def row(agent_id: str) -> dict[str, Any]:
        latest = await agents.get_latest_checkpoint(agent_id)
        snapshots = await agents.list_snapshots(agent_id)
        saved = await agents.list_checkpoints(agent_id)
        return {
            "agent": agent_id,
            "snapshots": len(snapshots),
            "checkpoints": len(saved),
            "latest_checkpoint": latest.checkpoint_id if latest else None,
            "step": latest.step if latest else None,
        }

    return await _each(await agents.list_agents(), row, skipped)


async def _inspect_workflows(
    state: StateManager, skipped: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    from agenticstate.managers import WorkflowStateManager

    workflows = WorkflowStateManager(state_manager=state)
    found = {workflow.workflow_id: workflow for workflow in await workflows.list_workflows()}

    async def row(workflow_id: str) -> dict[str, Any]:
        workflow = found[workflow_id]
        checkpoints = await workflows.list_checkpoints(workflow_id)
        return {
            "workflow": workflow_id,
            "status": workflow.status.value,
            "current_step": workflow.current_step,
            "total_steps": workflow.total_steps,
            "checkpoints": len(checkpoints),
            "latest_checkpoint": checkpoints[0].checkpoint_id if checkpoints else None,
        }

    return await _each(found, row, skipped)


async def _inspect_teams(
    state: StateManager, skipped: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    from agenticstate.managers import OrchestrationStateManager

    orch = OrchestrationStateManager(state_manager=state)

    async def row(team_id: str) -> dict[str, Any]:
        team = await orch.get_team(team_id)
        queue = team.task_queue
        return {
            "team": team_id,
            "agents": {a.agent_id: a.status.value for a in team.agents.values()},
            "pending": len(queue.pending),
            "in_progress": len(queue.in_progress),
            "completed": len(queue.completed),
            "dead_letter": len(queue.dead_letter),
        }

    return await _each(await orch.list_teams(), row, skipped)


async def _inspect_knowledge(
    state: StateManager, skipped: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    from agenticstate.managers import KnowledgeStateManager

    kb = KnowledgeStateManager(state_manager=state)

    async def row(kb_id: str) -> dict[str, Any]:
        overview = await kb.get_knowledge_base_state(kb_id)
        return {
            "knowledge_base": kb_id,
            "documents": overview.total_documents,
            "embeddings": overview.total_embeddings,
            "pending": overview.documents_pending,
            "failed": overview.failed_documents,
            "indexing": overview.indexing_status.value if overview.indexing_status else None,
            "sources": len(overview.sources),
        }

    return await _each(await kb.list_knowledge_bases(), row, skipped)


async def _inspect_tools(
    state: StateManager, skipped: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    from agenticstate.managers import ToolStateManager

    tools = ToolStateManager(state_manager=state)
    pending = await tools.get_pending_retries(due_only=False)

    async def row(name: str) -> dict[str, Any]:
        stats = await tools.get_tool_stats(name)
        return {
            "tool": name,
            "runs": stats.total_executions,
            "success_rate": stats.success_rate,
            "cache_hit_rate": stats.cache_hit_rate,
            "avg_ms": stats.avg_duration_ms,
            "p95_ms": stats.p95_duration_ms,
            "pending_retries": sum(1 for r in pending if r.tool_name == name),
        }

    return await _each(await tools.list_tools(), row, skipped)


async def _inspect_sessions(
    state: StateManager, skipped: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    from agenticstate.managers import SessionManager

    sessions = SessionManager(state_manager=state)
    ids = await sessions.list_session_ids()
    try:
        found = await sessions.get_sessions(ids)
    except (DecodeError, ForeignRecordError):  # one does not read: read them one by one

        async def one(session_id: str) -> dict[str, Any]:
            session = await sessions.get_session(session_id)
            if session is None:
                raise NotFoundError(session_id)
            return {"session": session}

        found = [row["session"] for row in await _each(ids, one, skipped)]
    return [
        {
            "session": session.session_id,
            "user": session.user_id,
            "name": session.name,
            "messages": session.message_count,
            "updated": session.updated_at.isoformat(),
        }
        for session in sorted(found, key=lambda s: s.updated_at.timestamp(), reverse=True)
    ]


async def _inspect_speech(
    state: StateManager, skipped: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    from agenticstate.managers import SpeechStateManager

    speech = SpeechStateManager(state_manager=state)
    return [
        {
            "session": session.session_id,
            "type": session.session_type,
            "mode": session.streaming_mode.value,
            "status": session.status.value,
            "created": session.created_at.isoformat(),
        }
        for session in await speech.list_sessions(active_only=False)
    ]


def _second(stamp: str) -> str:
    return datetime.fromisoformat(stamp).isoformat(timespec="seconds")


def _agents(statuses: dict[str, str]) -> str:
    return ", ".join(f"{agent}:{status}" for agent, status in statuses.items()) or "-"


@dataclasses.dataclass(frozen=True)
class _Inspector:
    """What `inspect <target>` reads, and the table that shows it."""

    read: Callable[[StateManager, list[tuple[str, str]]], Awaitable[list[dict[str, Any]]]]
    columns: tuple[_Column, ...]


_INSPECTORS: dict[str, _Inspector] = {
    "agents": _Inspector(
        _inspect_agents,
        (
            _col("agent", "agent"),
            _col("snapshots", "snapshots"),
            _col("checkpoints", "checkpoints"),
            _col("latest checkpoint", "latest_checkpoint"),
            _col("step", "step"),
        ),
    ),
    "workflows": _Inspector(
        _inspect_workflows,
        (
            _col("workflow", "workflow"),
            _col("status", "status"),
            _Column("step", lambda row: f"{row['current_step']}/{row['total_steps']}"),
            _col("checkpoints", "checkpoints"),
            _col("latest checkpoint", "latest_checkpoint"),
        ),
    ),
    "teams": _Inspector(
        _inspect_teams,
        (
            _col("team", "team"),
            _col("agents", "agents", _agents),
            _col("pending", "pending"),
            _col("in progress", "in_progress"),
            _col("completed", "completed"),
            _col("dead letter", "dead_letter"),
        ),
    ),
    "knowledge": _Inspector(
        _inspect_knowledge,
        (
            _col("knowledge base", "knowledge_base"),
            _col("documents", "documents"),
            _col("embeddings", "embeddings"),
            _col("pending", "pending"),
            _col("failed", "failed"),
            _col("indexing", "indexing"),
            _col("sources", "sources"),
        ),
    ),
    "tools": _Inspector(
        _inspect_tools,
        (
            _col("tool", "tool"),
            _col("runs", "runs"),
            _col("success", "success_rate", _percent),
            _col("cache hits", "cache_hit_rate", _percent),
            _col("avg ms", "avg_ms", _ms),
            _col("p95 ms", "p95_ms", _ms),
            _col("pending retries", "pending_retries"),
        ),
    ),
    "sessions": _Inspector(
        _inspect_sessions,
        (
            _col("session", "session"),
            _col("user", "user"),
            _col("name", "name"),
            _col("messages", "messages"),
            _col("updated", "updated", _second),
        ),
    ),
    "speech": _Inspector(
        _inspect_speech,
        (
            _col("session", "session"),
            _col("type", "type"),
            _col("mode", "mode"),
            _col("status", "status"),
            _col("created", "created", _second),
        ),
    ),
}
"""`inspect <target>`: the records each target reads, and the columns of its table (`--json`
prints the records themselves: numbers as numbers, rates as fractions, times in ISO 8601)."""


_STORE_EPILOG = f"""\
the store: --url, else the AGENTICSTATE_URL environment variable, else {DEFAULT_URL}
(the SQLite database ./state/state.db). Only `set`, `import`, `copy` (its destination) and
`demo` create a store; every other command on a missing store exits 1 and creates nothing.
Global options (--url, --prefix, --json, --no-progress) go before or after the command.

"""
_EXIT_CODES = """\
exit codes:
  0  success
  1  the key, record or store was not found
  2  bad usage or input
  3  the backend failed: unreachable, in use by another process, corrupt, unsupported server
"""
_EPILOG = _STORE_EPILOG + _EXIT_CODES


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {text}")
    return value


def _ttl_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
    try:
        as_ttl(value)
    except InvalidArgumentError as exc:
        if value > 0 and math.isfinite(value):  # too long: say so
            raise argparse.ArgumentTypeError(str(exc)) from None
        raise argparse.ArgumentTypeError(
            f"must be a positive number of seconds, not {text}"
        ) from None
    return value


_URL_HELP = (
    "the store: sqlite://FILE (the default), file://DIR or file://DIR/NAME.json, memory:// "
    "(empty, and gone when the command exits), redis://HOST:PORT/DB, rediss://... (TLS), "
    "unix://SOCKET, redis+cluster://HOST:PORT,..., rediss+cluster://..., "
    "postgresql://USER@HOST/DB or postgres://... "
    f"(default: $AGENTICSTATE_URL, else {DEFAULT_URL})"
)
_GLOBAL_HELP = {
    "url": _URL_HELP,
    "prefix": "the key prefix (namespace) to work in, ending in ':' (such as app:); SQLite and "
    "Redis stores hold many, a file or memory store is one namespace",
    "json": "machine-readable output",
    "no_progress": "no live progress on stderr (shown only on a terminal, never with --json)",
}
_GLOBAL_DEFAULTS: dict[str, object] = {
    "url": None,
    "prefix": "",
    "json": False,
    "no_progress": False,
}
_NOT_FOR: dict[str, dict[str, str]] = {
    # The global options a command does not take, and why: refused the same way whether they
    # come before or after the command.
    "copy": {"url": "copy names its stores as arguments (SRC_URL DST_URL)"},
    "export": {"url": "export names its store as an argument (URL FILE)"},
    "import": {"url": "import names its store as an argument (FILE URL)"},
    "demo": {
        "url": "the demo runs on its own store, ./.state/demo/state.db",
        "prefix": "the demo runs on its own store, ./.state/demo/state.db",
        "json": "the demo prints a report for people to read",
    },
}
"""Global options a command refuses (every other command takes all four)."""


def _global_options(parser: argparse.ArgumentParser, *, command: str | None) -> None:
    """Add `--url`, `--prefix`, `--json` and `--no-progress` to the main parser or a command's.

    On the main parser (`command=None`) with their defaults; on each command with SUPPRESS, so
    an option given after the command sets it and one left out does not reset what was given
    before. A command that does not take an option still parses it (hidden from its help), so
    that `_check_global_options` refuses it with the same words before or after the command.
    """
    refused = _NOT_FOR.get(command or "", {})
    for name, text in _GLOBAL_HELP.items():
        flag = "--" + name.replace("_", "-")
        default = _GLOBAL_DEFAULTS[name] if command is None else argparse.SUPPRESS
        shown = argparse.SUPPRESS if name in refused else text
        if isinstance(_GLOBAL_DEFAULTS[name], bool):
            parser.add_argument(flag, action="store_true", default=default, help=shown)
        else:
            metavar = name.upper()
            parser.add_argument(flag, default=default, metavar=metavar, help=shown)


def _check_global_options(args: argparse.Namespace) -> None:
    """Refuse a global option the command does not take (exit 2), rather than ignore it."""
    for name, reason in _NOT_FOR.get(args.command, {}).items():
        if getattr(args, name) != _GLOBAL_DEFAULTS[name]:
            flag = "--" + name.replace("_", "-")
            _fail(f"{args.command} does not take {flag}: {reason}", EXIT_USAGE)


# -- `agenticstate ui`: the web inspector (agenticstate[ui]) ---------------------------------


def _ui_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    ui = command("ui", "serve the live web inspector (agenticstate[ui])")
    ui.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1)")
    ui.add_argument("--port", type=int, default=8765, help="the port (0: any free one)")
    ui.add_argument("--allow-writes", action="store_true", help="let the page edit and delete keys")
    ui.add_argument(
        "--require-token",
        action="store_true",
        help="require the printed token on 127.0.0.1 too (always required elsewhere)",
    )
    ui.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another host name browsers may use to reach it (a reverse proxy); repeatable",
    )
    ui.add_argument(
        "--sample-interval", type=float, default=2.0, help="seconds between queue chart points"
    )


async def _ui(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    try:
        from agenticstate import ui  # only this command needs it
    except ImportError as exc:
        raise _CommandError(str(exc), EXIT_USAGE) from None

    # Reach the store before listening, as every other command does with its first read: an
    # unreachable server or a wrong password exits 3 with the reason, instead of serving a
    # page that can read nothing. One read of one key (a round trip).
    await state.open()
    await state.exists("agenticstate-ui:reachable")

    def ready(address: str) -> None:
        mode = "edits allowed" if args.allow_writes else "read-only"
        if args.json:
            _out(_dump({"address": address, "allow_writes": args.allow_writes}))
        else:
            _out(f"agenticstate inspector ({mode}) on {address}")
        sys.stderr.write("open that address in a browser; Ctrl-C to stop\n")
        sys.stderr.flush()

    try:
        await ui.serve(
            state,
            host=args.host,
            port=args.port,
            allow_writes=args.allow_writes,
            require_token=args.require_token,
            allowed_hosts=args.allowed_host,
            sample_interval=args.sample_interval,
            ready=ready,
        )
    except OSError as exc:
        hint = ""
        if exc.errno == errno.EADDRINUSE:
            hint = "; choose another with --port, or --port 0 for any free one"
        raise _CommandError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}{hint}", EXIT_USAGE
        ) from None
    return EXIT_OK


# ---------------------------------------------------------------- reindex

_REINDEX_HELP = "build a Redis store's key index again (the index its listings read)"


async def _reindex(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    """`reindex`: `RedisBackend.reindex`; a store without a separate key index says so."""
    from agenticstate.backends.redis import RedisBackend  # only this command needs it

    backend = state.backend
    scheme = _url(args).partition("://")[0]
    if not isinstance(backend, RedisBackend):
        # SQLite, file and memory stores list from the records themselves, in key order:
        # there is no separate index to get out of step, so nothing to do (not an error, so
        # that a deploy step can run it on any store).
        if args.json:
            _out(_dump({"reindexed": False, "backend": scheme}))
        else:
            _out(
                f"nothing to reindex: a {scheme}:// store lists its keys from the records "
                "themselves (no separate key index)"
            )
        return EXIT_OK
    async with progress.ticking("reindexing", _seconds(), "second"):
        report = await backend.reindex()
    if args.json:
        _out(_dump({"reindexed": True, "keys": report.keys, "added": report.added}))
    else:
        where = f"prefix {args.prefix!r}" if args.prefix else "the empty prefix"
        _out(
            f"reindexed {where}: {report.keys:,} records found, {report.added:,} of them "
            "added to the key index"
        )
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agenticstate",
        description="Look at and change agenticstate state.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"agenticstate {__version__}")
    _global_options(parser, command=None)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=_EXIT_CODES if "url" in _NOT_FOR.get(name, {}) else _EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _global_options(sub, command=name)
        return sub

    keys = command("keys", "list keys matching a Redis glob")
    keys.add_argument(
        "pattern", nargs="?", default="*", help="a Redis glob such as 'agent:*' (default: *)"
    )
    get = command("get", "show a key's value and version")
    get.add_argument("key", help="the key to read")
    put = command("set", "store a JSON value (creates the store if needed)")
    put.add_argument("key", help="the key to write")
    put.add_argument("value", help='a JSON document, such as \'{"status": "idle"}\'')
    put.add_argument("--ttl", type=_ttl_seconds, default=None, help="seconds until it expires")
    delete = command("delete", "delete a key")
    delete.add_argument("key", help="the key to delete")
    watch = command("watch", "stream changes (old -> new) until Ctrl-C")
    watch.add_argument("pattern", help="a Redis glob such as 'agent:*'")
    watch.add_argument(
        "--count", type=_positive_int, default=None, help="stop after this many changes"
    )
    usage = command("usage", "keys and stored bytes, per namespace")
    usage.add_argument("pattern", nargs="?", default="*", help="a Redis glob (default: every key)")
    usage.add_argument("--max-time", type=float, default=None, help="stop after this many seconds")
    inspect = command("inspect", "summaries of the managers' records")
    inspect.add_argument(
        "target",
        metavar="TARGET",
        choices=list(_INSPECTORS),
        help="which manager's records: %(choices)s",
    )
    from agenticstate import _cli_history  # imports this module: loaded once it is complete

    _cli_history.add_commands(command)
    command("demo", "run the demo pipeline on its own store, ./.state/demo/state.db")
    command(
        "repair",
        "salvage a damaged file store's log: keep every intact write, keep a copy of the log",
    )
    _add_transfer_commands(command)
    _ui_parser(command)
    command("reindex", _REINDEX_HELP)
    return parser


_COMMANDS: dict[str, Callable[[StateManager, argparse.Namespace, Progress], Awaitable[int]]] = {
    "keys": _keys,
    "usage": _usage,
    "get": _get,
    "set": _set,
    "delete": _delete,
    "watch": _watch,
    "inspect": _inspect,
    "ui": _ui,
    "reindex": _reindex,
}


# ---------------------------------------------------------------- copy, export, import
# Each names its own stores (not --url); --prefix applies to every store it opens.


def _add_transfer_commands(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    copy = command("copy", "copy keys, TTLs and indexes from one store to another")
    copy.add_argument("source", metavar="SRC_URL", help="the store to read")
    copy.add_argument("destination", metavar="DST_URL", help="the store to write")
    copy.add_argument("pattern", nargs="?", default="*", help="a Redis glob (default: *)")
    export = command("export", "write a store to a JSON-lines dump file")
    export.add_argument("source", metavar="URL", help="the store to read")
    export.add_argument("file", metavar="FILE", help="the dump file to write")
    export.add_argument("pattern", nargs="?", default="*", help="a Redis glob (default: *)")
    load = command("import", "write a dump file (from export) into a store")
    load.add_argument("file", metavar="FILE", help="a dump file from export")
    load.add_argument("destination", metavar="URL", help="the store to write")


def _open_url(url: str, prefix: str, *, create: bool) -> Backend:
    """The backend at `url`; with `create=False` opening it never makes a store."""
    try:
        backend = open_backend(url, key_prefix=prefix, create=create)
    except ConfigurationError as exc:
        raise _CommandError(str(exc), EXIT_USAGE) from None
    path = getattr(backend, "path", None)
    if (
        not create
        and not hasattr(backend, "create")
        and isinstance(path, Path)
        and not path.exists()
    ):
        # A store in a file, whose backend has no `create` option to refuse it: opening would
        # create it, so a missing file is refused here.
        raise _missing(url, NotFoundError(f"the database {path} does not exist"))
    return backend


async def _transfer(args: argparse.Namespace, progress: Progress) -> int:
    from agenticstate import transfer  # only these commands need it

    def show(done: transfer.TransferProgress) -> None:
        progress.update(f"{args.command}: keys", done.entries, "key")

    async with contextlib.AsyncExitStack() as stack:

        async def store(url: str, *, create: bool, backend: Backend | None = None) -> Backend:
            backend = backend or _open_url(url, args.prefix, create=create)
            return await stack.enter_async_context(_opened(url, backend))

        if args.command == "import":
            made = _open_url(args.destination, args.prefix, create=True)
            _refuse_memory(made, args.destination, "import")
            limit = transfer.value_limit(made)
            try:
                # The whole file first: a bad file neither creates the store nor writes to it.
                await anyio.to_thread.run_sync(
                    functools.partial(transfer.check_dump, args.file, max_value=limit)
                )
                destination = await store(args.destination, create=True, backend=made)
                done = await transfer.import_state(args.file, destination, progress=show)
            except OSError as exc:
                raise _CommandError(
                    f"cannot read {args.file}: {exc.strerror or exc}", EXIT_USAGE
                ) from None
        else:
            source = await store(args.source, create=False)
            if args.command == "copy":
                made = _open_url(args.destination, args.prefix, create=True)
                _refuse_memory(made, args.destination, "copy")
                destination = await store(args.destination, create=True, backend=made)
                done = await transfer.copy_state(source, destination, args.pattern, progress=show)
            else:
                try:
                    done = await transfer.export_state(
                        source, args.file, args.pattern, progress=show
                    )
                except OSError as exc:
                    message = f"cannot write {args.file}: {exc.strerror or exc}"
                    raise _CommandError(message, EXIT_USAGE) from None
    progress.clear()
    totals = {"entries": done.entries, "indexes": done.indexes, "skipped": done.skipped}
    report = (
        _dump(totals)
        if args.json
        else f"{args.command}: {done.entries} keys, "
        f"{done.indexes} indexes, {done.skipped} skipped (expired or gone)"
    )
    if args.command == "export" and _is_stdout(args.file):
        sys.stderr.write(report + "\n")  # the dump went to stdout: the totals must not follow it
    else:
        _out(report)
    return EXIT_OK


def _is_stdout(path: str) -> bool:
    """Whether `path` is this process's standard output (`/dev/stdout`, `/proc/self/fd/1`)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError):
        return False


async def _repair(args: argparse.Namespace, progress: Progress) -> int:
    """`repair`: salvage a damaged file store's log (`FileBackend.repair`)."""
    url = _url(args)
    backend = _open_url(url, args.prefix, create=True)  # never opened: repair() creates nothing
    if not isinstance(backend, FileBackend):
        raise _CommandError(
            f"repair works on file stores (file://DIR), not {url.partition('://')[0]}:// ones",
            EXIT_USAGE,
        )
    try:
        report = await backend.repair()
    except NotFoundError as exc:
        raise _missing(url, exc) from None
    if args.json:
        _out(
            _dump(
                dataclasses.asdict(report)
                | {
                    "log_path": str(report.log_path),
                    "damaged_copy": None
                    if report.damaged_copy is None
                    else str(report.damaged_copy),
                }
            )
        )
    elif report.damaged_copy is None:
        _out(f"nothing to repair: the log holds {report.records_kept} writes, all intact")
    else:
        ranges = ", ".join(f"{start}-{end}" for start, end in report.dropped)
        _out(
            f"repaired: kept {report.records_kept} writes in {report.frames_kept} frames, dropped "
            f"{report.bytes_dropped} damaged bytes (at {ranges or 'the end'}); the damaged log "
            f"was kept as {report.damaged_copy}"
        )
    return EXIT_OK


_TRANSFERS = {"copy": _transfer, "export": _transfer, "import": _transfer, "repair": _repair}


def _seconds() -> Callable[[], int]:
    start = time.monotonic()
    return lambda: int(time.monotonic() - start)


async def _run(args: argparse.Namespace, progress: Progress) -> int:
    state = _manager(args)
    if args.command in _CREATES:
        _refuse_memory(state.backend, _url(args), args.command)
    # A large file store takes a while to load, and to snapshot when it closes.
    async with progress.ticking("opening the store", _seconds(), "second"):
        try:
            await state.open()
        except NotFoundError as exc:
            with anyio.CancelScope(shield=True):
                await state.aclose()
            raise _missing(_url(args), exc) from None
    from agenticstate import _cli_history

    run = _COMMANDS.get(args.command) or _cli_history.COMMANDS[args.command]
    try:
        return await run(state, args, progress)
    finally:
        with anyio.CancelScope(shield=True):
            async with progress.ticking("closing the store", _seconds(), "second"):
                await state.aclose()


def configure_logging(progress: Progress | None = None) -> None:
    """Send the library's warnings and worse to stderr, never into the output a script reads.

    The library never configures logging; the command and the demo are applications, so they
    do: one handler on the `agenticstate` logger, which does not propagate to the root logger.

    Args:
        progress: A progress line on stderr to erase before each log line.
    """
    stream = progress.wrap(sys.stderr) if progress is not None else sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        logging.Formatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    )
    logger = logging.getLogger("agenticstate")
    for old in [h for h in logger.handlers if getattr(h, "_agenticstate_cli", False)]:
        logger.removeHandler(old)
    handler._agenticstate_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False


def _fail(message: str, code: int) -> NoReturn:
    sys.stderr.write(f"agenticstate: {message}\n")
    raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line."""
    args = _parser().parse_args(argv)
    _check_global_options(args)
    wanted = not args.json and not args.no_progress
    if args.command == "demo":
        # The demo prints its report as it goes: a counter only when that goes somewhere else.
        progress = Progress.on_stderr(enabled=wanted and not is_terminal(sys.stdout))
        configure_logging(progress)
        _guarded(_demo, progress)
        return
    progress = Progress.on_stderr(enabled=wanted)
    configure_logging(progress)
    _guarded(_TRANSFERS.get(args.command, _run), args, progress)


async def _demo(progress: Progress) -> int:
    from agenticstate import demo  # only this command needs it

    await demo.main(progress)
    return EXIT_OK


# Signals that stop a command as Ctrl-C does: cancelled, so that stores close and an export's
# temporary file is removed. (SIGTERM is what `timeout`, systemd, container runtimes and CI
# runners send; SIGHUP, a closed terminal.)
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class _Stopped(BaseException):
    """The command was stopped by a signal (after cleaning up)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


async def _stoppable(run: Callable[..., Awaitable[int]], *args: Any) -> int:
    """Run a command; a stop signal cancels it, as Ctrl-C does, and raises `_Stopped` after."""
    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as group:

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(*_STOP_SIGNALS) as received:
                async for signum in received:
                    outcome["signal"] = int(signum)
                    group.cancel_scope.cancel()
                    return

        async def command() -> None:
            try:
                outcome["code"] = await run(*args)
            except Exception as exc:  # noqa: BLE001  # re-raised below, outside the task group
                outcome["error"] = exc
            finally:
                group.cancel_scope.cancel()

        group.start_soon(watch_signals)
        group.start_soon(command)
    if "signal" in outcome:
        raise _Stopped(outcome["signal"])
    if "error" in outcome:
        raise outcome["error"]
    code: int = outcome["code"]
    return code


def _guarded(run: Callable[..., Awaitable[int]], *args: Any) -> NoReturn:
    # Every failure the user can cause or meet becomes one line on stderr and an exit code.
    try:
        code = anyio.run(_stoppable, run, *args)
    except _Stopped as exc:
        raise SystemExit(128 + exc.signum) from None
    except _CommandError as exc:
        _fail(str(exc), exc.code)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except BrokenPipeError:
        # The reader went away (`agenticstate keys | head -1`); the store was closed properly.
        # Exit as a process stopped by SIGPIPE would, without a traceback or a flush error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(141) from None
    except DecodeError as exc:
        # A stored record that does not read (corrupt, foreign, from a newer release): the
        # store is at fault, not the command line.
        _fail(str(exc), EXIT_BACKEND)
    except (InvalidArgumentError, SerializationError) as exc:
        _fail(str(exc), EXIT_USAGE)
    except NotFoundError as exc:
        _fail(str(exc), EXIT_NOT_FOUND)
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_USAGE)
    except BackendError as exc:
        _fail(f"{exc} ({type(exc).__name__})", EXIT_BACKEND)
    except AgenticStateError as exc:
        _fail(f"{exc} ({type(exc).__name__})", EXIT_BACKEND)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
