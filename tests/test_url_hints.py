"""URLs that cannot open what they seem to name are refused with the next step.

`sqlite://~/x.db` made a folder literally named `~` in the working directory (a shell expands
`~` only at the start of a word), `sqlite://:memory:` said only that a file path was needed,
and a Redis database the server does not have (`redis://.../99`) said only "DB index is out
of range".
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import StateManager
from agenticstate.backends import open_backend
from agenticstate.exceptions import BackendError, ConfigurationError

if TYPE_CHECKING:
    from pathlib import Path


@pytest.mark.parametrize("scheme", ["sqlite", "file"])
@pytest.mark.parametrize("path", ["~", "~/x.db", "~/state/s.db"])
def test_a_tilde_path_is_refused_with_the_path_written_out(
    scheme: str, path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`~` in a file or SQLite URL: `ConfigurationError` giving the path in full; nothing made."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match="write it in full") as caught:
        open_backend(f"{scheme}://{path}")
    assert os.path.expanduser(path) in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_sqlite_memory_points_to_memory_urls() -> None:
    """`sqlite://:memory:` is refused, naming `memory://`."""
    with pytest.raises(ConfigurationError, match="memory://"):
        open_backend("sqlite://:memory:")


@pytest.mark.redis
def test_a_redis_database_the_server_lacks_names_the_range(redis_url: str) -> None:
    """A database past the server's count: the error says which ones there are."""
    url = redis_url + ("&" if "?" in redis_url else "?") + "db=99"

    async def main() -> None:
        async with StateManager(backend=open_backend(url)) as state:
            with pytest.raises(BackendError, match=r"no such database.*/0 to /15"):
                await state.get("k")

    anyio.run(main, backend="asyncio")
