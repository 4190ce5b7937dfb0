"""Encryption at rest: values are ciphertext in the store, plain to readers with the keys.

Install: `pip install ".[encryption]"` (from a checkout; see the README).
"""

import anyio

from agenticstate import DecryptionError, Encryption, StateConfig, StateManager


async def main() -> None:
    first_key = Encryption.generate_key()  # in real use: from your secret store
    keyring = Encryption({"2026-11": first_key})
    config = StateConfig(backend="file", file_path="./state/encrypted.json", encryption=keyring)
    async with StateManager(config) as state:
        await state.save("agent:researcher", {"api_token": "tok-123", "status": "running"})
        print(await state.get("agent:researcher"))  # plain to whoever holds the key

        # Raw backend bytes: a header, the key id, a nonce, then ciphertext.
        stored = await state.backend.get("agent:researcher")
        assert stored is not None
        assert b"tok-123" not in stored.value

        # A value moved to another key does not decrypt there: it is bound to its key.
        await state.backend.set("agent:copy", stored.value)
        try:
            await state.get("agent:copy")
        except DecryptionError as exc:
            print("refused:", exc)

    # Rotation: add a new key, make it current, rewrite what the old one encrypted.
    rotated = Encryption(
        {"2026-11": first_key, "2026-12": Encryption.generate_key()}, current="2026-12"
    )
    config = StateConfig(backend="file", file_path="./state/encrypted.json", encryption=rotated)
    async with StateManager(config) as state:
        await state.delete("agent:copy")
        rewritten = await state.reencrypt("agent:*")
        print(f"re-encrypted {rewritten} value(s) under {rotated.current}")
        assert rewritten == 1


if __name__ == "__main__":
    anyio.run(main)
