"""One record that does not read hides only itself, in every inspector tab and `inspect` target.

A record under a manager's keys that does not validate as its model (a foreign value, a field
written by a newer release) used to blank a whole tab (`/api/agents` answered 422) and make
`agenticstate inspect agents` exit 2, naming no key. Now the records that read are shown and
the bad one is named with its key (the tab's `problems`, a line on stderr). The generator puts a
bad record at every shape of key the managers write (under a new id, and beside an existing
record of an existing id), in two kinds, and checks every tab and target that reads the family.
"""

from __future__ import annotations

import json
import re
import shutil
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from agenticstate import AgentCheckpoint, AgentStateStore, StateManager
from agenticstate.backends import SQLiteBackend
from agenticstate.cli import main
from agenticstate.exceptions import DecodeError
from agenticstate.ui import create_app
from tests.managers.test_list_methods import _fill  # records of every manager

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

# A key's first part -> (inspector endpoint, its list, its id field, `inspect` target, column).
VIEWS = {
    "agents": ("/api/agents", "agents", "agent_id", "agents", "agent"),
    "workflows": ("/api/workflows", "workflows", "workflow_id", "workflows", "workflow"),
    "teams": ("/api/teams", "teams", "team_id", "teams", "team"),
    "knowledge": (
        "/api/knowledge",
        "knowledge",
        "knowledge_base_id",
        "knowledge",
        "knowledge_base",
    ),
    "tools": ("/api/tools", "tools", "tool", "tools", "tool"),
    "sessions": ("/api/sessions", "sessions", "session_id", "sessions", "session"),
    "speech": ("/api/speech", "speech", "session_id", "speech", "session"),
}
BAD_VALUES = {
    "foreign": "written by another program",
    "newer": {"a_field_from_a_newer_release": 1},
}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """An SQLite store holding records of every manager, and its keys."""
    path = tmp_path_factory.mktemp("bad-records") / "template.db"

    async def make() -> list[str]:
        async with StateManager(backend=SQLiteBackend(path)) as state:
            await _fill(state)
            return await state.list_keys("*")

    return path, anyio.run(make)


def _bad_keys(keys: list[str]) -> Iterator[str]:
    """Every shape of key the managers wrote, once under a new id (`{ghost}`) and once beside
    an existing record of an existing id (its last part replaced)."""
    seen: set[str] = set()
    for key in sorted(keys):
        shape = re.sub(r"\{[^}]*\}", "{ID}", key)
        if shape in seen or "{ID}" not in shape:
            continue
        seen.add(shape)
        yield re.sub(r"\{[^}]*\}", "{ghost}", key, count=1)
        parts = key.split(":")
        if len(parts) >= 4:
            yield ":".join([*parts[:-1], "zz-bad"])


def _listed(template: tuple[Path, list[str]]) -> list[tuple[str, str]]:
    return [(key, kind) for key in _bad_keys(template[1]) for kind in BAD_VALUES]


def _ids(rows: list[dict[str, Any]], field: str) -> set[str]:
    return {str(row[field]) for row in rows}


async def _tab(path: Path, endpoint: str) -> httpx.Response:
    async with StateManager(backend=SQLiteBackend(path)) as state:
        app = create_app(state)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                return await c.get(endpoint)


def _inspect(path: Path, target: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["--url", f"sqlite://{path}", "--json", "inspect", target])
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_the_generator_covers_every_view(template: tuple[Path, list[str]]) -> None:
    """Every tab and target gets bad records of both kinds (the table is complete)."""
    covered = {key.split(":")[0] for key, _ in _listed(template)}
    assert covered == set(VIEWS)


