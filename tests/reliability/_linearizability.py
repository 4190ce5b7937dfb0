"""A Wing-Gong linearizability checker (with Lowe's memoization) for a versioned register.

A history is a list of `Operation`s on one key, each with the times it was invoked and it
responded (from one monotonic clock shared by every process on the host) and its result. The
history is linearizable if each operation can be given a single instant between its invocation
and its response such that, run in that order one at a time, the register model gives every
operation the result it really got.

The register is the contract of `Backend` reduced to one key: a version (0 while missing, one
more after each write) and the identity of the value last written. Operations:

- `read`: returns `(version, value)`, `(0, None)` when missing.
- `write(value)`: stores unconditionally, returns the new version.
- `cas(expected_version, value)`: stores if the version is `expected_version` and returns the
  new version; otherwise changes nothing and reports the conflict with the actual version.
- `update(value)`: an atomic read-modify-write; stores `value` and returns the identity of the
  value it replaced (None when missing).

An operation whose outcome is unknown (its reply was lost) has no response: `response` is None.
It may take effect at any instant after its invocation, or never, and its result is not checked.
If the test knows a time after which it can no longer take effect (every connection it could
still be travelling on was closed and killed on the server), that is its `deadline`: it took
effect before then, or never.

The search is Wing and Gong's: repeatedly linearize an operation whose invocation comes before
every pending response, backtrack when a response is reached that was not linearized, and (Lowe)
remember each (set of linearized operations, state) pair already explored, so no configuration
is explored twice. An operation with an unknown outcome is tried only where it changes the
state (taking effect without changing anything is the same as not taking effect); reaching its
deadline unlinearized means it never took effect; and the search ends once every operation that
has a response or deadline is linearized (the others may take effect after everything seen, or
never, which is the same). Without deadlines, every unknown outcome stays open to the end and
the search can grow exponentially with their number.

Histories are checked key by key: a history of independent keys is linearizable iff each key's
is (linearizability is local).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

__all__ = ["CheckResult", "Operation", "State", "check", "partition_by_key", "step"]

Kind: TypeAlias = Literal["read", "write", "cas", "update"]
State: TypeAlias = tuple[int, str | None]
"""The register: (version, identity of the stored value); (0, None) while missing."""

MISSING: State = (0, None)


@dataclass(frozen=True)
class Operation:
    """One call on one key, as a client saw it.

    Attributes:
        process: Who called (a process or task id); a process's calls never overlap.
        key: The key.
        kind: `read`, `write`, `cas` or `update`.
        value: The identity written (write, cas, update).
        expected: The expected version (cas).
        invoke: When the call started (monotonic nanoseconds).
        response: When it returned or raised, or None if its outcome is unknown.
        result: What it returned: read `(version, value)`; write and successful cas the new
            version; a refused cas `("conflict", actual_version)`; update the replaced identity.
        deadline: For an unknown outcome, when it could no longer take effect, if known.
    """

    process: int
    key: str
    kind: Kind
    invoke: int
    response: int | None
    value: str | None = None
    expected: int | None = None
    result: object = None
    deadline: int | None = None

    @property
    def ends(self) -> float:
        """The last instant it may take effect: its response, its deadline, or never known."""
        if self.response is not None:
            return float(self.response)
        return float("inf") if self.deadline is None else float(self.deadline)


@dataclass
class CheckResult:
    """The checker's verdict on one history.

    Attributes:
        ok: Whether the history is linearizable.
        operations: How many operations it has.
        explored: Configurations (linearized set, state) explored.
        longest: The most operations linearized at once in the search.
        stuck: On failure, an operation that responded before it could be linearized, at the
            deepest point the search reached: where to start reading the history.
    """

    ok: bool
    operations: int
    explored: int = 0
    longest: int = 0
    stuck: Operation | None = None


def step(state: State, op: Operation) -> tuple[bool, State]:
    """Apply `op` to the register in `state`: whether its result fits, and the next state.

    An operation with no response (unknown outcome) fits any result.
    """
    version, current = state
    unknown = op.response is None
    if op.kind == "read":
        if unknown:
            return True, state
        result = op.result
        fits = isinstance(result, (tuple, list)) and tuple(result) == (version, current)
        return fits, state
    if op.kind == "write":
        return unknown or op.result == version + 1, (version + 1, op.value)
    if op.kind == "cas":
        if op.expected == version:
            return unknown or op.result == version + 1, (version + 1, op.value)
        refused = ("conflict", version)
        fits = isinstance(op.result, (tuple, list)) and tuple(op.result) == refused
        return unknown or fits, state
    if op.kind == "update":
        return unknown or op.result == current, (version + 1, op.value)
    raise ValueError(f"unknown operation kind {op.kind!r}")


@dataclass(eq=False)
class _Event:
    """A call or return event in the doubly linked list the search lifts events out of."""

    op_id: int
    is_call: bool
    time: float
    match: _Event | None = None  # a call's return
    match_call: _Event = field(init=False)  # a return's call
    prev: _Event | None = None
    next: _Event | None = None


def _events(ops: list[Operation]) -> _Event:
    """Build the list of call and return events, in time order, behind a sentinel head."""
    events: list[_Event] = []
    for op_id, op in enumerate(ops):
        call = _Event(op_id, True, float(op.invoke))
        if op.ends < call.time:
            raise ValueError(f"operation {op} responds before it is invoked")
        ret = _Event(op_id, False, op.ends)
        call.match = ret
        ret.match_call = call
        events += (call, ret)
    # Calls before returns at equal times: simultaneous operations count as overlapping, which
    # allows more orders (never rejects a linearizable history).
    events.sort(key=lambda e: (e.time, not e.is_call, e.op_id))
    head = _Event(-1, False, float("-inf"))
    last = head
    for event in events:
        last.next = event
        event.prev = last
        last = event
    return head


def _lift(call: _Event) -> None:
    """Take a call and its return out of the list (the operation is linearized)."""
    assert call.prev is not None
    assert call.match is not None
    call.prev.next = call.next
    if call.next is not None:
        call.next.prev = call.prev
    ret = call.match
    assert ret.prev is not None
    ret.prev.next = ret.next
    if ret.next is not None:
        ret.next.prev = ret.prev


def _unlift(call: _Event) -> None:
    """Put a lifted call and its return back (undo `_lift`, in reverse order)."""
    ret = call.match
    assert ret is not None
    assert ret.prev is not None
    assert call.prev is not None
    ret.prev.next = ret
    if ret.next is not None:
        ret.next.prev = ret
    call.prev.next = call
    if call.next is not None:
        call.next.prev = call


def check(ops: list[Operation], *, initial: State = MISSING) -> CheckResult:
    """Decide whether `ops` (one key's history) is linearizable from `initial`."""
    head = _events(ops)
    result = CheckResult(ok=False, operations=len(ops))
    stack: list[tuple[_Event, State]] = []
    cache: set[tuple[int, State]] = set()
    linearized = 0
    stuck_depth = -1
    state = initial
    remaining = sum(op.ends != float("inf") for op in ops)  # must be linearized (or dropped)
    entry = head.next
    while remaining:
        assert entry is not None
        op = ops[entry.op_id]
        unknown = op.response is None
        if entry.is_call:
            fits, after = step(state, op)
            if fits and not (unknown and after == state):
                marked = linearized | (1 << entry.op_id)
                if (marked, after) not in cache:
                    cache.add((marked, after))
                    result.explored += 1
                    stack.append((entry, state))
                    state = after
                    linearized = marked
                    remaining -= op.ends != float("inf")
                    _lift(entry)
                    result.longest = max(result.longest, len(stack))
                    entry = head.next
                    continue
            entry = entry.next
            continue
        if unknown:
            # Its deadline, and it has not taken effect: it never did. (A choice like any
            # other: undone on backtracking, when taking effect earlier is tried instead.)
            call = entry.match_call
            marked = linearized | (1 << entry.op_id)
            if (marked, state) not in cache:
                cache.add((marked, state))
                result.explored += 1
                stack.append((call, state))
                linearized = marked
                remaining -= 1
                _lift(call)
                entry = head.next
                continue
        # A response (or a deadline already explored) whose operation is not linearized:
        # this prefix cannot go on.
        if len(stack) > stuck_depth:
            stuck_depth = len(stack)
            result.stuck = op
        if not stack:
            return result
        call, state = stack.pop()
        linearized &= ~(1 << call.op_id)
        remaining += ops[call.op_id].ends != float("inf")
        _unlift(call)
        entry = call.next
    result.ok = True
    result.stuck = None
    return result


def partition_by_key(ops: list[Operation]) -> dict[str, list[Operation]]:
    """Split a history into one history per key."""
    histories: dict[str, list[Operation]] = {}
    for op in ops:
        histories.setdefault(op.key, []).append(op)
    return histories
