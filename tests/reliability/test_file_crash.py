"""The file store under kill -9: large batches, transact steps and a forked child.

Each round starts a writer process (`_file_crash_worker`) that forks a child holding the open
store, writes single keys from three tasks and batches of up to 20,000 records from a fourth,
and is SIGKILLed after a random number of acknowledgements (always with a batch in flight).
While the forked child still lives, the test reopens the store (the lock must be free) and
checks that every key reads as its last acknowledged value or a later one, and that nothing is
unreadable. A fifth task runs `transact` steps of 100 keys and an index member each: after every
kill, each step's keys and member agree (the step is one log frame: all of it or none).
"""

from __future__ import annotations

import functools
import os
import random
import signal
from typing import TYPE_CHECKING

import pytest

from agenticstate import FileBackend
from tests.helpers import LineProcess
from tests.reliability._file_crash_worker import STEP_KEYS, STEP_SLOTS

if TYPE_CHECKING:
    from pathlib import Path

ROUNDS = 6


def ours(lines: list[str]) -> list[str]:
    """The worker's own lines (an unconfigured logger may print to stdout too)."""
    starts = ("child ", "open", "ack ", "batch ", "step ")
    return [line for line in list(lines) if line.startswith(starts)]


def has_lines(lines: list[str], count: int) -> bool:
    return len(ours(lines)) >= count


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def read_all(directory: Path) -> tuple[dict[str, int], dict[str, float]]:
    """Every key's number (a step's values carry padding after `|`), and the steps index."""
    async with FileBackend(base_path=directory, format="msgpack") as backend:
        keys = [key async for key in backend.scan("*")]
        entries = await backend.get_many(keys)
        stored = {
            key: int(entry.value.partition(b"|")[0])
            for key, entry in zip(keys, entries, strict=True)
            if entry
        }
        return stored, dict(await backend.index_range("steps"))


def check_steps(stored: dict[str, int], index: dict[str, float]) -> None:
    """Each slot's 100 keys hold one step's number, the one its index member holds."""
    for slot in range(STEP_SLOTS):
        values = {stored.get(f"t{slot}:{x}") for x in range(STEP_KEYS)}
        member = index.get(f"s{slot}")
        assert values == {None if member is None else int(member)}, (slot, values, member)


@pytest.mark.slow
async def test_kill_9_mid_batch_with_a_forked_child_loses_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    """6 kills of a process writing single keys and large batches, each with a forked child
    alive: the store reopens every time and no acknowledged write is lost or unreadable."""
    rng = random.Random(20261124)
    acked: dict[str, int] = {}
    start, batch_start, batches_acked, step_start, steps_acked = 0, 0, 0, 0, 0
    for round_ in range(ROUNDS):
        worker = LineProcess(
            "tests.reliability._file_crash_worker",
            str(tmp_path),
            str(round_),
            str(start),
            str(batch_start),
            str(step_start),
        )
        try:
            assert worker.wait_until(lambda lines: "open" in lines, 30), worker.close()
            child = int(next(x for x in worker.lines if x.startswith("child ")).split()[1])
            wanted = rng.randint(2, 100)
            worker.wait_until(functools.partial(has_lines, count=wanted + 2), timeout=30)
            worker.process.send_signal(signal.SIGKILL)
            worker.process.wait(timeout=30)
            for line in ours(worker.lines):
                kind, *numbers = line.split()
                if kind == "ack":
                    acked[f"k{int(numbers[0]) % 30}"] = int(numbers[0])
                elif kind == "batch":
                    batches_acked += 1
                    for i in range(int(numbers[1])):
                        acked[f"b{i}"] = int(numbers[0])
                elif kind == "step":
                    steps_acked += 1
                    j = int(numbers[0])
                    for x in range(STEP_KEYS):
                        acked[f"t{j % STEP_SLOTS}:{x}"] = j
            assert is_alive(child)
            stored, index = await read_all(tmp_path)  # reopens while the forked child lives
            assert is_alive(child)
        finally:
            worker.close()  # closes stdin: the child exits
        for key, value in acked.items():
            assert stored.get(key, -1) >= value, (round_, key, value, stored.get(key))
        check_steps(stored, index)
        step_start = max((int(score) for score in index.values()), default=-1) + 1
        start = max((v for k, v in stored.items() if k.startswith("k")), default=-1) + 1
        batch_start = max((v for k, v in stored.items() if k.startswith("b")), default=-1) + 1
    assert batches_acked >= 3  # the batch writer runs throughout: every kill lands in a batch
    assert steps_acked >= 3
