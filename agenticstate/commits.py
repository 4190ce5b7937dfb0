"""Commits of a scope: versioned snapshots of every key under a prefix (agex, LangGraph).

```python
info = await state.commit("agent:1:", message="before the tool call")
await state.log("agent:1:")                      # [CommitInfo, ...], newest first
view = await state.checkout(info.id)             # read-only: keys(), get(), items(), len()
await state.diff(older.id, info.id)              # CommitDiff(added, removed, changed)
await state.rollback("agent:1:", info.id)        # the scope is as it was, in one atomic step
await state.pin(info.id)                         # kept whatever the retention says
```

A **scope** is a key prefix (`"agent:1:"`; `""` is the whole namespace). A commit records the
exact stored bytes of every present key under it, so a value encrypted at rest stays encrypted
in the commit (and stays bound to its key: rollback writes it back to that same key).
`StateManager.reencrypt` leaves commits as they are, so an old encryption key stays needed in the
keyring while commits recorded under it are kept.

## Storage

Commits are normal keys and sorted indexes of the backend, under the reserved prefix
`_commits:` (`COMMIT_PREFIX`). They are never part of any scope's snapshot (not even scope
`""`'s), but they are listed by `list_keys("*")` and seen by a subscriber to `"*"`, so every one
of them decodes through the manager's codec: records are msgpack dicts, under the manager's
encryption (at their own key) when it has one; a blob is the value's stored bytes as they are
without encryption, and with it those bytes (still encrypted for their own key) wrapped as a
bytes value encrypted for the blob's key. Every key of
one scope's commits carries the hash tag `{sid}` (`sid`: 16 hex digits of the scope's SHA-256), so
on Redis Cluster they share a slot and each commit is one atomic transaction there too.

| key or index                     | holds                                                      |
|----------------------------------|------------------------------------------------------------|
| `_commits:{sid}:head`            | the scope's newest commit (id, seq); compare-and-set       |
| `_commits:{sid}:i:<id>`          | a commit's info (`CommitInfo` fields, seq, full)           |
| `_commits:{sid}:c:<id>`          | a commit's entries: a delta or a full manifest             |
| `_commits:{sid}:b:<sha256>`      | a blob: stored bytes, by the SHA-256 of the bytes          |
| `_commits:{sid}:mark`            | a nonce each commit writes to find "now" in the feed       |
| index `_commits:{sid}:log`       | the scope's commit ids, score `-seq` (newest first)        |
| index `_commits:{sid}:pins`      | the pinned commit ids                                      |
| index `_commits:ids:<id[:4]>`    | `<id> <sid>`: finds a commit (or a unique id prefix)       |

A commit id is a content hash (SHA-256, hex) of the scope, the parent id, the message, the time,
the feed cursor and the changes against the parent; through the parent id it covers the whole
snapshot, as a git commit does. Any unique prefix of 8 or more hex digits names a commit.

Values are stored once: a blob is written only when no retained commit of the scope has those
bytes already (unchanged values cost nothing; an encrypted value rewritten with the same
plaintext is new ciphertext, so it is a new blob and a change). A commit's entries are a
**delta** against its parent (key -> blob, or removed), or a **full manifest** (every key ->
blob) for the root and every 16th commit (`MANIFEST_EVERY`), so a checkout reads at most 16
entry records, all in one batch (each record lists the chain back to its manifest).

## Consistency and cost

- With a change feed (`backend.feed is not None`, one ordered stream: memory, file, SQLite,
  single Redis) and the previous commit's cursor still retained, a commit subscribes to the
  feed from that cursor, writes a fresh nonce to `_commits:{sid}:mark` and applies every change
  of the scope up to the marker's own change: no scan of the scope, and only the keys those
  changes touched are compared and their blobs looked up, so the cost follows what changed in
  the namespace since the previous commit. The snapshot is the scope exactly as it was at the
  marker, whose cursor is the commit's `cursor`. (Reading up to a marker of its own, rather
  than up to `feed_cursor()`, needs no assumption about how cursors compare.)
- Otherwise (the first commit, a manifest commit, the cursor trimmed, the feed read overflowed
  or did not reach the marker within 10 seconds): a scan of the scope and a batch read, made
  consistent by taking `feed_cursor()` before the scan and applying the feed's changes from
  there up to a marker written after it; the snapshot is again exact at `cursor`. The manifest
  commits scan so that keys that expired (expiry puts nothing in the feed) leave the snapshot
  within 16 commits.
- Without a feed (`feed=None`), and on Redis Cluster (a stream per slot, with no order across
  them), the snapshot is per key: each key's value is one it held during the commit, but writes
  racing the scan may be half in. `cursor` is then `None`.
- Commits of one scope by several processes form one chain: the head moves by a
  compare-and-set (in the same transaction as the commit's records), and a loser backs off,
  reads the new head and tries again (32 times, then `ConflictError`).

## Rollback

`rollback(scope, commit_id)` reads the scope, then writes the commit's bytes back (and deletes the
keys the commit lacks) in one `transact` that first compares every key's version as read: a
write that lands in between fails the compare, and the rollback reads again (a few times, then
`ConflictError`), so the scope ends exactly as the commit, never a mix of it and that write. It
is one atomic step on memory, file, SQLite and Redis, and on Redis Cluster when every key of the
scope shares a slot (a `{tag}` in the scope). Elsewhere (a cluster scope across slots, a backend
without `transact`) each key is written with `expected_version`, which is **not atomic**: a
reader may see the scope half rolled back, and a failure leaves it so (roll back again to
finish). Rollback writes are normal writes: subscribers see them, history keeps them, the version
goes on counting, and they take the manager's default `ttl`. Keys created during the rollback
that it did not read are left alone.

## Retention

`StateConfig.commit_retention` (default 50) commits per scope are kept, plus pinned ones, checked
after each commit (from the log index alone, until something is due). The oldest kept commit
must be a full manifest: retention keeps up to 15 more back to the nearest one rather than
rewrite one, so it drops 16 commits at a time. A kept commit whose chain loses a commit (a pinned
commit older than the window) is first rewritten as a full manifest, so every kept commit can
still be checked out. Blobs no kept commit names are deleted with the commits.

Across processes, retention's deletes (and `pin`) run in transactions conditional on the scope's
head that also bump its version: a commit that found a blob already stored, and a pass that is
deleting it, cannot both succeed (the commit's own compare-and-set fails, and it looks again).
A backend without `transact` gets plain deletes, without that guard. A commit that loses its
compare-and-set may leave blobs behind that no commit names (values overwritten before its retry
succeeded); nothing collects those.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from pydantic import AwareDatetime, BaseModel, ConfigDict

from agenticstate._keys import escape_glob, validate_key
from agenticstate.backends.base import (
    Change,
    Delete,
    Entry,
    IndexAdd,
    IndexRemove,
    Put,
    Version,
    backoff,
    check_limit,
    utcnow,
)
from agenticstate.exceptions import (
    ConflictError,
    CursorExpiredError,
    DecodeError,
    InvalidArgumentError,
    NotFoundError,
    SubscriptionClosedError,
    UnsupportedOperationError,
)
from agenticstate.serialization import Serializer

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence
    from datetime import datetime, timedelta

    from agenticstate._codec import Codec
    from agenticstate.backends.base import Backend, TxnCompare, TxnOp

__all__ = [
    "COMMIT_PREFIX",
    "DEFAULT_COMMIT_RETENTION",
    "MANIFEST_EVERY",
    "Checkout",
    "CommitDiff",
    "CommitInfo",
    "CommitStore",
]

_M = TypeVar("_M", bound=BaseModel)

COMMIT_PREFIX = "_commits:"
"""Where commits live in the backend; never part of a scope's snapshot."""
DEFAULT_COMMIT_RETENTION = 50
"""Commits kept per scope (besides pinned ones) unless `StateConfig.commit_retention` says."""
MANIFEST_EVERY = 16
"""Every this many commits of a scope (and its first) is a full manifest."""
MIN_ID_PREFIX = 8
"""The shortest commit id prefix accepted."""

