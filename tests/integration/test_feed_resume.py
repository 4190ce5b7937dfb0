"""A consumer process killed 5 times during 10,000 writes from 4 writer processes, restarting
each time from its last stored cursor, sees every change exactly once per key, in version order
(issue #23, point 2). The processes are `tests/integration/_feed_proc.py`."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import pytest

from agenticstate import open_backend
from agenticstate.backends import EARLIEST
from tests.helpers import LineProcess, unique_prefix
from tests.integration._feed_proc import KEYS, RETENTION

if TYPE_CHECKING:
    from pathlib import Path

WRITERS = 4
WRITES = 10_000  # in all, over the writers
CHUNKS = 6  # the writers write in chunks; the consumer is killed during each of the first 5
KILLS = 5
WAIT = 60.0  # seconds any one step may take before the test fails

KINDS = [
    "sqlite",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("redis-cluster", marks=pytest.mark.redis),
]


def feed_url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite://{tmp_path / 'state.db'}?synchronous=normal"
    return str(
        request.getfixturevalue("redis_cluster_url" if kind == "redis-cluster" else "redis_url")
    )


def Proc(*args: str) -> LineProcess:  # noqa: N802  # reads like the class it makes
    return LineProcess("tests.integration._feed_proc", *args)


def go(proc: LineProcess) -> None:
    assert proc.process.stdin is not None
    proc.process.stdin.write("go\n")
    proc.process.stdin.flush()


def resume_point(path: Path) -> str:
    """The cursor on the file's last complete line (a torn last line is cut off)."""
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        path.write_bytes(whole)  # the next consumer appends after the last whole line
    if not whole:
        return EARLIEST
    return whole.decode().splitlines()[-1].split(" ", 2)[2]


class LineCount:
    """The complete lines of a file only appended to, counted as it grows (each call reads
    only what was added since the last)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.read = 0
        self.lines = 0

    def __call__(self) -> int:
        with self.path.open("rb") as file:
            file.seek(self.read)
            added = file.read()
        self.read += len(added)
        self.lines += added.count(b"\n")
        return self.lines


@pytest.mark.parametrize("kind", KINDS)
async def test_a_killed_consumer_resumes_without_gap_or_duplicate(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """4 writer processes make 10,000 set/update writes on 40 shared keys; a consumer process
    reading changes("*", since=...) from EARLIEST logs "key version cursor" lines and is
    SIGKILLed 5 times while they write, each time restarted from the last complete line's
    cursor. In the end, for every key, the versions logged are exactly 1..final, in order."""
    url, prefix = feed_url(kind, request, tmp_path), unique_prefix()
    seen = tmp_path / "seen.txt"
    seen.touch()
    writers = [
        Proc("writer", url, prefix, str(n), str(WRITES // WRITERS), str(CHUNKS))
        for n in range(WRITERS)
    ]
    consumer = Proc("consumer", url, prefix, str(seen), EARLIEST)
    mid_write_kills = 0
    try:
        for proc in [*writers, consumer]:
            assert proc.wait_until(lambda lines: "ready" in lines, WAIT), proc.close()
        for chunk in range(CHUNKS):
            for proc in writers:
                go(proc)
            if chunk >= KILLS:
                continue
            # Some lines of this life, then SIGKILL (mid-write, mid-line: anywhere).
            assert consumer.wait_lines(len(consumer.lines) + 100, WAIT), consumer.close()
            consumer.kill()
            mid_write_kills += any(f"chunk {chunk}" not in proc.lines for proc in writers)
            consumer = Proc("consumer", url, prefix, str(seen), resume_point(seen))
            assert consumer.wait_until(lambda lines: "ready" in lines, WAIT), consumer.close()
        for proc in writers:
            assert proc.wait_until(lambda lines: "done" in lines, WAIT), proc.close()
        # Every write made, the last consumer catches up: WRITES lines in the file, counted
        # there as each line is printed. (Not from the lines printed: they reach this process
        # through a pipe and a reader thread, behind the file, so a count made from them
        # stopped the consumer before its last lines were written.)
        logged = LineCount(seen)
        caught_up = consumer.wait_until(lambda _: logged() >= WRITES, WAIT)
    finally:
        for proc in [*writers, consumer]:
            proc.kill()
    async with open_backend(url, key_prefix=prefix, feed=RETENTION) as backend:
        final = {
            key: entry.version
            for key, entry in zip(
                [f"k{n}" for n in range(KEYS)],
                await backend.get_many([f"k{n}" for n in range(KEYS)]),
                strict=True,
            )
            if entry is not None
        }
    versions: dict[str, list[int]] = defaultdict(list)
    for line in seen.read_text().splitlines():
        key, version, _ = line.split(" ", 2)
        versions[key].append(int(version))
    assert sum(final.values()) == WRITES
    gaps_or_duplicates = {
        key: got for key, got in versions.items() if got != list(range(1, final.get(key, 0) + 1))
    }
    assert gaps_or_duplicates == {}
    assert caught_up, consumer.close()
    assert set(versions) == set(final)
    assert mid_write_kills >= 1, "the writers finished each chunk before the consumer died"
