"""Frame fuzzing: a value holding log-frame bytes never becomes a frame of the log.

A store's last write holds, somewhere in its value, the bytes of other stores' log frames
(uploads, copies of logs, crafted values), with any sequence numbers. A crash tears that
append at any point after its header: the store opens, cuts the torn frame (nothing in it was
acknowledged) and holds exactly the writes before it; none of the embedded frames' keys
appear, on open or after `repair`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import anyio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agenticstate import CorruptStoreError, FileBackend
from agenticstate.backends._file_format import FRAME_HEADER, encode_frame


def _frame(lsn: int, key: str, compress: bool) -> bytes:
    record = [lsn, "s", key, b"injected", 1, 1_700_000_000_000, 1_700_000_000_000, None]
    return encode_frame([record], compress=compress)


async def _write(path: Path, value: bytes) -> int:
    """Two ordinary writes, then `value`; the log's size before the last frame."""
    async with FileBackend(path, close_snapshot_keys=0, auto_save=False) as store:
        await store.set("a", b"1")
        await store.set("b", b"2")
    size = (path / "state.json.log").stat().st_size
    async with FileBackend(path, close_snapshot_keys=0, auto_save=False) as store:
        await store.set("upload", value)
    return size


async def _contents(path: Path) -> dict[str, bytes]:
    async with FileBackend(path) as store:
        keys = [key async for key in store.scan("*")]
        return {e.key: e.value for e in await store.get_many(keys) if e is not None}


embedded = st.lists(st.tuples(st.integers(1, 2**40), st.booleans()), min_size=1, max_size=3).map(
    lambda specs: [(lsn, _frame(lsn, f"evil{n}", c)) for n, (lsn, c) in enumerate(specs)]
)
LAST_LSN = 2  # `_write`'s two ordinary writes; the torn append would have been 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    before=st.binary(max_size=300),
    frames=embedded,
    after=st.binary(max_size=300),
    cut=st.floats(0.0, 1.0),
)
@example(  # a frame continuing the log, whole, then a torn one: refused, rightly
    before=b"",
    frames=[(lsn, _frame(lsn, f"evil{n}", False)) for n, lsn in enumerate((3, 1, 1))],
    after=b"",
    cut=0.359375,
)
def test_a_torn_append_of_a_value_holding_frames_is_cut(
    before: bytes, frames: list[tuple[int, bytes]], after: bytes, cut: float
) -> None:
    """Torn anywhere after its header, the last append is cut; no embedded frame is applied."""

    async def main() -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder)
            joined = b"".join(frame for _, frame in frames)
            kept = await _write(path, before + joined + after)
            log = path / "state.json.log"
            data = log.read_bytes()
            start = kept + FRAME_HEADER.size + 1
            end = start + int((len(data) - start - 1) * cut)  # short of the whole frame
            log.write_bytes(data[:end])
            try:
                contents = await _contents(path)
            except CorruptStoreError:
                # Refused only when what was kept holds, whole, an embedded frame that continues
                # the log's sequence (above its last number): as far as bytes tell, a damaged
                # frame followed by the rest of a log, which the store will not cut unasked.
                tail = data[start:end]
                continuing = [frame for lsn, frame in frames if lsn > LAST_LSN]
                assert any(frame in tail for frame in continuing), (
                    "an ordinary torn append was refused"
                )
                return
            assert contents == {"a": b"1", "b": b"2"}
            await FileBackend(path).repair()
            assert not [key for key in await _contents(path) if key.startswith("evil")]

    anyio.run(main)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    before=st.binary(max_size=300),
    frames=embedded,
    after=st.binary(max_size=300),
    where=st.sampled_from(["checksum", "payload-start", "payload-end"]),
)
def test_repair_of_a_damaged_frame_holding_frames_keeps_none_of_them(
    before: bytes, frames: list[tuple[int, bytes]], after: bytes, where: str
) -> None:
    """Bit rot in a frame whose value holds frames: repair drops that frame, applies none inside."""

    async def main() -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder)
            kept = await _write(path, before + b"".join(frame for _, frame in frames) + after)
            async with FileBackend(path, close_snapshot_keys=0, auto_save=False) as store:
                await store.set("c", b"3")  # a frame after the damaged one
            log = path / "state.json.log"
            data = bytearray(log.read_bytes())
            length = FRAME_HEADER.unpack_from(data, kept)[0]
            at = {"checksum": kept + 5, "payload-start": kept + FRAME_HEADER.size + 2}.get(
                where, kept + FRAME_HEADER.size + length - 1
            )
            data[at] ^= 0x40
            log.write_bytes(bytes(data))
            await FileBackend(path).repair()
            assert await _contents(path) == {"a": b"1", "b": b"2", "c": b"3"}

    anyio.run(main)
