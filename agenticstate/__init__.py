"""agenticstate: async state for AI agents, on memory, crash-safe files and Redis.

```python
from agenticstate import StateConfig, StateManager

state = StateManager(config=StateConfig(backend="memory"))
await state.save("agent:researcher", {"status": "running"})
```
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from agenticstate.backends import (
    Backend,
    Change,
    ChangeOp,
    Entry,
    MemoryBackend,
    open_backend,
    register_backend,
)
from agenticstate.config import StateConfig
from agenticstate.events import StateChange
from agenticstate.exceptions import (
    AgenticStateError,
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigurationError,
    ConflictError,
    CycleError,
    DecodeError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidNumberError,
    InvalidPatternError,
    InvalidTransitionError,
    MergeError,
    MissingDependencyError,
    NonStringKeyError,
    NotFoundError,
    RetryExhaustedError,
    SerializationError,
    SubscriptionClosedError,
    TooDeepError,
    TooLargeError,
    UnsupportedTypeError,
    WorkflowCancelledError,
    WriteOutcomeUnknownError,
)
from agenticstate.manager import (
    DEFAULT,
    OverflowCallback,
    StateCallback,
    StateEntry,
    StateManager,
    StateStats,
    Watch,
)
from agenticstate.managers import (
    AgentCheckpoint,
    AgentRecoveryManager,
    AgentSnapshot,
    AgentStateStore,
    RecoveryEvent,
    RecoveryRecord,
    StepState,
    StepStatus,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
)
from agenticstate.serialization import Serializer

try:
    __version__ = version("agenticstate")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"

__all__ = [
    "DEFAULT",
    "AgentCheckpoint",
    "AgentRecoveryManager",
    "AgentSnapshot",
    "AgentStateStore",
    "AgenticStateError",
    "Backend",
    "BackendError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "Change",
    "ChangeOp",
    "ConfigurationError",
    "ConflictError",
    "CycleError",
    "DecodeError",
    "Entry",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidNumberError",
    "InvalidPatternError",
    "InvalidTransitionError",
    "MemoryBackend",
    "MergeError",
    "MissingDependencyError",
    "NonStringKeyError",
    "NotFoundError",
    "OverflowCallback",
    "RecoveryEvent",
    "RecoveryRecord",
    "RetryExhaustedError",
    "SerializationError",
    "Serializer",
    "StateCallback",
    "StateChange",
    "StateConfig",
    "StateEntry",
    "StateManager",
    "StateStats",
    "StepState",
    "StepStatus",
    "SubscriptionClosedError",
    "TooDeepError",
    "TooLargeError",
    "UnsupportedTypeError",
    "Watch",
    "WorkflowCancelledError",
    "WorkflowCheckpoint",
    "WorkflowState",
    "WorkflowStateManager",
    "WorkflowStatus",
    "WriteOutcomeUnknownError",
    "__version__",
    "open_backend",
    "register_backend",
]
