"""The file backend's writes and syncs, and the one place where `OSError` becomes `BackendError`.

`translate` is that place: every step of the file backend that can meet an `OSError` (creating
the directory, the lock file, the log, the snapshot, the fsync agent's pipes) runs inside it and
raises `BackendError` naming what it could not do and why, in words with the errno name after
them ("could not append to the log ...: the disk is full"). `describe_errno` words an errno that
arrives as a number (the fsync agent reports one). Only cleanup (closing a descriptor, removing a
partial temporary file) ignores an `OSError` instead.

The writes and syncs are small functions called through this module, so that tests can replace
one to inject a fault (ENOSPC, EIO).
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import TYPE_CHECKING

from agenticstate.exceptions import BackendError

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = ["describe_errno", "fsync", "fsync_directory", "translate", "write_all"]


def describe_errno(code: int, action: str) -> str:
    """`could not <action>: <what went wrong, in words> (<errno name>)`."""
    name = errno.errorcode.get(code, str(code))
    detail = "the disk is full" if code == errno.ENOSPC else f"{os.strerror(code).lower()} ({name})"
    return f"could not {action}: {detail}"


@contextlib.contextmanager
def translate(action: str, *, hint: str = "") -> Iterator[None]:
    """Turn an `OSError` raised inside into `BackendError` (`from` it); `hint` is appended."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None:
            message = f"could not {action}: {type(exc).__name__}"
        else:
            message = describe_errno(exc.errno, action)
        raise BackendError(message + hint) from exc


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` at the descriptor's position (the log is opened to append)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync(fd: int) -> None:
    os.fsync(fd)


def fsync_directory(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
