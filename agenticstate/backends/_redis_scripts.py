"""The Redis backend's data layout and the Lua scripts that write it.

A state key is one Redis string, `{key_prefix}{key}`: a fixed 97-byte ASCII header (`+` and the
version in 19 digits; created, updated and expiry times in server milliseconds, 0 = never; the
revision and the create revision, 16 digits each) followed by the value bytes. A record written
before revisions has a 65-byte header (the version in 20 digits, starting with `0`, and no
revisions): it reads as revision `updated ms * 1000` and create revision `created ms * 1000`, and
its next write gives it the new header. Code that reads only the version (`GETRANGE 0 19`) reads
both, `+` being a sign `tonumber` and `int` take.

Revisions (`revise`): each write and delete takes the next revision from a counter key per key
prefix (on a cluster, per prefix and slot: `_redis_revision.RevisionNames`), given as the script's
second key: the larger of one more than the counter and the server's clock in microseconds (a
hybrid logical clock). The counter makes revisions strictly increase within a store; the clock
makes them increase across stores whose prefixes nest (a key written through `app:` and through
`app:prod:` draws from two counters, both kept above the clock) and after a server restart that
lost the counter. A change (its message starts with `R` and its revision, 16 digits) is written
to the feed when the feed is on. The script that makes it publishes on
`{CHANNEL_NAMESPACE}{key_prefix}{key}` (`notify`): with the feed on, a notification naming the
feed entry that holds the change; with it off, the change itself, with the exact old and new
bytes (`parse_message` reads it back).
Subscribers take what they deliver from the store, never from a message (`_redis_pubsub`). A
sorted index lives at `{INDEX_NAMESPACE}{key_prefix}{index}`. A key that keeps history has a
list of its last
versions (`_redis_history`), which the write scripts push to (`keep`) and the delete script
drops, when the caller appends it to the script's keys (`take_history`). The scripts are sent
by SHA (`SET_SHA`, ...) and loaded after a NOSCRIPT reply.

The change feed (`_redis_feed` names its keys and reads it back). When the feed is on, a write
script also gets the feed's stream and its counter as its last two `KEYS` (in a cluster both hash
to the written key's slot) and the retention (max changes, max age in ms; 0 = none) in `ARGV`.
`to_feed` then gives the change its feed id, `<ms>-<n>`: `ms` the server time (never less than the
id before it), `n` one more than the stream's previous id, counted over the stream's whole life
(the counter key holds the last id given, so trimming never resets it). On one server the
registries of the outer prefixes come after the counter in `KEYS`: a script that starts the stream
joins them (`feed_at`). It XADDs the change with
fields `k` (the Redis key), `m` (`X<id> <previous id> <W or D message>`) and `u` (the change's
place in the server's commit order: `ORDER_FUNCTION`), trims the stream (`trim`: the counter
holds `<last id> <u> <bytes> <count>`) and publishes `F<id> <stream>`. A reader knows from the
previous id whether anything between two entries is missing (see `_redis_feed`).

Values by reference: a written value of `INLINE_MAX` bytes or more without a TTL is not in its
entry (kind `V`): the entry names the key and revision, and the key's hash of references
(`REFS_FUNCTION`) marks that revision; an overwrite or delete moves the value into the hash while
a retained entry holds it, and the readers (`_redis_feed.READ`, `LOOKUP`) put values back inline.
History lists come after the feed's keys (and their spec
after its arguments): `take_history` takes them off first, so the feed's positions are the same
with or without history.
"""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from agenticstate.backends._redis_feed import FEED_NAMESPACE, INLINE_MAX, RESOLVE_FUNCTION
from agenticstate.backends._redis_history import HISTORY_FUNCTION
from agenticstate.backends._redis_keyindex import KEY_INDEX_FUNCTION
from agenticstate.backends.base import Change, ChangeOp, new_change, new_entry
from agenticstate.exceptions import ForeignRecordError

if TYPE_CHECKING:
    from agenticstate.backends.base import Entry

__all__ = [
    "CHANNEL_NAMESPACE",
    "DELETE",
    "DELETE_SHA",
    "DROP_FUNCTION",
    "FEED_FUNCTION",
    "HEADER",
    "INDEX_NAMESPACE",
    "LEGACY_HEADER",
    "REVISION_FUNCTION",
    "SET",
    "SET_MANY",
    "SET_MANY_SHA",
    "SET_SHA",
    "STAT",
    "STRLEN",
    "entry",
    "from_ms",
    "parse_message",
    "split_feed",
    "stamp_of",
    "to_ms",
    "ttl_ms",
]

