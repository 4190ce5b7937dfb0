"""The package's layers, held by tests (see docs/extending/architecture.md).

- Every module imports first, on its own, in a fresh interpreter: no import cycle hidden by the
  order `agenticstate/__init__.py` happens to import things in.
- `agenticstate.backends` never imports the core above it (`manager`, `events`, `scope`) nor the
  managers; `agenticstate.events` (Watch, the callback pumps) never imports `agenticstate.manager`.
- The managers use `StateManager` through its public API only, plus the few private core modules
  listed in `MANAGER_PRIVATE_IMPORTS`.
- Every import between layers goes downward (`LAYERS`, `MAY_IMPORT`: the table the Architecture
  page draws).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "agenticstate"

# Private core modules (and private names of public ones) the managers use today. A new entry
# needs a reason; the goal is to shrink this list, not grow it.
MANAGER_PRIVATE_IMPORTS = {
    "agenticstate._keys": "escape_glob: building glob patterns from user-given key parts",
    "agenticstate._log": "get_logger: the project's loggers",
    "agenticstate._merge": "deep_merge: a session's first state merges as update() merges a dict",
    "agenticstate._otel": "spans for manager operations (telemetry integration)",
    "agenticstate._registry": "backend names for the persistence= shorthand (one registry)",
    "agenticstate._checks": "as_ttl, positive_timedelta: the argument checks shared with the core",
    "agenticstate._retry": "retry_delay: the one bounded exponential wait (tool retries)",
}
# Public core modules the managers may import from.
MANAGER_PUBLIC_IMPORTS = {
    "agenticstate",
    "agenticstate.config",
    "agenticstate.exceptions",
    "agenticstate.manager",
    "agenticstate.txn",
    "agenticstate.view",
}
# Modules above the backends: a backend importing one of these is a layering error.
ABOVE_BACKENDS = ("agenticstate.manager", "agenticstate.managers", "agenticstate.events")
ABOVE_BACKENDS_ALSO = ("agenticstate.scope", "agenticstate.langgraph", "agenticstate.ui")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> list[str]:
    # `__main__` modules run the CLI (or an agent process) when imported; they are not libraries.
    return sorted(
        _module_name(path) for path in PACKAGE.rglob("*.py") if path.name != "__main__.py"
    )


def _imports(path: Path, text: str | None = None) -> list[tuple[str, str | None, int]]:
    """Every import in `path` (module level, under TYPE_CHECKING and inside functions) as
    `(module, name or None, line)`, relative imports resolved; `text` stands in for the file's."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    source = path.read_text() if text is None else text
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            found.extend((module, alias.name, node.lineno) for alias in node.names)
    return found


def _import_alone(module: str) -> tuple[str, int, str]:
    result = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )
    return module, result.returncode, result.stderr[-2000:]


