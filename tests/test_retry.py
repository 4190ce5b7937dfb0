"""Every wait between retries is bounded, for any count of attempts.

`agenticstate._retry` is the one place a wait grows exponentially; the property tests run it
over attempt counts up to a million (an SQLite writer retrying `BEGIN IMMEDIATE` every ~2 ms
for 30 s makes about 15,000 tries; a reconnect loop during a day of outage, tens of
thousands). The source walk finds any other power with a variable exponent in the package, so
a new backoff written by hand (`0.05 * 2**failures`, which overflows a float after about 1,030
failures) fails here instead of in production.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from agenticstate._retry import backoff, retry_delay
from agenticstate.backends.base import backoff as reexported_backoff
from agenticstate.managers.tools import RetryState, ToolStateManager

PACKAGE = Path(__file__).resolve().parent.parent / "agenticstate"
ATTEMPTS = st.integers(min_value=0, max_value=10**6)
SECONDS = st.floats(min_value=1e-9, max_value=1e6, allow_nan=False, allow_infinity=False)
FACTORS = st.floats(min_value=1.0, max_value=1e6, allow_nan=False, allow_infinity=False)
# The one function a power with a growing exponent may live in.
ALLOWED_HOME = (PACKAGE / "_retry.py", "retry_delay")


@settings(max_examples=500)
@given(attempt=ATTEMPTS, base=SECONDS, cap=SECONDS, factor=FACTORS)
def test_retry_delay_is_bounded_and_grows_for_any_attempt(
    attempt: int, base: float, cap: float, factor: float
) -> None:
    """retry_delay is finite, in [min(base, cap), cap] and never shrinks as attempts grow."""
    delay = retry_delay(attempt, base=base, cap=cap, factor=factor)
    assert math.isfinite(delay)
    assert min(base, cap) * (1 - 1e-9) <= delay <= cap
    assert retry_delay(attempt + 1, base=base, cap=cap, factor=factor) >= delay * (1 - 1e-9)


@settings(max_examples=300)
@given(attempt=ATTEMPTS, base=SECONDS, cap=SECONDS)
def test_backoff_is_bounded_for_any_attempt(attempt: int, base: float, cap: float) -> None:
    """backoff (full jitter) stays in [0, cap] for any attempt count, never OverflowError."""
    assert 0 <= backoff(attempt, base=base, cap=cap) <= cap
    assert 0 <= reexported_backoff(attempt) <= 0.05


def test_the_sqlite_lock_wait_and_the_reconnect_loops_survive_a_million_tries() -> None:
    """The backoffs the backends and pumps call, at the counts a long outage reaches."""
    for attempt in (1029, 1030, 1100, 10**4, 10**6):
        assert 0 <= backoff(attempt, base=0.0002, cap=0.004) <= 0.004  # SQLite's _begin
        assert 0 <= backoff(attempt) <= 0.05  # pub/sub reconnects, update loops
        assert retry_delay(attempt, base=0.05, cap=5.0) == 5.0  # Watch pumps, LocalView
        assert retry_delay(attempt, base=0.05, cap=2.0) == 2.0  # Redis read retries


def test_exact_schedule_for_small_attempts() -> None:
    """Small attempt counts give the exact doubling schedule (1, 2, 4, ... capped)."""
    assert [retry_delay(n, base=1.0, cap=20.0) for n in range(7)] == [1, 2, 4, 8, 16, 20, 20]
    assert retry_delay(3, base=0.5, cap=100.0, factor=3.0) == 13.5
    assert retry_delay(-1, base=0.5, cap=100.0) == 0.5
    assert retry_delay(5, base=0.0, cap=1.0) == 0.0
    assert retry_delay(10**6, base=1.0, cap=math.inf) == 1.7976931348623157e308


@settings(max_examples=200)
@given(
    attempts=st.integers(min_value=0, max_value=10**6),
    factor=FACTORS,
    base=st.floats(min_value=0, max_value=1e4),
    cap=st.floats(min_value=0, max_value=1e6),
)
def test_a_tool_retry_schedule_is_bounded_for_any_attempt(
    attempts: int, factor: float, base: float, cap: float
) -> None:
    """ToolStateManager.next_delay never overflows, whatever the stored attempts and factor."""
    retry = RetryState(
        execution_id="e",
        attempts=attempts,
        max_attempts=attempts + 1,
        backoff_factor=factor,
        base_delay=base,
        max_delay=cap,
        tool_name="t",
    )
    delay = ToolStateManager.next_delay(retry, jitter=False)
    assert math.isfinite(delay)
    assert 0 <= delay <= cap


def _is_bounded_exponent(node: ast.expr) -> bool:
    """`min(x, <constant>)`: an exponent that stops growing by itself."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "min"
        and any(isinstance(arg, ast.Constant) for arg in node.args)
    )


def _grows(node: ast.AST) -> bool:
    """A power whose exponent may grow without bound, spelled any way."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return not (isinstance(node.right, ast.Constant) or _is_bounded_exponent(node.right))
    if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Pow, ast.Mult)):
        # `delay *= 2` in a loop is a power by another name; a page size doubling is not a
        # wait, so only names that read as a delay count.
        target = ast.unparse(node.target)
        return any(word in target for word in ("delay", "wait", "backoff", "sleep"))
    if isinstance(node, ast.Call) and len(node.args) > 1:
        return ast.unparse(node.func).rpartition(".")[2] in ("pow", "ldexp")
    return False


def _unbounded_powers(path: Path, source: str) -> list[str]:
    tree = ast.parse(source)
    home: set[int] = set()
    if path == ALLOWED_HOME[0]:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == ALLOWED_HOME[1]:
                home.update(id(inner) for inner in ast.walk(node))
    return [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.expr, ast.stmt)) and id(node) not in home and _grows(node)
    ]


def test_no_power_with_a_growing_exponent_outside_retry_delay() -> None:
    """Every exponential wait in the package goes through retry_delay (or caps its exponent)."""
    found = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in _unbounded_powers(path, path.read_text(encoding="utf-8"))
    ]
    assert found == [], "use agenticstate._retry.retry_delay:\n" + "\n".join(found)


def test_the_source_walk_finds_each_spelling_of_a_growing_wait() -> None:
    """The walk above flags `2**n`, `factor ** (n - 1)`, `pow(2, n)` and `delay *= 2`, and
    passes constants and `min(n, 6)`."""
    sample = (
        "a = 0.05 * 2**failures\n"
        "b = base * factor ** (n - 1)\n"
        "c = pow(2, n)\n"
        "delay *= 2\n"
        "d = 2**53\n"
        "e = 2 ** min(n, 6)\n"
        "page *= 2\n"
    )
    found = _unbounded_powers(PACKAGE / "sample.py", sample)
    assert sorted(line.split(": ", 1)[1] for line in found) == [
        "2 ** failures",
        "delay *= 2",
        "factor ** (n - 1)",
        "pow(2, n)",
    ]
