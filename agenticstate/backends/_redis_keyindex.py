"""The Redis backend's key index: every record's name in a sorted set, read by listings.

Layout. Each key prefix has a lexicographic sorted set of the Redis names (full names, the prefix
included; every score 0) of the records written through it: `__agenticstate_keys__:{key_prefix}` on
one server; on Redis Cluster one per prefix and slot, `__agenticstate_keys__:{key_prefix}{TAG}`
(`slot_tag`; the tag first if the prefix holds a brace), as the revision counters and the feed's
streams are named, so a write's script touches its own slot only. The index also holds its expiry
schedule: for each name with a TTL, a member `<NUL><expiry in server ms, 15 digits><name>` (the NUL
sorts it before every name, so listings never meet it). Beside each index, `<index>#braced` (the
braced set; in the index's slot) holds the names whose key (after the writing store's prefix) has
two `}` or more: the names a skip-scan's `*` may match across a second `}`. Per prefix,
`__agenticstate_keys__:{key_prefix}#built` marks an index built over the records a previous release
left (`build`), and `__agenticstate_keys__:{key_prefix}#nested` is the set of prefixes nested in it
that write records (a nested store joins it before its first write, as the feed's registry), so an
outer store's listing reads their indexes too. On a cluster,
`__agenticstate_keys__:{key_prefix}#slots` is the registry of the slots whose index may hold a
name: the slot numbers, and `COMPLETE` once it covers every name the index held when it was made
(`USED_SLOTS`, over every slot's index). A writer adds a slot before its first write to it (once
per process and slot), so the registry is a superset of the slots in use: a writer killed between
the two leaves a slot whose index is empty, never a name in an unregistered slot.

Writes. Every write script is given the written key's index as its last `KEYS` entry (after the
history lists) and takes it off first (`take_key_index`, run before the script's body, so the
rest of the script reads its usual layout). The `write` function adds the name (`index_put`: one
ZADD; with a TTL one more, its schedule member), the `drop` function removes it (`index_drop`),
in the same atomic step as the record and before it (a write of a braced key is also given
the braced set, after the index, and the prefix's length as its last ARGV: the set gains or
loses the name in the same step): the index never misses a record written
through this library, and an index another client wrote over (WRONGTYPE) stops the script before
it writes anything (`ForeignRecordError` naming the index). Redis expires keys by itself and
leaves their names in the index: each write script then removes up to two names whose expiry
passed (`trim_due`), and listings check every name they read and remove the dead ones they meet.

Listings (`LIST`). One script reads one or more indexes (one server: the store's, those of the
prefixes it is nested in and those nested in it; a cluster slot: the same in that slot; a
cluster primary without a hash tag to go by: those of the registered slots it serves, with the
`allow-cross-slot-keys` script flag) over the lexicographic range of the pattern's literal
prefix, a page of names at a time, keeps the names that exist and removes the others.
`TAGS` reads the same indexes for the distinct hash tags under a prefix (`scan_tags`): one
ZRANGE BYLEX LIMIT 0 1 per tag, jumping past the rest of each tag's names. `SKIP` answers
`<literal>*}<rest>` the same way: per entity, one jump and one range of the names starting with
`<entity>}<rest's literal>`, and the entity's range of the braced set.
"""

from __future__ import annotations

import hashlib

from agenticstate.backends._redis_slots import slot_tail

__all__ = [
    "BUILD",
    "BUILD_SHA",
    "KEEP_BUILD_LOCK",
    "KEEP_BUILD_LOCK_SHA",
    "KEY_INDEX_FUNCTION",
    "KEY_INDEX_NAMESPACE",
    "LIST",
    "LIST_ACROSS_SLOTS",
    "LIST_ACROSS_SLOTS_SHA",
    "LIST_SHA",
    "RELEASE_BUILD_LOCK",
    "RELEASE_BUILD_LOCK_SHA",
    "SKIP",
    "SKIP_ACROSS_SLOTS",
    "SKIP_ACROSS_SLOTS_SHA",
    "SKIP_SHA",
    "SLOTS_COMPLETE",
    "TAGS",
    "TAGS_ACROSS_SLOTS",
    "TAGS_ACROSS_SLOTS_SHA",
    "TAGS_SHA",
    "USED_SLOTS",
    "USED_SLOTS_SHA",
    "KeyIndexNames",
    "braced_set",
    "is_braced",
    "lex_range",
    "pinned_slot_key",
]

