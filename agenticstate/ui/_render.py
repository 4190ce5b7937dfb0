"""Values as indented JSON text, cut at a limit without ever building more than the limit.

`shown(value, limit)` returns exactly `json.dumps(value, default=..., ensure_ascii=False,
indent=2)[:limit]` and whether that cut anything, but it writes the text a piece at a time and
stops as soon as the limit is reached: a long string or byte string is encoded from its first
`limit` characters only, a list or dict is walked only as far as the text reaches. Its memory
and time are bounded by the limit, whatever the size of the value (the value itself is already
decoded by then). The text goes into one `io.StringIO` (one growing buffer), not a list of small
strings, which cost tens of bytes each. Containers are walked with an explicit stack, so any
depth is fine.
"""

from __future__ import annotations

import base64
import io
import json
import math
from datetime import date, datetime, timedelta
from typing import Any
from uuid import UUID

from pydantic import BaseModel

__all__ = ["plain", "shown"]

_INDENT = "  "


class _FullError(Exception):
    """The text reached its limit."""


class _Text:
    """A buffer that takes at most `limit` characters, then raises `_FullError`."""

    __slots__ = ("buffer", "room")

    def __init__(self, limit: int) -> None:
        self.buffer = io.StringIO()
        self.room = limit

    def add(self, text: str) -> None:
        if len(text) > self.room:
            self.buffer.write(text[: self.room])
            self.room = 0
            raise _FullError
        self.buffer.write(text)
        self.room -= len(text)


def plain(value: Any) -> Any:
    """What JSON cannot hold, as the inspector shows it (the `default` of `json.dumps`)."""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, bytes):
        return {"$base64": base64.b64encode(value).decode()}
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return repr(value)


def _string(text: str, room: int) -> str:
    # Escaping never shortens a character, so the first `room` characters of a longer string
    # fill the room: the rest of it could not show.
    return json.dumps(text if len(text) <= room else text[:room], ensure_ascii=False)


def _key(key: object, room: int) -> str:
    if isinstance(key, str):
        return _string(key, room)
    if key is True or key is False or key is None:
        return f'"{json.dumps(key)}"'
    if isinstance(key, int | float):
        return f'"{json.dumps(key)}"'
    return _string(str(key), room)


def _jsonable(value: Any, room: int) -> Any:
    """`value` as a JSON type, with byte strings cut to what `room` characters can show."""
    if isinstance(value, str | int | float | dict | list | tuple) or value is None:
        return value
    if isinstance(value, bytes):
        kept = value[: 3 * (room // 4 + 1)]  # base64 of a prefix is a prefix of the base64
        return {"$base64": base64.b64encode(kept).decode()}
    return plain(value)


def _scalar(value: Any, room: int) -> str:
    if isinstance(value, str):
        return _string(value, room)
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    return json.dumps(value)  # int, float (NaN and infinities as json.dumps writes them)


def _write(value: Any, text: _Text) -> None:
    # Each frame: the items left, the closing bracket, the nesting level, whether it is a dict.
    stack: list[tuple[Any, str, int, bool]] = []
    started: list[bool] = []  # whether the frame at the same depth has written an item

    def open_value(item: Any, level: int) -> None:
        item = _jsonable(item, text.room)
        if isinstance(item, dict):
            if not item:
                text.add("{}")
                return
            text.add("{")
            stack.append((iter(item.items()), "}", level, True))
            started.append(False)
        elif isinstance(item, list | tuple):
            if not item:
                text.add("[]")
                return
            text.add("[")
            stack.append((iter(item), "]", level, False))
            started.append(False)
        else:
            text.add(_scalar(item, text.room))

    open_value(value, 0)
    while stack:
        items, closing, level, is_dict = stack[-1]
        try:
            item = next(items)
        except StopIteration:
            stack.pop()
            started.pop()
            text.add("\n" + _INDENT * level + closing)
            continue
        text.add(("\n" if not started[-1] else ",\n") + _INDENT * (level + 1))
        started[-1] = True
        if is_dict:
            key, item = item
            text.add(_key(key, text.room) + ": ")
        open_value(item, level + 1)


def shown(value: Any, limit: int) -> tuple[str, bool]:
    """Return `value` as indented JSON text cut to `limit` characters, and whether it was cut.

    The same text as `json.dumps(value, default=plain, ensure_ascii=False, indent=2)[:limit]`,
    built in memory and time bounded by `limit`.
    """
    text = _Text(limit)
    try:
        _write(value, text)
    except _FullError:
        return text.buffer.getvalue(), True
    return text.buffer.getvalue(), False
