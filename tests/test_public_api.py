"""The public API: what `agenticstate` exports, sorted and importable."""

from __future__ import annotations

import importlib

import pytest

import agenticstate

PUBLIC_MODULES = [
    "agenticstate",
    "agenticstate.backends",
    "agenticstate.managers",
    "agenticstate.sync",
    "agenticstate.telemetry",
    "agenticstate.testing",
]

# The names the seed page ("State Management") imports from agenticaiframework.state.
SEED_CORE_NAMES = ["StateManager", "StateConfig", "MemoryBackend"]


def _isort_key(name: str) -> tuple[int, str]:
    # The order ruff's RUF022 keeps: CONSTANTS, then Classes, then functions and dunders.
    if name.isupper() and len(name) > 1:
        return (0, name)
    if name[0].isupper():
        return (1, name)
    return (2, name)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_all_is_sorted_and_importable(module_name: str) -> None:
    """Every public module lists its names in a sorted __all__, and each one exists."""
    module = importlib.import_module(module_name)
    names = list(module.__all__)
    assert names == sorted(names, key=_isort_key)
    for name in names:
        assert hasattr(module, name), name


def test_seed_core_names_are_exported() -> None:
    """The seed page's core names import from agenticstate."""
    for name in SEED_CORE_NAMES:
        assert name in agenticstate.__all__


# Sessions, scoped views (issue 22): importable from the package and from agenticstate.managers.
SESSION_NAMES = ["SessionManager", "Session", "SessionMessage", "SessionSummary", "SessionDeletion"]


def test_session_names_are_exported() -> None:
    """The session manager and its records import from agenticstate and .managers."""
    for name in SESSION_NAMES:
        assert name in agenticstate.__all__
        assert name in agenticstate.managers.__all__
    assert "ScopedState" in agenticstate.__all__


def test_sync_api_wraps_every_manager() -> None:
    """agenticstate.sync has a blocking class for StateManager and every manager."""
    import agenticstate.sync

    for name in agenticstate.managers.__all__:
        if name.endswith(("Manager", "Store")) and name != "StateManagerBase":
            assert name in agenticstate.sync.__all__, name
    assert "StateManager" in agenticstate.sync.__all__


def test_exceptions_share_one_root() -> None:
    """Every exported exception derives from AgenticStateError."""
    for name in agenticstate.__all__:
        value = getattr(agenticstate, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, agenticstate.AgenticStateError), name


def test_version_is_set() -> None:
    """__version__ comes from the installed package metadata."""
    assert agenticstate.__version__.count(".") >= 2


def test_no_pickle_in_the_package() -> None:
    """No module of the package imports pickle or a pickle-like serializer."""
    import pathlib
    import re

    root = pathlib.Path(agenticstate.__file__).parent
    pattern = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|dill|shelve|cloudpickle)\b", re.M)
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []
