"""The inspector's ASGI application: a JSON API, a server-sent event stream and static files."""

from __future__ import annotations

import contextlib
import hmac
import json
import re
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from agenticstate._keys import validate_key, validate_pattern
from agenticstate._log import get_logger
from agenticstate.exceptions import (
    AgenticStateError,
    ConflictError,
    DecodeError,
    ForeignRecordError,
    InvalidArgumentError,
    NotFoundError,
    SerializationError,
    SubscriptionClosedError,
)
from agenticstate.managers import (
    AgentRecoveryManager,
    AgentStateStore,
    KnowledgeStateManager,
    OrchestrationStateManager,
    SessionManager,
    SpeechStateManager,
    ToolStateManager,
    WorkflowStateManager,
)
from agenticstate.managers._base import skipping_bad_records
from agenticstate.ui._render import plain, shown

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

    from starlette.requests import Request
    from starlette.types import ASGIApp, Receive, Scope, Send

    from agenticstate.events import StateChange
    from agenticstate.manager import StateManager, Watch
    from agenticstate.managers import AudioSession, RetryState, WorkflowState

log = get_logger(__name__)

COOKIE = "agenticstate_ui_token"
"""The cookie that carries the token once the browser has opened the printed address (its name
ends with the server's port: browsers share cookies across the ports of one host, and two
inspectors must not overwrite each other's)."""

MAX_KEYS = 5000
"""The most keys one listing returns (the listing says when more matched; `limit` may not be
larger). A listing reads each key's metadata and size (`Backend.stat_many`), never its value."""

MAX_VALUE_CHARS = 1_000_000
"""Values longer than this (as JSON) are cut when shown; the text is built only this far."""

MAX_STREAM_VALUE_CHARS = 2_000
"""Values in the live stream and session messages are cut to this many characters."""

MAX_MESSAGES = 1000
"""The most messages of a session one request returns (`last` may not be larger)."""

MAX_VERSIONS = 20
"""The most retained versions of a key the value view lists (the newest), each value cut to
`MAX_STREAM_VALUE_CHARS` characters."""

MAX_LISTED = 50
"""The most checkpoints of an agent, and sources of a knowledge base, one view lists (newest)."""

MAX_WRITE_BYTES = 16 * 1024 * 1024
"""The largest body a save from the page may have (HTTP 413 beyond it, read no further): the
page edits only values it shows whole, at most `MAX_VALUE_CHARS` characters of JSON."""

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})

_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/app.css": ("app.css", "text/css; charset=utf-8"),
}

_SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cross-origin-resource-policy": "same-origin",
    "cache-control": "no-store",
}


def _json(value: Any) -> str:
    return json.dumps(value, default=plain, ensure_ascii=False)


def _reply(data: Any, status: int = 200) -> Response:
    return Response(_json(data), status_code=status, media_type="application/json")


def _error(message: str, status: int) -> Response:
    return JSONResponse({"error": message}, status_code=status)


@dataclass
class QueueSample:
    """A team's queue at one moment: what the chart draws."""

    at: datetime
    pending: int
    in_progress: int
    dead_letter: int
    expired_leases: int


@dataclass
class InspectorSettings:
    """How the inspector guards the store (see `create_app`)."""

    allow_writes: bool = False
    token: str | None = None
    allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS
    sample_interval: float = 2.0
    samples_kept: int = 300
    history: dict[str, deque[QueueSample]] = field(default_factory=dict)
    stopping: anyio.Event = field(default_factory=anyio.Event)
    """Set when the server shuts down: live streams end so that it need not cut them."""