KEY_INDEX_NAMESPACE = "__agenticstate_keys__:"
"""What every key index's (and its schedule's, marker's and registry's) name starts with."""

BUILT_SUFFIX = "#built"
BUILDING_SUFFIX = "#building"
BRACED_SUFFIX = "#braced"
NESTED_SUFFIX = "#nested"
SLOTS_SUFFIX = "#slots"
SLOTS_COMPLETE = "complete"
"""The slot registry's member saying it covers every slot whose index held a name when made."""


class KeyIndexNames:
    """The key indexes of one key prefix: one (or one per cluster slot), and their companions."""

    __slots__ = (
        "_by_slot",
        "building",
        "built",
        "cluster",
        "nested",
        "plain",
        "prefix",
        "slots",
    )

    def __init__(self, key_prefix: str, *, cluster: bool) -> None:
        self.prefix = key_prefix
        self.cluster = cluster
        self.plain = KEY_INDEX_NAMESPACE + key_prefix
        self.built = self.plain + BUILT_SUFFIX
        self.building = self.plain + BUILDING_SUFFIX
        self.nested = self.plain + NESTED_SUFFIX
        self.slots = self.plain + SLOTS_SUFFIX
        self._by_slot: dict[int, str] = {}

    def index(self, slot: int) -> str:
        """The index of `slot` (on one server: the only one)."""
        if not self.cluster:
            return self.plain
        name = self._by_slot.get(slot)
        if name is None:
            name = self._by_slot[slot] = KEY_INDEX_NAMESPACE + slot_tail(self.prefix, slot)
        return name


def braced_set(index: str) -> str:
    """The braced names' set of key index `index` (in its slot: the index's tag comes first)."""
    return index + BRACED_SUFFIX


def is_braced(key: str) -> bool:
    """Whether a key (after its store's prefix) goes in the braced set: two `}` or more."""
    return key.count("}") >= 2


def lex_range(start: str) -> tuple[bytes, bytes]:
    """The ZRANGE BYLEX bounds of the names starting with `start` (every name when empty).

    UTF-8 holds no 0xFF byte, so the names starting with `start` end before the same bytes with
    the last one raised by one. Every name is above byte 1 (no name starts with a control
    character), the schedule's members below it.
    """
    if not start:
        return b"[\x01", b"+"
    raw = start.encode("utf-8", "surrogatepass")
    return b"[" + raw, b"(" + raw[:-1] + bytes((raw[-1] + 1,))


def pinned_slot_key(literal: str, *, whole: bool) -> str | None:
    """A name whose slot every name starting with `literal` shares, if there is one.

    Redis Cluster hashes a name by its first `{...}` when that is not empty: once `literal`
    holds a complete, non-empty first tag, every name starting with it is in that tag's slot.
    `whole`: the pattern is `literal` itself (no metacharacter), so its one name pins it.
    """
    start = literal.find("{")
    if start >= 0:
        end = literal.find("}", start + 1)
        if end > start + 1:
            return literal[: end + 1]
    return literal if whole else None


