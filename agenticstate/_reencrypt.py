"""Re-encryption: an operation over a backend and a codec (`StateManager.reencrypt` runs it)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from agenticstate.commits import COMMIT_PREFIX
from agenticstate.exceptions import ConfigurationError, ConflictError

if TYPE_CHECKING:
    from agenticstate._codec import Codec
    from agenticstate.backends.base import Backend

__all__ = ["reencrypt"]


async def reencrypt(backend: Backend, codec: Codec, pattern: str) -> int:
    """Rewrite the values matching `pattern` that are not under `codec`'s current key.

    Keys are taken in sorted order. Each rewrite is a compare-and-set on the version: a value
    written meanwhile is read again (it is usually under the current key already). A rewrite
    keeps the value and its remaining time to live; a value expiring this instant is skipped.
    Commits (`_commits:` keys) are left as they are: a commit holds the exact bytes it recorded,
    under the key they were encrypted with.

    Returns:
        How many values were rewritten.

    Raises:
        ConfigurationError: `codec` has no encryption.
        DecryptionError: A value is under a key the keyring lacks, or was altered.
    """
    encryption = codec.encryption
    if encryption is None:
        raise ConfigurationError("reencrypt() needs StateConfig(encryption=...)")
    namespace = codec.namespace
    rewritten = 0
    keys = {key async for key in backend.scan(pattern) if not key.startswith(COMMIT_PREFIX)}
    for key in sorted(keys):
        while True:
            entry = await backend.get(key)
            if entry is None or encryption.key_id_of(entry.value) == encryption.current:
                break
            life = entry.ttl()
            if life is not None and life <= timedelta(0):
                break  # expiring this instant: nothing to keep
            raw = encryption.encrypt(
                namespace, key, encryption.decrypt(namespace, key, entry.value)
            )
            try:
                await backend.set(key, raw, ttl=life, expected_version=entry.version)
            except ConflictError:
                continue
            rewritten += 1
            break
    return rewritten