CHANNEL_NAMESPACE = "__agenticstate__:"
"""What every change channel starts with (before the key prefix)."""
INDEX_NAMESPACE = "__agenticstate_idx__:"
"""What every sorted index's Redis key starts with (before the key prefix)."""

HEADER = (
    97  # "+" version 19, created 15, updated 15, expires 15 (0 = never), revision 16, create 16
)
LEGACY_HEADER = 65  # before revisions: version 20 + created 15 + updated 15 + expires 15

# The size of each key's value, -1 for a missing key or one that is not a record (another
# application's list, hash or string under the prefix): usage(), sizes without reading values.
STRLEN = """
local sizes = {}
for i, name in ipairs(KEYS) do
  local n = 0
  if redis.call('TYPE', name).ok == 'string' then n = redis.call('STRLEN', name) end
  local first = n > 0 and redis.call('GETRANGE', name, 0, 0)
  if first == '+' and n >= 97 then
    sizes[i] = n - 97
  elseif first == '0' and n >= 65 then
    sizes[i] = n - 65
  else
    sizes[i] = -1  -- missing, or not a record (another application's key)
  end
end
return sizes
"""

# Each key's header and stored length, false for a missing one or one that is not a string
# (listings: no value is read).
STAT = f"""
local found = {{}}
for i, name in ipairs(KEYS) do
  local length = 0
  if redis.call('TYPE', name).ok == 'string' then length = redis.call('STRLEN', name) end
  if length == 0 then
    found[i] = false
  else
    found[i] = {{redis.call('GETRANGE', name, 0, {HEADER - 1}), length}}
  end
end
return found
"""

# Revisions (see the module docstring). `header(cur)`: a record's version, created time (its 15
# digits), revision, create revision and where its value starts. `shaped(cur)`: whether a
# string is a record (else another application's value: `not_ours`, an error reply read as
# `ForeignRecordError`; `write` and `drop` check the key they read). `refuse_foreign(names)`: the
# same for several keys, one GETRANGE each, before a multi-key script writes anything.
# `rev_at(k)`: the revision counter KEYS[k], read once a script. `revise(rev, now_us)`: the next
# revision.
REVISION_FUNCTION = """
local function header(cur)
  local ver = tonumber(string.sub(cur, 1, 20))
  local created = string.sub(cur, 21, 35)
  if string.byte(cur, 1) == 43 then
    return ver, created, tonumber(string.sub(cur, 66, 81)), tonumber(string.sub(cur, 82, 97)), 98
  end
  return ver, created, tonumber(string.sub(cur, 36, 50)) * 1000, tonumber(created) * 1000, 66
end
local function shaped(cur)
  local first = string.byte(cur, 1)
  if first == 43 then return #cur >= 97 and tonumber(string.sub(cur, 1, 20)) ~= nil end
  return first == 48 and #cur >= 65 and tonumber(string.sub(cur, 1, 20)) ~= nil
end
local function not_ours(name)
  return redis.error_reply('WRONGTYPE ' .. name .. ' is not an agenticstate record')
end
local function foreign(name)
  local head = redis.call('GETRANGE', name, 0, 96)  -- a list, a hash, ...: WRONGTYPE
  return head ~= '' and not shaped(head)
end
local function refuse_foreign(names)
  for _, name in ipairs(names) do
    if foreign(name) then return not_ours(name) end
  end
  return false
end
local function rev_at(k)
  return {KEYS[k], false}
end
local function revise(rev, now_us)
  local last = rev[2]
  if not last then last = tonumber(redis.call('GET', rev[1]) or '0') or 0 end
  last = last + 1
  if now_us > last then last = now_us end
  rev[2] = last
  redis.call('SET', rev[1], string.format('%d', last))
  return last
end
"""

