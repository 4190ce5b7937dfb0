"""What only the file backend promises: crash safety, one owner, readable snapshots."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from structlog.testing import capture_logs

import agenticstate.backends.file as file_module
from agenticstate import (
    BackendError,
    ConfigurationError,
    CorruptStoreError,
    FileBackend,
    NotFoundError,
    StateConfig,
    StateManager,
)
from agenticstate.backends import EARLIEST, ChangeOp, _file_io, open_backend
from tests.backends._file_writer import FEED

if TYPE_CHECKING:
    from collections.abc import Iterator

    from agenticstate.backends import Change, Entry

ROOT = Path(__file__).parent.parent.parent


def spawn_writer(directory: Path, start: int, *more: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.backends._file_writer", str(directory), str(start), *more],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


class ForkedWriters:
    """Writers forked by one `_file_writer --fork` process (see its docstring): each round of a
    crash test starts one, reads its acknowledgements, SIGKILLs it and reads the rest."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.backends._file_writer", "--fork"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        self.pid = 0

    def start(self, directory: Path, start: int, *more: str) -> None:
        """Fork a writer of `k{n % 40}` from `start` on (with history DEPTH `more`)."""
        self.stdin.write("\t".join([str(directory), str(start), *more]) + "\n")
        self.stdin.flush()
        line = self.stdout.readline()
        assert line.startswith("pid "), line
        self.pid = int(line.split()[1])

    def readline(self) -> str:
        return self.stdout.readline()

    def kill(self) -> list[str]:
        """SIGKILL the writer; the lines it printed before it died (all come before "reaped")."""
        os.kill(self.pid, signal.SIGKILL)
        self.stdin.write("reap\n")
        self.stdin.flush()
        lines: list[str] = []
        for line in self.stdout:
            if line == "reaped\n":
                return lines
            lines.append(line)
        raise AssertionError("the fork server ended")

    def close(self) -> None:
        self.stdin.close()
        self.process.wait(timeout=10)
        self.stdout.close()


@pytest.fixture
def writers() -> Iterator[ForkedWriters]:
    """A fork server of writer processes for the test."""
    writers = ForkedWriters()
    try:
        yield writers
    finally:
        writers.close()


async def read_all(directory: Path) -> dict[str, bytes]:
    async with FileBackend(base_path=directory, format="msgpack") as backend:
        keys = [key async for key in backend.scan("*")]
        entries = await backend.get_many(keys)
        return {key: entry.value for key, entry in zip(keys, entries, strict=True) if entry}


async def read_feed(directory: Path) -> tuple[list[Change], dict[str, list[Entry]]]:
    """Every change of a `k` key the store's feed holds, and their histories, as an opener
    sees them (the opener writes one key of its own, `end`, to mark where the replay ends)."""
    async with FileBackend(base_path=directory, format="msgpack", feed=FEED) as backend:
        changes: list[Change] = []
        async with backend.changes("*", since=EARLIEST) as stream:
            mark = await backend.set("end", b"")
            with anyio.fail_after(30):
                async for change in stream:
                    if change.cursor == mark.cursor:
                        break
                    if change.key != "end":
                        changes.append(change)
        histories = {f"k{k}": await backend.history(f"k{k}") for k in range(40)}
        return changes, histories


