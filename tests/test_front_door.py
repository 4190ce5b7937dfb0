"""The texts a new user reads first name everything the package has: every registered backend,
every manager and every extra, taken from the registry, `agenticstate.managers.__all__` and
pyproject.toml, so a backend, manager or extra added later is checked here too."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import agenticstate
import agenticstate.managers as managers
from agenticstate._registry import backend_names
from agenticstate.managers._base import StateManagerBase

if TYPE_CHECKING:
    from collections.abc import Callable

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}


def manager_names() -> list[str]:
    """The managers: the public classes built on `StateManagerBase`."""
    found = [getattr(managers, name) for name in managers.__all__]
    return sorted(
        kind.__name__
        for kind in found
        if isinstance(kind, type) and issubclass(kind, StateManagerBase)
        and kind is not StateManagerBase
    )  # fmt: skip


def read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def first_paragraph(path: str) -> str:
    """The text of a page up to its first blank line after the title."""
    body = read(path).split("\n", 1)[1].strip()
    return body.split("\n\n", 1)[0]


def mkdocs_description() -> str:
    found = re.search(r"^site_description: (.*)$", read("mkdocs.yml"), re.MULTILINE)
    assert found is not None
    return found[1]


# A backend's registered name as prose may spell it (a pattern): `postgres` is "PostgreSQL".
SPOKEN = {"postgres": "postgres(ql)?"}

# Where backends are listed for a newcomer: each must name every registered backend.
BACKEND_LISTS: dict[str, Callable[[], str]] = {
    "README intro": lambda: read("README.md").split("```", 1)[0],
    "pyproject description": lambda: str(PYPROJECT["project"]["description"]),
    "docs site description": mkdocs_description,
    "package docstring": lambda: (agenticstate.__doc__ or "").split("\n\n")[0],
    "home page": lambda: first_paragraph("docs/index.md"),
    "LangGraph page": lambda: first_paragraph("docs/langgraph.md"),
    "sessions page, persistence=": lambda: next(
        part for part in read("docs/sessions.md").split("\n\n") if "persistence=" in part
    ),
}
# Where the managers are listed: each must name every one of them, by class.
MANAGER_LISTS: dict[str, Callable[[], str]] = {
    "README": lambda: read("README.md"),
    "home page": lambda: first_paragraph("docs/index.md"),
    "package docstring": lambda: (agenticstate.__doc__ or "").split("```")[0],
}
# Where installing is explained: each must give every extra pyproject.toml has.
EXTRA_LISTS: dict[str, Callable[[], str]] = {
    "README": lambda: read("README.md"),
    "getting started": lambda: read("docs/getting-started.md"),
}


def test_the_lists_cover_the_package() -> None:
    """The registry has the four built-in backends, there are seven managers, and the extras
    are read from pyproject.toml: the tests below check real lists."""
    assert {"memory", "file", "sqlite", "redis"} <= set(backend_names())
    assert "SessionManager" in manager_names()
    assert len(manager_names()) == 7
    assert {"redis", "langgraph", "ui"} <= set(PYPROJECT["project"]["optional-dependencies"])


@pytest.mark.parametrize("where", list(BACKEND_LISTS))
def test_every_backend_is_named(where: str) -> None:
    """Each place that lists backends names every registered backend (SQLite, the embedded
    default, included) and Redis Cluster."""
    text = " ".join(BACKEND_LISTS[where]().split())
    missing = [
        name
        for name in backend_names()
        if not re.search(rf"\b{SPOKEN.get(name, name)}\b", text, re.IGNORECASE)
    ]
    assert missing == [], f"{where}: {text!r}"
    if where != "sessions page, persistence=":  # a persistence= name, not a URL
        assert "Redis Cluster" in text, where


@pytest.mark.parametrize("where", list(MANAGER_LISTS))
def test_every_manager_is_named(where: str) -> None:
    """Each place that lists the managers names every one of them, `SessionManager` included."""
    text = " ".join(MANAGER_LISTS[where]().split())
    assert [name for name in manager_names() if name not in text] == [], where


@pytest.mark.parametrize("where", list(EXTRA_LISTS))
def test_every_extra_is_given(where: str) -> None:
    """The install instructions give every extra of pyproject.toml, installed from a checkout
    (`pip install ".[redis]"`), besides `pip install .` itself."""
    text = EXTRA_LISTS[where]()
    assert "pip install .  " in text or "pip install .\n" in text, where
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert [name for name in extras if f'pip install ".[{name}]"' not in text] == [], where


def test_every_count_of_managers_is_right() -> None:
    """Wherever the docs say "N managers", N is the number of managers there are."""
    wrong = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"\b(\w+) (?:specialized )?managers\b", text, re.IGNORECASE):
            count = NUMBERS.get(match[1].lower())
            if count is not None and count != len(manager_names()):
                wrong.append(f"{path.relative_to(ROOT)}: {match[0]}")
    assert wrong == []
