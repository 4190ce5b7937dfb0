"""The Redis backend's durable change feed: stream names, feed ids, cursors, and reading back.

Storage. Every write script appends its change to a Redis stream in the same atomic step (see
`_redis_scripts`, `to_feed`). On a single server there is one stream per key prefix,
`__agenticstate_feed__:{key_prefix}`, with its counter at `__agenticstate_feedseq__:{key_prefix}`
(both in the reserved namespace: SCAN under a prefix never lists them). On Redis Cluster a script
may not cross slots, so there is one stream per prefix and slot:
`__agenticstate_feed__:{key_prefix}{TAG}`, where `TAG` is a short string whose CRC16 is that slot
(`slot_tag`: a table built once, lazily, of the first base-62 strings covering every slot), in
braces: the stream's hash tag, so it lives in that slot. The prefix comes first, so an ACL key
pattern per prefix (`~__agenticstate_feed__:app:*`) reaches its streams. A prefix holding a
brace would spoil the tag (`a{b:` makes Redis hash from its brace on), so then the tag comes
first instead: `__agenticstate_feed__:{TAG}{key_prefix}`. A `Stream` is (slot, prefix): 0 on one
server.

Feed ids are `<ms>-<n>`: `ms` the server's time at the write (never less than the id before it,
so ids rise even if a clock steps back), `n` the stream's own count of changes over its whole life
(trimming never resets it). Each entry carries the id before it, so a reader resuming after id
`E` knows that nothing is missing exactly when the first entry it reads names `E` as its
predecessor. Each entry also carries `u`, its place in its server's commit order (the clock in
microseconds when its script ran, never less than the stream's `u` before it): readers merge
several streams by it. Retention: the counter also holds the stream's count and bytes, and a
write that takes them past a bound (count by 1% or 32, bytes by 1%, or an entry older than
`max_age`) trims the oldest entries down to it, releasing what they hold by reference (see
`_redis_scripts`, "Values by reference").

Prefixes nest: a store reads its own stream, those of the prefixes nested in it (on one server,
the registry `__agenticstate_feeds__:{key_prefix}` a nested store joins before its first write,
and again in the write script that starts its stream, so the two are never apart; on a cluster,
the SCAN that finds the slots' streams) and those of the prefixes it is nested in (`ancestors`:
its own prefix says which), keeping its own keys. Cursors name a stream relative to the store's
prefix (`FeedNames.token`): a cursor belongs to the store that gave it.

Cursors on one server (`Position.point`) name a point in commit order: `r1:<id>` (a change of
the store's own stream), `r1:<id>@<stream>` (of another prefix's), `r1:<id>/<u>` (a head:
`feed_cursor`). Resuming reads the named stream after the id and every other stream from the
point's order on (the order of the change's entry, looked up; its millisecond where the entry is
gone). On a cluster the shards' streams are not ordered with each other, so a cursor is a
vector, `c1:<floor>:<stream>=<id>,...` (each id written as its time less the floor, a dot, and
its `n`: `c1:1700000000000:5=3.42`): for each listed stream, every change up to that id has been
seen; for every other stream, every change stamped before `floor` (server ms) and none after.
Only streams seen to change since the floor are listed, so a cursor stays small: a subscription
raises the floor with marker rounds (each primary publishes a marker after reading its clock,
`TIME`, which its reply returns; once every primary's marker has arrived, every change stamped
before the smallest of those times has been delivered). A cursor of a change lists that change's
own stream first. Clock assumption: each node's clock does not step back (the ids of one stream
never do; the floor compares ids of different nodes, so a node whose clock is behind the
others' is read from a lower floor, never skipped).

Order and patterns on a cluster. Slots deliver apart (a replay merges the streams by `u`, a live
subscription gets each shard as it arrives), so a change may come before one committed earlier on
another slot; a cursor holds what its read yielded before it, in that order, and resuming from it
yields exactly what came after it in that read (never a change committed after it but yielded
before it). A cluster cursor is exact for the pattern it was read with: the floor and the listed
slots say what that subscription read (a live connection receives only its patterns' channels).
Resumed with another pattern it misses nothing committed after its change, but may deliver that
pattern's changes of unlisted slots stamped at or after the floor and committed before its change
(duplicates, never gaps).

A cluster's feed has an epoch (`EPOCH`): a random token in one key per prefix
(`__agenticstate_feedseq__:{key_prefix}#`), made when it is first read and lost with the
streams when the cluster loses its data. Every cursor ends with the epoch its backend last read
(`c1:<floor>:<listing>/<epoch>`); resuming reads the epoch and refuses a cursor of another one
(`CursorExpiredError`): a cursor from before the loss, whatever streams it lists, and a head
cursor (`c1:<ms>:/<epoch>`, nothing listed) of another prefix or cluster. A backend reads the
epoch before its first write, after a write that started a stream (the first of its slot, or
the first after a loss), when resuming, catching up and making a head cursor; a cursor made in
between may carry the epoch before a loss and expire (never a gap). The epoch's key lives in
one slot: a primary that lost its data alone is told apart for the streams a cursor lists and,
when it held the epoch, for every stream.

Reading back (`READ`, `check_start`): one script returns a page of a stream after a position
(only the entries of the reader's keys, for a stream of an outer prefix) together with the
stream's last id and the first entry's predecessor, atomically, so a reader tells "nothing after
the cursor" (the last id is the cursor's) from "everything after it was trimmed" (the last id
is newer, the page empty or starting after a gap): the latter raises `CursorExpiredError`.
`LOOKUP` reads the entries a subscriber's notifications name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

from agenticstate.backends._redis_slots import SLOTS, slot_tag, slot_tail
from agenticstate.exceptions import CursorExpiredError, InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = [
    "COUNTER_NAMESPACE",
    "EPOCH",
    "FEED_NAMESPACE",
    "FIRSTS",
    "INLINE_MAX",
    "LOOKUP",
    "READ",
    "REFS_NAMESPACE",
    "REGISTRY_NAMESPACE",
    "RESOLVE_FUNCTION",
    "FeedNames",
    "Id",
    "Position",
    "Stream",
    "ancestors",
    "check_epoch",
    "check_not_ahead",
    "check_start",
    "cursor_place",
    "id_text",
    "make_cursor",
    "parse_cursor",
    "parse_id",
    "point_cursor",
    "registry_key",
    "slot_tag",
]

FEED_NAMESPACE = "__agenticstate_feed__:"
"""What every feed stream's name starts with."""
COUNTER_NAMESPACE = "__agenticstate_feedseq__:"
"""What every feed counter's name starts with (it holds the stream's last id and its `u`)."""
REGISTRY_NAMESPACE = "__agenticstate_feeds__:"
"""What every registry of nested feeds starts with (then the outer prefix; a set of prefixes)."""
REFS_NAMESPACE = "__agenticstate_feedref__:"
"""What every key's hash of values held by reference starts with, then the Redis key (on a
cluster, a key without a hash tag is followed by its slot's tag in braces; one with a brace but
no valid tag is preceded by it)."""
INLINE_MAX = 1024
"""A written value this size or larger (bytes, as stored) is held by reference in the feed: its
entry names the key and revision instead of carrying it (unless the write sets a TTL)."""

