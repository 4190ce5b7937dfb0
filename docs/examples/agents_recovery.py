"""An agent checkpoints its progress, crashes, and the recovery manager restores it.

Install: `pip install .` (from a checkout; see the README).
"""

import logging
from typing import Any

import anyio

from agenticstate import (
    AgentCheckpoint,
    AgentRecoveryManager,
    AgentSnapshot,
    AgentStateStore,
)


class Researcher:
    def __init__(self) -> None:
        self.id = "researcher_01"
        self.done: list[str] = []
        self.crashes_left = 1

    def restore_from_checkpoint(self, state: dict[str, Any]) -> None:
        self.done = list(state["done"])

    async def run(self, store: AgentStateStore, topics: list[str]) -> list[str]:
        for step, topic in enumerate(topics, start=1):
            if topic in self.done:
                continue  # finished before the crash: skip it
            if step == 3 and self.crashes_left:
                self.crashes_left -= 1
                self.done = []  # a crash loses what was in memory
                raise ConnectionError("model endpoint went away")
            self.done.append(topic)
            await store.save_checkpoint(
                AgentCheckpoint(
                    agent_id=self.id,
                    checkpoint_id=f"step_{step}",
                    step=step,
                    state={"done": self.done},
                )
            )
        return self.done


async def main() -> None:
    # The library logs through `logging`; show its warnings as labelled lines.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    async with AgentStateStore(persistence="memory", max_checkpoints=3) as store:
        agent = Researcher()
        await store.save_snapshot(AgentSnapshot(agent_id=agent.id, metadata={"version": "1.0"}))

        recovery = AgentRecoveryManager(
            agent_store=store, auto_recover=True, max_recovery_attempts=3
        )
        recovery.on_after_recovery(
            lambda event: print(f"recovered {event.agent_id} from {event.checkpoint.checkpoint_id}")
        )

        topics = ["llms", "agents", "state", "memory", "tools"]
        print("the agent crashes on purpose at step 3 (a ConnectionError); recovering")
        result = await recovery.run(agent, lambda: agent.run(store, topics))
        print("finished:", result)
        assert result == topics

        checkpoints = await store.list_checkpoints(agent.id)
        print("kept checkpoints:", [c.checkpoint_id for c in checkpoints])
        assert [c.step for c in checkpoints] == [5, 4, 3]


if __name__ == "__main__":
    anyio.run(main)
