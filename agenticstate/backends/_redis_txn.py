"""`RedisBackend.transact`: one Lua script per transaction, its arguments and its reply.

The script gets every key and index the transaction names as `KEYS` (each once) and the compares and
both branches as `ARGV`, checks the compares (each key's version or revision, read from its record
header), then runs one branch, op by op, and returns `{succeeded, results}`. Redis runs a script as
one atomic step, so nothing else writes between the compares and the writes, and one transaction is
one command (EVALSHA). `Put` is the same `write` function `set` runs (record header, TTL, PUBLISH of
old and new); `Delete` publishes as `delete` does. A `Put` or `Delete` of a key that keeps history
(`ph`, `dh`) also keeps or drops its history list, as `set` and `delete` do (`_redis_history`).

`ARGV` layout: `[channel namespace, compares, then_at, else_at, end_at, written_at, feed max
changes, feed max age ms, compares..., then ops..., else ops...]`, positions 1-based as Lua
counts. `written_at` is the position in `KEYS` of the revision counter (the change feed's stream
and counter follow it when the feed is on; all after the transaction's own keys), 0 when
nothing is written. A compare is `kind, key, number` (`v`: at version, `r`: at revision, `e`:
exists). An op is its code, its key's position in `KEYS`, and its fields:

| op | fields | result |
| --- | --- | --- |
| `g` | | the raw record, or nil |
| `p` | value, ttl ms (0: none) | `{1, version, old or nil, now ms, id or nil, revision}` |
| `ph` | value, ttl ms, history list's position in `KEYS`, depth | as `p` |
| `d` | | `{version, old, now ms, feed id or nil, revision}`, or nil |
| `dh` | history list's position in `KEYS` | as `d` |
| `ia` | n, then score, member n times | members added |
| `ir` | n, then n members | members removed |
| `ii` | member, delta | the new score (a string) |
| `r` | limit (-1: all) | member, score, member, score, ... |

On a cluster a script's keys must share a slot: `check_one_slot` refuses a transaction that
does not, naming its keys, before anything is sent.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from agenticstate.backends.base import (
    ChangeOp,
    Delete,
    Get,
    IndexAdd,
    IndexIncr,
    IndexRange,
    IndexRemove,
    Put,
    Revision,
    TxnResult,
    Version,
    new_change,
)
from agenticstate.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from agenticstate.backends.base import Entry, TxnCompare, TxnOp

__all__ = ["TxnCall", "add_written", "check_one_slot", "pack", "parse", "result", "script"]

_MS = timedelta(milliseconds=1)

# Runs after the `write` function (and `now`) of the write scripts, the `drop` function and the
# history's `keep`.
_TXN_BODY = """
local ns = ARGV[1]
local feed, rev = false, false
if ARGV[6] ~= '0' then
  rev = rev_at(tonumber(ARGV[6]))
  feed = feed_at(tonumber(ARGV[6]) + 1, 7)
end
local ok = 1
local i = 9
for c = 1, tonumber(ARGV[2]) do
  local head = redis.call('GETRANGE', KEYS[tonumber(ARGV[i + 1])], 0, 96)
  local ver = 0
  if head ~= '' then ver = tonumber(string.sub(head, 1, 20)) end
  if ARGV[i] == 'v' then
    if ver ~= tonumber(ARGV[i + 2]) then ok = 0 end
  elseif ARGV[i] == 'r' then
    local revision = 0
    if head ~= '' then
      local v, created
      v, created, revision = header(head)
    end
    if revision ~= tonumber(ARGV[i + 2]) then ok = 0 end
  elseif ver == 0 then
    ok = 0
  end
  i = i + 3