_ATTEMPTS = 32  # commit and rollback attempts when another writer wins the compare-and-set
_FEED_WAIT = 10.0  # seconds a commit waits for the feed to reach its head before it scans
_FEED_BUFFER = 10_000  # changes buffered while reading the feed
_BATCH = 1000  # keys per get_many
_HEX = frozenset("0123456789abcdef")
# The records' own encoding: compact, compressed, independent of the manager's format.
_RECORDS = Serializer(
    "msgpack", compression=True, compression_threshold=4096, max_size=512 * 1024 * 1024
)


class CommitInfo(BaseModel):
    """One commit of a scope, as `StateManager.commit` and `log` return it.

    Attributes:
        id: The commit's content hash (64 hex digits).
        scope: The key prefix it snapshots.
        parent: The previous commit of the scope, or `None` for the first. A parent dropped by
            retention is still named here, but no longer found.
        message: What the caller said about it.
        timestamp: When it was made (UTC).
        cursor: The feed cursor the snapshot is exact at, or `None` (no feed: per key).
        keys: How many keys the snapshot holds.
        added: Keys present now and not in the parent.
        changed: Keys whose stored bytes differ from the parent's.
        removed: Keys in the parent and not present now.
        pinned: Whether it is pinned (kept whatever the retention).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    scope: str
    parent: str | None
    message: str
    timestamp: AwareDatetime
    cursor: str | None
    keys: int
    added: int
    changed: int
    removed: int
    pinned: bool = False


class CommitDiff(BaseModel):
    """What changed from one commit to another (`StateManager.diff(a, b)`), sorted keys.

    Attributes:
        added: Keys in `b` and not in `a`.
        removed: Keys in `a` and not in `b`.
        changed: Keys in both whose stored bytes differ.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    added: list[str]
    removed: list[str]
    changed: list[str]


class _Info(BaseModel):
    # What `_commits:{sid}:i:<id>` holds: the public fields, the place in the chain, the form.
    model_config = ConfigDict(frozen=True, extra="forbid")

    info: CommitInfo
    seq: int
    full: bool


class _Record(BaseModel):
    # What `_commits:{sid}:c:<id>` holds. `chain`: the ids from the nearest full manifest up to
    # the parent, oldest first (empty for a full manifest), so a checkout reads them in one batch.
    model_config = ConfigDict(frozen=True, extra="forbid")

    full: bool
    chain: list[str]
    entries: dict[str, str | None]


class _Head(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    scope: str
    id: str
    seq: int


# ------------------------------------------------------------------ key layout


def _sid(scope: str) -> str:
    return hashlib.sha256(scope.encode()).hexdigest()[:16]


def _head_key(sid: str) -> str:
    return f"{COMMIT_PREFIX}{{{sid}}}:head"


def _info_key(sid: str, commit_id: str) -> str:
    return f"{COMMIT_PREFIX}{{{sid}}}:i:{commit_id}"


def _record_key(sid: str, commit_id: str) -> str:
    return f"{COMMIT_PREFIX}{{{sid}}}:c:{commit_id}"


def _blob_key(sid: str, digest: str) -> str:
    return f"{COMMIT_PREFIX}{{{sid}}}:b:{digest}"


def _mark_key(sid: str) -> str:
    return f"{COMMIT_PREFIX}{{{sid}}}:mark"


def _log_index(sid: str) -> str:
    return f"{COMMIT_PREFIX}{{{sid}}}:log"


def _pins_index(sid: str) -> str:
    return f"{COMMIT_PREFIX}{{{sid}}}:pins"


def _ids_index(commit_id: str) -> str:
    return f"{COMMIT_PREFIX}ids:{commit_id[:4]}"


def _dump(codec: Codec, key: str, model: BaseModel) -> bytes:
    """A commit record's stored bytes: `_RECORDS`, then the manager's encryption at its own key.

    So every `_commits:` value decodes through the manager's codec (a `watch("*")` or a view of
    everything reads them as plain dicts and bytes, never failing on them) and an encrypted store
    keeps its key names encrypted in the records too.
    """
    raw = _RECORDS.dumps(model)
    if codec.encryption is None:
        return raw
    return codec.encryption.encrypt(codec.namespace, key, raw)


def _load(codec: Codec, key: str, raw: bytes, model: type[_M]) -> _M:
    if codec.encryption is not None:
        raw = codec.encryption.decrypt(codec.namespace, key, raw)
    return _RECORDS.load_model(raw, model, key=key)


def _seal_blob(codec: Codec, key: str, value: bytes) -> bytes:
    # Without encryption a value's stored bytes decode as they are. Encrypted ones are bound to
    # the key they came from: wrap them (as a bytes value) under the blob's own key.
    if codec.encryption is None:
        return value
    return codec.encryption.encrypt(codec.namespace, key, _RECORDS.dumps(value))


def _open_blob(codec: Codec, key: str, stored: bytes) -> bytes:
    if codec.encryption is None:
        return stored
    value = _RECORDS.loads(codec.encryption.decrypt(codec.namespace, key, stored))
    if not isinstance(value, bytes):
        raise DecodeError(f"commit blob {key!r} does not hold bytes", path="")
    return value


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _check_scope(scope: object) -> str:
    if not isinstance(scope, str):
        raise InvalidArgumentError(
            f"scope must be a str (a key prefix), not {type(scope).__name__}"
        )
    if scope:
        validate_key(scope)
    if scope.startswith(COMMIT_PREFIX):
        raise InvalidArgumentError(
            f"scope may not start with {COMMIT_PREFIX!r}: commits live there"
        )
    return scope


def _in_scope(scope: str, key: str) -> bool:
    return key.startswith(scope) and not key.startswith(COMMIT_PREFIX)


def _commit_id(
    scope: str,
    parent: str | None,
    message: str,
    timestamp: datetime,
    cursor: str | None,
    delta: Mapping[str, str | None],
) -> str:
    # Length-prefixed fields, so no two different commits hash the same bytes.
    hasher = hashlib.sha256()

    def add(text: str) -> None:
        raw = text.encode("utf-8", "surrogatepass")
        hasher.update(len(raw).to_bytes(8, "big"))
        hasher.update(raw)

    for part in ("agenticstate-commit-1", scope, parent or "", message, timestamp.isoformat()):
        add(part)
    add(cursor or "")
    for key in sorted(delta):
        add(key)
        add(delta[key] or "")
    return hasher.hexdigest()


def _batches(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), _BATCH):
        yield items[start : start + _BATCH]


# ------------------------------------------------------------------ checkout


