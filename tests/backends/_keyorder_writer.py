"""A writer for the key-order kill test: `python -m tests.backends._keyorder_writer DIR SEED`.

Opens a file store (fsync durability) and, until it is killed, makes seeded random changes to
hash-tagged and braced keys (`ns:{t3}:m`, `ns:{t}x}:m`, ...): writes, deletes, writes with a TTL
so short it expires at once, and transactions of several puts and deletes. Prints `open`, then
`ack N` after the N-th change is acknowledged.
"""

from __future__ import annotations

import random
import sys
from datetime import timedelta

import anyio

from agenticstate import FileBackend
from agenticstate.backends.base import Delete, Put


def key(rng: random.Random) -> str:
    """A key shaped like a manager's (`ns:{tag}:part`), sometimes with a second `}`."""
    tag = f"t{rng.randrange(12)}"
    part = rng.choice(["m", "meta", "msg:1", "msg:2", "x}:m", "}", "q}r"])
    return f"{rng.choice(['ns', 'nt'])}:{{{tag}}}:{part}"


async def main(*args: str) -> None:
    directory, seed = args
    rng = random.Random(int(seed))
    backend = FileBackend(base_path=directory, format="msgpack")
    await backend.open()
    sys.stdout.write("open\n")
    sys.stdout.flush()
    count = 0
    while True:
        roll = rng.random()
        if roll < 0.5:
            await backend.set(key(rng), b"v")
        elif roll < 0.7:
            await backend.delete(key(rng))
        elif roll < 0.8:
            await backend.set(key(rng), b"e", ttl=timedelta(microseconds=1))
        else:
            ops = [
                Put(key(rng), b"t") if rng.random() < 0.6 else Delete(key(rng)) for _ in range(3)
            ]
            await backend.transact([], ops)
        count += 1
        sys.stdout.write(f"ack {count}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:])