def test_the_module_list_is_complete() -> None:
    """The walk finds the modules that matter (a broken walk would make the next test vacuous)."""
    modules = _modules()
    for name in ("agenticstate", "agenticstate.events", "agenticstate.backends._fanout"):
        assert name in modules
    assert len(modules) > 30


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """`python -c "import agenticstate.X"` works for every module X, each in its own process:
    importing `agenticstate.events` first used to raise ImportError (issue #18, point 1)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(_import_alone, _modules()))
    failed = {module: err for module, code, err in results if code != 0}
    assert failed == {}


def test_events_never_import_the_manager() -> None:
    """`agenticstate.events` (Watch, the callback pumps) sits below `agenticstate.manager`, which
    imports it: it never imports the manager back, not even for type annotations (it names what
    it needs of its manager in a protocol), and neither do the codec and operations below."""
    offenders = []
    for name in ("events.py", "_codec.py", "_reencrypt.py", "_merge.py"):
        for module, imported, line in _imports(PACKAGE / name):
            full = f"{module}.{imported}" if imported else module
            if module == "agenticstate.manager" or full == "agenticstate.manager":
                offenders.append(f"agenticstate/{name}:{line} imports {full}")
    assert offenders == []


def test_the_manager_re_exports_what_moved() -> None:
    """Names that moved out of `agenticstate.manager` (issue #18) still import from there."""
    import agenticstate._codec
    import agenticstate._merge
    import agenticstate.events
    import agenticstate.manager as manager

    assert manager.Watch is agenticstate.events.Watch
    assert manager.Subscription is agenticstate.events.Subscription
    assert manager.StateCallback is agenticstate.events.StateCallback
    assert manager.OverflowCallback is agenticstate.events.OverflowCallback
    assert manager.StateEntry is agenticstate._codec.StateEntry
    assert manager.deep_merge is agenticstate._merge.deep_merge


def test_backends_never_import_the_layers_above() -> None:
    offenders = []
    for path in sorted((PACKAGE / "backends").rglob("*.py")):
        for module, name, line in _imports(path):
            full = f"{module}.{name}" if name else module
            for above in ABOVE_BACKENDS + ABOVE_BACKENDS_ALSO:
                if module == above or module.startswith(above + ".") or full == above:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {full}")
    assert offenders == []


def test_the_layer_check_sees_a_violation() -> None:
    """The import walker finds module-level, TYPE_CHECKING, function-level and relative imports
    (so `offenders == []` above means something)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from agenticstate.manager import StateManager\n"
        "if TYPE_CHECKING:\n    from ..managers import AgentManager\n"
        "def f():\n    import agenticstate.events\n"
    )
    found = {(m, n) for m, n, _ in _imports(PACKAGE / "backends" / "file.py", source)}
    assert ("agenticstate.manager", "StateManager") in found
    assert ("agenticstate.managers", "AgentManager") in found
    assert ("agenticstate.events", None) in found


def _private_names_defined(paths: list[Path]) -> set[str]:
    """The private attributes the given modules define (methods, class attributes, `self._x =`)."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {name for name in names if name.startswith("_")}


def test_managers_use_only_the_public_core() -> None:
    """A manager imports from the public core modules (public names only), from the other
    managers, and from the listed private modules; the only private attributes it touches on
    other objects are ones the managers define themselves (never `state._pumps`)."""
    paths = sorted((PACKAGE / "managers").rglob("*.py"))
    own = _private_names_defined(paths)
    offenders = []
    for path in paths:
        where = path.relative_to(ROOT)
        for module, name, line in _imports(path):
            full = f"{module}.{name}" if name else module
            if not module.startswith("agenticstate"):
                continue
            if module == "agenticstate.managers" or module.startswith("agenticstate.managers."):
                continue
            if module in MANAGER_PRIVATE_IMPORTS or full in MANAGER_PRIVATE_IMPORTS:
                continue
            if module in MANAGER_PUBLIC_IMPORTS and name and not name.startswith("_"):
                continue
            offenders.append(f"{where}:{line} imports {full}")
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in own
            ):
                offenders.append(f"{where}:{node.lineno} touches private .{node.attr}")
    assert offenders == []


def test_the_private_attribute_check_sees_a_violation() -> None:
    """`StateManager`'s private attributes are not among the managers' own names, so a manager
    reaching for `state._pumps` or `state._codec` would be reported."""
    own = _private_names_defined(sorted((PACKAGE / "managers").rglob("*.py")))
    core = _private_names_defined([PACKAGE / "manager.py"])
    assert {"_pumps", "_codec", "_ensure_open"} <= core
    assert not {"_pumps", "_codec", "_ensure_open"} & own


