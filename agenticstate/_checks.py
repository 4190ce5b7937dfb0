"""The argument checks more than one module makes, one helper each: a TTL and a positive timedelta.

```python
ttl = as_ttl(5)                                      # timedelta(seconds=5); None stays None
max_age = positive_timedelta(max_age, "max_age")     # a timedelta > 0, or None
```

Both raise `InvalidArgumentError` (a `ValueError`, so a pydantic validator may call them too)
with a message that says what was given.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from agenticstate.exceptions import InvalidArgumentError

__all__ = ["as_ttl", "positive_timedelta", "wrong_object"]


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
