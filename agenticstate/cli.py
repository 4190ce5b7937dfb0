"""The `agenticstate` command: look at and change state from a shell.

```console
agenticstate --url file://./state keys 'agent:*'
agenticstate --url redis://localhost:6379/0 --prefix agenticai: get agent:researcher
agenticstate set agent:researcher '{"status": "idle"}' --ttl 3600
agenticstate watch 'agent:*'
agenticstate inspect workflows
agenticstate demo
agenticstate copy sqlite://./state/state.db redis://localhost:6379/0 'agent:*'
agenticstate export redis://localhost:6379/0 backup.jsonl
agenticstate import backup.jsonl sqlite://./restored.db
```

The store comes from `--url` (or `AGENTICSTATE_URL`, else `file://./state`): `memory://`,
`file://DIR`, `sqlite://FILE`, `redis://...`, `rediss://...`, `unix://...`, or any scheme a
backend registered. `--json` prints machine-readable output.
Long operations (`keys`, `inspect`, `demo`) show a live counter on stderr when it is a terminal,
unless `--json` or `--no-progress` is given; stdout never carries it.

Exit codes: 0 success, 1 the key or record was not found, 2 bad usage or input, 3 the backend
failed (unreachable, in use by another process, corrupt).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import sys
import time
from datetime import date, datetime
from typing import TYPE_CHECKING, Any, NoReturn
from uuid import UUID

import anyio
import structlog

from agenticstate._keys import validate_pattern
from agenticstate._progress import Progress, is_terminal
from agenticstate.backends import open_backend
from agenticstate.exceptions import (
    AgenticStateError,
    BackendError,
    ConfigurationError,
    InvalidArgumentError,
    NotFoundError,
    SerializationError,
)
from agenticstate.manager import StateManager

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from agenticstate.backends import Backend

__all__ = ["configure_logging", "main"]

EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_BACKEND = 0, 1, 2, 3


class _CommandError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, bytes):
        return {"$base64": base64.b64encode(value).decode()}
    if value is Ellipsis:
        return "..."
    raise TypeError(f"cannot show {type(value).__name__}")


def _dump(value: Any, *, pretty: bool = False) -> str:
    return json.dumps(value, default=_plain, ensure_ascii=False, indent=2 if pretty else None)


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
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


def _manager(args: argparse.Namespace) -> StateManager:
    url = args.url or os.environ.get("AGENTICSTATE_URL") or "file://./state"
    try:
        backend = open_backend(url, key_prefix=args.prefix)
    except ConfigurationError as exc:
        raise _CommandError(str(exc), EXIT_USAGE) from None
    return StateManager(backend=backend)


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


async def _get(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    entry = await state.get_entry(args.key)
    if entry is None:
        raise _CommandError(f"no state at key {args.key!r}", EXIT_NOT_FOUND)
    if args.json:
        _out(_dump(entry.model_dump()))
    else:
        _out(_dump(entry.value, pretty=True))
        ttl = f", expires in {entry.ttl}" if entry.ttl is not None else ""
        _out(f"(version {entry.version}, updated {entry.updated_at.isoformat()}{ttl})")
    return EXIT_OK


async def _set(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    try:
        value = json.loads(args.value)
    except json.JSONDecodeError as exc:
        raise _CommandError(
            f"VALUE is not valid JSON: {exc.msg} (column {exc.colno})", EXIT_USAGE
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


async def _watch(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    seen = 0
    async with state.watch(args.pattern) as changes:
        # On stderr, once subscribed: from here on no change is missed.
        sys.stderr.write(f"watching {args.pattern!r} (Ctrl-C to stop)\n")
        sys.stderr.flush()
        async for change in changes:
            if args.json:
                _out(_dump(change.model_dump()))
            else:
                _out(
                    f"{change.timestamp.isoformat()}  {change.op.value:<6} {change.key}  "
                    f"v{change.version}  {_dump(change.old_value)} -> {_dump(change.new_value)}"
                )
            seen += 1
            if args.count and seen >= args.count:
                break
    return EXIT_OK


async def _inspect(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    # The managers read many records in few calls: count the reads while they run.
    async with progress.ticking(f"reading {args.what}", lambda: state.stats().reads, "record"):
        rows, columns = await _inspected(state, args.what)
    _out(_dump(rows) if args.json else _table(rows, columns))
    return EXIT_OK


async def _inspected(state: StateManager, what: str) -> tuple[list[dict[str, Any]], list[str]]:
    from agenticstate.managers import (  # only this command needs them
        OrchestrationStateManager,
        SpeechStateManager,
        ToolStateManager,
        WorkflowStateManager,
    )

    rows: list[dict[str, Any]]
    if what == "workflows":
        workflows = WorkflowStateManager(state_manager=state)
        found = await workflows.list_workflows()
        rows = []
        for workflow in found:
            checkpoints = await workflows.list_checkpoints(workflow.workflow_id)
            rows.append(
                {
                    "workflow": workflow.workflow_id,
                    "status": workflow.status.value,
                    "step": f"{workflow.current_step}/{workflow.total_steps}",
                    "checkpoints": len(checkpoints),
                    "latest checkpoint": checkpoints[0].checkpoint_id if checkpoints else "-",
                }
            )
        columns = ["workflow", "status", "step", "checkpoints", "latest checkpoint"]
    elif what == "teams":
        orch = OrchestrationStateManager(state_manager=state)
        rows = []
        for team_id in await orch.list_teams():
            team = await orch.get_team(team_id)
            queue = team.task_queue
            rows.append(
                {
                    "team": team_id,
                    "agents": ", ".join(
                        f"{a.agent_id}:{a.status.value}" for a in team.agents.values()
                    ),
                    "pending": len(queue.pending),
                    "in progress": len(queue.in_progress),
                    "completed": len(queue.completed),
                    "dead letter": len(queue.dead_letter),
                }
            )
        columns = ["team", "agents", "pending", "in progress", "completed", "dead letter"]
    elif what == "tools":
        tools = ToolStateManager(state_manager=state)
        names = sorted(
            {
                key.split("}", 1)[0][len("tools:{") :]
                for key in await state.list_keys("tools:{*}:stats")
            }
        )
        pending = await tools.get_pending_retries(due_only=False)
        rows = []
        for name in names:
            stats = await tools.get_tool_stats(name)
            rows.append(
                {
                    "tool": name,
                    "runs": stats.total_executions,
                    "success": f"{stats.success_rate:.0%}",
                    "cache hits": f"{stats.cache_hit_rate:.0%}",
                    "avg ms": f"{stats.avg_duration_ms:.1f}",
                    "p95 ms": f"{stats.p95_duration_ms:.1f}",
                    "pending retries": sum(1 for r in pending if r.tool_name == name),
                }
            )
        columns = ["tool", "runs", "success", "cache hits", "avg ms", "p95 ms", "pending retries"]
    else:
        speech = SpeechStateManager(state_manager=state)
        rows = [
            {
                "session": session.session_id,
                "type": session.session_type,
                "mode": session.streaming_mode.value,
                "status": session.status.value,
                "created": session.created_at.isoformat(timespec="seconds"),
            }
            for session in await speech.list_sessions(active_only=False)
        ]
        columns = ["session", "type", "mode", "status", "created"]
    return rows, columns


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agenticstate", description="Look at and change agenticstate state."
    )
    parser.add_argument(
        "--url", help="memory://, file://DIR, sqlite://FILE, redis://..., rediss://..., unix://..."
    )
    parser.add_argument("--prefix", default="", help="the key prefix (namespace) to work in")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no live progress on stderr (shown only on a terminal, never with --json)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    keys = commands.add_parser("keys", help="list keys matching a Redis glob")
    keys.add_argument("pattern", nargs="?", default="*")
    get = commands.add_parser("get", help="show a key's value and version")
    get.add_argument("key")
    put = commands.add_parser("set", help="store a JSON value")
    put.add_argument("key")
    put.add_argument("value", help="a JSON document")
    put.add_argument("--ttl", type=float, default=None, help="seconds until it expires")
    delete = commands.add_parser("delete", help="delete a key")
    delete.add_argument("key")
    watch = commands.add_parser("watch", help="stream changes (old -> new) until Ctrl-C")
    watch.add_argument("pattern")
    watch.add_argument("--count", type=int, default=0, help="stop after this many changes")
    inspect = commands.add_parser("inspect", help="summaries of the managers' records")
    inspect.add_argument("what", choices=["workflows", "teams", "tools", "speech"])
    commands.add_parser("demo", help="run the demo job on the file backend")
    _add_transfer_commands(commands)
    return parser


_COMMANDS: dict[str, Callable[[StateManager, argparse.Namespace, Progress], Awaitable[int]]] = {
    "keys": _keys,
    "get": _get,
    "set": _set,
    "delete": _delete,
    "watch": _watch,
    "inspect": _inspect,
}


# ---------------------------------------------------------------- copy, export, import
# Each names its own stores (not --url); --prefix applies to every store it opens.


def _add_transfer_commands(commands: Any) -> None:
    copy = commands.add_parser("copy", help="copy keys, TTLs and indexes from one store to another")
    copy.add_argument("source", metavar="SRC_URL")
    copy.add_argument("destination", metavar="DST_URL")
    copy.add_argument("pattern", nargs="?", default="*")
    export = commands.add_parser("export", help="write a store to a JSON-lines dump file")
    export.add_argument("source", metavar="URL")
    export.add_argument("file", metavar="FILE")
    export.add_argument("pattern", nargs="?", default="*")
    load = commands.add_parser("import", help="write a dump file (from export) into a store")
    load.add_argument("file", metavar="FILE")
    load.add_argument("destination", metavar="URL")


def _open_url(url: str, prefix: str) -> Backend:
    try:
        return open_backend(url, key_prefix=prefix)
    except ConfigurationError as exc:
        raise _CommandError(str(exc), EXIT_USAGE) from None


async def _transfer(args: argparse.Namespace, progress: Progress) -> int:
    from agenticstate import transfer  # only these commands need it

    def show(done: transfer.TransferProgress) -> None:
        progress.update(f"{args.command}: keys", done.entries, "key")

    async with contextlib.AsyncExitStack() as stack:
        if args.command == "import":
            destination = await stack.enter_async_context(_open_url(args.destination, args.prefix))
            try:
                done = await transfer.import_state(args.file, destination, progress=show)
            except OSError as exc:
                raise _CommandError(
                    f"cannot read {args.file}: {exc.strerror}", EXIT_USAGE
                ) from None
        else:
            source = await stack.enter_async_context(_open_url(args.source, args.prefix))
            if args.command == "copy":
                destination = await stack.enter_async_context(
                    _open_url(args.destination, args.prefix)
                )
                done = await transfer.copy_state(source, destination, args.pattern, progress=show)
            else:
                try:
                    done = await transfer.export_state(
                        source, args.file, args.pattern, progress=show
                    )
                except OSError as exc:
                    message = f"cannot write {args.file}: {exc.strerror}"
                    raise _CommandError(message, EXIT_USAGE) from None
    progress.clear()
    totals = {"entries": done.entries, "indexes": done.indexes, "skipped": done.skipped}
    _out(
        _dump(totals)
        if args.json
        else f"{args.command}: {done.entries} keys, "
        f"{done.indexes} indexes, {done.skipped} skipped (expired or gone)"
    )
    return EXIT_OK


_TRANSFERS = {"copy": _transfer, "export": _transfer, "import": _transfer}


def _seconds() -> Callable[[], int]:
    start = time.monotonic()
    return lambda: int(time.monotonic() - start)


async def _run(args: argparse.Namespace, progress: Progress) -> int:
    state = _manager(args)
    # A large file store takes a while to load, and to snapshot when it closes.
    async with progress.ticking("opening the store", _seconds(), "second"):
        await state.open()
    try:
        return await _COMMANDS[args.command](state, args, progress)
    finally:
        with anyio.CancelScope(shield=True):
            async with progress.ticking("closing the store", _seconds(), "second"):
                await state.aclose()


def configure_logging(progress: Progress | None = None) -> None:
    """Send warnings and worse to stderr, never mixed into the output a script reads.

    The library never configures logging; the command and the demo are applications, so they do.

    Args:
        progress: A progress line on stderr to erase before each log line.
    """
    stream = progress.wrap(sys.stderr) if progress is not None else sys.stderr
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(stream),
    )


def _fail(message: str, code: int) -> NoReturn:
    sys.stderr.write(f"agenticstate: {message}\n")
    raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line."""
    args = _parser().parse_args(argv)
    wanted = not args.json and not args.no_progress
    if args.command == "demo":
        from agenticstate import demo  # only this command needs it

        # The demo prints its report as it goes: a counter only when that goes somewhere else.
        progress = Progress.on_stderr(enabled=wanted and not is_terminal(sys.stdout))
        configure_logging(progress)
        anyio.run(demo.main, progress)
        return
    progress = Progress.on_stderr(enabled=wanted)
    configure_logging(progress)
    try:
        code = anyio.run(_TRANSFERS.get(args.command, _run), args, progress)
    except _CommandError as exc:
        _fail(str(exc), exc.code)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
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
