"""Change events: the records users see.

`StateChange` is what `StateManager.subscribe` callbacks and `watch()` iterators receive. The
in-process fan-out backends share (`ChangeFanout`, `ChangeStream`) lives in
`agenticstate.backends._fanout`, below this layer; it is re-exported here under its old import
path, unchanged.
"""

from __future__ import annotations

from datetime import datetime  # pydantic needs it at runtime
from typing import Any

from pydantic import BaseModel, ConfigDict

from agenticstate.backends._fanout import ChangeFanout, ChangeStream
from agenticstate.backends.base import ChangeOp

__all__ = ["ChangeFanout", "ChangeStream", "StateChange"]


class StateChange(BaseModel):
    """A committed change to one key, as subscribers receive it.

    Attributes:
        key: The key that changed.
        old_value: The value before the change (`None` if the key was missing).
        new_value: The value after it (`None` after a delete).
        version: The version written; for a delete, the version deleted.
        op: What happened.
        timestamp: When the change committed (UTC).
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    key: str
    old_value: Any
    new_value: Any
    version: int
    op: ChangeOp
    timestamp: datetime
