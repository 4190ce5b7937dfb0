"""Several real processes on one PostgreSQL store: atomic updates, the change feed in commit
order, clients SIGKILLed inside a transaction, and the server restarted (`pg_ctl restart -m
immediate`) under writers and a subscriber.

Each test gets a store of its own (a fresh Postgres schema on the session's cluster); the
restart test gets a cluster of its own, so restarting it disturbs no other test.
"""

from __future__ import annotations

import json
import random
import subprocess
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

import anyio
import psycopg
import pytest

from agenticstate import PostgresBackend, StateConfig, StateManager
from agenticstate.backends import EARLIEST
from tests._postgres_server import PostgresServer, _as_server_user, binary, require_postgres
from tests.helpers import LineProcess

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.postgres

WAIT = 120.0  # seconds a process may take to reach a line, on a loaded 2-core machine


def Proc(*args: str) -> LineProcess:  # noqa: N802  # reads like the class it makes
    return LineProcess("tests.integration._postgres_proc", *args)


def ready(proc: LineProcess) -> str:
    assert proc.wait_until(lambda lines: any(x.startswith("ready") for x in lines), WAIT), (
        proc.errors
    )
    return next(x for x in proc.lines if x.startswith("ready"))


def go(proc: LineProcess) -> None:
    assert proc.process.stdin is not None
    proc.process.stdin.write("go\n")
    proc.process.stdin.flush()


def received(proc: LineProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.lines if line.startswith("{")]


def with_schema(url: str, schema: str, **params: str) -> str:
    extra = "".join(f"&{name}={value}" for name, value in params.items())
    return f"{url}{'&' if '?' in url else '?'}schema={schema}{extra}"


@pytest.fixture
def store(postgres_url: str) -> Iterator[str]:
    """A URL naming a fresh schema of the session's cluster (dropped at the end)."""
    schema = f"p{uuid.uuid4().hex[:16]}"
    yield with_schema(postgres_url, schema)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'.encode())


def schema_of(url: str) -> str:
    return url.rsplit("schema=", 1)[1].split("&", 1)[0]


def base_of(url: str) -> str:
    return url.rsplit("&schema=", 1)[0] if "&schema=" in url else url.rsplit("?schema=", 1)[0]


# ------------------------------------------------------------------ atomic updates


async def test_four_processes_update_one_key_to_exactly_1000(store: str) -> None:
    """update(fn) from 4 processes x 250 on one key gives exactly 1,000 (and version 1,000)."""
    procs = [Proc("update", store, "app:", "250") for _ in range(4)]
    try:
        for proc in procs:
            ready(proc)
        for proc in procs:  # start them together
            go(proc)
        for proc in procs:
            assert proc.wait_until(lambda lines: "done" in lines, 300), proc.errors
    finally:
        for proc in procs:
            proc.stop()
    config = StateConfig(backend="postgres", postgres_url=store, key_prefix="app:")
    async with StateManager(config) as state:
        entry = await state.get_entry("counter")
    assert entry is not None
    assert (entry.value, entry.version) == (1000, 1000)


# ------------------------------------------------------------------ the feed across processes


def check_chain(changes: list[dict[str, Any]]) -> None:
    """Each change's old value is the new value of the key's change before it (None first)."""
    last: dict[str, str | None] = {}
    for change in changes:
        assert change["old"] == last.get(change["key"]), change
        last[change["key"]] = change["new"]


async def test_subscriber_in_another_process_sees_200_changes_in_commit_order(store: str) -> None:
    """3 writer processes make 200 sets, updates and deletes of ten shared keys at once; a
    subscriber process receives each once, in commit (revision) order, with its exact old value,
    as the store's feed lists them."""
    subscriber = Proc("subscribe", store, "app:", "200")
    writers = [
        Proc("mixed", store, "app:", name, count)
        for name, count in [("a", "70"), ("b", "70"), ("c", "60")]
    ]
    try:
        start = ready(subscriber).split()[1]
        for proc in writers:
            ready(proc)
        for proc in writers:
            go(proc)
        for proc in writers:
            assert proc.wait_until(lambda lines: "done" in lines, WAIT), proc.errors
        assert subscriber.wait_until(lambda lines: len(lines) >= 201, WAIT), subscriber.errors
    finally:
        subscriber.stop()
        for proc in writers:
            proc.stop()
    made = []
    async with PostgresBackend.from_url(store, key_prefix="app:") as backend:
        async with backend.changes("*", since=start) as stream:
            with anyio.fail_after(WAIT):
                async for change in stream:
                    made.append(change)
                    if len(made) == 200:
                        break
        assert await backend.feed_cursor() == made[-1].cursor, "200 changes, no more"
    lines = received(subscriber)
    assert lines == [
        {
            "seq": change.revision,
            "key": change.key,
            "op": change.op.value,
            "old": change.old.hex() if change.old is not None else None,
            "new": change.new.hex() if change.new is not None else None,
            "version": change.version,
        }
        for change in made
    ]
    seqs = [line["seq"] for line in lines]
    assert seqs == list(range(seqs[0], seqs[0] + 200)), "revisions in order, without gaps"
    check_chain(lines)
    assert {line["key"][0] for line in lines} == {"k"}
    assert len({line["new"] for line in lines if line["new"] is not None}) > 100


