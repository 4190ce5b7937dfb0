"""After `repair`, no revision or cursor a store handed out is given again.

For damage in every frame of a log (bit rot in its payload), after the repair: every new
write's revision is above every revision acknowledged before, a compare-and-set on any lost
write's revision conflicts, and resuming the feed from any acknowledged cursor delivers the
new write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from agenticstate import ConflictError, FileBackend

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate.backends.base import Change

WRITES = 5


async def _write(path: Path) -> tuple[list[Change], list[int]]:
    """Five acknowledged writes, one frame each; their changes and the frames' ends."""
    changes, ends = [], []
    log = path / "state.json.log"
    async with FileBackend(path, close_snapshot_keys=0, auto_save=False) as store:
        for n in range(WRITES):
            changes.append(await store.set(f"k{n % 2}", f"v{n}".encode()))
            ends.append(log.stat().st_size)
    return changes, ends


@pytest.mark.parametrize("frame", range(WRITES))
async def test_repair_never_gives_a_revision_or_cursor_again(frame: int, tmp_path: Path) -> None:
    """Damage in any frame: after repair, new revisions pass every acknowledged one."""
    changes, ends = await _write(tmp_path)
    log = tmp_path / "state.json.log"
    data = bytearray(log.read_bytes())
    data[ends[frame] - 2] ^= 0x01  # bit rot in that frame's payload
    log.write_bytes(bytes(data))
    await FileBackend(tmp_path).repair()
    async with FileBackend(tmp_path) as store:
        new = await store.set("k0", b"after the repair")
        assert new.revision > max(c.revision for c in changes)
        lost = changes[frame]
        with pytest.raises(ConflictError):
            await store.set(lost.key, b"stale", expected_revision=lost.revision)
        for change in changes:
            seen = []
            async with store.changes("*", since=change.cursor) as stream:
                with anyio.fail_after(10):
                    async for got in stream:
                        seen.append(got.cursor)
                        if got.cursor == new.cursor:
                            break
            assert new.cursor in seen
