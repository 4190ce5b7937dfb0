r"""A glob matcher that agrees with Redis, for the memory and file backends.

Redis matches `SCAN MATCH`, `KEYS` and `PSUBSCRIBE` patterns with `stringmatchlen` (`src/util.c`).
This module is a faithful port, so a pattern selects the same keys on every backend:

- `*` matches any run of bytes, `:` included; `?` matches exactly one byte;
- `[abc]`, `[a-z]` (reversed ranges work too), `[^abc]` negation, `\` escapes inside brackets;
- `\x` matches `x` literally; an unterminated `[` runs to the end of the pattern.

Matching works on UTF-8 bytes, as Redis does: `?` matches one byte, not one character, and range
bounds compare as signed C chars. `fnmatch` differs (`[!a]` negation, no escapes, `?` per
character), and translating to a regex by replacing `*` is wrong for escapes, so neither is used.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["GlobMatcher", "compile_glob", "glob_match"]

_STAR, _QUESTION, _OPEN, _CLOSE, _BACKSLASH, _CARET, _DASH = b"*?[]\\^-"
_META = frozenset(b"*?[\\")


def _signed(byte: int) -> int:
    # Redis compares range bounds as `char`, which is signed on the platforms it runs on.
    return byte - 256 if byte >= 128 else byte


def _mark(table: bytearray, start: int, end: int) -> None:
    """Mark the bytes whose signed value lies in `start..end` (both signed, `start <= end`)."""
    if end < 0:
        table[start + 256 : end + 257] = b"\x01" * (end - start + 1)
    elif start >= 0:
        table[start : end + 1] = b"\x01" * (end - start + 1)
    else:
        table[: end + 1] = b"\x01" * (end + 1)
        table[start + 256 :] = b"\x01" * -start


_NEGATE = bytes.maketrans(b"\x00\x01", b"\x01\x00")

_Class = tuple[int, int, bytes]
"""A parsed class: where the parse stops (`p`, `plen`) and which of the 256 bytes it matches."""


def _parse_class(pat: bytes, p: int, plen: int) -> _Class:
    """Parse the class opening at `p` exactly as `stringmatchlen` walks it.

    Redis walks the whole class for every byte it tests, and where the walk ends never depends
    on that byte, so one walk can record every byte the class matches. A class after a `*` is
    tried at every position of the key; parsing it once keeps that linear in the key.
    """
    p += 1
    plen -= 1
    negate = pat[p] == _CARET
    if negate:
        p += 1
        plen -= 1
    table = bytearray(256)
    while True:
        if pat[p] == _BACKSLASH and plen >= 2:
            p += 1
            plen -= 1
            table[pat[p]] = 1
        elif pat[p] == _CLOSE:
            break
        elif plen == 0:
            p -= 1
            plen += 1
            break
        elif plen >= 3 and pat[p + 1] == _DASH:
            start, end = _signed(pat[p]), _signed(pat[p + 2])
            if start > end:
                start, end = end, start
            p += 2
            plen -= 2
            _mark(table, start, end)
        else:
            table[pat[p]] = 1
        p += 1
        plen -= 1
    members = bytes(table)
    return p, plen, members.translate(_NEGATE) if negate else members


def _match(
    pat: bytes,
    p: int,
    plen: int,
    s: bytes,
    i: int,
    slen: int,
    skip: list[bool],
    classes: dict[int, _Class],
) -> bool:
    """Port of `stringmatchlen_impl`; `pat` ends with a NUL byte as C strings do.

    `classes` holds the pattern's classes parsed so far, by position (`p + plen` is the same at
    every step, so a position names one parse, whatever the key).
    """
    while plen and slen:
        c = pat[p]
        if c == _STAR:
            while plen and pat[p + 1] == _STAR:
                p += 1
                plen -= 1
            if plen == 1:
                return True
            while slen:
                if _match(pat, p + 1, plen - 1, s, i, slen, skip, classes):
                    return True
                if skip[0]:
                    return False
                i += 1
                slen -= 1
            # Nothing after this star matches anywhere in the rest of the string, so no earlier
            # star can help by matching more: stop (this keeps the match polynomial).
            skip[0] = True
            return False
        if c == _QUESTION:
            i += 1
            slen -= 1
        elif c == _OPEN:
            parsed = classes.get(p)
            if parsed is None:
                parsed = classes[p] = _parse_class(pat, p, plen)
            p, plen, members = parsed
            if not members[s[i]]:
                return False
            i += 1
            slen -= 1
        else:
            if c == _BACKSLASH and plen >= 2:
                p += 1
                plen -= 1
            if pat[p] != s[i]:
                return False
            i += 1
            slen -= 1
        p += 1
        plen -= 1
        if slen == 0:
            while pat[p] == _STAR:
                p += 1
                plen -= 1
            break
    return plen == 0 and slen == 0


class GlobMatcher:
    """A compiled Redis glob pattern.

    Attributes:
        pattern: The pattern as given.
        literal_prefix: The text every matching key starts with (the part of the pattern before
            its first metacharacter), used to skip keys cheaply.
        is_literal: Whether the pattern has no metacharacters at all (it matches one key).
        is_prefix: Whether the pattern is its literal prefix followed by stars only (it matches
            exactly the keys that start with the prefix).
        literal_suffix: The text every matching key ends with (the literal part after the
            pattern's last wildcard or class): with the prefix, what lets a fan-out find the
            patterns a key may match without trying each one.
    """

    __slots__ = (
        "_classes",
        "_pat",
        "_plen",
        "is_literal",
        "is_prefix",
        "literal_prefix",
        "literal_suffix",
        "pattern",
    )

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        raw = pattern.encode("utf-8", "surrogatepass")
        self._plen = len(raw)
        self._pat = raw + b"\0"
        # The classes met so far, parsed: at most one 256-byte table per class in the pattern.
        self._classes: dict[int, _Class] = {}
        prefix = bytearray()
        position = 0
        while position < len(raw):
            byte = raw[position]
            if byte == _BACKSLASH and position + 1 < len(raw):
                prefix.append(raw[position + 1])
                position += 2
                continue
            if byte in _META:
                break
            prefix.append(byte)
            position += 1
        self.is_literal = position >= len(raw)
        # Only stars after the prefix: a key matches exactly when it starts with the prefix.
        self.is_prefix = not self.is_literal and raw[position:].strip(b"*") == b""
        # Whole characters: the prefix stops only at an ASCII metacharacter or the end.
        self.literal_prefix = bytes(prefix).decode("utf-8", "surrogatepass")
        self.literal_suffix = _literal_suffix(self._pat, self._plen).decode(
            "utf-8", "surrogatepass"
        )

    def __repr__(self) -> str:
        return f"GlobMatcher({self.pattern!r})"

    def match(self, key: str) -> bool:
        """Return whether `key` matches the pattern, exactly as Redis would decide."""
        if self.literal_prefix and not key.startswith(self.literal_prefix):
            return False
        if self.is_prefix:
            return True
        data = key.encode("utf-8", "surrogatepass")
        return _match(self._pat, 0, self._plen, data, 0, len(data), [False], self._classes)


def _literal_suffix(pat: bytes, plen: int) -> bytes:
    """The literal bytes after the last `*`, `?` or class of `pat`, walked as `_match` walks it."""
    p = 0
    suffix = bytearray()
    while plen:
        c = pat[p]
        if c in (_STAR, _QUESTION):
            suffix.clear()
        elif c == _OPEN:
            p, plen, _ = _parse_class(pat, p, plen)
            suffix.clear()
        elif c == _BACKSLASH and plen >= 2:
            p += 1
            plen -= 1
            suffix.append(pat[p])
        else:
            suffix.append(c)
        p += 1
        plen -= 1
    return bytes(suffix)


@lru_cache(maxsize=1024)
def compile_glob(pattern: str) -> GlobMatcher:
    """Return a (cached) `GlobMatcher` for `pattern`."""
    return GlobMatcher(pattern)


def glob_match(pattern: str, key: str) -> bool:
    """Return whether `key` matches the Redis glob `pattern`."""
    return compile_glob(pattern).match(key)
