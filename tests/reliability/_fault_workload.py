"""The workload of the fault tests, and the model it is checked against.

Worker tasks share one `StateManager` whose `RedisBackend` reaches Redis through a `FaultProxy`.
Each worker owns a few keys (no other worker touches them), so the model knows the exact state
each key must be in, and every call is checked against it as it returns:

- A call that returned normally took effect exactly once: a save or update returns the model's
  next version and value, a delete `True`, a read exactly the model's state.
- A write that raised `WriteOutcomeUnknownError` took effect at most once: the key is in doubt,
  its state either the one before the call or the one after it.
- A write that raised `BackendUnavailableError` or `BackendTimeoutError` did not take effect
  (the library says it was not sent): the key's state must still be the one before the call.
- Anything else a call raises (a `ConflictError` on a key nobody else writes, a redis-py
  exception, a generic `BackendError`) is a violation.

A key in doubt is written no more until the round ends, but still read: every read must see one
of its possible states. At the end of a round, `settle` makes sure nothing is still on its way
(the proxy severs every connection, then `CLIENT KILL` ends every server-side connection but the
admin's, so no byte sent earlier can still run), reads every key over a direct, healthy
connection, resolves each doubt (applied or not: anything else is a duplicate or a phantom) and
compares every key with the model.

Every value is `{"n": increments so far, "ops": the ids of the last writes, newest last}`: an
operation applied twice shows up as a version, a count or an id too many.

Every failing call is timed against the time the library documents for it (`Budgets`).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate import (
    BackendTimeoutError,
    BackendUnavailableError,
    WriteOutcomeUnknownError,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from agenticstate import StateEntry, StateManager

__all__ = ["Budgets", "Doubt", "FaultWorkload", "KeyState", "Timing"]

KINDS = {"get": 25, "save_cas": 30, "save": 10, "update": 25, "delete": 10}
"""How often each call is made."""
WRITES = frozenset(KINDS) - {"get"}
EMPTY: dict[str, Any] = {"n": 0, "ops": []}
KEEP_OPS = 6  # ids kept in a value: enough to show a duplicate, small enough to stay cheap


@dataclass(frozen=True)
class KeyState:
    """A present key: its version and value."""

    version: int
    value: Any


def next_value(current: dict[str, Any] | None, op_id: str, *, increment: bool) -> dict[str, Any]:
    """The value a write with id `op_id` stores over `current`."""
    base = current if current is not None else EMPTY
    return {"n": base["n"] + int(increment), "ops": [*base["ops"][-(KEEP_OPS - 1) :], op_id]}


def state_of(entry: StateEntry | None) -> KeyState | None:
    """A read's result as a model state."""
    return None if entry is None else KeyState(entry.version, entry.value)


@dataclass(frozen=True)
class Budgets:
    """How long a failing call may take, from the backend's documented settings.

    A write is one command: `socket_timeout` covers connecting, sending and the reply. A read
    is retried `read_retries` times after a connection failure or timeout, with a backoff of
    0.05 s doubling. An update is a read then a write. Each timed wait (a timeout or a backoff)
    may end up to `margin_per_wait` late on a busy event loop.
    """

    socket_timeout: float
    read_retries: int
    margin_per_wait: float

    def of(self, kind: str) -> float:
        """The documented worst case for a failing call of `kind`."""
        read = (self.read_retries + 1) * self.socket_timeout
        read += sum(0.05 * 2.0**attempt for attempt in range(self.read_retries))
        if kind == "get":
            return read
        if kind == "update":
            return read + self.socket_timeout
        return self.socket_timeout

    def limit(self, kind: str) -> float:
        """The documented worst case plus the margin for each timed wait in it."""
        read_waits = 2 * self.read_retries + 1
        waits = {"get": read_waits, "update": read_waits + 1}.get(kind, 1)
        return self.of(kind) + waits * self.margin_per_wait


