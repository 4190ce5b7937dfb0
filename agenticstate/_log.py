"""The library's loggers: structlog key-value events on the standard `logging` module.

A library must print nothing by itself. Every module gets its logger from `get_logger(__name__)`:
a structlog bound logger wrapped around `logging.getLogger("agenticstate.<module>")`, built here
with its own processors, so nothing depends on (or changes) the application's
`structlog.configure()`. What happens to an event is then the application's choice, through
`logging`:

- with no configuration, Python's last-resort handler prints WARNING and above to stderr, and
  nothing below;
- `logging.basicConfig(level=logging.DEBUG)` shows every event as
  `DEBUG:agenticstate.backends.file:file_store_snapshot entries=2 path='state/app_state.json'`;
- `structlog.stdlib.ProcessorFormatter` on a handler renders them with the application's
  structlog processors (JSON, console colours), from the event's own key-value pairs.

A disabled level costs one `isEnabledFor` check: no event dict is built. Inside
`structlog.testing.capture_logs()` the events are captured as well, so tests may use it or caplog.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import structlog
import structlog.testing

if TYPE_CHECKING:
    from collections.abc import MutableMapping

__all__ = ["get_logger"]


class _Event(dict[str, Any]):
    """An event dict that prints as `event key=value ...` for plain `logging` formatters.

    `structlog.stdlib.ProcessorFormatter` copies it as a dict (it is one) and renders it itself.
    """

    __slots__ = ()

    def __str__(self) -> str:
        context = " ".join(
            f"{key}={value!r}" for key, value in self.items() if key not in ("event", "exc_info")
        )
        event = str(self.get("event", ""))
        return f"{event} {context}" if context else event


def _to_stdlib(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # The same shape as structlog.stdlib.ProcessorFormatter.wrap_for_formatter, so the
    # application's ProcessorFormatter recognises the record as structlog's.
    kwargs: dict[str, Any] = {"extra": {"_logger": logger, "_name": method_name}}
    exc_info = event_dict.get("exc_info")
    if exc_info:
        if exc_info is True or not isinstance(exc_info, (tuple, BaseException)):
            exc_info = sys.exc_info()
            event_dict["exc_info"] = exc_info
        kwargs["exc_info"] = exc_info
    return (_Event(event_dict),), kwargs


def _capture(processors: Any, method: str, event_dict: dict[str, Any]) -> None:
    # Inside `structlog.testing.capture_logs()` (which ends the global chain with a LogCapture)
    # every event is captured too, whatever the logging levels: tests can use either that or
    # pytest's caplog. An application's own structlog configuration is never used.
    try:
        for processor in processors:
            event_dict = processor(None, method, event_dict)
    except structlog.DropEvent:
        pass


class _BoundLogger(structlog.BoundLoggerBase):
    """The methods the library calls, each skipped at once when its level is disabled."""

    _logger: logging.Logger

    def _emit(self, level: int, method: str, event: str, kw: dict[str, Any]) -> None:
        processors = structlog.get_config()["processors"]
        if processors and isinstance(processors[-1], structlog.testing.LogCapture):
            _capture(processors, method, {**self._context, **kw, "event": event})
        if self._logger.isEnabledFor(level):
            args, kwargs = self._process_event(method, event, kw)
            getattr(self._logger, method)(*args, **kwargs)

    def debug(self, event: str, **kw: Any) -> None:
        """Log `event` at DEBUG with its context."""
        self._emit(logging.DEBUG, "debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        """Log `event` at INFO with its context."""
        self._emit(logging.INFO, "info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        """Log `event` at WARNING with its context."""
        self._emit(logging.WARNING, "warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        """Log `event` at ERROR with its context."""
        self._emit(logging.ERROR, "error", event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        """Log `event` at ERROR with its context and the exception being handled."""
        kw.setdefault("exc_info", True)
        self._emit(logging.ERROR, "error", event, kw)


def get_logger(name: str) -> Any:
    """Return the structlog logger for module `name`, writing to `logging.getLogger(name)`.

    Typed `Any` like `structlog.get_logger`, so the call sites stay as they were.
    """
    return _BoundLogger(
        logging.getLogger(name),
        processors=[_to_stdlib],
        context={},
    )