# Reading a change back with its values inline (`resolve`), shared by the scripts that read the
# feed (`READ`, `LOOKUP`) and those that write it (`_redis_scripts.REFS_FUNCTION`).
RESOLVE_FUNCTION = """local REFS_NS = 'REFS_NAMESPACE'
local function refs_of(key, tag)
  -- In the key's slot. On a cluster: a key with a hash tag keeps it; one without a brace gets
  -- its slot's tag after it; one with a brace but no tag, before it (the brace would spoil it).
  if tag == '' then return REFS_NS .. key end
  local open = string.find(key, '{', 1, true)
  if not open then return REFS_NS .. key .. tag end
  local close = string.find(key, '}', open + 1, true)
  if close and close > open + 1 then return REFS_NS .. key end
  return REFS_NS .. tag .. key
end
local function message_at(m)
  local first = string.find(m, ' ', 1, true)
  local second = first and string.find(m, ' ', first + 1, true)
  if not second or string.sub(m, second + 1, second + 1) ~= 'R' then return false end
  local at = second + 1
  local kind = string.sub(m, at + 17, at + 17)
  if kind == 'D' then return at, kind, at + 53 end
  return at, kind, at + 68
end
local function resolve(k, m, tag)
  local at, kind, o = message_at(m)
  if not at then return m end
  local flag = string.sub(m, o, o)
  if kind ~= 'V' and flag ~= '2' then return m end
  local refs = refs_of(k, tag)
  local head, old, rest = string.sub(m, 1, o - 1), '0', string.sub(m, o + 1)
  if flag == '2' then
    local held = redis.call('HGET', refs, string.sub(m, o + 11, o + 26))
    if not held or string.sub(held, 1, 1) ~= 'V' then return false end
    old = '1' .. string.sub(m, o + 1, o + 10) .. string.sub(held, 2)
    rest = string.sub(m, o + 27)
  elseif flag == '1' then
    local size = tonumber(string.sub(m, o + 1, o + 10))
    old = string.sub(m, o, o + 10 + size)
    rest = string.sub(m, o + 11 + size)
  end
  if kind == 'V' then
    local revstr = string.sub(m, at + 1, at + 16)
    local new = false
    local ok, cur = pcall(redis.call, 'GET', k)
    if ok and cur and string.byte(cur, 1) == 43 and string.sub(cur, 66, 81) == revstr then
      new = string.sub(cur, 98)
    else
      local held = redis.call('HGET', refs, revstr)
      if held and string.sub(held, 1, 1) == 'V' then new = string.sub(held, 2) end
    end
    if not new then return false end
    head = string.sub(head, 1, at + 16) .. 'W' .. string.sub(head, at + 18)
    rest = new
  end
  return head .. old .. rest
end
""".replace("REFS_NAMESPACE", REFS_NAMESPACE)


