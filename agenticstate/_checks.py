"""The argument checks more than one module makes, one helper each: TTLs and other durations.

```python
ttl = as_ttl(5)                                      # timedelta(seconds=5); None stays None
max_age = positive_timedelta(max_age, "max_age")     # a timedelta > 0, or None
lease = duration(lease, "lease")                     # a timedelta > 0, or None
delay = duration(delay, "delay", seconds=True, zero=True)  # seconds or a timedelta >= 0
interval = seconds(interval, "sync_interval")        # a finite number of seconds > 0
```

Every duration parameter of the public API goes through one of these, so each accepts what its
annotation says (a `timedelta`, a number of seconds, or either; `None` where it is optional) and
refuses the rest, a bool, NaN, infinity and a negative (or zero) duration included.

Both raise `InvalidArgumentError` (a `ValueError`, so a pydantic validator may call them too)
with a message that says what was given.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Literal, overload

from agenticstate.exceptions import InvalidArgumentError

__all__ = ["as_ttl", "duration", "positive_timedelta", "seconds", "wrong_object"]


def as_ttl(value: object) -> timedelta | None:
    """Return a time to live as a timedelta: from seconds (int or float) or a timedelta.

    None means "no TTL" and stays None.

    Raises:
        InvalidArgumentError: Not a number of seconds or a timedelta (a bool is neither), not
            finite, not positive, or so long that the expiry would fall after the year 9999.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidArgumentError("ttl must be seconds or a timedelta, not a bool")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgumentError(f"ttl must be a finite number of seconds, not {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            # Say what was typed: timedelta(seconds=-5) would print as "-1 day, 23:59:55".
            raise InvalidArgumentError(f"ttl must be positive, not {value!r} seconds")
        try:
            value = timedelta(seconds=value)
        except OverflowError:
            raise InvalidArgumentError(f"ttl of {value!r} seconds is too long") from None
    if not isinstance(value, timedelta):
        raise InvalidArgumentError(
            f"ttl must be seconds or a timedelta, not {type(value).__name__}"
        )
    if value <= timedelta(0):
        raise InvalidArgumentError(f"ttl must be positive, not {value}")
    try:
        datetime.now(UTC) + value
    except OverflowError:
        raise InvalidArgumentError(
            f"ttl {value} is too long: it would expire after the year 9999"
        ) from None
    return value


def positive_timedelta(value: object, name: str) -> timedelta | None:
    """Return `value` if it is None or a timedelta greater than zero.

    Raises:
        InvalidArgumentError: Anything else, named `name` in the message.
    """
    if value is None:
        return None
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidArgumentError(f"{name} must be a positive timedelta or None, not {value!r}")
    return value


@overload
def duration(
    value: object, name: str, *, seconds: bool = ..., zero: bool = ..., optional: Literal[False]
) -> timedelta: ...
@overload
def duration(
    value: object, name: str, *, seconds: bool = ..., zero: bool = ..., optional: bool = ...
) -> timedelta | None: ...
def duration(
    value: object,
    name: str,
    *,
    seconds: bool = False,
    zero: bool = False,
    optional: bool = True,
) -> timedelta | None:
    """Return a duration parameter as a timedelta (None stays None where it is `optional`).

    Args:
        value: What was passed.
        name: The parameter, as the message names it.
        seconds: Whether a number of seconds (int or float, not a bool) is accepted too.
        zero: Whether zero is accepted (a delay or an age), not only positive durations.
        optional: Whether None is accepted.

    Raises:
        InvalidArgumentError: Anything else, named `name` in the message.
    """
    if value is None and optional:
        return None
    least = "non-negative" if zero else "positive"
    kinds = "timedelta or number of seconds" if seconds else "timedelta"
    wanted = f"{name} must be a {least} {kinds}{' or None' if optional else ''}"
    if seconds and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise InvalidArgumentError(f"{wanted}, not {value!r} seconds")
        try:
            given, value = value, timedelta(seconds=value)
        except OverflowError:
            raise InvalidArgumentError(f"{name} of {value!r} seconds is too long") from None
        if given > 0 and not value:
            value = timedelta(microseconds=1)  # below a timedelta's resolution: the least one
    if not isinstance(value, timedelta):
        raise InvalidArgumentError(f"{wanted}, not {_shown(value)}")
    if value < timedelta(0) or (value == timedelta(0) and not zero):
        raise InvalidArgumentError(f"{wanted}, not {value!r}")
    return value


def seconds(value: object, name: str, *, zero: bool = False, unit: str = "seconds") -> float:
    """Return a duration parameter given in seconds: a finite int or float (not a bool).

    Args:
        value: What was passed.
        name: The parameter, as the message names it.
        zero: Whether zero is accepted, not only positive numbers.
        unit: What the number counts, as the message says it (LangGraph's TTLs are minutes).

    Raises:
        InvalidArgumentError: Anything else (a timedelta too), named `name` in the message.
    """
    least = "non-negative" if zero else "positive"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(
            f"{name} must be a {least} number of {unit}, not {_shown(value)}"
        )
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise InvalidArgumentError(
            f"{name} must be a {least} finite number of {unit}, not {value!r}"
        )
    return float(value)


def _shown(value: object) -> str:
    # A timedelta or a number is shown as it is; anything else by its type (never its value).
    if isinstance(value, (timedelta, int, float, str)) or value is None:
        return repr(value)
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def wrong_object(value: object, *, parameter: str, expected: str, owner: str) -> str:
    """Say that `owner` got `value` for `parameter` where it takes an `expected`.

    Both types are named with their modules (`agenticstate.sync.StateManager` is not
    `agenticstate.StateManager`), and a blocking object of the sync API gets what to pass
    instead: the blocking twin of `owner`, or the async object it wraps.
    """
    kind = type(value)
    text = f"{owner}: {parameter} must be an {expected}, not {kind.__module__}.{kind.__qualname__}"
    if kind.__module__ == "agenticstate.sync":
        text += (
            f"; {owner} is the async API: use agenticstate.sync.{owner}({parameter}=...) for a "
            f"blocking one over it, or pass {parameter}.async_object from async code running on "
            "the sync API's loop"
        )
    return text
