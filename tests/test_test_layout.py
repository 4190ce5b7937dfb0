"""The layout of the code around the package: the test suite's helpers, and bench/.

- Shared helpers come from `tests/helpers.py`, never `conftest.py`. pytest imports every
  conftest.py itself; a test module importing `tests.conftest` as well gets a second copy of it
  under another name (two sets of fixtures, two `BACKEND_MAKERS`).
- bench/ uses agenticstate's public API only: no private module, name or attribute, so that a
  benchmark or the soak measures what users get and survives a refactoring of the internals.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
BENCH = TESTS.parent / "bench"
# Private attributes of the standard library bench/ may use (not agenticstate's).
STDLIB_PRIVATE = {"_clear_type_cache", "_exit"}


def _imported_modules(path: Path) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append(("." * node.level + (node.module or ""), node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
    return found


def test_no_test_module_imports_conftest() -> None:
    """Every module under tests/ takes shared helpers from tests.helpers, not from conftest."""
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{line}: imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module, line in _imported_modules(path)
        if module.lstrip(".") == "conftest" or module.endswith(".conftest")
    ]
    assert not offenders, "import shared helpers from tests.helpers:\n" + "\n".join(offenders)


def test_the_rule_sees_an_import_from_conftest(tmp_path: Path) -> None:
    """The check above finds each spelling of an import from conftest."""
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "from tests.conftest import unique_prefix\n"
        "import tests.conftest\n"
        "from .conftest import BACKEND_MAKERS\n",
        encoding="utf-8",
    )
    modules = [module for module, _ in _imported_modules(sample)]
    assert modules == ["tests.conftest", "tests.conftest", ".conftest"]


def _private_uses(path: Path) -> list[str]:
    """agenticstate's private modules and names imported, and private attributes read (but on
    `self` and the few of the standard library in `STDLIB_PRIVATE`)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("agenticstate"):
            parts = (node.module or "").split(".") + [alias.name for alias in node.names]
            private = [part for part in parts if part.startswith("_")]
            found += [f"{node.lineno}: from {node.module}: {part}" for part in private]
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {alias.name}"
                for alias in node.names
                if alias.name.startswith("agenticstate") and "._" in alias.name
            ]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in STDLIB_PRIVATE
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
            and not str(node.args[1].value).startswith("__")
        ):
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_bench_uses_the_public_api_only() -> None:
    """No module of bench/ imports a private agenticstate module or name, or reads a private
    attribute."""
    offenders = [
        f"bench/{path.name}:{use}"
        for path in sorted(BENCH.glob("*.py"))
        for use in _private_uses(path)
    ]
    assert not offenders, "bench/ uses private internals:\n" + "\n".join(offenders)


def test_the_bench_rule_sees_private_uses(tmp_path: Path) -> None:
    """The check above finds a private module, a private name and a private attribute."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from agenticstate.backends import _local\n"
        "from agenticstate._keys import validate_key\n"
        "import agenticstate._glob\n"
        "size = state.backend._connections\n"
        "self._fine = sys._clear_type_cache\n"
        "pool = getattr(backend, '_local', None)\n",
        encoding="utf-8",
    )
    assert _private_uses(sample) == [
        "1: from agenticstate.backends: _local",
        "2: from agenticstate._keys: _keys",
        "3: import agenticstate._glob",
        "4: ._connections",
        "6: getattr(..., '_local')",
    ]
