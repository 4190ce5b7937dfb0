"""LangGraph integration: a checkpointer and a long-term memory store on any agenticstate backend.

```python
from agenticstate import StateManager
from agenticstate.langgraph import CheckpointSaver, Store

async with StateManager(StateConfig(backend="redis", redis_url=...)) as state:
    graph = builder.compile(checkpointer=CheckpointSaver(state), store=Store(state))
```

Needs the `langgraph` extra: `pip install "agenticstate[langgraph]"`.
"""

from __future__ import annotations

from agenticstate.exceptions import MissingDependencyError

try:
    import langgraph.checkpoint.base
    import langgraph.store.base  # noqa: F401 (fail here, not at first use)
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("langgraph", "langgraph") from exc

from agenticstate.langgraph._common import StaleCheckpointError
from agenticstate.langgraph.checkpoint import HEAD_GUARD_KEY, CheckpointRetention, CheckpointSaver
from agenticstate.langgraph.store import Store

__all__ = [
    "HEAD_GUARD_KEY",
    "CheckpointRetention",
    "CheckpointSaver",
    "StaleCheckpointError",
    "Store",
]
