"""How long to wait before a retry: the one place the code base grows a wait exponentially.

```python
await anyio.sleep(retry_delay(failures, base=0.05, cap=5.0))   # 0.05, 0.1, 0.2, ... 5, 5, 5
time.sleep(backoff(attempt, base=0.0002, cap=0.004))  # a worker thread's wait, never the loop's
```

Both are bounded by `cap` for any count of attempts: the power is never computed past the cap
(a float overflows after about a thousand doublings, so `base * 2**attempt` raises
`OverflowError` in a loop that retries for long enough). A test walks the package's source for
any other power with a variable exponent.
"""

from __future__ import annotations

import math
import random
import sys

__all__ = ["backoff", "retry_delay"]


def retry_delay(attempt: int, *, base: float, cap: float, factor: float = 2.0) -> float:
    """Return `min(cap, base * factor**attempt)`, in seconds, for any count of `attempt`s.

    `attempt` 0 (or less) waits `base`; a `factor` of 1 (or less) waits `base` every time.
    """
    cap = min(cap, sys.float_info.max)  # an infinite cap: the largest finite wait
    if base <= 0 or cap <= 0:
        return 0.0
    if attempt <= 0 or factor <= 1 or base >= cap:
        return float(min(cap, base))
    # Compare logarithms: base * factor**attempt >= cap exactly when this holds.
    growth = attempt * math.log(factor)
    if growth >= math.log(cap) - math.log(base):
        return float(cap)
    if growth < 700:  # factor**attempt is a finite float (exact for small powers of two)
        return float(min(cap, base * factor**attempt))
    return float(min(cap, math.exp(math.log(base) + growth)))


def backoff(attempt: int, *, base: float = 0.001, cap: float = 0.05) -> float:
    """Return a full-jitter delay, in seconds, for a retry after `attempt` failures.

    Uniform between 0 and `retry_delay(attempt, base=base, cap=cap)`, so never above `cap`.
    """
    return random.uniform(0, retry_delay(attempt, base=base, cap=cap))  # noqa: S311  # jitter