# The write scripts' part (see the module docstring). Run first, before the script's body:
# `key_index` is the index when the last of KEYS is one (taken off), else false (a call
# without it: a transaction that only reads). `index_put(name, expires, cur, now)` after a write
# of `name` (`expires` its expiry in ms, 0 = none; `cur` the record it replaced or false),
# `index_drop(name, cur, now)` after a delete. The schedule's members are in the index too,
# before every name: NUL, the expiry (15 digits), the name. `trim_due` removes, once a script,
# up to two schedule members whose time passed, and their names when the key is gone.
KEY_INDEX_FUNCTION = f"""
local function take_key_index()
  local n = #KEYS
  local ns = '{KEY_INDEX_NAMESPACE}'
  if n >= 1 and string.sub(KEYS[n], 1, #ns) == ns then
    local found = KEYS[n]
    KEYS[n] = nil
    return found
  end
  return false
end
local key_index = take_key_index()
-- The braced names' set, when the script is given it (after its index): it holds the names
-- whose key (after the writer's prefix, ARGV's last: its length in bytes) has two `}}` or more.
local key_braced, key_braced_from = false, 0
if key_index and string.sub(key_index, -7) == '#braced' then
  key_braced = key_index
  key_braced_from = tonumber(ARGV[#ARGV]) + 1
  ARGV[#ARGV] = nil
  key_index = take_key_index()
end
local key_index_trimmed = false
local function is_braced(name)
  local at = string.find(name, '}}', key_braced_from, true)
  return at ~= nil and string.find(name, '}}', at + 1, true) ~= nil
end
-- A command on the index; another type there (a client wrote over it) is refused by name.
local function icall(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    error({{err = 'WRONGTYPE ' .. key_index .. ' is not an agenticstate key index'}})
  end
  return reply
end
local function trim_due(now)
  if key_index_trimmed then return end
  key_index_trimmed = true
  -- Due: expired a millisecond before this script's clock (Redis has removed the key by now).
  local due = icall('ZRANGE', key_index, '[\\0', string.format('(\\0%015d', now - 1),
    'BYLEX', 'LIMIT', 0, 2)
  for _, member in ipairs(due) do
    icall('ZREM', key_index, member)
    local name = string.sub(member, 17)
    if redis.call('EXISTS', name) == 0 then
      icall('ZREM', key_index, name)
      if key_braced then icall('ZREM', key_braced, name) end
    end
  end
end
local function expiry_of(cur)
  if not cur then return 0 end
  return tonumber(string.sub(cur, 51, 65)) or 0
end
local function index_put(name, expires, cur, now)
  if not key_index then return end
  trim_due(now)  -- first: the name written now does not exist yet
  icall('ZADD', key_index, 0, name)
  if key_braced and is_braced(name) then icall('ZADD', key_braced, 0, name) end
  local before = expiry_of(cur)
  if before ~= expires then
    if before > 0 then
      icall('ZREM', key_index, string.format('\\0%015d', before) .. name)
    end
    if expires > 0 then
      icall('ZADD', key_index, 0, string.format('\\0%015d', expires) .. name)
    end
  end
end
local function index_drop(name, cur, now)
  if not key_index then return end
  trim_due(now)
  icall('ZREM', key_index, name)
  if key_braced then icall('ZREM', key_braced, name) end
  local before = expiry_of(cur)
  if before > 0 then
    icall('ZREM', key_index, string.format('\\0%015d', before) .. name)
  end
end
"""

# KEYS: indexes; ARGV: the range's low and high bounds (ZRANGE BYLEX), how many names to look
# at, at most, then where to start: the position among the indexes and the low bound there.
# Returns {the names that exist, the position to go on from and its low bound} (false, false:
# done). A name that is gone leaves the index (and its schedule) here.
_LIST_BODY = """
local low, high, budget = ARGV[1], ARGV[2], tonumber(ARGV[3])
local pos, from = tonumber(ARGV[4]), ARGV[5]
local found, looked = {}, 0
while pos <= #indexes do
  local index = indexes[pos]
  local page = redis.call('ZRANGE', index, from, high, 'BYLEX', 'LIMIT', 0, budget - looked)
  for _, name in ipairs(page) do
    if redis.call('EXISTS', name) == 1 then
      found[#found + 1] = name
    else
      redis.call('ZREM', index, name)  -- its schedule member goes when due (`trim_due`)
    end
  end
  looked = looked + #page
  if looked >= budget then return {found, pos, '(' .. page[#page]} end
  pos = pos + 1
  from = low
end
return {found, false, false}
"""
LIST = "local indexes = KEYS\n" + _LIST_BODY