async def test_killed_writers_keep_an_exact_feed_and_history(
    tmp_path: Path, writers: ForkedWriters
) -> None:
    """Four concurrent writers with history SIGKILLed 25 times mid-stream: after each reopen the
    feed holds every acknowledged write once, in order per key (versions by one, each change's
    old value the previous one's new), and nothing else but the writes in flight (at most one
    per writer, the next it would make); what an earlier reopen saw is a prefix of what a later
    one sees; history is the feed's last three versions of each key."""
    rng = random.Random(20261126)
    acked: set[int] = set()
    start = 0
    previous: list[tuple[str, ChangeOp, bytes | None, bytes | None, int, str | None]] = []
    for _ in range(25):
        writers.start(tmp_path, start, "3")
        assert writers.readline().strip() == "open"
        this_round: set[int] = set()
        for _ in range(rng.randint(0, 80)):
            line = writers.readline()
            this_round.add(int(line.split()[1]))
        # SIGKILL, somewhere in the middle of the next write; acknowledged before: they count too
        for line in writers.kill():
            this_round.add(int(line.split()[1]))
        acked |= this_round
        changes, histories = await read_feed(tmp_path)
        facts = [(c.key, c.op, c.old, c.new, c.version, c.cursor) for c in changes]
        assert facts[: len(previous)] == previous  # nothing lost or rewritten by a reopen
        previous = facts
        cursors = [int((c.cursor or "").rsplit(":", 1)[1]) for c in changes]
        assert cursors == sorted(set(cursors))
        written = [int(c.new or b"") for c in changes]
        assert len(written) == len(set(written))  # each write once
        assert acked <= set(written)  # no acknowledged write lost
        # Beyond them, at most the write each writer had in flight: the next one it would make.
        for extra in set(written) - acked:
            lane = (extra - start) % 4
            lane_acked = [n for n in this_round if (n - start) % 4 == lane]
            assert extra == (max(lane_acked) + 4 if lane_acked else start + lane), (extra, start)
            acked.add(extra)  # in the log: later rounds must keep it
        by_key: dict[str, list[Change]] = {}
        for change in changes:
            assert change.op is ChangeOp.SET
            by_key.setdefault(change.key, []).append(change)
        for key, mine in by_key.items():
            assert [c.version for c in mine] == list(range(1, len(mine) + 1)), key
            assert [c.old for c in mine] == [None] + [c.new for c in mine[:-1]], key
            values = [int(c.new or b"") for c in mine]
            assert values == sorted(values), key
            assert [(e.version, e.value) for e in histories[key]] == [
                (c.version, c.new) for c in reversed(mine[-3:])
            ], key
        start = max(written, default=-1) + 1
    assert len(by_key) == 40


async def test_state_survives_close_and_reopen(tmp_path: Path) -> None:
    """Values, versions, timestamps and TTLs read back after the store is closed and reopened."""
    async with FileBackend(base_path=tmp_path) as backend:
        await backend.set("a", b"1")
        await backend.set("a", b"2")
        await backend.set("gone", b"x")
        await backend.delete("gone")
        first = await backend.get("a")
    async with FileBackend(base_path=tmp_path) as backend:
        again = await backend.get("a")
        assert await backend.get("gone") is None
        assert again == first
        change = await backend.set("a", b"3")
        assert change.version == 3


async def test_killed_writers_never_tear_or_lose_acknowledged_writes(
    tmp_path: Path, writers: ForkedWriters
) -> None:
    """A process of four concurrent writers SIGKILLed 100 times mid-stream: every key reads as its
    last acknowledged value or a later one, and nothing is ever unreadable."""
    rng = random.Random(20261122)
    acked: dict[str, int] = {}
    start = 0
    for _ in range(100):
        writers.start(tmp_path, start)
        assert writers.readline().strip() == "open"
        for _ in range(rng.randint(0, 120)):
            n = int(writers.readline().split()[1])
            acked[f"k{n % 40}"] = n
        # SIGKILL, somewhere in the middle of the next write. Acknowledgements already in the
        # pipe came before the kill: they count too.
        for line in writers.kill():
            n = int(line.split()[1])
            acked[f"k{n % 40}"] = n
        stored = await read_all(tmp_path)
        for key, n in acked.items():
            assert key in stored, key
            assert int(stored[key]) >= n, (key, stored[key], n)  # never older than acknowledged
        start = max((int(v) for v in stored.values()), default=-1) + 1
    assert len(acked) == 40


async def test_torn_tail_is_cut_and_earlier_records_kept(tmp_path: Path) -> None:
    """Garbage or a half record at the end of the log is dropped; everything before it stays."""
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        backend.compact_bytes = 1 << 40  # keep everything in the log
        await backend.set("a", b"1")
        await backend.set("b", b"2")
        backend._write_snapshot = _no_snapshot  # type: ignore[method-assign]  # crash before close
    log_path = tmp_path / "state.json.log"
    size = log_path.stat().st_size
    assert size > 0
    with log_path.open("ab") as handle:
        handle.write(b"\x00\x00\x01\x00garbage-half-record")
    with capture_logs() as logs:
        async with FileBackend(base_path=tmp_path) as backend:
            assert (await backend.get("a")) is not None
            entry = await backend.get("b")
            assert entry is not None
            assert entry.value == b"2"
    assert any(event["event"] == "file_store_torn_tail" for event in logs)


def _no_snapshot(
    entries: dict[str, Entry], indexes: dict[str, dict[str, float]], lsn: int, journal: object
) -> None:
    """Stands in for the snapshot writer: closing then leaves the log as a crash would."""


