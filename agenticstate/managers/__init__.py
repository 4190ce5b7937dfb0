"""The six managers built on `StateManager`: agents, workflows, orchestration, knowledge, tools,
speech. Each stores pydantic records through a `StateManager`, so each works on every backend."""

from __future__ import annotations

__all__: list[str] = []