# Where a change sits in its server's commit order (see `_redis_feed`, "Order"): a feed entry's
# `u` field, the server's clock in microseconds when its script ran, never less than the `u`
# before it in the same stream. `feed_head(counter)`: the stream's last id and the `u` this
# script's entries get (the counter holds `<last id> <its u>`; an earlier version of this library
# wrote the id alone). `clock` is the script's TIME (read once, `clock = redis.call('TIME')`), so
# its entries share one `u` and are told apart by id.
ORDER_FUNCTION = """
local clock = {}
local function feed_head(counter)
  local held = redis.call('GET', counter) or '0-0'
  local prev, before, held_bytes, count = held, '0', '0', false
  local space = string.find(held, ' ', 1, true)
  if space then
    local a, b, c, d = string.match(held, '^(%S+) (%S+) ?(%S*) ?(%S*)$')
    prev, before = a, b
    if c ~= '' then held_bytes = c end
    if d ~= '' then count = tonumber(d) end
  end
  local u = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  if tonumber(before) > u then u = tonumber(before) end
  return prev, u, tonumber(held_bytes), count
end
"""

# What a write publishes on its key's channel. With the feed on, a notification, not the change:
# `F<id> <stream>` (the feed entry to read, and its stream's name after `FEED_NAMESPACE`). With
# the feed off, the change itself (`data`, `parse_message`), which a subscriber checks against the
# key before it delivers it. Subscribers take what they deliver from the store (`_redis_pubsub`),
# so a message someone else PUBLISHes on these channels cannot deliver a change.
NOTIFY_FUNCTION = """
local function notify(channel, id, feed, data)
  if id then
    redis.call('PUBLISH', channel, 'F' .. id .. ' ' .. string.sub(feed[1], FEED_CUT))
  else
    redis.call('PUBLISH', channel, data)
  end
end
""".replace("FEED_CUT", str(len(FEED_NAMESPACE) + 1))

# Values held by reference (see "Values by reference" in the module docstring). A change's
# message at `at` (its `R`): the revision (16 digits), the kind (`W` a write with its new value,
# `V` a write whose new value is held by reference, `D` a delete), the version, the time, for a
# write the expiry, then the old value: `0` none, `1<size 10><old>` inline, `2<size 10><revision
# 16>` by reference. `refs_of(key, tag)`: the key's hash of references; `displace(feed, key,
# revstr, old)`: before `key`'s value at `revstr` is overwritten or deleted, move it into that
# hash if a retained change holds it by reference (the `L` marker), held by 2 (that change and
# the one displacing it); `release(fields, tag)`: a trimmed entry lets go of what it references,
# returning the bytes it held; `resolve(k, m, tag)`: the message with every value inline, false
# if one is gone (a key deleted or evicted behind the library's back).
REFS_FUNCTION = (
    RESOLVE_FUNCTION
    + """local INLINE_MAX = INLINE_LIMIT
local function displace(feed, key, revstr, old)
  if not feed or #old < INLINE_MAX then return false end
  local refs = refs_of(key, feed.tag)
  if redis.call('HGET', refs, revstr) ~= 'L' then return false end
  redis.call('HSET', refs, revstr, 'V' .. old, revstr .. '#', 2)
  return true
end
local function unref(refs, revstr)
  -- A value held by 2 has a count; the `L` marker (held by 1) none: its count goes below 0.
  if redis.call('HINCRBY', refs, revstr .. '#', -1) <= 0 then
    redis.call('HDEL', refs, revstr, revstr .. '#')
  end
end
local function release(fields, tag)
  local k, m = '', ''
  for j = 1, #fields, 2 do
    if fields[j] == 'k' then k = fields[j + 1] elseif fields[j] == 'm' then m = fields[j + 1] end
  end
  local size = #k + #m
  local at, kind, o = message_at(m)
  if not at then return size end
  local held = string.byte(m, o) == 50  -- '2': the old value by reference
  if kind ~= 'V' and not held then return size end  -- no reference: nothing to let go of
  local refs = refs_of(k, tag)
  if kind == 'V' then unref(refs, string.sub(m, at + 1, at + 16)) end
  if held then
    size = size + tonumber(string.sub(m, o + 1, o + 10))
    unref(refs, string.sub(m, o + 11, o + 26))
  end
  return size
end
""".replace("INLINE_LIMIT", str(INLINE_MAX))
)

