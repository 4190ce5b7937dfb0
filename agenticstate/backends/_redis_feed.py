"""The Redis backend's durable change feed: stream names, feed ids, cursors, and reading back.

Storage. Every write script appends its change to a Redis stream in the same atomic step (see
`_redis_scripts`, `record`). On a single server there is one stream per key prefix,
`__agenticstate_feed__:{key_prefix}`, with its counter at `__agenticstate_feedseq__:{key_prefix}`
(both in the reserved namespace: SCAN under a prefix never lists them). On Redis Cluster a script
may not cross slots, so there is one stream per slot: `__agenticstate_feed__:{key_prefix}{TAG}`,
where `TAG` is a short string whose CRC16 is that slot (`slot_tag`: a table built once, lazily,
of the first base-62 strings covering every slot), in braces: the stream's hash tag, so it lives
in that slot. The prefix comes first, so an ACL key pattern per prefix
(`~__agenticstate_feed__:app:*`) reaches its streams. A prefix holding a brace would spoil the
tag (`a{b:` makes Redis hash from its brace on), so then the tag comes first instead:
`__agenticstate_feed__:{TAG}{key_prefix}`.

Feed ids are `<ms>-<n>`: `ms` the server's time at the write (never less than the id before it,
so ids rise even if a clock steps back), `n` the stream's own count of changes over its whole life
(trimming never resets it). Each entry carries the id before it, so a reader resuming after id
`E` knows that nothing is missing exactly when the first entry it reads names `E` as its
predecessor. Retention is `XADD ... MAXLEN ~ max_changes` (Redis trims whole stream nodes, so it
keeps somewhat more, never fewer) and `XTRIM MINID ~ now - max_age` with each write.

Cursors. On one server a cursor is `r1:<id>`: the change with that id and every change before it
have been seen. On a cluster the shards' streams are not ordered with each other, so a cursor is a
vector, `c1:<floor>:<slot>=<id>,...` (each id written as its time less the floor, a dot, and its
`n`: `c1:1700000000000:5=3.42`): for each listed slot, every change up to that id has been
seen; for every other slot, every change stamped before `floor` (server ms) and none after.
Only slots seen to change since the floor are listed, so a cursor stays small: a subscription
raises the floor with marker rounds (each primary publishes its clock, `TIME`; once every
primary's marker has arrived, every change stamped before the smallest of those times has been
read). A cursor of a change lists that change's own slot first. Clock assumption: each node's
clock does not step back (the ids of one stream never do; the floor compares ids of different
nodes, so a node whose clock is behind the others' is read from a lower floor, never skipped).

Order and patterns on a cluster. Slots deliver apart (a replay merges the streams by id, a live
subscription gets each shard as it arrives), so a change may come before one committed earlier on
another slot; a cursor holds what its read yielded before it, in that order, and resuming from it
yields exactly what came after it in that read (never a change committed after it but yielded
before it). A cluster cursor is exact for the pattern it was read with: the floor and the listed
slots say what that subscription read (a live connection receives only its patterns' channels).
Resumed with another pattern it misses nothing committed after its change, but may deliver that
pattern's changes of unlisted slots stamped at or after the floor and committed before its change
(duplicates, never gaps). A cluster cursor names no store: a head cursor (`c1:<ms>:`, nothing
listed) of another key prefix or cluster is taken as a time here, not refused.

Reading back (`read_page`, `check_start`): one script returns a page of a stream after a
position together with the stream's last id, atomically, so a reader tells "nothing after the
cursor" (the last id is the cursor's) from "everything after it was trimmed" (the last id is
newer, the page empty or starting after a gap): the latter raises `CursorExpiredError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agenticstate.backends._redis_slots import SLOTS, slot_tag
from agenticstate.exceptions import CursorExpiredError, InvalidArgumentError

__all__ = [
    "COUNTER_NAMESPACE",
    "FEED_NAMESPACE",
    "READ",
    "FeedNames",
    "Id",
    "Position",
    "check_start",
    "cluster_cursor",
    "cursor_place",
    "id_text",
    "parse_cursor",
    "parse_id",
    "plain_cursor",
    "slot_tag",
]

FEED_NAMESPACE = "__agenticstate_feed__:"
"""What every feed stream's name starts with."""
COUNTER_NAMESPACE = "__agenticstate_feedseq__:"
"""What every feed counter's name starts with (it holds the stream's last id)."""


# KEYS: the stream, its counter; ARGV: where to start (an exclusive `(id`, or `-`), how many.
# Returns {entries, the stream's last id or false}, read in one atomic step.
READ = """
local page = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
return {page, redis.call('GET', KEYS[2])}
"""

Id = tuple[int, int]
"""A feed id as numbers: (ms, n)."""


def parse_id(raw: bytes | str) -> Id:
    """`b"1700000000000-42"` as `(1700000000000, 42)`."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, n = text.partition("-")
    return int(ms), int(n)


def id_text(at: Id) -> str:
    """`(ms, n)` as `"ms-n"`."""
    return f"{at[0]}-{at[1]}"


class FeedNames:
    """The feed's Redis keys for one key prefix: one stream (or one per cluster slot)."""

    __slots__ = ("_by_slot", "cluster", "key_prefix", "plain")

    def __init__(self, key_prefix: str, *, cluster: bool) -> None:
        self.key_prefix = key_prefix
        self.cluster = cluster
        self.plain = (FEED_NAMESPACE + key_prefix, COUNTER_NAMESPACE + key_prefix)
        self._by_slot: dict[int, tuple[str, str]] = {}

    def for_slot(self, slot: int) -> tuple[str, str]:
        """The stream and counter of `slot` (on one server: the only ones)."""
        if not self.cluster:
            return self.plain
        names = self._by_slot.get(slot)
        if names is None:
            tag = "{" + slot_tag(slot) + "}"
            tail = tag + self.key_prefix if "{" in self.key_prefix else self.key_prefix + tag
            names = self._by_slot[slot] = (FEED_NAMESPACE + tail, COUNTER_NAMESPACE + tail)
        return names

    def scan_match(self) -> str:
        """A SCAN pattern that finds this prefix's streams on a cluster node (check each)."""
        prefix = _escape(self.key_prefix)
        return FEED_NAMESPACE + ("{*}" + prefix if "{" in self.key_prefix else prefix + "{*}")

    def slot_of_stream(self, name: str, slot: int) -> bool:
        """Whether `name` (found by SCAN, hashing to `slot`) is this prefix's stream of `slot`."""
        return self.for_slot(slot)[0] == name


