"""Every ```python block in docs/**/*.md runs, so no code shown in the documentation can rot.

A block is one of two things:

- an include of a program, `--8<-- "examples/name.py"` (pymdownx.snippets): the file must exist in
  docs/examples, where tests/test_docs_examples.py runs every program;
- a fragment, with an HTML comment on the line right before it (invisible in the rendered page)
  saying how to run it:

      <!-- snippet: setup=state check=step_completed -->
      ```python
      await state.save("job:42", {"step": 2})
      ```

  `setup=a,b` seeds the fragment's namespace from the setups in SETUPS below, entered in that
  order (without it the namespace starts empty); `check=name` runs a check from CHECKS on the
  namespace the fragment leaves; `redis` runs it against the test session's redis-server:
  `redis://localhost:6379` in the executed source (never in the page) and AGENTICSTATE_REDIS_URL
  become that server, in a database of its own that is emptied before and after, and the
  fragment must have written something there. A bare `<!-- snippet -->` runs the fragment as is.

A python block with neither form fails. A fragment is compiled as the body of a coroutine (so
top-level `await` and `async with` work, as in `python -m asyncio`) and run with anyio on asyncio,
in a fresh directory; tracebacks point at the markdown file and line. Whatever StateManager,
manager or backend it leaves open is closed afterwards.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import pytest

import agenticstate
from agenticstate import (
    AgentCheckpoint,
    AgentRecoveryManager,
    AgentStateStore,
    Backend,
    MemoryBackend,
    RedisBackend,
    StateConfig,
    StateManager,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
)
from agenticstate.managers._base import StateManagerBase

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from contextlib import AbstractAsyncContextManager
    from types import CodeType

Namespace = dict[str, Any]

DOCS = Path(__file__).parent.parent / "docs"
EXAMPLES = DOCS / "examples"
DOCS_REDIS_URL = "redis://localhost:6379"  # what the pages write; replaced when run
SNIPPET_DB = 9  # fragments write fixed names (research_team, ...): keep them apart from other tests

FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?:python|py)\b[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
MARKER = re.compile(r"^\s*<!--\s*snippet\b(?::(?P<options>[^>]*?))?\s*-->\s*$")
ANY_MARKER = re.compile(r"<!--\s*snippet\b")
INCLUDE = re.compile(r'^--8<--\s+"(?P<path>[^"]+)"\s*$')
MANGLED_INCLUDE = re.compile(r"--8\s*<\s*--")


# --------------------------------------------------------------------------- finding blocks


@dataclass(frozen=True)
class Block:
    """One ```python block of a page: where it is, its code, and its snippet comment."""

    page: str  # relative to docs/
    line: int  # the line of the opening fence
    source: str
    marker: str | None  # the options of its snippet comment, None without one
    options: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def includes(self) -> list[str] | None:
        """The files this block includes, or None if it is code."""
        lines = [line.strip() for line in self.source.splitlines() if line.strip()]
        found = [INCLUDE.match(line) for line in lines]
        if lines and all(found):
            return [match["path"] for match in found if match]
        return None

    @property
    def setups(self) -> list[str]:
        return [name for name in self.options.get("setup", "").split(",") if name]

    @property
    def needs_redis(self) -> bool:
        return "redis" in self.options


def parse_options(text: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for word in text.split():
        name, _, value = word.partition("=")
        options[name] = value
    return options


def find_blocks(docs: Path = DOCS) -> list[Block]:
    blocks = []
    for path in sorted(docs.rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            marker = MARKER.match(lines[line - 2]) if line >= 2 else None
            options = (marker["options"] or "") if marker else None
            blocks.append(
                Block(
                    page=path.relative_to(docs).as_posix(),
                    line=line,
                    source=textwrap.dedent(match["body"]),
                    marker=options,
                    options=parse_options(options or ""),
                )
            )
    return blocks


def reference_targets(docs: Path = DOCS) -> list[str]:
    """The objects the API reference renders (`::: name` lines in docs/reference)."""
    return [
        line.removeprefix(":::").strip()
        for path in sorted((docs / "reference").glob("*.md"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.startswith(":::")
    ]


def _documented(target: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) of a rendered object and of the members rendered with it."""
    module_name, _, name = target.rpartition(".")
    try:
        obj: Any = importlib.import_module(target)
    except ImportError:
        obj = getattr(importlib.import_module(module_name), name)
    found = [(target, inspect.getdoc(obj) or "")]
    members = vars(obj) if inspect.isclass(obj) else {}
    for member_name, member in members.items():
        if member_name.startswith("_"):
            continue
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        if isinstance(member, property):
            member = member.fget
        if callable(member) and getattr(member, "__doc__", None):
            found.append((f"{target}.{member_name}", inspect.getdoc(member) or ""))
    return found


def find_docstring_blocks() -> list[Block]:
    """The ```python blocks of the docstrings the API reference pages render."""
    blocks = []
    seen: set[str] = set()
    for target in reference_targets():
        for qualified, doc in _documented(target):
            if qualified in seen:
                continue
            seen.add(qualified)
            lines = doc.splitlines()
            for match in FENCE.finditer(doc):
                line = doc.count("\n", 0, match.start()) + 1
                marker = MARKER.match(lines[line - 2]) if line >= 2 else None
                options = (marker["options"] or "") if marker else None
                blocks.append(
                    Block(
                        page=f"api/{qualified}",
                        line=line,
                        source=textwrap.dedent(match["body"]),
                        marker=options,
                        options=parse_options(options or ""),
                    )
                )
    return blocks


BLOCKS = find_blocks() + find_docstring_blocks()
INCLUDES = [block for block in BLOCKS if block.includes is not None]
FRAGMENTS = [block for block in BLOCKS if block.includes is None]


# --------------------------------------------------------------------------- setups and checks

Setup: TypeAlias = "Callable[[], AbstractAsyncContextManager[Namespace]]"
Check: TypeAlias = "Callable[[Namespace], Awaitable[None]]"
SETUPS: dict[str, Setup] = {}
CHECKS: dict[str, Check] = {}


def setup(fn: Setup) -> Setup:
    SETUPS[fn.__name__] = fn
    return fn


def check(fn: Check) -> Check:
    CHECKS[fn.__name__] = fn
    return fn


@setup
@asynccontextmanager
async def imports() -> AsyncIterator[Namespace]:
    """Every public name of agenticstate, as a page's earlier `from agenticstate import` gives."""
    yield {name: getattr(agenticstate, name) for name in agenticstate.__all__}