# The feed (see the module docstring). `feed_at(k, a)`: the feed of a script whose stream and
# counter are KEYS[k] and KEYS[k + 1] and whose retention is ARGV[a] and ARGV[a + 1], or false
# when there is no KEYS[k] (the feed is off); the KEYS after them (once `take_history` took off
# the history lists) are registries of the prefixes the stream's is nested in (one server).
# `to_feed(feed, key, message, now, displaced, old, new)` appends `message .. old .. new` (a
# change of `key`; the value parts are given apart, so the entry is made in one piece: a script
# pays for each string it makes, about 1.3 µs a KB) to the feed and returns what to publish and
# its id (false: no feed). The script that starts a stream (its counter is missing: the first
# write, or the first after the stream was lost) adds its prefix to those registries in the same
# atomic step, so an outer prefix's reader never misses a stream that exists.
FEED_FUNCTION = (
    ORDER_FUNCTION
    + NOTIFY_FUNCTION
    + REFS_FUNCTION
    + """
local function feed_at(k, a)
  if not KEYS[k] then return false end
  local spec = ARGV[a]  -- '<max changes> <max bytes> <cluster: 1 or 0>' (or a bare count)
  local maxn, maxb, cl = string.match(spec, '^(%d+) (%d+) (%d)$')
  if not maxn then maxn, maxb, cl = spec, '0', '0' end
  local tag = ''
  if cl == '1' then tag = string.match(KEYS[k], '{[^{}]*}') or '' end
  return {KEYS[k], KEYS[k + 1], tonumber(maxn), tonumber(ARGV[a + 1]), false, false, k + 2,
    maxbytes = tonumber(maxb), tag = tag, bytes = 0, count = 0}
end
local function trim(feed, now)
  local maxn, maxage, maxb = feed[3], feed[4], feed.maxbytes
  local n = feed.count
  -- Trimmed in batches: once the count passes its bound by 1% (by 32 at least: a live reader
  -- that lags a few writes behind still finds what it was told of, as when `MAXLEN ~` kept
  -- whole stream nodes) or the bytes by 1%, down to the bound.
  local due = (maxn > 0 and n > maxn + math.max(32, math.floor(maxn / 100)))
    or (maxb > 0 and feed.bytes > maxb + math.floor(maxb / 100))
  local cutoff = false
  if maxage > 0 then
    cutoff = now - maxage
    if not due then
      local first = redis.call('XRANGE', feed[1], '-', '+', 'COUNT', 1)[1]
      due = first and tonumber(string.match(first[1], '^(%d+)')) < cutoff
    end
  end
  if not due then return end
  while n > 1 do
    local want = 16
    if maxn > 0 and n > maxn then want = math.min(100, n - maxn) end
    local batch = redis.call('XRANGE', feed[1], '-', '+', 'COUNT', want)
    local last, stop = false, false
    for _, e in ipairs(batch) do
      local over = (maxn > 0 and n > maxn) or (maxb > 0 and feed.bytes > maxb)
      if not over and cutoff then
        over = tonumber(string.match(e[1], '^(%d+)')) < cutoff
      end
      if not over or n <= 1 then stop = true break end
      feed.bytes = feed.bytes - release(e[2], feed.tag)
      n = n - 1
      feed.count = n
      last = e[1]
    end
    if last then
      local ms, seq = string.match(last, '^(%d+)-(%d+)$')
      redis.call('XTRIM', feed[1], 'MINID', ms .. '-' .. string.format('%d', tonumber(seq) + 1))
    end
    if stop or not last then break end
  end
  if feed.bytes < 0 then feed.bytes = 0 end
end
local function to_feed(feed, key, message, now, displaced, old, new)
  -- The message is `message .. old .. new` (each of the last two may be missing), joined once
  -- with the feed header: a script's cost grows with each string it makes, a big one most.
  old, new = old or '', new or ''
  if not feed then return message .. old .. new, false end
  local prev = feed[5]  -- the id this script gave last (the counter is read once a script)
  if not prev then
    prev, feed[6], feed.bytes, feed.count = feed_head(feed[2])
    if not feed.count then feed.count = redis.call('XLEN', feed[1]) end
    if prev == '0-0' then
      -- A new stream (the first, or the old one was lost): it joins the registries given.
      for j = feed[7], #KEYS do
        redis.call('SADD', KEYS[j], string.sub(feed[1], FEED_CUT))
      end
    end
  end
  local dash = string.find(prev, '-', 1, true)
  local ms = tonumber(string.sub(prev, 1, dash - 1))
  if now > ms then ms = now end
  local id = string.format('%d-%d', ms, tonumber(string.sub(prev, dash + 1)) + 1)
  local data = 'X' .. id .. ' ' .. prev .. ' ' .. message .. old .. new
  local u = string.format('%d', feed[6])
  redis.call('XADD', feed[1], id, 'k', key, 'm', data, 'u', u)
  feed.bytes = feed.bytes + #key + #data + (displaced or 0)
  feed.count = feed.count + 1
  trim(feed, now)
  redis.call('SET', feed[2], string.format('%s %s %d %d', id, u, feed.bytes, feed.count))
  feed[5] = id
  return data, id
end
""".replace("FEED_CUT", str(len(FEED_NAMESPACE) + 1))
)

