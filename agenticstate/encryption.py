"""Optional encryption at rest for values: AES-GCM, bound to the key each value is stored at.

```python
keys = {"2026-11": Encryption.generate_key()}
state = StateManager(StateConfig(backend="redis", redis_url=..., encryption=Encryption(keys)))
```

Every value is encrypted by the `StateManager` before it reaches the backend, so Redis, the file
store's log and snapshot, and every change event carry ciphertext; readers and subscribers with
the keys see plain values. Each value gets a fresh random 96-bit nonce and is authenticated
together with the namespace (the backend's key prefix) and the key it is stored at: a value that
was altered, copied to another key or namespace, or written under a key this keyring does not
hold fails to read with `DecryptionError`. Keys, versions, timestamps, expiries and sorted-index
members are not encrypted.

Rotation: give the keyring every key that may still be in use and name the `current` one, which
encrypts all new writes; values written under older keys keep reading. `StateManager.reencrypt`
rewrites the values still under an older key so that it can be dropped. Random nonces are safe
for about four billion writes per key: rotate well before that.

Stored form: `0x04 | key-id length (1 byte) | key id (ASCII) | nonce (12) | ciphertext + tag (16)`,
the plaintext being the serializer's own encoding (with its header byte). Needs the
`cryptography` package: `pip install "agenticstate[encryption]"`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from agenticstate.exceptions import ConfigurationError, DecryptionError, MissingDependencyError

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["ENCRYPTED_HEADER", "Encryption"]

ENCRYPTED_HEADER = 0x04
"""The first byte of every encrypted value (the serializer's formats use 0x01 and 0x02)."""

_NONCE = 12
_TAG = 16
_KEY_SIZES = (16, 24, 32)
_DOMAIN = b"agenticstate/aes-gcm/v1\x00"


def _aesgcm() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise MissingDependencyError("cryptography", "encryption") from None
    return AESGCM


class Encryption:
    """A keyring of AES-GCM keys by id; the `current` one encrypts new values.

    Args:
        keys: Key id -> key bytes (16, 24 or 32 bytes: AES-128, -192 or -256). Ids are short
            printable ASCII names (at most 64 characters), stored with each value.
        current: The id of the key that encrypts new writes; may be left out when there is only
            one key.
        allow_plaintext: Read values that were stored unencrypted (while migrating a store to
            encryption). Off by default: a plaintext value where ciphertext is expected could
            have been planted, so reading it raises `DecryptionError`.

    Raises:
        ConfigurationError: No keys, a bad id, a key of the wrong size, or an unknown `current`.
        MissingDependencyError: `cryptography` is not installed.
    """

    __slots__ = ("_ciphers", "allow_plaintext", "current")

    def __init__(
        self,
        keys: Mapping[str, bytes],
        *,
        current: str | None = None,
        allow_plaintext: bool = False,
    ) -> None:
        if not keys:
            raise ConfigurationError("Encryption needs at least one key")
        aesgcm = _aesgcm()
        ciphers: dict[str, Any] = {}
        for key_id, material in keys.items():
            if (
                not isinstance(key_id, str)
                or not 0 < len(key_id) <= 64
                or not key_id.isascii()
                or not key_id.isprintable()
            ):
                raise ConfigurationError(
                    f"encryption key ids must be printable ASCII of 1-64 characters, not {key_id!r}"
                )
            if not isinstance(material, bytes | bytearray) or len(material) not in _KEY_SIZES:
                size = len(material) if isinstance(material, bytes | bytearray) else None
                raise ConfigurationError(
                    f"encryption key {key_id!r} must be 16, 24 or 32 bytes, not {size}"
                )
            ciphers[key_id] = aesgcm(bytes(material))
        if current is None:
            if len(ciphers) != 1:
                raise ConfigurationError("name the current key: Encryption(keys, current=...)")
            current = next(iter(ciphers))
        if current not in ciphers:
            raise ConfigurationError(f"the current key {current!r} is not in the keyring")
        self._ciphers = ciphers
        self.current = current
        self.allow_plaintext = allow_plaintext

    def __repr__(self) -> str:
        # Ids only: key material never appears in a repr, a log or an error.
        return f"Encryption(key_ids={sorted(self._ciphers)!r}, current={self.current!r})"

    @staticmethod
    def generate_key() -> bytes:
        """Return a new random 256-bit key (keep it in a secret store, not in code)."""
        return os.urandom(32)

    @property
    def key_ids(self) -> list[str]:
        """The ids of the keys in the keyring."""
        return sorted(self._ciphers)

    def encrypt(self, namespace: str, key: str, payload: bytes) -> bytes:
        """Encrypt `payload` for storage at `key` in `namespace`, with the current key."""
        key_id = self.current.encode()
        nonce = os.urandom(_NONCE)
        sealed: bytes = self._ciphers[self.current].encrypt(
            nonce, payload, self._associated(namespace, key, key_id)
        )
        return bytes((ENCRYPTED_HEADER, len(key_id))) + key_id + nonce + sealed

    def decrypt(self, namespace: str, key: str, raw: bytes) -> bytes:
        """Return the payload stored at `key`, checking it was written there, unaltered.

        Raises:
            DecryptionError: The value is not encrypted (and plaintext is not allowed), names a
                key id this keyring lacks, or fails authentication (altered, moved from another
                key or namespace, or encrypted with another key under the same id).
        """
        if not raw or raw[0] != ENCRYPTED_HEADER:
            if self.allow_plaintext:
                return raw
            raise DecryptionError(
                f"the value at {key!r} is not encrypted; refusing it (allow_plaintext=True "
                "reads unencrypted values while a store is being migrated)",
                path="",
            )
        size = raw[1] if len(raw) > 1 else 0
        body = 2 + size
        if size == 0 or len(raw) < body + _NONCE + _TAG:
            raise DecryptionError(f"the encrypted value at {key!r} is truncated")
        key_id = bytes(raw[2:body])
        cipher = self._ciphers.get(key_id.decode("ascii", "replace"))
        if cipher is None:
            raise DecryptionError(
                f"the value at {key!r} was encrypted with key "
                f"{key_id.decode('ascii', 'replace')!r}, which is not in the keyring",
                path="",
            )
        from cryptography.exceptions import InvalidTag

        try:
            plain: bytes = cipher.decrypt(
                raw[body : body + _NONCE],
                raw[body + _NONCE :],
                self._associated(namespace, key, key_id),
            )
        except InvalidTag:
            raise DecryptionError(
                f"the value at {key!r} failed authentication: it was altered, moved from "
                "another key or namespace, or encrypted with a different key",
                path="",
            ) from None
        return plain

    def key_id_of(self, raw: bytes) -> str | None:
        """The id of the key a stored value was encrypted with, or `None` if it is plaintext."""
        if len(raw) < 2 or raw[0] != ENCRYPTED_HEADER:
            return None
        return bytes(raw[2 : 2 + raw[1]]).decode("ascii", "replace")

    @staticmethod
    def _associated(namespace: str, key: str, key_id: bytes) -> bytes:
        # Length-prefixed so that no two (namespace, key) pairs give the same bytes.
        name, space = key.encode(), namespace.encode()
        return b"".join(
            (
                _DOMAIN,
                len(space).to_bytes(4, "big"),
                space,
                len(name).to_bytes(4, "big"),
                name,
                key_id,
            )
        )
