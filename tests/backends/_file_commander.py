"""A file store owner driven line by line: `python -m tests.backends._file_commander DIR [D]`.

It opens a FileBackend on DIR (durability D: `fsync`, the default, or `none`) and prints
`open` (or `open-error MESSAGE`), then reads commands from stdin, one per line, and answers each
on stdout:

- `set KEY VALUE`: `ok KEY` once the write is acknowledged, or `error KEY MESSAGE`;
- `close`: `closed`, or `close-error MESSAGE`; then it exits.
"""

from __future__ import annotations

import sys

import anyio

from agenticstate import AgenticStateError, FileBackend


def emit(line: str) -> None:
    sys.stdout.write(line.replace("\n", " ") + "\n")
    sys.stdout.flush()


async def main(*args: str) -> None:
    directory, durability = args[0], args[1] if len(args) > 1 else "fsync"
    backend = FileBackend(base_path=directory, auto_save=False, durability=durability)  # type: ignore[arg-type]
    try:
        await backend.open()
    except AgenticStateError as exc:
        emit(f"open-error {exc}")
        return
    emit("open")
    lines = anyio.wrap_file(sys.stdin)
    async for line in lines:
        command, *args = line.split()
        if command == "set":
            key, value = args
            try:
                await backend.set(key, b"\x02" + f'"{value}"'.encode())
            except AgenticStateError as exc:
                emit(f"error {key} {exc}")
            else:
                emit(f"ok {key}")
        elif command == "close":
            try:
                await backend.aclose()
            except AgenticStateError as exc:
                emit(f"close-error {exc}")
            else:
                emit("closed")
            return


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:])
