"""Commits of a scope on every backend: commit, log, checkout, diff, rollback, pins, retention."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from pydantic import BaseModel

from agenticstate import (
    Encryption,
    FeedRetention,
    InvalidArgumentError,
    MemoryBackend,
    NotFoundError,
    StateConfig,
    StateManager,
)
from agenticstate.backends.base import EARLIEST
from agenticstate.commits import COMMIT_PREFIX, MANIFEST_EVERY, CommitDiff

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from agenticstate.backends import Backend, TxnCompare, TxnOp, TxnResult
    from agenticstate.commits import CommitInfo


class Plan(BaseModel):
    steps: list[str]


@pytest.fixture
async def small(backend: Backend) -> AsyncIterator[StateManager]:
    """A StateManager keeping 3 commits per scope."""
    manager = StateManager(StateConfig(commit_retention=3), backend=backend, close_backend=False)
    try:
        yield manager
    finally:
        await manager.aclose()


async def blob_keys(state: StateManager) -> list[str]:
    return [key for key in await state.list_keys(COMMIT_PREFIX + "*") if ":b:" in key]


async def scope_values(state: StateManager, scope: str) -> dict[str, Any]:
    return await state.get_many(
        [k for k in await state.list_keys(scope + "*") if not k.startswith(COMMIT_PREFIX)]
    )


async def test_commit_log_checkout_diff_rollback(state: StateManager) -> None:
    """The whole cycle: two commits, their log, views, diff, and a rollback to the first."""
    await state.save("agent:1:plan", {"steps": ["search", "answer"]})
    await state.save("agent:1:notes", "n1")
    await state.save("agent:2:plan", {"steps": []})  # another scope: never in agent:1:'s
    first = await state.commit("agent:1:", message="planned")
    assert (first.scope, first.parent, first.message) == ("agent:1:", None, "planned")
    assert (first.keys, first.added, first.changed, first.removed) == (2, 2, 0, 0)
    assert len(first.id) == 64
    assert first.timestamp.tzinfo is not None

    await state.save("agent:1:plan", {"steps": ["answer"]})
    await state.delete("agent:1:notes")
    await state.save("agent:1:result", 42)
    second = await state.commit("agent:1:", message="answered")
    assert second.parent == first.id
    assert (second.keys, second.added, second.changed, second.removed) == (2, 1, 1, 1)

    assert [c.id for c in await state.log("agent:1:")] == [second.id, first.id]
    assert [c.id for c in await state.log("agent:1:", limit=1)] == [second.id]
    assert await state.log("agent:2:") == []
    assert await state.log("agent:1:", limit=0) == []

    view = await state.checkout(first.id)
    assert view.info == first
    assert view.keys() == ["agent:1:notes", "agent:1:plan"]
    assert len(view) == 2
    assert "agent:1:plan" in view
    assert "agent:1:result" not in view
    assert await view.get("agent:1:plan", model=Plan) == Plan(steps=["search", "answer"])
    assert await view.get("agent:1:result", "none") == "none"
    assert await view.items() == {
        "agent:1:notes": "n1",
        "agent:1:plan": {"steps": ["search", "answer"]},
    }
    assert (await state.checkout(first.id[:8])).info.id == first.id  # a unique prefix

    assert await state.diff(first.id, second.id) == CommitDiff(
        added=["agent:1:result"], removed=["agent:1:notes"], changed=["agent:1:plan"]
    )
    assert await state.diff(second.id, second.id) == CommitDiff(added=[], removed=[], changed=[])

    plan_version = (await state.get_entry("agent:1:plan")).version  # type: ignore[union-attr]
    assert await state.rollback("agent:1:", first.id) == 3
    assert await scope_values(state, "agent:1:") == {
        "agent:1:notes": "n1",
        "agent:1:plan": {"steps": ["search", "answer"]},
    }
    entry = await state.get_entry("agent:1:plan")
    assert entry is not None
    assert entry.version == plan_version + 1  # a normal write: the version goes on
    assert await state.get("agent:2:plan") == {"steps": []}
    assert await state.rollback("agent:1:", first.id) == 0  # already there
    assert [c.id for c in await state.log("agent:1:")] == [second.id, first.id]


async def test_unchanged_values_are_stored_once(state: StateManager) -> None:
    """A second commit with one key changed stores one blob more, not the whole scope again."""
    await state.save_many({f"doc:{i}": {"n": i} for i in range(10)})
    await state.commit("doc:")
    assert len(await blob_keys(state)) == 10
    await state.save("doc:3", {"n": 33})
    info = await state.commit("doc:")
    assert (info.changed, info.added, info.removed) == (1, 0, 0)
    assert len(await blob_keys(state)) == 11
    await state.save("doc:4", {"n": 4})  # the same bytes again: no change, no blob
    info = await state.commit("doc:")
    assert (info.changed, info.keys) == (0, 10)
    assert len(await blob_keys(state)) == 11


async def test_whole_namespace_scope_leaves_out_the_commits(state: StateManager) -> None:
    """Scope "" snapshots every key but the commits' own."""
    await state.save("a", 1)
    await state.commit("x:")  # leaves _commits: keys behind
    first = await state.commit("")
    second = await state.commit("")
    assert (await state.checkout(first.id)).keys() == ["a"]
    assert (await state.checkout(second.id)).keys() == ["a"]
    assert await state.diff(first.id, second.id) == CommitDiff(added=[], removed=[], changed=[])
    await state.save("b", 2)
    await state.rollback("", first.id)
    assert await state.list_keys("[^_]*") == ["a"]
    assert await state.log("x:")  # the other scope's commits survived the rollback of ""