def test_one_bad_record_hides_only_itself(
    template: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """For every shape of key x kind of bad value: the tab answers 200 with every record it
    listed before and names any record it left out by its key; `inspect` exits 0 with the same
    records and names the left-out ones on stderr."""
    source, _ = template
    before: dict[str, tuple[set[str], set[str]]] = {}
    for namespace, (endpoint, field, id_field, target, column) in VIEWS.items():
        reply = anyio.run(_tab, source, endpoint)
        assert reply.status_code == 200, reply.text
        code, out, _ = _inspect(source, target, capsys)
        assert code == 0
        before[namespace] = (_ids(reply.json()[field], id_field), _ids(json.loads(out), column))
        assert before[namespace][0], namespace
    failures = []
    flagged: set[str] = set()  # the views that named a bad record (not only passed it over)
    for bad_key, kind in _listed(template):
        namespace = bad_key.split(":")[0]
        endpoint, field, id_field, target, column = VIEWS[namespace]
        path = tmp_path / "store.db"
        for stale in tmp_path.glob("store.db*"):
            stale.unlink()
        shutil.copy(source, path)

        async def put(path: Path = path, bad_key: str = bad_key, kind: str = kind) -> None:
            async with StateManager(backend=SQLiteBackend(path)) as state:
                await state.save(bad_key, BAD_VALUES[kind])

        anyio.run(put)
        reply = anyio.run(_tab, path, endpoint)
        code, out, err = _inspect(path, target, capsys)
        tab_ok = reply.status_code == 200 and before[namespace][0] <= _ids(
            reply.json()[field], id_field
        )
        problems = reply.json().get("problems", []) if reply.status_code == 200 else []
        named = all(p["key"] == bad_key or bad_key in p["error"] for p in problems)
        cli_ok = code == 0 and before[namespace][1] <= _ids(json.loads(out or "[]"), column)
        cli_named = all(bad_key in line for line in err.splitlines())
        if problems and err:
            flagged.add(namespace)
        if not (tab_ok and named and cli_ok and cli_named):
            failures.append((bad_key, kind, reply.status_code, reply.text[:200], code, err[:200]))
    assert failures == []
    assert flagged == set(VIEWS)


def test_the_red_team_case_is_flagged_with_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint with a field from a newer release under a new agent: the valid agent is
    listed with its checkpoint, and the bad record is named by its key, on the page and on
    stderr."""
    path = tmp_path / "s.db"
    bad = "agents:{ghost}:checkpoints:c1"

    async def make() -> None:
        async with StateManager(backend=SQLiteBackend(path)) as state:
            store = AgentStateStore(state_manager=state)
            await store.save_checkpoint(AgentCheckpoint(agent_id="writer", checkpoint_id="c0"))
            await state.save(bad, {"agent_id": "ghost", "checkpoint_id": "c1", "priority": 5})

    anyio.run(make)
    reply = anyio.run(_tab, path, "/api/agents")
    assert reply.status_code == 200
    agents = {a["agent_id"]: a for a in reply.json()["agents"]}
    assert agents["writer"]["checkpoint_count"] == 1
    assert agents.get("ghost", {"checkpoint_count": 0})["checkpoint_count"] == 0
    [problem] = reply.json()["problems"]
    assert problem["key"] == bad or bad in problem["error"]
    assert "priority" in problem["error"]
    code, out, err = _inspect(path, "agents", capsys)
    assert code == 0
    assert "writer" in out
    assert bad in err
    assert "AgentCheckpoint" in err


def test_a_record_that_does_not_validate_is_named_by_its_key(tmp_path: Path) -> None:
    """`get(key, model=...)` on a record that does not validate raises `DecodeError` naming
    the key, the first field at fault (never its value) and what to do."""

    async def main_() -> None:
        async with StateManager(backend=SQLiteBackend(tmp_path / "s.db")) as state:
            await state.save(
                "agents:{a}:checkpoints:c1", {"agent_id": "a", "secret_field": "v4lue"}
            )
            with pytest.raises(DecodeError) as caught:
                await state.get("agents:{a}:checkpoints:c1", model=AgentCheckpoint)
            message = str(caught.value)
            assert "'agents:{a}:checkpoints:c1'" in message
            assert "AgentCheckpoint" in message
            assert "v4lue" not in message
            assert "delete" in message

    anyio.run(main_)


def test_the_cli_exits_3_on_a_record_it_was_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`get KEY` on a value that does not decode (a damaged store) exits 3, naming the key."""
    path = tmp_path / "s.db"

    async def make() -> None:
        async with SQLiteBackend(path) as backend:
            await backend.set("k", b"\x01\xc1 not msgpack")  # bytes no release wrote

    anyio.run(make)
    with pytest.raises(SystemExit) as done:
        main(["--url", f"sqlite://{path}", "get", "k"])
    assert done.value.code == 3
    assert "corrupt" in capsys.readouterr().err