@setup
@asynccontextmanager
async def state() -> AsyncIterator[Namespace]:
    """`state`: an empty StateManager on the memory backend."""
    async with StateManager(config=StateConfig(backend="memory")) as manager:
        yield {"state": manager}


@setup
@asynccontextmanager
async def agent_store() -> AsyncIterator[Namespace]:
    """`agent_store`: holding checkpoint task_step_5 of researcher_01, as the page saved it."""
    async with AgentStateStore(persistence="memory") as store:
        await store.save_checkpoint(
            AgentCheckpoint(
                agent_id="researcher_01",
                checkpoint_id="task_step_5",
                step=5,
                state={"current_task": "data_analysis", "tokens_used": 15000},
            )
        )
        yield {"agent_store": store}


class Agent:
    """The smallest agent `AgentRecoveryManager.register` takes: an id and a restore method."""

    def __init__(self, agent_id: str) -> None:
        self.id = agent_id
        self.restored: dict[str, Any] | None = None

    def restore_from_checkpoint(self, state: dict[str, Any]) -> None:
        self.restored = state


@setup
@asynccontextmanager
async def agent() -> AsyncIterator[Namespace]:
    """`agent`: researcher_01, which keeps the state it is restored from."""
    yield {"agent": Agent("researcher_01")}


@setup
@asynccontextmanager
async def backend() -> AsyncIterator[Namespace]:
    """`backend`: an empty MemoryBackend."""
    async with MemoryBackend() as made:
        yield {"backend": made}


@setup
@asynccontextmanager
async def recovery_manager() -> AsyncIterator[Namespace]:
    """`recovery_manager` on a memory store, and the `agent` it has registered."""
    async with AgentStateStore(persistence="memory") as store:
        manager = AgentRecoveryManager(agent_store=store)
        registered = Agent("researcher_01")
        manager.register(registered)
        yield {"recovery_manager": manager, "agent": registered}


@setup
@asynccontextmanager
async def workflow_state() -> AsyncIterator[Namespace]:
    """`workflow_state`: a memory WorkflowStateManager running research_pipeline (5 steps)."""
    async with WorkflowStateManager(persistence="memory") as manager:
        await manager.create(WorkflowState(workflow_id="research_pipeline", total_steps=5))
        await manager.start("research_pipeline")
        yield {"workflow_state": manager}


