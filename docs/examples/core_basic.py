"""The core calls of the AgenticAI Framework state-management API, run as written in memory.

Install: `pip install .` (from a checkout; see the README).
"""

import logging

import anyio

from agenticstate import StateConfig, StateManager

logging.basicConfig(level=logging.INFO)
logger = logging.getLogger(__name__)


async def main() -> None:
    # In-memory state (development)
    state_manager = StateManager(
        config=StateConfig(
            backend="memory",
            auto_save=True,
            save_interval=30,
        )
    )

    # Subscribe to state changes
    changed = anyio.Event()

    async def on_state_change(key: str, old_value: dict, new_value: dict) -> None:
        logger.info(f"State changed for {key}")
        logger.info(f" Old: {old_value}")
        logger.info(f" New: {new_value}")
        if new_value is None:
            changed.set()

    state_manager.subscribe("agent:*", on_state_change)

    # Save state
    await state_manager.save(
        "agent:researcher",
        {
            "status": "running",
            "current_task": "analyze_data",
            "progress": 0.45,
        },
    )

    # Get state
    agent_state = await state_manager.get("agent:researcher")
    logger.info(f"Status: {agent_state['status']}")

    # Update partial state
    await state_manager.update(
        "agent:researcher",
        {
            "progress": 0.75,
        },
    )
    assert (await state_manager.get("agent:researcher"))["progress"] == 0.75

    # List all keys
    keys = await state_manager.list_keys("agent:*")
    assert keys == ["agent:researcher"]

    # Delete state
    await state_manager.delete("agent:researcher")

    with anyio.fail_after(5):
        await changed.wait()

    # Unsubscribe
    state_manager.unsubscribe("agent:*", on_state_change)
    await state_manager.aclose()


if __name__ == "__main__":
    anyio.run(main)
