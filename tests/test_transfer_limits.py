"""An import checks every value against the destination's largest value before it writes.

A destination states its largest value by `MAX_VALUE_BYTES` (file) or `max_value_size`
(SQLite, lower by option); `value_limit` reads both. For each SQLite limit x where the value
over it sits in the dump (first, middle, last line) an import is refused with nothing written,
and a value exactly at the limit is imported.
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING

import pytest

from agenticstate import FileBackend, MemoryBackend, SerializationError, SQLiteBackend
from agenticstate.transfer import import_state, value_limit

if TYPE_CHECKING:
    from pathlib import Path


def _dump(path: Path, values: list[bytes]) -> Path:
    lines: list[dict[str, object]] = [
        {"format": "agenticstate-dump", "version": 1, "pattern": "*", "created_at": None}
    ]
    for n, value in enumerate(values):
        lines.append(
            {
                "type": "entry",
                "key": f"k{n:04d}",
                "value": base64.b64encode(value).decode(),
                "version": 1,
                "created_at": None,
                "updated_at": None,
                "expires_at": None,
            }
        )
    lines.append({"type": "end", "entries": len(values), "indexes": 0})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_value_limit_reads_every_backends_name_for_it(tmp_path: Path) -> None:
    """value_limit finds the file backend's constant and the SQLite option; memory has none."""
    assert value_limit(FileBackend(tmp_path / "f")) == FileBackend.MAX_VALUE_BYTES
    assert value_limit(SQLiteBackend(tmp_path / "s.db", max_value_size=77)) == 77
    assert (
        value_limit(SQLiteBackend(tmp_path / "s.db"))
        == SQLiteBackend(tmp_path / "t.db").max_value_size
    )
    assert value_limit(MemoryBackend()) is None


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("limit", [1, 100, 4096])
async def test_an_import_over_the_sqlite_limit_writes_nothing(
    limit: int, where: str, tmp_path: Path
) -> None:
    """A dump with one value over SQLite's max_value_size is refused before any key is written."""
    values = [b"x" * min(limit, 5)] * 700
    at = {"first": 0, "middle": 350, "last": 699}[where]
    values[at] = b"y" * (limit + 1)
    dump = _dump(tmp_path / "dump.jsonl", values)
    async with SQLiteBackend(tmp_path / "s.db", max_value_size=limit) as store:
        with pytest.raises(SerializationError, match="at most"):
            await import_state(dump, store)
        assert [key async for key in store.scan("*")] == []
        values[at] = b"y" * limit  # exactly at the limit: taken
        await import_state(_dump(tmp_path / "ok.jsonl", values), store)
        assert len([key async for key in store.scan("*")]) == 700