async def test_a_whole_frame_that_fails_its_checksum_is_refused(tmp_path: Path) -> None:
    """A whole last frame whose checksum does not match is damage, not a torn append: the store
    is refused with the log untouched (it used to be cut), and repair drops only that frame."""
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        await backend.set("a", b"first")
        backend._write_snapshot = _no_snapshot  # type: ignore[method-assign]
    log_path = tmp_path / "state.json.log"
    good = log_path.read_bytes()
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        backend._write_snapshot = _no_snapshot  # type: ignore[method-assign]
        await backend.set("a", b"second")
    data = bytearray(log_path.read_bytes())
    data[len(good) + 12] ^= 0xFF  # flip a byte inside the second record
    log_path.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match="fails its checksum"):
        await FileBackend(base_path=tmp_path).open()
    assert log_path.read_bytes() == bytes(data)
    await FileBackend(base_path=tmp_path).repair()
    async with FileBackend(base_path=tmp_path) as backend:
        entry = await backend.get("a")
        assert entry is not None
        assert entry.value == b"first"


async def test_stray_temp_files_are_removed(tmp_path: Path) -> None:
    """A temporary snapshot left by an interrupted write is removed on open."""
    stray = tmp_path / "state.json.4242.tmp"
    stray.write_text("half a snapshot")
    async with FileBackend(base_path=tmp_path):
        pass
    assert not stray.exists()


async def test_second_process_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    """While a process owns the store, another opener gets BackendError naming its pid."""
    writer = spawn_writer(tmp_path, 0)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "open"
        with pytest.raises(BackendError, match=f"process {writer.pid}"):
            await FileBackend(base_path=tmp_path, format="msgpack").open()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
        assert writer.stdout is not None
        writer.stdout.close()
    # The killed holder's lock died with it: the store can be taken over.
    stored = await read_all(tmp_path)
    assert all(int(value) >= 0 for value in stored.values())


async def test_same_process_cannot_open_twice(tmp_path: Path) -> None:
    """Two backends on one store in one process conflict too."""
    async with FileBackend(base_path=tmp_path):
        with pytest.raises(BackendError, match="in use"):
            await FileBackend(base_path=tmp_path).open()


@pytest.mark.parametrize("key", ["../../etc/passwd", "/abs/path", "..", ".", "a/../../b", "ü/../x"])
async def test_keys_never_become_paths(tmp_path: Path, key: str) -> None:
    """Hostile keys are stored inside the store's files; nothing is written anywhere else."""
    store = tmp_path / "deep" / "store"
    async with FileBackend(base_path=store) as backend:
        await backend.set(key, b"x")
        await backend.flush()
        entry = await backend.get(key)
        assert entry is not None
    outside = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))  # noqa: ASYNC240
    assert outside == sorted(
        [
            "deep",
            "deep/store",
            "deep/store/state.json",
            "deep/store/state.json.log",
            "deep/store/state.json.lock",
        ]
    )


FAILING_AGENT = Path(__file__).with_name("_failing_fsync_agent.py")


@pytest.mark.parametrize(("name", "message"), [("ENOSPC", "disk is full"), ("EIO", "EIO")])
async def test_failed_fsync_raises_and_keeps_the_previous_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, message: str
) -> None:
    """An fsync that fails (injected: full disk, I/O error) raises a typed error naming it; the
    old value stays, later writes work, and the failed write never comes back after reopen."""
    async with FileBackend(base_path=tmp_path) as backend:
        await backend.set("k", b"old")
    monkeypatch.setattr(FileBackend, "_agent_script", FAILING_AGENT)
    monkeypatch.setenv("AGENTICSTATE_TEST_FSYNC_ERRNO", name)
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        with pytest.raises(BackendError, match=message):
            await backend.set("k", b"new")
        entry = await backend.get("k")
        assert entry is not None
        assert (entry.value, entry.version) == (b"old", 1)
        change = await backend.set("k", b"newer")
        assert change.version == 2
        backend._write_snapshot = _no_snapshot  # type: ignore[method-assign]  # keep the log
    monkeypatch.undo()
    async with FileBackend(base_path=tmp_path) as backend:
        entry = await backend.get("k")
        assert entry is not None
        assert (entry.value, entry.version) == (b"newer", 2)


