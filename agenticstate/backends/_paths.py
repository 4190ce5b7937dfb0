"""What a store's path error means, the same for every backend that keeps files.

An error a retry cannot fix (the path is a file or runs through one, permission denied, a name
too long, too many symbolic links, a read-only file system, a NUL byte) is a
`ConfigurationError` naming its cause; anything else (a full disk, an I/O error: the storage
failed, the path may be fine) is the retryable `BackendUnavailableError`. The file and SQLite
backends both raise through `path_error`, so one cause gives one error type and one wording.
"""

from __future__ import annotations

import contextlib
import errno
from typing import TYPE_CHECKING

from agenticstate.exceptions import BackendUnavailableError, ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = ["PATH_CAUSES", "check_path_text", "path_error", "path_errors"]

PATH_CAUSES: dict[int, str] = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.EISDIR: "is a directory",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.EEXIST: "a part of the path is not a directory",  # from mkdir
    errno.ENAMETOOLONG: "the name is too long",
    errno.ELOOP: "too many symbolic links",
}
"""The errno values of a path to fix, and their causes in words."""


def check_path_text(path: object, what: str) -> None:
    """Refuse a path no file system can hold (a NUL byte), before anything is opened.

    Raises:
        ConfigurationError: The path holds a NUL byte.
    """
    if "\x00" in str(path):
        raise ConfigurationError(
            f"the {what} path contains a NUL byte, which no file name can hold"
        )


def path_error(path: Path, exc: OSError) -> BackendUnavailableError | ConfigurationError:
    """The error to raise for `exc`, met opening the store at `path`."""
    cause = PATH_CAUSES.get(exc.errno or 0)
    if cause is None:
        return BackendUnavailableError(f"could not open {path}: {exc.strerror or exc}")
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return ConfigurationError(f"could not open {path}: {cause} ({name})")


@contextlib.contextmanager
def path_errors(path: Path) -> Iterator[None]:
    """Raise an `OSError` inside as `path_error` says."""
    try:
        yield
    except OSError as exc:
        raise path_error(path, exc) from exc
