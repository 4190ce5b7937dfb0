"""The inspector in a real browser: Debian's chromium, headless, over the DevTools protocol.

The inspector runs as its own process (`agenticstate ui`) on a real redis-server; this test
process writes to the same store, so every change it makes is "a write by another process" for
the inspector. Screenshots land in `tmp_path`, or in `$AGENTICSTATE_UI_SCREENSHOTS` (the docs'
images are taken with `AGENTICSTATE_UI_SCREENSHOTS=docs/images`).
"""

from __future__ import annotations

import itertools
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
    AgentCheckpoint,
    AgentCoordinationState,
    AgentSnapshot,
    AgentStateStore,
    IndexingProgress,
    KnowledgeStateManager,
    OrchestrationStateManager,
    SessionManager,
    SourceState,
    SpeechStateManager,
    StepState,
    SyncStatus,
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
    assert "Only the current version (1) is retained" in history
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


async def test_the_header_shows_what_the_change_feed_holds(
    inspector: tuple[str, str], store: StateManager, page: Page
) -> None:
    """The page's header shows the feed's retained changes and bytes, as usage() reports them."""
    await store.save("feed:small", {"n": 1})
    await store.save("feed:large", {"text": "x" * 4000})
    await store.save("feed:large", {"text": "y" * 4000})  # the old value: held by the feed
    expected = (await store.usage()).feed
    assert expected is not None
    assert expected.changes >= 3
    assert expected.bytes > 4000
    await page.goto(inspector[0])
    shown = await page.wait_for(
        "document.querySelector('#feed').dataset.bytes && [document.querySelector('#feed')"
        ".dataset.changes, document.querySelector('#feed').dataset.bytes,"
        " document.querySelector('#feed').textContent]"
    )
    changes, held, text = shown
    assert (int(changes), int(held)) == (expected.changes, expected.bytes)
    assert text == f"feed: {expected.changes} changes, {expected.bytes / 1024:.1f} KB", text


async def test_a_write_by_another_process_appears_in_the_live_stream_within_a_second(
    inspector: tuple[str, str], store: StateManager, page: Page, shots: Path
) -> None:
    await page.goto(inspector[0])
    await page.click("#tabs a[data-tab=stream]")
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
    await page.click("#tabs a[data-tab=teams]")
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
    await _check_chart_reads(page, team)
    await _screenshot(page, shots, "inspector-teams.png")


async def _check_chart_reads(page: Page, team: str) -> None:
    """The chart is wide, its axes are labelled, and series at equal values stay apart: each
    has its own stroke (width and dash), and the labels at their ends do not overlap."""
    chart = f"{team} svg.queue-chart".replace("'", '"')
    width = await page.evaluate(f"document.querySelector('{chart}').getBoundingClientRect().width")
    assert width >= 700, width
    texts = await page.evaluate(
        f"[...document.querySelectorAll('{chart} text')].map(t => t.textContent)"
    )
    assert "tasks" in texts
    assert any(text.startswith("time (a point every 0.2 s") for text in texts), texts
    assert {"0", "1"} <= set(texts)  # y ticks
    assert sum(":" in text for text in texts) >= 2  # x ticks: the samples' times
    # Pending, in progress and dead letters all end at 1 here: drawn over each other.
    ends = await page.evaluate(
        f"[...document.querySelectorAll('{chart} text.end-label')].map(t => {{"
        " const b = t.getBoundingClientRect();"
        " return [t.dataset.series, t.textContent, b.top, b.bottom]; })"
    )
    assert {(series, text) for series, text, _, _ in ends} >= {
        ("pending", "pending 1"),
        ("in_progress", "in progress 1"),
        ("dead_letter", "dead letter 1"),
    }
    boxes = sorted((top, bottom) for _, _, top, bottom in ends)
    assert all(b[0] >= a[1] - 0.5 for a, b in itertools.pairwise(boxes)), boxes
    strokes = await page.evaluate(
        f"[...document.querySelectorAll('{chart} polyline')].map(l =>"
        " [l.getAttribute('stroke-width'), l.getAttribute('stroke-dasharray')])"
    )
    assert len({tuple(stroke) for stroke in strokes}) == len(strokes) == 4, strokes


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
    await page.click("#tabs a[data-tab=workflows]")
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

    await page.click("#tabs a[data-tab=tools]")
    row = await page.wait_for(
        "(() => { const r = document.querySelector(\"#tools-table tr[data-tool='web_search']\");"
        " return r && [...r.children].map(c => c.textContent); })()"
    )
    assert row[:3] == ["web_search", "3", "100%"]

    await page.click("#tabs a[data-tab=sessions]")
    await page.wait_for("document.querySelector(\"#sessions-table tr[data-session='chat-1']\")")
    await page.click("#sessions-table tr[data-session='chat-1']")
    messages = await page.wait_for(
        "document.querySelectorAll('#messages-panel .message').length === 2"
        " && document.querySelector('#messages-panel').textContent"
    )
    assert "find papers on agent memory" in messages
    assert "here are three" in messages

    await page.click("#tabs a[data-tab=speech]")
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
        await page.click("#tabs a[data-tab=stream]")
        await page.wait_for("document.querySelector('#stream-table').dataset.watching === '*'")


