"""The codec: how one `StateManager` turns values into the bytes its backend stores, and back.

Serialization (`agenticstate.serialization`), then encryption (`agenticstate.encryption`) bound to
the backend's namespace (its `key_prefix`, authenticated with each value so a value cannot be
moved to another key or namespace). Backends only ever see the bytes; the codec also turns their
`Entry` and `Change` records into the `StateEntry` and `StateChange` users get.
"""

from __future__ import annotations

from datetime import datetime, timedelta  # pydantic needs them at runtime
from typing import TYPE_CHECKING, Any, Self

from pydantic import BaseModel, ConfigDict

from agenticstate.backends.base import ChangeOp
from agenticstate.encryption import ENCRYPTED_HEADER
from agenticstate.events import StateChange
from agenticstate.exceptions import DecodeError, DecryptionError
from agenticstate.serialization import Serializer

if TYPE_CHECKING:
    from agenticstate.backends.base import Backend, Change, Entry
    from agenticstate.config import StateConfig
    from agenticstate.encryption import Encryption

__all__ = ["Codec", "StateEntry"]

_ENCRYPTED = bytes((ENCRYPTED_HEADER,))


class StateEntry(BaseModel):
    """A value with its metadata, as `StateManager.get_entry` returns it.

    Attributes:
        key: The key.
        value: The stored value (or the validated model, with `model=`).
        version: 1 after the first write, one more after each later write.
        created_at: When the key was first written (UTC).
        updated_at: When it was last written (UTC).
        expires_at: When it expires (UTC), or `None` for never.
        ttl: The time left before it expires, or `None` for never.
        revision: The revision of the write that made this version: unique and increasing in
            the store, never given again, so it names this version of this life of the key
            (`expected_revision`, the `Revision` compare). 0 from a backend without revisions,
            and for a history version written before the store had them.
        create_revision: The revision of the write that created the key's current life.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    key: str
    value: Any
    version: int
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None
    ttl: timedelta | None
    revision: int = 0
    create_revision: int = 0


class Codec:
    """Values <-> stored bytes for one namespace: a `Serializer`, then an optional `Encryption`.

    Args:
        serializer: Turns values into bytes and back.
        encryption: Encrypts the serialized bytes, or `None` to store them plain (a plain store
            refuses to read an encrypted value, naming the fix).
        namespace: The backend's `key_prefix`: the encryption binds each value to it and its key.
    """

    __slots__ = ("encryption", "namespace", "serializer")

    def __init__(
        self, serializer: Serializer, encryption: Encryption | None, namespace: str
    ) -> None:
        self.serializer = serializer
        self.encryption = encryption
        self.namespace = namespace

    @classmethod
    def for_backend(cls, config: StateConfig, backend: Backend) -> Self:
        """Return the codec `config` asks for over `backend` (its format preference and prefix)."""
        serializer = Serializer(
            config.format or backend.preferred_format or "msgpack",
            compression=config.compression,
            compression_threshold=config.compression_threshold,
            max_size=config.max_value_size,
            max_depth=config.max_depth,
        )
        return cls(serializer, config.encryption, backend.key_prefix)

    def encode(self, key: str, value: object) -> bytes:
        """Return the bytes to store at `key` for `value`.

        Raises:
            SerializationError: The value cannot be stored.
        """
        raw = self.serializer.dumps(value)
        if self.encryption is None:
            return raw
        return self.encryption.encrypt(self.namespace, key, raw)

    def decode(self, key: str, raw: bytes, model: type[BaseModel] | None = None) -> Any:
        """Return the value stored at `key` as `raw`, validated as `model` if given.

        Raises:
            DecryptionError: The value is encrypted and this codec has no key for it.
            DecodeError: The bytes are corrupt or do not validate as `model`.
        """
        if self.encryption is not None:
            raw = self.encryption.decrypt(self.namespace, key, raw)
        elif raw[:1] == _ENCRYPTED:
            raise DecryptionError(
                f"the value at {key!r} is encrypted; open the store with its keys "
                "(StateConfig(encryption=...))",
                path="",
            )
        if model is not None:
            return self.serializer.load_model(raw, model, key=key)  # names the key itself
        try:
            return self.serializer.loads(raw)
        except DecodeError as exc:
            raise DecodeError(f"{exc} (at key {key!r})", path="") from exc

    def copy(self, value: object) -> Any:
        """Return `value` as a stored copy of it would read back (what `update` starts from)."""
        return self.serializer.loads(self.serializer.dumps(value))

    def state_entry(self, entry: Entry, model: type[BaseModel] | None = None) -> StateEntry:
        """Return the backend's `entry` with its value decoded."""
        return StateEntry(
            key=entry.key,
            value=self.decode(entry.key, entry.value, model),
            version=entry.version,
            created_at=entry.created_at,
            updated_at=entry.updated_at,
            expires_at=entry.expires_at,
            ttl=entry.ttl(),
            revision=entry.revision,
            create_revision=entry.create_revision,
        )

    def state_change(self, change: Change) -> StateChange:
        """Return the backend's `change` with its old and new values decoded."""
        old, new = self.change_values(change)
        return StateChange.model_construct(
            key=change.key,
            old_value=old,
            new_value=new,
            version=change.version,
            op=change.op,
            timestamp=change.timestamp,
            cursor=change.cursor,
            revision=change.revision,
        )

    def resync_change(self, entry: Entry) -> StateChange:
        """Return a `RESYNC` change delivering `entry`'s current value (the old one unknown)."""
        return StateChange.model_construct(
            key=entry.key,
            old_value=None,
            new_value=self.decode(entry.key, entry.value),
            version=entry.version,
            op=ChangeOp.RESYNC,
            timestamp=entry.updated_at,
            cursor=None,
            revision=entry.revision,
        )

    def change_values(self, change: Change) -> tuple[Any, Any]:
        """Return the decoded `(old, new)` values of `change` (`None` for a missing side)."""
        key = change.key
        old = None if change.old is None else self.decode(key, change.old)
        new = None if change.new is None else self.decode(key, change.new)
        return old, new
