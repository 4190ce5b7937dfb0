r"""Keys in order, and listings that read only what they return.

`SortedKeys` keeps the memory and file stores' keys sorted as they change (a list of sorted
chunks with bisect: O(log n) to add, remove or find where a range starts), so a pattern with a
literal prefix (`agent:*`) reads only the keys in that prefix's range.

`skip_plan` and `skip_scan` answer patterns across entities, `<prefix>*}<rest>` (the managers'
`agents:{*}:recovery`: hash-tagged keys, one tag per entity), without reading every key of every
entity. The scan jumps from one group of keys (the keys up to the first `}` after the prefix:
`agents:{a1}`) to the next with one seek, and in each group reads what `<group><rest>` selects
(one more seek and its result). A key whose `*` would have to cross a second `}` (`agents:{a}x}:r`
matches `agents:{*}:r` with `*` = `a}x`) is found in a second ordered set, the keys with two or
more `}` (`is_braced`), read over the group's range: rare in practice, so each group costs
O(log n) plus what it returns. The SQLite store runs the same scan with an index seek for each
step and a partial index for the braced keys.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from itertools import chain
from typing import TYPE_CHECKING

from agenticstate._keys import escape_glob

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from agenticstate._glob import GlobMatcher

__all__ = ["SortedKeys", "after_prefix", "is_braced", "skip_plan", "skip_scan", "tag_scan"]

_LOAD = 512
"""A chunk's usual size: chunks split past twice this and merge with a neighbour below a quarter."""


def after_prefix(prefix: str) -> str | None:
    """The least key above every key that starts with `prefix` (`None`: there is none).

    Keys hold no surrogate (they are valid UTF-8, as SQLite stores them), so the bound after
    U+D7FF is U+E000.
    """
    while prefix:
        last = ord(prefix[-1])
        if last < 0x10FFFF:
            return prefix[:-1] + chr(last + 1 if last != 0xD7FF else 0xE000)
        prefix = prefix[:-1]
    return None


def is_braced(key: str) -> bool:
    """Whether `key` holds two `}` or more (the keys a skip-scan reads apart)."""
    return key.count("}") >= 2


class SortedKeys:
    """Distinct strings in sorted order: a list of sorted chunks and the last key of each.

    Adding or removing a key costs a bisect over the chunks' last keys, then one in a chunk of
    at most `2 * _LOAD` keys; a range costs the same to find, then what it returns.
    """

    __slots__ = ("_chunks", "_lasts", "_size")

    def __init__(self, keys: Iterable[str] = ()) -> None:
        ordered = sorted(keys)
        self._chunks = [ordered[at : at + _LOAD] for at in range(0, len(ordered), _LOAD)]
        self._lasts = [chunk[-1] for chunk in self._chunks]
        self._size = len(ordered)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[str]:
        return chain.from_iterable(self._chunks)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        at = bisect_left(self._lasts, key)
        if at == len(self._lasts):
            return False
        chunk = self._chunks[at]
        return chunk[bisect_left(chunk, key)] == key

    def add(self, key: str) -> None:
        """Add `key`, which must not be there yet."""
        chunks, lasts = self._chunks, self._lasts
        self._size += 1
        if not lasts:
            chunks.append([key])
            lasts.append(key)
            return
        at = bisect_left(lasts, key)
        if at == len(lasts):
            at -= 1
            chunk = chunks[at]
            chunk.append(key)
            lasts[at] = key
        else:
            chunk = chunks[at]
            insort(chunk, key)
        if len(chunk) > 2 * _LOAD:
            chunks.insert(at + 1, chunk[_LOAD:])
            del chunk[_LOAD:]
            lasts.insert(at, chunk[-1])

    def discard(self, key: str) -> bool:
        """Remove `key`; return whether it was there."""
        chunks, lasts = self._chunks, self._lasts
        at = bisect_left(lasts, key)
        if at == len(lasts):
            return False
        chunk = chunks[at]
        position = bisect_left(chunk, key)
        if chunk[position] != key:
            return False
        del chunk[position]
        self._size -= 1
        if not chunk:
            del chunks[at]
            del lasts[at]
        else:
            lasts[at] = chunk[-1]
            if len(chunk) < _LOAD // 4 and len(chunks) > 1:
                self._merge(at if at + 1 < len(chunks) else at - 1)
        return True

    def _merge(self, at: int) -> None:
        """Join chunk `at` with the next one (splitting the result if it is too long)."""
        chunks, lasts = self._chunks, self._lasts
        joined = chunks[at] + chunks[at + 1]
        del chunks[at + 1]
        del lasts[at + 1]
        if len(joined) > 2 * _LOAD:
            half = len(joined) // 2
            chunks[at] = joined[:half]
            chunks.insert(at + 1, joined[half:])
            lasts[at] = joined[half - 1]
            lasts.insert(at + 1, joined[-1])
        else:
            chunks[at] = joined
            lasts[at] = joined[-1]

    def first(self, low: str, high: str | None, *, above: bool = False) -> str | None:
        """The least key at or above `low` (above it, with `above`) and below `high`, if any."""
        lasts = self._lasts
        seek = bisect_right if above else bisect_left
        at = seek(lasts, low)
        if at == len(lasts):
            return None
        chunk = self._chunks[at]
        key = chunk[seek(chunk, low)]
        return key if high is None or key < high else None

    def range(self, low: str, high: str | None) -> list[str]:
        """The keys from `low` (included) to `high` (excluded; `None`: to the end), in order."""
        chunks, lasts = self._chunks, self._lasts
        at = bisect_left(lasts, low)
        found: list[str] = []
        first = True
        while at < len(chunks):
            chunk = chunks[at]
            start = bisect_left(chunk, low) if first else 0
            first = False
            if high is not None and lasts[at] >= high:
                found.extend(chunk[start : bisect_left(chunk, high, start)])
                break
            found.extend(chunk[start:] if start else chunk)
            at += 1
        return found


