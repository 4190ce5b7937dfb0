"""Per-key history on Redis: where a key's versions live, and the Lua that keeps and reads them.

A key whose `HistoryRules` depth is above 1 has a Redis list, newest first, at
`history_key(prefix, key)`: `__agenticstate_hist__:{key_prefix}{key}{tag}` (the Redis key,
with a tag before its first brace, if any: one list per Redis key, whichever of the stores
whose prefixes nest writes it), so an ACL user's key patterns reach it as they reach the
sorted indexes (`~__agenticstate_hist__:myapp:*`). Each element is the key's whole record as
that write left it (the 65-byte header, then the value, as `_redis_scripts.entry` decodes it).
The write script pushes it and trims the list to the depth (`keep`), in the same atomic step as
the write, and gives the list the key's expiry (the same PEXPIRE as the key's `SET ... PX`, or
PERSIST: run after it, so the list never expires before the key, at most the script's run time
after it); writing version 1 drops the old list first, and a delete drops it (DEL, in the
delete's script). A write script is given the lists as its last `KEYS` and their `spec` as its
last `ARGV`, which it takes off first (`take_history`): without history a call is exactly what
it was, and the rest of the script reads its usual layout whatever else it is given.

`{tag}` makes the list hash to the key's cluster slot (a script's keys may not cross slots):
`slot_tag(slot)`, a short string found for each of the 16,384 slots (built once, lazily), put
before the name's first brace, so it is the list's hash tag whatever the name holds. The same
name is used on a single server. The name is never ambiguous: what comes before the first `{`
is the key's name up to its first brace, the tag holds no brace, and the rest follows. A prefix
holding a brace (which no manager uses) gets its tag inside it, so a key pattern on the prefix
does not reach its lists. An earlier version named the list by the writer's prefix
(`legacy_history_key`); reads fall back to that list while the new one does not exist.

Reads (`READ`) are one script: the key's record and the list's elements, so the current version
and its predecessors are one consistent snapshot. `versions` keeps only the elements of the
key's current life (the same created time, older versions, each once, newest first): a list
left behind by a writer without history rules never shows versions of an earlier life.
"""

from __future__ import annotations

import binascii
import hashlib
from typing import TYPE_CHECKING, Any

from agenticstate.backends._redis_slots import SLOTS, slot_tag

if TYPE_CHECKING:
    from collections.abc import Callable

    from agenticstate.backends.base import Entry

__all__ = [
    "HISTORY_FUNCTION",
    "HISTORY_NAMESPACE",
    "READ",
    "READ_SHA",
    "history_key",
    "legacy_history_key",
    "slot_tag",
    "spec",
    "versions",
]

HISTORY_NAMESPACE = "__agenticstate_hist__:"
"""What every history list's Redis key starts with (before its `{tag}` and the key's name)."""


def _hash_tag(name: str) -> str | None:
    """The hash tag Redis Cluster hashes `name` by (`{...}`, non-empty), or `None`."""
    start = name.find("{")
    if start > -1:
        end = name.find("}", start + 1)
        if end > start + 1:
            return name[start + 1 : end]
    return None


def history_key(prefix: str, key: str) -> str:
    """The Redis key of `key`'s history list under `prefix`, in the slot of `prefix + key`.

    It depends on the Redis key alone (`prefix + key`), so a key written through stores whose
    prefixes nest (`app:` writing `prod:x`, `app:prod:` writing `x`) keeps one history: the
    name up to its first brace, the tag of its slot, then the rest of the name.
    """
    name = prefix + key
    tag = _hash_tag(name)
    slot = binascii.crc_hqx((name if tag is None else tag).encode(), 0) % SLOTS
    cut = name.find("{")
    if cut < 0:
        cut = len(name)
    return f"{HISTORY_NAMESPACE}{name[:cut]}{{{slot_tag(slot)}}}{name[cut:]}"


def legacy_history_key(prefix: str, key: str) -> str:
    """Where an earlier version of this library kept the list (by the writer's prefix)."""
    name = prefix + key
    tag = _hash_tag(name)
    if tag is None:
        tag = slot_tag(binascii.crc_hqx(name.encode(), 0) % SLOTS)
    if "{" in prefix:
        return f"{HISTORY_NAMESPACE}{{{tag}}}{name}"
    return f"{HISTORY_NAMESPACE}{prefix}{{{tag}}}{key}"


