r"""The plain-dict model the model-based tests compare every backend against.

Nothing here imports agenticstate: the model states what the API promises in the simplest terms
it can be written in, so that it is a check and not a copy.

- Keys come from a small fixed set that includes every glob metacharacter (`*?[]\^`), so writes
  collide and `list_keys` must treat those characters literally when they are escaped.
- Patterns are literal keys with every metacharacter escaped, plus a few wildcard patterns whose
  matches a one-line predicate computes (prefix, suffix, length, first-character class): Redis
  glob semantics, without a glob matcher in the model.
- Values are small JSON-like data; `canon` compares them strictly (1, 1.0 and True differ).
- Lives (issue #32): each write that finds its key missing starts a new life of it, numbered
  across the store; a write is named by its key's `(life, version)`, which is what a revision
  names, so a token read from an earlier life is stale however the versions compare.
- History (issue #23): `HISTORY` names how many versions some keys keep; the model keeps each
  key's retained versions, and a delete or an expiry ends them (a rewrite starts at version 1).
  Every committed change carries the step that made it (a `save_many` or a `transact` commits
  several in one step), so a feed read in one stream can be checked for order across keys.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

Json: TypeAlias = "bool | int | float | str | list[Json] | dict[str, Json] | None"

TAGGED: tuple[str, ...] = ("{t}a", "{t}:b", "{t}*")
"""Keys sharing the hash tag `{t}`: one slot on a Redis Cluster, so one `transact` may name all."""

KEYS: tuple[str, ...] = (
    "a",
    "b",
    "ab",
    "a:b",
    "a*",
    "*",
    "a?b",
    "[ab]",
    "x\\y",
    "^a",
    "a]",
    *TAGGED,
)
"""Every key the model-based test writes: each glob metacharacter appears in at least one."""

INDEXES: tuple[str, ...] = ("{t}i", "{t}j")
"""The sorted indexes `transact` writes (tagged like `TAGGED`)."""

_GLOB_SPECIAL = frozenset("*?[]\\^")


def literal(text: str) -> str:
    """A pattern that matches exactly `text`: a backslash before every metacharacter."""
    return "".join("\\" + char if char in _GLOB_SPECIAL else char for char in text)


def _equals(key: str) -> Callable[[str], bool]:
    return lambda k: k == key


def _literal_patterns() -> list[tuple[str, Callable[[str], bool]]]:
    return [(literal(key), _equals(key)) for key in KEYS]


PATTERNS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("*", lambda k: True),
    *_literal_patterns(),
    ("a*", lambda k: k.startswith("a")),
    (literal("a:") + "*", lambda k: k.startswith("a:")),
    (literal("[") + "*", lambda k: k.startswith("[")),
    (literal("x\\") + "*", lambda k: k.startswith("x\\")),
    ("*" + literal("b"), lambda k: k.endswith("b")),
    ("*" + literal("*"), lambda k: k.endswith("*")),
    ("*" + literal("]"), lambda k: k.endswith("]")),
    ("*:*", lambda k: ":" in k),
    ("?", lambda k: len(k) == 1),
    ("??", lambda k: len(k) == 2),
    ("???", lambda k: len(k) == 3),
    ("[ab]*", lambda k: k[0] in "ab"),
    ("[^a]*", lambda k: k[0] != "a"),
    ("a?b", lambda k: len(k) == 3 and k[0] == "a" and k[2] == "b"),
    ("nothing*", lambda k: k.startswith("nothing")),
    ("{t}*", lambda k: k.startswith("{t}")),
)
"""Glob patterns with the predicate that says which keys each one matches."""

PATTERN_NAMES: tuple[str, ...] = tuple(pattern for pattern, _ in PATTERNS)
MATCHES: dict[str, Callable[[str], bool]] = dict(PATTERNS)

HISTORY: dict[str, int] = {"a*": 3, "{t}*": 2, literal("b"): 4}
"""History rules (the first matching pattern wins): keys under `a` keep 3 versions, the tagged
keys 2, `b` 4, every other key only its current one."""


def history_depth(key: str) -> int:
    """How many versions `HISTORY` keeps of `key` (1: only the current one)."""
    return next((depth for pattern, depth in HISTORY.items() if MATCHES[pattern](key)), 1)


def canon(value: object) -> object:
    """A hashable form of `value` that tells apart what Python's `==` does not (1, 1.0, True).

    Dict order is ignored (a dict is a mapping); list order is not.
    """
    if value is None:
        return ("none",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, list):
        return ("list", tuple(canon(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), canon(v)) for k, v in value.items())))
    return ("other", type(value).__name__, repr(value))


def merged(base: dict[str, Json], partial: Mapping[str, Json]) -> dict[str, Json]:
    """The documented deep merge: nested dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in partial.items():
        current = out.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            out[key] = merged(current, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def depth(value: Json) -> int:
    """How deeply containers nest in `value` (a scalar is 0)."""
    if isinstance(value, list):
        return 1 + max((depth(item) for item in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(item) for item in value.values()), default=0)
    return 0


class Boom(Exception):  # noqa: N818  # a plain marker raised by a test function
    """Raised by the update function that fails; nothing may be written."""


def _incr(value: Json) -> Json:
    return value + 1 if type(value) is int and value < 2**63 - 1 else 0


def _wrap(value: Json) -> Json:
    return {"prev": value if depth(value) < 16 else None}


def _append(value: Json) -> Json:
    return [*value, len(value)] if isinstance(value, list) else [value]


def _mutate(value: Json) -> Json:
    # Changes its argument in place: the update gets its own copy, so no one else may see this.
    if isinstance(value, dict):
        value["mutated"] = True
    elif isinstance(value, list):
        value.append("mutated")
    return value


def _to_none(value: Json) -> Json:
    return None


def _boom(value: Json) -> Json:
    raise Boom


def _unstorable(value: Json) -> Json:
    return {"bad": {1, 2}}  # type: ignore[dict-item]  # a set cannot be stored, on purpose


UPDATE_FUNCTIONS: dict[str, Callable[[Json], Json]] = {
    "incr": _incr,
    "wrap": _wrap,
    "append": _append,
    "mutate": _mutate,
    "to_none": _to_none,
    "boom": _boom,
    "unstorable": _unstorable,
}
"""Update functions by name; `boom` raises, `unstorable` returns a value that cannot be stored."""


@dataclass(frozen=True)
class Stored:
    """What the model holds at a key."""

    value: Json
    version: int
    has_ttl: bool
    life: int = 0  # which life of its key this is (a new one after each delete or expiry)


@dataclass(frozen=True)
class Committed:
    """One change the model expects subscribers to see: `old`/`new` are `None` when missing."""

    key: str
    op: str
    old: Json
    new: Json
    version: int
    step: int = 0  # the state machine's step that committed it


@dataclass
class Model:
    """The state a backend must hold, and every change committed to it, in commit order.

    `versions` holds each present key's retained versions, oldest first, at most
    `history_depth(key)` of them (the last one is the current value).
    """

    data: dict[str, Stored]
    log: list[Committed]
    indexes: dict[str, dict[str, float]] = field(default_factory=dict)
    versions: dict[str, list[tuple[int, Json]]] = field(default_factory=dict)
    step: int = 0
    lives: int = 0  # lives begun so far, of every key

    @classmethod
    def empty(cls) -> Model:
        return cls(data={}, log=[])

    def history(self, key: str) -> list[tuple[int, Json]]:
        """The retained `(version, value)`s of `key`, newest first (`[]` when it is missing)."""
        return list(reversed(self.versions.get(key, [])))

    def _keep(self, key: str, version: int, value: Json) -> None:
        kept = [] if version == 1 else self.versions.get(key, [])
        kept = [*kept, (version, copy.deepcopy(value))]
        self.versions[key] = kept[-history_depth(key) :]

    def write_of(self, key: str) -> tuple[int, int] | None:
        """The write `key` holds now, as `(life, version)`, or `None` when it is missing."""
        stored = self.data.get(key)
        return None if stored is None else (stored.life, stored.version)

    def version(self, key: str) -> int:
        stored = self.data.get(key)
        return 0 if stored is None else stored.version

    def write(self, key: str, value: Json, *, has_ttl: bool = False) -> int:
        """Record a committed write; return the version it gets."""
        old = self.data.get(key)
        version = 1 if old is None else old.version + 1
        if old is None:
            self.lives += 1
        kept = copy.deepcopy(value)
        self.data[key] = Stored(kept, version, has_ttl, self.lives if old is None else old.life)
        old_value = None if old is None else old.value
        self.log.append(Committed(key, "set", old_value, kept, version, self.step))
        self._keep(key, version, kept)
        return version

    def delete(self, key: str) -> bool:
        """Record a delete; return whether the key existed."""
        old = self.data.pop(key, None)
        if old is None:
            return False
        self.log.append(Committed(key, "delete", old.value, None, old.version, self.step))
        self.versions.pop(key, None)
        return True

    def expire(self, key: str) -> None:
        """Record that `key` expired: it is gone (and its history), and no change is announced."""
        self.data.pop(key, None)
        self.versions.pop(key, None)

    def keys_matching(self, pattern: str) -> list[str]:
        return sorted(key for key in self.data if MATCHES[pattern](key))

    # Sorted indexes: members with scores, read lowest score first, ties by member.

    def index_add(self, index: str, members: Mapping[str, float]) -> int:
        found = self.indexes.setdefault(index, {})
        added = sum(member not in found for member in members)
        found.update(members)
        return added

    def index_remove(self, index: str, members: list[str]) -> int:
        found = self.indexes.get(index, {})
        removed = sum(found.pop(member, None) is not None for member in dict.fromkeys(members))
        if not found:
            self.indexes.pop(index, None)
        return removed

    def index_incr(self, index: str, member: str, delta: float) -> float:
        found = self.indexes.setdefault(index, {})
        found[member] = found.get(member, 0.0) + delta
        return found[member]

    def index_range(self, index: str, limit: int | None = None) -> list[tuple[str, float]]:
        ordered = sorted(self.indexes.get(index, {}).items(), key=lambda item: (item[1], item[0]))
        return ordered if limit is None else ordered[:limit]