class Checkout:
    """A read-only view of one commit's snapshot (`StateManager.checkout`).

    Keys are full keys (with the scope's prefix). Values are decoded through the manager's codec
    (serializer, encryption) as `get` decodes them; each read fetches the blobs it needs.

    Attributes:
        info: The commit.
    """

    __slots__ = ("_backend", "_codec", "_manifest", "_sid", "info")

    def __init__(
        self,
        info: CommitInfo,
        manifest: Mapping[str, str],
        *,
        backend: Backend,
        codec: Codec,
    ) -> None:
        self.info = info
        self._manifest = dict(manifest)
        self._sid = _sid(info.scope)
        self._backend = backend
        self._codec = codec

    def __repr__(self) -> str:
        return f"Checkout({self.info.id[:12]}, scope={self.info.scope!r}, keys={len(self)})"

    def __len__(self) -> int:
        return len(self._manifest)

    def __contains__(self, key: object) -> bool:
        return key in self._manifest

    def keys(self) -> list[str]:
        """The snapshot's keys, sorted."""
        return sorted(self._manifest)

    async def get(
        self, key: str, default: object = None, *, model: type[BaseModel] | None = None
    ) -> Any:
        """The value `key` held in the snapshot, or `default` if it held none.

        Raises:
            NotFoundError: The value's blob is missing from the store (deleted by hand).
            DecodeError: The bytes do not decode (or validate as `model`).
        """
        digest = self._manifest.get(key)
        if digest is None:
            return default
        (raw,) = await _read_blobs(self._backend, self._codec, self._sid, [digest])
        return self._codec.decode(key, raw, model)

    async def items(self, *, model: type[BaseModel] | None = None) -> dict[str, Any]:
        """Every key of the snapshot with its value, sorted by key; blobs read in batches."""
        keys = self.keys()
        digests = [self._manifest[k] for k in keys]
        raws = await _read_blobs(self._backend, self._codec, self._sid, digests)
        decode = self._codec.decode
        return {key: decode(key, raw, model) for key, raw in zip(keys, raws, strict=True)}


async def _read_blobs(
    backend: Backend, codec: Codec, sid: str, digests: Sequence[str]
) -> list[bytes]:
    raws: list[bytes] = []
    for batch in _batches(digests):
        keys = [_blob_key(sid, digest) for digest in batch]
        for key, digest, entry in zip(keys, batch, await backend.get_many(keys), strict=True):
            if entry is None:
                raise NotFoundError(f"commit blob {digest} is missing from the store")
            raws.append(_open_blob(codec, key, entry.value))
    return raws


# ------------------------------------------------------------------ the store


