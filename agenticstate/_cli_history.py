"""The `agenticstate` commands that read a store's past: `history`, `changes`, `log`, `diff`.

```console
agenticstate history agent:1 --limit 5           # the retained versions, newest first
agenticstate changes 'agent:*' --since CURSOR    # the change feed after CURSOR, as JSON lines
agenticstate changes 'agent:*' --follow          # ... then live, until Ctrl-C (or --limit N)
agenticstate log agent:1:                        # the commits of a scope (a key prefix)
agenticstate diff COMMIT_A COMMIT_B              # keys added, removed and changed
```

`agenticstate.cli` registers them (`add_commands`) and runs them like its own (`COMMANDS`): the
same store options, output helpers and exit codes. A cursor whose changes were trimmed is a user
error (exit 2) with what to do next; a store that keeps no feed is one too.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from agenticstate._glob import compile_glob
from agenticstate._keys import validate_pattern
from agenticstate.backends import EARLIEST
from agenticstate.cli import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    _CommandError,
    _dump,
    _out,
    _positive_int,
    _table,
)
from agenticstate.exceptions import (
    CursorExpiredError,
    SubscriptionClosedError,
    UnsupportedOperationError,
)

if TYPE_CHECKING:
    import argparse
    from collections.abc import AsyncIterator, Awaitable, Callable

    from agenticstate._progress import Progress
    from agenticstate.events import StateChange
    from agenticstate.manager import StateManager

__all__ = ["COMMANDS", "add_commands"]

NOW = "now"
"""`--since now`: start at the feed's head (with `--follow`, only what is written from now on)."""
IDLE = 2.0
"""Seconds without a change after which a replay (no `--follow`) counts as having reached the
head: the fallback for a head no retained change carries (a Redis Cluster's; a file store's
after an index update; one trimmed)."""
_EVERY_VERSION = 2**31 - 1  # a history depth no writer's rule exceeds
_VALUE_WIDTH = 100  # characters of a value a table shows (`--json` shows all of it)