@dataclass(frozen=True)
class Timing:
    """One failing call: what it was, what it raised and how long it took."""

    kind: str
    error: str
    seconds: float
    budget: float
    limit: float

    @property
    def over(self) -> float:
        """Seconds beyond the documented time (negative when within it)."""
        return self.seconds - self.budget


@dataclass
class Doubt:
    """A key whose last write failed: the states it may be in."""

    op_id: str
    kind: str
    error: str
    before: KeyState | None
    after: KeyState | None
    may_have_applied: bool

    def allows(self, state: KeyState | None) -> bool:
        """Whether the key may be in `state`."""
        return state == self.before or (self.may_have_applied and state == self.after)


@dataclass
class FaultWorkload:
    """Workers, their keys, the model and everything observed."""

    state: StateManager
    budgets: Budgets
    workers: int = 6
    keys_per_worker: int = 4
    seed: int = 0
    model: dict[str, KeyState | None] = field(default_factory=dict)
    doubts: dict[str, Doubt] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    timings: list[Timing] = field(default_factory=list)
    resolved: Counter[str] = field(default_factory=Counter)
    calls: int = 0
    round_failures: int = 0

    def __post_init__(self) -> None:
        self.keys = {
            worker: [f"w{worker}:k{n}" for n in range(self.keys_per_worker)]
            for worker in range(self.workers)
        }
        for keys in self.keys.values():
            self.model.update(dict.fromkeys(keys))
        self._random = random.Random(self.seed)
        self._progress = anyio.Event()

    # progress, for tests that switch faults when the workload gets somewhere

    def _advance(self) -> None:
        self._progress.set()
        self._progress = anyio.Event()

    async def wait_until(self, predicate: Callable[[FaultWorkload], bool]) -> None:
        """Wait (no polling: woken after each call) until `predicate(self)` holds."""
        while not predicate(self):
            await self._progress.wait()

    # one round

    async def run_round(self, number: int, calls_per_worker: int) -> None:
        """Run every worker for `calls_per_worker` calls at once."""
        self.round_failures = 0
        async with anyio.create_task_group() as group:
            for worker in range(self.workers):
                rng = random.Random(self._random.random())
                group.start_soon(self._worker, number, worker, calls_per_worker, rng)

    async def _worker(self, number: int, worker: int, count: int, rng: random.Random) -> None:
        for n in range(count):
            await self._call(f"{number}.{worker}.{n}", self.keys[worker], rng)
            self.calls += 1
            self._advance()

    async def _call(self, op_id: str, keys: list[str], rng: random.Random) -> None:
        kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
        writable = [key for key in keys if key not in self.doubts]
        if kind in WRITES and not writable:
            kind = "get"
        key = rng.choice(keys if kind == "get" else writable)
        before = self.model[key]
        if kind == "delete" and before is None:
            kind = "save_cas"
        after: KeyState | None = None
        if kind != "delete" and kind != "get":
            version = before.version + 1 if before is not None else 1
            current = before.value if before is not None else None
            after = KeyState(version, next_value(current, op_id, increment=kind == "update"))
        started = time.monotonic()
        try:
            await self._send(kind, key, before, after, op_id)
        except (WriteOutcomeUnknownError, BackendUnavailableError, BackendTimeoutError) as exc:
            seconds = time.monotonic() - started
            error = type(exc).__name__
            self.outcomes[f"{kind}:{error}"] += 1
            self.round_failures += 1
            budgets = self.budgets
            self.timings.append(Timing(kind, error, seconds, budgets.of(kind), budgets.limit(kind)))
            if kind == "get":
                if isinstance(exc, WriteOutcomeUnknownError):
                    self.violations.append(f"{op_id}: a read raised {error}")
                return
            unknown = isinstance(exc, WriteOutcomeUnknownError)
            self.doubts[key] = Doubt(op_id, kind, error, before, after, may_have_applied=unknown)
        except Exception as exc:  # noqa: BLE001  # every other outcome is a finding
            self.outcomes[f"{kind}:{type(exc).__name__}"] += 1
            self.violations.append(f"{op_id}: {kind} {key} raised {type(exc).__name__}: {exc}")
            self.doubts[key] = Doubt(op_id, kind, type(exc).__name__, before, after, True)
        else:
            self.outcomes[f"{kind}:ok"] += 1
            if kind != "get":
                self.model[key] = after

    async def _send(
        self,
        kind: str,
        key: str,
        before: KeyState | None,
        after: KeyState | None,
        op_id: str,
    ) -> None:
        """Make the call and check what it returned against the model."""
        state = self.state
        if kind == "get":
            seen = state_of(await state.get_entry(key))
            doubt = self.doubts.get(key)
            if doubt is not None:
                if not doubt.allows(seen):
                    self.violations.append(
                        f"{op_id}: read {key} = {seen}, but after {doubt.op_id} "
                        f"({doubt.kind}, {doubt.error}) it can only be "
                        f"{doubt.before} or {doubt.after if doubt.may_have_applied else '-'}"
                    )
            elif seen != before:
                self.violations.append(f"{op_id}: read {key} = {seen}, model says {before}")
            return
        if kind == "delete":
            assert before is not None
            existed = await state.delete(key, expected_version=before.version)
            if not existed:
                self.violations.append(f"{op_id}: delete {key} found nothing, model {before}")
            return
        assert after is not None
        if kind == "update":

            def bump(current: dict[str, Any]) -> dict[str, Any]:
                return next_value(current, op_id, increment=True)

            stored = await state.update(key, bump, default=EMPTY)
            if stored != after.value:
                self.violations.append(f"{op_id}: update {key} stored {stored}, model {after}")
            return
        expected = (before.version if before is not None else 0) if kind == "save_cas" else None
        version = await state.save(key, after.value, expected_version=expected)
        if version != after.version:
            self.violations.append(f"{op_id}: {kind} {key} -> version {version}, model {after}")

    # the barrier between rounds

    async def settle(self, direct: StateManager) -> dict[str, KeyState | None]:
        """Resolve every doubt and compare every key with the model, reading via `direct`.

        Call it only once nothing can reach the server any more (see the module docstring).
        """
        found: dict[str, KeyState | None] = {}
        for key, expected in self.model.items():
            actual = state_of(await direct.get_entry(key))
            found[key] = actual
            doubt = self.doubts.pop(key, None)
            if doubt is None:
                if actual != expected:
                    self.violations.append(f"settle: {key} = {actual}, model says {expected}")
                continue
            if actual == doubt.before:
                self.resolved[f"{doubt.error}:not applied"] += 1
            elif doubt.may_have_applied and actual == doubt.after:
                self.resolved[f"{doubt.error}:applied"] += 1
            else:
                claim = "at most once" if doubt.may_have_applied else "not at all"
                self.violations.append(
                    f"settle: {key} = {actual} after {doubt.op_id} ({doubt.kind} raised "
                    f"{doubt.error}: {claim}); before {doubt.before}, after {doubt.after}"
                )
            self.model[key] = actual
        return found


class View:
    """What a subscriber saw: the last version and value of each key (deletes remove it)."""

    def __init__(self) -> None:
        self.states: dict[str, KeyState] = {}
        self.events: Counter[str] = Counter()
        self.ready = anyio.Event()
        self._changed = anyio.Event()

    async def follow(self, state: StateManager, pattern: str = "*") -> None:
        """Apply every change `state` delivers for `pattern`, until cancelled."""
        async with state.watch(pattern) as changes:
            self.ready.set()
            async for change in changes:
                self.events[change.op.value] += 1
                if change.new_value is None:
                    self.states.pop(change.key, None)
                else:
                    self.states[change.key] = KeyState(change.version, change.new_value)
                self._advance()

    def _advance(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_until(self, predicate: Callable[[dict[str, KeyState]], bool]) -> None:
        """Wait (woken by each change, no polling) until `predicate(states)` holds."""
        while not predicate(self.states):
            await self._changed.wait()