# KEYS: the stream, its counter; ARGV: where to start (an exclusive `(id`, an inclusive id, or
# `-`), how many entries to look at, a key prefix to keep ('' keeps all) and whether the stream
# is a cluster's ('1'; then its tag names the keys' hashes of references). Returns {the entries
# kept, the counter, how many were looked at, the predecessor named by the first one looked at,
# the last id looked at}, read in one atomic step. Each kept entry's message has its values
# inline (`resolve`); one whose value is gone ends in `?` after its header (`LOST`).
READ = (
    RESOLVE_FUNCTION
    + """
local page = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
local counter = redis.call('GET', KEYS[2])
if #page == 0 then return {page, counter, 0, false, false} end
local first = page[1][2]
local prev = false
for j = 1, #first, 2 do
  if first[j] == 'm' then prev = string.match(first[j + 1], '^X%S+ (%S+) ') or false end
end
local keep = ARGV[3]
local kept = page
if keep ~= '' then
  kept = {}
  for _, e in ipairs(page) do
    local f = e[2]
    for j = 1, #f, 2 do
      if f[j] == 'k' then
        if string.sub(f[j + 1], 1, #keep) == keep then kept[#kept + 1] = e end
        break
      end
    end
  end
end
local tag = ''
if ARGV[4] == '1' then tag = string.match(KEYS[1], '{[^{}]*}') or '' end
for _, e in ipairs(kept) do
  local f = e[2]
  local k, mi = '', false
  for j = 1, #f, 2 do
    if f[j] == 'k' then k = f[j + 1] elseif f[j] == 'm' then mi = j + 1 end
  end
  if mi then
    local m = f[mi]
    local whole = resolve(k, m, tag)
    if not whole then
      local first = string.find(m, ' ', 1, true)
      whole = string.sub(m, 1, string.find(m, ' ', first + 1, true)) .. '?'
    end
    f[mi] = whole
  end
end
return {kept, counter, #page, prev, page[#page][1]}
"""
)