# One write: check the version (`expected`, -1: any) or the revision (`exprev`, -1: any), store
# header + value, apply the TTL, publish old and new (and append the change to `feed`, false when
# off), all with the revision `rev` gives. Returns {1, version, old-or-false, now, feed id or
# false, revision} or {0, actual version or revision} on a conflict.
WRITE_FUNCTION = (
    FEED_FUNCTION
    + REVISION_FUNCTION
    + KEY_INDEX_FUNCTION
    + """
local t = redis.call('TIME')
clock = t
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function write(key, value, ttl, expected, channel, now, feed, rev, exprev)
  local cur = redis.call('GET', key)  -- another type than a string: WRONGTYPE
  if cur and not shaped(cur) then return not_ours(key) end
  local ver = 0
  local created, crev, old = nil, nil, false  -- crev: the create revision's 16 digits
  local oldrev = false  -- the old value's revision (16 digits), false before revisions
  if cur then
    ver = tonumber(string.sub(cur, 1, 20))
    created = string.sub(cur, 21, 35)
    if string.byte(cur, 1) == 43 then
      crev = string.sub(cur, 82, 97)
      oldrev = string.sub(cur, 66, 81)
      old = string.sub(cur, 98)
    else  -- written before revisions (see `header`)
      crev = string.format('%016d', tonumber(created) * 1000)
      old = string.sub(cur, 66)
    end
  end
  if expected >= 0 and expected ~= ver then
    return {0, ver}
  end
  if exprev >= 0 then
    local curev = 0
    if cur then ver, created, curev = header(cur) end
    if exprev ~= curev then return {0, curev} end
  end
  local expires = 0
  if ttl > 0 then expires = now + ttl end
  -- The index first: an index another client broke (WRONGTYPE) stops the script before it
  -- writes anything (every write op of a script starts here or in `drop`, on the same index).
  index_put(key, expires, cur, now)
  local nowstr = string.format('%015d', now)
  if not created then created = nowstr end
  ver = ver + 1
  local revision = revise(rev, now_us)
  local verstr = string.format('%020d', ver)
  local revstr = string.format('%016d', revision)
  local expstr = string.format('%015d', expires)
  local record = '+' .. string.sub(verstr, 2) .. created .. nowstr .. expstr .. revstr
    .. (crev or revstr) .. value
  if ttl > 0 then
    redis.call('SET', key, record, 'PX', ttl)
  else
    redis.call('SET', key, record)
  end
  local oldpart, oldbody, displaced = '0', '', 0  -- the message's old value: its tag, its bytes
  if old then
    if oldrev and displace(feed, key, oldrev, old) then
      displaced = #old
      oldpart = '2' .. string.format('%010d', #old) .. oldrev
    else
      oldpart, oldbody = '1' .. string.format('%010d', #old), old
    end
  end
  -- The new value by reference (`V`): it stays in the key until a later write displaces it.
  -- Inline (`W`) when small, when the key expires (expiry runs no script), or with no feed.
  local data, id
  if feed and ttl == 0 and #value >= INLINE_MAX then
    data, id = to_feed(feed, key, 'R' .. revstr .. 'V' .. verstr .. nowstr .. expstr
      .. oldpart, now, displaced, oldbody)
    redis.call('HSET', refs_of(key, feed.tag), revstr, 'L')
  else
    data, id = to_feed(feed, key, 'R' .. revstr .. 'W' .. verstr .. nowstr .. expstr
      .. oldpart, now, displaced, oldbody, value)
  end
  notify(channel, id, feed, data)
  return {1, ver, old, now, id, revision}
end
"""
)