HASH = "location.hash"


async def _reload(page: Page) -> None:
    await page.evaluate("document.body.dataset.ready = ''")
    await page.send("Page.reload")
    await page.wait_for("document.body && document.body.dataset.ready === '1'", 20)


async def test_every_tab_and_selection_has_an_address(
    inspector: tuple[str, str], store: StateManager, page: Page
) -> None:
    """Tabs, globs and selections are in the address: a link opens the same view, reload keeps
    it, back returns to the one before."""
    await store.save("addr:one", {"n": 1})
    await store.save("addr:two", {"n": 2})
    sessions = SessionManager(state_manager=store)
    await sessions.create_session("grace", session_id="addr-chat", name="addresses")
    await sessions.add_message("addr-chat", "user", "is this view a link?")
    workflows = WorkflowStateManager(state_manager=store)
    await workflows.create(WorkflowState(workflow_id="addr-flow", name="linked", total_steps=2))

    # A shared link to a key, under a glob.
    await page.goto(inspector[0] + "#/keys/addr%3Atwo?glob=addr%3A*")
    shown = await page.wait_for(
        "document.querySelector('#value-panel').dataset.key === 'addr:two'"
        " && document.querySelector('#value-json').textContent"
    )
    assert json.loads(shown) == {"n": 2}
    assert await page.evaluate("document.querySelector('#key-pattern').value") == "addr:*"
    assert sorted(await page.evaluate(ROW_KEYS)) == ["addr:one", "addr:two"]
    assert await page.evaluate(
        "document.querySelector(\"#key-table tr[data-key='addr:two']\").classList"
        ".contains('selected')"
    )

    # Selecting changes the address; reload keeps the view; back returns.
    await page.click("#key-table tr[data-key='addr:one']")
    await page.wait_for("document.querySelector('#value-panel').dataset.key === 'addr:one'")
    assert await page.evaluate(HASH) == "#/keys/addr%3Aone?glob=addr%3A*"
    await _reload(page)
    await page.wait_for(
        "document.querySelector('#value-panel').dataset.key === 'addr:one'"
        " && document.querySelector('#value-json')"
    )
    await page.evaluate("history.back()")
    await page.wait_for("document.querySelector('#value-panel').dataset.key === 'addr:two'")

    # A tab, and a selection in it, survive a reload.
    await page.click("#tabs a[data-tab=sessions]")
    await page.wait_for("document.querySelector(\"#sessions-table tr[data-session='addr-chat']\")")
    assert await page.evaluate(HASH) == "#/sessions"
    await page.click("#sessions-table tr[data-session='addr-chat']")
    await page.wait_for("document.querySelectorAll('#messages-panel .message').length === 1")
    assert await page.evaluate(HASH) == "#/sessions/addr-chat"
    await _reload(page)
    messages = await page.wait_for(
        "document.querySelectorAll('#messages-panel .message').length === 1"
        " && document.querySelector('#messages-panel').textContent"
    )
    assert "is this view a link?" in messages
    assert await page.evaluate("document.querySelector('#tabs a.active').dataset.tab") == "sessions"

    # A workflow's card links to itself; the keys tab's link opens the keys as they were left.
    await page.click("#tabs a[data-tab=workflows]")
    link = ".workflow[data-workflow='addr-flow'] h3 a"
    await page.wait_for(f'document.querySelector("{link}")')
    await page.click(link)
    await page.wait_for(
        "document.querySelector(\".workflow[data-workflow='addr-flow']\")"
        ".classList.contains('selected')"
    )
    assert await page.evaluate(HASH) == "#/workflows/addr-flow"
    keys_link = await page.evaluate("document.querySelector('#tabs a[data-tab=keys]').hash")
    assert keys_link == "#/keys/addr%3Atwo?glob=addr%3A*"
    await page.goto(inspector[0] + "#/stream?glob=addr%3A*")
    await page.wait_for("document.querySelector('#stream-table').dataset.watching === 'addr:*'")


