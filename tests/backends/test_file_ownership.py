"""A deleted or replaced lock file: the owner stops writing, and nothing acknowledged is lost.

Deleting a store's `.lock` lets a second process lock a new file and open the store beside its
owner. Each scenario drives two real owner processes (`_file_commander`) through writes and
closes in a set order around the deletion, then reopens the store: every write either process
acknowledged must be there, and the owner that lost its lock says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate.backends import FileBackend
from tests.helpers import LineProcess

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


class Owner:
    """One `_file_commander` process: send a command, wait for its one-line answer."""

    def __init__(self, directory: Path, durability: str) -> None:
        self.process = LineProcess("tests.backends._file_commander", str(directory), durability)
        assert self.process.wait_lines(1, timeout=60), self.process.close()
        self.opened = self.process.lines[0]

    def send(self, command: str) -> str:
        count = len(self.process.lines)
        stdin = self.process.process.stdin
        assert stdin is not None
        stdin.write(command + "\n")
        stdin.flush()
        assert self.process.wait_lines(count + 1, timeout=60), self.process.close()
        return self.process.lines[count]


@pytest.fixture
def owners(tmp_path: Path) -> Iterator[dict[str, Owner]]:
    started: dict[str, Owner] = {}
    yield started
    for owner in started.values():
        owner.process.kill()


# Each step: "P1 set KEY", "P1 close", "open P2" or "delete lock".
SCENARIOS = {
    # The trial's case: both write after the deletion, then both close.
    "both-write-then-both-close": [
        "open P1", "P1 set a", "delete lock", "open P2", "P2 set b", "P1 set c",
        "P2 close", "P1 close",
    ],
    # The second owner compacts and empties the log before the first writes again.
    "second-closes-first": [
        "open P1", "P1 set a", "delete lock", "open P2", "P2 set b", "P2 close",
        "P1 set c", "P1 close",
    ],
    # The first owner closes (its final snapshot) while the second is still open.
    "first-closes-first": [
        "open P1", "P1 set a", "delete lock", "open P2", "P2 set b", "P1 close",
        "P2 set d", "P2 close",
    ],
    # Nobody else came: the owner still stops, since anyone could have.
    "deleted-only": ["open P1", "P1 set a", "delete lock", "P1 set b", "P1 close"],
}  # fmt: skip


async def _stored(directory: Path) -> dict[str, bytes]:
    async with FileBackend(base_path=directory) as backend:
        keys = [key async for key in backend.scan("*")]
        return {e.key: e.value for e in await backend.get_many(keys) if e is not None}


CASES = [
    *(pytest.param(name, "fsync", id=f"{name}-fsync") for name in SCENARIOS),
    # Without fsync the lock file is looked up at most every 10 ms; the log's size, which the
    # second owner changes, is checked on every frame.
    *(pytest.param(name, "none", id=f"{name}-none") for name in SCENARIOS if "only" not in name),
]


@pytest.mark.parametrize(("name", "durability"), CASES)
def test_a_deleted_lock_file_never_loses_an_acknowledged_write(
    tmp_path: Path, owners: dict[str, Owner], name: str, durability: str
) -> None:
    """Two owners after the lock file is deleted: every acknowledged write survives both
    closes, and the first owner refuses to go on writing, saying its lock file went away."""
    acknowledged: dict[str, bytes] = {}
    deleted = False
    for step in SCENARIOS[name]:
        words = step.split()
        if words[0] == "open":
            owners[words[1]] = Owner(tmp_path, durability)
            assert owners[words[1]].opened == "open"
        elif words[0] == "delete":
            (tmp_path / "state.json.lock").unlink()
            deleted = True
        elif words[1] == "set":
            answer = owners[words[0]].send(f"set {words[2]} {words[0]}")
            if words[0] == "P1" and deleted:
                # The first owner's lock file is gone: it must not acknowledge anything more.
                assert answer.startswith(f"error {words[2]} "), answer
                assert "the lock file" in answer or "changed by another process" in answer
                assert "stops writing" in answer
            else:
                assert answer == f"ok {words[2]}"
                acknowledged[words[2]] = b"\x02" + f'"{words[0]}"'.encode()
        else:
            assert owners[words[0]].send("close") == "closed"
    stored = anyio.run(_stored, tmp_path)
    for key, value in acknowledged.items():
        assert stored.get(key) == value, (key, stored)


def _act(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "replace":
        replacement = path.with_name(path.name + ".new")
        replacement.write_bytes(b"")
        replacement.replace(path)
    else:  # moved away, as logrotate does
        path.rename(path.with_name(path.name + ".1"))


@pytest.mark.parametrize("how", ["delete", "replace", "move"])
@pytest.mark.parametrize("name", ["state.json.log", "state.json.lock"])
def test_a_store_file_gone_from_its_path_acknowledges_nothing_lost(
    tmp_path: Path, owners: dict[str, Owner], name: str, how: str
) -> None:
    """A log or lock file deleted, replaced or moved under its owner: the next write is refused
    (naming the file), never acknowledged and then lost when the owner crashes."""
    owners["P1"] = Owner(tmp_path, "fsync")
    assert owners["P1"].send("set a P1") == "ok a"
    _act(tmp_path / name, how)
    answer = owners["P1"].send("set b P1")
    owners["P1"].process.kill()  # a crash after the answer
    if answer == "ok b":
        assert anyio.run(_stored, tmp_path).get("b") == b'\x02"P1"', "acknowledged, then lost"
    else:
        assert answer.startswith("error b "), answer
        assert name in answer, answer