# How the write scripts take a condition (ARGV): `-1` none, `<n>` version n, `r<n>` revision n.
EXPECT_FUNCTION = """
local function expectation(arg)
  local n = tonumber(arg)
  if n then return n, -1 end
  return -1, tonumber(string.sub(arg, 2))
end
"""

# KEYS[1] the key, KEYS[2] the revision counter (then the feed's stream and counter); ARGV:
# value, ttl ms (0 = none), the condition (`expectation`), channel, the feed's max changes and
# max age ms. (Then its history list and spec, if it keeps history: `take_history`.)
SET = (
    WRITE_FUNCTION
    + EXPECT_FUNCTION
    + HISTORY_FUNCTION
    + """
local lists = take_history()
local ttl = tonumber(ARGV[2])
local expected, exprev = expectation(ARGV[3])
local r = write(KEYS[1], ARGV[1], ttl, expected, ARGV[4], now, feed_at(3, 5), rev_at(2), exprev)
if lists and r[1] == 1 then keep(lists[1][1], KEYS[1], lists[1][2], r[2], ttl) end
return r
"""
)

# KEYS: the keys, the revision counter (then the feed's stream and counter); ARGV: ttl ms, the
# feed's max changes and max age ms, then a value and a channel per key. Each write is
# unconditional; the reply is each write's reply, in order. (Then the history lists and their
# spec, if some keys keep history: `take_history`.)
SET_MANY = (
    WRITE_FUNCTION
    + HISTORY_FUNCTION
    + """
local lists = take_history()  -- first: the count below is of the ARGV without the spec
local count = (#ARGV - 3) / 2
local refused = refuse_foreign({unpack(KEYS, 1, count)})
if refused then return refused end
local ttl = tonumber(ARGV[1])
local feed = feed_at(count + 2, 2)
local rev = rev_at(count + 1)
local replies = {}
for i = 1, count do
  replies[i] = write(KEYS[i], ARGV[2 * i + 2], ttl, -1, ARGV[2 * i + 3], now, feed, rev, -1)
  local kept = lists and lists[i]
  if kept then keep(kept[1], KEYS[i], kept[2], replies[i][2], ttl) end
end
return replies
"""
)

# drop(key, expected, channel, now, feed, rev, exprev, now_us): delete `key` and publish the
# change (and append it to `feed`), with a revision of its own, in one place for DELETE and the
# transaction script. Returns {1, version, old, now, feed id or false, revision}, {2} when
# missing, or {0, actual version or revision} on a conflict (expected, exprev -1 = any).
DROP_FUNCTION = """
local function drop(key, expected, channel, now, feed, rev, exprev, now_us)
  local cur = redis.call('GET', key)  -- another type than a string: WRONGTYPE
  if cur and not shaped(cur) then return not_ours(key) end
  local ver, curev, at = 0, 0, 66
  if cur then
    local created, crev
    ver, created, curev, crev, at = header(cur)
  end
  if expected >= 0 and expected ~= ver then
    return {0, ver}
  end
  if exprev >= 0 and exprev ~= curev then
    return {0, curev}
  end
  if not cur then return {2} end
  local old = string.sub(cur, at)
  index_drop(key, cur, now)  -- first, as in `write`
  redis.call('DEL', key)
  local revision = revise(rev, now_us)
  local verstr = string.format('%020d', ver)
  local oldpart, oldbody, displaced = '1' .. string.format('%010d', #old), old, 0
  if at == 98 and displace(feed, key, string.sub(cur, 66, 81), old) then
    displaced = #old
    oldpart, oldbody = '2' .. string.format('%010d', #old) .. string.sub(cur, 66, 81), ''
  end
  local data, id = to_feed(feed, key, 'R' .. string.format('%016d', revision) .. 'D' .. verstr
    .. string.format('%015d', now) .. oldpart, now, displaced, oldbody)
  notify(channel, id, feed, data)
  return {1, ver, old, now, id, revision}
end
"""

