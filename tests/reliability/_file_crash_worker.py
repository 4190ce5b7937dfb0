"""A writer process for the file store's kill -9 harness.

`python -m tests.reliability._file_crash_worker DIR SEED START BATCH_START STEP_START`: opens
the store,
forks a child that inherits it and lives until stdin closes (`child PID`), prints `open`, then
runs at once:

- three writers of single keys: `k{n % 30}` = n for n = START, START+1, ... (writer `w` takes
  the n with `n % 3 == w`), printing `ack n` after each acknowledged write;
- one writer of large batches: batch m (m = BATCH_START, ...) writes `b{i}` = m for every
  i < size, with sizes between 500 and 20,000 drawn from SEED, and prints `batch m size`
  once the whole batch is acknowledged;
- one writer of `transact` steps: step j (j = STEP_START, ...) writes `t{j % 3}:{x}` = j,
  padded to 2 KB, for every x < 100, and sets member `s{j % 3}` of index `steps` to j, in one
  step (one log frame), printing `step j` once it is acknowledged. After a kill, the 100 keys
  and the index member of each slot must agree: the step happened whole or not at all.

Values only grow per key, so after a kill every key must read as its last acknowledged value
or a later one, until the process is killed.
"""

from __future__ import annotations

import os
import random
import sys

import anyio

from agenticstate import FileBackend
from agenticstate.backends import IndexAdd, Put

WRITERS = 3
STEP_SLOTS = 3
STEP_KEYS = 100


def step_value(j: int) -> bytes:
    return b"%d|" % j + b"x" * 2048


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main(directory: str, seed: str, start: str, batch_start: str, step_start: str) -> None:
    backend = FileBackend(base_path=directory, format="msgpack")
    await backend.open()
    pid = os.fork()
    if pid == 0:  # the child: holds whatever it inherited until stdin closes
        sys.stdin.buffer.read()
        os._exit(0)
    emit(f"child {pid}")
    emit("open")
    rng = random.Random(int(seed))

    async def writer(first: int) -> None:
        n = first
        while True:
            await backend.set(f"k{n % 30}", b"%d" % n)
            emit(f"ack {n}")
            n += WRITERS

    async def batches() -> None:
        m = int(batch_start)
        while True:
            size = rng.randint(500, 20_000)
            await backend.set_many([(f"b{i}", b"%d" % m) for i in range(size)])
            emit(f"batch {m} {size}")
            m += 1

    async def steps() -> None:
        j = int(step_start)
        while True:
            slot = j % STEP_SLOTS
            then = [Put(f"t{slot}:{x}", step_value(j)) for x in range(STEP_KEYS)]
            await backend.transact([], [*then, IndexAdd("steps", {f"s{slot}": j})])
            emit(f"step {j}")
            j += 1

    async with anyio.create_task_group() as tg:
        for w in range(WRITERS):
            tg.start_soon(writer, int(start) + w)
        tg.start_soon(batches)
        tg.start_soon(steps)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