# What a subscriber reads for the notifications it received (`_redis_pubsub`). KEYS: streams (of
# one slot); ARGV[1]: a channel to PUBLISH an empty marker on once read ('' for none), ARGV[2]:
# whether the streams are a cluster's ('1'), then pairs (a stream's position in KEYS, an id).
# Returns, for each asked entry, its fields `k`, `m` (its values inline: `resolve`; false when
# one is gone) and `u` ('' for an entry of an earlier version, which has none), or false where
# there is none.
LOOKUP = (
    RESOLVE_FUNCTION
    + """
local found = {}
local tag = ''
if ARGV[2] == '1' then tag = string.match(KEYS[1] or '', '{[^{}]*}') or '' end
for i = 3, #ARGV, 2 do
  local e = redis.call('XRANGE', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 1])[1]
  if e then
    local f = e[2]
    local k, m, u = '', '', ''
    for j = 1, #f, 2 do
      if f[j] == 'k' then k = f[j + 1] elseif f[j] == 'm' then m = f[j + 1]
      elseif f[j] == 'u' then u = f[j + 1] end
    end
    found[#found + 1] = {k, resolve(k, m, tag), u}
  else
    found[#found + 1] = false
  end
end
if ARGV[1] ~= '' then redis.call('PUBLISH', ARGV[1], '') end
return found
"""
)

# A cluster's feed epoch: a token naming this life of a prefix's feed, in one key (KEYS[1],
# `FeedNames.epoch_key`), lost with the streams when the cluster loses its data. ARGV[1]: a fresh
# token, kept if the key holds none. Returns the key's token.
EPOCH = """
local held = redis.call('GET', KEYS[1])
if held then return held end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"""

# KEYS: streams. Returns each one's first retained id, or false (a stream gone or empty).
FIRSTS = """
local firsts = {}
for j = 1, #KEYS do
  local e = redis.call('XRANGE', KEYS[j], '-', '+', 'COUNT', 1)[1]
  firsts[j] = e and e[1] or false
end
return firsts
"""

Id = tuple[int, int]
"""A feed id as numbers: (ms, n)."""

Stream = tuple[int, str]
"""A feed stream: (its cluster slot, 0 on one server; the key prefix that writes to it)."""


