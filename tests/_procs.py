"""Child processes for the cross-process tests, with their output read as it arrives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

ROOT = Path(__file__).parent.parent


class LineProcess:
    """`python -m MODULE ARGS...`, its stdout lines collected by a thread as they arrive.

    Tests wait on those lines (with a timeout) instead of sleeping.
    """

    def __init__(self, module: str, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self.errors: list[str] = []
        self.changed = threading.Condition()
        self.readers = [
            threading.Thread(
                target=self._read, args=(self.process.stdout, self.lines), daemon=True
            ),
            threading.Thread(
                target=self._read, args=(self.process.stderr, self.errors), daemon=True
            ),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, pipe: object, into: list[str]) -> None:
        assert pipe is not None
        with pipe:  # type: ignore[attr-defined]
            for line in pipe:  # type: ignore[attr-defined]
                with self.changed:
                    into.append(line.rstrip("\n"))
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_until(self, predicate: Callable[[list[str]], bool], timeout: float = 60) -> bool:
        """Wait until `predicate(lines)` holds; False if the process ended or time ran out."""
        with self.changed:
            self.changed.wait_for(
                lambda: predicate(self.lines) or self.process.poll() is not None, timeout
            )
            return predicate(self.lines)

    def wait_lines(self, count: int, timeout: float = 60) -> bool:
        """Wait until the process printed `count` lines."""
        return self.wait_until(lambda lines: len(lines) >= count, timeout)

    def stop(self) -> None:
        """Ask it to stop (close its stdin) and wait for it."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        finally:
            self.close()

    def kill(self) -> None:
        """SIGKILL it and wait for it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.close()

    def close(self) -> str:
        """Make sure it has ended; return what it wrote on stderr."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        for reader in self.readers:
            reader.join(10)
        return "\n".join(self.errors)
