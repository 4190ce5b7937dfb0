"""The six managers built on `StateManager`.

Agents, workflows, orchestration, knowledge, tools and speech: each stores pydantic records
through a `StateManager`, so each works on every backend.
"""

from __future__ import annotations

__all__: list[str] = []