def skip_plan(pattern: str) -> tuple[str, str] | None:
    r"""`(prefix, rest)` if `pattern` is `<literal prefix>*}<rest>`, else `None`.

    The prefix is the pattern's literal text before its first metacharacter (escapes resolved);
    then one `*` or more, then a `}` (or `\}`); `rest` is the pattern text after it, as given.
    `agents:{*}:recovery` gives `("agents:{", ":recovery")`.
    """
    prefix: list[str] = []
    position, size = 0, len(pattern)
    while position < size:
        char = pattern[position]
        if char == "\\" and position + 1 < size:
            prefix.append(pattern[position + 1])
            position += 2
        elif char in "*?[\\":
            break
        else:
            prefix.append(char)
            position += 1
    if position >= size or pattern[position] != "*":
        return None
    while position < size and pattern[position] == "*":
        position += 1
    if pattern.startswith("}", position):
        return "".join(prefix), pattern[position + 1 :]
    if pattern.startswith("\\}", position):
        return "".join(prefix), pattern[position + 2 :]
    return None


def skip_scan(
    prefix: str,
    rest: str,
    matcher: GlobMatcher,
    first: Callable[[str, str | None, bool], str | None],
    select: Callable[[str], list[str]],
    braced: Callable[[str, str], list[str]],
) -> list[str]:
    """The keys `matcher` (`<prefix>*}<rest>`, from `skip_plan`) selects, sorted.

    Reads the store through three callables: `first(low, high, above)`, the least key from
    `low` (above it, with `above`) below `high`; `select(pattern)`, the keys a pattern with a
    longer literal prefix selects, sorted; `braced(low, high)`, the keys with two `}` or more in
    that range, sorted. For each group of keys sharing the text up to the first `}` after the
    prefix: one `first`, one `select` of `<group><rest>` and one `braced` over the group. A key
    in the prefix's range with no `}` after the prefix costs one `first` to step over.
    """
    found: list[str] = []
    high = after_prefix(prefix)
    low, above = prefix, False
    while True:
        key = first(low, high, above)
        if key is None:
            return found
        cut = key.find("}", len(prefix))
        if cut < 0:
            low, above = key, True  # matches nothing: `*}` needs a `}` after the prefix
            continue
        group = key[: cut + 1]
        end = after_prefix(group)
        assert end is not None  # noqa: S101  # the group ends with `}`, below U+10FFFF
        direct = select(escape_glob(group) + rest)
        extra = [other for other in braced(group, end) if matcher.match(other)]
        found.extend(sorted(set(direct).union(extra)) if extra else direct)
        low, above = end, False


def tag_scan(prefix: str, first: Callable[[str, str | None, bool], str | None]) -> list[str]:
    """The distinct tags of the keys starting `<prefix>{`, sorted (`Backend.scan_tags`).

    Reads the store through `first(low, high, above)`, as `skip_scan` does: one seek per tag
    (to the first key of its group `<prefix>{<tag>}`, then past the whole group), and one to
    step over each key in the range with no `}` after the `{`. A key whose tag part holds a
    second `}` (`agents:{a}x}:y`) is in the group of its first one (`a`), so it needs no
    second look.
    """
    start = prefix + "{"
    high = after_prefix(start)
    tags: list[str] = []
    low, above = start, False
    while True:
        key = first(low, high, above)
        if key is None:
            break
        cut = key.find("}", len(start))
        if cut < 0:
            low, above = key, True  # no tag: step over this key alone
            continue
        tags.append(key[len(start) : cut])
        end = after_prefix(key[: cut + 1])
        assert end is not None  # noqa: S101  # the group ends with `}`, below U+10FFFF
        low, above = end, False
    # Groups come in key order (`a!}` before `a}`); tags are listed in string order.
    tags.sort()
    return tags
