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
from agenticstate.managers.knowledge import (
    IndexingEstimate,
    IndexingProgress,
    IndexingStatus,
    KnowledgeBaseState,
    KnowledgeStateManager,
    ProgressSample,
    SourceState,
    SyncStatus,
)
from agenticstate.managers.orchestration import (
    AgentCoordinationState,
    AgentStatus,
    OrchestrationStateManager,
    TaskClaim,
    TaskItem,
    TaskPriority,
    TaskQueueState,
    TaskStatus,
    TeamState,
)
from agenticstate.managers.speech import (
    AudioSession,
    AudioSessionStatus,
    SpeechStateManager,
    StreamingMode,
    STTState,
    TranscriptionStatus,
    TTSState,
    VoiceConversationState,
)
from agenticstate.managers.tools import (
    RetryState,
    ToolCacheEntry,
    ToolExecution,
    ToolExecutionStatus,
    ToolStateManager,
    ToolStats,
    hash_parameters,
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
    "AgentCoordinationState",
    "AgentRecoveryManager",
    "AgentSnapshot",
    "AgentStateStore",
    "AgentStatus",
    "AudioSession",
    "AudioSessionStatus",
    "IndexingEstimate",
    "IndexingProgress",
    "IndexingStatus",
    "KnowledgeBaseState",
    "KnowledgeStateManager",
    "OrchestrationStateManager",
    "ProgressSample",
    "RecoverableAgent",
    "RecoveryEvent",
    "RecoveryHook",
    "RecoveryRecord",
    "RetryState",
    "STTState",
    "SourceState",
    "SpeechStateManager",
    "StateManagerBase",
    "StepState",
    "StepStatus",
    "StreamingMode",
    "SyncStatus",
    "TTSState",
    "TaskClaim",
    "TaskItem",
    "TaskPriority",
    "TaskQueueState",
    "TaskStatus",
    "TeamState",
    "ToolCacheEntry",
    "ToolExecution",
    "ToolExecutionStatus",
    "ToolStateManager",
    "ToolStats",
    "TranscriptionStatus",
    "VoiceConversationState",
    "WorkflowCheckpoint",
    "WorkflowState",
    "WorkflowStateManager",
    "WorkflowStatus",
    "WorkflowStep",
    "hash_parameters",
]