end
local from, to = tonumber(ARGV[3]), tonumber(ARGV[4])
if ok == 0 then from, to = tonumber(ARGV[4]), tonumber(ARGV[5]) end
do  -- the keys this branch reads or writes as records: none may be another application's
  local names, j = {}, from
  while j < to do
    local op = ARGV[j]
    if op == 'g' or op == 'p' or op == 'ph' or op == 'd' or op == 'dh' then
      names[#names + 1] = KEYS[tonumber(ARGV[j + 1])]
    end
    if op == 'g' or op == 'd' then j = j + 2
    elseif op == 'dh' then j = j + 3
    elseif op == 'p' or op == 'ii' then j = j + 4
    elseif op == 'ph' then j = j + 6
    elseif op == 'ia' then j = j + 3 + 2 * tonumber(ARGV[j + 2])
    elseif op == 'ir' then j = j + 3 + tonumber(ARGV[j + 2])
    else j = j + 3 end
  end
  local refused = refuse_foreign(names)
  if refused then return refused end
end
local function zmany(cmd, key, first, count, width)
  local total = 0
  -- at most 500 members per command: Lua's unpack has a stack limit
  for start = 0, count - 1, 500 do
    local n = math.min(500, count - start)
    local a = first + start * width
    total = total + redis.call(cmd, key, unpack(ARGV, a, a + n * width - 1))
  end
  return total
end
local results = {}
i = from
while i < to do
  local op = ARGV[i]
  local key = KEYS[tonumber(ARGV[i + 1])]
  local r = false
  if op == 'g' then
    r = redis.call('GET', key)
    i = i + 2
  elseif op == 'p' then
    r = write(key, ARGV[i + 2], tonumber(ARGV[i + 3]), -1, ns .. key, now, feed, rev, -1)
    i = i + 4
  elseif op == 'ph' then
    local ttl = tonumber(ARGV[i + 3])
    r = write(key, ARGV[i + 2], ttl, -1, ns .. key, now, feed, rev, -1)
    keep(KEYS[tonumber(ARGV[i + 4])], key, tonumber(ARGV[i + 5]), r[2], ttl)
    i = i + 6
  elseif op == 'd' or op == 'dh' then
    local d = drop(key, -1, ns .. key, now, feed, rev, -1, now_us)
    if d[1] == 1 then r = {d[2], d[3], d[4], d[5], d[6]} end
    if op == 'dh' then
      if d[1] == 1 then redis.call('DEL', KEYS[tonumber(ARGV[i + 2])]) end
      i = i + 1
    end
    i = i + 2
  elseif op == 'ia' then
    local n = tonumber(ARGV[i + 2])
    r = zmany('ZADD', key, i + 3, n, 2)
    i = i + 3 + 2 * n
  elseif op == 'ir' then
    local n = tonumber(ARGV[i + 2])
    r = zmany('ZREM', key, i + 3, n, 1)
    i = i + 3 + n
  elseif op == 'ii' then
    r = redis.call('ZINCRBY', key, ARGV[i + 3], ARGV[i + 2])
    i = i + 4
  else
    local limit = tonumber(ARGV[i + 2])
    if limit == 0 then
      r = {}
    else
      local stop = -1
      if limit > 0 then stop = limit - 1 end
      r = redis.call('ZRANGE', key, 0, stop, 'WITHSCORES')
    end
    i = i + 3
  end
  results[#results + 1] = r
end
return {ok, results}
"""


@functools.cache
def script(write_function: str, drop_function: str, history_function: str) -> tuple[str, str]:
    """The transaction script on the write scripts' `write`, `drop` and `keep`, and its SHA-1."""
    source = write_function + drop_function + history_function + _TXN_BODY
    return source, hashlib.sha1(source.encode()).hexdigest()  # noqa: S324  # Redis names scripts so


@dataclass(frozen=True, slots=True)
class TxnCall:
    """One transaction as the script takes it.

    Attributes:
        keys: The Redis keys (`KEYS`), each once.
        args: `ARGV`.
        names: Each Redis key's name as the caller gave it (a key or an index), for messages.
        write_key: The key whose write outcome an unknown reply leaves open.
        writes: Whether it may write a key (a `Put` or a `Delete`): only then does it need the
            revision counter and the change feed.
    """

    keys: list[str]
    args: list[str | bytes | int]
    names: list[str]
    write_key: str
    writes: bool = False


def _ttl_ms(op: Put) -> int:
    if op.ttl is None:
        return 0
    return max(1, -(-op.ttl // _MS))


def pack(
    compare: Sequence[TxnCompare],
    then: Sequence[TxnOp],
    orelse: Sequence[TxnOp],
    *,
    channels: str,
    state_key: Callable[[str], str],
    index_key: Callable[[str], str],
    history: Callable[[str], tuple[str, int] | None] = lambda key: None,
) -> TxnCall:
    """Pack a validated transaction (`check_transaction`'s output) for the script.

    `history(key)` is the Redis key and depth of `key`'s history list, `None` when it keeps none.
    The change feed's keys and retention are added by `add_feed`, once the slot is known.
    """
    keys: list[str] = []
    names: list[str] = []
    positions: dict[str, int] = {}
    args: list[str | bytes | int] = [channels, len(compare), 0, 0, 0, 0, 0, 0]
    for item in compare:
        name = state_key(item.key)
        found = positions.get(name)
        if found is None:
            keys.append(name)
            names.append(item.key)
            found = positions[name] = len(keys)
        if type(item) is Version:
            args += ("v", found, item.version)
        elif type(item) is Revision:
            args += ("r", found, item.revision)
        else:
            args += ("e", found, 0)
    args[2] = len(args) + 1
    _pack_ops(then, args, keys, names, positions, state_key, index_key, history)
    args[3] = len(args) + 1
    _pack_ops(orelse, args, keys, names, positions, state_key, index_key, history)
    args[4] = len(args) + 1
    written = [op.key for op in (*then, *orelse) if type(op) is Put or type(op) is Delete]
    return TxnCall(keys, args, names, (written or names or [""])[0], writes=bool(written))


def add_written(
    call: TxnCall, revision_counter: str, feed: tuple[str, ...], retention: tuple[str, int]
) -> None:
    """Append the revision counter, then the feed's stream and counter (if on), to `call`.

    Only if it writes a key: a transaction that only reads or compares takes neither.
    """
    if not call.writes:
        return
    call.args[5] = len(call.keys) + 1
    if feed:
        call.args[6], call.args[7] = retention
    call.keys.extend((revision_counter, *feed))


def _pack_ops(  # the packing state is passed down, not closed over
    ops: Sequence[TxnOp],
    args: list[str | bytes | int],
    keys: list[str],
    names: list[str],
    positions: dict[str, int],
    state_key: Callable[[str], str],
    index_key: Callable[[str], str],
    history: Callable[[str], tuple[str, int] | None],
) -> None:
    for op in ops:
        kind = type(op)
        given = op.index if kind in _INDEX_OPS else op.key  # type: ignore[union-attr]
        name = index_key(given) if kind in _INDEX_OPS else state_key(given)
        found = positions.get(name)
        if found is None:
            keys.append(name)
            names.append(given)
            found = positions[name] = len(keys)
        kept = history(op.key) if kind is Put or kind is Delete else None  # type: ignore[union-attr]
        if kept is not None:
            listed = positions.get(kept[0])
            if listed is None:
                keys.append(kept[0])
                names.append(given)
                listed = positions[kept[0]] = len(keys)
            if type(op) is Put:
                args += ("ph", found, op.value, _ttl_ms(op), listed, kept[1])
            else:
                args += ("dh", found, listed)
        elif type(op) is Get:
            args += ("g", found)
        elif type(op) is Put:
            args += ("p", found, op.value, _ttl_ms(op))
        elif type(op) is Delete:
            args += ("d", found)
        elif type(op) is IndexAdd:
            args += ("ia", found, len(op.members))
            for member, score in op.members.items():
                args += (repr(float(score)), member)
        elif type(op) is IndexRemove:
            unique = list(dict.fromkeys(op.members))
            args += ("ir", found, len(unique), *unique)
        elif type(op) is IndexIncr:
            args += ("ii", found, op.member, repr(float(op.delta)))
        elif type(op) is IndexRange:
            args += ("r", found, -1 if op.limit is None else op.limit)


_INDEX_OPS = frozenset((IndexAdd, IndexRemove, IndexIncr, IndexRange))


def check_one_slot(call: TxnCall, slot_of: Callable[[str], int]) -> None:
    """On a cluster: refuse a transaction whose keys live in more than one slot.

    Raises:
        InvalidArgumentError: Naming the keys and their slots.
    """
    slots = [slot_of(key) for key in call.keys]
    if len(set(slots)) > 1:
        listed = ", ".join(
            f"{name!r} (slot {slot})" for name, slot in zip(call.names, slots, strict=True)
        )
        raise InvalidArgumentError(
            "on Redis Cluster every key and index of one transaction must hash to one slot "
            f"(give them one {{hash tag}}); these do not: {listed}"
        )


def parse(
    ops: Sequence[TxnOp],
    reply: list[Any],
    entry: Callable[[str, bytes], Entry],
    cursor: Callable[[bytes | None], str | None],
) -> list[Any]:
    """The results of the branch that ran (`ops`), from the script's reply.

    `cursor` makes a change's cursor from its feed id (`None`: the feed is off).
    """
    results: list[Any] = []
    for op, raw in zip(ops, reply, strict=True):
        if type(op) is Get:
            results.append(None if raw is None else entry(op.key, raw))
        elif type(op) is Put:
            results.append(
                new_change(
                    op.key,
                    ChangeOp.SET,
                    raw[2],
                    op.value,
                    int(raw[1]),
                    _at(raw[3]),
                    cursor(raw[4]),
                    int(raw[5]),
                )
            )
        elif type(op) is Delete:
            results.append(
                None
                if raw is None
                else new_change(
                    op.key,
                    ChangeOp.DELETE,
                    raw[1],
                    None,
                    int(raw[0]),
                    _at(raw[2]),
                    cursor(raw[3]),
                    int(raw[4]),
                )
            )
        elif type(op) is IndexAdd or type(op) is IndexRemove:
            results.append(int(raw))
        elif type(op) is IndexIncr:
            results.append(float(raw))
        elif type(op) is IndexRange:
            if raw and not isinstance(raw[0], list):
                raw = list(zip(raw[::2], raw[1::2], strict=True))
            results.append([(member.decode(), float(score)) for member, score in raw])
    return results


def result(
    compare_then_orelse: tuple[Sequence[TxnCompare], Sequence[TxnOp], Sequence[TxnOp]],
    reply: list[Any],
    entry: Callable[[str, bytes], Entry],
    cursor: Callable[[bytes | None], str | None],
) -> TxnResult:
    """The `TxnResult` of the script's reply `{succeeded, results}`."""
    _, then, orelse = compare_then_orelse
    succeeded = int(reply[0]) == 1
    return TxnResult(succeeded, parse(then if succeeded else orelse, reply[1], entry, cursor))


def _at(ms: Any) -> datetime:
    return datetime.fromtimestamp(int(ms) / 1000, UTC)