class _Guard:
    """Host, origin and token checks in front of every request (pure ASGI middleware).

    - The Host header must name an allowed host: a page on another site that re-points its own
      name at 127.0.0.1 (DNS rebinding) sends its own name and is refused.
    - A request the browser marks as coming from another site (`Sec-Fetch-Site`) is refused, so
      no other page can read values or send writes through the user's browser.
    - With a token, every request carries it: the printed address sets it as a strict,
      HTTP-only cookie, or a client sends `Authorization: Bearer TOKEN`.
    """

    def __init__(self, app: ASGIApp, settings: InspectorSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                extra = [(k.encode(), v.encode()) for k, v in _SECURITY_HEADERS.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> Response | None:
        allowed = self.settings.allowed_hosts
        host = _hostname(headers.get("host", ""))
        if allowed is not None and host not in allowed:
            return _error("host not allowed (see --allowed-host)", 403)
        if headers.get("sec-fetch-site", "same-origin") not in {"same-origin", "none"}:
            return _error("cross-site requests are refused", 403)
        method = scope["method"]
        if method not in {"GET", "HEAD"}:
            origin = headers.get("origin")
            if origin is None or _hostport(origin) != headers.get("host", "").lower():
                return _error("writes must come from the inspector's own page", 403)
        token = self.settings.token
        if token is None:
            return None
        if _presented(scope, headers, token):
            return None
        query = dict(
            part.split("=", 1) if "=" in part else (part, "")
            for part in scope.get("query_string", b"").decode("latin-1").split("&")
        )
        offered = query.get("token", "")
        if scope["path"] == "/" and method == "GET" and _same(offered, token):
            response = RedirectResponse("/", status_code=303)
            response.set_cookie(
                _cookie_name(scope), token, httponly=True, samesite="strict", path="/"
            )
            return response
        return _error("a token is required: open the address the inspector printed", 401)


def _cookie_name(scope: Scope) -> str:
    server = scope.get("server")
    return f"{COOKIE}_{server[1]}" if server and server[1] else COOKIE


def _same(offered: str, token: str) -> bool:
    return hmac.compare_digest(offered.encode(), token.encode())


def _presented(scope: Scope, headers: dict[str, str], token: str) -> bool:
    authorization = headers.get("authorization", "")
    if authorization.startswith("Bearer ") and _same(authorization[7:], token):
        return True
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == _cookie_name(scope) and _same(value, token):
            return True
    return False


_HOST_HEADER = re.compile(r"(?:\[([0-9a-f:.]+)\]|([^:\[\]]*))(?::[0-9]{1,5})?")
"""`name`, `name:port`, `[v6]` or `[v6]:port`; anything else names no host."""


def _hostname(host: str) -> str:
    """The host name of a Host header, lower case; "" when it is malformed (refused)."""
    match = _HOST_HEADER.fullmatch(host.strip().lower())
    if match is None:
        return ""
    return match.group(1) or match.group(2)


def _hostport(origin: str) -> str:
    return origin.lower().split("://", 1)[-1].rstrip("/")


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        number = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"{name} must be an integer, not {raw!r}") from None
    if not low <= number <= high:
        raise InvalidArgumentError(f"{name} must be between {low} and {high}, not {number}")
    return number


_BAD_RECORD = (DecodeError, ForeignRecordError)
"""A stored record that does not read as what a tab shows (foreign, or from a newer release)."""


def _problem(key: str | None, error: str) -> dict[str, str | None]:
    return {"key": key, "error": error}


async def _each(
    ids: Iterable[str],
    row: Callable[[str], Awaitable[dict[str, Any] | None]],
    problems: list[dict[str, str | None]],
) -> list[dict[str, Any]]:
    """`row(id)` for each id, leaving out one whose records do not read.

    It is noted in `problems` (the error names its key), so one bad record never blanks a tab.
    """
    rows = []
    for id_ in ids:
        try:
            made = await row(id_)
        except NotFoundError:
            continue  # deleted between the listing and the read
        except _BAD_RECORD as exc:
            problems.append(_problem(getattr(exc, "key", None), f"{type(exc).__name__}: {exc}"))
            continue
        if made is not None:
            rows.append(made)
    return rows


def _with_problems(
    data: dict[str, Any], problems: list[dict[str, str | None]], skipped: list[tuple[str, str]]
) -> Response:
    """`data` with the records left out (`problems`: key and reason), for the page to show."""
    listed = [_problem(key, f"DecodeError: {reason}") for key, reason in skipped]
    return _reply({**data, "problems": listed + problems})


class Inspector:
    """The API behind the inspector's pages, over one open `StateManager`."""

    def __init__(self, state: StateManager, settings: InspectorSettings) -> None:
        self.state = state
        self.settings = settings
        self.orchestration = OrchestrationStateManager(state_manager=state)
        self.workflows = WorkflowStateManager(state_manager=state)
        self.tools = ToolStateManager(state_manager=state)
        self.sessions = SessionManager(state_manager=state)
        self.speech = SpeechStateManager(state_manager=state)
        self.agents = AgentStateStore(state_manager=state)
        self.recovery = AgentRecoveryManager(agent_store=self.agents)
        self.knowledge = KnowledgeStateManager(state_manager=state)

    # -- keys and values -------------------------------------------------------------------

    async def keys(self, request: Request) -> Response:
        """Keys matching `pattern`, each with its version, TTL and stored size."""
        pattern = validate_pattern(request.query_params.get("pattern") or "*")
        limit = _int_param(request, "limit", 500, 1, MAX_KEYS)
        found, more = await self._scan(pattern, limit)
        # Metadata and sizes only: a listing never transfers the values it lists.
        stats = await self.state.backend.stat_many(found) if found else []
        rows = [
            {
                "key": stat.key,
                "version": stat.version,
                "ttl": None if (ttl := stat.ttl()) is None else ttl.total_seconds(),
                "size": stat.size,
                "updated_at": stat.updated_at,
            }
            for stat in stats
            if stat is not None
        ]
        return _reply({"pattern": pattern, "keys": rows, "more": more, "limit": limit})

    async def _scan(self, pattern: str, limit: int) -> tuple[list[str], bool]:
        """The first `limit` keys the scan finds, sorted, and whether there were more."""
        found: list[str] = []
        more = False
        keys = self.state.backend.scan(pattern)
        try:
            async for key in keys:
                if len(found) >= limit:
                    more = True
                    break
                found.append(key)
        finally:
            close = getattr(keys, "aclose", None)  # end the scan now, not when collected
            if close is not None:
                await close()
        return sorted(found), more

    async def value(self, request: Request) -> Response:
        """One key's value and metadata."""
        key = validate_key(request.query_params.get("key", ""))
        entry = await self.state.get_entry(key)
        if entry is None:
            return _error(f"no state at key {key!r}", 404)
        stat = (await self.state.backend.stat_many([key]))[0]
        if stat is not None and stat.version != entry.version:
            stat = None  # written in between: the size would be another version's
        # Bounded by the limit, but up to a million characters of Python work: in a thread, so
        # that other requests and the live streams go on meanwhile.
        text, cut = await anyio.to_thread.run_sync(shown, entry.value, MAX_VALUE_CHARS)
        return _reply(
            {
                "key": key,
                "json": text,
                "truncated": cut,
                "version": entry.version,
                "created_at": entry.created_at,
                "updated_at": entry.updated_at,
                "ttl": None if entry.ttl is None else entry.ttl.total_seconds(),
                "size": None if stat is None else stat.size,
                "writable": self.settings.allow_writes,
            }
        )

    async def history(self, request: Request) -> Response:
        """A key's retained versions, newest (the current one) first, each value cut short.

        What the writers kept (`StateConfig.history`): the backend reads at most as many as its
        own rules name (`serve` names every key when the backend has none). Each listed version
        is read and decoded whole, then cut to `MAX_STREAM_VALUE_CHARS` characters.
        """
        key = validate_key(request.query_params.get("key", ""))
        limit = _int_param(request, "limit", MAX_VERSIONS, 1, MAX_VERSIONS)
        versions = await self.state.history(key, limit=limit)
        if not versions:
            return _error(f"no state at key {key!r}", 404)
        rows = []
        for version in versions:
            text, cut = shown(version.value, MAX_STREAM_VALUE_CHARS)
            rows.append(
                {
                    "version": version.version,
                    "updated_at": version.updated_at,
                    "json": text,
                    "truncated": cut,
                }
            )
        return _reply({"key": key, "versions": rows, "limit": limit})

    async def write(self, request: Request) -> Response:
        """Save or delete one key, only with `--allow-writes` and the version the page showed."""
        if not self.settings.allow_writes:
            return _error("the inspector is read-only (start it with --allow-writes)", 403)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_WRITE_BYTES:
            return _error(f"the body is larger than {MAX_WRITE_BYTES} bytes", 413)
        raw = bytearray()
        async for chunk in request.stream():  # a body without a length is counted as it comes
            raw += chunk
            if len(raw) > MAX_WRITE_BYTES:
                return _error(f"the body is larger than {MAX_WRITE_BYTES} bytes", 413)
        try:
            body = json.loads(raw)
        except ValueError:
            return _error("the body must be JSON", 400)
        if not isinstance(body, dict):
            return _error("the body must be a JSON object", 400)
        key = validate_key(body.get("key"))
        expected = body.get("expected_version")
        if type(expected) is not int or expected < 0:
            return _error("expected_version (an int >= 0) is required", 400)
        if request.method == "DELETE":
            deleted = await self.state.delete(key, expected_version=expected)
            if not deleted:
                return _error(f"no state at key {key!r}", 404)
            log.info("ui_delete", key=key, version=expected)
            return _reply({"key": key, "deleted": True})
        if "value" not in body:
            return _error("value is required", 400)
        version = await self.state.save(key, body["value"], expected_version=expected)
        log.info("ui_save", key=key, version=version)
        return _reply({"key": key, "version": version})

    async def stream(self, request: Request) -> Response:
        """Server-sent events: every change to keys matching `pattern`, as it commits."""
        pattern = validate_pattern(request.query_params.get("pattern") or "*")
        watch = self.state.watch(pattern)
        await watch.__aenter__()  # subscribed before the response starts: nothing is missed

        async def events() -> AsyncIterator[str]:
            try:
                yield f"event: ready\ndata: {_json({'pattern': pattern})}\n\n"
                while (change := await self._next_change(watch)) is not None:
                    new, cut_new = shown(change.new_value, MAX_STREAM_VALUE_CHARS)
                    old, cut_old = shown(change.old_value, MAX_STREAM_VALUE_CHARS)
                    data = {
                        "key": change.key,
                        "op": change.op.value,
                        "version": change.version,
                        "timestamp": change.timestamp,
                        "old": old,
                        "new": new,
                        "truncated": cut_new or cut_old,
                    }
                    yield f"data: {_json(data)}\n\n"
                yield f"event: closed\ndata: {_json({'reason': 'shutdown'})}\n\n"
            except SubscriptionClosedError as exc:
                yield f"event: closed\ndata: {_json({'reason': exc.reason})}\n\n"
            finally:
                with anyio.CancelScope(shield=True):
                    await watch.aclose()

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"x-accel-buffering": "no"},
        )

    async def _next_change(self, watch: Watch) -> StateChange | None:
        """The next change, or None once the server is stopping or the manager closed."""
        stopping = self.settings.stopping
        if stopping.is_set():
            return None
        found: list[StateChange] = []
        async with anyio.create_task_group() as tasks:

            async def pull() -> None:
                with contextlib.suppress(StopAsyncIteration):
                    found.append(await watch.__anext__())
                tasks.cancel_scope.cancel()

            async def stop() -> None:
                await stopping.wait()
                tasks.cancel_scope.cancel()

            tasks.start_soon(pull)
            tasks.start_soon(stop)
        return found[0] if found else None

    # -- managers ------------------------------------------------------------------------------

    async def teams(self, request: Request) -> Response:
        """Teams with their agents, queue counts, lease expiries and the sampled queue history."""
        now = datetime.now().astimezone()
        problems: list[dict[str, str | None]] = []
        with skipping_bad_records() as skipped:
            rows = await _each(
                await self.orchestration.list_teams(),
                lambda team_id: self._team_row(team_id, now),
                problems,
            )
        return _with_problems(
            {"teams": rows, "sample_interval": self.settings.sample_interval}, problems, skipped
        )

    async def _team_row(self, team_id: str, now: datetime) -> dict[str, Any]:
        team = await self.orchestration.get_team(team_id)
        queue = await self.orchestration.get_queue_status(team_id)
        leases = [t.lease_expires_at for t in queue.in_progress if t.lease_expires_at]
        history = self.settings.history.get(team_id, ())
        return {
            "team_id": team_id,
            "agents": [
                {
                    "agent_id": a.agent_id,
                    "status": a.status.value,
                    "capabilities": a.capabilities,
                    "current_task": a.current_task,
                }
                for a in team.agents.values()
            ],
            "pending": len(queue.pending),
            "in_progress": len(queue.in_progress),
            "completed": len(queue.completed),
            "dead_letter": len(queue.dead_letter),
            "expired_leases": sum(1 for at in leases if at <= now),
            "next_lease_expiry": min((at for at in leases if at > now), default=None),
            "dead_letters": [
                {"task_id": t.task_id, "error": t.error, "failures": t.failures}
                for t in queue.dead_letter[:20]
            ],
            "samples": [
                {
                    "at": s.at,
                    "pending": s.pending,
                    "in_progress": s.in_progress,
                    "dead_letter": s.dead_letter,
                    "expired_leases": s.expired_leases,
                }
                for s in history
            ],
        }

    async def sample_queues(self) -> None:
        """Record every team's queue counts once (the chart's points)."""
        now = datetime.now().astimezone()
        for team_id in await self.orchestration.list_teams():
            try:
                queue = await self.orchestration.get_queue_status(team_id)
            except NotFoundError:
                continue
            except _BAD_RECORD:
                continue  # the Teams tab names the record; the other teams are still sampled
            expired = sum(
                1
                for task in queue.in_progress
                if task.lease_expires_at is not None and task.lease_expires_at <= now
            )
            kept = self.settings.history.setdefault(
                team_id, deque(maxlen=self.settings.samples_kept)
            )
            kept.append(
                QueueSample(
                    now, len(queue.pending), len(queue.in_progress), len(queue.dead_letter), expired
                )
            )

    async def sample_forever(self) -> None:
        """Sample the queues every `sample_interval` seconds until cancelled."""
        while True:
            try:
                await self.sample_queues()
            except AgenticStateError as exc:
                log.warning("ui_sample_failed", error=type(exc).__name__)
            await anyio.sleep(self.settings.sample_interval)

    async def workflows_view(self, request: Request) -> Response:
        """Workflows with their steps (the timeline) and checkpoints."""
        problems: list[dict[str, str | None]] = []
        with skipping_bad_records() as skipped:
            found = {w.workflow_id: w for w in await self.workflows.list_workflows()}
            rows = await _each(found, lambda id_: self._workflow_row(found[id_]), problems)
        return _with_problems({"workflows": rows}, problems, skipped)

    async def _workflow_row(self, workflow: WorkflowState) -> dict[str, Any]:
        checkpoints = await self.workflows.list_checkpoints(workflow.workflow_id)
        return {
            "workflow_id": workflow.workflow_id,
            "name": workflow.name,
            "status": workflow.status.value,
            "current_step": workflow.current_step,
            "total_steps": workflow.total_steps,
            "error": workflow.error,
            "created_at": workflow.created_at,
            "started_at": workflow.started_at,
            "finished_at": workflow.finished_at,
            "steps": [
                {
                    "step_number": s.step_number,
                    "name": s.name,
                    "status": s.status.value,
                    "duration_ms": s.duration_ms,
                    "started_at": s.started_at,
                    "completed_at": s.completed_at,
                    "error": s.error,
                }
                for _, s in sorted(workflow.steps.items())
            ],
            "checkpoints": [
                {
                    "checkpoint_id": c.checkpoint_id,
                    "step": c.step,
                    "timestamp": c.timestamp,
                    "automatic": c.automatic,
                }
                for c in checkpoints
            ],
        }

    async def tools_view(self, request: Request) -> Response:
        """Per-tool statistics: runs, success and error rates, cache hit ratio, durations."""
        problems: list[dict[str, str | None]] = []
        with skipping_bad_records() as skipped:
            pending = await self.tools.get_pending_retries(due_only=False)
            rows = await _each(
                await self.tools.list_tools(),
                lambda name: self._tool_row(name, pending),
                problems,
            )
        return _with_problems({"tools": rows}, problems, skipped)

    async def _tool_row(self, name: str, pending: list[RetryState]) -> dict[str, Any]:
        stats = await self.tools.get_tool_stats(name)
        return {
            "tool": name,
            "runs": stats.total_executions,
            "success_rate": stats.success_rate,
            "error_rate": stats.error_rate,
            "cache_hit_rate": stats.cache_hit_rate,
            "avg_duration_ms": stats.avg_duration_ms,
            "p95_duration_ms": stats.p95_duration_ms,
            "last_execution_at": stats.last_execution_at,
            "pending_retries": sum(1 for r in pending if r.tool_name == name),
        }

    async def sessions_view(self, request: Request) -> Response:
        """Every session (newest first), across users."""
        ids = await self.sessions.list_session_ids(limit=MAX_KEYS + 1)
        more = len(ids) > MAX_KEYS
        problems: list[dict[str, str | None]] = []
        try:
            found = await self.sessions.get_sessions(ids[:MAX_KEYS])
        except _BAD_RECORD:  # one of them does not read: read them one by one
            found = []
            for session_id in ids[:MAX_KEYS]:
                try:
                    session = await self.sessions.get_session(session_id)
                except _BAD_RECORD as exc:
                    key = getattr(exc, "key", None)
                    problems.append(_problem(key, f"{type(exc).__name__}: {exc}"))
                    continue
                if session is not None:
                    found.append(session)
        sessions = sorted(found, key=lambda s: s.updated_at, reverse=True)
        data = {"sessions": [s.model_dump(mode="json") for s in sessions], "more": more}
        return _with_problems(data, problems, [])

    async def session_messages(self, request: Request) -> Response:
        """One session's last messages, oldest first."""
        session_id = request.path_params["session_id"]
        last = _int_param(request, "last", 200, 1, MAX_MESSAGES)
        if await self.sessions.get_session(session_id) is None:
            return _error(f"no session {session_id!r}", 404)
        messages = await self.sessions.get_messages(session_id, last=last)
        return _reply(
            {
                "session_id": session_id,
                "messages": [
                    {
                        "seq": m.seq,
                        "role": m.role,
                        "content": shown(m.content, MAX_STREAM_VALUE_CHARS)[0],
                        "created_at": m.created_at,
                    }
                    for m in messages
                ],
            }
        )

    async def speech_view(self, request: Request) -> Response:
        """Speech sessions with their STT, TTS and conversation state."""
        problems: list[dict[str, str | None]] = []
        with skipping_bad_records() as skipped:
            found = {s.session_id: s for s in await self.speech.list_sessions(active_only=False)}
            rows = await _each(found, lambda id_: self._speech_row(found[id_]), problems)
        return _with_problems({"speech": rows}, problems, skipped)

    async def _speech_row(self, session: AudioSession) -> dict[str, Any]:
        stt = await self.speech.get_stt_state(session.session_id)
        tts = await self.speech.get_tts_state(session.session_id)
        conversation = await self.speech.get_conversation_state(session.session_id)
        return {
            "session_id": session.session_id,
            "type": session.session_type,
            "mode": session.streaming_mode.value,
            "status": session.status.value,
            "created_at": session.created_at,
            "stt": None if stt is None else stt.model_dump(mode="json"),
            "tts": None if tts is None else tts.model_dump(mode="json"),
            "turns": None if conversation is None else conversation.turn_count,
        }

    async def agents_view(self, request: Request) -> Response:
        """Agents with their snapshots, checkpoints (newest first) and recovery record."""
        problems: list[dict[str, str | None]] = []
        with skipping_bad_records() as skipped:
            rows = await _each(await self.agents.list_agents(), self._agent_row, problems)
        return _with_problems({"agents": rows}, problems, skipped)

    async def _agent_row(self, agent_id: str) -> dict[str, Any]:
        snapshots = await self.agents.list_snapshots(agent_id)
        checkpoints = await self.agents.list_checkpoints(agent_id)
        recovery = await self.recovery.get_recovery_state(agent_id)
        latest = snapshots[0] if snapshots else None
        return {
            "agent_id": agent_id,
            "snapshots": len(snapshots),
            "latest_snapshot": None
            if latest is None
            else {
                "snapshot_id": latest.snapshot_id,
                "timestamp": latest.timestamp,
                "step": latest.step,
                "messages": len(latest.conversation_history),
                "metadata": shown(latest.metadata, MAX_STREAM_VALUE_CHARS)[0],
            },
            "checkpoint_count": len(checkpoints),
            "checkpoints": [
                {
                    "checkpoint_id": c.checkpoint_id,
                    "step": c.step,
                    "timestamp": c.timestamp,
                    "recoverable": c.recoverable,
                    "state": shown(c.state, MAX_STREAM_VALUE_CHARS)[0],
                }
                for c in checkpoints[:MAX_LISTED]
            ],
            "recovery": None if recovery is None else recovery.model_dump(mode="json"),
        }

    async def knowledge_view(self, request: Request) -> Response:
        """Knowledge bases: the overview, the indexing run's progress, and the sources."""
        problems: list[dict[str, str | None]] = []
        with skipping_bad_records() as skipped:
            ids = await self.knowledge.list_knowledge_bases()
            rows = await _each(ids, self._knowledge_row, problems)
        return _with_problems({"knowledge": rows}, problems, skipped)

    async def _knowledge_row(self, kb_id: str) -> dict[str, Any]:
        overview = await self.knowledge.get_knowledge_base_state(kb_id)
        progress = await self.knowledge.get_indexing_progress(kb_id)
        return {
            "knowledge_base_id": kb_id,
            "documents": overview.total_documents,
            "embeddings": overview.total_embeddings,
            "pending": overview.documents_pending,
            "failed": overview.failed_documents,
            "storage_mb": overview.storage_size_mb,
            "last_updated": overview.last_updated,
            "sync_status": None if overview.sync_status is None else overview.sync_status.value,
            "progress": None
            if progress is None
            else {
                "status": progress.status.value,
                "processed": progress.processed_documents,
                "failed": progress.failed_documents,
                "total": progress.total_documents,
                "percent": progress.percent,
                "started_at": progress.started_at,
                "completed_at": progress.completed_at,
                "error": progress.error,
            },
            "sources": [
                {
                    "source_id": source.source_id,
                    "sync_status": source.sync_status.value,
                    "last_sync": source.last_sync,
                    "documents_synced": source.documents_synced,
                    "documents_pending": source.documents_pending,
                    "error": source.error,
                }
                for source in overview.sources[:MAX_LISTED]
            ],
        }

    async def feed(self, request: Request) -> Response:
        """What the change feed holds: retained changes and their bytes (`usage().feed`)."""
        size = await self.state.backend.feed_size()
        if size is None:
            return _reply({"feed": None})
        return _reply({"feed": {"changes": size.changes, "bytes": size.bytes}})

    async def info(self, request: Request) -> Response:
        """What the page needs to know about this inspector."""
        return _reply(
            {
                "backend": type(self.state.backend).__name__,
                "allow_writes": self.settings.allow_writes,
                # The page refreshes its views as often as the chart gains a point.
                "refresh_ms": max(500, round(self.settings.sample_interval * 1000)),
            }
        )


