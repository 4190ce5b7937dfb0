"""A writer process for the crash tests: `python -m tests.backends._file_writer DIR START`.

It writes `k{n % 10}` = n for n = START, START+1, ... forever (fsync durability), printing
"ack n" after each write is acknowledged, until it is killed.
"""

from __future__ import annotations

import sys

import anyio

from agenticstate import FileBackend


async def main(directory: str, start: str) -> None:
    backend = FileBackend(base_path=directory, format="msgpack")
    await backend.open()
    sys.stdout.write("open\n")
    sys.stdout.flush()
    n = int(start)
    while True:
        await backend.set(f"k{n % 10}", str(n).encode())
        sys.stdout.write(f"ack {n}\n")
        sys.stdout.flush()
        n += 1


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
