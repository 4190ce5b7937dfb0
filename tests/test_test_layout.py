"""The test suite's own layout: shared helpers come from `tests/helpers.py`, never `conftest.py`.

pytest imports every conftest.py itself; a test module importing `tests.conftest` as well gets
a second copy of it under another name (two sets of fixtures, two `BACKEND_MAKERS`). Helpers
that are not fixtures live in `tests/helpers.py`, and every test module imports them there.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


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
