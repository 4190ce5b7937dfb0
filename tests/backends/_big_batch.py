"""One very large batch on a file store, with a ticker on the same event loop.

`python -m tests.backends._big_batch DIR MODE COUNT`: MODE `manager` saves COUNT records with
`StateManager.save_many`, `backend` writes them with `FileBackend.set_many`. A ticker task
sleeps 10 ms at a time and records when it runs. Prints one JSON line: how many records were
written, how many ticks happened while the batch ran and the longest gap between two ticks
(seconds), a sample read back, and whether the store then closed.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import anyio

from agenticstate import FileBackend, StateManager


async def main(directory: str, mode: str, count: str) -> None:
    n = int(count)
    backend = FileBackend(base_path=directory, format="msgpack", auto_save=False)
    ticks: list[float] = []
    written = 0
    sample: object = None

    async def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        if mode == "manager":
            async with StateManager(backend=backend) as state:
                start = time.monotonic()
                versions = await state.save_many({f"k{i}": i for i in range(n)})
                end = time.monotonic()
                written = len(versions)
                sample = await state.get(f"k{n - 1}")
        else:
            async with backend:
                start = time.monotonic()
                changes = await backend.set_many([(f"k{i}", b"%d" % i) for i in range(n)])
                end = time.monotonic()
                written = len(changes)
                entry = await backend.get(f"k{n - 1}")
                sample = entry.value.decode() if entry is not None else None
        tg.cancel_scope.cancel()
    during = [start, *(tick for tick in ticks if start < tick < end), end]
    gaps = [later - earlier for earlier, later in itertools.pairwise(during)]
    report = {
        "written": written,
        "ticks": len(during) - 2,
        "max_gap": max(gaps),
        "seconds": end - start,
        "sample": sample,
        "closed": True,
    }
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