async def test_failed_fsync_fails_every_write_queued_behind_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes staged while a failing fsync ran fail with it (they may build on it); none of them
    is applied, and the store keeps working."""
    monkeypatch.setattr(FileBackend, "_agent_script", FAILING_AGENT)
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        results: list[object] = []

        async def write(n: int) -> None:
            try:
                results.append(await backend.update(f"k{n % 3}", lambda e: b"%d" % n))
            except BackendError as exc:
                results.append(exc)

        async with anyio.create_task_group() as tg:
            for n in range(30):
                tg.start_soon(write, n)
        failed = [r for r in results if isinstance(r, BackendError)]
        assert failed  # the first batch at least
        assert len(results) == 30
        entries = [await backend.get(key) for key in ("k0", "k1", "k2")]
        versions = {entry.key: entry.version for entry in entries if entry is not None}
        saved = [r for r in results if not isinstance(r, BackendError)]
        # Versions count exactly the writes that succeeded: failed ones left no trace.
        assert sum(versions.values()) == len(saved)


async def test_io_error_on_write_is_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An injected EIO while appending raises BackendError and changes nothing."""
    async with FileBackend(base_path=tmp_path) as backend:
        await backend.set("k", b"old")

        def broken(fd: int, data: bytes) -> None:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(_file_io, "write_all", broken)
        with pytest.raises(BackendError, match="EIO"):
            await backend.set("k", b"new")
        monkeypatch.undo()
        entry = await backend.get("k")
        assert entry is not None
        assert entry.value == b"old"
        assert (await backend.set("k", b"again")).version == 2


