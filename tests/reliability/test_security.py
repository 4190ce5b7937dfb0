"""Security: encryption at rest, secrets kept out of output, no pickle, tenants kept apart."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from structlog.testing import capture_logs

from agenticstate import (
    AgentSnapshot,
    AgentStateStore,
    BackendUnavailableError,
    ConfigurationError,
    DecryptionError,
    Encryption,
    RedisBackend,
    StateConfig,
    StateManager,
)
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agenticstate.backends import Backend

ROOT = Path(__file__).parent.parent.parent
SECRET = {"api_token": "tok-9f8e7d", "notes": "only for the owner"}
K1, K2 = bytes(range(32)), bytes(range(32, 64))


def manager(backend: Backend, encryption: Encryption | None) -> StateManager:
    return StateManager(StateConfig(encryption=encryption), backend=backend, close_backend=False)


@pytest.fixture
async def sealed(backend: Backend) -> AsyncIterator[StateManager]:
    """A StateManager over each backend, encrypting with key "k1"."""
    state = manager(backend, Encryption({"k1": K1}))
    try:
        yield state
    finally:
        await state.aclose()


async def test_values_are_ciphertext_at_rest_and_plain_to_readers(
    sealed: StateManager, backend: Backend
) -> None:
    """Stored bytes never contain the value; get, get_many, update and watch see it in plain."""
    async with sealed.watch("vault:*") as changes:
        await sealed.save("vault:a", SECRET)
        await sealed.update("vault:a", {"rotated": True})
        with anyio.fail_after(5):
            first = await changes.__anext__()
            second = await changes.__anext__()
    assert (first.old_value, first.new_value) == (None, SECRET)
    assert second.new_value == {**SECRET, "rotated": True}
    assert await sealed.get("vault:a") == {**SECRET, "rotated": True}
    assert await sealed.get_many(["vault:a"]) == {"vault:a": {**SECRET, "rotated": True}}
    raw = await backend.get("vault:a")
    assert raw is not None
    assert raw.value[0] == 0x04
    assert b"tok-9f8e7d" not in raw.value
    assert b"api_token" not in raw.value


async def test_tampered_swapped_and_foreign_values_are_refused(
    sealed: StateManager, backend: Backend
) -> None:
    """A flipped bit, a value copied to another key, one under a different key with the same id,
    and one under an unknown id: each raises DecryptionError, and nothing else is affected."""
    await sealed.save("a", SECRET)
    await sealed.save("b", {"other": 1})
    good = await backend.get("a")
    assert good is not None
    tampered = bytearray(good.value)
    tampered[-20] ^= 0x01
    await backend.set("tampered", bytes(tampered))
    await backend.set("swapped", good.value)  # a's ciphertext at another key
    with pytest.raises(DecryptionError, match="failed authentication"):
        await sealed.get("tampered")
    with pytest.raises(DecryptionError, match="failed authentication"):
        await sealed.get("swapped")
    impostor = manager(backend, Encryption({"k1": K2}))  # same id, other key
    with pytest.raises(DecryptionError, match="failed authentication"):
        await impostor.get("a")
    stranger = manager(backend, Encryption({"k9": K2}))
    with pytest.raises(DecryptionError, match="'k1', which is not in the keyring"):
        await stranger.get("a")
    assert await sealed.get("a") == SECRET
    assert await sealed.get("b") == {"other": 1}


async def test_plaintext_and_missing_keys_are_explicit(
    sealed: StateManager, backend: Backend
) -> None:
    """Plain values are refused unless allow_plaintext; a manager without keys reading
    ciphertext says so instead of returning garbage."""
    plain = manager(backend, None)
    await plain.save("legacy", {"v": 1})
    with pytest.raises(DecryptionError, match="not encrypted"):
        await sealed.get("legacy")
    migrating = manager(backend, Encryption({"k1": K1}, allow_plaintext=True))
    assert await migrating.get("legacy") == {"v": 1}
    await sealed.save("new", {"v": 2})
    with pytest.raises(DecryptionError, match="is encrypted; open the store with its keys"):
        await plain.get("new")


async def test_key_rotation_and_reencrypt(backend: Backend) -> None:
    """Values written under k1 read after rotating to k2; reencrypt() moves them all to k2, so
    k1 can be dropped; values written meanwhile are kept; TTLs survive the rewrite."""
    old = manager(backend, Encryption({"k1": K1}))
    for n in range(20):
        await old.save(f"r:{n}", {"n": n}, ttl=3600 if n % 2 else None)
    rotated = manager(backend, Encryption({"k1": K1, "k2": K2}, current="k2"))
    await rotated.save("r:0", {"n": "rewritten by a writer"})  # already under k2
    assert await rotated.get("r:5") == {"n": 5}
    assert await rotated.reencrypt("r:*") == 19
    assert await rotated.reencrypt("r:*") == 0
    only_new = manager(backend, Encryption({"k2": K2}))
    assert await only_new.get_many([f"r:{n}" for n in range(20)]) == {
        "r:0": {"n": "rewritten by a writer"},
        **{f"r:{n}": {"n": n} for n in range(1, 20)},
    }
    entry = await only_new.get_entry("r:1")
    assert entry is not None
    assert entry.ttl is not None
    with pytest.raises(DecryptionError):
        await old.get("r:3")
    with pytest.raises(ConfigurationError, match="needs StateConfig"):
        await manager(backend, None).reencrypt()


async def test_managers_records_are_encrypted_too(tmp_path: Path) -> None:
    """A manager on an encrypted StateManager stores its records as ciphertext (file store)."""
    config = StateConfig(
        backend="file",
        file_path=tmp_path / "state.json",
        encryption=Encryption({"k1": K1}),
    )
    async with StateManager(config) as state:
        store = AgentStateStore(state_manager=state)
        await store.save_snapshot(
            AgentSnapshot(agent_id="a1", memory_state={"plan": "secret-plan-77"})
        )
        assert (await store.get_latest_snapshot("a1")) is not None
    on_disk = (tmp_path / "state.json").read_bytes()
    assert b"secret-plan-77" not in on_disk
    assert b"secret-plan-77" not in base64.b64decode(
        b"".join(
            item["base64"].encode()
            for item in json.loads(on_disk)["entries"].values()
            if "base64" in item
        )
    )


def test_encryption_config_is_checked_and_never_shows_key_material() -> None:
    """Bad keyrings are ConfigurationErrors; reprs show key ids only."""
    with pytest.raises(ConfigurationError, match="at least one key"):
        Encryption({})
    with pytest.raises(ConfigurationError, match="16, 24 or 32 bytes"):
        Encryption({"k": b"short"})
    with pytest.raises(ConfigurationError, match="printable ASCII"):
        Encryption({"k\n": K1})
    with pytest.raises(ConfigurationError, match="name the current key"):
        Encryption({"a": K1, "b": K2})
    with pytest.raises(ConfigurationError, match="not in the keyring"):
        Encryption({"a": K1}, current="b")
    keyring = Encryption({"a": K1, "b": K2}, current="b")
    shown = repr(keyring) + repr(StateConfig(encryption=keyring))
    for material in (K1, K2):
        assert material.hex() not in shown
        assert repr(material) not in shown
        assert base64.b64encode(material).decode() not in shown
    assert keyring.key_ids == ["a", "b"]
    assert len(Encryption.generate_key()) == 32


async def test_no_pickle_at_run_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A workload over every manager-facing path runs with pickle's entry points disabled, so
    nothing (ours or a dependency's) unpickles stored state."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle was used")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    config = StateConfig(
        backend="file", file_path=tmp_path / "s.json", encryption=Encryption({"k": K1})
    )
    async with StateManager(config) as state, state.watch("*") as changes:
        await state.save("a", {"nested": [1, 2.5, "x", None, True]})
        await state.update("a", {"more": {"deep": 1}})
        await state.save_many({"b": 1, "c": "two"})
        with anyio.fail_after(5):
            assert (await changes.__anext__()).key == "a"
    async with StateManager(config) as state:
        assert await state.get("a") == {"nested": [1, 2.5, "x", None, True], "more": {"deep": 1}}


async def test_secrets_stay_out_of_errors_logs_and_the_cli(tmp_path: Path) -> None:
    """A password in a Redis URL never shows in reprs, `url`, raised errors, logs or the CLI."""
    url = f"redis://app:hunter2-pw@unix-socket-that-does-not-exist{tmp_path}/x:6379/0"
    socket_url = f"unix://app:hunter2-pw@{tmp_path}/nothing.sock"
    with capture_logs() as logs:
        config = StateConfig(backend="redis", redis_url=socket_url, key_prefix="p:")
        state = StateManager(config)
        with pytest.raises(BackendUnavailableError) as caught:
            await state.get("k")
        await state.aclose()
        backend = RedisBackend(url=url, read_retries=0, connect_timeout=0.2)
        with pytest.raises(BackendUnavailableError) as caught_too:
            await backend.set("k", b"v")
        await backend.aclose()
    texts = [repr(config), str(config), repr(state), repr(backend), repr(logs)]
    assert isinstance(state.backend, RedisBackend)
    texts += [backend.url, state.backend.url, repr(state.backend)]
    texts += [str(caught.value), repr(caught.value), str(caught_too.value)]
    for text in texts:
        assert "hunter2-pw" not in text, text
    result = subprocess.run(
        [sys.executable, "-m", "agenticstate.cli", "--url", socket_url, "get", "k"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        check=False,
    )
    assert result.returncode != 0
    assert "hunter2-pw" not in result.stdout + result.stderr


@pytest.mark.redis
async def test_tenants_cannot_read_list_watch_or_delete_each_other(redis_url: str) -> None:
    """Two prefixes on one Redis, through StateManager: no get, list, watch, delete, update or
    glob trick of one tenant reaches the other's keys."""
    alice = StateManager(
        StateConfig(backend="redis", redis_url=redis_url, key_prefix=unique_prefix())
    )
    bob = StateManager(
        StateConfig(backend="redis", redis_url=redis_url, key_prefix=unique_prefix())
    )
    async with alice, bob, bob.watch("*") as bob_changes:
        await alice.save("secret", {"owner": "alice"})
        await alice.save("a*b", 1)
        await bob.save("mine", 1)
        assert await bob.get("secret") is None
        assert await bob.list_keys("*") == ["mine"]
        assert await bob.list_keys("*secret*") == []
        assert await bob.list_keys("\\*") == []
        assert await bob.delete("secret") is False
        assert await bob.update("secret", lambda v: "stolen", default=None) == "stolen"
        with anyio.fail_after(5):
            seen = [await bob_changes.__anext__(), await bob_changes.__anext__()]
        assert [change.key for change in seen] == ["mine", "secret"]  # bob's own keys only
        assert await alice.get("secret") == {"owner": "alice"}
        assert await alice.list_keys() == ["a*b", "secret"]