@setup
@asynccontextmanager
async def analyze() -> AsyncIterator[Namespace]:
    """`analyze`: an async step that returns {"themes": 3}."""

    async def analyze() -> dict[str, int]:
        return {"themes": 3}

    yield {"analyze": analyze}


@check
async def recovered(namespace: Namespace) -> None:
    """The agent was restored from the store's latest checkpoint."""
    assert namespace["recovered"] is True
    assert namespace["agent"].restored == {"current_task": "data_analysis", "tokens_used": 15000}


@check
async def step_completed(namespace: Namespace) -> None:
    """Step 3 is recorded completed, with the step's result."""
    workflow = await namespace["workflow_state"].require("research_pipeline")
    assert workflow.status is WorkflowStatus.RUNNING
    assert workflow.steps[3].status == "completed"
    assert workflow.steps[3].result == {"themes": 3}


@check
async def password_hidden(namespace: Namespace) -> None:
    """What the fragment built holds the password; its repr, str and `url` never show it."""
    made = [value for value in namespace.values() if isinstance(value, StateConfig | Backend)]
    assert made, "the fragment built no StateConfig or backend"
    for value in made:
        # The config keeps the URL as given; a backend keeps it for its connections only.
        url = value.redis_url if isinstance(value, StateConfig) else getattr(value, "_url", "")
        assert url is not None
        assert ":secret@" in url
        shown = [repr(value), str(value)]
        if isinstance(value, RedisBackend):
            shown.append(value.url)
        if isinstance(value, StateConfig):
            manager = StateManager(config=value)  # builds the backend; connects to nothing
            shown += [repr(manager), repr(manager.backend)]
            await manager.aclose()
        for text in shown:
            assert "secret" not in text, text
            assert ":***@" in text, text


# --------------------------------------------------------------------------- running fragments


def in_database(url: str, db: int) -> str:
    """Return the Redis `url` pointing at database `db`."""
    parts = urlsplit(url)
    query = [(name, value) for name, value in parse_qsl(parts.query) if name != "db"]
    if parts.scheme == "unix":
        # urlunsplit would drop the `//` of unix:///path.
        query.append(("db", str(db)))
        return f"unix://{parts.netloc}{parts.path}?{urlencode(query)}"
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", urlencode(query), ""))


def database_size(url: str, *, empty: bool = False) -> int:
    import redis

    with redis.Redis.from_url(url) as client:
        size: int = client.dbsize()
        if empty:
            client.flushdb()
        return size


def compiled(block: Block, source: str) -> CodeType:
    # Blank lines first, so that tracebacks name the page's own line numbers.
    padded = "\n" * block.line + source
    # As `python -m asyncio` does: the block becomes a coroutine's body if it awaits anything.
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    code: CodeType = compile(padded, str(DOCS / block.page), "exec", flags, dont_inherit=True)
    return code


async def run_fragment(code: CodeType, block: Block) -> None:
    async with AsyncExitStack() as stack:
        namespace: Namespace = {"__name__": "__snippet__"}
        for name in block.setups:
            namespace.update(await stack.enter_async_context(SETUPS[name]()))
        provided = list(namespace.values())
        try:
            result = eval(code, namespace)  # noqa: S307  # the documentation's own code
            if inspect.iscoroutine(result):
                await result
            if "check" in block.options:
                await CHECKS[block.options["check"]](namespace)
        finally:
            for value in namespace.values():
                left_open = isinstance(value, StateManager | StateManagerBase | Backend)
                if left_open and not any(value is mine for mine in provided):
                    await value.aclose()


def why_not_runnable(block: Block) -> list[str]:
    """What keeps a fragment from running as the test runs fragments (nothing if it can)."""
    if block.marker is None:
        hint = " (a mangled --8<-- include?)" if MANGLED_INCLUDE.search(block.source) else ""
        return [f"no runnable form{hint}: put <!-- snippet: ... --> on the line before the block"]
    unknown = set(block.options) - {"setup", "check", "redis"}
    unknown |= set(block.setups) - set(SETUPS)
    if "check" in block.options:
        unknown |= {block.options["check"]} - set(CHECKS)
    found = [f"unknown snippet options {sorted(unknown)}"] if unknown else []
    talks_to_redis = DOCS_REDIS_URL in block.source or 'persistence="redis"' in block.source
    if talks_to_redis != block.needs_redis:
        found.append("a fragment is marked `redis` exactly when it talks to Redis")
    return found