def parse_id(raw: bytes | str) -> Id:
    """`b"1700000000000-42"` as `(1700000000000, 42)` (a counter's `u` after a space is cut)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, n = text.partition(" ")[0].partition("-")
    return int(ms), int(n)


def id_text(at: Id) -> str:
    """`(ms, n)` as `"ms-n"`."""
    return f"{at[0]}-{at[1]}"


def ancestors(key_prefix: str) -> list[str]:
    """The prefixes a store under `key_prefix` is nested in, longest first (`""` last).

    Prefixes nest at colons: `app:prod:` is in `app:` and in `""`.
    """
    found = []
    end = key_prefix.rfind(":", 0, len(key_prefix) - 1)
    while end >= 0:
        found.append(key_prefix[: end + 1])
        end = key_prefix.rfind(":", 0, end)
    if key_prefix:
        found.append("")
    return found


def registry_key(key_prefix: str) -> str:
    """The set of prefixes nested in `key_prefix` that keep a feed (one server)."""
    return REGISTRY_NAMESPACE + key_prefix


def is_prefix(text: str) -> bool:
    """Whether `text` can be a key prefix (empty, or ending with `:`)."""
    return not text or text.endswith(":")


_UNKNOWN = object()


class FeedNames:
    """The feed's Redis keys: per key prefix one stream (on a cluster, one per slot).

    `key_prefix` is the store's own; `stream(slot, prefix)` names any prefix's (the stores
    nested in this one, and those it is nested in, write their own streams).
    """

    __slots__ = ("_names", "_tails", "cluster", "epoch", "epoch_key", "key_prefix", "plain")

    def __init__(self, key_prefix: str, *, cluster: bool) -> None:
        self.key_prefix = key_prefix
        self.cluster = cluster
        self.plain = (FEED_NAMESPACE + key_prefix, COUNTER_NAMESPACE + key_prefix)
        # A cluster's feed epoch (`EPOCH`): its key, and the value last read (`None`: unknown).
        self.epoch_key = COUNTER_NAMESPACE + key_prefix + "#"
        self.epoch: str | None = None
        self._names: dict[Stream, tuple[str, str]] = {}
        self._tails: dict[tuple[int, bytes], str | None] = {}

    def for_slot(self, slot: int) -> tuple[str, str]:
        """This store's own stream and counter in `slot` (on one server: the only ones)."""
        return self.stream((slot, self.key_prefix))

    def stream(self, stream: Stream) -> tuple[str, str]:
        """The stream and counter of `stream`: (slot, prefix)."""
        names = self._names.get(stream)
        if names is None:
            slot, prefix = stream
            tail = slot_tail(prefix, slot) if self.cluster else prefix
            names = (FEED_NAMESPACE + tail, COUNTER_NAMESPACE + tail)
            if len(self._names) < 65536:  # a cache, bounded
                self._names[stream] = names
        return names

    def prefix_of(self, tail: bytes, slot: int) -> str | None:
        """The prefix whose stream in `slot` is named `FEED_NAMESPACE + tail`, or `None`."""
        cached = self._tails.get((slot, tail), _UNKNOWN)
        if cached is not _UNKNOWN:
            return cached  # type: ignore[return-value]
        found: str | None = None
        try:
            text = tail.decode()
        except UnicodeDecodeError:
            text = ""
        candidates = [text]
        if self.cluster:
            candidates = []
            close = text.rfind("{")
            if close >= 0 and text.endswith("}"):
                candidates.append(text[:close])
            if text.startswith("{") and "}" in text:
                candidates.append(text[text.index("}") + 1 :])
        for prefix in candidates:
            if is_prefix(prefix) and self.stream((slot, prefix))[0] == FEED_NAMESPACE + text:
                found = prefix
                break
        if len(self._tails) < 65536:
            self._tails[(slot, tail)] = found
        return found

    def scan_match(self) -> str:
        """A SCAN pattern that finds the feed streams on a cluster node (check each's name)."""
        return FEED_NAMESPACE + "*"

    def stream_of_name(self, name: str, slot: int) -> Stream | None:
        """The stream `name` (found by SCAN, hashing to `slot`) is, if this store reads it.

        That is its own stream, one of a prefix nested in it, or one of a prefix it is nested
        in (whose writes may land in its keys).
        """
        if not name.startswith(FEED_NAMESPACE):
            return None
        prefix = self.prefix_of(name[len(FEED_NAMESPACE) :].encode(), slot)
        if prefix is None or not related(prefix, self.key_prefix):
            return None
        return slot, prefix

    # cursors: each stream written relative to this store's prefix

    def token(self, stream: Stream) -> str:
        """`stream` in a cursor: its slot, then how its prefix relates to this store's."""
        slot, prefix = stream
        own = self.key_prefix
        if prefix == own:
            return str(slot)
        if prefix.startswith(own):
            return f"{slot}+{quote(prefix[len(own) :], safe='')}"
        return f"{slot}-{len(own) - len(prefix)}"

    def of_token(self, token: str) -> Stream:
        """The stream a cursor's `token` names (raises `ValueError` if none)."""
        digits = len(token) - len(token.lstrip("0123456789"))
        slot = int(token[:digits])
        if not 0 <= slot < SLOTS or (slot and not self.cluster):
            raise ValueError(token)
        rest, own = token[digits:], self.key_prefix
        if not rest:
            return slot, own
        if rest[0] == "+":
            suffix = unquote(rest[1:], errors="strict")
            if not suffix or not is_prefix(suffix):
                raise ValueError(token)
            return slot, own + suffix
        if rest[0] == "-" and rest[1:].isdigit():
            cut = int(rest[1:])
            if not 0 < cut <= len(own) or not is_prefix(own[: len(own) - cut]):
                raise ValueError(token)
            return slot, own[: len(own) - cut]
        raise ValueError(token)


def related(prefix: str, key_prefix: str) -> bool:
    """Whether a store under `key_prefix` reads `prefix`'s stream (nested either way)."""
    return prefix.startswith(key_prefix) or key_prefix.startswith(prefix)


