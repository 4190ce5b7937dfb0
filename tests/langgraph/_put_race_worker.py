"""A process that extends one thread with guarded `aput`s as fast as it can, racing others.

`python -m tests.langgraph._put_race_worker SPEC THREAD NAME` where SPEC is JSON
`{"url": ..., "options": {...}, "prefix": ...}` naming a shared backend. Forever: read the
thread's head (`aget_tuple`), build the next checkpoint on it (two channels change, one stays),
`aput` it with the head guard and record a pending write against it; a refused put
(`StaleCheckpointError`) is counted and the loop reads the head again. After each put it prints
`{"puts": N, "stale": M}`; it stops when its stdin closes (or is killed).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint

from agenticstate import StateConfig, StateManager
from agenticstate.backends import open_backend
from agenticstate.langgraph import HEAD_GUARD_KEY, CheckpointSaver, StaleCheckpointError


def next_checkpoint(
    saver: CheckpointSaver, previous: Any, name: str, step: int
) -> tuple[Any, dict[str, Any]]:
    """The checkpoint after `previous` (a `CheckpointTuple` or `None`) and its new versions."""
    base = previous.checkpoint if previous is not None else empty_checkpoint()
    values = dict(base["channel_values"])
    versions = dict(base["channel_versions"])
    messages = [*values.get("messages", [])[-6:], f"{name}:{step}"]
    new = {
        "messages": saver.get_next_version(versions.get("messages"), None),
        "by": saver.get_next_version(versions.get("by"), None),
    }
    if "tools" not in versions:
        new["tools"] = saver.get_next_version(None, None)
    versions |= new
    checkpoint = create_checkpoint(base, None, step)
    checkpoint["channel_versions"] = versions
    checkpoint["channel_values"] = {
        "messages": messages,
        "by": name,
        "tools": values.get("tools", ["search"]),
    }
    return checkpoint, new


async def _stdin_closed(done: anyio.Event) -> None:
    await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
    done.set()


async def main(spec: dict[str, Any], thread: str, name: str) -> None:
    backend = open_backend(spec["url"], **spec.get("options", {}))
    async with StateManager(StateConfig(), backend=backend) as state:
        saver = CheckpointSaver(state, prefix=spec["prefix"])
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stdin_closed, stop)
            puts = stale = 0
            while not stop.is_set():
                latest = await saver.aget_tuple({"configurable": {"thread_id": thread}})
                if latest is None:
                    config: Any = {
                        "configurable": {
                            "thread_id": thread,
                            "checkpoint_ns": "",
                            HEAD_GUARD_KEY: True,
                        }
                    }
                else:
                    config = latest.config
                checkpoint, new = next_checkpoint(saver, latest, name, puts + stale)
                metadata: Any = {"source": "loop", "step": puts, "writer": name}
                try:
                    stored = await saver.aput(config, checkpoint, metadata, new)
                except StaleCheckpointError:
                    stale += 1
                    continue
                await saver.aput_writes(stored, [("messages", f"{name}:w{puts}")], f"task-{name}")
                puts += 1
                sys.stdout.write(json.dumps({"puts": puts, "stale": stale}) + "\n")
                sys.stdout.flush()
            tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
