"""OpenTelemetry: spans and metrics recorded by the SDK's in-memory exporter and reader."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from agenticstate import (
    AgentRecoveryManager,
    ConflictError,
    OrchestrationStateManager,
    StateConfig,
    StateManager,
    SubscriptionClosedError,
    TeamState,
    ToolCacheEntry,
    ToolStateManager,
    WorkflowState,
    WorkflowStateManager,
    telemetry,
)
from agenticstate._otel import key_namespace
from tests.helpers import unique_prefix

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from opentelemetry.sdk.trace import ReadableSpan

    from agenticstate.backends import Backend

SECRET_ID = "user-4f1c9a"  # noqa: S105  # an id inside keys: must never reach a span or a metric
SECRET_VALUE = "sk-the-value-itself"  # noqa: S105  # a marker, not a credential


class Recorded:
    """The spans and metric points the in-memory exporter and reader collected."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def span(self, name: str) -> ReadableSpan:
        found = [span for span in self.spans() if span.name == name]
        assert found, f"no span {name}: {[span.name for span in self.spans()]}"
        return found[-1]

    def points(self, metric: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for recorded in scope.metrics
            if recorded.name == metric
            for point in recorded.data.data_points
        ]

    def total(self, metric: str, **attributes: object) -> float:
        values: list[float] = [
            point.value
            for point in self.points(metric)
            if all(point.attributes.get(k) == v for k, v in attributes.items())
        ]
        return sum(values)


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    """Instrumentation installed with SDK providers of this test's own, removed afterwards."""
    record = Recorded()
    telemetry.instrument(
        tracer_provider=record.tracer_provider, meter_provider=record.meter_provider
    )
    try:
        yield record
    finally:
        telemetry.uninstrument()
        record.tracer_provider.shutdown()
        record.meter_provider.shutdown()


def _texts(attributes: Any) -> list[str]:
    return [f"{key}={value!r}" for key, value in dict(attributes or {}).items()]


def _attribute_texts(record: Recorded) -> list[str]:
    texts = [span.name for span in record.spans()]
    for span in record.spans():
        texts += _texts(span.attributes)
        for event in span.events:
            texts += _texts(event.attributes)
    data = record.reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    texts += _texts(point.attributes)
    return texts


async def test_a_span_and_metrics_per_state_manager_operation(
    recorded: Recorded, backend: Backend
) -> None:
    """Every StateManager operation gives one span with backend, operation and namespace."""
    kind = type(backend).__name__.removesuffix("Backend").lower()
    state = StateManager(backend=backend, close_backend=False)
    key = f"session:{SECRET_ID}:profile"
    await state.save(key, {"token": SECRET_VALUE})
    assert await state.get(key) == {"token": SECRET_VALUE}
    await state.update(key, {"seen": 1})
    assert await state.get_many(k for k in [key, f"session:{SECRET_ID}:other"]) == {
        key: {"token": SECRET_VALUE, "seen": 1}
    }
    assert await state.list_keys("session:*") == [key]
    assert (await state.usage()).keys == 1
    assert await state.delete(key)
    await state.aclose()
    names = [span.name for span in recorded.spans()]
    for operation in ["save", "get", "update", "get_many", "list_keys", "usage", "delete"]:
        span = recorded.span(f"agenticstate.{operation}")
        attributes = dict(span.attributes or {})
        assert attributes["agenticstate.backend"] == kind
        assert attributes["agenticstate.operation"] == operation
        if operation != "usage":  # the default pattern "*" has no namespace
            assert attributes["agenticstate.key.namespace"] == "session"
        assert recorded.total("agenticstate.operations", **{"agenticstate.operation": operation})
    assert names.count("agenticstate.get") == 1
    durations = recorded.points("agenticstate.operation.duration")
    assert sum(point.count for point in durations) == len(names)
    texts = _attribute_texts(recorded)
    assert not [text for text in texts if SECRET_ID in text or SECRET_VALUE in text]