def _across_slots(body: str, fixed: int) -> str:
    """`body` over the indexes of several slots of one cluster node (Redis 7.0 or later).

    A command's declared keys must share a slot, so the indexes come in ARGV after the
    `fixed` arguments `body` reads, and the script is flagged to read several slots.
    """
    return (
        "#!lua flags=allow-cross-slot-keys\n"
        "local indexes = {}\n"
        f"for i = {fixed + 1}, #ARGV do indexes[i - {fixed}] = ARGV[i] end\n" + body
    )


LIST_ACROSS_SLOTS = _across_slots(_LIST_BODY, 5)

# The distinct tags of the names in the range (`Backend.scan_tags`): ARGV as `LIST`'s, then the
# byte length of the range's start (`<prefix>{`). One ZRANGE BYLEX LIMIT 0 1 per step: a name
# with a `}` after the start gives its tag (when it exists; a dead one leaves the index and the
# next name is read) and the next step starts past every name of that tag (`}` raised to `~`);
# a name without one is stepped over alone. Returns {the tags, then as `LIST`}.
_TAGS_BODY = """
local low, high, budget = ARGV[1], ARGV[2], tonumber(ARGV[3])
local pos, from, start = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local found, looked = {}, 0
while pos <= #indexes do
  local index = indexes[pos]
  while true do
    if looked >= budget then return {found, pos, from} end
    looked = looked + 1
    local name = redis.call('ZRANGE', index, from, high, 'BYLEX', 'LIMIT', 0, 1)[1]
    if not name then break end
    local close = string.find(name, '}', start + 1, true)
    if not close then
      from = '(' .. name
    elseif redis.call('EXISTS', name) == 0 then
      redis.call('ZREM', index, name)
      from = '(' .. name
    else
      found[#found + 1] = string.sub(name, start + 1, close - 1)
      from = '[' .. string.sub(name, 1, close - 1) .. '~'
    end
  end
  pos = pos + 1
  from = low
end
return {found, false, false}
"""
TAGS = "local indexes = KEYS\n" + _TAGS_BODY
TAGS_ACROSS_SLOTS = _across_slots(_TAGS_BODY, 6)

# The positions (1-based) of the indexes given in ARGV that exist (hold a name), on one cluster
# node: how the slot registry of an index written before it existed is made.
USED_SLOTS = """#!lua flags=allow-cross-slot-keys
local used = {}
for i = 1, #ARGV do
  if redis.call('EXISTS', ARGV[i]) == 1 then used[#used + 1] = i end
end
return used
"""

# Build an index over records a previous release wrote (no index): KEYS: the index, its braced
# set, other indexes (ARGV[1] of them: those of prefixes that nest with this one), then names
# found by SCAN; ARGV[2]: the prefix's length in bytes. Each name that is a record and in none of
# the other indexes joins the index (and its schedule, if it expires; and the braced set, if its
# key holds two `}`). Returns how many joined.
BUILD = """
local added = 0
local others = tonumber(ARGV[1])
local from = tonumber(ARGV[2]) + 1
for i = 3 + others, #KEYS do
  local name = KEYS[i]
  local held = false
  for j = 3, 2 + others do
    if #redis.call('ZRANGE', KEYS[j], '[' .. name, '[' .. name, 'BYLEX') > 0 then held = true end
  end
  if not held and redis.call('TYPE', name).ok == 'string' then
    local head = redis.call('GETRANGE', name, 0, 96)
    local first = string.byte(head, 1)
    if (first == 43 and #head >= 97) or (first == 48 and #head >= 65) then
      added = added + redis.call('ZADD', KEYS[1], 0, name)
      local expires = tonumber(string.sub(head, 51, 65)) or 0
      if expires > 0 then
        redis.call('ZADD', KEYS[1], 0, string.format('\\0%015d', expires) .. name)
      end
      local at = string.find(name, '}', from, true)
      if at and string.find(name, '}', at + 1, true) then
        redis.call('ZADD', KEYS[2], 0, name)
      end
    end
  end
end
return added
"""