def make_cursor(
    names: FeedNames, floor: int, own: tuple[Stream, str] | None, listed: dict[Stream, str]
) -> str:
    """A cluster cursor: the change `own` and what came before it.

    Every change of `own`'s stream and of each listed stream up to its id, and of any other
    stream every change stamped before `floor`, has been seen. Written `c1:<floor>:<stream>=<ms
    - floor>.<n>,...`, `own` first (each id's time relative to the floor: a few digits instead
    of thirteen).
    """
    parts = [] if own is None else [_listing(names, own[0], own[1], floor)]
    parts += [
        _listing(names, stream, at, floor)
        for stream, at in listed.items()
        if own is None or stream != own[0]
    ]
    epoch = "" if names.epoch is None else "/" + names.epoch
    return f"c1:{floor}:{','.join(parts)}{epoch}"


def point_cursor(names: FeedNames, stream: Stream, at: str, order: int | None = None) -> str:
    """A cursor on one server: the change `at` of `stream`, and everything before it.

    `r1:<id>` for a change of this store's own stream, `r1:<id>@<stream>` for one of another
    prefix's (nested either way); `/<order>` when it names a time rather than a change (a
    head: `feed_cursor`). The same change has the same cursor in any read.
    """
    relation = names.token(stream)[1:]  # "": this store's own stream
    text = f"r1:{at}@{relation}" if relation else "r1:" + at
    return text if order is None else f"{text}/{order}"


def _listing(names: FeedNames, stream: Stream, at: str, floor: int) -> str:
    ms, _, n = at.partition("-")
    return f"{names.token(stream)}={int(ms) - floor}.{n}"


def cursor_place(names: FeedNames, cursor: str) -> tuple[Stream, Id]:
    """The stream and id of the change a cursor was made for (a cluster's: its first listing)."""
    if cursor.startswith("r1:"):
        position = parse_cursor(cursor, names)
        ((stream, at),) = position.ids.items()
        return stream, at
    floor, _, listed = cursor[3:].partition(":")
    token, _, at_text = listed.partition("/")[0].split(",", 1)[0].partition("=")
    delta, _, n = at_text.partition(".")
    return names.of_token(token), (int(floor) + int(delta), int(n))


@dataclass
class Position:
    """Where a cursor stands: per stream the last id seen, else everything before `floor`.

    `earliest`: `EARLIEST`, everything retained. On one server (`order` is set, or to be looked
    up: `None` with `point`), a cursor names a point in the server's commit order: its stream
    up to its id, and of every other stream the entries whose order (`u`) is at most `order`;
    `floor` is then `order`'s millisecond, where reading those streams starts.
    """

    floor: int = 0
    ids: dict[Stream, Id] = field(default_factory=dict)
    earliest: bool = False
    point: bool = False
    order: int | None = None
    epoch: str | None = None

    def skips(self, stream: Stream, order: int, named: Iterable[Stream] = ()) -> bool:
        """Whether an entry of `stream` with `order` was seen, though read from `start`.

        On one server a stream the cursor does not name (`named`: those it names, or
        `ids` when not given) is read from the point's millisecond: the entries up to the
        point's order came before it.
        """
        return (
            self.point
            and self.order is not None
            and stream not in (named or self.ids)
            and order <= self.order
        )

    def start(self, stream: Stream) -> str:
        """Where to read `stream` from (XRANGE's start)."""
        at = self.ids.get(stream)
        if at is not None:
            return "(" + id_text(at)
        if self.earliest:
            return "-"
        return f"({self.floor}-0"  # no id has n = 0: the same as from `floor`, inclusive


