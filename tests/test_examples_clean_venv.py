"""Every program in docs/examples runs twice in a row in a fresh virtualenv holding only what its
docstring's `Install:` line says to install (the package built from this checkout, with that
extra), and the README's first example with the package alone: nothing an example needs comes
from the development environment.

Builds one wheel, then one virtualenv per distinct install line (pip from the package index, as
a reader would, run from outside: `pip --python` installs into a virtualenv made without pip);
slow, so marked, and kept in the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.test_docs_examples import EXAMPLES, readme_example

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
INSTALL = re.compile(r'^Install: `pip install (?:"\.\[(?P<extra>[a-z,]+)\]"|\.)`', re.MULTILINE)


def _extra(path: Path) -> str:
    """The extra the example's docstring says to install ('' for the package alone)."""
    found = INSTALL.search(path.read_text(encoding="utf-8"))
    assert found is not None, f"{path.name}'s docstring has no `Install:` line"
    return found["extra"] or ""


def test_every_example_says_what_to_install() -> None:
    """Each example's docstring names its install line."""
    assert {path.name: _extra(path) for path in EXAMPLES}


def _run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )


def test_examples_run_twice_in_clean_virtualenvs(tmp_path: Path) -> None:
    """Built wheel + each example's extra in its own venv: the example exits 0 twice."""
    wheels = tmp_path / "wheels"
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        tmp_path,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("agenticstate-*.whl")
    by_extra: dict[str, list[Path]] = {}
    for path in EXAMPLES:
        by_extra.setdefault(_extra(path), []).append(path)
    for extra, paths in sorted(by_extra.items()):
        home = tmp_path / f"venv-{extra or 'base'}"
        # No pip inside (ensurepip took most of this test's time): this environment's pip
        # installs into it (`--python`), from the package index all the same.
        venv.create(home, with_pip=False)
        python = str(home / "bin" / "python")
        wanted = f"agenticstate[{extra}] @ {wheel.as_uri()}" if extra else str(wheel)
        pip = [sys.executable, "-m", "pip", "--python", python]
        installed = _run([*pip, "install", "-q", wanted], tmp_path)
        assert installed.returncode == 0, installed.stdout + installed.stderr
        work = tmp_path / f"run-{extra or 'base'}"
        work.mkdir()
        if not extra:
            paths = [*paths, readme_example(work)]
        for path in paths:
            for attempt in ("first", "second"):
                result = _run([python, str(path)], work, timeout=180)
                assert result.returncode == 0, (
                    f"{path.name} ({attempt} run, only {wanted!r} installed):\n"
                    + result.stdout
                    + result.stderr
                )