# Skip-scan (`scan_batches` of `<literal>*}<rest>`: `agents:{*}:recovery`): the names of each
# group (the names up to the first `}` after the literal: one entity's) that start with
# `<group><rest's literal text>`, and the group's names in the braced set (the names whose `*`
# may take a `}`: rare), never the group's other names. Indexes: pairs (an index, its braced set);
# ARGV: as `LIST`'s, then the literal's length in bytes, the rest's literal text and the bound
# past it, and the group a previous call stopped inside ('' none). Per group one ZRANGE LIMIT 0 1
# to find it, one ZRANGE for its names, one more for its braced names when the braced set is not
# empty, and an EXISTS per name returned. Returns {names, position, low bound, group} as `LIST`
# (the caller matches the names against the pattern and drops those seen twice).
_SKIP_BODY = """
local low, high, budget = ARGV[1], ARGV[2], tonumber(ARGV[3])
local pos, from = tonumber(ARGV[4]), ARGV[5]
local start, rest, past, inside = tonumber(ARGV[6]), ARGV[7], ARGV[8], ARGV[9]
local count = #indexes / 2
local found, looked = {}, 0
local function take(index, braced, names)
  for _, name in ipairs(names) do
    if redis.call('EXISTS', name) == 1 then
      found[#found + 1] = name
    else
      redis.call('ZREM', index, name)
      if braced then redis.call('ZREM', braced, name) end
    end
  end
end
while pos <= count do
  local index, braced = indexes[2 * pos - 1], indexes[2 * pos]
  if redis.call('EXISTS', braced) == 0 then braced = false end
  while true do
    local group, direct = false, false
    if inside ~= '' then
      group, direct, inside = inside, from, ''
    else
      if looked >= budget then return {found, pos, from, ''} end
      looked = looked + 1
      local name = redis.call('ZRANGE', index, from, high, 'BYLEX', 'LIMIT', 0, 1)[1]
      if not name then break end
      local close = string.find(name, '}', start + 1, true)
      if close then
        group = string.sub(name, 1, close)
        direct = '[' .. group .. rest
      else
        from = '(' .. name  -- no `}` after the literal: it matches nothing
      end
    end
    if group then
      local limit = math.max(budget - looked, 1)
      local page = redis.call('ZRANGE', index, direct, '(' .. group .. past, 'BYLEX',
        'LIMIT', 0, limit)
      looked = looked + #page
      take(index, braced, page)
      if #page == limit then return {found, pos, '(' .. page[#page], group} end
      local head = string.sub(group, 1, -2)
      if braced then
        local extra = redis.call('ZRANGE', braced, '[' .. group, '(' .. head .. '~', 'BYLEX')
        looked = looked + #extra
        take(index, braced, extra)
      end
      from = '[' .. head .. '~'
    end
  end
  pos = pos + 1
  from = low
end
return {found, false, false, ''}
"""
SKIP = "local indexes = KEYS\n" + _SKIP_BODY
SKIP_ACROSS_SLOTS = _across_slots(_SKIP_BODY, 9)


# The build lock (`#building`: a token, with an expiry): KEYS[1] the lock, ARGV[1] the token
# this builder set, ARGV[2] a new expiry in ms (`KEEP`) or none (`RELEASE`). Each acts only
# while the lock still holds that token (not one another builder took after it expired), and
# returns 1 if it did.
KEEP_BUILD_LOCK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
RELEASE_BUILD_LOCK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


def _sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()  # noqa: S324  # Redis names scripts so


LIST_SHA = _sha(LIST)
TAGS_SHA = _sha(TAGS)
TAGS_ACROSS_SLOTS_SHA = _sha(TAGS_ACROSS_SLOTS)
LIST_ACROSS_SLOTS_SHA = _sha(LIST_ACROSS_SLOTS)
BUILD_SHA = _sha(BUILD)
KEEP_BUILD_LOCK_SHA = _sha(KEEP_BUILD_LOCK)
RELEASE_BUILD_LOCK_SHA = _sha(RELEASE_BUILD_LOCK)
SKIP_SHA = _sha(SKIP)
SKIP_ACROSS_SLOTS_SHA = _sha(SKIP_ACROSS_SLOTS)
USED_SLOTS_SHA = _sha(USED_SLOTS)