# The layers, bottom up, as docs/extending/architecture.md draws them. A module not listed is an
# integration (langgraph, ui, sync, telemetry and _otel, transfer, cli, demo, testing, ...).
FOUNDATION = {
    "agenticstate._checks",
    "agenticstate._glob",
    "agenticstate._keys",
    "agenticstate._log",
    "agenticstate._registry",
    "agenticstate._retry",
    "agenticstate._tasks",
    "agenticstate._merge",
    "agenticstate._version",
    "agenticstate.config",
    "agenticstate.encryption",
    "agenticstate.exceptions",
    "agenticstate.serialization",
}
CORE = {
    "agenticstate.manager",
    "agenticstate.events",
    "agenticstate.scope",
    "agenticstate.view",
    "agenticstate.txn",
    "agenticstate._codec",
    "agenticstate._reencrypt",
    "agenticstate._usage",
    "agenticstate.commits",
}
TELEMETRY_HOOKS = "agenticstate._otel"  # the core and the managers call its hooks (no-ops if off)
MAY_IMPORT = {
    "foundation": {"foundation"},
    "backends": {"foundation", "backends"},
    "core": {"foundation", "backends", "core", "telemetry-hooks"},
    "managers": {"foundation", "core", "managers", "telemetry-hooks"},
}


def _layer(module: str) -> str:
    if module in FOUNDATION:
        return "foundation"
    if module == "agenticstate.backends" or module.startswith("agenticstate.backends."):
        return "backends"
    if module in CORE:
        return "core"
    if module == "agenticstate.managers" or module.startswith("agenticstate.managers."):
        return "managers"
    if module == TELEMETRY_HOOKS:
        return "telemetry-hooks"
    if module == "agenticstate":
        return "package"
    return "integrations"


def _runtime_imports(path: Path) -> list[tuple[str, int]]:
    """The agenticstate modules `path` imports outside `if TYPE_CHECKING:` blocks (annotations
    may name any layer), `from agenticstate import _otel` resolved to the module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(inner) for inner in ast.walk(node))
    found = []
    for module, name, line in _imports(path):
        if not module.startswith("agenticstate"):
            continue
        if (
            name
            and (PACKAGE.parent / f"{module}.{name}".replace(".", "/")).with_suffix(".py").exists()
        ):
            module = f"{module}.{name}"
        found.append((module, line))
    lines_typing = {
        getattr(node, "lineno", -1)
        for node in ast.walk(tree)
        if id(node) in typing_only and isinstance(node, (ast.Import, ast.ImportFrom))
    }
    return [(module, line) for module, line in found if line not in lines_typing]


def test_imports_go_down_the_layers() -> None:
    """Foundation < backends < core < managers < integrations: no module imports a layer above
    its own (the core and the managers may call the telemetry hooks in `_otel`)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _layer(_module_name(path))
        allowed = MAY_IMPORT.get(importer)
        if allowed is None:  # integrations and the package itself may import any layer
            continue
        for module, line in _runtime_imports(path):
            if _layer(module) not in allowed:
                offenders.append(f"{path.relative_to(ROOT)}:{line} ({importer}) imports {module}")
    assert offenders == []


def test_every_layer_has_modules() -> None:
    """The table names real modules (a renamed module would silently leave its layer)."""
    modules = set(_modules())
    assert modules >= FOUNDATION
    assert modules >= CORE
    assert TELEMETRY_HOOKS in modules
    assert _layer("agenticstate.backends._fanout") == "backends"
    assert _layer("agenticstate.langgraph") == "integrations"


def test_the_layer_walk_resolves_and_filters() -> None:
    """`from agenticstate import _otel` counts as the module `_otel`; an import under
    `if TYPE_CHECKING:` does not count; a function-level import does."""
    found = {module for module, _ in _runtime_imports(PACKAGE / "manager.py")}
    assert "agenticstate._otel" in found
    assert "agenticstate.backends.base" in found
    registry = {module for module, _ in _runtime_imports(PACKAGE / "_registry.py")}
    assert "agenticstate.backends.base" not in registry  # only under TYPE_CHECKING there
    otel = {module for module, _ in _runtime_imports(PACKAGE / "_otel.py")}
    assert "agenticstate.managers.agents" in otel  # imported inside a function
