"""Separate processes sharing one PostgreSQL store, for `test_postgres_processes.py`.

URL is a `postgresql://` URL naming the store's schema (`?schema=...`); PREFIX its key prefix.

python -m tests.integration._postgres_proc update URL PREFIX COUNT
    print "ready", wait for a line on stdin, then COUNT x `update("counter", +1)`; print "done"
python -m tests.integration._postgres_proc subscribe URL PREFIX COUNT [SINCE]
    subscribe to "*" (from cursor SINCE if given, else from now), print "ready CURSOR", then one
    JSON line per change (seq, key, op, old, new as hex, version) until COUNT changes arrived
python -m tests.integration._postgres_proc mixed URL PREFIX NAME COUNT
    print "ready", wait for a line on stdin, then COUNT changes to ten shared keys (`set`,
    `update` appending to the value, `delete`, or a `set` when the key to delete is missing),
    each value naming NAME and the step; print "done"
python -m tests.integration._postgres_proc transact URL PREFIX KEYS
    print "ready", wait for a line on stdin, then one `transact` putting "k0".."k{KEYS-1}" (the
    value "new") and adding to the index "idx"; print "committed"
python -m tests.integration._postgres_proc batches URL PREFIX NAME
    run transactions until killed: each reads "NAME:gen" and puts GEN + 1 into "NAME:gen" and
    into the eight keys "NAME:0".."NAME:7", and adds 1 to NAME's score in the index "gens";
    print "ack GEN" once each returned
python -m tests.integration._postgres_proc writer URL PREFIX NAME
    4 tasks save NAME:T:N for N = 0, 1, ...; print "ack NAME:T:N" once each save returned, and
    "unknown NAME:T:N" when the outcome of one is unknown (the connection failed at commit);
    a save the server could not take (down, restarting) is tried again; run until killed
"""

from __future__ import annotations

import json
import sys

import anyio
import anyio.to_thread

from agenticstate import (
    BackendUnavailableError,
    PostgresBackend,
    StateConfig,
    StateManager,
    WriteOutcomeUnknownError,
)
from agenticstate.backends import Entry, Get, IndexAdd, IndexIncr, Put


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def state_at(url: str, prefix: str) -> StateManager:
    return StateManager(StateConfig(backend="postgres", postgres_url=url, key_prefix=prefix))


def backend_at(url: str, prefix: str) -> PostgresBackend:
    return PostgresBackend.from_url(url, key_prefix=prefix)


async def go() -> None:
    say("ready")
    await anyio.to_thread.run_sync(sys.stdin.readline)


async def update(url: str, prefix: str, count: int) -> None:
    async with state_at(url, prefix) as state:
        await go()
        for _ in range(count):
            await state.update("counter", lambda n: n + 1, default=0)
        say("done")


async def subscribe(url: str, prefix: str, count: int, since: str | None) -> None:
    async with backend_at(url, prefix) as backend:
        start = since if since is not None else await backend.feed_cursor()
        async with backend.changes("*", since=start) as changes:
            say(f"ready {start}")
            seen = 0
            async for change in changes:
                seen += 1
                say(
                    json.dumps(
                        {
                            "seq": change.revision,
                            "key": change.key,
                            "op": change.op.value,
                            "old": change.old.hex() if change.old is not None else None,
                            "new": change.new.hex() if change.new is not None else None,
                            "version": change.version,
                        }
                    )
                )
                if seen >= count:
                    return


async def mixed(url: str, prefix: str, name: str, count: int) -> None:
    async with backend_at(url, prefix) as backend:
        await go()
        for step in range(count):
            key = f"k{(step * 7 + len(name)) % 10}"
            value = f"{name}.{step}".encode()
            if step % 5 == 4:
                if await backend.delete(key) is None:  # missing: write it, so one change a step
                    await backend.set(key, value)
            elif step % 3 == 0:

                def append(entry: Entry | None, value: bytes = value) -> bytes:
                    return (entry.value if entry is not None else b"") + b"|" + value

                await backend.update(key, append)
            else:
                await backend.set(key, value)
        say("done")


async def transact(url: str, prefix: str, keys: int) -> None:
    async with backend_at(url, prefix) as backend:
        await go()
        await backend.transact(
            [],
            [Put(f"k{n}", b"new") for n in range(keys)] + [IndexAdd("idx", {"victim": 1.0})],
        )
        say("committed")


async def batches(url: str, prefix: str, name: str) -> None:
    async with backend_at(url, prefix) as backend:
        say("ready")
        while True:
            read = await backend.transact([], [Get(f"{name}:gen")])
            entry = read.results[0]
            gen = int(entry.value) + 1 if entry is not None else 1
            value = b"%d" % gen
            await backend.transact(
                [],
                [
                    Put(f"{name}:gen", value),
                    *(Put(f"{name}:{n}", value) for n in range(8)),
                    IndexIncr("gens", name, 1),
                ],
            )
            say(f"ack {gen}")


async def writer(url: str, prefix: str, name: str) -> None:
    async with state_at(url, prefix) as state:

        async def one(task: int) -> None:
            n = 0
            while True:
                key = f"{name}:{task}:{n}"
                try:
                    await state.save(key, {"key": key})
                except WriteOutcomeUnknownError:
                    say(f"unknown {key}")
                except BackendUnavailableError:
                    await anyio.sleep(0.05)  # nothing was written: try the same key again
                    continue
                else:
                    say(f"ack {key}")
                n += 1

        async with anyio.create_task_group() as tg:
            for task in range(4):
                tg.start_soon(one, task)


def main(argv: list[str]) -> None:
    mode, url, prefix, *rest = argv
    if mode == "update":
        anyio.run(update, url, prefix, int(rest[0]), backend="asyncio")
    elif mode == "subscribe":
        since = rest[1] if len(rest) > 1 else None
        anyio.run(subscribe, url, prefix, int(rest[0]), since, backend="asyncio")
    elif mode == "mixed":
        anyio.run(mixed, url, prefix, rest[0], int(rest[1]), backend="asyncio")
    elif mode == "transact":
        anyio.run(transact, url, prefix, int(rest[0]), backend="asyncio")
    elif mode == "batches":
        anyio.run(batches, url, prefix, rest[0], backend="asyncio")
    elif mode == "writer":
        anyio.run(writer, url, prefix, rest[0], backend="asyncio")
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
