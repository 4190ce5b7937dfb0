"""Agno's shopping-list agent, on agenticstate: session state across runs, rendered instructions.

Agno keeps `session_state={"shopping_list": []}` per session in its db, hands it to tools, and
substitutes `{shopping_list}` into the instructions. Here the tools take the SessionManager and
a session id, every change is one atomic update (no lost item when two runs overlap), and the
history is a record per message. The model call is left out: each "run" calls the tools the
model would have chosen.

Install: `pip install .` (from a checkout; see the README).
"""

from collections.abc import Awaitable
from pathlib import Path
from tempfile import TemporaryDirectory
from textwrap import dedent

import anyio

from agenticstate import SessionManager

INSTRUCTIONS = dedent("""\
    Your job is to manage a shopping list.
    The shopping list starts empty. You can add items, remove items by name, and list all items.
    Current shopping list: {shopping_list}
    """)


async def add_item(sessions: SessionManager, session_id: str, item: str) -> str:
    """Add an item to the shopping list unless it is there already (case-insensitive)."""
    added = False

    def add(state: dict[str, list[str]]) -> dict[str, list[str]]:
        nonlocal added
        items = state["shopping_list"]
        added = item.lower() not in [i.lower() for i in items]
        return {**state, "shopping_list": [*items, item] if added else items}

    await sessions.update_state(session_id, add)
    return f"Added '{item}' to the shopping list" if added else f"'{item}' is already on it"


async def remove_item(sessions: SessionManager, session_id: str, item: str) -> str:
    """Remove an item from the shopping list by name (case-insensitive)."""
    removed: list[str] = []

    def remove(state: dict[str, list[str]]) -> dict[str, list[str]]:
        keep = [i for i in state["shopping_list"] if i.lower() != item.lower()]
        removed[:] = [i for i in state["shopping_list"] if i.lower() == item.lower()]
        return {**state, "shopping_list": keep}

    await sessions.update_state(session_id, remove)
    return f"Removed '{removed[0]}'" if removed else f"'{item}' was not found in the list"


async def list_items(sessions: SessionManager, session_id: str) -> str:
    """List all items in the shopping list."""
    shopping_list = (await sessions.get_state(session_id))["shopping_list"]
    if not shopping_list:
        return "The shopping list is empty."
    return "Current shopping list:\n" + "\n".join(f"- {item}" for item in shopping_list)


async def run(
    sessions: SessionManager, session_id: str, prompt: str, *calls: Awaitable[str]
) -> None:
    """One agent run: the user's message, the tools the model chose, the reply."""
    await sessions.add_message(session_id, "user", prompt)
    instructions = await sessions.render(session_id, INSTRUCTIONS)  # what the model would get
    assert "Current shopping list: [" in instructions
    replies = [await call for call in calls]
    await sessions.add_message(session_id, "assistant", "\n".join(replies))
    print(f"Session state: {await sessions.get_state(session_id)}")


async def main(directory: Path) -> None:
    # persistence="file" keeps the sessions across processes, like Agno's SqliteDb(db_file=...).
    async with SessionManager(
        persistence="file", base_path=directory, default_state={"shopping_list": []}
    ) as sessions:
        session = await sessions.create_session("user_1", session_id="user_1_session_1")
        sid = session.session_id
        await run(
            sessions,
            sid,
            "Add milk, eggs, and bread to the shopping list",
            add_item(sessions, sid, "milk"),
            add_item(sessions, sid, "eggs"),
            add_item(sessions, sid, "bread"),
        )
        await run(sessions, sid, "I got bread", remove_item(sessions, sid, "Bread"))
        await run(
            sessions,
            sid,
            "I need apples and oranges",
            add_item(sessions, sid, "apples"),
            add_item(sessions, sid, "oranges"),
        )
        await run(sessions, sid, "whats on my list?", list_items(sessions, sid))
        await run(
            sessions,
            sid,
            "Clear everything from my list and start over with just bananas and yogurt",
        )
        # "Clear everything": overwrite the state (Agno's overwrite_db_session_state).
        await sessions.set_state(sid, {"shopping_list": ["bananas", "yogurt"]})
        assert await sessions.get_state(sid) == {"shopping_list": ["bananas", "yogurt"]}

    # A later run (another process, here a new manager) finds the session and its history.
    async with SessionManager(persistence="file", base_path=directory) as sessions:
        state = await sessions.get_state("user_1_session_1")
        assert state == {"shopping_list": ["bananas", "yogurt"]}
        history = await sessions.get_messages("user_1_session_1", last=4)
        assert [m.role for m in history] == ["user", "assistant", "user", "assistant"]
        print(await sessions.render("user_1_session_1", "Current shopping list: {shopping_list}"))
        print([s.session_id for s in await sessions.list_sessions("user_1")])


if __name__ == "__main__":
    with TemporaryDirectory() as tmp:
        anyio.run(main, Path(tmp))