async def test_every_kept_commit_checks_out_after_retention(small: StateManager) -> None:
    """Retention keeps the last N (and back to a full manifest) plus pins; each one checks out."""
    state = small
    expected: dict[str, dict[str, Any]] = {}
    infos: list[CommitInfo] = []
    for i in range(2 * MANIFEST_EVERY + 7):
        await state.save(f"s:k{i % 5}", i)
        if i % 7 == 3:
            await state.delete(f"s:k{(i + 1) % 5}")
        info = await state.commit("s:", message=str(i))
        infos.append(info)
        expected[info.id] = await scope_values(state, "s:")
        if i == 5:
            assert (await state.pin(info.id)).pinned
    pinned = infos[5]
    log = await state.log("s:")
    kept = {c.id for c in log}
    assert pinned.id in kept
    assert infos[-3].id in kept and infos[-1].id in kept  # noqa: PT018
    assert len(log) <= 3 + MANIFEST_EVERY
    assert [c.pinned for c in log if c.id == pinned.id] == [True]
    for commit in log:
        assert await (await state.checkout(commit.id)).items() == expected[commit.id]
    dropped = infos[6]
    assert dropped.id not in kept
    with pytest.raises(NotFoundError):
        await state.checkout(dropped.id)
    # Only the blobs some kept commit names are left.
    wanted = set()
    for commit in log:
        view = await state.checkout(commit.id)
        wanted |= set(view._manifest.values())
    assert len(await blob_keys(state)) == len(wanted)

    assert await state.unpin(pinned.id)
    assert not await state.unpin(pinned.id)
    await state.save("s:k0", "again")
    await state.commit("s:")
    assert pinned.id not in {c.id for c in await state.log("s:")}


