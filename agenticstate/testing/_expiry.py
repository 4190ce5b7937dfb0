"""The expiry contract: a key past its TTL behaves exactly like a missing key."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from agenticstate.backends import Backend


SHORT = timedelta(milliseconds=150)


async def _past(ttl: timedelta) -> None:
    # Expiry is a matter of wall-clock time, so the test waits for the time itself to pass.
    await anyio.sleep(ttl.total_seconds() + 0.1)


class ExpiryContract:
    """The expiry contract: a key past its TTL behaves exactly like a missing key.

    Its tests take a `backend` fixture (a fresh, empty, open backend).
    """

    async def test_entry_reports_expiry_and_ttl(self, backend: Backend) -> None:
        """A key written with a TTL reports when it expires and how long is left."""
        await backend.set("k", b"x", ttl=timedelta(seconds=60))
        entry = await backend.get("k")
        assert entry is not None
        assert entry.expires_at is not None
        left = entry.ttl()
        assert left is not None
        assert timedelta(seconds=55) < left <= timedelta(seconds=60)

    async def test_expired_key_is_missing_everywhere(self, backend: Backend) -> None:
        """After its TTL a key reads as None, is not scanned, and expected_version=0 accepts it."""
        await backend.set("gone", b"x", ttl=SHORT)
        await backend.set("stays", b"y")
        assert await backend.get("gone") is not None
        await _past(SHORT)
        assert await backend.get("gone") is None
        assert [e is None for e in await backend.get_many(["gone", "stays"])] == [True, False]
        assert [key async for key in backend.scan("*")] == ["stays"]
        assert await backend.delete("gone") is None
        change = await backend.set("gone", b"again", expected_version=0)
        assert change.version == 1
        assert change.old is None

    async def test_rewrite_without_ttl_removes_expiry(self, backend: Backend) -> None:
        """Every write states its TTL: writing again without one makes the key permanent."""
        await backend.set("k", b"x", ttl=SHORT)
        await backend.set("k", b"y")
        entry = await backend.get("k")
        assert entry is not None
        assert entry.expires_at is None
        await _past(SHORT)
        entry = await backend.get("k")
        assert entry is not None
        assert entry.value == b"y"

    async def test_rewrite_with_ttl_extends_expiry(self, backend: Backend) -> None:
        """Writing again with a longer TTL replaces the earlier expiry."""
        await backend.set("k", b"x", ttl=SHORT)
        # On a busy machine the first write may expire before the second commits (the second
        # then starts a new life at version 1): either way the second write's expiry holds.
        written = await backend.set("k", b"y", ttl=timedelta(seconds=60))
        await _past(SHORT)
        entry = await backend.get("k")
        assert entry is not None
        assert (entry.value, entry.version) == (b"y", written.version)

    async def test_update_and_set_many_apply_ttl(self, backend: Backend) -> None:
        """update() and set_many() take a TTL like set()."""
        await backend.update("u", lambda entry: b"1", ttl=SHORT)
        await backend.set_many([("m", b"1")], ttl=SHORT)
        await _past(SHORT)
        assert await backend.get_many(["u", "m"]) == [None, None]