# take_history(): the history lists a write script was given, taken off the end of KEYS and
# ARGV, so that the rest of the script reads its usual layout. The last ARGV, `h<pos>:<depth>,...`
# (`spec`), names the position in KEYS of each written key that keeps history, with its depth;
# their lists are the last KEYS, in the same order. Returns {[pos] = {list, depth}}, or false
# when the last ARGV is no spec (never starts with `h`: a channel, a number).
# keep(hist, key, depth, version, ttl): after a successful write of `key` (now at `version`),
# push its record onto the history list `hist`, keep the newest `depth`, and give the list the
# key's expiry (`ttl` ms, as the write's SET PX; 0: none). Version 1 starts a fresh list.
HISTORY_FUNCTION = """
local function take_history()
  local spec = ARGV[#ARGV]
  if not spec or string.byte(spec, 1) ~= 104 then return false end
  ARGV[#ARGV] = nil
  local wanted = {}
  for pos, depth in string.gmatch(spec, '(%d+):(%d+)') do
    wanted[#wanted + 1] = {tonumber(pos), tonumber(depth)}
  end
  local lists = {}
  for j = #wanted, 1, -1 do
    lists[wanted[j][1]] = {table.remove(KEYS), wanted[j][2]}
  end
  return lists
end
local function keep(hist, key, depth, version, ttl)
  if version == 1 then redis.call('DEL', hist) end
  redis.call('LPUSH', hist, redis.call('GET', key))
  redis.call('LTRIM', hist, 0, depth - 1)
  if ttl > 0 then
    redis.call('PEXPIRE', hist, ttl)
  elseif version > 1 then
    redis.call('PERSIST', hist)
  end
end
"""

# KEYS: the key, its history list (and where an earlier version kept it, read when the list is
# missing); ARGV: the last list index to read (-1: all), the version wanted (0: every retained
# one). Returns false for a missing key, else {record, elements}: for one version, only the
# element that may be it (or none).
READ = """
local cur = redis.call('GET', KEYS[1])
if not cur then return false end
if KEYS[3] and redis.call('EXISTS', KEYS[2]) == 0 then KEYS[2] = KEYS[3] end
local want = tonumber(ARGV[2])
local ver = tonumber(string.sub(cur, 1, 20))
if not ver or want == ver or want > ver then return {cur, {}} end  -- not ver: not a record
local stop = tonumber(ARGV[1])
if want > 0 then stop = ver - want end
local items = redis.call('LRANGE', KEYS[2], 0, stop)
if want > 0 then
  local created = string.sub(cur, 21, 35)
  for _, item in ipairs(items) do
    if tonumber(string.sub(item, 1, 20)) == want and string.sub(item, 21, 35) == created then
      return {cur, {item}}
    end
  end
  return {cur, {}}
end
return {cur, items}
"""
READ_SHA = hashlib.sha1(READ.encode()).hexdigest()  # noqa: S324  # Redis names scripts so


def spec(kept: list[tuple[int, int]]) -> str:
    """The last ARGV `take_history` reads: each `(position in KEYS, depth)`, in KEYS' order."""
    return "h" + ",".join(f"{position}:{depth}" for position, depth in kept)


def versions(
    key: str, reply: Any, limit: int | None, entry: Callable[[str, bytes], Entry]
) -> list[Entry]:
    """The entries `READ` replied (decoded by `entry`), newest (the current one) first.

    At most `limit` of them. Keeps the elements of the current life only: the current record's
    created time, versions below the current one, each version once.
    """
    if not reply:
        return []
    current = entry(key, reply[0])
    found = [current]
    created = reply[0][20:35]
    below = current.version
    for raw in reply[1]:
        if limit is not None and len(found) >= limit:
            break
        if raw[20:35] != created:
            continue
        version = int(raw[0:20])
        if version < below:
            found.append(entry(key, raw))
            below = version
    return found