async def test_writes_racing_a_commit(state: StateManager) -> None:
    """Writes during a commit: with a feed the snapshot is the scope at its cursor, else per key."""
    backend = state.backend
    written: dict[str, set[int]] = {}
    infos: list[CommitInfo] = []
    await state.save("race:0", -1)  # the feed's head is a change from here on
    written["race:0"] = {-1}

    async def writer() -> None:
        for i in range(300):
            key = f"race:{i % 17}"
            written.setdefault(key, set()).add(i)
            await state.save(key, i)
            if i % 40 == 0:
                await state.delete(f"race:{(i + 5) % 17}")
            if i % 25 == 0:
                await anyio.lowlevel.checkpoint()

    async def committer() -> None:
        for _ in range(6):
            infos.append(await state.commit("race:"))

    async with anyio.create_task_group() as group:
        group.start_soon(writer)
        group.start_soon(committer)
    infos.append(await state.commit("race:"))
    # With one ordered feed, every commit is exact at its cursor (a cluster has a feed per slot).
    if await backend.feed_cursor() is not None and not getattr(backend, "is_cluster", False):
        assert all(info.cursor is not None for info in infos)
    assert await (await state.checkout(infos[-1].id)).items() == await scope_values(state, "race:")
    for info in infos:
        view = await state.checkout(info.id)
        values = await view.items()
        assert all(value in written[key] for key, value in values.items())
        if info.cursor is None:
            continue
        # Replay the feed up to the commit's cursor: the scope at that point, exactly.
        at_cursor: dict[str, bytes] = {}
        with anyio.fail_after(10):
            async with backend.changes("*", since=EARLIEST) as changes:
                async for change in changes:
                    if change.key.startswith("race:"):
                        if change.new is None:
                            at_cursor.pop(change.key, None)
                        else:
                            at_cursor[change.key] = change.new
                    if change.cursor == info.cursor:
                        break
        decoded = {key: state._codec.decode(key, raw) for key, raw in at_cursor.items()}
        assert values == decoded