async def test_a_failed_operation_is_an_error_span_and_raises_unchanged(
    recorded: Recorded,
) -> None:
    """A refused write raises as before; its span has status ERROR and its metric error.type."""
    async with StateManager() as state:
        await state.save("agent:a", 1)
        with pytest.raises(ConflictError):
            await state.save("agent:a", 2, expected_version=5)
    failed = [span for span in recorded.spans() if span.status.status_code is StatusCode.ERROR]
    assert [span.name for span in failed] == ["agenticstate.save"]
    assert dict(failed[0].attributes or {})["error.type"] == "ConflictError"
    assert failed[0].events == ()  # no exception event: its message names the key
    assert recorded.total("agenticstate.operations", **{"error.type": "ConflictError"}) == 1


async def test_manager_operations_are_parents_of_their_state_operations(
    recorded: Recorded, tmp_path: Path
) -> None:
    """A manager call is one span named after the manager; its StateManager calls are children."""
    async with WorkflowStateManager(persistence="file", base_path=tmp_path) as workflows:
        await workflows.create(WorkflowState(workflow_id="wf-1", total_steps=2))
    parent = recorded.span("agenticstate.WorkflowStateManager.create")
    attributes = dict(parent.attributes or {})
    assert attributes["agenticstate.manager"] == "WorkflowStateManager"
    assert attributes["agenticstate.backend"] == "file"
    children = [
        span
        for span in recorded.spans()
        if span.parent is not None and span.parent.span_id == parent.context.span_id
    ]
    assert children
    assert all(span.name.startswith("agenticstate.") for span in children)


async def test_subscriber_lag_and_overflow_are_measured(recorded: Recorded) -> None:
    """Deliveries to callbacks and watches record their lag; a watch that overflows counts."""
    async with StateManager() as state:
        delivered = anyio.Event()
        state.subscribe("agent:*", lambda key, old, new: delivered.set())
        await state.save("agent:a", 1)
        with anyio.fail_after(5):
            await delivered.wait()
        async with state.watch("agent:*", max_buffer=1) as changes:
            for version in range(3):
                await state.save("agent:b", version)
            with pytest.raises(SubscriptionClosedError):  # noqa: PT012  # the stream runs dry
                with anyio.fail_after(5):
                    async for _ in changes:
                        pass
    lags = recorded.points("agenticstate.subscription.lag")
    kinds = {point.attributes["agenticstate.subscriber"] for point in lags}
    assert kinds == {"callback", "watch"}
    assert all(point.min >= 0 for point in lags)
    assert (
        recorded.total(
            "agenticstate.subscription.overflows", **{"agenticstate.subscriber": "watch"}
        )
        == 1
    )


async def test_queue_depth_lease_expiries_and_task_retries(
    recorded: Recorded, state: StateManager
) -> None:
    """get_queue_status sets the depth gauge; reaped leases and retried tasks are counted."""
    orch = OrchestrationStateManager(state_manager=state)
    await orch.create_team(TeamState(team_id="team"))
    for name in ["a", "b", "c"]:
        await orch.enqueue_task("team", {"id": name, "max_retries": 1})
    claim = await orch.claim_task("team", "w1", lease=timedelta(milliseconds=20))
    assert claim is not None
    await anyio.sleep(0.05)  # let the lease run out: wall-clock expiry, not synchronization
    assert await orch.reap_expired("team") == [claim.task.task_id]
    again = await orch.claim_task("team", "w1")
    assert again is not None
    await orch.fail_task("team", again.task.task_id, "boom", lease_token=again.lease_token)
    queue = await orch.get_queue_status("team")
    assert len(queue.pending) == 3
    depth = {
        point.attributes["agenticstate.task.status"]: point.value
        for point in recorded.points("agenticstate.queue.depth")
    }
    assert depth["pending"] == 3
    assert depth["in_progress"] == 0
    assert recorded.total("agenticstate.queue.lease_expiries", **{"agenticstate.team": "team"}) == 1
    assert recorded.total("agenticstate.retries", **{"agenticstate.retry.kind": "task"}) == 1


