"""A small research job on agenticstate: `python -m agenticstate.demo` (or `make demo`).

The job runs on the embedded default, the crash-safe file backend, in `.state/demo/`. Three agent
workers share a batch of documents kept in state. Each claims a document with a compare-and-set
on its version (so no document is taken twice), records progress with atomic updates, and a
subscriber reports every change as it commits. Run it again and it continues from the state the
last run left: it finds the earlier batches done and processes the next one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio

from agenticstate import ConflictError, StateConfig, StateManager

BATCH = 12
WORKERS = ["researcher", "analyst", "writer"]
STORE = Path(".state/demo/state.json")


def say(text: str) -> None:
    """Print one line of the demo's report."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def claim_next(state: StateManager, worker: str, documents: list[str]) -> str | None:
    """Claim the first unclaimed document with a version check, or return None when done."""
    for doc in documents:
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


async def work(state: StateManager, worker: str, documents: list[str]) -> None:
    """Process documents until none is left."""
    while (doc := await claim_next(state, worker, documents)) is not None:
        await state.update(f"agent:{worker}", {"status": "working", "current_task": doc})
        await anyio.sleep(0.01)  # the "research"
        await state.update(f"doc:{doc}", {"done": True})
        await state.update("job:progress", lambda n: n + 1, default=0)
        await state.update(f"agent:{worker}", lambda a: {**a, "processed": a["processed"] + 1})
    await state.update(f"agent:{worker}", {"status": "idle", "current_task": None})


async def main() -> None:
    """Run the next batch of the job and print what happened."""
    changes = 0

    def on_agent_change(key: str, old: Any, new: Any) -> None:
        nonlocal changes
        changes += 1
        if new is not None and (old is None or old.get("status") != new.get("status")):
            say(f"  {key}: {None if old is None else old['status']} -> {new['status']}")

    config = StateConfig(backend="file", file_path=STORE)
    async with StateManager(config=config) as state:
        run = await state.update("job:runs", lambda n: n + 1, default=0)
        first = (run - 1) * BATCH + 1
        documents = [f"doc-{n:03d}" for n in range(first, first + BATCH)]
        span = f"{documents[0]}..{documents[-1]}"
        say(f"agenticstate demo, run {run}: 3 agents share documents {span}")
        say(f"state lives in {STORE.parent.resolve()} (file backend: crash-safe log + snapshot)")
        if run > 1:
            done_before = await state.get("job:progress", 0)
            say(f"continuing from the last run: {done_before} documents were already processed")
        state.subscribe("agent:*", on_agent_change)
        await state.save_many({f"doc:{doc}": {"owner": None, "done": False} for doc in documents})
        for worker in WORKERS:
            await state.update(
                f"agent:{worker}", {"status": "idle"}, default={"status": "new", "processed": 0}
            )

        async with anyio.create_task_group() as tg:
            for worker in WORKERS:
                tg.start_soon(work, state, worker, documents)

        done = await state.get("job:progress", 0)
        owners = [(await state.get(f"doc:{doc}"))["owner"] for doc in documents]
        say(f"processed {done} documents in all ({run} runs); this batch's were claimed once each")
        for worker in WORKERS:
            agent = await state.get(f"agent:{worker}")
            say(f"  {worker}: {agent['processed']} documents in all ({owners.count(worker)} now)")
        stats = state.stats()
        say(f"stats: {stats.saves} saves, {stats.updates} updates, {stats.conflicts} conflicts")
        if done != run * BATCH or any(owner not in WORKERS for owner in owners):
            raise SystemExit("demo failed: not every document was processed exactly once")
    say(f"{changes} agent changes delivered to the subscriber")
    say("run `make demo` again to continue from this state")


if __name__ == "__main__":
    from agenticstate.cli import configure_logging

    configure_logging()
    anyio.run(main)
