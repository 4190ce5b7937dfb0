"""Watching changes as an async iterator, with versions and optimistic concurrency.

Install: `pip install .` (from a checkout; see the README).
"""

import anyio

from agenticstate import ConflictError, StateManager


async def main() -> None:
    async with StateManager() as state, state.watch("job:*") as changes:
        version = await state.save("job:42", {"step": 1})
        await state.save("job:42", {"step": 2}, expected_version=version)
        try:
            await state.save("job:42", {"step": 99}, expected_version=version)  # stale
        except ConflictError as exc:
            print(f"refused: {exc}")

        with anyio.fail_after(5):
            async for change in changes:
                print(change.op, change.key, change.old_value, "->", change.new_value)
                if change.version == 2:
                    break


if __name__ == "__main__":
    anyio.run(main)