def _escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def plain_cursor(at: bytes | str) -> str:
    """The cursor of the change with feed id `at` on one server."""
    return "r1:" + (at.decode() if isinstance(at, bytes) else at)


def cluster_cursor(floor: int, own: tuple[int, str] | None, listed: dict[int, str]) -> str:
    """A cluster cursor: `own` (slot, id) first, then every other listed slot.

    Each listed id is written `<slot>=<ms - floor>.<n>`, its time relative to the floor (a few
    digits instead of thirteen: cursors are stored and sent with every change).
    """
    parts = [] if own is None else [_listing(own[0], own[1], floor)]
    parts += [
        _listing(slot, at, floor) for slot, at in listed.items() if own is None or slot != own[0]
    ]
    return f"c1:{floor}:{','.join(parts)}"


def _listing(slot: int, at: str, floor: int) -> str:
    ms, _, n = at.partition("-")
    return f"{slot}={int(ms) - floor}.{n}"


def cursor_place(cursor: str) -> tuple[int, Id]:
    """The stream (slot; 0 on one server) and id of the change a cursor was made for."""
    if cursor.startswith("r1:"):
        return 0, parse_id(cursor[3:])
    floor, _, listed = cursor[3:].partition(":")
    slot, _, at = listed.split(",", 1)[0].partition("=")
    delta, _, n = at.partition(".")
    return int(slot), (int(floor) + int(delta), int(n))


@dataclass
class Position:
    """Where a cursor stands: per stream the last id seen, else everything before `floor`.

    On one server the stream is slot 0 and `floor` is unused (0). `earliest`: `EARLIEST`,
    everything retained.
    """

    floor: int = 0
    ids: dict[int, Id] = field(default_factory=dict)
    earliest: bool = False

    def start(self, slot: int) -> str:
        """Where to read `slot`'s stream from (XRANGE's start)."""
        at = self.ids.get(slot)
        if at is not None:
            return "(" + id_text(at)
        if self.earliest:
            return "-"
        return f"({self.floor}-0"  # no id has n = 0: the same as from `floor`, inclusive


def parse_cursor(cursor: str, *, cluster: bool) -> Position:
    """The position a cursor names.

    Raises:
        InvalidArgumentError: Not a cursor of this kind of backend (`r1:` on one server,
            `c1:` on a cluster), or malformed.
    """
    if not isinstance(cursor, str):
        raise InvalidArgumentError(f"since must be a cursor (a str), not {type(cursor).__name__}")
    kind = "c1:" if cluster else "r1:"
    if not cursor.startswith(kind):
        raise InvalidArgumentError(
            f"{cursor!r} is not a cursor of this {'Redis Cluster' if cluster else 'Redis'} "
            f"backend (they start with {kind!r})"
        )
    try:
        if not cluster:
            at = parse_id(cursor[3:])
            if at[0] < 0 or at[1] < 0:
                raise ValueError(cursor)
            return Position(ids={0: at})
        floor_text, _, listed = cursor[3:].partition(":")
        position = Position(floor=int(floor_text))
        for part in filter(None, listed.split(",")):
            slot_text, _, at_text = part.partition("=")
            delta, dot, n = at_text.partition(".")
            slot = int(slot_text)
            if not dot or not 0 <= slot < SLOTS or int(n) < 0:
                raise ValueError(part)
            position.ids[slot] = (position.floor + int(delta), int(n))
    except ValueError:
        raise InvalidArgumentError(f"{cursor!r} is not a well-formed cursor") from None
    return position


def check_start(
    cursor: str, position: Position, slot: int, first_prev: Id | None, last: Id | None
) -> None:
    """Raise `CursorExpiredError` unless reading `slot` from `position` misses nothing.

    `first_prev`: the predecessor named by the first entry read (`None`: none was read);
    `last`: the stream's last id when that page was read (`None`: the stream never had one).
    """
    at = position.ids.get(slot)
    if at is None and position.earliest:
        return
    if at is not None:
        # Resuming after a change that this stream holds (or held): the first entry after it
        # must name it, or, with none after it, the stream must end at it.
        named = first_prev if first_prev is not None else (last or (0, 0))
        if named != at:
            raise CursorExpiredError(cursor, _expired(cursor, trimmed=named > at))
        return
    # Everything before the floor was seen: the entry before the first one read must be older.
    before = first_prev if first_prev is not None else last
    if before is not None and before >= (position.floor, 0):
        raise CursorExpiredError(cursor, _expired(cursor, trimmed=True))


def _expired(cursor: str, trimmed: bool) -> str:  # a message helper
    if trimmed:
        return (
            f"the changes after cursor {cursor!r} are no longer retained (the feed was trimmed "
            "past it); re-read the state and resume from a new cursor"
        )
    return (
        f"cursor {cursor!r} is not from this store's feed as it is now (the server restarted "
        "without its data, or the feed was deleted); re-read the state and resume from a new "
        "cursor"
    )
