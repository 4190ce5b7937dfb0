"""Docstrings that make claims about the code, held to them (issue #18, point 7)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from agenticstate.exceptions import DecodeError
from agenticstate.serialization import Serializer, payload_is_compressed

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "agenticstate"

# The modules that use json or msgpack for formats of their own, as serialization.py's docstring
# lists them (never for a stored value's payload). A new one means revisiting that docstring.
OWN_FORMATS = {
    "agenticstate/serialization.py",
    "agenticstate/backends/_file_format.py",  # snapshot and log framing
    "agenticstate/transfer.py",  # dump lines
    "agenticstate/cli.py",  # output
    "agenticstate/ui/_app.py",  # the inspector's output
    "agenticstate/ui/_render.py",  # the inspector's bounded JSON text of a value
    "agenticstate/managers/sessions.py",  # a message's text
    "agenticstate/managers/tools.py",  # the cache key's canonical text
}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_modules_using_json_or_msgpack_are_the_ones_named() -> None:
    users = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(name.split(".")[0] in ("json", "msgpack") for name in names):
                users.add(str(path.relative_to(ROOT)))
    assert users == OWN_FORMATS


def test_only_serialization_reads_the_payload_header_bits() -> None:
    """No other module masks a value's header byte with a literal (`value[0] & 0x80`)."""
    pattern = re.compile(r"\[0\]\s*&\s*(0x[0-9a-fA-F]+|\d+)")
    offenders = [
        str(path.relative_to(ROOT))
        for path in _modules()
        if path.name != "serialization.py" and pattern.search(path.read_text())
    ]
    assert offenders == []


def test_payload_is_compressed() -> None:
    big = {"text": "x" * 5000}
    compressed = Serializer(compression=True, compression_threshold=100).dumps(big)
    plain = Serializer().dumps(big)
    assert payload_is_compressed(compressed)
    assert not payload_is_compressed(plain)
    for bad in (b"", b"\x7f{}"):
        with pytest.raises(DecodeError):
            payload_is_compressed(bad)


def test_no_docstring_describes_the_file_backends_old_io_thread() -> None:
    """The file backend's log is synced by an fsync agent process, not "one I/O thread"."""
    stale = [
        str(path.relative_to(ROOT))
        for path in _modules()
        if re.search(r"I/O thread", path.read_text(), re.IGNORECASE)
    ]
    assert stale == []
    text = (PACKAGE / "backends" / "file.py").read_text()
    assert "fsync\nagent** process" in text or "fsync agent" in text


FILE_BACKEND = [PACKAGE / "backends" / "file.py", *(PACKAGE / "backends").glob("_file_*.py")]


def _handled_names(handler: ast.ExceptHandler) -> set[str]:
    kinds = handler.type
    nodes = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds] if kinds else []
    return {node.id for node in nodes if isinstance(node, ast.Name)}


def test_the_file_backend_maps_os_errors_in_one_place() -> None:
    """`_file_io.translate` is the one `except OSError` of the file backend's modules (cleanup
    that ignores an error, `contextlib.suppress(OSError)`, maps nothing)."""
    assert len(FILE_BACKEND) >= 5  # file.py and its _file_* modules
    handlers = [
        path.name
        for path in FILE_BACKEND
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.ExceptHandler) and "OSError" in _handled_names(node)
    ]
    assert handlers == ["_file_io.py"]


def test_the_file_backend_writes_no_payload_header_byte() -> None:
    """A stored value's header byte is serialization's: the file backend asks `json_text` and
    `json_payload` and holds no one-byte literal of a header (`b"\\x02"`)."""
    headers = {bytes((kind | flag,)) for kind in (0x01, 0x02) for flag in (0, 0x80)}
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in FILE_BACKEND
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Constant) and node.value in headers
    ]
    assert found == []


def test_the_file_backend_logs_from_file_py_only() -> None:
    """file.py's docstring: every event of the file backend is logged under its logger, so its
    private modules hold no logger."""
    for path in FILE_BACKEND:
        if path.name != "file.py":
            assert "get_logger" not in path.read_text(), path.name
