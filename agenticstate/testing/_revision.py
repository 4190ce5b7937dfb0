"""The revision contract: every write and delete gets a revision that never repeats in the store.

A backend without revisions (`has_revisions` false, as `Backend`'s default) skips these tests:
its entries and changes carry revision 0, and `StateManager` refuses `expected_revision` on it.
One that keeps revisions must pass all of them. Every key shares the hash tag `{r}`, so on
Redis Cluster they live in one slot (revisions increase per slot there).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import pytest_asyncio

from agenticstate import (
    ConflictError,
    InvalidArgumentError,
    StateConfig,
    StateManager,
    UnsupportedOperationError,
)
from agenticstate import txn as state_txn
from agenticstate.backends import Delete, Exists, Get, Put, Revision, Version

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agenticstate.backends import Backend, Change, TxnResult

K, OTHER, ALL = "{r}:k", "{r}:other", "{r}:*"
SHORT = timedelta(milliseconds=150)


def _needs_revisions(backend: Backend) -> None:
    if not backend.has_revisions:
        pytest.skip(f"{type(backend).__name__} keeps no revisions")


async def _transact(backend: Backend, *args: Any) -> TxnResult:
    try:
        return await backend.transact(*args)
    except UnsupportedOperationError:
        pytest.skip(f"{type(backend).__name__} does not implement transact()")


async def _past(ttl: timedelta) -> None:
    # Expiry is a matter of wall-clock time, so the test waits for the time itself to pass.
    await anyio.sleep(ttl.total_seconds() + 0.1)


async def _take(changes: AsyncIterator[Change], count: int) -> list[Change]:
    out: list[Change] = []
    with anyio.fail_after(10):
        async for change in changes:
            out.append(change)
            if len(out) == count:
                break
    return out


async def _conflict(call: Any) -> ConflictError:
    with pytest.raises(ConflictError) as caught:
        await call
    return caught.value


class RevisionContract:
    """The revision contract: unique, increasing, never repeated; compared by conditional writes.

    Its tests take a `backend` fixture (a fresh, empty, open backend), and the `state` fixture
    below (a `StateManager` over it).
    """

    @pytest_asyncio.fixture
    async def state(self, backend: Backend) -> AsyncIterator[StateManager]:
        """A `StateManager` over `backend` (which it does not close)."""
        manager = StateManager(StateConfig(), backend=backend, close_backend=False)
        try:
            yield manager
        finally:
            await manager.aclose()

    async def test_revision_a_write_and_its_entry_carry_one(self, backend: Backend) -> None:
        """A write's change and the entry it makes carry the same revision, an int >= 1."""
        _needs_revisions(backend)
        change = await backend.set(K, b"1")
        entry = await backend.get(K)
        assert entry is not None
        assert type(change.revision) is int
        assert change.revision >= 1
        assert entry.revision == change.revision
        assert entry.create_revision == change.revision  # version 1: this write created it
        assert (await backend.get_many([K]))[0] == entry

    async def test_revision_create_revision_names_the_life(self, backend: Backend) -> None:
        """Later writes keep create_revision; a delete and a new write start a new life."""
        _needs_revisions(backend)
        first = await backend.set(K, b"1")
        second = await backend.set(K, b"2")
        entry = await backend.get(K)
        assert entry is not None
        assert entry.revision == second.revision > first.revision
        assert entry.create_revision == first.revision
        await backend.delete(K)
        again = await backend.set(K, b"3")
        entry = await backend.get(K)
        assert entry is not None
        assert entry.version == 1
        assert entry.create_revision == entry.revision == again.revision > second.revision

    async def test_revision_increases_over_every_kind_of_write(self, backend: Backend) -> None:
        """set, set_many, update, delete and transact each take the next, larger revision."""
        _needs_revisions(backend)
        revisions = [(await backend.set(K, b"1")).revision]
        revisions.append((await backend.set(OTHER, b"1")).revision)
        revisions += [c.revision for c in await backend.set_many([(K, b"2"), (OTHER, b"2")])]
        revisions.append((await backend.update(K, lambda entry: b"3")).revision)
        deleted = await backend.delete(OTHER)
        assert deleted is not None
        revisions.append(deleted.revision)
        try:
            done = await backend.transact([], [Put(K, b"4"), Delete(K), Put(OTHER, b"5")])
        except UnsupportedOperationError:
            pass
        else:
            revisions += [result.revision for result in done.results]
        assert all(type(revision) is int and revision >= 1 for revision in revisions)
        assert revisions == sorted(set(revisions)), "revisions must strictly increase"

    async def test_revision_of_a_delete_is_its_own(self, backend: Backend) -> None:
        """A delete's change carries a new revision, larger than the deleted entry's."""
        _needs_revisions(backend)
        written = await backend.set(K, b"1")
        deleted = await backend.delete(K)
        assert deleted is not None
        assert deleted.revision > written.revision
        again = await backend.set(K, b"2")
        assert again.revision > deleted.revision

    async def test_revision_never_repeats_across_lives(self, backend: Backend) -> None:
        """A key deleted and written again, many times, never gets a revision it had before."""
        _needs_revisions(backend)
        seen: list[int] = []
        for n in range(5):
            seen.append((await backend.set(K, b"%d" % n)).revision)
            seen.append((await backend.set(K, b"%d" % n)).revision)
            deleted = await backend.delete(K)
            assert deleted is not None
            seen.append(deleted.revision)
        assert seen == sorted(set(seen))

    async def test_revision_after_expiry_is_larger(self, backend: Backend) -> None:
        """A key written again after it expired gets version 1 and a larger revision."""
        _needs_revisions(backend)
        first = await backend.set(K, b"1", ttl=SHORT)
        await _past(SHORT)
        assert await backend.get(K) is None
        again = await backend.set(K, b"2", expected_revision=0)
        assert again.version == 1
        assert again.revision > first.revision
        entry = await backend.get(K)
        assert entry is not None
        assert entry.create_revision == again.revision

    async def test_expected_revision_zero_means_missing(self, backend: Backend) -> None:
        """expected_revision=0 writes a missing key and refuses a present one."""
        _needs_revisions(backend)
        change = await backend.set(K, b"1", expected_revision=0)
        caught = await _conflict(backend.set(K, b"2", expected_revision=0))
        assert (caught.key, caught.expected, caught.actual) == (K, 0, change.revision)
        entry = await backend.get(K)
        assert entry is not None
        assert entry.value == b"1"
        assert await backend.delete(OTHER, expected_revision=0) is None

    async def test_expected_revision_refuses_a_stale_life(self, backend: Backend) -> None:
        """A revision read before a delete and a new write refuses the new life at the same
        version (where `expected_version` lets the stale write through) and changes nothing."""
        _needs_revisions(backend)
        await backend.set(K, b"old")
        stale = await backend.get(K)
        assert stale is not None
        await backend.delete(K)
        fresh = await backend.set(K, b"new")
        assert fresh.version == stale.version == 1
        caught = await _conflict(backend.set(K, b"stale", expected_revision=stale.revision))
        assert (caught.expected, caught.actual) == (stale.revision, fresh.revision)
        caught = await _conflict(backend.delete(K, expected_revision=stale.revision))
        assert (caught.expected, caught.actual) == (stale.revision, fresh.revision)
        entry = await backend.get(K)
        assert entry is not None
        assert (entry.value, entry.revision) == (b"new", fresh.revision)
        # The version cannot tell the lives apart: the point of revisions.
        await backend.set(K, b"aba", expected_version=stale.version)

    async def test_expected_revision_matches_the_current_one(self, backend: Backend) -> None:
        """The current revision lets a write or a delete through; the one before refuses."""
        _needs_revisions(backend)
        first = await backend.set(K, b"1")
        second = await backend.set(K, b"2", expected_revision=first.revision)
        assert second.version == 2
        await _conflict(backend.set(K, b"3", expected_revision=first.revision))
        await _conflict(backend.delete(K, expected_revision=first.revision))
        deleted = await backend.delete(K, expected_revision=second.revision)
        assert deleted is not None
        caught = await _conflict(backend.set(K, b"4", expected_revision=second.revision))
        assert (caught.expected, caught.actual) == (second.revision, 0)
        assert await backend.get(K) is None

    async def test_expected_revision_bad_input_is_refused(self, backend: Backend) -> None:
        """Both conditions at once, a negative or a non-int revision: InvalidArgumentError."""
        _needs_revisions(backend)
        await backend.set(K, b"1")
        for bad in (
            {"expected_revision": -1},
            {"expected_revision": "1"},
            {"expected_revision": True},
        ):
            with pytest.raises(InvalidArgumentError):
                await backend.set(K, b"2", **bad)
            with pytest.raises(InvalidArgumentError):
                await backend.delete(K, **bad)
        with pytest.raises(InvalidArgumentError):
            await backend.set(K, b"2", expected_version=1, expected_revision=1)
        with pytest.raises(InvalidArgumentError):
            await backend.delete(K, expected_version=1, expected_revision=1)
        entry = await backend.get(K)
        assert entry is not None
        assert (entry.value, entry.version) == (b"1", 1)

    async def test_revision_compare_in_a_transaction(self, backend: Backend) -> None:
        """Revision(key, r) holds at the key's current revision only, 0 when missing."""
        _needs_revisions(backend)
        missing = await _transact(backend, [Revision(K, 0)], [Put(K, b"1")], [Get(K)])
        assert missing.succeeded
        written: Change = missing.results[0]
        entry = await backend.get(K)
        assert entry is not None
        assert entry.revision == written.revision
        held = await _transact(backend, [Revision(K, written.revision), Exists(K)], [Get(K)])
        assert held.succeeded
        assert held.results[0] == entry
        await backend.delete(K)
        await backend.set(K, b"again")
        stale = await _transact(
            backend, [Revision(K, written.revision)], [Put(K, b"stale")], [Get(K)]
        )
        assert not stale.succeeded
        assert stale.results[0].value == b"again"
        same_version = await _transact(backend, [Version(K, 1)], [])
        assert same_version.succeeded  # the version cannot tell the lives apart
        with pytest.raises(InvalidArgumentError):
            await backend.transact([Revision(K, -1)], [])

    async def test_revision_of_transaction_writes(self, backend: Backend) -> None:
        """A transaction's Put and Delete results carry their revisions, a Get the entry's."""
        _needs_revisions(backend)
        done = await _transact(backend, [], [Put(K, b"1"), Get(K), Put(K, b"2"), Delete(K)])
        put, got, again, deleted = done.results
        assert got.revision == put.revision
        assert got.create_revision == put.revision
        assert put.revision < again.revision < deleted.revision

    async def test_revision_subscribers_see_the_writes_revision(self, backend: Backend) -> None:
        """A subscriber's changes carry the revisions the writes returned, deletes included."""
        _needs_revisions(backend)
        async with backend.changes(ALL) as changes:
            made = [
                await backend.set(K, b"1"),
                await backend.set(OTHER, b"1"),
                await backend.delete(K),
                (await backend.set_many([(K, b"2")]))[0],
                await backend.update(K, lambda entry: b"3"),
            ]
            seen = await _take(changes, len(made))
        assert [(c.key, c.op, c.revision) for c in seen] == [
            (c.key, c.op, c.revision) for c in made if c is not None
        ]

    async def test_revision_feed_replay_carries_revisions(self, backend: Backend) -> None:
        """A replay from the change feed carries each change's revision."""
        _needs_revisions(backend)
        if backend.feed is None:
            pytest.skip(f"{type(backend).__name__} keeps no change feed")
        head = await backend.feed_cursor()
        made = [await backend.set(K, b"1"), await backend.delete(K), await backend.set(K, b"2")]
        async with backend.changes(ALL, since=head) as changes:
            replayed = await _take(changes, 3)
        assert [c.revision for c in replayed] == [c.revision for c in made if c is not None]

    async def test_revision_history_versions_carry_theirs(self, backend: Backend) -> None:
        """Each retained version carries the revision of the write that made it."""
        _needs_revisions(backend)
        try:
            backend.keep_history({"{r}:*": 4})
        except UnsupportedOperationError:
            pytest.skip(f"{type(backend).__name__} keeps no history")
        made = [await backend.set(K, b"%d" % n) for n in range(3)]
        history = await backend.history(K)
        assert [entry.revision for entry in history] == [c.revision for c in reversed(made)]
        assert {entry.create_revision for entry in history} == {made[0].revision}
        older = await backend.get_version(K, 2)
        assert older is not None
        assert older.revision == made[1].revision

    # ---------------------------------------------------------------- through StateManager

    async def test_revision_state_entry_and_change_carry_it(
        self, backend: Backend, state: StateManager
    ) -> None:
        """get_entry, history and watched changes carry the revisions the backend gave."""
        _needs_revisions(backend)
        async with state.watch(ALL) as changes:
            await state.save(K, {"n": 1})
            await state.save(K, {"n": 2})
            with anyio.fail_after(10):
                seen = [await anext(changes), await anext(changes)]
        entry = await state.get_entry(K)
        assert entry is not None
        raw = await backend.get(K)
        assert raw is not None
        assert (entry.revision, entry.create_revision) == (raw.revision, raw.create_revision)
        assert [c.revision for c in seen] == [entry.create_revision, entry.revision]
        assert (await state.history(K))[0].revision == entry.revision

    async def test_revision_save_and_delete_compare_it(
        self, backend: Backend, state: StateManager
    ) -> None:
        """save and delete with expected_revision refuse a stale life and change nothing."""
        _needs_revisions(backend)
        await state.save(K, "old", expected_revision=0)
        stale = await state.get_entry(K)
        assert stale is not None
        await state.delete(K, expected_revision=stale.revision)
        await state.save(K, "new")
        caught = await _conflict(state.save(K, "stale", expected_revision=stale.revision))
        assert caught.expected == stale.revision
        await _conflict(state.delete(K, expected_revision=stale.revision))
        assert await state.get(K) == "new"
        fresh = await state.get_entry(K)
        assert fresh is not None
        assert await state.save(K, "next", expected_revision=fresh.revision) == 2
        with pytest.raises(InvalidArgumentError):
            await state.save(K, "x", expected_version=2, expected_revision=fresh.revision)
        scoped = state.scope("{r}:")
        current = await state.get_entry(K)
        assert current is not None
        await _conflict(scoped.save("k", "y", expected_revision=fresh.revision))
        assert await scoped.delete("k", expected_revision=current.revision)

    async def test_revision_transact_compares_and_reports_it(
        self, backend: Backend, state: StateManager
    ) -> None:
        """StateManager.transact takes Revision compares and reports each write's revision."""
        _needs_revisions(backend)
        try:
            done = await state.transact(
                [state_txn.Revision(K, 0)],
                [state_txn.Put(K, "a"), state_txn.Get(K), state_txn.Delete(OTHER)],
            )
        except UnsupportedOperationError:
            pytest.skip(f"{type(backend).__name__} does not implement transact()")
        assert done.succeeded
        entry = done.results[1]
        assert done.revisions == [entry.revision, 0, 0]
        stale = await state.transact([state_txn.Revision(K, 0)], [state_txn.Put(K, "b")])
        assert not stale.succeeded
        assert stale.revisions == []
        again = await state.transact([state_txn.Revision(K, entry.revision)], [state_txn.Delete(K)])
        assert again.succeeded
        assert again.revisions[0] > entry.revision