async def test_cache_hit_ratio_comes_from_hit_and_miss_counts(
    recorded: Recorded, state: StateManager
) -> None:
    """Tool cache lookups are counted with agenticstate.cache.hit, so hits / all is the ratio."""
    tools = ToolStateManager(state_manager=state)
    params = {"q": SECRET_VALUE}
    assert await tools.get_cached_result("search", params) is None
    from agenticstate import hash_parameters

    await tools.cache_result(
        ToolCacheEntry(tool_name="search", parameters_hash=hash_parameters(params), result=1)
    )
    for _ in range(3):
        assert await tools.get_cached_result("search", params) is not None
    hits = recorded.total("agenticstate.tool.cache.lookups", **{"agenticstate.cache.hit": True})
    misses = recorded.total("agenticstate.tool.cache.lookups", **{"agenticstate.cache.hit": False})
    assert (hits, misses) == (3, 1)
    stats = await tools.get_tool_stats("search")
    assert hits / (hits + misses) == stats.cache_hit_rate
    assert not [text for text in _attribute_texts(recorded) if SECRET_VALUE in text]


def test_uninstrument_puts_the_original_methods_back() -> None:
    """Without instrumentation the methods are the plain functions: nothing runs per call."""
    original = StateManager.get
    original_manager = WorkflowStateManager.create
    original_recovery = AgentRecoveryManager.recover
    telemetry.instrument(tracer_provider=TracerProvider(), meter_provider=MeterProvider())
    try:
        assert telemetry.is_instrumented()
        assert StateManager.get is not original
        assert WorkflowStateManager.create is not original_manager
        assert AgentRecoveryManager.recover is not original_recovery
        assert StateManager.get.__wrapped__ is original  # type: ignore[attr-defined]
    finally:
        telemetry.uninstrument()
    assert not telemetry.is_instrumented()
    assert StateManager.get is original
    assert WorkflowStateManager.create is original_manager
    assert AgentRecoveryManager.recover is original_recovery


@pytest.mark.parametrize(
    ("key", "namespace"),
    [
        ("agent:a1:status", "agent"),
        ("counter", ""),  # no colon: the whole key could be an id
        ("user-42", ""),
        ("agent*", None),
        ("ag?nt:x", None),
        (r"a\*:x", None),
        ("[ab]:x", None),
        ("*", None),
    ],
)
def test_key_namespace_is_the_literal_first_segment(key: str, namespace: str | None) -> None:
    """Only a literal first segment is recorded: never the rest of the key, never a glob."""
    assert key_namespace(key) == namespace


