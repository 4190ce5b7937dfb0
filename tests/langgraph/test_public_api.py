"""`agenticstate.langgraph` exports exactly its sorted `__all__`, and every name exists."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("langgraph")


def _isort_key(name: str) -> tuple[int, str]:
    """Ruff's RUF022 order, as tests/test_public_api.py: CONSTANTS, Classes, functions."""
    if name.isupper():
        return (0, name)
    if name[0].isupper():
        return (1, name)
    return (2, name)


def test_langgraph_all_is_sorted_and_complete() -> None:
    """The integration's public names are listed, sorted, and importable."""
    module = importlib.import_module("agenticstate.langgraph")
    assert module.__all__ == sorted(module.__all__, key=_isort_key)
    assert module.__all__ == [
        "HEAD_GUARD_KEY",
        "CheckpointRetention",
        "CheckpointSaver",
        "StaleCheckpointError",
        "Store",
    ]
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_stale_error_is_a_conflict() -> None:
    """StaleCheckpointError is caught by `except ConflictError` like every lost race."""
    from agenticstate import ConflictError
    from agenticstate.langgraph import StaleCheckpointError

    assert issubclass(StaleCheckpointError, ConflictError)
