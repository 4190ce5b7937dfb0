"""LangGraph's own checkpointer conformance suite, every base and extended capability, on every
backend the `backend` fixture makes (memory, file, Redis, Redis Cluster; new makers join it)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest

pytest.importorskip("langgraph.checkpoint.conformance")

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    BASE_CAPABILITIES,
    EXTENDED_CAPABILITIES,
)

from agenticstate.langgraph import CheckpointSaver

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agenticstate import StateManager


async def test_conformance_every_capability(state: StateManager) -> None:
    """Every base and extended capability of langgraph-checkpoint-conformance passes."""

    @checkpointer_test(name=f"agenticstate-{state.backend!r}")
    async def saver() -> AsyncIterator[CheckpointSaver]:
        yield CheckpointSaver(state, prefix=f"c{uuid.uuid4().hex[:8]}")

    report = await validate(saver)
    failures = {
        name: result.failures for name, result in report.results.items() if not result.passed
    }
    assert not failures, failures
    tested = {name for name, result in report.results.items() if result.detected}
    assert tested == {cap.value for cap in BASE_CAPABILITIES | EXTENDED_CAPABILITIES}
    assert report.passed_all_base()
    assert sum(result.tests_passed for result in report.results.values()) >= 50