def fragment_params() -> list[Any]:
    return [
        pytest.param(block, id=block.id, marks=[pytest.mark.redis] if block.needs_redis else [])
        for block in FRAGMENTS
    ]


def test_the_pages_have_code() -> None:
    """The scan finds the pages' examples: included programs and fragments."""
    assert len(INCLUDES) >= 9
    assert len(FRAGMENTS) >= 14
    assert {"concepts/versions.md", "managers/agents.md"} <= {b.page for b in FRAGMENTS}


@pytest.mark.parametrize("block", INCLUDES, ids=[block.id for block in INCLUDES])
def test_included_program_exists(block: Block) -> None:
    """The include names a program in docs/examples, which test_docs_examples.py runs."""
    assert block.marker is None, "an included program runs as a whole: drop the snippet comment"
    for name in block.includes or []:
        path = (DOCS / name).resolve()
        assert path.is_file(), f"{block.id}: {name} does not exist"
        assert path.parent == EXAMPLES.resolve(), f"{block.id}: {name} is not in docs/examples"
        assert path.suffix == ".py"


@pytest.mark.parametrize("block", fragment_params())
def test_fragment_runs(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The fragment runs to the end from its setup and passes its check."""
    if problems := why_not_runnable(block):
        pytest.fail(f"{block.id}: {'; '.join(problems)} (see tests/test_docs_snippets.py)")
    source = block.source
    url = ""
    if block.needs_redis:
        url = in_database(request.getfixturevalue("redis_url"), SNIPPET_DB)
        source = source.replace(DOCS_REDIS_URL, url)
        monkeypatch.setenv("AGENTICSTATE_REDIS_URL", url)
        database_size(url, empty=True)
    monkeypatch.chdir(tmp_path)
    try:
        anyio.run(run_fragment, compiled(block, source), block, backend="asyncio")
        if url:
            assert database_size(url) > 0, f"{block.id} wrote nothing to Redis"
    finally:
        if url:
            database_size(url, empty=True)


def test_snippet_comments_precede_python_blocks() -> None:
    """Every snippet comment sits on the line right before a ```python block."""
    marked = {(b.page, b.line - 1) for b in BLOCKS if b.marker is not None}
    stray = [
        f"{path.relative_to(DOCS).as_posix()}:{number}"
        for path in sorted(DOCS.rglob("*.md"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if ANY_MARKER.search(line) and (path.relative_to(DOCS).as_posix(), number) not in marked
    ]
    assert not stray


def test_unrunnable_blocks_are_reported(tmp_path: Path) -> None:
    """Unmarked code, a mangled include, unknown options and unmarked Redis use are refused."""
    (tmp_path / "page.md").write_text(
        "```python\nx = 1\n```\n\n"
        '```python\n--8 < --"examples/a.py"\n```\n\n'
        "<!-- snippet: setup=nothing check=nothing colour=blue -->\n```python\nx = 1\n```\n\n"
        '<!-- snippet -->\n```python\nStateConfig(redis_url="redis://localhost:6379")\n```\n\n'
        "<!-- snippet: setup=state -->\n```python\nawait state.get('k')\n```\n\n"
        '  ```python\n  --8<-- "examples/a.py"\n  ```\n'
    )
    *code, include = find_blocks(tmp_path)
    assert [block.line for block in code] == [1, 5, 10, 15, 20]
    assert include.includes == ["examples/a.py"]
    reasons = [why_not_runnable(block) for block in code]
    assert reasons[0] == [
        "no runnable form: put <!-- snippet: ... --> on the line before the block"
    ]
    assert "mangled" in reasons[1][0]
    assert reasons[2] == ["unknown snippet options ['colour', 'nothing']"]
    assert reasons[3] == ["a fragment is marked `redis` exactly when it talks to Redis"]
    assert reasons[4] == []


def test_in_database() -> None:
    """The test server's URL is pointed at the fragments' own database, whatever its form."""
    assert in_database("unix:///tmp/r/redis.sock", 9) == "unix:///tmp/r/redis.sock?db=9"
    assert in_database("unix:///tmp/r.sock?db=1", 9) == "unix:///tmp/r.sock?db=9"
    assert in_database("redis://127.0.0.1:6379/0", 9) == "redis://127.0.0.1:6379/9"
    assert in_database("rediss://h:1", 9) == "rediss://h:1/9"