async def test_killed_fsync_agent_fails_writes_and_loses_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    """If the fsync agent dies, waiting and later writes fail with a clear error, and what was
    acknowledged before reads back after reopening."""
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        await backend.set("k", b"kept")
        agent = backend._commit_log.agent
        assert agent is not None
        agent.process.kill()

        async def write_until_refused() -> None:
            while True:  # the first write may be appended before the agent's death is noticed
                await backend.set("k", b"lost")

        with anyio.fail_after(10), pytest.raises(BackendError, match="fsync agent"):
            await write_until_refused()
        with pytest.raises(BackendError, match="reopen"):
            await backend.set("other", b"x")
    async with FileBackend(base_path=tmp_path) as backend:
        entry = await backend.get("k")
        assert entry is not None
        assert entry.value == b"kept"
        assert await backend.get("other") is None


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs: a real filesystem that really fills up (needs root, as CI has)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if os.geteuid() != 0 or mount is None or umount is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    subprocess.run([mount, "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run([umount, "-l", str(mount_point)], check=True)


async def test_real_full_disk_raises_and_keeps_acknowledged_writes(tiny_disk: Path) -> None:
    """On a filesystem that runs out of space, writes fail with "disk is full", every value
    acknowledged before stays readable (also after reopening), and writing works again once
    space is freed."""
    ballast = tiny_disk / "ballast"
    acked: dict[str, bytes] = {}
    async with FileBackend(base_path=tiny_disk / "store", auto_save=False) as backend:
        ballast.write_bytes(b"\0" * 300_000)

        async def fill() -> None:
            for n in range(10_000):
                value = b"%06d" % n * 200
                await backend.set(f"k{n % 20}", value)
                acked[f"k{n % 20}"] = value

        with pytest.raises(BackendError, match="disk is full"):
            await fill()
        for key, value in acked.items():
            entry = await backend.get(key)
            assert entry is not None
            assert entry.value == value
        ballast.unlink()
        await backend.set("after", b"space again")
        acked["after"] = b"space again"
    async with FileBackend(base_path=tiny_disk / "store") as backend:
        for key, value in acked.items():
            entry = await backend.get(key)
            assert entry is not None
            assert entry.value == value


async def test_json_snapshot_is_readable(tmp_path: Path) -> None:
    """With format="json" the snapshot is plain JSON showing the values themselves."""
    config = StateConfig(
        backend="file", file_path=tmp_path / "state" / "app_state.json", auto_save=True
    )
    async with StateManager(config=config) as state:
        await state.save("agent:researcher", {"status": "running", "progress": 0.45})
    snapshot = json.loads((tmp_path / "state" / "app_state.json").read_text())
    item = snapshot["entries"]["agent:researcher"]
    assert item["json"] == {"status": "running", "progress": 0.45}
    assert item["version"] == 1
    async with StateManager(config=config) as state:
        assert await state.get("agent:researcher") == {"status": "running", "progress": 0.45}


@pytest.mark.parametrize(
    ("fmt", "compression"), [("msgpack", False), ("msgpack", True), ("json", True)]
)
async def test_formats_and_compression_round_trip(
    tmp_path: Path, fmt: Any, compression: bool
) -> None:
    """msgpack and compressed snapshots read back exactly; they are not plain JSON."""
    value = b"\x01" + b"abc" * 400
    async with FileBackend(base_path=tmp_path, format=fmt, compression=compression) as backend:
        await backend.set("k", value)
    raw = (tmp_path / f"state.{fmt}").read_bytes()  # a test reading a file
    if compression:
        assert zlib.decompress(raw)
    else:
        with pytest.raises(ValueError, match=r"."):
            json.loads(raw)
    async with FileBackend(base_path=tmp_path, format=fmt, compression=compression) as backend:
        entry = await backend.get("k")
        assert entry is not None
        assert entry.value == value


async def test_corrupt_snapshot_refuses_to_open(tmp_path: Path) -> None:
    """A damaged snapshot is a typed error, never a silent fresh start."""
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(BackendError, match="corrupt"):
        await FileBackend(base_path=tmp_path).open()


async def test_durability_none_persists_on_close(tmp_path: Path) -> None:
    """Without fsync, writes still persist across a clean close."""
    async with (
        FileBackend(base_path=tmp_path, format="msgpack", durability="none") as backend,
        anyio.create_task_group() as tg,
    ):
        for n in range(50):
            tg.start_soon(backend.set, f"k{n}", b"v")
    assert len(await read_all(tmp_path)) == 50


async def test_concurrent_writers_share_fsyncs(tmp_path: Path) -> None:
    """50 concurrent durable writes need far fewer than 50 fsyncs (group commit)."""
    async with FileBackend(base_path=tmp_path, format="msgpack", auto_save=False) as backend:
        async with anyio.create_task_group() as tg:
            for n in range(50):
                tg.start_soon(backend.set, f"k{n}", b"v")
        stats = backend.stats()
    assert 1 <= stats["fsyncs"] <= 10
    assert stats["batches"] <= 10
    assert len(await read_all(tmp_path)) == 50


async def test_bad_options_are_refused(tmp_path: Path) -> None:
    """Unknown formats, durability modes and file names raise ConfigurationError."""
    from agenticstate import ConfigurationError

    for options in ({"format": "xml"}, {"durability": "maybe"}, {"file_name": "../x"}):
        with pytest.raises(ConfigurationError):
            FileBackend(base_path=tmp_path, **options)  # type: ignore[arg-type]


async def test_indexes_survive_reopen_from_log_and_snapshot(tmp_path: Path) -> None:
    """Sorted indexes come back after a crash (from the log) and after a clean close (snapshot)."""
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        await backend.index_add("q", {"a": 2, "b": 1, "c": 3})
        await backend.index_remove("q", ["c"])
        backend._write_snapshot = _no_snapshot  # type: ignore[method-assign]  # crash: log only
    async with FileBackend(base_path=tmp_path) as backend:
        assert await backend.index_range("q") == [("b", 1.0), ("a", 2.0)]
        await backend.index_add("q", {"d": 0})
    async with FileBackend(base_path=tmp_path) as backend:
        assert [m for m, _ in await backend.index_range("q")] == ["d", "b", "a"]


async def test_cancelling_one_waiter_leaves_the_others_waiting(tmp_path: Path) -> None:
    """Writers share one wait per batch; cancelling one of them neither wakes nor fails the
    others, and the cancelled write's outcome is simply not reported to it."""
    async with FileBackend(base_path=tmp_path, auto_save=False) as backend:
        results: dict[int, int] = {}

        async def write(n: int) -> None:
            results[n] = (await backend.set(f"k{n}", b"v")).version

        async with anyio.create_task_group() as tg:
            for n in range(20):
                tg.start_soon(write, n)
            async with anyio.create_task_group() as victim:
                victim.start_soon(write, 99)
                await anyio.lowlevel.checkpoint()  # it is staged and waiting now
                victim.cancel_scope.cancel()
        assert results == dict.fromkeys(range(20), 1)


async def test_many_waiters_and_cancellation_on_the_shared_event() -> None:
    """The asyncio event behind batches wakes every waiter once set, and a waiter cancelled
    while others wait does not take them down with it."""
    from agenticstate._tasks import event_factory

    event = event_factory()()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await event.wait()
        woken.append(n)

    async with anyio.create_task_group() as tg:
        for n in range(5):
            tg.start_soon(waiter, n)
        async with anyio.create_task_group() as victim:
            victim.start_soon(waiter, 99)
            await anyio.lowlevel.checkpoint()
            victim.cancel_scope.cancel()
        await anyio.lowlevel.checkpoint()
        assert woken == []
        event.set()
    assert sorted(woken) == [0, 1, 2, 3, 4]


async def test_a_large_batch_spans_frames_and_all_of_it_is_durable(tmp_path: Path) -> None:
    """set_many with more writes than fit one frame returns once every frame is synced."""
    async with FileBackend(base_path=tmp_path, format="msgpack", auto_save=False) as backend:
        changes = await backend.set_many([(f"k{n}", b"%d" % n) for n in range(2000)])
        assert [change.version for change in changes] == [1] * 2000
        assert backend.stats()["batches"] >= 2000 // file_module._STAGE_CHUNK
        backend._write_snapshot = _no_snapshot  # type: ignore[method-assign]  # log only
    assert len(await read_all(tmp_path)) == 2000


async def test_closing_after_only_reads_leaves_the_snapshot_alone(tmp_path: Path) -> None:
    """A session that wrote nothing does not rewrite the snapshot on close (a read-only command
    on a large store must not pay for it); one that wrote does."""
    async with FileBackend(base_path=tmp_path) as backend:
        await backend.set("k", b"v")
    snapshot = tmp_path / "state.json"
    before = snapshot.stat()
    async with FileBackend(base_path=tmp_path) as backend:
        assert await backend.get("k") is not None
        assert [key async for key in backend.scan("*")] == ["k"]
        stats = backend.stats()
    after = snapshot.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert stats["snapshots"] == 0
    async with FileBackend(base_path=tmp_path) as backend:
        await backend.set("k", b"w")
    assert snapshot.stat().st_ino != before.st_ino  # replaced by a new snapshot


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_a_store_that_is_only_read_lets_go_of_expired_entries(
    tmp_path: Path, kind: str
) -> None:
    """Expired entries leave memory on scans and batch reads, not only on the next write."""
    from datetime import timedelta

    from agenticstate import MemoryBackend

    backend = MemoryBackend() if kind == "memory" else FileBackend(base_path=tmp_path)
    async with backend:
        await backend.set_many(
            [(f"k{n}", b"v") for n in range(50)], ttl=timedelta(milliseconds=600)
        )
        await backend.set("stays", b"v")
        assert len(backend._local.data) == 51  # (a loaded machine needs the 600 ms margin)
        await anyio.sleep(0.7)  # expiry is wall-clock time: wait for the time itself
        assert [key async for key in backend.scan("stays")] == ["stays"]
        assert len(backend._local.data) == 1


async def test_create_false_opens_only_a_store_that_exists(tmp_path: Path) -> None:
    """With create=False (also open_backend(url, create=False)) a missing store raises
    NotFoundError and nothing is made, not even the directory; an existing one opens."""
    missing = tmp_path / "a" / "b"
    for backend in (
        FileBackend(base_path=missing, create=False),
        open_backend(f"file://{missing}", create=False),
        open_backend(f"file://{missing}?feed=off", create=False),
    ):
        with pytest.raises(NotFoundError, match="no file store"):
            await backend.open()
        await backend.aclose()
    assert not os.listdir(tmp_path)
    async with FileBackend(base_path=missing) as made:
        await made.set("k", b"\x011")
    async with open_backend(f"file://{missing}", create=False) as backend:
        assert await backend.get("k") is not None
    with pytest.raises(ConfigurationError):
        FileBackend(base_path=missing, create="no")  # type: ignore[arg-type]


def test_open_backend_passes_create_only_to_factories_that_take_it() -> None:
    """create=False reaches the file backend (and any factory with a create parameter); memory
    and Redis, with nothing to create, are built as before."""
    from agenticstate._registry import takes_create, url_factory

    found = {scheme: takes_create(url_factory(scheme)) for scheme in ("file", "memory", "redis")}  # type: ignore[arg-type]
    assert found == {"file": True, "memory": False, "redis": False}
    assert open_backend("memory://", create=False) is not None
    assert open_backend("redis://localhost:1/0", create=False) is not None
