r"""Key and pattern validation and the key layout helpers, in one place.

A key is a non-empty `str` of at most `MAX_KEY_BYTES` bytes in UTF-8 with no control characters
(Unicode category `Cc`) and no lone surrogates. Glob metacharacters (`*?[]^\`) are allowed in
keys: match them literally in a pattern by escaping them with a backslash (see `escape_glob`).
"""

from __future__ import annotations

import unicodedata

from agenticstate.exceptions import ConfigurationError, InvalidKeyError, InvalidPatternError

__all__ = [
    "KEY_PREFIX_SEPARATOR",
    "MAX_KEY_BYTES",
    "RESERVED_PREFIX",
    "escape_glob",
    "validate_key",
    "validate_key_prefix",
    "validate_pattern",
]

MAX_KEY_BYTES = 1024
"""The longest key (and pattern) accepted, in UTF-8 bytes."""

_GLOB_SPECIAL = frozenset("*?[]\\^")
# Recently validated keys (validation is a pure function of the key, and most writes reuse a
# working set of keys): a set lookup instead of five string checks.
_VALID_KEYS: set[str] = set()
_VALID_KEYS_KEPT = 4096

RESERVED_PREFIX = "__agenticstate"
"""Keys may not start with this: the Redis backend keeps its own keys and channels there."""


def _problem(text: object, what: str) -> str | None:
    if not isinstance(text, str):
        return f"{what} must be a str, not {type(text).__name__}"
    if not text:
        return f"{what} must not be empty"
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{what} contains a lone surrogate and is not valid UTF-8"
    if size > MAX_KEY_BYTES:
        return f"{what} is {size} bytes in UTF-8; the maximum is {MAX_KEY_BYTES}"
    if what == "key" and text.startswith(RESERVED_PREFIX):
        return f"keys starting with {RESERVED_PREFIX!r} are reserved for agenticstate itself"
    # Most keys are short ASCII; checking `isprintable` first keeps the common case fast.
    if not text.isprintable():
        for position, char in enumerate(text):
            if unicodedata.category(char) == "Cc":
                return f"{what} contains control character {char!r} at position {position}"
    return None


def validate_key(key: object) -> str:
    """Return `key` if it is a valid state key.

    Raises:
        InvalidKeyError: The key is not a str, is empty, too long, or has control characters.
    """
    if type(key) is str:
        if key in _VALID_KEYS:
            return key
        # The common case in a few C calls: printable ASCII is one byte a character, and no
        # printable character is a control character.
        if (
            0 < len(key) <= MAX_KEY_BYTES
            and key.isascii()
            and key.isprintable()
            and not key.startswith(RESERVED_PREFIX)
        ):
            if len(_VALID_KEYS) >= _VALID_KEYS_KEPT:
                _VALID_KEYS.clear()
            _VALID_KEYS.add(key)
            return key
    problem = _problem(key, "key")
    if problem is not None:
        raise InvalidKeyError(problem)
    return key  # type: ignore[return-value]  # _problem proved it is a str


def validate_pattern(pattern: object) -> str:
    """Return `pattern` if it is a valid glob pattern (same rules as keys).

    Raises:
        InvalidPatternError: The pattern is not a str, is empty, too long, or has control
            characters.
    """
    problem = _problem(pattern, "pattern")
    if problem is not None:
        raise InvalidPatternError(problem)
    return pattern  # type: ignore[return-value]  # _problem proved it is a str


KEY_PREFIX_SEPARATOR = ":"
"""What a non-empty key prefix must end with, so that it has an unambiguous boundary."""


def validate_key_prefix(prefix: object) -> str:
    """Return `prefix` if it is a valid key prefix (namespace) for a shared store.

    A prefix is empty (the whole database) or ends with `:`. Without that boundary `app1` would
    see every key of `app12` (`app12x` is `app1` + `2x`); with it, `app1:` and `app12:` never
    meet. Prefixes nest at `:` like directories: `app:` contains `app:tenant:`'s keys, as the
    empty prefix contains every prefix's keys.

    Raises:
        ConfigurationError: The prefix is not a str, does not end with `:`, or has control
            characters or a lone surrogate.
    """
    if not isinstance(prefix, str):
        raise ConfigurationError(f"key_prefix must be a str, not {type(prefix).__name__}")
    if not prefix:
        return prefix
    if not prefix.endswith(KEY_PREFIX_SEPARATOR):
        raise ConfigurationError(
            f"key_prefix {prefix!r} must end with {KEY_PREFIX_SEPARATOR!r} (for example "
            f"{prefix + KEY_PREFIX_SEPARATOR!r}), so that no other prefix can start with it; "
            "a store written under a prefix without it must be migrated first (see "
            "'Key prefixes' in the Redis backend docs)"
        )
    problem = _problem(prefix, "key_prefix")
    if problem is not None or prefix.startswith(RESERVED_PREFIX):
        raise ConfigurationError(problem or f"key_prefix may not start with {RESERVED_PREFIX!r}")
    return prefix


def escape_glob(text: str) -> str:
    r"""Escape glob metacharacters so that `text` matches only itself.

    `escape_glob("tenant[1]:*")` returns `tenant\[1\]:\*`.
    """
    return "".join("\\" + char if char in _GLOB_SPECIAL else char for char in text)