async def test_bad_ids_and_scopes(state: StateManager) -> None:
    """Unknown ids raise NotFoundError; malformed ids, foreign scopes and bad scopes raise."""
    await state.save("a:1", 1)
    info = await state.commit("a:")
    await state.save("b:1", 1)
    other = await state.commit("b:")
    with pytest.raises(NotFoundError):
        await state.checkout("0" * 64 if not info.id.startswith("0" * 8) else "f" * 64)
    for bad in ("", "abc", info.id[:7], info.id.upper(), "z" * 64, info.id + "0", 12345678):
        with pytest.raises(InvalidArgumentError):
            await state.checkout(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        await state.rollback("a:", other.id)  # a commit of scope b:
    with pytest.raises(InvalidArgumentError):
        await state.commit(COMMIT_PREFIX + "x")
    with pytest.raises(InvalidArgumentError):
        await state.commit(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        await state.commit("a:", message=None)  # type: ignore[arg-type]
    with pytest.raises(NotFoundError):
        await state.diff(info.id, "f" * 64 if not info.id.startswith("f" * 8) else "0" * 64)
    with pytest.raises(InvalidArgumentError):
        await state.log("a:", limit=-1)


async def test_encrypted_values_round_trip(backend: Backend) -> None:
    """Commits keep ciphertext; checkout decrypts it, rollback writes it back to its key."""
    config = StateConfig(encryption=Encryption({"k1": Encryption.generate_key()}))
    async with StateManager(config, backend=backend, close_backend=False) as state:
        await state.save("vault:card", {"number": "4111"})
        info = await state.commit("vault:")
        for key in await blob_keys(state):
            entry = await backend.get(key)
            assert entry is not None
            assert b"4111" not in entry.value
        await state.save("vault:card", {"number": "5500"})
        assert (await state.diff(info.id, (await state.commit("vault:")).id)).changed == [
            "vault:card"
        ]
        assert await (await state.checkout(info.id)).get("vault:card") == {"number": "4111"}
        await state.rollback("vault:", info.id)
        assert await state.get("vault:card") == {"number": "4111"}


async def test_rollback_is_a_normal_change(state: StateManager) -> None:
    """Subscribers see a rollback's writes and deletes."""
    await state.save("w:a", 1)
    info = await state.commit("w:")
    await state.save("w:a", 2)
    await state.save("w:b", 3)
    async with state.watch("w:*") as changes:
        await state.rollback("w:", info.id)
        seen = {}
        with anyio.fail_after(5):
            async for change in changes:
                seen[change.key] = (change.op, change.new_value)
                if len(seen) == 2:
                    break
    assert seen == {"w:a": ("set", 1), "w:b": ("delete", None)}


async def test_two_managers_commit_one_scope(backend: Backend) -> None:
    """Concurrent commits of one scope through two managers make one linear chain."""
    managers = [StateManager(backend=backend, close_backend=False) for _ in range(2)]
    await managers[0].save("c:1", 0)

    async def commit_many(state: StateManager) -> None:
        for i in range(5):
            await state.save("c:1", i)
            await state.commit("c:")

    async with anyio.create_task_group() as group:
        for manager in managers:
            group.start_soon(commit_many, manager)
    log = await managers[0].log("c:")
    assert len(log) == 10
    assert [c.parent for c in log[:-1]] == [c.id for c in log[1:]]
    assert log[-1].parent is None
    for manager in managers:
        await manager.aclose()


def test_commit_ids_are_content_hashes() -> None:
    """The id hashes every field: a different message, parent or change is a different id."""
    from datetime import UTC, datetime

    from agenticstate.commits import _commit_id

    now = datetime(2026, 1, 1, tzinfo=UTC)
    base = _commit_id("s:", None, "m", now, None, {"s:a": "1"})
    assert base == _commit_id("s:", None, "m", now, None, {"s:a": "1"})
    variants = {
        _commit_id("s:", "p", "m", now, None, {"s:a": "1"}),
        _commit_id("s:", None, "n", now, None, {"s:a": "1"}),
        _commit_id("s:", None, "m", now, "c", {"s:a": "1"}),
        _commit_id("s:", None, "m", now, None, {"s:a": "2"}),
        _commit_id("s:", None, "m", now, None, {"s:a": None}),
        _commit_id("t:", None, "m", now, None, {"s:a": "1"}),
    }
    assert base not in variants
    assert len(variants) == 6
    assert hashlib.sha256(b"").hexdigest() != base


async def test_a_scope_commits_its_prefix(state: StateManager) -> None:
    """ScopedState.commit/log/rollback are the manager's, on the scope's prefix."""
    user = state.scope("session:u1:")
    await user.save("cart", ["milk"])
    info = await user.commit(message="cart")
    assert info.scope == "session:u1:"
    await user.save("cart", [])
    assert [c.id for c in await user.log()] == [info.id]
    assert await user.rollback(info.id) == 1
    assert await user.get("cart") == ["milk"]


def test_the_sync_api_commits_and_checks_out() -> None:
    """sync.StateManager commits; its checkout is a blocking view with len and in."""
    from agenticstate import sync

    state = sync.StateManager()
    try:
        state.save("a:1", {"n": 1})
        info = state.scope("a:").commit(message="one")
        state.save("a:1", {"n": 2})
        view = state.checkout(info.id)
        assert isinstance(view, sync.Checkout)
        assert (len(view), "a:1" in view, view.keys()) == (1, True, ["a:1"])
        assert view.get("a:1") == {"n": 1}
        assert view.items() == {"a:1": {"n": 1}}
        assert state.rollback("a:", info.id) == 1
        assert state.get("a:1") == {"n": 1}
    finally:
        state.close()


class ScanCountingBackend(MemoryBackend):
    """A memory backend that counts the scans made of it."""

    scans = 0

    def scan_batches(self, pattern: str) -> AsyncIterator[list[str]]:
        self.scans += 1
        return super().scan_batches(pattern)


async def test_with_a_feed_a_commit_reads_what_changed() -> None:
    """After the first commit, commits read the feed (no scan) until the next full manifest."""
    backend = ScanCountingBackend()
    async with StateManager(backend=backend) as state:
        await state.save_many({f"d:{i}": i for i in range(50)})
        infos = [await state.commit("d:")]
        assert backend.scans == 1
        for round_ in range(1, MANIFEST_EVERY):
            await state.save(f"d:{round_}", -round_)
            await state.delete(f"d:{round_ + 20}")
            infos.append(await state.commit("d:"))
            assert (infos[-1].changed, infos[-1].removed) == (1, 1)
        assert backend.scans == 1
        infos.append(await state.commit("d:"))  # the 17th: a full manifest, which scans
        assert backend.scans == 2
        assert all(info.cursor is not None for info in infos)
        expected = {f"d:{i}": i for i in range(50) if not 21 <= i < 20 + MANIFEST_EVERY}
        expected.update({f"d:{r}": -r for r in range(1, MANIFEST_EVERY)})
        assert await (await state.checkout(infos[-2].id)).items() == expected


async def test_a_trimmed_cursor_falls_back_to_a_scan() -> None:
    """When the feed no longer holds the previous commit's cursor, the commit scans, exactly."""
    backend = ScanCountingBackend(feed=FeedRetention(max_changes=5))
    async with StateManager(backend=backend) as state:
        await state.save("t:a", 0)
        first = await state.commit("t:")
        for i in range(20):
            await state.save(f"t:{i % 3}", i)
        second = await state.commit("t:")
        assert backend.scans == 2
        assert second.cursor is not None and second.cursor != first.cursor  # noqa: PT018
        assert await (await state.checkout(second.id)).items() == {
            "t:a": 0,
            "t:0": 18,
            "t:1": 19,
            "t:2": 17,
        }


class RacedBackend(MemoryBackend):
    """A memory backend where another writer changes `r:a` right before the first transaction."""

    def __init__(self) -> None:
        super().__init__()
        self.transactions = 0
        self.race: bytes | None = None

    async def transact(
        self, compare: Sequence[TxnCompare], then: Sequence[TxnOp], orelse: Sequence[TxnOp] = ()
    ) -> TxnResult:
        self.transactions += 1
        if self.race is not None:
            raced, self.race = self.race, None
            await self.set("r:a", raced)
        return await super().transact(compare, then, orelse)


async def test_a_write_racing_a_rollback_makes_it_read_again() -> None:
    """A write between the rollback's read and its transaction fails the compare: it re-reads."""
    backend = RacedBackend()
    async with StateManager(backend=backend) as state:
        await state.save_many({"r:a": 1, "r:b": 2})
        info = await state.commit("r:")
        await state.save_many({"r:a": 10, "r:b": 20})
        backend.race = state.serializer.dumps(99)
        before = backend.transactions
        assert await state.rollback("r:", info.id) == 2
        assert backend.transactions - before == 2  # the first one's compare failed
        assert await state.get_many(["r:a", "r:b"]) == {"r:a": 1, "r:b": 2}


async def test_reencrypt_leaves_commits_as_recorded(backend: Backend) -> None:
    """reencrypt() skips `_commits:` keys; old commits read while their key is in the keyring."""
    old, new = Encryption.generate_key(), Encryption.generate_key()
    config = StateConfig(encryption=Encryption({"k1": old}))
    async with StateManager(config, backend=backend, close_backend=False) as state:
        await state.save("vault:a", {"n": 1})
        info = await state.commit("vault:")
    rotated = StateConfig(encryption=Encryption({"k1": old, "k2": new}, current="k2"))
    async with StateManager(rotated, backend=backend, close_backend=False) as state:
        assert await state.reencrypt() == 1
        assert await (await state.checkout(info.id)).get("vault:a") == {"n": 1}
        await state.save("vault:a", {"n": 2})
        await state.rollback("vault:", info.id)  # the k1 bytes, back at their own key
        assert await state.get("vault:a") == {"n": 1}


@pytest.mark.parametrize("encrypted", [False, True])
async def test_a_watch_of_everything_decodes_the_commits_writes(
    backend: Backend, encrypted: bool
) -> None:
    """Every `_commits:` write decodes through the manager's codec: a watch of "*" never fails."""
    encryption = Encryption({"k1": Encryption.generate_key()}) if encrypted else None
    config = StateConfig(encryption=encryption, commit_retention=1)
    async with StateManager(config, backend=backend, close_backend=False) as state:
        seen = 0
        async with state.watch("*") as changes:
            for i in range(MANIFEST_EVERY + 2):  # past a retention pass, which deletes
                await state.save("e:a", i)
                await state.commit("e:")
            await state.save("e:done", True)
            with anyio.fail_after(10):
                async for change in changes:
                    seen += 1
                    if change.key == "e:done":
                        break
        assert seen > 3 * MANIFEST_EVERY
        for key in await state.list_keys(COMMIT_PREFIX + "*"):
            await state.get(key)  # decodes (records as dicts, blobs as values or bytes)
