"""The file backend's one-owner rule: the lock file, and what a forked child does with it.

A store's `<name>.lock` is held under an exclusive `flock` by the process that owns the store
and holds its pid, so a second opener is refused with the holder's pid. The operating system
releases the lock with its process, so a store left by a killed process is taken over safely.

A forked child inherits the owner's descriptors (the lock, the log, the pipes to the fsync
agent). `disown_after_fork` runs in the child and has every store open in the parent close its
copies at once, so that the child neither keeps the agent alive (which would block the owner's
`aclose()`) nor keeps the lock after the owner dies. Closing a copy never releases the owner's
lock: only the last descriptor of an open file description does.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
from typing import TYPE_CHECKING, Protocol

from agenticstate.backends._file_io import translate
from agenticstate.exceptions import BackendError

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["Owned", "OwnerLock", "holder_of", "track", "untrack"]


class OwnerLock:
    """A store's lock file, held (exclusive `flock`, close-on-exec) while the store is open."""

    __slots__ = ("fd", "path")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self, store: object) -> None:
        """Take the lock and write this process's pid into it.

        Raises:
            BackendError: Another process holds it (named, with its pid), or the lock file
                cannot be opened, locked or written.
        """
        fd = _lock_or_holder(self.path)
        if isinstance(fd, str):
            raise BackendError(
                f"the store {store} is in use by {fd}; one process owns a store at a time"
            )
        try:
            with translate(f"write the lock file {self.path}"):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def lost(self) -> str | None:
        """Why the lock file at the path is no longer the one this process holds, or `None`.

        Deleting or replacing a store's lock file lets a second process lock a new file and
        open the store beside its owner; the owner finds out here (the inode it holds is not
        the one at the path) and must stop writing.
        """
        fd = self.fd
        if fd is None:
            return None
        held = there = None
        with contextlib.suppress(OSError):  # cannot tell (a transient error): look next time
            held = os.fstat(fd)
            try:
                there = os.stat(self.path)
            except FileNotFoundError:
                return f"the lock file {self.path} was deleted"
        if held is None or there is None:
            return None
        if (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino):
            return f"the lock file {self.path} was replaced"
        return None

    def release(self) -> None:
        """Unlock and close (nothing if not held)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(fd)

    def forget(self) -> None:
        """Close this process's copy without unlocking: the owner's lock stays (after a fork)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def holder_of(path: Path) -> str | None:
    """Who holds the lock at `path` ("process 123"), or None if nobody does (left unlocked)."""
    fd = _lock_or_holder(path)
    if isinstance(fd, str):
        return fd
    os.close(fd)
    return None


def _lock_or_holder(path: Path) -> int | str:
    """Lock `path`: its descriptor, or who holds it.

    Raises:
        BackendError: The lock file cannot be opened or locked for another reason.
    """
    with translate(f"open the lock file {path}"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    held = False
    try:
        with translate(f"lock {path}"):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return _named_holder(fd)
            held = True
    finally:
        if not held:
            os.close(fd)
    return fd


def _named_holder(fd: int) -> str:
    """The holder named in a lock file held by another process."""
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 32, 0).decode().strip()
        if text:
            return f"process {int(text)}"
    return "another process"


class Owned(Protocol):
    """A store open in this process, which a forked child must let go of."""

    def _disown(self, owner: int) -> None:
        """Close this process's copies of the store's descriptors; `owner` keeps the store."""


# Stores open in this process (see the module docstring).
_OPEN_STORES: weakref.WeakSet[Owned] = weakref.WeakSet()


def track(store: Owned) -> None:
    """Count `store` as open in this process until `untrack`."""
    _OPEN_STORES.add(store)


def untrack(store: Owned) -> None:
    _OPEN_STORES.discard(store)


def disown_after_fork() -> None:
    """In a forked child: every store open in the parent closes its copies of descriptors."""
    for store in list(_OPEN_STORES):
        store._disown(os.getppid())
    _OPEN_STORES.clear()


os.register_at_fork(after_in_child=disown_after_fork)
