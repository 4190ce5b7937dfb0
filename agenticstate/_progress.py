"""A live progress line for the command line: `scanning... 12,000 keys`, rewritten in place.

Dependency-free: a carriage return moves back to the start of the line and the new text is padded
over the old. Only ever drawn on a terminal; `clear()` erases it, so nothing is left behind.
"""

from __future__ import annotations

import sys
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TextIO, cast

import anyio

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

__all__ = ["Progress", "is_terminal"]


def is_terminal(stream: object) -> bool:
    """Whether `stream` is an open terminal (a replaced or closed stream is not)."""
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False


def counted(number: int, unit: str) -> str:
    """`1 key`, `12,000 keys`."""
    return f"{number:,} {unit}{'' if number == 1 else 's'}"


class Progress:
    """One line of progress on a terminal, redrawn at most once per `interval` seconds.

    Args:
        stream: Where to draw, or `None` for a progress that shows nothing.
        interval: The least time between two redraws (0.1 s: at most 10 a second).
        clock: Monotonic seconds (for tests).
    """

    def __init__(
        self,
        stream: TextIO | None,
        *,
        interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.interval = interval
        self._clock = clock
        self._due = float("-inf")  # the first update draws at once
        self._shown = ""  # the line on screen now

    @classmethod
    def on_stderr(cls, *, enabled: bool = True) -> Progress:
        """Draw on stderr if `enabled` and stderr is a terminal; otherwise show nothing."""
        return cls(sys.stderr if enabled and is_terminal(sys.stderr) else None)

    @property
    def enabled(self) -> bool:
        """Whether anything is drawn."""
        return self.stream is not None

    def update(self, label: str, number: int, unit: str) -> None:
        """Show `label... number units`, unless the last redraw was less than `interval` ago."""
        if self.stream is None:
            return
        now = self._clock()
        if now < self._due:
            return
        self._due = now + self.interval
        text = f"{label}... {counted(number, unit)}"
        if text == self._shown:
            return
        # Pad over the previous text: the line may have been longer.
        self.stream.write("\r" + text.ljust(len(self._shown)))
        self.stream.flush()
        self._shown = text

    def clear(self) -> None:
        """Erase the line (a no-op when nothing is drawn); the next update draws at once."""
        if self.stream is not None and self._shown:
            self.stream.write("\r" + " " * len(self._shown) + "\r")
            self.stream.flush()
        self._shown = ""
        self._due = float("-inf")

    @asynccontextmanager
    async def ticking(
        self, label: str, number: Callable[[], int], unit: str
    ) -> AsyncIterator[None]:
        """Redraw `label... number() units` every `interval` while the block runs, then erase it.

        For work that reports no progress of its own: `number` reads a counter it moves.
        """
        if self.stream is None:
            yield
            return

        async def tick() -> None:
            while True:
                self.update(label, number(), unit)
                await anyio.sleep(self.interval)

        failed: BaseException | None = None
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(tick)
                try:
                    yield
                finally:
                    tasks.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The task group wraps what the block raised; `tick` itself never fails.
            failed = group.exceptions[0] if len(group.exceptions) == 1 else group
        finally:
            self.clear()
        if failed is not None:
            raise failed

    def wrap(self, stream: TextIO) -> TextIO:
        """Return `stream`, erasing this line before each write to it (for log lines)."""
        if self.stream is None:
            return stream
        return cast("TextIO", _Erasing(self, stream))


class _Erasing:
    """A text stream that erases a progress line before it writes."""

    def __init__(self, progress: Progress, stream: TextIO) -> None:
        self._progress = progress
        self._stream = stream

    def write(self, text: str) -> int:
        self._progress.clear()
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return is_terminal(self._stream)