class CommitStore:
    """Commits of scopes over one backend: what `StateManager.commit` and its siblings call.

    Args:
        backend: The (open) backend.
        codec: The manager's codec, for `Checkout`.
        retention: Commits kept per scope, besides pinned ones.
        ttl: What a rollback's writes expire after (the manager's default `ttl`).
    """

    def __init__(
        self,
        backend: Backend,
        codec: Codec,
        *,
        retention: int = DEFAULT_COMMIT_RETENTION,
        ttl: timedelta | None = None,
    ) -> None:
        if type(retention) is not int or retention < 1:
            raise InvalidArgumentError(f"commit retention must be an int >= 1, not {retention!r}")
        self.backend = backend
        self.codec = codec
        self.retention = retention
        self.ttl = ttl
        self._lock = anyio.Lock()  # one commit at a time from this process: no needless races
        self._states: dict[str, dict[str, str]] = {}  # commit id -> snapshot (key -> blob)

    # -------------------------------------------------------------- reading commits

    async def _info(self, sid: str, commit_id: str) -> _Info:
        key = _info_key(sid, commit_id)
        entry = await self.backend.get(key)
        if entry is None:
            raise NotFoundError(f"no commit {commit_id}")
        return _load(self.codec, key, entry.value, _Info)

    async def resolve(self, commit_id: object) -> tuple[str, str]:
        """Return `(full id, sid)` for a commit id or a unique prefix of 8+ hex digits.

        Raises:
            InvalidArgumentError: Not a hex str of 8 to 64 digits, or a prefix of several ids.
            NotFoundError: No retained commit has that id.
        """
        if (
            not isinstance(commit_id, str)
            or not MIN_ID_PREFIX <= len(commit_id) <= 64
            or not set(commit_id) <= _HEX
        ):
            raise InvalidArgumentError(
                f"a commit id is {MIN_ID_PREFIX} to 64 lowercase hex digits, not {commit_id!r}"
            )
        members = await self.backend.index_range(_ids_index(commit_id))
        found = {
            tuple(member.split(" ", 1))
            for member, _score in members
            if member.startswith(commit_id)
        }
        if not found:
            raise NotFoundError(f"no commit {commit_id}")
        if len(found) > 1:
            raise InvalidArgumentError(f"commit id prefix {commit_id!r} is ambiguous")
        full_id, sid = next(iter(found))
        return full_id, sid

    async def _records(self, sid: str, ids: Sequence[str]) -> list[_Record]:
        records: list[_Record] = []
        for batch in _batches(ids):
            entries = await self.backend.get_many([_record_key(sid, i) for i in batch])
            for commit_id, entry in zip(batch, entries, strict=True):
                if entry is None:
                    raise NotFoundError(f"no commit {commit_id}")
                records.append(_load(self.codec, _record_key(sid, commit_id), entry.value, _Record))
        return records

    async def _state(self, sid: str, commit_id: str) -> dict[str, str]:
        """The snapshot of a commit: key -> blob digest (cached; never mutate the result)."""
        cached = self._states.get(commit_id)
        if cached is not None:
            return cached
        (record,) = await self._records(sid, [commit_id])
        state: dict[str, str] = {}
        if not record.full:
            chain = await self._records(sid, record.chain)
            if not chain or not chain[0].full:
                raise NotFoundError(f"commit {commit_id}'s chain is incomplete")
            for link in chain:
                _apply(state, link.entries)
        _apply(state, record.entries)
        self._remember(commit_id, state)
        return state

    def _remember(self, commit_id: str, state: dict[str, str]) -> None:
        if len(self._states) >= 8:
            self._states.clear()
        self._states[commit_id] = state

    async def _pinned(self, sid: str) -> set[str]:
        return {member for member, _ in await self.backend.index_range(_pins_index(sid))}

    async def log(self, scope: str, *, limit: int | None = None) -> list[CommitInfo]:
        """See `StateManager.log`."""
        sid = _sid(_check_scope(scope))
        limit = check_limit(limit)
        if limit == 0:
            return []
        ids = [member for member, _ in await self.backend.index_range(_log_index(sid), limit=limit)]
        pinned = await self._pinned(sid) if ids else set()
        infos: list[CommitInfo] = []
        for batch in _batches(ids):
            entries = await self.backend.get_many([_info_key(sid, i) for i in batch])
            for commit_id, entry in zip(batch, entries, strict=True):
                if entry is None:  # dropped by a concurrent retention pass
                    continue
                info = _load(self.codec, _info_key(sid, commit_id), entry.value, _Info).info
                infos.append(info.model_copy(update={"pinned": commit_id in pinned}))
        return infos

    async def checkout(self, commit_id: str) -> Checkout:
        """See `StateManager.checkout`."""
        full_id, sid = await self.resolve(commit_id)
        stored = await self._info(sid, full_id)
        state = await self._state(sid, full_id)
        info = stored.info.model_copy(update={"pinned": full_id in await self._pinned(sid)})
        return Checkout(info, state, backend=self.backend, codec=self.codec)

    async def diff(self, a: str, b: str) -> CommitDiff:
        """See `StateManager.diff`."""
        a_id, a_sid = await self.resolve(a)
        b_id, b_sid = await self.resolve(b)
        before = await self._state(a_sid, a_id)
        after = await self._state(b_sid, b_id)
        return CommitDiff(
            added=sorted(after.keys() - before.keys()),
            removed=sorted(before.keys() - after.keys()),
            changed=sorted(k for k in before.keys() & after.keys() if before[k] != after[k]),
        )

    async def pin(self, commit_id: str) -> CommitInfo:
        """See `StateManager.pin`."""
        full_id, sid = await self.resolve(commit_id)
        for attempt in range(_ATTEMPTS):
            # Conditional on the head, as retention's deletes are: a pin never lands on a
            # commit a racing retention pass is dropping.
            head = await self.backend.get(_head_key(sid))
            stored = await self._info(sid, full_id)
            if head is not None and await self._guarded(
                sid, head, [[IndexAdd(_pins_index(sid), {full_id: float(stored.seq)})]]
            ):
                return stored.info.model_copy(update={"pinned": True})
            await anyio.sleep(backoff(attempt, base=0.002, cap=0.2))
        raise ConflictError(f"pin of {full_id[:12]} lost {_ATTEMPTS} races in a row")

    async def unpin(self, commit_id: str) -> bool:
        """See `StateManager.unpin`."""
        full_id, sid = await self.resolve(commit_id)
        return await self.backend.index_remove(_pins_index(sid), [full_id]) > 0

    # -------------------------------------------------------------- snapshots

    async def _feed_changes(self, scope: str, since: str) -> tuple[list[Change], str] | None:
        """The feed's changes of `scope` after `since`, up to now, and the cursor they reach.

        "Now" is a marker the commit writes (`_commits:{sid}:mark`, a fresh nonce) once its
        subscription is live: reading up to the marker's own change needs no assumption about
        how cursors compare, and the marker's cursor is where the snapshot is exact. `None`
        when the feed cannot say (the cursor was trimmed, the reader overflowed, or the marker
        did not come back in time): the caller scans instead.
        """
        marker = _mark_key(_sid(scope))
        nonce = self.codec.encode(marker, uuid.uuid4().hex)  # decodes like any value
        changes: list[Change] = []
        try:
            with anyio.move_on_after(_FEED_WAIT):
                async with self.backend.changes("*", max_buffer=_FEED_BUFFER, since=since) as feed:
                    await self.backend.set(marker, nonce)
                    async for change in feed:
                        if change.key == marker and change.new == nonce:
                            return (changes, change.cursor) if change.cursor else None
                        if _in_scope(scope, change.key):  # read all, keep the scope's
                            changes.append(change)
        except (CursorExpiredError, SubscriptionClosedError, UnsupportedOperationError):
            return None
        return None

    def _has_ordered_feed(self) -> bool:
        # Redis Cluster keeps one stream per slot: no single order to read a head up to.
        return self.backend.feed is not None and not getattr(self.backend, "is_cluster", False)

    async def _scan(self, scope: str, blobs: dict[str, bytes]) -> tuple[dict[str, str], str | None]:
        """Read the scope whole; exact at the returned cursor when the feed allows."""
        backend = self.backend
        ordered = self._has_ordered_feed()
        before = await backend.feed_cursor() if ordered else None
        keys: list[str] = []
        async for page in backend.scan_batches(escape_glob(scope) + "*"):
            keys += (key for key in page if _in_scope(scope, key))
        state: dict[str, str] = {}
        for batch in _batches(keys):
            for key, entry in zip(batch, await backend.get_many(batch), strict=True):
                if entry is not None:
                    digest = _digest(entry.value)
                    state[key] = digest
                    blobs[digest] = entry.value
        if before is None:
            return state, None
        read = await self._feed_changes(scope, before)
        if read is None:
            return state, None
        _replay(scope, state, blobs, read[0])
        return state, read[1]

    async def _snapshot(
        self, scope: str, parent: _Info | None, parent_state: Mapping[str, str], seq: int
    ) -> tuple[dict[str, str], dict[str, bytes], str | None, set[str] | None]:
        """`(state, bytes by digest, cursor, keys maybe changed)` for the next commit of `scope`.

        The keys maybe changed are `None` after a scan: any key may have.
        """
        blobs: dict[str, bytes] = {}
        is_manifest = (seq - 1) % MANIFEST_EVERY == 0
        since = parent.info.cursor if parent is not None else None
        if since is not None and not is_manifest and self._has_ordered_feed():
            read = await self._feed_changes(scope, since)
            if read is not None:
                state = dict(parent_state)
                touched = _replay(scope, state, blobs, read[0])
                return state, blobs, read[1], touched
        state, cursor = await self._scan(scope, blobs)
        return state, blobs, cursor, None

    # -------------------------------------------------------------- commit

    async def commit(self, scope: str, *, message: str = "") -> CommitInfo:
        """See `StateManager.commit`."""
        scope = _check_scope(scope)
        if not isinstance(message, str):
            raise InvalidArgumentError(f"message must be a str, not {type(message).__name__}")
        sid = _sid(scope)
        async with self._lock:
            for attempt in range(_ATTEMPTS):
                info = await self._try_commit(scope, sid, message)
                if info is not None:
                    await self._retain(sid, info.id)
                    return info
                await anyio.sleep(backoff(attempt, base=0.002, cap=0.2))  # let the winner by
        raise ConflictError(f"commit of scope {scope!r} lost {_ATTEMPTS} races in a row; try again")

    async def _try_commit(self, scope: str, sid: str, message: str) -> CommitInfo | None:
        backend = self.backend
        head_entry = await backend.get(_head_key(sid))
        head = (
            None
            if head_entry is None
            else _load(self.codec, _head_key(sid), head_entry.value, _Head)
        )
        expected = 0 if head_entry is None else head_entry.version
        if head is not None and head.scope != scope:
            raise ConflictError(f"scope {scope!r} shares its commit id with {head.scope!r}")
        parent: _Info | None = None
        parent_state: Mapping[str, str] = {}
        parent_chain: list[str] = []
        if head is not None:
            try:
                parent = await self._info(sid, head.id)
                parent_state = await self._state(sid, head.id)
                (parent_record,) = await self._records(sid, [head.id])
            except NotFoundError:
                # Read a head that other processes have since committed past and pruned.
                latest = await backend.get(_head_key(sid))
                if latest is not None and latest.version != expected:
                    return None
                raise
            parent_chain = [*parent_record.chain, head.id]
        seq = 1 if head is None else head.seq + 1
        state, blobs, cursor, touched = await self._snapshot(scope, parent, parent_state, seq)
        # After a feed read only the keys it touched can differ: the cost follows the changes.
        delta: dict[str, str | None] = {}
        for key in state.keys() | parent_state.keys() if touched is None else touched:
            digest = state.get(key)
            if parent_state.get(key) != digest:
                delta[key] = digest
        added = sum(1 for key in delta if key not in parent_state)
        removed = sum(1 for digest in delta.values() if digest is None)
        timestamp = utcnow()
        parent_id = None if head is None else head.id
        commit_id = _commit_id(scope, parent_id, message, timestamp, cursor, delta)
        info = CommitInfo(
            id=commit_id,
            scope=scope,
            parent=parent_id,
            message=message,
            timestamp=timestamp,
            cursor=cursor,
            keys=len(state),
            added=added,
            changed=len(delta) - added - removed,
            removed=removed,
        )
        full = (seq - 1) % MANIFEST_EVERY == 0
        if full:
            record = _Record(full=True, chain=[], entries=dict(state))
        else:
            record = _Record(full=False, chain=parent_chain, entries=delta)

        await self._store_blobs(sid, delta, blobs)
        directory = _ids_index(commit_id)
        await backend.index_add(directory, {f"{commit_id} {sid}": 0.0})
        stored = _Info(info=info, seq=seq, full=full)
        new_head = _Head(scope=scope, id=commit_id, seq=seq)
        if not await self._publish(sid, expected, stored, record, new_head):
            await backend.index_remove(directory, [f"{commit_id} {sid}"])
            return None
        self._remember(commit_id, state)
        return info

    async def _store_blobs(
        self, sid: str, delta: Mapping[str, str | None], blobs: Mapping[str, bytes]
    ) -> None:
        # Unchanged keys keep their parent's blobs, which are stored (the parent is retained):
        # only the delta's blobs may be new. Look them up, write the missing ones.
        wanted = sorted({digest for digest in delta.values() if digest is not None})
        for batch in _batches(wanted):
            sizes = await self.backend.value_sizes([_blob_key(sid, d) for d in batch])
            missing = [
                (_blob_key(sid, d), _seal_blob(self.codec, _blob_key(sid, d), blobs[d]))
                for d, size in zip(batch, sizes, strict=True)
                if size is None
            ]
            if missing:
                await self.backend.set_many(missing)

    async def _publish(
        self, sid: str, expected: int, stored: _Info, record: _Record, head: _Head
    ) -> bool:
        """Write the commit and move the head, if the head is still at `expected`."""
        backend = self.backend
        commit_id = stored.info.id
        writes = [
            Put(
                _record_key(sid, commit_id), _dump(self.codec, _record_key(sid, commit_id), record)
            ),
            Put(_info_key(sid, commit_id), _dump(self.codec, _info_key(sid, commit_id), stored)),
            Put(_head_key(sid), _dump(self.codec, _head_key(sid), head)),
        ]
        try:
            result = await backend.transact(
                [Version(_head_key(sid), expected)],
                [*writes, IndexAdd(_log_index(sid), {commit_id: -float(stored.seq)})],
            )
        except UnsupportedOperationError:
            pass
        else:
            return result.succeeded
        # No transactions: the entries first, the head by compare-and-set last.
        for put in writes[:2]:
            await backend.set(put.key, put.value)
        try:
            await backend.set(writes[2].key, writes[2].value, expected_version=expected)
        except ConflictError:
            for put in writes[:2]:
                await backend.delete(put.key)
            return False
        await backend.index_add(_log_index(sid), {commit_id: -float(stored.seq)})
        return True

    # -------------------------------------------------------------- retention

    async def _retain(self, sid: str, newest: str) -> None:
        """Drop the commits of `sid` beyond the retention, keeping chains whole.

        The deletes run in transactions conditional on the scope's head, and each bumps the
        head's version: a commit racing this one (in another process) that counted on a blob
        being there fails its own compare-and-set and looks again, and a commit or pin that
        lands first stops this pass (the next commit's pass picks it up).
        """
        backend = self.backend
        head_entry = await backend.get(_head_key(sid))
        if (
            head_entry is None
            or _load(self.codec, _head_key(sid), head_entry.value, _Head).id != newest
        ):
            return  # a newer commit has landed: its own pass will see to it
        log = await backend.index_range(_log_index(sid))
        if len(log) <= self.retention:
            return
        seqs = {member: round(-score) for member, score in log}
        window = max(seqs.values()) - self.retention + 1
        # Back to the nearest full manifest, so the oldest kept commit needs no rewrite.
        start = max(
            (seq for seq in seqs.values() if seq <= window and (seq - 1) % MANIFEST_EVERY == 0),
            default=window,
        )
        if all(seq >= start for seq in seqs.values()):
            return  # the usual case: nothing to drop until the next manifest leaves the window
        pinned = await self._pinned(sid)
        keep = [i for i, seq in seqs.items() if seq >= start or i in pinned]
        drop = [i for i in seqs if i not in keep]
        if drop:
            try:
                await self._drop(sid, head_entry, keep, drop)
            except NotFoundError:
                return  # another process's pass got there first; the next pass finishes

    async def _drop(
        self,
        sid: str,
        head_entry: Entry,
        keep: Sequence[str],
        drop: Sequence[str],
    ) -> None:
        backend = self.backend
        dropped = set(drop)
        kept_records = dict(zip(keep, await self._records(sid, keep), strict=True))
        for commit_id, record in kept_records.items():
            if not record.full and dropped.intersection(record.chain):
                state = await self._state(sid, commit_id)  # the chain is still there
                kept_records[commit_id] = full = _Record(full=True, chain=[], entries=dict(state))
                stored = (await self._info(sid, commit_id)).model_copy(update={"full": True})
                await backend.set_many(
                    [
                        (
                            _record_key(sid, commit_id),
                            _dump(self.codec, _record_key(sid, commit_id), full),
                        ),
                        (
                            _info_key(sid, commit_id),
                            _dump(self.codec, _info_key(sid, commit_id), stored),
                        ),
                    ]
                )
        needed = {d for r in kept_records.values() for d in r.entries.values() if d is not None}
        garbage: set[str] = set()
        for record in await self._records_present(sid, drop):
            garbage.update(d for d in record.entries.values() if d is not None)
        garbage -= needed
        # The blobs first, the commits (records, infos, log entries) in the last step.
        steps: list[list[TxnOp]] = [
            [Delete(_blob_key(sid, d)) for d in batch] for batch in _batches(sorted(garbage))
        ]
        last: list[TxnOp] = [Delete(_record_key(sid, i)) for i in drop]
        last += [Delete(_info_key(sid, i)) for i in drop]
        last.append(IndexRemove(_log_index(sid), drop))
        steps.append(last)
        if not await self._guarded(sid, head_entry, steps):
            return
        for commit_id in drop:
            self._states.pop(commit_id, None)
            await backend.index_remove(_ids_index(commit_id), [f"{commit_id} {sid}"])

    async def _guarded(self, sid: str, head: Entry, steps: Sequence[Sequence[TxnOp]]) -> bool:
        """Run each step if the head is still `head`, bumping its version; False if it moved."""
        backend = self.backend
        version = head.version
        for ops in steps:
            bump = Put(_head_key(sid), head.value)
            try:
                result = await backend.transact([Version(bump.key, version)], [bump, *ops])
            except UnsupportedOperationError:
                break
            if not result.succeeded:
                return False
            change = result.results[0]
            assert isinstance(change, Change)  # noqa: S101  # a Put's result
            version = change.version
        else:
            return True
        # No transactions: plain calls, with no guard against a racing commit (documented).
        for ops in steps:
            for op in ops:
                if isinstance(op, Delete):
                    await backend.delete(op.key)
                elif isinstance(op, IndexRemove):
                    await backend.index_remove(op.index, op.members)
                elif isinstance(op, IndexAdd):
                    await backend.index_add(op.index, op.members)
        return True

    async def _records_present(self, sid: str, ids: Sequence[str]) -> list[_Record]:
        records: list[_Record] = []
        for batch in _batches(ids):
            entries = await self.backend.get_many([_record_key(sid, i) for i in batch])
            records += (
                _load(self.codec, _record_key(sid, i), e.value, _Record)
                for i, e in zip(batch, entries, strict=True)
                if e is not None
            )
        return records

    # -------------------------------------------------------------- rollback

    async def rollback(self, scope: str, commit_id: str) -> int:
        """See `StateManager.rollback`."""
        scope = _check_scope(scope)
        full_id, sid = await self.resolve(commit_id)
        stored = await self._info(sid, full_id)
        if stored.info.scope != scope:
            raise InvalidArgumentError(
                f"commit {full_id[:12]} is of scope {stored.info.scope!r}, not {scope!r}"
            )
        target = await self._state(sid, full_id)
        for attempt in range(_ATTEMPTS):
            done = await self._try_rollback(scope, sid, target)
            if done is not None:
                return done
            await anyio.sleep(backoff(attempt, base=0.002, cap=0.2))
        raise ConflictError(f"rollback of scope {scope!r} lost {_ATTEMPTS} races in a row")

    async def _try_rollback(self, scope: str, sid: str, target: Mapping[str, str]) -> int | None:
        backend = self.backend
        keys: list[str] = []
        async for page in backend.scan_batches(escape_glob(scope) + "*"):
            keys += (key for key in page if _in_scope(scope, key))
        current: dict[str, Entry] = {}
        for batch in _batches(keys):
            entries = await backend.get_many(batch)
            current.update(
                (key, entry) for key, entry in zip(batch, entries, strict=True) if entry is not None
            )
        puts = sorted(
            key
            for key, digest in target.items()
            if key not in current or _digest(current[key].value) != digest
        )
        deletes = sorted(current.keys() - target.keys())
        if not puts and not deletes:
            return 0
        raws = await _read_blobs(backend, self.codec, sid, [target[key] for key in puts])
        ops: list[TxnOp] = [
            Put(key, raw, ttl=self.ttl) for key, raw in zip(puts, raws, strict=True)
        ]
        ops += [Delete(key) for key in deletes]
        versions = {key: (current[key].version if key in current else 0) for key in target}
        versions.update((key, entry.version) for key, entry in current.items())
        compare: list[TxnCompare] = [Version(key, v) for key, v in sorted(versions.items())]
        try:
            result = await backend.transact(compare, ops)
        except UnsupportedOperationError:
            pass
        except InvalidArgumentError:
            # Redis Cluster: the scope's keys are in several slots. Anything else is a bug.
            if not getattr(backend, "is_cluster", False):
                raise
        else:
            return len(ops) if result.succeeded else None
        return await self._rollback_by_key(ops, versions)

    async def _rollback_by_key(
        self, ops: Sequence[TxnOp], versions: Mapping[str, int]
    ) -> int | None:
        # Not atomic: each key on its own, each only if nobody wrote it since it was read.
        backend = self.backend
        try:
            for op in ops:
                if isinstance(op, Put):
                    await backend.set(
                        op.key, op.value, ttl=op.ttl, expected_version=versions[op.key]
                    )
                elif isinstance(op, Delete):
                    await backend.delete(op.key, expected_version=versions[op.key])
        except ConflictError:
            return None  # read again and go on from there
        return len(ops)


def _apply(state: dict[str, str], entries: Mapping[str, str | None]) -> None:
    for key, digest in entries.items():
        if digest is None:
            state.pop(key, None)
        else:
            state[key] = digest


def _replay(
    scope: str, state: dict[str, str], blobs: dict[str, bytes], changes: Sequence[Change]
) -> set[str]:
    """Apply the feed's `changes` (in feed order) to the scope's `state`; return the keys."""
    touched: set[str] = set()
    for change in changes:
        key = change.key
        if not _in_scope(scope, key):
            continue
        touched.add(key)
        if change.new is None:
            state.pop(key, None)
        else:
            digest = _digest(change.new)
            state[key] = digest
            blobs[digest] = change.new
    return touched
