"""The inspector in a real browser: Debian's chromium, headless, over the DevTools protocol.

The inspector runs as its own process (`agenticstate ui`) on a real redis-server; this test
process writes to the same store, so every change it makes is "a write by another process" for
the inspector. Screenshots land in `tmp_path`, or in `$AGENTICSTATE_UI_SCREENSHOTS` (the docs'
images are taken with `AGENTICSTATE_UI_SCREENSHOTS=docs/images`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from agenticstate import StateManager
from agenticstate.backends import open_backend
from agenticstate.managers import (
    AgentCoordinationState,
    OrchestrationStateManager,
    SessionManager,
    SpeechStateManager,
    StepState,
    TeamState,
    ToolExecution,
    ToolStateManager,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
)
from tests.helpers import LineProcess, unique_prefix
from tests.ui._cdp import Chromium, Page, chromium_path

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SCREENSHOT_LIMIT = 150_000


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    executable = chromium_path()
    if executable is None:
        if os.environ.get("AGENTICSTATE_REQUIRE_BROWSER") == "1":
            pytest.fail(
                "AGENTICSTATE_REQUIRE_BROWSER=1 but no chromium (scripts/install-chromium.sh)"
            )
        pytest.skip("no chromium: run scripts/install-chromium.sh")
    browser = Chromium(executable, tmp_path_factory.mktemp("chromium"))
    try:
        yield browser
    finally:
        browser.close()


@pytest.fixture(scope="module")
def inspector(redis_url: str) -> Iterator[tuple[str, str]]:
    """`agenticstate ui` in its own process over a fresh namespace: (address, prefix)."""
    yield from _inspector(redis_url, "read-only")


@pytest.fixture(scope="module")
def writable_inspector(redis_url: str) -> Iterator[tuple[str, str]]:
    """`agenticstate ui --allow-writes` in its own process: (address, prefix)."""
    yield from _inspector(redis_url, "edits allowed", "--allow-writes")


def _inspector(redis_url: str, mode: str, *options: str) -> Iterator[tuple[str, str]]:
    prefix = unique_prefix()
    server = LineProcess(
        "agenticstate.cli",
        "--url",
        redis_url,
        "--prefix",
        prefix,
        "ui",
        "--port",
        "0",
        "--sample-interval",
        "0.2",
        *options,
    )
    try:
        assert server.wait_until(lambda lines: any("http://" in line for line in lines), 30), (
            server.close()
        )
        line = next(line for line in server.lines if "http://" in line)
        address = line[line.index("http://") :].split()[0]
        assert f"({mode})" in line
        yield address, prefix
    finally:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGINT)
            server.process.wait(timeout=20)
        errors = server.close()
    # Ctrl-C stops it cleanly: 0, or 130 (the shell's convention) when the signal is re-raised.
    assert server.process.returncode in {0, 130}, errors
    assert "Traceback" not in errors, errors


@pytest.fixture
async def store(redis_url: str, inspector: tuple[str, str]) -> AsyncIterator[StateManager]:
    state = StateManager(backend=open_backend(redis_url, key_prefix=inspector[1]))
    await state.open()
    try:
        yield state
    finally:
        await state.aclose()


@pytest.fixture
async def page(chromium: Chromium) -> AsyncIterator[Page]:
    opened = await Page.open(chromium)
    try:
        yield opened
    finally:
        await opened.close()
    assert not opened.console, opened.console  # no script error in the page


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    wanted = os.environ.get("AGENTICSTATE_UI_SCREENSHOTS")
    folder = Path(wanted) if wanted else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder


async def _screenshot(page: Page, folder: Path, name: str) -> None:
    size = await page.screenshot(folder / name)
    assert 0 < size < SCREENSHOT_LIMIT, f"{name} is {size} bytes"


ROW_KEYS = "[...document.querySelectorAll('#key-table tbody tr')].map(r => r.dataset.key)"


async def test_key_list_filters_and_a_value_shows(
    inspector: tuple[str, str], store: StateManager, page: Page, shots: Path
) -> None:
    await store.save("agent:researcher", {"status": "working", "task": "summarize the papers"})
    await store.save("agent:writer", {"status": "idle"}, ttl=3600)
    await store.save("agent:writer", {"status": "idle", "drafts": 2}, ttl=3600)
    await store.save("task:42", {"title": "draft the report"})
    # A hostile value: shown as text, never run as markup.
    await store.save("agent:xss", '<img src=x onerror="window.__pwned = 1">')
    await page.goto(inspector[0])
    everything = await page.wait_for(f"{ROW_KEYS}.length >= 4 && {ROW_KEYS}")
    assert set(everything) == {"agent:researcher", "agent:writer", "agent:xss", "task:42"}

    await page.type_into("#key-pattern", "agent:w*")
    await page.click("#key-form button[type=submit]")
    await page.wait_for("document.querySelector('#key-table').dataset.pattern === 'agent:w*'")
    assert await page.evaluate(ROW_KEYS) == ["agent:writer"]
    cells = await page.evaluate(
        "[...document.querySelectorAll('#key-table tbody tr td')].map(c => c.textContent)"
    )
    key, version, ttl, size, _updated = cells
    assert (key, version) == ("agent:writer", "2")
    assert ttl.endswith((" h", " min")), ttl
    assert size.endswith(" B"), size
    assert int(size.split()[0]) > 0, size

    await page.type_into("#key-pattern", "agent:*")
    await page.click("#key-form button[type=submit]")
    await page.wait_for("document.querySelector('#key-table').dataset.pattern === 'agent:*'")
    assert sorted(await page.evaluate(ROW_KEYS)) == [
        "agent:researcher",
        "agent:writer",
        "agent:xss",
    ]

    await page.click("#key-table tr[data-key='agent:researcher']")
    shown = await page.wait_for(
        "document.querySelector('#value-panel').dataset.key === 'agent:researcher'"
        " && document.querySelector('#value-json').textContent"
    )
    assert json.loads(shown) == {"status": "working", "task": "summarize the papers"}
    history = await page.evaluate("document.querySelector('#value-history').textContent")
    assert "only the current version (1)" in history
    await _screenshot(page, shots, "inspector-keys.png")

    await page.click("#key-table tr[data-key='agent:xss']")
    shown = await page.wait_for(
        "document.querySelector('#value-panel').dataset.key === 'agent:xss'"
        " && document.querySelector('#value-json').textContent"
    )
    assert json.loads(shown) == '<img src=x onerror="window.__pwned = 1">'
    assert await page.evaluate("document.querySelectorAll('#value-panel img').length") == 0
    assert await page.evaluate("window.__pwned === undefined")
    # Read-only: no editor on the page.
    assert await page.evaluate("document.querySelector('#value-edit') === null")


async def test_a_write_by_another_process_appears_in_the_live_stream_within_a_second(
    inspector: tuple[str, str], store: StateManager, page: Page, shots: Path
) -> None:
    await page.goto(inspector[0])
    await page.click("#tabs button[data-tab=stream]")
    await page.type_into("#stream-pattern", "live:*")
    await page.click("#stream-form button[type=submit]")
    await page.wait_for("document.querySelector('#stream-table').dataset.watching === 'live:*'")

    await store.save("other:1", {"not": "watched"})
    for n in range(1, 4):
        await store.save("live:agent", {"step": n, "status": "working"})
        written = time.monotonic()
        await page.wait_for(
            f"[...document.querySelectorAll('#stream-table tbody tr')]"
            f".some(r => r.children[3].textContent === '{n}')",
            timeout=1.0,
        )
        assert time.monotonic() - written < 1.0
    await store.delete("live:agent")
    await page.wait_for("document.querySelector('#stream-table tbody tr.op-delete')", timeout=1.0)
    rows = await page.evaluate(
        "[...document.querySelectorAll('#stream-table tbody tr')]"
        ".map(r => [...r.children].map(c => c.textContent))"
    )
    assert [row[1:4] for row in rows] == [
        ["delete", "live:agent", "3"],
        ["set", "live:agent", "3"],
        ["set", "live:agent", "2"],
        ["set", "live:agent", "1"],
    ]
    assert json.loads(rows[1][5]) == {"step": 3, "status": "working"}
    assert json.loads(rows[1][4]) == {"step": 2, "status": "working"}
    await _screenshot(page, shots, "inspector-stream.png")


async def test_a_queue_chart_renders(
    inspector: tuple[str, str], store: StateManager, page: Page, shots: Path
) -> None:
    orchestration = OrchestrationStateManager(state_manager=store)
    await orchestration.create_team(
        TeamState(
            team_id="research",
            agents={
                name: AgentCoordinationState(agent_id=name, capabilities=["search"])
                for name in ("alice", "bob")
            },
        )
    )
    for n in range(6):
        await orchestration.enqueue_task("research", {"task_id": f"t{n}", "max_retries": 0})
    claim = await orchestration.claim_task("research", "alice", lease=timedelta(minutes=5))
    assert claim is not None
    await orchestration.fail_task(
        "research", claim.task.task_id, "timeout talking to the search API", agent_id="alice"
    )
    assert await orchestration.claim_task("research", "bob", lease=timedelta(minutes=5))

    await page.goto(inspector[0])
    await page.click("#tabs button[data-tab=teams]")
    team = ".team[data-team='research']"
    # The chart needs two samples after the writes (one every 0.2 s here).
    pending = f"{team} polyline[data-series='pending']"
    points = await page.wait_for(
        f'(() => {{ const line = document.querySelector("{pending}");'
        " return line && line.getAttribute('points').split(' ').length >= 2"
        " && line.getAttribute('points'); })()",
        timeout=10,
    )
    ys = [float(point.split(",")[1]) for point in points.split()]
    dead = await page.evaluate(
        f"document.querySelector(\"{team} polyline[data-series='dead_letter']\")"
        ".getAttribute('points')"
    )
    # 4 pending is the top of the chart, 1 dead letter is a quarter of the way up.
    assert ys[-1] < float(dead.split()[-1].split(",")[1])
    counts = await page.evaluate(
        f'[...document.querySelectorAll("{team} .counts span")].map(s => s.textContent)'
    )
    assert counts[:4] == ["4 pending", "1 in progress", "0 completed", "1 dead letters"]

    # The queue drains; the chart follows, point by point.
    count_points = f"document.querySelector(\"{pending}\").getAttribute('points').split(' ').length"
    for agent in ["alice", "bob", "alice"]:
        seen = await page.evaluate(count_points)
        claim = await orchestration.claim_task("research", agent, lease=timedelta(minutes=5))
        assert claim is not None
        await orchestration.complete_task(
            "research", claim.task.task_id, {"ok": True}, lease_token=claim.lease_token
        )
        await page.wait_for(f"{count_points} >= {seen} + 3", timeout=10)
    counts = await page.evaluate(
        f'[...document.querySelectorAll("{team} .counts span")].map(s => s.textContent)'
    )
    assert counts[:4] == ["1 pending", "1 in progress", "3 completed", "1 dead letters"]
    points = await page.evaluate(f"document.querySelector(\"{pending}\").getAttribute('points')")
    ys = [float(point.split(",")[1]) for point in points.split()]
    # Fewer pending now than at the peak: the line went down (SVG y grows downwards). The
    # first point may be a sample from before the tasks were written, so compare with the top.
    assert ys[-1] > min(ys)
    await _screenshot(page, shots, "inspector-teams.png")


async def test_workflows_tools_sessions_and_speech_show(
    inspector: tuple[str, str], store: StateManager, page: Page, shots: Path
) -> None:
    workflows = WorkflowStateManager(state_manager=store)
    await workflows.create(WorkflowState(workflow_id="ingest", name="ingest papers", total_steps=4))
    await workflows.start("ingest")
    for number, name, ms in [(1, "fetch", 120.0), (2, "parse", 900.0)]:
        await workflows.update_step(
            "ingest", StepState(step_number=number, name=name, duration_ms=ms)
        )
    await workflows.checkpoint(
        WorkflowCheckpoint(workflow_id="ingest", checkpoint_id="cp-2", step=2)
    )
    tools = ToolStateManager(state_manager=store)
    for n in range(3):
        execution = await tools.start_execution(ToolExecution(tool_name="web_search"))
        await tools.complete_execution(execution.execution_id, {"hits": n}, duration_ms=10.0 * n)
    sessions = SessionManager(state_manager=store)
    session = await sessions.create_session("ada", session_id="chat-1", name="papers")
    await sessions.add_message(session.session_id, "user", "find papers on agent memory")
    await sessions.add_message(session.session_id, "assistant", "here are three")
    speech = SpeechStateManager(state_manager=store)
    await speech.create_session(session_id="call-7")

    await page.goto(inspector[0])
    await page.click("#tabs button[data-tab=workflows]")
    steps = await page.wait_for(
        "[...document.querySelectorAll(\".workflow[data-workflow='ingest'] .step\")]"
        ".map(s => s.className).join(' ')"
    )
    assert (
        steps.split() == ["step", "s-completed", "step", "s-completed"] + ["step", "s-pending"] * 2
    )
    checkpoints = await page.evaluate(
        "document.querySelector(\".workflow[data-workflow='ingest']\").textContent"
    )
    assert "cp-2 @ step 2" in checkpoints
    await _screenshot(page, shots, "inspector-workflows.png")

    await page.click("#tabs button[data-tab=tools]")
    row = await page.wait_for(
        "(() => { const r = document.querySelector(\"#tools-table tr[data-tool='web_search']\");"
        " return r && [...r.children].map(c => c.textContent); })()"
    )
    assert row[:3] == ["web_search", "3", "100%"]

    await page.click("#tabs button[data-tab=sessions]")
    await page.wait_for("document.querySelector(\"#sessions-table tr[data-session='chat-1']\")")
    await page.click("#sessions-table tr[data-session='chat-1']")
    messages = await page.wait_for(
        "document.querySelectorAll('#messages-panel .message').length === 2"
        " && document.querySelector('#messages-panel').textContent"
    )
    assert "find papers on agent memory" in messages
    assert "here are three" in messages

    await page.click("#tabs button[data-tab=speech]")
    speech_row = await page.wait_for(
        "(() => { const r = document.querySelector(\"#speech-table tr[data-session='call-7']\");"
        " return r && [...r.children].map(c => c.textContent); })()"
    )
    assert speech_row[0] == "call-7"


async def test_with_writes_allowed_the_page_edits_and_deletes_with_a_version_check(
    redis_url: str, writable_inspector: tuple[str, str], page: Page
) -> None:
    address, prefix = writable_inspector
    store = StateManager(backend=open_backend(redis_url, key_prefix=prefix))
    await store.open()
    try:
        await store.save("agent:edit", {"v": 1})
        await page.goto(address)
        assert await page.evaluate("document.querySelector('#mode').textContent") == (
            "writes allowed"
        )
        await page.click("#key-table tr[data-key='agent:edit']")
        await page.wait_for("document.querySelector('#value-edit')")
        await page.type_into("#value-edit", '{"v": 2, "by": "the page"}')
        await page.click("#value-panel button:nth-of-type(1)")  # Save
        await page.wait_for("document.querySelector('#value-panel').dataset.version === '2'")
        assert await store.get("agent:edit") == {"v": 2, "by": "the page"}

        # Another process writes; the page still shows version 2 and its save is refused.
        await store.save("agent:edit", {"v": 3, "by": "a worker"})
        await page.type_into("#value-edit", '{"v": 4}')
        await page.click("#value-panel button:nth-of-type(1)")
        refused = await page.wait_for(
            "[...document.querySelectorAll('#value-panel span')]"
            ".map(s => s.textContent).find(t => t.includes('version'))"
        )
        assert "3" in refused, refused
        assert await store.get("agent:edit") == {"v": 3, "by": "a worker"}
        status = "[...document.querySelectorAll('#value-panel span')].at(-1)"
        await page.evaluate(f"{status}.textContent = ''")
        await page.click("#value-panel button:nth-of-type(2)")  # Delete, at the stale version
        refused = await page.wait_for(f"{status}.textContent")
        assert "3" in refused, refused
        assert page.dialogs == ["Delete agent:edit (version 2)?"]
        assert await store.get("agent:edit") == {"v": 3, "by": "a worker"}

        await page.click("#key-table tr[data-key='agent:edit']")  # reload: version 3
        await page.wait_for("document.querySelector('#value-panel').dataset.version === '3'")
        await page.click("#value-panel button:nth-of-type(2)")
        await page.wait_for(
            "document.querySelector('#value-panel').textContent.includes('deleted')"
        )
        assert not await store.exists("agent:edit")
        assert len(page.dialogs) == 2
    finally:
        await store.aclose()


async def test_with_a_token_the_printed_address_opens_the_page_and_nothing_else_does(
    redis_url: str, page: Page
) -> None:
    for address, _prefix in _inspector(redis_url, "read-only", "--require-token"):
        assert "?token=" in address
        bare = address.split("?")[0]
        await page.send("Page.navigate", url=bare)
        refused = await page.wait_for(
            "document.body && document.body.textContent.includes('token is required')"
            " && document.body.textContent"
        )
        assert "open the address the inspector printed" in refused
        await page.goto(address)  # sets the cookie, then drops the token from the address bar
        assert await page.evaluate("location.href") == bare
        assert await page.evaluate("document.querySelector('#mode').textContent") == "read-only"
        assert await page.evaluate("document.cookie") == ""  # HTTP-only: no script can read it
        await page.click("#tabs button[data-tab=stream]")
        await page.wait_for("document.querySelector('#stream-table').dataset.watching === '*'")