MALFORMED_ADDRESSES = [
    "#/keys/100%",
    "#/keys/%E0%A4%A",
    "#/keys/%zz?glob=%",
    "#/sessions/50%",
    "#/workflows/%",
    "#/agents/%%",
    "#/nosuchtab/%",
]


async def test_an_address_that_does_not_decode_still_loads_the_page(
    inspector: tuple[str, str], store: StateManager, page: Page
) -> None:
    """Every malformed address (a bare `%`, a cut escape, in an item or a glob, in every kind
    of tab): the page loads its tab, with no script error, taking the part as written."""
    await store.save("percent:key", 1)
    for address in MALFORMED_ADDRESSES:
        await page.goto(inspector[0] + address)
        await _reload(page)  # a fresh page parses the address as it starts
        tab = address.split("/")[1].split("?")[0]
        if tab in ("keys", "nosuchtab"):  # an unknown tab opens the keys
            row = "#key-table tr[data-key='percent:key']"
            listed = "true" if "glob" in address else f'document.querySelector("{row}")'
            active = "document.querySelector('#tabs a.active').dataset.tab === 'keys'"
            await page.wait_for(f"{active} && {listed}")
        else:
            await page.wait_for(f"document.body.dataset.loaded === '{tab}'")
    assert await page.evaluate(HASH) == "#/nosuchtab/%"


async def test_the_value_view_lists_the_versions_the_writers_kept(
    inspector: tuple[str, str], store: StateManager, page: Page, tmp_path: Path
) -> None:
    """A key whose writer keeps history shows its retained versions, newest first, with their
    values; a key without shows only its current version and says where history comes from."""
    store.backend.keep_history({"hist:*": 10})
    for status in ("queued", "running", "blocked", "done"):
        await store.save("hist:job", {"status": status})
    await page.goto(inspector[0] + "#/keys/hist%3Ajob?glob=hist%3A*")
    rows = await page.wait_for(
        "document.querySelectorAll('#value-history tr[data-version]').length === 4 &&"
        " [...document.querySelectorAll('#value-history tr[data-version]')]"
        ".map(r => [r.children[0].textContent, r.querySelector('pre').textContent])"
    )
    assert [(number, json.loads(value)["status"]) for number, value in rows] == [
        ("4 (current)", "done"),
        ("3", "blocked"),
        ("2", "running"),
        ("1", "queued"),
    ]
    note = await page.evaluate("document.querySelector('#value-history p').textContent")
    assert note.startswith("4 retained versions, newest first"), note
    await page.evaluate("document.querySelector('#value-history details').open = true")
    await _screenshot(page, tmp_path, "inspector-history.png")


