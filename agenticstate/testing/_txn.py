"""The transaction contract: compare, then one branch, as one atomic step (`Backend.transact`).

A backend that declares transactions unsupported (its `transact` raises
`UnsupportedOperationError`, as `Backend`'s default does) skips these tests: the managers fall
back to single-key calls there. One that implements it must pass all of them.

Every key and index of one transaction shares the hash tag `{t}`, so the tests run on Redis
Cluster too (a transaction there must stay in one slot).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from agenticstate import ChangeOp, InvalidArgumentError, InvalidKeyError, UnsupportedOperationError
from agenticstate.backends import (
    Delete,
    Exists,
    Get,
    IndexAdd,
    IndexIncr,
    IndexRange,
    IndexRemove,
    Put,
    Version,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from agenticstate.backends import Backend, Change, Entry, TxnCompare, TxnOp, TxnResult

A, B, IDX = "{t}:a", "{t}:b", "{t}:idx"
SHORT = timedelta(milliseconds=150)


async def _txn(
    backend: Backend,
    compare: Sequence[TxnCompare],
    then: Sequence[TxnOp],
    orelse: Sequence[TxnOp] = (),
) -> TxnResult:
    try:
        return await backend.transact(compare, then, orelse)
    except UnsupportedOperationError:
        pytest.skip(f"{type(backend).__name__} does not implement transact()")


async def _nothing_changed(backend: Backend) -> None:
    assert await backend.get(A) is None
    assert await backend.get(B) is None
    assert await backend.index_range(IDX) == []


class TransactContract:
    """The transaction contract: compares, both branches, every operation, atomicity.

    Its tests take a `backend` fixture (a fresh, empty, open backend).
    """

    async def test_compares_pick_the_branch(self, backend: Backend) -> None:
        """All compares hold: `then` runs; any fails: `orelse` runs; Version 0 means missing."""
        result = await _txn(backend, [Version(A, 0)], [Put(A, b"1")], [Put(B, b"no")])
        assert result.succeeded
        assert result.results[0].version == 1
        assert await backend.get(B) is None
        result = await _txn(backend, [Version(A, 0)], [Put(A, b"2")], [Put(B, b"else")])
        assert not result.succeeded
        assert result.results[0].new == b"else"
        entry = await backend.get(A)
        assert entry is not None
        assert entry.value == b"1"
        assert (await _txn(backend, [Version(A, 1), Exists(B)], [])).succeeded
        assert not (await _txn(backend, [Version(A, 1), Version(B, 2)], [])).succeeded
        assert not (await _txn(backend, [Exists("{t}:missing")], [])).succeeded
        assert (await _txn(backend, [Version("{t}:missing", 0)], [])).succeeded
        assert (await _txn(backend, [], [])).results == []

    async def test_every_operation_and_its_result(self, backend: Backend) -> None:
        """Each operation's result, in order: entries, changes, counts, scores, ranges."""
        await backend.set(B, b"old")
        result = await _txn(
            backend,
            [],
            [
                Get(A),
                Put(A, b"new"),
                Delete(B),
                Delete("{t}:missing"),
                IndexAdd(IDX, {"x": 1, "y": 2.5}),
                IndexAdd(IDX, {"x": 3}),
                IndexRemove(IDX, ["y", "nope"]),
                IndexIncr(IDX, "c", 2),
                IndexIncr(IDX, "c", 0.5),
                IndexRange(IDX),
                IndexRange(IDX, limit=1),
            ],
        )
        assert result.succeeded
        got, put, deleted, missing, added, moved, removed, first, second, full, one = result.results
        assert got is None
        assert (put.key, put.op, put.old, put.new, put.version) == (
            A,
            ChangeOp.SET,
            None,
            b"new",
            1,
        )
        assert (deleted.key, deleted.op, deleted.old, deleted.new, deleted.version) == (
            B,
            ChangeOp.DELETE,
            b"old",
            None,
            1,
        )
        assert missing is None
        assert (added, moved, removed) == (2, 0, 1)
        assert (first, second) == (2.0, 2.5)
        assert full == [("c", 2.5), ("x", 3.0)]
        assert one == [("c", 2.5)]
        assert await backend.get(B) is None
        assert await backend.index_range(IDX) == full

    async def test_reads_see_the_steps_own_writes(self, backend: Backend) -> None:
        """A Get after a Put (or Delete) in the same step sees it; so does an index read."""
        result = await _txn(
            backend,
            [Version(A, 0)],
            [
                Put(A, b"1"),
                Get(A),
                Put(A, b"2"),
                Get(A),
                Delete(A),
                Get(A),
                Put(A, b"3"),
                IndexIncr(IDX, "n", 1),
                IndexIncr(IDX, "n", 1),
                IndexRemove(IDX, ["n"]),
                IndexIncr(IDX, "n", 5),
                IndexRange(IDX),
            ],
        )
        first: Entry = result.results[1]
        second: Entry = result.results[3]
        assert (first.value, first.version) == (b"1", 1)
        assert (second.value, second.version) == (b"2", 2)
        assert result.results[5] is None
        assert result.results[6].version == 1  # written again after the delete: starts over
        assert result.results[7:11] == [1.0, 2.0, 1, 5.0]
        assert result.results[11] == [("n", 5.0)]
        entry = await backend.get(A)
        assert entry is not None
        assert (entry.value, entry.version) == (b"3", 1)

    async def test_changes_are_emitted_as_set_and_delete_emit_them(self, backend: Backend) -> None:
        """Subscribers see every Put and Delete of the step, with old, new and version."""
        await backend.set(B, b"b0")
        async with backend.changes("{t}:*") as changes:
            result = await _txn(
                backend, [Exists(B)], [Put(A, b"a1"), Put(B, b"b1"), Delete(A), IndexAdd(IDX, {})]
            )
            seen: list[Change] = []
            with anyio.fail_after(5):
                async for change in changes:
                    seen.append(change)
                    if len(seen) == 3:
                        break
        assert result.succeeded
        assert [(c.key, c.op, c.old, c.new, c.version) for c in seen] == [
            (A, ChangeOp.SET, None, b"a1", 1),
            (B, ChangeOp.SET, b"b0", b"b1", 2),
            (A, ChangeOp.DELETE, b"a1", None, 1),
        ]
        assert [(c.key, c.version, c.new) for c in seen] == [
            (c.key, c.version, c.new) for c in result.results[:3]
        ]

    async def test_put_applies_its_ttl(self, backend: Backend) -> None:
        """A Put's TTL replaces the key's expiry; after it the key compares as missing."""
        await backend.set(A, b"x", ttl=timedelta(hours=1))
        result = await _txn(backend, [], [Put(A, b"y", SHORT), Put(B, b"z"), Get(A)])
        entry: Entry = result.results[2]
        assert entry.expires_at is not None
        left = entry.ttl()
        assert left is not None
        assert left <= SHORT
        await anyio.sleep(SHORT.total_seconds() + 0.1)  # expiry is wall-clock time: let it pass
        assert await backend.get(A) is None
        result = await _txn(backend, [Version(A, 0)], [Get(A), Get(B)])
        assert result.succeeded
        assert result.results[0] is None
        kept: Entry = result.results[1]
        assert kept.expires_at is None

    @pytest.mark.parametrize(
        "bad",
        [
            Put("", b"x"),
            Put("{t}:k", b"x", timedelta(0)),
            Put("{t}:k", "text"),  # type: ignore[arg-type]
            IndexAdd(IDX, {"m": float("nan")}),
            IndexAdd(IDX, {"bad\nmember": 1}),
            IndexRemove(IDX, ["bad\nmember"]),
            IndexRemove(IDX, "m"),  # a str, not a list of members
            IndexAdd(IDX, ["m"]),  # type: ignore[arg-type]
            IndexIncr(IDX, "m", float("inf")),
            IndexRange(IDX, limit=-1),
            Get("bad\nkey"),
            "not an operation",
        ],
        ids=repr,
    )
    async def test_an_invalid_operation_changes_nothing(self, backend: Backend, bad: Any) -> None:
        """Validation runs before anything: a bad operation in either branch raises and nothing
        of the step is written."""
        for then, orelse in ([[Put(A, b"1"), IndexAdd(IDX, {"m": 1}), bad], []], [[], [bad]]):
            with pytest.raises(InvalidArgumentError):
                await _txn(backend, [], then, orelse)
            await _nothing_changed(backend)

    async def test_an_invalid_compare_changes_nothing(self, backend: Backend) -> None:
        """Compares are validated too: a bad key or version raises before anything runs."""
        bad_version: Any = "1"
        for compare in ([Version(A, -1)], [Version(A, bad_version)], [Exists("")], ["nope"]):
            with pytest.raises(InvalidArgumentError):
                await _txn(backend, compare, [Put(A, b"1")])  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            await _txn(backend, [Exists("bad\nkey")], [Put(A, b"1")])
        await _nothing_changed(backend)

    async def test_concurrent_steps_lose_no_update(self, backend: Backend) -> None:
        """Many tasks: Version-guarded Puts of a counter and IndexIncr counters end exact."""
        tasks, rounds = 10, 10

        async def worker() -> None:
            done = 0
            while done < rounds:
                read = await _txn(backend, [], [Get(A)])
                entry: Entry | None = read.results[0]
                version = entry.version if entry is not None else 0
                value = int(entry.value) if entry is not None else 0
                result = await _txn(
                    backend,
                    [Version(A, version)],
                    [Put(A, b"%d" % (value + 1)), IndexIncr(IDX, "ok", 1)],
                    [IndexIncr(IDX, "lost", 1)],
                )
                done += result.succeeded
                await _txn(backend, [], [IndexIncr(IDX, "calls", 1)])

        async with anyio.create_task_group() as tg:
            for _ in range(tasks):
                tg.start_soon(worker)
        entry = await backend.get(A)
        assert entry is not None
        assert (entry.value, entry.version) == (b"%d" % (tasks * rounds), tasks * rounds)
        scores = dict(await backend.index_range(IDX))
        assert scores["ok"] == tasks * rounds
        assert scores["calls"] == scores["ok"] + scores.get("lost", 0)
