"""The six managers built on `StateManager`.

Agents, workflows, orchestration, knowledge, tools and speech: each stores pydantic records
through a `StateManager`, so each works on every backend.
"""

from __future__ import annotations

from agenticstate.managers._base import StateManagerBase
from agenticstate.managers.agents import (
    AgentCheckpoint,
    AgentRecoveryManager,
    AgentSnapshot,
    AgentStateStore,
    RecoverableAgent,
    RecoveryEvent,
    RecoveryHook,
    RecoveryRecord,
)
from agenticstate.managers.workflows import (
    StepState,
    StepStatus,
    WorkflowCheckpoint,
    WorkflowState,
    WorkflowStateManager,
    WorkflowStatus,
    WorkflowStep,
)

__all__ = [
    "AgentCheckpoint",
    "AgentRecoveryManager",
    "AgentSnapshot",
    "AgentStateStore",
    "RecoverableAgent",
    "RecoveryEvent",
    "RecoveryHook",
    "RecoveryRecord",
    "StateManagerBase",
    "StepState",
    "StepStatus",
    "WorkflowCheckpoint",
    "WorkflowState",
    "WorkflowStateManager",
    "WorkflowStatus",
    "WorkflowStep",
]