def _python(code: str, tmp_path: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_globally_configured_provider_is_picked_up_by_itself(tmp_path: Path) -> None:
    """An application that sets the SDK's global providers gets spans without calling anything."""
    result = _python(
        """
        import json, anyio
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        from agenticstate import StateManager, telemetry

        async def main():
            async with StateManager() as state:
                await state.save("agent:a", 1)
                await state.get("agent:a")

        anyio.run(main)
        print(json.dumps({"instrumented": telemetry.is_instrumented(),
                          "spans": [s.name for s in exporter.get_finished_spans()]}))
        """,
        tmp_path,
    )
    assert result == {
        "instrumented": True,
        "spans": ["agenticstate.save", "agenticstate.get"],
    }


def test_no_provider_means_nothing_is_installed(tmp_path: Path) -> None:
    """With the API imported but no provider configured, the methods stay the plain ones."""
    result = _python(
        """
        import json, anyio
        import opentelemetry.trace, opentelemetry.metrics
        from agenticstate import StateManager, telemetry
        original = StateManager.get

        async def main():
            async with StateManager() as state:
                await state.save("agent:a", 1)
                return await state.get("agent:a")

        print(json.dumps({"value": anyio.run(main), "instrumented": telemetry.is_instrumented(),
                          "plain": StateManager.get is original}))
        """,
        tmp_path,
    )
    assert result == {"value": 1, "instrumented": False, "plain": True}


def test_everything_works_without_the_extra(tmp_path: Path) -> None:
    """Without opentelemetry installed the library works; instrument() names the extra."""
    result = _python(
        """
        import json, sys, anyio
        for name in ["opentelemetry", "opentelemetry.trace", "opentelemetry.metrics"]:
            sys.modules[name] = None  # as if the package were not installed
        from agenticstate import MissingDependencyError, StateManager, telemetry

        async def main():
            async with StateManager() as state:
                await state.save("agent:a", 1)
                return await state.get("agent:a"), (await state.usage()).keys

        try:
            telemetry.instrument()
            error = None
        except MissingDependencyError as exc:
            error = exc.extra
        print(json.dumps({"result": anyio.run(main), "error": error,
                          "instrumented": telemetry.is_instrumented()}))
        """,
        tmp_path,
    )
    assert result == {"result": [1, 1], "error": "otel", "instrumented": False}


async def test_instrumented_encrypted_and_prefixed_manager_still_records_only_namespaces(
    recorded: Recorded,
) -> None:
    """A key prefix (tenant) is not a namespace either: only the key's own first segment."""
    async with StateManager(StateConfig(key_prefix=f"tenant-{SECRET_ID}:")) as state:
        await state.save(f"agent:{SECRET_ID}", SECRET_VALUE)
    span = recorded.span("agenticstate.save")
    assert dict(span.attributes or {})["agenticstate.key.namespace"] == "agent"
    assert not [text for text in _attribute_texts(recorded) if SECRET_ID in text]


operations = st.lists(
    st.tuples(
        st.sampled_from(["save", "get", "exists", "delete", "get_many", "update"]),
        st.sampled_from(["agents", "teams", "sessions"]),
        st.from_regex(r"[a-z0-9-]{6,12}", fullmatch=True),
    ),
    min_size=1,
    max_size=15,
)


@settings(max_examples=30, deadline=None)
@given(steps=operations)
def test_generated_operations_give_one_span_each_and_never_an_id(
    steps: list[tuple[str, str, str]],
) -> None:
    """For any sequence of operations: one span each, in order, with the namespace and no id."""
    record = Recorded()
    ids = {f"id{ident}" for _, _, ident in steps}

    async def main() -> None:
        async with StateManager() as state:
            for operation, namespace, ident in steps:
                key = f"{namespace}:id{ident}:value"
                if operation == "save":
                    await state.save(key, {"owner": f"id{ident}"})
                elif operation == "get":
                    await state.get(key)
                elif operation == "exists":
                    await state.exists(key)
                elif operation == "delete":
                    await state.delete(key)
                elif operation == "get_many":
                    await state.get_many([key, f"{namespace}:other"])
                else:
                    await state.update(key, {"n": 1}, default={})

    telemetry.instrument(
        tracer_provider=record.tracer_provider, meter_provider=record.meter_provider
    )
    try:
        anyio.run(main)
    finally:
        telemetry.uninstrument()
    spans = record.spans()
    assert [span.name for span in spans] == [f"agenticstate.{op}" for op, _, _ in steps]
    assert [dict(span.attributes or {})["agenticstate.key.namespace"] for span in spans] == [
        namespace for _, namespace, _ in steps
    ]
    assert record.total("agenticstate.operations") == len(steps)
    texts = _attribute_texts(record)
    assert not [text for text in texts for ident in ids if ident in text]


def test_the_blocking_api_is_traced_too(recorded: Recorded) -> None:
    """agenticstate.sync runs the instrumented methods on its loop thread: the same spans."""
    from agenticstate import sync

    with sync.StateManager() as state:
        state.save("agent:a", {"n": 1})
        assert state.get("agent:a") == {"n": 1}
        usage = state.usage()
    assert (usage.keys, usage.namespaces["agent"].keys) == (1, 1)
    assert [span.name for span in recorded.spans()] == [
        "agenticstate.save",
        "agenticstate.get",
        "agenticstate.usage",
    ]


@pytest.mark.redis
async def test_an_update_that_loses_a_race_counts_its_retries(
    recorded: Recorded, redis_url: str
) -> None:
    """On Redis, a write from another client between read and compare-and-set is one retry."""
    from agenticstate import RedisBackend, sync

    prefix = unique_prefix()
    calls = [0]
    with sync.StateManager(backend=RedisBackend(url=redis_url, key_prefix=prefix)) as rival:
        async with StateManager(backend=RedisBackend(url=redis_url, key_prefix=prefix)) as state:
            await state.save("counter:a", 1)

            def bump(value: int) -> int:
                calls[0] += 1
                if calls[0] == 1:
                    rival.save("counter:a", 10)  # another client commits first: the CAS fails
                return value + 1

            assert await state.update("counter:a", bump) == 11
            await state.update("counter:a", lambda value: value + 1)  # no race: no retry
    assert calls[0] == 2
    assert recorded.total("agenticstate.retries", **{"agenticstate.retry.kind": "update"}) == 1