def _handled(
    endpoint: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            return await endpoint(request)
        except (DecodeError, ForeignRecordError) as exc:
            # Stored bytes that do not decode, or another application's key: say so, change
            # nothing.
            return _error(f"{type(exc).__name__}: {exc}", 422)
        except (InvalidArgumentError, SerializationError) as exc:  # bad input: nothing written
            return _error(str(exc), 400)
        except ConflictError as exc:
            return _error(str(exc), 409)
        except NotFoundError as exc:
            return _error(str(exc), 404)
        except AgenticStateError as exc:
            log.warning("ui_request_failed", path=request.url.path, error=type(exc).__name__)
            return _error(f"{type(exc).__name__}: {exc}", 500)

    return run


def _static(name: str, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    body = resources.files("agenticstate.ui").joinpath("static", name).read_bytes()

    async def serve(request: Request) -> Response:
        return Response(body, media_type=media_type)

    return serve


def create_app(
    state: StateManager,
    *,
    allow_writes: bool = False,
    token: str | None = None,
    allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS,
    sample_interval: float = 2.0,
) -> Starlette:
    """Build the inspector's ASGI application over an open `StateManager`.

    Args:
        state: The store to show; the caller opens and closes it.
        allow_writes: Whether the page may save and delete keys (each with the version it showed).
        token: When set, every request must carry it (cookie set by `/?token=...`, or
            `Authorization: Bearer ...`).
        allowed_hosts: The host names the Host header may carry (`None`: any, only sensible
            with a token).
        sample_interval: Seconds between two samples of the queues' counts (the chart's points).
    """
    if sample_interval <= 0:
        raise InvalidArgumentError("sample_interval must be > 0")
    settings = InspectorSettings(
        allow_writes=allow_writes,
        token=token,
        allowed_hosts=allowed_hosts,
        sample_interval=sample_interval,
    )
    inspector = Inspector(state, settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(inspector.sample_forever)
            try:
                yield
            finally:
                settings.stopping.set()
                tasks.cancel_scope.cancel()

    routes = [Route(path, _static(name, kind)) for path, (name, kind) in _STATIC.items()]
    routes += [
        Route("/api/info", _handled(inspector.info)),
        Route("/api/feed", _handled(inspector.feed)),
        Route("/api/keys", _handled(inspector.keys)),
        Route("/api/value", _handled(inspector.value)),
        Route("/api/value", _handled(inspector.write), methods=["PUT", "DELETE"]),
        Route("/api/history", _handled(inspector.history)),
        Route("/api/stream", _handled(inspector.stream)),
        Route("/api/teams", _handled(inspector.teams)),
        Route("/api/workflows", _handled(inspector.workflows_view)),
        Route("/api/tools", _handled(inspector.tools_view)),
        Route("/api/sessions", _handled(inspector.sessions_view)),
        Route("/api/sessions/{session_id}/messages", _handled(inspector.session_messages)),
        Route("/api/speech", _handled(inspector.speech_view)),
        Route("/api/agents", _handled(inspector.agents_view)),
        Route("/api/knowledge", _handled(inspector.knowledge_view)),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=[Middleware(_Guard, settings=settings)]
    )
    app.state.inspector = inspector
    app.state.stopping = settings.stopping
    return app
