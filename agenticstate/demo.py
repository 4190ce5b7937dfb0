"""A small research job on agenticstate: `python -m agenticstate.demo` (or `make demo`).

Three agent workers share a queue of documents kept in state. Each claims a document with a
compare-and-set on its version (so no document is taken twice), records progress with atomic
updates, and a subscriber reports every change as it commits.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio

from agenticstate import ConflictError, StateConfig, StateManager

DOCUMENTS = [f"doc-{n:02d}" for n in range(1, 13)]
WORKERS = ["researcher", "analyst", "writer"]


def say(text: str) -> None:
    """Print one line of the demo's report."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def claim_next(state: StateManager, worker: str) -> str | None:
    """Claim the first unclaimed document with a version check, or return None when done."""
    for doc in DOCUMENTS:
        entry = await state.get_entry(f"doc:{doc}")
        if entry is None or entry.value["owner"] is not None:
            continue
        try:
            await state.save(
                f"doc:{doc}", {**entry.value, "owner": worker}, expected_version=entry.version
            )
        except ConflictError:
            continue  # another worker claimed it first
        return doc
    return None


async def work(state: StateManager, worker: str) -> None:
    """Process documents until none is left."""
    while (doc := await claim_next(state, worker)) is not None:
        await state.update(f"agent:{worker}", {"status": "working", "current_task": doc})
        await anyio.sleep(0.01)  # the "research"
        await state.update(f"doc:{doc}", {"done": True})
        await state.update("job:progress", lambda n: n + 1)
        await state.update(f"agent:{worker}", lambda a: {**a, "processed": a["processed"] + 1})
    await state.update(f"agent:{worker}", {"status": "idle", "current_task": None})


async def main() -> None:
    """Run the job and print what happened."""
    changes = 0

    def on_agent_change(key: str, old: Any, new: Any) -> None:
        nonlocal changes
        changes += 1
        if new is not None and (old is None or old.get("status") != new.get("status")):
            say(f"  {key}: {None if old is None else old['status']} -> {new['status']}")

    async with StateManager(config=StateConfig(backend="memory")) as state:
        say("agenticstate demo: 3 agents share 12 documents (memory backend)")
        state.subscribe("agent:*", on_agent_change)
        await state.save_many({f"doc:{doc}": {"owner": None, "done": False} for doc in DOCUMENTS})
        await state.save("job:progress", 0)
        for worker in WORKERS:
            await state.save(f"agent:{worker}", {"status": "idle", "processed": 0})

        async with anyio.create_task_group() as tg:
            for worker in WORKERS:
                tg.start_soon(work, state, worker)

        done = await state.get("job:progress")
        owners = [(await state.get(f"doc:{doc}"))["owner"] for doc in DOCUMENTS]
        say(f"processed {done}/{len(DOCUMENTS)} documents, each claimed exactly once")
        for worker in WORKERS:
            agent = await state.get(f"agent:{worker}")
            say(f"  {worker}: {agent['processed']} documents ({owners.count(worker)} claimed)")
        stats = state.stats()
        say(f"stats: {stats.saves} saves, {stats.updates} updates, {stats.conflicts} conflicts")
        if done != len(DOCUMENTS):
            raise SystemExit("demo failed: not every document was processed")
    say(f"{changes} agent changes delivered to the subscriber")


if __name__ == "__main__":
    anyio.run(main)