def add_commands(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add the commands to the parser, through `agenticstate.cli`'s `command(name, help)`."""
    history = command("history", "the retained versions of a key, newest first")
    history.add_argument("key", help="the key to read")
    history.add_argument(
        "--limit", type=_positive_int, default=None, help="show at most this many versions"
    )
    changes = command(
        "changes", "the change feed after a cursor, as JSON lines (then live with --follow)"
    )
    changes.add_argument("pattern", help="a Redis glob such as 'agent:*'")
    changes.add_argument(
        "--since",
        default=EARLIEST,
        metavar="CURSOR",
        help=f"start after this cursor (a change's `cursor`); {EARLIEST!r}: everything retained "
        f"(the default); {NOW!r}: the feed's head",
    )
    changes.add_argument(
        "--follow",
        action="store_true",
        help="after the retained changes, go on with live ones until Ctrl-C (default: stop at "
        "the head the feed had when the command started)",
    )
    changes.add_argument(
        "--limit", type=_positive_int, default=None, help="stop after this many changes"
    )
    log = command("log", "the commits of a scope, newest first")
    log.add_argument("scope", help="the scope (key prefix) the commits were made of")
    log.add_argument(
        "--limit", type=_positive_int, default=None, help="show at most this many commits"
    )
    diff = command("diff", "the keys added, removed and changed from one commit to another")
    diff.add_argument("a", metavar="A", help="the older commit's id")
    diff.add_argument("b", metavar="B", help="the newer commit's id")


# ---------------------------------------------------------------- history


async def _history(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    # A backend reads the history of the keys its rules name; this process writes nothing, so a
    # rule naming every key only lets it show whatever the writers kept. A backend that keeps
    # no history refuses rules, and shows the current version.
    with contextlib.suppress(UnsupportedOperationError):
        state.backend.keep_history({"*": _EVERY_VERSION})
    entries = await state.history(args.key, limit=args.limit)
    if not entries:
        raise _CommandError(f"no state at key {args.key!r}", EXIT_NOT_FOUND)
    if args.json:
        _out(_dump([entry.model_dump() for entry in entries]))  # ttl in seconds
        return EXIT_OK
    rows = [
        {
            "version": entry.version,
            "updated": entry.updated_at.isoformat(timespec="milliseconds"),
            "value": _shortened(_dump(entry.value)),
        }
        for entry in entries
    ]
    _out(_table(rows, ["version", "updated", "value"]))
    if len(entries) == 1 and entries[0].version > 1 and args.limit != 1:
        # Not an error, but rarely what was hoped for: say where history comes from.
        _note(
            "only the current version is retained: the processes that write this key keep "
            'history when their StateConfig(history={"pattern": depth}) names it'
        )
    return EXIT_OK


def _shortened(text: str) -> str:
    return text if len(text) <= _VALUE_WIDTH else text[: _VALUE_WIDTH - 3] + "..."


def _note(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


# ---------------------------------------------------------------- changes


@dataclass
class _Reading:
    """Where `changes` is in the feed: the last cursor read, and why it stopped (if it did)."""

    position: str
    shown: int = 0
    at_head: bool = False  # reached the head taken at the start (no --follow)
    idle: bool = False  # no change came for IDLE seconds (no --follow)
    at_limit: bool = False
    closed: bool = False  # the store closed

    @property
    def done(self) -> bool:
        return self.at_head or self.idle or self.at_limit or self.closed


async def _changes(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    matches = compile_glob(validate_pattern(args.pattern)).match
    head = await state.feed_cursor()
    if head is None:
        raise _CommandError(
            "this store keeps no change feed (opened with feed=off): use `watch` for live changes",
            EXIT_USAGE,
        )
    until = None if args.follow else head
    reading = _Reading(head if args.since == NOW else args.since)
    reading.at_head = until is not None and (reading.position == until or _empty(until))
    while not reading.done:
        try:
            # Every key, matched here: the replay then reaches the change at the head even when
            # it is not one of the pattern's, so the command knows it has read everything.
            async with state.changes("*", since=reading.position) as feed:
                await _read(feed, reading, matches, until, args.limit)
        except SubscriptionClosedError as exc:
            if exc.reason != "overflow":
                raise
            # It fell behind (a slow reader of its output): resume after the last change read.
        except CursorExpiredError:
            raise _CommandError(
                f"the changes after cursor {reading.position!r} are no longer retained (the "
                "feed keeps a bounded number of changes; or the cursor is of another store): "
                "re-read the state you need, then go on with --since now, or replay what is "
                "left with --since earliest",
                EXIT_USAGE,
            ) from None
        except UnsupportedOperationError as exc:
            raise _CommandError(f"{exc}: use `watch` for live changes", EXIT_USAGE) from None
    # At the head every retained change up to it was read, shown or not: go on from there. A
    # silence only suggests it: go on from the last change read, which skips nothing.
    resume = head if reading.at_head else reading.position
    plural = "" if reading.shown == 1 else "s"
    _note(f"{reading.shown} change{plural}; to go on: --since {resume}")
    return EXIT_OK


async def _read(
    feed: AsyncIterator[StateChange],
    reading: _Reading,
    matches: Callable[[str], object],
    until: str | None,
    limit: int | None,
) -> None:
    """Print the changes of `feed` that match, until `limit`, the head `until`, or the end."""
    changes = aiter(feed)
    while True:
        # A replay reads stored changes without pause; a silence means none is left before the
        # head (the fallback when no retained change carries the head's cursor).
        with anyio.move_on_after(math.inf if until is None else IDLE) as waited:
            change = await anext(changes, None)
        if waited.cancelled_caught:
            reading.idle = True
            return
        if until is not None and _after(change, until):
            reading.at_head = True
            return
        if change is None:
            reading.closed = True
            return
        if change.cursor is not None:
            reading.position = change.cursor
        if matches(change.key):
            _out(_change_json(change))
            reading.shown += 1
        reading.at_head = reading.position == until
        reading.at_limit = limit is not None and reading.shown >= limit
        if reading.done:
            return


def _change_json(change: StateChange) -> str:
    return _dump(
        {
            "cursor": change.cursor,
            "key": change.key,
            "op": change.op.value,
            "version": change.version,
            "timestamp": change.timestamp,
            "old_value": change.old_value,
            "new_value": change.new_value,
        }
    )


# A cursor is opaque to users; to stop a replay at the head taken at the start, the command
# orders a change's cursor against the head when their forms allow it: a kind tag, a store id
# and a position made of numbers at the end (`m1:<store>:42`, `s1:<db>:42`, `r1:<ms>-<n>`), or
# a Redis Cluster head `c1:<floor>:` (every change stamped at `floor` ms or later is after it)
# against a change's `c1:<floor>:<slot>=<ms - floor>.<n>,...` (its own slot first). Any other
# form is left to the idle fallback.
_POSITION = re.compile(r"^(?P<feed>.*?)(?P<position>\d+(?:-\d+)?)$")
_CLUSTER_HEAD = re.compile(r"^c1:(?P<floor>\d+):$")
_CLUSTER_CHANGE = re.compile(r"^c1:(?P<floor>\d+):\d+=(?P<ms>-?\d+)\.\d+")


def _after(change: StateChange | None, head: str) -> bool:
    """Whether `change` was written after `head` (both of one feed; `False` if unknown)."""
    if change is None or change.cursor is None:
        return False
    floor, stamped = _CLUSTER_HEAD.match(head), _CLUSTER_CHANGE.match(change.cursor)
    if floor is not None or stamped is not None:
        if floor is None or stamped is None:
            return False
        return int(stamped["floor"]) + int(stamped["ms"]) >= int(floor["floor"])
    mine, theirs = _POSITION.match(change.cursor), _POSITION.match(head)
    if mine is None or theirs is None or mine["feed"] != theirs["feed"]:
        return False
    return _numbers(mine["position"]) > _numbers(theirs["position"])


def _empty(head: str) -> bool:
    """Whether `head` is the head of a feed no change was ever written to (`r1:0-0`)."""
    found = _POSITION.match(head)
    return found is not None and not any(_numbers(found["position"]))


def _numbers(position: str) -> tuple[int, ...]:
    return tuple(int(part) for part in position.split("-"))


# ---------------------------------------------------------------- log, diff


_SHORT_ID = 12  # hex digits of a commit id a table shows (any unique prefix of 8+ names it)


async def _log(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    commits = await state.log(args.scope, limit=args.limit)
    if args.json:
        _out(_dump([commit.model_dump(mode="json") for commit in commits]))
        return EXIT_OK
    if not commits:
        _out(f"no commits of scope {args.scope!r}")
        return EXIT_OK
    rows = [
        {
            "commit": commit.id[:_SHORT_ID] + (" (pinned)" if commit.pinned else ""),
            "time": commit.timestamp.isoformat(timespec="seconds"),
            "keys": commit.keys,
            "+": commit.added,
            "~": commit.changed,
            "-": commit.removed,
            "message": commit.message,
        }
        for commit in commits
    ]
    _out(_table(rows, ["commit", "time", "keys", "+", "~", "-", "message"]))
    return EXIT_OK


async def _diff(state: StateManager, args: argparse.Namespace, progress: Progress) -> int:
    difference = await state.diff(args.a, args.b)
    if args.json:
        _out(_dump(difference.model_dump(mode="json")))
        return EXIT_OK
    for mark, keys in (
        ("+", difference.added),
        ("-", difference.removed),
        ("~", difference.changed),
    ):
        for key in keys:
            _out(f"{mark} {key}")
    counts = (len(difference.added), len(difference.removed), len(difference.changed))
    _note("{} added, {} removed, {} changed".format(*counts))
    return EXIT_OK


COMMANDS: dict[str, Callable[[StateManager, argparse.Namespace, Progress], Awaitable[int]]] = {
    "history": _history,
    "changes": _changes,
    "log": _log,
    "diff": _diff,
}
"""The commands by name, each run like `agenticstate.cli`'s own."""
