"""A writer process for the key index tests, meant to be SIGKILLed mid-write.

python -m tests.integration._keyindex_worker URL PREFIX SEED
    write, delete and transact random keys (some with short TTLs) forever; print "writing"
    after the first few, so the parent knows it is under way. Every tenth write is to a key
    under a hash tag of its own (on a cluster, mostly a slot this store never wrote to: it is
    registered first).
"""

from __future__ import annotations

import random
import sys
from datetime import timedelta

import anyio

from agenticstate import RedisBackend
from agenticstate.backends import Delete, Put

KEYS = [f"k:{{{n % 7}}}:{n}" for n in range(40)]


async def main(url: str, prefix: str, seed: int) -> None:
    rng = random.Random(seed)
    async with RedisBackend(url=url, key_prefix=prefix) as backend:
        done = 0
        while True:
            key = rng.choice(KEYS)
            move = rng.random()
            if move < 0.5:
                ttl = (
                    timedelta(milliseconds=rng.choice([5, 20, 1000]))
                    if rng.random() < 0.3
                    else None
                )
                await backend.set(key, b"v", ttl=ttl)
            elif move < 0.7:
                await backend.delete(key)
            elif move < 0.9:
                await backend.set_many([(rng.choice(KEYS), b"m") for _ in range(3)])
            else:
                tag = key.split(":")[1]
                twin = next(k for k in KEYS if k.split(":")[1] == tag and k != key)
                await backend.transact([], [Put(key, b"t"), Delete(twin)])
            if done % 10 == 0:
                await backend.set(f"n:{{{seed}-{done}}}", b"n")
            done += 1
            if done == 20:
                sys.stdout.write("writing\n")
                sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
