"""What an export or a store does with every kind of file at its destination.

Every kind of destination (missing, a regular file, a symlink to one, a dangling symlink, a
FIFO with and without a reader, a character device, a socket, a directory) x export, a SQLite
store and a file store's snapshot: a regular file is replaced atomically, a symlink is followed
and stays a symlink, a FIFO or a device is written through by an export and refused by a store,
and nothing is ever replaced by a regular file silently.
"""

from __future__ import annotations

import json
import os
import select
import socket
import stat
import threading
from typing import TYPE_CHECKING

import pytest

from agenticstate import ConfigurationError, FileBackend, MemoryBackend, SQLiteBackend
from agenticstate.transfer import export_state

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

KINDS = [
    "missing",
    "regular",
    "symlink",
    "dangling symlink",
    "fifo with a reader",
    "fifo",
    "char device",
    "socket",
    "directory",
]


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    for test, name in (
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISCHR, "char device"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISREG, "regular"),
    ):
        if test(mode):
            return name
    return "other"


class Destinations:
    """Makes destinations of each kind; `finish` waits for FIFO readers and closes sockets."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self.read: dict[str, bytes] = {}

    def __call__(self, kind: str, path: Path) -> None:
        if kind == "regular":
            path.write_text("old")
        elif kind in ("symlink", "dangling symlink"):
            real = path.parent / f"real-{path.name}"
            if kind == "symlink":
                real.write_text("old")
            os.symlink(real, path)
        elif kind.startswith("fifo"):
            os.mkfifo(path)
            if kind == "fifo with a reader":
                self._reader(path)
        elif kind == "char device":
            if os.geteuid() != 0:
                pytest.skip("creating a device needs root")
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # like /dev/null
        elif kind == "socket":
            server = socket.socket(socket.AF_UNIX)
            server.bind(str(path))
            self.sockets.append(server)
        elif kind == "directory":
            path.mkdir()

    def _reader(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a reader from now on
        os.set_blocking(fd, True)

        def drain() -> None:
            # Linux's poll waits for a FIFO's first writer (no hang-up before one).
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(30_000)
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            self.read[str(path)] = b"".join(chunks)
            os.close(fd)

        thread = threading.Thread(target=drain)
        thread.start()
        self.threads.append(thread)

    def finish(self) -> None:
        for thread in self.threads:
            thread.join(timeout=30)
        for server in self.sockets:
            server.close()


@pytest.fixture
def make() -> Iterator[Destinations]:
    """A `Destinations`, finished after the test."""
    destinations = Destinations()
    yield destinations
    destinations.finish()


@pytest.mark.parametrize("kind", KINDS)
async def test_export_to_every_kind_of_destination(
    kind: str, make: Destinations, tmp_path: Path
) -> None:
    """An export replaces a regular file, follows a symlink, writes through a FIFO or a device."""
    target = tmp_path / "dump.jsonl"
    make(kind, target)
    async with MemoryBackend() as store:
        await store.set("k", b"v")
        if kind in ("fifo", "socket", "directory"):
            with pytest.raises(OSError):  # noqa: PT011  # ENXIO, ENXIO, EISDIR
                await export_state(store, target)
        else:
            done = await export_state(store, target)
            assert done.entries == 1
    expected = {"missing": "regular", "dangling symlink": "symlink", "fifo with a reader": "fifo"}
    assert _kind(target) == expected.get(kind, kind)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".partial")]
    if kind in ("missing", "regular", "symlink", "dangling symlink"):
        lines = target.read_text().splitlines()  # through the link: the file it names
        assert json.loads(lines[-1]) == {"type": "end", "entries": 1, "indexes": 0}
    if kind == "fifo with a reader":
        make.finish()
        lines = make.read[str(target)].decode().splitlines()
        assert json.loads(lines[-1]) == {"type": "end", "entries": 1, "indexes": 0}


@pytest.mark.parametrize("kind", ["fifo", "char device", "socket", "directory"])
async def test_a_store_refuses_a_file_that_is_not_regular(
    kind: str, make: Destinations, tmp_path: Path
) -> None:
    """A SQLite store or a file store's snapshot that is not a regular file is refused, as it is."""
    make(kind, tmp_path / "s.db")
    with pytest.raises(ConfigurationError):
        async with SQLiteBackend(tmp_path / "s.db"):
            pass
    assert _kind(tmp_path / "s.db") == kind
    (tmp_path / "files").mkdir()
    make(kind, tmp_path / "files" / "state.json")
    with pytest.raises(ConfigurationError):
        async with FileBackend(tmp_path / "files"):
            pass
    assert _kind(tmp_path / "files" / "state.json") == kind