async def test_agents_and_knowledge_tabs_show(
    inspector: tuple[str, str], store: StateManager, page: Page, tmp_path: Path
) -> None:
    """The Agents tab lists agents with their checkpoints and recovery record; the Knowledge tab
    lists knowledge bases with their indexing run and sources."""
    agents = AgentStateStore(state_manager=store)
    await agents.save_snapshot(AgentSnapshot(agent_id="scout", step=3, metadata={"model": "m1"}))
    for step in (1, 2, 3):
        await agents.save_checkpoint(
            AgentCheckpoint(
                agent_id="scout", checkpoint_id=f"cp-{step}", step=step, state={"done": step}
            )
        )
    knowledge = KnowledgeStateManager(state_manager=store)
    await knowledge.update_indexing_progress(
        IndexingProgress(knowledge_base_id="papers", total_documents=40)
    )
    await knowledge.increment_progress("papers", processed=30, failed=2, embeddings=90)
    await knowledge.update_source_state(
        SourceState(
            source_id="arxiv",
            knowledge_base_id="papers",
            sync_status=SyncStatus.SYNCED,
            documents_synced=30,
        )
    )

    await page.goto(inspector[0] + "#/agents/scout")
    row = await page.wait_for(
        "(() => { const r = document.querySelector(\"#agents-table tr[data-agent='scout']\");"
        " return r && [...r.children].map(c => c.textContent); })()"
    )
    assert row[:4] == ["scout", "1", "3", "cp-3 (step 3)"]
    checkpoints = await page.wait_for(
        "[...document.querySelectorAll('#agent-panel tr[data-checkpoint]')]"
        ".map(r => r.dataset.checkpoint).join(' ')"
    )
    assert checkpoints.split() == ["cp-3", "cp-2", "cp-1"]
    await _screenshot(page, tmp_path, "inspector-agents.png")

    await page.click("#tabs a[data-tab=knowledge]")
    row = await page.wait_for(
        "(() => { const r = document.querySelector(\"#knowledge-table tr[data-kb='papers']\");"
        " return r && [...r.children].map(c => c.textContent); })()"
    )
    assert row[0] == "papers"
    assert row[5] == "in progress 80%"
    await page.click("#knowledge-table tr[data-kb='papers']")
    panel = await page.wait_for(
        "document.querySelector(\"#knowledge-panel tr[data-source='arxiv']\")"
        " && document.querySelector('#knowledge-panel').textContent"
    )
    assert "30 processed, 2 failed of 40" in panel
    assert await page.evaluate(HASH) == "#/knowledge/papers"
    await _screenshot(page, tmp_path, "inspector-knowledge.png")


EMPTY_TABS = {
    "keys": "The store is empty",
    "teams": "OrchestrationStateManager.create_team",
    "workflows": "WorkflowStateManager.create",
    "agents": "AgentStateStore.save_snapshot",
    "knowledge": "KnowledgeStateManager.update_indexing_progress",
    "tools": "ToolStateManager.start_execution",
    "sessions": "SessionManager.create_session",
    "speech": "SpeechStateManager.create_session",
    "stream": "every write and delete shows here",
}


async def test_an_empty_tab_says_what_would_appear_and_how(
    redis_url: str, page: Page, tmp_path: Path
) -> None:
    """On an empty store every tab says what it would show and which call (or the demo) puts
    something there, instead of bare headers."""
    for address, _prefix in _inspector(redis_url, "read-only"):
        for tab, wanted in EMPTY_TABS.items():
            await page.goto(address + "#/" + tab)
            text = await page.wait_for(
                f"document.querySelector('#tab-{tab} .empty')"
                f" && document.querySelector('#tab-{tab} .empty').textContent"
            )
            assert wanted in text, (tab, text)
            if tab not in ("keys", "stream"):
                assert "agenticstate demo" in text, (tab, text)
            if tab == "teams":
                await _screenshot(page, tmp_path, "empty-teams.png")