def parse_cursor(cursor: str, names: FeedNames) -> Position:
    """The position a cursor names.

    Raises:
        InvalidArgumentError: Not a cursor of this kind of backend (`r1:` on one server,
            `c1:` on a cluster), or malformed.
    """
    if not isinstance(cursor, str):
        raise InvalidArgumentError(f"since must be a cursor (a str), not {type(cursor).__name__}")
    cluster = names.cluster
    kind = "c1:" if cluster else "r1:"
    if not cursor.startswith(kind):
        raise InvalidArgumentError(
            f"{cursor!r} is not a cursor of this {'Redis Cluster' if cluster else 'Redis'} "
            f"backend (they start with {kind!r})"
        )
    try:
        body = cursor[3:]
        if not cluster:
            body, slash, order_text = body.partition("/")
            body, at_sign, token = body.partition("@")
            ms_text, dash, n_text = body.partition("-")
            if not dash or (at_sign and not token):
                raise ValueError(cursor)
            at = (_number(ms_text), _number(n_text))
            order = _number(order_text) if slash else None
            stream = names.of_token("0" + token)
            floor = at[0] if order is None else order // 1000
            return Position(floor=floor, ids={stream: at}, point=True, order=order)
        floor_text, _, listed = body.partition(":")
        listed, slash, epoch = listed.partition("/")
        position = Position(floor=_number(floor_text))
        if slash:
            if not _EPOCH.fullmatch(epoch):
                raise ValueError(cursor)
            position.epoch = epoch
        for part in filter(None, listed.split(",")):
            token, _, at_text = part.partition("=")
            delta, dot, n = at_text.partition(".")
            stream = names.of_token(token)
            if not dot:
                raise ValueError(part)
            ms = position.floor + _number(delta, signed=True)
            if not 0 <= ms <= NUMBER_MAX:
                raise ValueError(part)
            position.ids[stream] = (ms, _number(n))
    except ValueError:
        raise InvalidArgumentError(f"{cursor!r} is not a well-formed cursor") from None
    return position


NUMBER_MAX = 2**63 - 1
"""The largest number a cursor's field may hold (an id's time or count, a clock, a floor).

Redis takes a stream id's parts up to 2**64 - 1; a cursor past 2**63 - 1 (292 million years of
milliseconds) is malformed, refused before anything is sent.
"""
_DIGITS = re.compile(r"[0-9]{1,19}")
_EPOCH = re.compile(r"[0-9a-f]{8}")


def _number(text: str, *, signed: bool = False) -> int:
    """A cursor's numeric field: ASCII digits (a `-` first if `signed`), at most `NUMBER_MAX`.

    Raises:
        ValueError: Anything else (`+1`, `1_0`, ` 1`, other scripts' digits, out of range).
    """
    digits = text[1:] if signed and text[:1] == "-" else text
    if not _DIGITS.fullmatch(digits):
        raise ValueError(text)
    value = int(text)
    if abs(value) > NUMBER_MAX:
        raise ValueError(text)
    return value


def check_not_ahead(cursor: str, position: Position, clocks: Sequence[int], now_us: int) -> None:
    """Raise `CursorExpiredError` if the cursor names a time after the feed's head.

    `clocks`: every primary's clock in ms (a cluster: the cursor's floor may not pass the
    largest); `now_us`: the server's clock in microseconds (one server: a head cursor's order
    may not pass it). Such a cursor is from another feed (another server, a clock that ran
    ahead): resuming from it would skip the changes up to that time.
    """
    if position.earliest:
        return
    if position.point:
        ahead = position.order is not None and position.order > now_us
    else:
        ahead = bool(clocks) and position.floor > max(clocks)
    if ahead:
        raise CursorExpiredError(cursor, _expired(cursor, trimmed=False))


def check_epoch(cursor: str, position: Position, epoch: str) -> None:
    """Raise `CursorExpiredError` if a cluster cursor is of another life of the feed.

    `epoch`: the feed's epoch now (`EPOCH`). A cursor without one (of an earlier version) is
    not checked.
    """
    if position.epoch is not None and position.epoch != epoch and not position.earliest:
        raise CursorExpiredError(cursor, _expired(cursor, trimmed=False))


def check_start(
    cursor: str, position: Position, stream: Stream, first_prev: Id | None, last: Id | None
) -> None:
    """Raise `CursorExpiredError` unless reading `stream` from `position` misses nothing.

    `first_prev`: the predecessor named by the first entry read (`None`: none was read);
    `last`: the stream's last id when that page was read (`None`: the stream never had one).
    """
    at = position.ids.get(stream)
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
