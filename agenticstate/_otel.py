"""OpenTelemetry instrumentation: the one module that imports `opentelemetry`.

Nothing here costs anything until instrumentation is installed. `StateManager.__init__` calls
`auto_instrument()`, which installs it once when the application has configured a global tracer
or meter provider (checked without importing OpenTelemetry: an application that configured a
provider has imported `opentelemetry.trace` or `opentelemetry.metrics` already). Installing wraps
the public coroutine methods of `StateManager` and of every manager class, once, from here:
there is no per-method code in the managers. Before that, the methods are the plain functions,
so a process without the `otel` extra or without a provider pays nothing per operation.

The metric hooks (`record_*`) are called from a few places in the library (subscriptions, the
task queue, the tool cache); each returns at once while instrumentation is not installed.

What is recorded never includes values or full keys (they may carry user or session ids): only
the backend, the operation, the key's namespace (its first `:`-separated segment) and, for the
task queue's gauges, the team id. `docs/observability.md` lists every span and metric.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agenticstate._version import __version__

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from datetime import datetime

__all__ = [
    "auto_instrument",
    "instrument",
    "is_instrumented",
    "key_namespace",
    "record_cache_lookup",
    "record_lease_expiries",
    "record_overflow",
    "record_queue_depth",
    "record_retry",
    "record_subscriber_lag",
    "uninstrument",
]

SCOPE = "agenticstate"
"""The instrumentation scope name of every span and metric."""

# Seconds, for operations that take from a few microseconds (memory) to seconds (a slow Redis).
_DURATION_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# StateManager methods that are lifecycle, not operations.
_SKIPPED = frozenset({"open", "aclose"})


@dataclass(slots=True)
class _Instruments:
    tracer: Any
    operations: Any
    duration: Any
    lag: Any
    overflows: Any
    queue_depth: Any
    lease_expiries: Any
    cache_lookups: Any
    retries: Any


_active: _Instruments | None = None
_originals: dict[tuple[type, str], Callable[..., Any]] = {}


def is_instrumented() -> bool:
    """Return whether spans and metrics are being recorded."""
    return _active is not None


def _build(tracer_provider: Any, meter_provider: Any) -> _Instruments:
    from opentelemetry import metrics, trace

    tracer = (
        tracer_provider.get_tracer(SCOPE, __version__)
        if tracer_provider is not None
        else trace.get_tracer(SCOPE, __version__)
    )
    meter = (
        meter_provider.get_meter(SCOPE, __version__)
        if meter_provider is not None
        else metrics.get_meter(SCOPE, __version__)
    )
    return _Instruments(
        tracer=tracer,
        operations=meter.create_counter(
            "agenticstate.operations", unit="{operation}", description="Operations completed"
        ),
        duration=meter.create_histogram(
            "agenticstate.operation.duration",
            unit="s",
            description="Duration of StateManager and manager operations",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        ),
        lag=meter.create_histogram(
            "agenticstate.subscription.lag",
            unit="s",
            description="Time from a change's commit to its delivery to a subscriber",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        ),
        overflows=meter.create_counter(
            "agenticstate.subscription.overflows",
            unit="{overflow}",
            description="Subscribers that fell more than their buffer behind",
        ),
        queue_depth=meter.create_gauge(
            "agenticstate.queue.depth",
            unit="{task}",
            description="Tasks per status in a team's queue, when get_queue_status last read it",
        ),
        lease_expiries=meter.create_counter(
            "agenticstate.queue.lease_expiries",
            unit="{task}",
            description="Claimed tasks put back to pending because their lease expired",
        ),
        cache_lookups=meter.create_counter(
            "agenticstate.tool.cache.lookups",
            unit="{lookup}",
            description="Tool result cache lookups (attribute agenticstate.cache.hit)",
        ),
        retries=meter.create_counter(
            "agenticstate.retries",
            unit="{retry}",
            description="Updates that lost a race, failed tasks retried, tool retries scheduled",
        ),
    )


def _providers_configured() -> bool:
    """Whether the application set a global tracer or meter provider (the SDK's, or another)."""
    if "opentelemetry.trace" not in sys.modules and "opentelemetry.metrics" not in sys.modules:
        return False  # nobody imported OpenTelemetry, so nobody configured it
    try:
        from opentelemetry import metrics, trace
    except ImportError:  # pragma: no cover - imported above by the application
        return False
    tracer_provider = trace.get_tracer_provider()
    if not isinstance(tracer_provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return True
    meter_provider = metrics.get_meter_provider()
    # The API's default is a private proxy class; its public no-op sibling means "off" too.
    return not isinstance(meter_provider, metrics.NoOpMeterProvider) and type(
        meter_provider
    ).__name__ not in {"_ProxyMeterProvider", "ProxyMeterProvider"}


def auto_instrument() -> None:
    """Install instrumentation once if the application configured a global provider."""
    if _active is None and _providers_configured():
        instrument()


def instrument(*, tracer_provider: Any = None, meter_provider: Any = None) -> None:
    """Record spans and metrics for every StateManager and manager operation from now on.

    Args:
        tracer_provider: The tracer provider to use; by default the global one.
        meter_provider: The meter provider to use; by default the global one.

    Raises:
        MissingDependencyError: `opentelemetry-api` is not installed (`agenticstate[otel]`).
    """
    global _active
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        from agenticstate.exceptions import MissingDependencyError

        raise MissingDependencyError("opentelemetry-api", "otel") from None
    _active = _build(tracer_provider, meter_provider)
    for cls, layer in _instrumented_classes():
        for name, member in list(vars(cls).items()):
            if name.startswith("_") or name in _SKIPPED or (cls, name) in _originals:
                continue
            if inspect.iscoroutinefunction(member):
                _originals[cls, name] = member
                setattr(cls, name, _traced(member, cls.__name__, name, layer))


def uninstrument() -> None:
    """Stop recording: put the original methods back."""
    global _active
    _active = None
    for (cls, name), original in _originals.items():
        setattr(cls, name, original)
    _originals.clear()


def _instrumented_classes() -> list[tuple[type, str]]:
    from agenticstate.manager import StateManager
    from agenticstate.managers._base import StateManagerBase
    from agenticstate.managers.agents import AgentRecoveryManager

    classes: list[tuple[type, str]] = [(StateManager, "state"), (AgentRecoveryManager, "manager")]
    pending = list(StateManagerBase.__subclasses__())
    while pending:
        cls = pending.pop()
        classes.append((cls, "manager"))
        pending.extend(cls.__subclasses__())
    return classes


def _backend_name(backend: object) -> str:
    # A private variant (the shared file store's lease) reports as the public backend it extends.
    cls = next(
        (
            c
            for c in type(backend).__mro__
            if not c.__module__.startswith("agenticstate.backends._")
        ),
        type(backend),
    )
    name = cls.__name__
    return name.removesuffix("Backend").lower() or name


def _manager_backend(manager: Any) -> object:
    state = getattr(manager, "state", None)
    if state is None:  # AgentRecoveryManager works through its AgentStateStore
        state = getattr(getattr(manager, "agent_store", None), "state", None)
    return getattr(state, "backend", None)


def key_namespace(key: object) -> str | None:
    """Return a key's first `:`-separated segment (`"agent"` for `"agent:a1:status"`).

    A key without a `:` gives `""` (the whole key could be an id), as in `StateManager.usage`.
    For a glob pattern, the segment only when it holds no glob character; `None` otherwise.
    """
    if not isinstance(key, str):
        return None
    head, colon, _ = key.partition(":")
    if any(char in head for char in "*?[\\"):
        return None
    return head if colon else ""


def _namespace_of(operation: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    first = args[0] if args else kwargs.get("key", kwargs.get("pattern"))
    if operation in {"get_many", "save_many"}:
        keys = list(first) if first is not None else []
        spaces = {key_namespace(key) for key in keys}
        return spaces.pop() if len(spaces) == 1 else None
    if first is None and operation in {"list_keys", "usage", "reencrypt"}:
        return None  # the default pattern "*"
    return key_namespace(first)


def _traced(
    method: Callable[..., Coroutine[Any, Any, Any]], owner: str, name: str, layer: str
) -> Callable[..., Coroutine[Any, Any, Any]]:
    operation = name if layer == "state" else f"{owner}.{name}"
    span_name = f"agenticstate.{operation}"

    @functools.wraps(method)
    async def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        instruments = _active
        if instruments is None:  # uninstrumented while this class still held the wrapper
            return await method(self, *args, **kwargs)
        backend = self.backend if layer == "state" else _manager_backend(self)
        attributes: dict[str, str] = {
            "agenticstate.backend": _backend_name(backend),
            "agenticstate.operation": operation,
        }
        if layer == "state":
            # get_many takes any iterable: materialize it once so the method sees the same keys.
            if name in {"get_many"} and args and not isinstance(args[0], (list, tuple)):
                args = (list(args[0]), *args[1:])
            namespace = _namespace_of(name, args, kwargs)
            if namespace is not None:
                attributes["agenticstate.key.namespace"] = namespace
        else:
            attributes["agenticstate.manager"] = owner
        started = time.perf_counter()
        error: str | None = None
        # Exceptions are not recorded as span events: their messages name keys (ids).
        with instruments.tracer.start_as_current_span(
            span_name, attributes=attributes, record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                return await method(self, *args, **kwargs)
            except BaseException as exc:
                error = type(exc).__name__
                span.set_attribute("error.type", error)
                span.set_status(_error_status(error))
                raise
            finally:
                measured: dict[str, str] = {
                    "agenticstate.backend": attributes["agenticstate.backend"],
                    "agenticstate.operation": operation,
                }
                if error is not None:
                    measured["error.type"] = error
                instruments.operations.add(1, measured)
                instruments.duration.record(time.perf_counter() - started, measured)

    return traced


def _error_status(error: str) -> Any:
    from opentelemetry.trace import Status, StatusCode

    return Status(StatusCode.ERROR, error)


# ---------------------------------------------------------------- metric hooks


def record_subscriber_lag(backend: object, committed_at: datetime, kind: str) -> None:
    """Record how long a change took from its commit to its delivery to a subscriber."""
    instruments = _active
    if instruments is None:
        return
    lag = max(time.time() - committed_at.timestamp(), 0.0)
    instruments.lag.record(
        lag, {"agenticstate.backend": _backend_name(backend), "agenticstate.subscriber": kind}
    )


def record_overflow(backend: object, kind: str) -> None:
    """Count a subscriber that fell more than its buffer behind."""
    instruments = _active
    if instruments is not None:
        instruments.overflows.add(
            1, {"agenticstate.backend": _backend_name(backend), "agenticstate.subscriber": kind}
        )


def record_queue_depth(backend: object, team_id: str, depths: dict[str, int]) -> None:
    """Set the queue-depth gauge of one team, one value per task status."""
    instruments = _active
    if instruments is None:
        return
    name = _backend_name(backend)
    for status, depth in depths.items():
        instruments.queue_depth.set(
            depth,
            {
                "agenticstate.backend": name,
                "agenticstate.team": team_id,
                "agenticstate.task.status": status,
            },
        )


def record_lease_expiries(backend: object, team_id: str, count: int) -> None:
    """Count tasks put back because their lease expired."""
    instruments = _active
    if instruments is not None and count:
        instruments.lease_expiries.add(
            count, {"agenticstate.backend": _backend_name(backend), "agenticstate.team": team_id}
        )


def record_cache_lookup(backend: object, *, hit: bool) -> None:
    """Count one tool-cache lookup, hit or miss (the hit ratio is hits / all lookups)."""
    instruments = _active
    if instruments is not None:
        instruments.cache_lookups.add(
            1, {"agenticstate.backend": _backend_name(backend), "agenticstate.cache.hit": hit}
        )


def record_retry(backend: object, kind: str, count: int = 1) -> None:
    """Count retries of one kind.

    `kind` is `"update"` (a compare-and-set that lost a race and ran again), `"task"` (a failed
    task sent back to pending) or `"tool"` (a retry schedule stored).
    """
    instruments = _active
    if instruments is not None and count > 0:
        instruments.retries.add(
            count, {"agenticstate.backend": _backend_name(backend), "agenticstate.retry.kind": kind}
        )