# KEYS[1] the key, KEYS[2] the revision counter (then the feed's stream and counter); ARGV: the
# condition (`expectation`), channel, the feed's max changes and max age ms. (Then its history
# list and spec, if it keeps history: `take_history`; the list goes with the key.)
# Returns {1, version, old, now, id, revision}, {2} when missing, or {0, actual} on a conflict.
DELETE = (
    FEED_FUNCTION
    + REVISION_FUNCTION
    + KEY_INDEX_FUNCTION
    + DROP_FUNCTION
    + EXPECT_FUNCTION
    + HISTORY_FUNCTION
    + """
local lists = take_history()
local t = redis.call('TIME')
clock = t
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local expected, exprev = expectation(ARGV[1])
local r = drop(KEYS[1], expected, ARGV[2], now, feed_at(3, 3), rev_at(2), exprev, now_us)
if lists and r[1] == 1 then redis.call('DEL', lists[1][1]) end
return r
"""
)


def from_ms(value: int) -> datetime:
    """A server time in milliseconds since the epoch, as an aware UTC datetime."""
    return datetime.fromtimestamp(value / 1000, UTC)


def entry(key: str, raw: bytes) -> Entry:
    """The entry a stored record (header + value, either layout) holds."""
    revised = raw[:1] == b"+"
    if len(raw) < (HEADER if revised else LEGACY_HEADER):
        raise ForeignRecordError(key)
    try:
        version = int(raw[0:20])
        created = int(raw[20:35])
        updated = int(raw[35:50])
        expires = int(raw[50:65])
        if revised:
            revision, create_revision, start = int(raw[65:81]), int(raw[81:97]), HEADER
        else:
            revision, create_revision, start = updated * 1000, created * 1000, LEGACY_HEADER
    except ValueError:
        raise ForeignRecordError(key) from None
    return new_entry(
        key,
        raw[start:],
        version,
        from_ms(created),
        from_ms(updated),
        from_ms(expires) if expires else None,
        revision,
        create_revision,
    )


def parse_message(
    key: str, data: bytes, start: int = 0, cursor: str | None = None
) -> tuple[Change, int]:
    """Decode a published change and when the key expires (server ms, 0 = never).

    `W`: a write (op, version, timestamp, expiry, optional old, new); `D`: a delete (no expiry);
    `S`: a write published by an earlier version of this library (no expiry). Since revisions,
    `R` and the change's revision (16 digits) come first. The message starts at `start` (after a
    feed header: `split_feed`); the change gets `cursor`.
    """
    revision = 0
    if data[start : start + 1] == b"R":
        revision = int(data[start + 1 : start + 17])
        start += 17
    kind = data[start : start + 1]
    op = ChangeOp.DELETE if kind == b"D" else ChangeOp.SET
    version = int(data[start + 1 : start + 21])
    stamp = int(data[start + 21 : start + 36])
    position = start + 36
    expires = 0
    if kind == b"W":
        expires = int(data[position : position + 15])
        position += 15
    old: bytes | None = None
    if data[position : position + 1] == b"1":
        size = int(data[position + 1 : position + 11])
        old = data[position + 11 : position + 11 + size]
        position += 11 + size
    else:
        position += 1
    new = data[position:] if op is ChangeOp.SET else None
    change = new_change(key, op, old, new, version, from_ms(stamp), cursor, revision)  # fast
    return change, expires


def split_feed(data: bytes) -> tuple[bytes, bytes, int] | None:
    """A feed message's id, the previous id and where its change starts; `None` if no feed's.

    A change written with the feed on is published (and kept in the stream) as
    `X<id> <previous id> <message>`.
    """
    if data[:1] != b"X":
        return None
    space = data.index(b" ", 1)
    second = data.index(b" ", space + 1)
    return data[1:space], data[space + 1 : second], second + 1


def stamp_of(data: bytes) -> int:
    """The server time (ms) a published change was committed at, feed header or not."""
    start = 0
    if data[:1] == b"X":
        start = data.index(b" ", data.index(b" ", 1) + 1) + 1
    if data[start : start + 1] == b"R":
        start += 17
    return int(data[start + 21 : start + 36])


def _sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()  # noqa: S324  # Redis names scripts so


def ttl_ms(ttl: timedelta | None) -> int:
    """A TTL in whole milliseconds, rounded up (0 = none)."""
    return 0 if ttl is None else max(1, math.ceil(ttl.total_seconds() * 1000))


def to_ms(moment: datetime) -> int:
    """Milliseconds since the epoch (the inverse of `from_ms`)."""
    return round(moment.timestamp() * 1000)


SET_SHA = _sha(SET)
SET_MANY_SHA = _sha(SET_MANY)
DELETE_SHA = _sha(DELETE)