# ------------------------------------------------------------------ clients killed mid-transaction


async def wait_for_sql(url: str, sql: str, params: tuple[Any, ...] = ()) -> None:
    """Wait (polling the server's views, 120 s at most) until `sql` returns a row."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        with anyio.fail_after(WAIT):
            while (await (await conn.execute(sql.encode(), params)).fetchone()) is None:  # noqa: ASYNC110  # the server's views send no event
                await anyio.sleep(0.02)


async def test_client_killed_inside_a_transaction_leaves_nothing_of_it(store: str) -> None:
    """A process SIGKILLed inside `transact`, after 5 of its 10 Puts ran and while the 6th
    waits on a row lock: none of its writes, feed rows, index members or revisions appear, and
    the next write takes the head lock and the next revision."""
    base, schema = base_of(store), schema_of(store)
    async with PostgresBackend.from_url(store, key_prefix="app:") as backend:
        for n in range(10):
            await backend.set(f"k{n}", b"old")
        before = await backend.feed_cursor()
        victim = Proc(
            "transact", with_schema(base, schema, application_name="victim"), "app:", "10"
        )
        try:
            ready(victim)
            async with await psycopg.AsyncConnection.connect(base) as blocker:
                # Hold k5's row: the victim's 6th Put waits for it, its transaction half done.
                await blocker.execute(
                    f'SELECT 1 FROM "{schema}".kv WHERE key = %s FOR UPDATE'.encode(),  # noqa: S608
                    ("app:k5",),
                )
                go(victim)
                await wait_for_sql(
                    base,
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = 'victim' "
                    "AND wait_event_type = 'Lock'",
                )
                victim.kill()
                await blocker.rollback()
            await wait_for_sql(
                base,
                "SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity "
                "WHERE application_name = 'victim')",
            )
        finally:
            victim.kill()
        assert "committed" not in victim.lines
        entries = await backend.get_many([f"k{n}" for n in range(10)])
        assert [(e.value, e.version) for e in entries if e is not None] == [(b"old", 1)] * 10
        assert await backend.index_range("idx") == []
        assert await backend.feed_cursor() == before
        after = await backend.set("k0", b"after")
        assert after.revision == int(before.rsplit(":", 1)[1]) + 1


@pytest.mark.slow
async def test_transaction_processes_killed_at_random_leave_whole_transactions(store: str) -> None:
    """3 processes run 9-write transactions (a generation number put into nine keys, and an
    index score incremented); SIGKILLed 8 times at random moments: every name's nine keys and
    its score agree, no acknowledged generation is lost, and the feed holds whole transactions."""
    rng = random.Random(7)
    names = ["a", "b", "c"]
    procs = {name: Proc("batches", store, "app:", name) for name in names}
    done: list[tuple[str, LineProcess]] = []
    try:
        for _ in range(8):
            name = rng.choice(names)
            victim = procs[name]
            ready(victim)
            acks = len(victim.lines) + rng.randrange(3, 25)
            assert victim.wait_lines(acks, WAIT), victim.errors
            victim.kill()
            done.append((name, victim))
            procs[name] = Proc("batches", store, "app:", name)
        for name, proc in procs.items():
            ready(proc)
            assert proc.wait_lines(len(proc.lines) + 3, WAIT), proc.errors
            proc.kill()
            done.append((name, proc))
    finally:
        for proc in procs.values():
            proc.kill()
    acked: Counter[str] = Counter()
    for name, proc in done:
        for line in proc.lines:
            if line.startswith("ack "):
                acked[name] = max(acked[name], int(line.split()[1]))
    async with PostgresBackend.from_url(store, key_prefix="app:") as backend:
        scores = dict(await backend.index_range("gens"))
        for name in names:
            entries = await backend.get_many([f"{name}:gen", *(f"{name}:{n}" for n in range(8))])
            values = {e.value for e in entries if e is not None}
            assert len(values) == 1, (name, values)
            gen = int(values.pop())
            assert [e.version for e in entries if e is not None] == [gen] * 9
            assert scores[name] == gen
            assert gen >= acked[name] > 0
        keys_per_revision = []
        async with backend.changes("*", since=EARLIEST) as stream:
            head = await backend.feed_cursor()
            with anyio.fail_after(WAIT):
                async for change in stream:
                    keys_per_revision.append((change.revision, change.key, change.new))
                    if change.cursor == head:
                        break
    # Nine consecutive revisions per transaction, all the same name and generation. The feed
    # keeps its newest changes (a count bound), so only the oldest transaction kept may be cut.
    runs: list[tuple[tuple[str, Any], list[int]]] = []
    for revision, key, new in keys_per_revision:
        run = (key.split(":")[0], new)
        if runs and runs[-1][0] == run and runs[-1][1][-1] + 1 == revision:
            runs[-1][1].append(revision)
        else:
            runs.append((run, [revision]))
    assert runs
    assert len(runs[0][1]) <= 9, runs[0]
    assert [len(revisions) for _, revisions in runs[1:]] == [9] * (len(runs) - 1), runs


# ------------------------------------------------------------------ the server restarted


class RestartableServer(PostgresServer):
    """A private cluster that `pg_ctl restart -m immediate` restarts (a crash: no checkpoint,
    the WAL replayed at start). The restarted server is pg_ctl's daemon; `stop` ends it with
    pg_ctl too."""

    def pg_ctl(self, *args: str) -> None:
        prefix, _ = _as_server_user()
        assert self.directory is not None
        done = subprocess.run(
            [*prefix, binary("pg_ctl"), "-D", str(self.directory / "data"), "-w", *args],
            capture_output=True,
            check=False,
            timeout=WAIT,
        )
        assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()

    def restart_immediate(self) -> None:
        assert self.directory is not None
        self.pg_ctl("restart", "-m", "immediate", "-l", str(self.directory / "restarted.log"))
        if self.process is not None:
            self.process.wait(WAIT)  # the first server, which pg_ctl stopped

    def stop(self) -> None:
        if self.directory is not None and (self.directory / "data" / "postmaster.pid").exists():
            with_pidfile = self.process is None or self.process.poll() is not None
            if with_pidfile:
                self.pg_ctl("stop", "-m", "fast")
        super().stop()


@pytest.fixture
def own_cluster() -> Iterator[RestartableServer]:
    """A private cluster for one test (restarting it disturbs no other test)."""
    server = RestartableServer()
    try:
        server.start()
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        if require_postgres():
            pytest.fail(f"AGENTICSTATE_REQUIRE_POSTGRES=1 but no PostgreSQL server: {exc}")
        pytest.skip(f"no PostgreSQL server: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
async def test_immediate_restart_loses_no_acknowledged_write_and_the_feed_resumes_exactly(
    own_cluster: RestartableServer,
) -> None:
    """2 writer processes (4 tasks each) save while the server is restarted with `pg_ctl
    restart -m immediate` twice: every acknowledged save is there, the writers go on after it,
    and a subscriber process that stayed subscribed received every committed change once, in
    revision order (the feed read after the restart, from its last revision)."""
    store = with_schema(own_cluster.url, "app")
    async with PostgresBackend.from_url(store) as backend:
        await backend.set("first", b"1")  # makes the schema before the processes race for it
    subscriber = Proc("subscribe", store, "", "1000000")
    writers = [Proc("writer", store, "", name) for name in ("w0", "w1")]
    try:
        start = ready(subscriber).split()[1]
        for _ in range(2):
            for proc in writers:
                wait_acks(proc, 40)
            own_cluster.restart_immediate()
        for proc in writers:  # they write again after the restart
            wait_acks(proc, 40)
            proc.kill()
        async with PostgresBackend.from_url(store) as backend:
            head = int((await backend.feed_cursor()).rsplit(":", 1)[1])
            assert subscriber.wait_until(
                lambda lines: bool(received_seqs(lines)) and received_seqs(lines)[-1] >= head,
                WAIT,
            ), subscriber.errors
            acked = [
                line.split()[1]
                for proc in writers
                for line in proc.lines
                if line.startswith("ack ")
            ]
            entries = await backend.get_many(acked)
            missing = [key for key, entry in zip(acked, entries, strict=True) if entry is None]
            feed = []
            async with backend.changes("*", since=start) as stream:
                with anyio.fail_after(WAIT):
                    async for change in stream:
                        feed.append(change.revision)
                        if change.revision == head:
                            break
    finally:
        subscriber.kill()
        for proc in writers:
            proc.kill()
    assert len(acked) >= 240
    assert missing == []
    # A writer killed as it sent COMMIT may commit after `head` was read: compare up to it.
    seqs = [seq for seq in received_seqs(subscriber.lines) if seq <= head]
    assert seqs == feed, "every committed change once, in revision order"
    assert seqs == list(range(seqs[0], head + 1))


def wait_acks(proc: LineProcess, more: int) -> None:
    """Wait until `proc` acknowledged `more` saves beyond those it has so far."""
    want = sum(line.startswith("ack ") for line in proc.lines) + more
    assert proc.wait_until(
        lambda lines: sum(line.startswith("ack ") for line in lines) >= want, WAIT
    ), proc.errors


def received_seqs(lines: list[str]) -> list[int]:
    return [json.loads(line)["seq"] for line in lines if line.startswith("{")]
