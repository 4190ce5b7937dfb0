# ruff: noqa: E501
# (The table keeps one row per line, so that a reader sees all of them at once.)
r"""The bad-input table: every bad input to the public API, its typed error, and no change.

Each row of `BAD` is one bad input to `StateManager` (on every backend), a manager, or a
constructor. The test seeds the same state (plain keys, versions, a TTL, an index, a record for
each manager), snapshots what the backend holds (bytes, versions, expiries), makes the call, and
asserts the exact exception class, a fragment of its message a user can act on, that no
password is echoed, and that the snapshot is unchanged. Rows with `raw=` first store corrupt
bytes through the backend API, as a foreign writer or bit rot would.

Rows, by group (ids in brackets):

- keys: empty, non-str, NUL, newline, DEL, C1 control, overlong (ASCII and UTF-8), lone
  surrogate, reserved prefix, in get_many / save_many / a traversal path [key-*]
- patterns: empty, non-str, control, overlong, lone surrogate, for list_keys, watch and
  subscribe [pattern-*]
- values: NaN, +-inf, ints beyond 64 bits, non-str dict keys, cycles, over-deep, oversized,
  sets, objects, functions, complex, Decimal, lone surrogates, in save, save_many and update
  [value-*, update-*]
- versions: wrong expected_version on save and delete (ConflictError with key, expected,
  actual), negative, str, bool, float [version-*]
- TTLs: 0, negative, zero timedelta, str, bool, NaN, inf, too long, on save, save_many, update
  and the backend API [ttl-*]
- other arguments: index scores and members, limits, callbacks, buffers [index-*, watch-*, ...]
- the change feed and history (issue #23): `since=` of the wrong type, empty, malformed, of an
  unknown kind, mangled, another kind's cursor (InvalidArgumentError), another store's cursor
  (CursorExpiredError), on a feed that is off (UnsupportedOperationError; SQLite's cannot be
  off), a bad `on_gap`; history depths 0, -1, "3", True and 2.0 and bad patterns, in
  StateConfig and on the backend; `get`/`get_entry`/`get_version` of versions 0, -1, "1",
  True; `revert` to a version not retained, of a missing key, to 0 or "1"; a negative history
  limit; bad feed retentions [since-*, history-*, version-*, revert-*, feed-*]
- managers: unknown ids (NotFoundError), duplicates (ConflictError), illegal transitions of
  workflows and speech sessions (InvalidTransitionError), bad ids and enum values [wf-*,
  speech-*, team-*, tool-*, kb-*, recovery-*]
- stored bytes: bad header, empty, truncated, reserved msgpack byte, bad JSON, garbage JSON
  tags, unknown extension, bad and truncated zlib, a 64 MB zlib bomb (refused holding at most
  about max_size), a msgpack length bomb, a record that does not validate as its model
  [raw-*]
- configuration: StateConfig options, URLs (unknown scheme, no scheme, bad port, bad IPv6, bad
  options, password in the query), file backend options, the serializer, the managers'
  shorthand, a closed manager [config-*, url-*, ...]

`test_hostile_keys_round_trip` and `test_traversal_keys_stay_inside_the_store` are the other
half: inputs that look hostile but are valid (glob metacharacters, paths) must work, and a
file store never writes outside its directory. `test_any_value_saves_or_raises_typed` fuzzes
values with hypothesis.
"""

from __future__ import annotations

import tracemalloc
import zlib
from datetime import timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agenticstate import (
    EARLIEST,
    AgenticStateError,
    BackendError,
    ConfigurationError,
    ConflictError,
    CursorExpiredError,
    CycleError,
    DecodeError,
    FeedRetention,
    FileBackend,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidNumberError,
    InvalidPatternError,
    InvalidTransitionError,
    MergeError,
    NonStringKeyError,
    NotFoundError,
    RedisBackend,
    SerializationError,
    Serializer,
    StateConfig,
    StateManager,
    StepState,
    TooDeepError,
    TooLargeError,
    UnsupportedOperationError,
    UnsupportedTypeError,
    WorkflowCancelledError,
    WorkflowState,
    WorkflowStateManager,
    open_backend,
)
from agenticstate._keys import escape_glob
from agenticstate.config import redact_url
from agenticstate.serialization import DEFAULT_MAX_SIZE
from agenticstate.txn import (
    Delete,
    Exists,
    IndexAdd,
    IndexIncr,
    IndexRange,
    IndexRemove,
    Put,
    Version,
    _NotTransactError,
)
from tests.helpers import BACKEND_MAKERS, REDIS_BACKENDS, unique_prefix
from tests.reliability._bad_payloads import zlib_bomb
from tests.reliability._bad_rows import (
    Bad,
    Ctx,
    anything,
    backend_changes_since,
    changes_since,
    seed,
    since_feed_off,
    since_mangled,
    since_other_kind,
    since_other_store,
    snapshot,
    sync,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

SECRET = "hunter2"  # noqa: S105  # a fake password: errors must never echo it
NAN, INF = float("nan"), float("inf")


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def _cyclic_dict() -> dict[str, Any]:
    value: dict[str, Any] = {"a": {}}
    value["a"]["self"] = value
    return value


def _cyclic_list() -> list[Any]:
    value: list[Any] = [1]
    value.append([value])
    return value


def _versions(key: str, expected: int, actual: int) -> Callable[[BaseException], None]:
    def check(exc: BaseException) -> None:
        assert isinstance(exc, ConflictError)
        assert (exc.key, exc.expected, exc.actual) == (key, expected, actual)

    return check


def _path(path: str) -> Callable[[BaseException], None]:
    def check(exc: BaseException) -> None:
        assert isinstance(exc, SerializationError)
        assert exc.path == path

    return check


async def _async_fn(value: object) -> object:
    return value


def _callback(key: str, old: object, new: object) -> None:
    """A valid subscriber callback."""


async def _bomb_read(ctx: Ctx) -> object:
    """Read the stored zlib bomb, and check it was refused holding at most ~max_size."""
    tracemalloc.start()
    try:
        return await ctx.state.get("raw:k")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 2 * DEFAULT_MAX_SIZE + 8_000_000, peak


async def _closed_manager(ctx: Ctx) -> object:
    closed = StateManager(backend=ctx.backend, close_backend=False)
    await closed.aclose()
    return await closed.save("seed:a", 3)


async def _watch(ctx: Ctx, pattern: str, max_buffer: int | None = None) -> object:
    async with ctx.state.watch(pattern, max_buffer=max_buffer):
        return None


async def _redis_first_use(ctx: Ctx, url: str) -> object:
    # Construction makes no connection; the URL is parsed on first use.
    async with StateManager(backend=RedisBackend(url=url)) as state:
        return await state.get("k")


async def _view_update(ctx: Ctx, key: str, change: object, **kwargs: Any) -> object:
    async with ctx.state.view("seed:*") as view:
        return await view.update(key, change, **kwargs)  # type: ignore[arg-type]


def _txn(
    *then: Any, compare: tuple[Any, ...] = (), orelse: tuple[Any, ...] = ()
) -> Callable[[Ctx], Any]:
    """A transact row: each starts with a valid write, which must not happen either."""
    return lambda c: c.state.transact(list(compare), [Put("seed:a", 3), *then], list(orelse))


def _redis_url_row(url: str, fragment: str) -> Bad:
    return Bad(lambda c: _redis_first_use(c, url), ConfigurationError, fragment, only="memory")


_MSGPACK_DICT = b"\x01" + msgpack.packb({"name": "x", "items": [1, 2, 3]})
BAD: list[Any] = [
    # ---- keys
    pytest.param(Bad(lambda c: c.state.save("", 1), InvalidKeyError, "must not be empty"), id="key-empty"),
    pytest.param(Bad(lambda c: c.state.save(anything(42), 1), InvalidKeyError, "key must be a str, not int"), id="key-int"),
    pytest.param(Bad(lambda c: c.state.get(anything(b"k")), InvalidKeyError, "not bytes"), id="key-bytes"),
    pytest.param(Bad(lambda c: c.state.delete(anything(None)), InvalidKeyError, "not NoneType"), id="key-none"),
    pytest.param(Bad(lambda c: c.state.save("a\x00b", 1), InvalidKeyError, "control character '\\x00' at position 1"), id="key-nul"),
    pytest.param(Bad(lambda c: c.state.update("a\nb", {"x": 1}), InvalidKeyError, "control character '\\n'"), id="key-newline"),
    pytest.param(Bad(lambda c: c.state.exists("\x7f"), InvalidKeyError, "control character '\\x7f'"), id="key-del"),
    pytest.param(Bad(lambda c: c.state.save("x\x85", 1), InvalidKeyError, "control character '\\x85'"), id="key-c1-control"),
    pytest.param(Bad(lambda c: c.state.save("x" * 1025, 1), InvalidKeyError, "is 1025 bytes in UTF-8; the maximum is 1024"), id="key-overlong"),
    pytest.param(Bad(lambda c: c.state.save("é" * 513, 1), InvalidKeyError, "is 1026 bytes in UTF-8"), id="key-overlong-utf8"),
    pytest.param(Bad(lambda c: c.state.save("a\ud800", 1), InvalidKeyError, "lone surrogate"), id="key-lone-surrogate"),
    pytest.param(Bad(lambda c: c.state.save("__agenticstate:x", 1), InvalidKeyError, "reserved for agenticstate"), id="key-reserved-prefix"),
    pytest.param(Bad(lambda c: c.state.get_many(["seed:a", ""]), InvalidKeyError, "must not be empty"), id="key-in-get-many"),
    pytest.param(Bad(lambda c: c.state.save_many({"new:1": 1, "bad\x00": 2}), InvalidKeyError, "control character"), id="key-in-save-many"),
    pytest.param(Bad(lambda c: c.state.save("../\x00etc/passwd", 1), InvalidKeyError, "control character '\\x00'"), id="key-traversal-nul"),
    pytest.param(Bad(lambda c: c.state.get_entry(anything(1.5)), InvalidKeyError, "not float"), id="key-float-get-entry"),
    # ---- patterns
    pytest.param(Bad(lambda c: c.state.list_keys(""), InvalidPatternError, "pattern must not be empty"), id="pattern-empty"),
    pytest.param(Bad(lambda c: c.state.list_keys(anything(5)), InvalidPatternError, "pattern must be a str, not int"), id="pattern-int"),
    pytest.param(Bad(lambda c: c.state.list_keys("a\x00*"), InvalidPatternError, "control character '\\x00'"), id="pattern-control"),
    pytest.param(Bad(lambda c: c.state.list_keys("*" * 1025), InvalidPatternError, "is 1025 bytes"), id="pattern-overlong"),
    pytest.param(Bad(lambda c: c.state.list_keys("\udfff*"), InvalidPatternError, "lone surrogate"), id="pattern-lone-surrogate"),
    pytest.param(Bad(lambda c: _watch(c, ""), InvalidPatternError, "must not be empty"), id="pattern-watch-empty"),
    pytest.param(Bad(sync(lambda c: c.state.subscribe("a\nb", _callback)), InvalidPatternError, "control character"), id="pattern-subscribe-control"),
    # ---- values
    pytest.param(Bad(lambda c: c.state.save("new", {"x": NAN}), InvalidNumberError, "float nan is not finite at $.x"), id="value-nan"),
    pytest.param(Bad(lambda c: c.state.save("new", [1, INF]), InvalidNumberError, "not finite at $[1]"), id="value-inf"),
    pytest.param(Bad(lambda c: c.state.save("new", {"a": {"b": -INF}}), InvalidNumberError, "at $.a.b"), id="value-negative-inf"),
    pytest.param(Bad(lambda c: c.state.save("new", {"n": 2**64}), InvalidNumberError, "int does not fit in 64 bits at $.n"), id="value-int-2-64"),
    pytest.param(Bad(lambda c: c.state.save("new", [-(2**63) - 1]), InvalidNumberError, "64 bits at $[0]"), id="value-int-below-int64"),
    pytest.param(Bad(lambda c: c.state.save("new", {1: "a"}), NonStringKeyError, "dict key 1 is a int, not a str at $"), id="value-int-dict-key"),
    pytest.param(Bad(lambda c: c.state.save("new", {"a": {("t",): 1}}), NonStringKeyError, "is a tuple", _path("$.a")), id="value-tuple-dict-key"),
    pytest.param(Bad(lambda c: c.state.save("new", _cyclic_dict()), CycleError, "value contains itself at $.a.self"), id="value-cyclic-dict"),
    pytest.param(Bad(lambda c: c.state.save("new", _cyclic_list()), CycleError, "contains itself at $[1][0]"), id="value-cyclic-list"),
    pytest.param(Bad(lambda c: c.state.save("new", _nested(100)), TooDeepError, "nested deeper than 64 levels"), id="value-too-deep"),
    pytest.param(Bad(lambda c: c.state.save("new", "x" * DEFAULT_MAX_SIZE), TooLargeError, f"the maximum is {DEFAULT_MAX_SIZE}"), id="value-too-large"),
    pytest.param(Bad(lambda c: c.state.save("new", {"s": {1, 2}}), UnsupportedTypeError, "cannot store a value of type set at $.s"), id="value-set"),
    pytest.param(Bad(lambda c: c.state.save("new", [object()]), UnsupportedTypeError, "type object at $[0]"), id="value-object"),
    pytest.param(Bad(lambda c: c.state.save("new", {"f": print}), UnsupportedTypeError, "builtin_function_or_method at $.f"), id="value-function"),
    pytest.param(Bad(lambda c: c.state.save("new", 1j), UnsupportedTypeError, "type complex"), id="value-complex"),
    pytest.param(Bad(lambda c: c.state.save("new", {"d": Decimal("1.5")}), UnsupportedTypeError, "type Decimal at $.d"), id="value-decimal"),
    pytest.param(Bad(lambda c: c.state.save("new", {"t": "a\ud800"}), SerializationError, "lone surrogate and is not valid UTF-8 at $.t"), id="value-lone-surrogate"),
    pytest.param(Bad(lambda c: c.state.save("new", {"\udc00": 1}), SerializationError, "dict key '\\udc00' contains a lone surrogate"), id="value-lone-surrogate-key"),
    pytest.param(Bad(lambda c: c.state.save_many({"new:1": 1, "new:2": {1}}), UnsupportedTypeError, "type set"), id="value-in-save-many"),
    pytest.param(Bad(lambda c: c.state.update("seed:a", lambda v: {"x": NAN}), InvalidNumberError, "at $.x"), id="update-fn-returns-nan"),
    pytest.param(Bad(lambda c: c.state.update("seed:a", {"s": {1}}), UnsupportedTypeError, "type set at $.s"), id="update-merge-set"),
    pytest.param(Bad(lambda c: c.state.update("int", {"a": 1}), MergeError, "cannot merge a dict into the int stored at 'int'"), id="update-merge-into-int"),
    pytest.param(Bad(lambda c: c.state.update("seed:a", anything(5)), InvalidArgumentError, "update() takes a dict or a function, not int"), id="update-not-callable"),
    pytest.param(Bad(lambda c: c.state.update("seed:a", _async_fn), InvalidArgumentError, "must be synchronous"), id="update-async-function"),
    pytest.param(Bad(lambda c: c.state.update("missing", {"a": 1}), NotFoundError, "no state at key 'missing'"), id="update-missing-key"),
    # ---- versions
    pytest.param(Bad(lambda c: c.state.save("seed:a", 3, expected_version=1), ConflictError, "key 'seed:a' is at version 2, expected at version 1", _versions("seed:a", 1, 2)), id="version-save-stale"),
    pytest.param(Bad(lambda c: c.state.save("seed:a", 3, expected_version=0), ConflictError, "is at version 2, expected missing", _versions("seed:a", 0, 2)), id="version-save-expected-missing"),
    pytest.param(Bad(lambda c: c.state.save("nope", 3, expected_version=4), ConflictError, "key 'nope' is missing, expected at version 4", _versions("nope", 4, 0)), id="version-save-on-missing"),
    pytest.param(Bad(lambda c: c.state.delete("seed:a", expected_version=5), ConflictError, "expected at version 5", _versions("seed:a", 5, 2)), id="version-delete-stale"),
    pytest.param(Bad(lambda c: c.state.save("seed:a", 3, expected_version=-1), InvalidArgumentError, "expected_version must be an int >= 0 or None, not -1"), id="version-negative"),
    pytest.param(Bad(lambda c: c.state.save("seed:a", 3, expected_version=anything("2")), InvalidArgumentError, "not '2'"), id="version-str"),
    pytest.param(Bad(lambda c: c.state.save("seed:a", 3, expected_version=True), InvalidArgumentError, "not True"), id="version-bool"),
    pytest.param(Bad(lambda c: c.state.delete("seed:a", expected_version=anything(2.0)), InvalidArgumentError, "not 2.0"), id="version-float"),
    # ---- TTLs
    pytest.param(Bad(lambda c: c.state.save("new", 1, ttl=0), InvalidArgumentError, "ttl must be positive"), id="ttl-zero"),
    pytest.param(Bad(lambda c: c.state.save("new", 1, ttl=-5), InvalidArgumentError, "ttl must be positive"), id="ttl-negative"),
    pytest.param(Bad(lambda c: c.state.save("new", 1, ttl=timedelta(0)), InvalidArgumentError, "ttl must be positive, not 0:00:00"), id="ttl-zero-timedelta"),
    pytest.param(Bad(lambda c: c.state.save("new", 1, ttl=anything("5")), InvalidArgumentError, "ttl must be seconds or a timedelta, not str"), id="ttl-str"),
    pytest.param(Bad(lambda c: c.state.save("new", 1, ttl=True), InvalidArgumentError, "not a bool"), id="ttl-bool"),
    pytest.param(Bad(lambda c: c.state.save("new", 1, ttl=NAN), InvalidArgumentError, "ttl must be a finite number of seconds, not nan"), id="ttl-nan"),
    pytest.param(Bad(lambda c: c.state.save("new", 1, ttl=INF), InvalidArgumentError, "finite number of seconds, not inf"), id="ttl-inf"),
    pytest.param(Bad(lambda c: c.state.save("new", 1, ttl=1e20), InvalidArgumentError, "ttl of 1e+20 seconds is too long"), id="ttl-huge-seconds"),
    pytest.param(Bad(lambda c: c.state.save("new", 1, ttl=timedelta.max), InvalidArgumentError, "would expire after the year 9999"), id="ttl-timedelta-max"),
    pytest.param(Bad(lambda c: c.state.update("seed:a", {"n": 3}, ttl=-1), InvalidArgumentError, "ttl must be positive"), id="ttl-update"),
    pytest.param(Bad(lambda c: c.state.save_many({"new": 1}, ttl=0), InvalidArgumentError, "ttl must be positive"), id="ttl-save-many"),
    pytest.param(Bad(lambda c: c.backend.set("new", b"\x011", ttl=anything(5)), InvalidArgumentError, "ttl must be a timedelta or None, not int"), id="ttl-backend-int"),
    pytest.param(Bad(lambda c: c.backend.set("new", b"\x011", ttl=timedelta.max), InvalidArgumentError, "too long", only="memory"), id="ttl-backend-too-long-memory"),
    pytest.param(Bad(lambda c: c.backend.set("new", b"\x011", ttl=timedelta.max), InvalidArgumentError, "too long", only="file"), id="ttl-backend-too-long-file"),
    pytest.param(Bad(lambda c: c.backend.set("new", b"\x011", ttl=timedelta.max), InvalidArgumentError, "too long", only="redis"), id="ttl-backend-too-long-redis"),
    # ---- other arguments
    pytest.param(Bad(lambda c: c.state.index_add("seed:index", {"m3": NAN}), InvalidArgumentError, "index score for 'm3' must be a number"), id="index-nan-score"),
    pytest.param(Bad(lambda c: c.state.index_add("seed:index", {"m3": 10**400}), InvalidArgumentError, "beyond a 64-bit float's range"), id="index-huge-int-score"),
    pytest.param(Bad(lambda c: c.state.index_add("seed:index", {"": 1.0}), InvalidKeyError, "must not be empty"), id="index-empty-member"),
    pytest.param(Bad(lambda c: c.state.index_range("seed:index", limit=-1), InvalidArgumentError, "limit must be an int >= 0 or None, not -1"), id="index-negative-limit"),
    pytest.param(Bad(sync(lambda c: c.state.subscribe("*", anything(5))), InvalidArgumentError, "callback must be callable, not int"), id="subscribe-not-callable"),
    pytest.param(Bad(lambda c: _watch(c, "*", max_buffer=-1), InvalidArgumentError, "max_buffer must be an int >= 1, not -1"), id="watch-negative-buffer"),
    pytest.param(Bad(lambda c: _watch(c, "*", max_buffer=0), InvalidArgumentError, "max_buffer must be an int >= 1, not 0"), id="watch-zero-buffer"),
    pytest.param(Bad(_closed_manager, BackendError, "this StateManager is closed"), id="closed-manager"),
    # ---- transact and LocalView.update (issue #21): validated before anything is written
    pytest.param(Bad(lambda c: c.state.transact(anything(["seed:a"]), [Put("seed:a", 3)]), _NotTransactError, "not a transact compare: 'seed:a'"), id="txn-compare-not-a-compare"),
    pytest.param(Bad(lambda c: c.state.transact(anything("seed:a"), [Put("seed:a", 3)]), _NotTransactError, "compare is a sequence, not str"), id="txn-compare-str"),
    pytest.param(Bad(lambda c: c.state.transact([], anything("seed:a")), _NotTransactError, "then is a sequence, not str"), id="txn-then-str"),
    pytest.param(Bad(lambda c: c.state.transact([], [Put("seed:a", 3)], anything(5)), _NotTransactError, "orelse is a sequence, not int"), id="txn-orelse-int"),
    pytest.param(Bad(_txn(anything("x")), _NotTransactError, "not a transact operation: 'x'"), id="txn-op-not-an-op"),
    pytest.param(Bad(_txn(compare=(Version("seed:a", -1),)), InvalidArgumentError, "Version('seed:a') needs an int >= 0, not -1"), id="txn-version-negative"),
    pytest.param(Bad(_txn(compare=(Version("seed:a", anything(True)),)), InvalidArgumentError, "not True"), id="txn-version-bool"),
    pytest.param(Bad(_txn(compare=(Exists(""),)), InvalidKeyError, "must not be empty"), id="txn-compare-empty-key"),
    pytest.param(Bad(_txn(Put("new", {"s": {1}})), UnsupportedTypeError, "type set at $.s"), id="txn-put-unstorable"),
    pytest.param(Bad(_txn(Put("new", [NAN])), InvalidNumberError, "not finite at $[0]"), id="txn-put-nan"),
    pytest.param(Bad(_txn(Put("new", 1, ttl=-5)), InvalidArgumentError, "ttl must be positive"), id="txn-put-negative-ttl"),
    pytest.param(Bad(_txn(Put("a\x00", 1)), InvalidKeyError, "control character '\\x00'"), id="txn-put-nul-key"),
    pytest.param(Bad(_txn(Delete(anything(5))), InvalidKeyError, "not int"), id="txn-delete-int-key"),
    pytest.param(Bad(_txn(IndexAdd("seed:index", {"m3": NAN})), InvalidArgumentError, "index score for 'm3' must be a number"), id="txn-index-nan-score"),
    pytest.param(Bad(_txn(IndexAdd("seed:index", anything(["m1"]))), InvalidArgumentError, "takes a mapping of member: score"), id="txn-index-add-list"),
    pytest.param(Bad(_txn(IndexRemove("seed:index", anything("m1"))), InvalidArgumentError, "takes a list of members"), id="txn-index-remove-str"),
    pytest.param(Bad(_txn(IndexIncr("seed:index", "m1", INF)), InvalidArgumentError, "must be finite"), id="txn-index-incr-inf"),
    pytest.param(Bad(_txn(IndexIncr("seed:index", "", 1)), InvalidKeyError, "must not be empty"), id="txn-index-incr-empty-member"),
    pytest.param(Bad(_txn(IndexRange("seed:index", -1)), InvalidArgumentError, "limit must be an int >= 0 or None, not -1"), id="txn-range-negative-limit"),
    pytest.param(Bad(_txn(compare=(Version("seed:a", 99),), orelse=(Put("seed:a", 4), Delete(""))), InvalidKeyError, "must not be empty"), id="txn-orelse-bad-key"),
    pytest.param(Bad(_txn(Put("other", 4)), InvalidArgumentError, "must hash to one slot", only="redis-cluster"), id="txn-cluster-two-slots"),
    pytest.param(Bad(lambda c: _view_update(c, "int", {"a": 1}), InvalidArgumentError, "key 'int' is outside the view of 'seed:*'"), id="view-update-outside"),
    pytest.param(Bad(lambda c: _view_update(c, "seed:b", {"a": 1}), MergeError, "cannot merge a dict into the list stored at 'seed:b'"), id="view-update-merge-into-list"),
    pytest.param(Bad(lambda c: _view_update(c, "seed:zz", {"a": 1}), NotFoundError, "no state at key 'seed:zz'"), id="view-update-missing"),
    pytest.param(Bad(lambda c: _view_update(c, "seed:a", lambda v: {"s": {1}}), UnsupportedTypeError, "type set at $.s"), id="view-update-unstorable"),
    pytest.param(Bad(lambda c: _view_update(c, "seed:a", _async_fn), InvalidArgumentError, "must be synchronous"), id="view-update-async-function"),
    pytest.param(Bad(lambda c: _view_update(c, "seed:a", 5), InvalidArgumentError, "update() takes a dict or a function, not int"), id="view-update-not-callable"),
    pytest.param(Bad(lambda c: _view_update(c, "seed:a", {"n": 3}, ttl=-5), InvalidArgumentError, "ttl must be positive"), id="view-update-negative-ttl"),
    pytest.param(Bad(sync(lambda c: c.state.view("seed:*", max_buffer=0)), InvalidArgumentError, "max_buffer must be an int >= 1, not 0"), id="view-zero-buffer"),
    # ---- the change feed and history (issue #23): refused on entry, nothing changed
    pytest.param(Bad(lambda c: changes_since(c, anything(5)), InvalidArgumentError, "since must be a"), id="since-int"),
    pytest.param(Bad(lambda c: changes_since(c, anything(b"m1:x:1")), InvalidArgumentError, "not b'm1:x:1'"), id="since-bytes"),
    pytest.param(Bad(lambda c: changes_since(c, ""), InvalidArgumentError, "not ''"), id="since-empty"),
    pytest.param(Bad(lambda c: changes_since(c, "garbage"), InvalidArgumentError, "'garbage'"), id="since-garbage"),
    pytest.param(Bad(lambda c: changes_since(c, "x9:abc:1"), InvalidArgumentError, "'x9:abc:1'"), id="since-unknown-kind"),
    pytest.param(Bad(lambda c: since_mangled(c, "not-a-number"), InvalidArgumentError, "not-a-number"), id="since-mangled"),
    pytest.param(Bad(lambda c: since_mangled(c, "-1"), InvalidArgumentError, "-1"), id="since-mangled-negative"),
    pytest.param(Bad(since_other_kind, InvalidArgumentError, "cursor"), id="since-other-kind"),
    pytest.param(Bad(since_other_store, CursorExpiredError, "cursor"), id="since-other-store"),
    pytest.param(Bad(lambda c: backend_changes_since(c, anything(b"x1:1")), InvalidArgumentError, "since must be a"), id="since-backend-bytes"),
    pytest.param(Bad(lambda c: backend_changes_since(c, anything(1.5)), InvalidArgumentError, "since must be a"), id="since-backend-float"),
    pytest.param(Bad(lambda c: backend_changes_since(c, "garbage"), InvalidArgumentError, "'garbage'"), id="since-backend-garbage"),
    pytest.param(Bad(lambda c: changes_since(c, EARLIEST, on_gap="bogus"), InvalidArgumentError, "on_gap must be 'raise' or 'resync', not 'bogus'"), id="since-bad-on-gap"),
    pytest.param(Bad(since_feed_off, UnsupportedOperationError, "feed", only="memory"), id="since-feed-off-memory"),
    pytest.param(Bad(since_feed_off, UnsupportedOperationError, "feed", only="file"), id="since-feed-off-file"),
    pytest.param(Bad(since_feed_off, UnsupportedOperationError, "feed", only="redis"), id="since-feed-off-redis"),
    pytest.param(Bad(since_feed_off, ConfigurationError, "feed", only="sqlite"), id="since-feed-off-sqlite"),
    pytest.param(Bad(sync(lambda c: StateConfig(history={"a:*": 0})), ConfigurationError, "history depth for 'a:*' must be an int >= 1, not 0", only="memory"), id="history-config-depth-0"),
    pytest.param(Bad(sync(lambda c: StateConfig(history={"a:*": -1})), ConfigurationError, "not -1", only="memory"), id="history-config-depth-negative"),
    pytest.param(Bad(sync(lambda c: StateConfig(history=anything({"a:*": "3"}))), ConfigurationError, "not '3'", only="memory"), id="history-config-depth-str"),
    pytest.param(Bad(sync(lambda c: StateConfig(history={"a:*": True})), ConfigurationError, "not True", only="memory"), id="history-config-depth-bool"),
    pytest.param(Bad(sync(lambda c: StateConfig(history={"": 2})), ConfigurationError, "pattern must not be empty", only="memory"), id="history-config-empty-pattern"),
    pytest.param(Bad(sync(lambda c: c.backend.keep_history({"a:*": 0})), ConfigurationError, "must be an int >= 1, not 0"), id="history-backend-depth-0"),
    pytest.param(Bad(sync(lambda c: c.backend.keep_history(anything({"a:*": "3"}))), ConfigurationError, "not '3'"), id="history-backend-depth-str"),
    pytest.param(Bad(sync(lambda c: c.backend.keep_history({"a\x00": 2})), InvalidPatternError, "control character"), id="history-backend-bad-pattern"),
    pytest.param(Bad(lambda c: c.state.history("seed:a", limit=-1), InvalidArgumentError, "limit must be an int >= 0 or None, not -1"), id="history-negative-limit"),
    pytest.param(Bad(lambda c: c.state.history("", limit=1), InvalidKeyError, "must not be empty"), id="history-empty-key"),
    pytest.param(Bad(lambda c: c.state.get("seed:a", version=0), InvalidArgumentError, "version must be an int >= 1, not 0"), id="version-get-0"),
    pytest.param(Bad(lambda c: c.state.get("seed:a", version=-1), InvalidArgumentError, "not -1"), id="version-get-negative"),
    pytest.param(Bad(lambda c: c.state.get("seed:a", version=anything("1")), InvalidArgumentError, "not '1'"), id="version-get-str"),
    pytest.param(Bad(lambda c: c.state.get("seed:a", version=True), InvalidArgumentError, "not True"), id="version-get-bool"),
    pytest.param(Bad(lambda c: c.state.get_entry("seed:a", version=0), InvalidArgumentError, "not 0"), id="version-get-entry-0"),
    pytest.param(Bad(lambda c: c.backend.get_version("seed:a", anything(1.0)), InvalidArgumentError, "not 1.0"), id="version-backend-float"),
    pytest.param(Bad(lambda c: c.state.revert("seed:a", to_version=1), NotFoundError, "version 1 of 'seed:a' is not retained"), id="revert-not-retained"),
    pytest.param(Bad(lambda c: c.state.revert("seed:a", to_version=3), NotFoundError, "version 3 of 'seed:a' is not retained"), id="revert-future-version"),
    pytest.param(Bad(lambda c: c.state.revert("nope", to_version=1), NotFoundError, "no state at key 'nope'"), id="revert-missing-key"),
    pytest.param(Bad(lambda c: c.state.revert("seed:a", to_version=0), InvalidArgumentError, "to_version must be an int >= 1, not 0"), id="revert-version-0"),
    pytest.param(Bad(lambda c: c.state.revert("seed:a", to_version=anything("1")), InvalidArgumentError, "not '1'"), id="revert-version-str"),
    pytest.param(Bad(lambda c: c.state.revert("seed:a", to_version=2, ttl=-1), InvalidArgumentError, "ttl must be positive"), id="revert-negative-ttl"),
    pytest.param(Bad(sync(lambda c: FeedRetention(max_changes=0)), ConfigurationError, "max_changes must be an int >= 1 or None, not 0", only="memory"), id="feed-max-changes-0"),
    pytest.param(Bad(sync(lambda c: FeedRetention(max_changes=anything("10"))), ConfigurationError, "not '10'", only="memory"), id="feed-max-changes-str"),
    pytest.param(Bad(sync(lambda c: FeedRetention(max_age=timedelta(0))), ConfigurationError, "max_age must be a positive timedelta or None", only="memory"), id="feed-max-age-zero"),
    pytest.param(Bad(sync(lambda c: FeedRetention(max_age=anything(60))), ConfigurationError, "not 60", only="memory"), id="feed-max-age-seconds"),
    pytest.param(Bad(sync(lambda c: StateConfig(feed=anything(5))), ConfigurationError, "must be a FeedRetention or None, not int", only="memory"), id="feed-config-int"),
    # ---- managers
    pytest.param(Bad(lambda c: c.workflows.start("nope"), NotFoundError, "no workflow 'nope'"), id="wf-unknown-start"),
    pytest.param(Bad(lambda c: c.workflows.get_status("nope"), NotFoundError, "no workflow 'nope'"), id="wf-unknown-status"),
    pytest.param(Bad(lambda c: c.workflows.create(WorkflowState(workflow_id="wf")), ConflictError, "workflow 'wf' exists already"), id="wf-duplicate"),
    pytest.param(Bad(lambda c: c.workflows.complete("wf"), InvalidTransitionError, "workflow 'wf' cannot go from pending to completed"), id="wf-pending-to-completed"),
    pytest.param(Bad(lambda c: c.workflows.resume("wf-running"), InvalidTransitionError, "is running, not paused"), id="wf-resume-running"),
    pytest.param(Bad(lambda c: c.workflows.start("wf-done"), InvalidTransitionError, "cannot go from completed to running"), id="wf-restart-completed"),
    pytest.param(Bad(lambda c: c.workflows.update_step("wf-done", StepState(step_number=1)), InvalidTransitionError, "is completed; no more steps"), id="wf-step-completed"),
    pytest.param(Bad(lambda c: c.workflows.update_step("wf-cancelled", StepState(step_number=1)), WorkflowCancelledError, "workflow 'wf-cancelled' was cancelled: seeded"), id="wf-step-cancelled"),
    pytest.param(Bad(lambda c: c.workflows.resume_from("wf-running", "nope"), NotFoundError, "no checkpoint 'nope' for workflow 'wf-running'"), id="wf-unknown-checkpoint"),
    pytest.param(Bad(lambda c: c.workflows.get("a{b"), InvalidArgumentError, "workflow_id must not contain '{' or '}'"), id="wf-id-brace"),
    pytest.param(Bad(lambda c: c.workflows.start(""), InvalidArgumentError, "workflow_id must be a non-empty str"), id="wf-id-empty"),
    pytest.param(Bad(lambda c: c.speech.update_session_status("nope", "active"), NotFoundError, "no speech session 'nope'"), id="speech-unknown"),
    pytest.param(Bad(lambda c: c.speech.end_session("s-ended"), InvalidTransitionError, "session 's-ended' has ended already"), id="speech-end-twice"),
    pytest.param(Bad(lambda c: c.speech.update_session_status("s-live", "paused"), InvalidTransitionError, "cannot go from initializing to paused"), id="speech-illegal-move"),
    pytest.param(Bad(lambda c: c.speech.update_session_status("s-live", "bogus"), InvalidArgumentError, "'bogus' is not a AudioSessionStatus"), id="speech-bad-status"),
    pytest.param(Bad(lambda c: c.speech.append_turn("s-ended", "user", "hi"), InvalidTransitionError, "session 's-ended' has ended"), id="speech-append-after-end"),
    pytest.param(Bad(lambda c: c.speech.create_session(session_id="s-live"), ConflictError, "expected missing"), id="speech-duplicate"),
    pytest.param(Bad(lambda c: c.teams.get_team("nope"), NotFoundError, "no team 'nope'"), id="team-unknown"),
    pytest.param(Bad(lambda c: c.teams.get_task("t1", "nope"), NotFoundError, "team 't1' has no task 'nope'"), id="team-unknown-task"),
    pytest.param(Bad(lambda c: c.teams.get_agent("t1", "nope"), NotFoundError, "team 't1' has no agent 'nope'"), id="team-unknown-agent"),
    pytest.param(Bad(lambda c: c.tools.complete_execution("nope"), NotFoundError, "no execution 'nope'"), id="tool-unknown-execution"),
    pytest.param(Bad(lambda c: c.knowledge.increment_progress("nope", processed=1), NotFoundError, "no indexing progress for 'nope'"), id="kb-unknown"),
    pytest.param(Bad(lambda c: c.knowledge.increment_progress("kb", processed=-1), InvalidArgumentError, "processed must be an int >= 0, not -1"), id="kb-negative-count"),
    pytest.param(Bad(lambda c: c.recovery.recover("nope"), NotFoundError, "agent 'nope' is not registered for recovery"), id="recovery-unregistered"),
    # ---- stored bytes (written raw through the backend API, read through the public API)
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "unknown payload header 0x07", raw=("raw:k", b"\x07junk")), id="raw-bad-header"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "empty payload", raw=("raw:k", b"")), id="raw-empty"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "stored value is corrupt", raw=("raw:k", _MSGPACK_DICT[:-3])), id="raw-truncated"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "stored value is corrupt", raw=("raw:k", b"\x01\xc1")), id="raw-msgpack-reserved-byte"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "stored value is corrupt", raw=("raw:k", b"\x02{not json")), id="raw-bad-json"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "stored value is corrupt: ValueError", raw=("raw:k", b'\x02{"$dt": "garbage"}')), id="raw-json-datetime-tag-garbage"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "stored value is corrupt", raw=("raw:k", b'\x02[{"$uuid": "nope"}]')), id="raw-json-uuid-tag-garbage"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "unknown msgpack extension type 99", raw=("raw:k", b"\x01" + msgpack.packb(msgpack.ExtType(99, b"x")))), id="raw-unknown-extension"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "not valid zlib data", raw=("raw:k", b"\x81garbage")), id="raw-bad-zlib"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "stored value is truncated", raw=("raw:k", b"\x81" + zlib.compress(_MSGPACK_DICT[1:])[:-6])), id="raw-truncated-zlib"),
    pytest.param(Bad(_bomb_read, DecodeError, f"inflates beyond the maximum size of {DEFAULT_MAX_SIZE}", raw=("raw:k", zlib_bomb(64 * 1024 * 1024))), id="raw-zlib-bomb"),
    pytest.param(Bad(lambda c: c.state.get("raw:k"), DecodeError, "stored value is corrupt", raw=("raw:k", b"\x01\xdd\xff\xff\xff\xff")), id="raw-msgpack-length-bomb"),
    pytest.param(Bad(lambda c: c.state.get_entry("raw:k"), DecodeError, "corrupt", raw=("raw:k", b"\x01\xc1")), id="raw-get-entry"),
    pytest.param(Bad(lambda c: c.state.get_many(["seed:a", "raw:k"]), DecodeError, "corrupt", raw=("raw:k", b"\x01\xc1")), id="raw-get-many"),
    pytest.param(Bad(lambda c: c.state.update("raw:k", lambda v: v), DecodeError, "corrupt", raw=("raw:k", b"\x01\xc1")), id="raw-update"),
    pytest.param(Bad(lambda c: c.workflows.get("raw"), DecodeError, "stored value does not validate as WorkflowState", raw=("workflows:{raw}:state", b"\x01" + msgpack.packb({"workflow_id": 5}))), id="raw-record-fails-its-model"),
    # ---- configuration, URLs, constructors (they touch no store: memory only)
    pytest.param(Bad(sync(lambda c: StateConfig(backend=anything("mongodb"))), ConfigurationError, "invalid StateConfig: backend", only="memory"), id="config-backend"),
    pytest.param(Bad(sync(lambda c: StateConfig(ttl=-1)), ConfigurationError, "ttl must be positive", only="memory"), id="config-ttl-negative"),
    pytest.param(Bad(sync(lambda c: StateConfig(ttl=INF)), ConfigurationError, "ttl must be a finite number of seconds", only="memory"), id="config-ttl-inf"),
    pytest.param(Bad(sync(lambda c: StateConfig(ttl=10**30)), ConfigurationError, "is too long", only="memory"), id="config-ttl-huge"),
    pytest.param(Bad(sync(lambda c: StateConfig(**anything({"unknown_option": 1}))), ConfigurationError, "unknown_option", only="memory"), id="config-unknown-option"),
    pytest.param(Bad(sync(lambda c: StateConfig(max_depth=1000)), ConfigurationError, "max_depth", only="memory"), id="config-max-depth"),
    pytest.param(Bad(sync(lambda c: StateConfig(redis_url=f"redis://u:{SECRET}@h/0", ttl=anything("x"))), ConfigurationError, "ttl", only="memory"), id="config-error-hides-password"),
    pytest.param(Bad(sync(lambda c: StateManager(config=anything({"backend": "memory"}))), ConfigurationError, "config must be a StateConfig, not dict", only="memory"), id="config-not-a-config"),
    pytest.param(Bad(sync(lambda c: open_backend("ftp://x")), ConfigurationError, "unknown backend scheme 'ftp'", only="memory"), id="url-unknown-scheme"),
    pytest.param(Bad(sync(lambda c: open_backend("localhost:6379")), ConfigurationError, "must look like scheme://", only="memory"), id="url-no-scheme"),
    pytest.param(Bad(sync(lambda c: open_backend(f"redis://u:{SECRET}@[::1/0")), ConfigurationError, "URL", only="memory"), id="url-bad-ipv6"),
    pytest.param(_redis_url_row(f"redis://u:{SECRET}@127.0.0.1:abc/0", "invalid Redis URL 'redis://u:***@127.0.0.1:abc/0'"), id="url-bad-port"),
    pytest.param(_redis_url_row(f"redis://u:{SECRET}@127.0.0.1:99999/0", "Port out of range"), id="url-port-out-of-range"),
    pytest.param(_redis_url_row(f"redis://u:{SECRET}@127.0.0.1:6379/0?socket_timeout=abc", "'socket_timeout' must be a number of seconds"), id="url-bad-option"),
    pytest.param(_redis_url_row(f"redis://127.0.0.1:6379/0?password={SECRET}&socket_timeout=x", "'socket_timeout' must be a number"), id="url-password-in-query"),
    pytest.param(Bad(sync(lambda c: RedisBackend(url="localhost")), ConfigurationError, "url must look like redis://host:port/db", only="memory"), id="url-redis-no-scheme"),
    pytest.param(Bad(sync(lambda c: RedisBackend(url=f"redis://u:a/{SECRET}@127.0.0.1:6379/0")), ConfigurationError, "percent-encode", only="memory"), id="url-slash-in-password"),
    pytest.param(Bad(sync(lambda c: open_backend("redis://127.0.0.1:6379/0?subscribe_whole_prefix=maybe")), ConfigurationError, "subscribe_whole_prefix must be 1 or 0", only="memory"), id="url-bad-subscribe-whole-prefix"),
    pytest.param(Bad(sync(lambda c: open_backend(f"redis://u:a?{SECRET}@127.0.0.1:6379/0")), ConfigurationError, "query item without '='", only="memory"), id="url-question-mark-in-password"),
    pytest.param(Bad(sync(lambda c: open_backend(f"redis+cluster://u:a#{SECRET}@127.0.0.1:7000")), ConfigurationError, "cannot have a fragment", only="memory"), id="url-hash-in-cluster-password"),
    pytest.param(Bad(sync(lambda c: FileBackend(c.tmp_path / "x", format=anything("xml"))), ConfigurationError, "format must be 'json' or 'msgpack', not 'xml'", only="memory"), id="file-format"),
    pytest.param(Bad(sync(lambda c: FileBackend(c.tmp_path, file_name="../x")), ConfigurationError, "file_name must be a plain file name", only="memory"), id="file-name-traversal"),
    pytest.param(Bad(sync(lambda c: FileBackend(c.tmp_path, durability=anything("maybe"))), ConfigurationError, "durability must be 'fsync' or 'none'", only="memory"), id="file-durability"),
    pytest.param(Bad(sync(lambda c: Serializer(anything("xml"))), InvalidArgumentError, "format must be 'msgpack' or 'json', not 'xml'", only="memory"), id="serializer-format"),
    pytest.param(Bad(sync(lambda c: WorkflowStateManager(persistence=anything("mongodb"))), ConfigurationError, "persistence must be one of 'file', 'memory', 'postgres', 'redis', 'sqlite', not 'mongodb'", only="memory"), id="manager-persistence"),
    pytest.param(Bad(sync(lambda c: WorkflowStateManager(state_manager=c.state, persistence="memory")), ConfigurationError, "not both", only="memory"), id="manager-both-sources"),
    pytest.param(Bad(sync(lambda c: WorkflowStateManager(state_manager=c.state, checkpoint_interval=-1)), InvalidArgumentError, "checkpoint_interval must be an int >= 0", only="memory"), id="manager-bad-option"),
]  # fmt: skip


# Rows a backend fails today, each a bug reported to its owner: strict, so a fix shows up here.
KNOWN: dict[tuple[str | None, str], str] = {}


def _table() -> list[Any]:
    """Each row on each backend it applies to (Redis rows marked `redis`)."""
    params = []
    for param in BAD:
        row: Bad = param.values[0]
        for kind in BACKEND_MAKERS:
            if row.only is not None and kind != row.only:
                continue
            marks = [*param.marks, *([pytest.mark.redis] if kind in REDIS_BACKENDS else [])]
            if (param.id, kind) in KNOWN:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[param.id, kind]))
            params.append(pytest.param(row, kind, id=f"{param.id}-{kind}", marks=marks))
    return params


@pytest.mark.parametrize(("row", "kind"), _table())
async def test_bad_input_is_refused_and_changes_nothing(
    request: pytest.FixtureRequest, tmp_path: Path, row: Bad, kind: str
) -> None:
    """The exact error, a message naming the problem (never a password), and no change."""
    async with (
        BACKEND_MAKERS[kind](request, tmp_path) as backend,
        StateManager(backend=backend, close_backend=False) as state,
    ):
        ctx = Ctx(kind, backend, state, tmp_path, request)
        await seed(ctx)
        if row.raw is not None:
            await backend.set(*row.raw)
        before = await snapshot(backend)
        with pytest.raises(AgenticStateError) as caught:
            await row.call(ctx)
        assert type(caught.value) is row.error, repr(caught.value)
        assert row.fragment in str(caught.value)
        assert SECRET not in str(caught.value)
        assert SECRET not in repr(caught.value)
        if row.check is not None:
            row.check(caught.value)
        assert await snapshot(backend) == before
        assert await state.get("seed:a") == {"n": 2}


@pytest.mark.redis
async def test_redis_key_written_with_the_longest_ttl_stays_readable(redis_url: str) -> None:
    """A key the Redis backend accepted with timedelta.max reads back (or was refused)."""
    async with RedisBackend(url=redis_url, key_prefix=unique_prefix()) as backend:
        try:
            await backend.set("k", b"\x011", ttl=timedelta.max)
        except InvalidArgumentError:
            return
        entry = await backend.get("k")
        assert entry is not None
        assert entry.value == b"\x011"


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        (f"redis://u:{SECRET}@h:6379/0", "redis://u:***@h:6379/0"),
        (f"redis://u:{SECRET}@h:abc/0", "redis://u:***@h:abc/0"),
        (f"redis://u:{SECRET}@[::1]:6379/0", "redis://u:***@[::1]:6379/0"),
        (f"redis://h:6379/0?db=1&password={SECRET}", "redis://h:6379/0?db=1&password=***"),
        (f"unix:///tmp/r.sock?PASSWORD={SECRET}#x", "unix:///tmp/r.sock?PASSWORD=***#***"),
        (f"redis://u:{SECRET}@[::1/0", "<invalid url>"),
        ("redis://h:6379/0?db=1", "redis://h:6379/0?db=1"),
        # Delimiters in the password: everything up to the last `@` is hidden.
        (f"redis://u:a/{SECRET}@h:6379/0", "redis://u:***@h:6379/0"),
        (f"redis://u:a?{SECRET}@h:6379/0", "redis://u:***@h:6379/0"),
        (f"redis://u:a#{SECRET}@h:6379/0", "redis://u:***@h:6379/0"),
        (f"redis://u:a@{SECRET}@h:6379/0", "redis://u:***@h:6379/0"),
        (f"rediss+cluster://u:/{SECRET}@a:1,b:2", "rediss+cluster://u:***@a:1,b:2"),
        (f"redis://{SECRET}@h", "redis://***@h"),  # user info without `:`: all of it
        # A parameter name spelled another way is still not a shown setting.
        (f"redis://h/0?pass%77ord={SECRET}&db=2", "redis://h/0?pass%77ord=***&db=2"),
        (f"redis://h/0?db=1;password={SECRET}", "redis://h/0?db=***"),  # not a setting's value
        (f"redis://h/0?{SECRET} x=1", "redis://h/0?***=***"),
        # No authority to parse: nothing is echoed.
        (f"redis://:{SECRET}/x", "<invalid url>"),
        (f"{SECRET}@h", "<invalid url>"),
        (f"sqlite://./s.db?password={SECRET}", "sqlite://./s.db?password=***"),
        (
            f"postgresql://u:{SECRET}@db.internal:5432/app",
            "postgresql://u:***@db.internal:5432/app",
        ),
        ("unix:///tmp/a@b.sock?db=2", "unix:///tmp/a@b.sock?db=2"),
    ],
)
def test_redact_url_hides_every_password(url: str, redacted: str) -> None:
    """Passwords in user info or query are redacted, bad port or not; unparsable URLs hidden."""
    assert redact_url(url) == redacted


def test_serializer_refuses_values_too_deep_for_the_interpreter() -> None:
    """With max_depth beyond the recursion limit, a too-deep value is TooDeepError, not crash."""
    serializer = Serializer(max_depth=100_000)
    with pytest.raises(TooDeepError, match="nested too deeply"):
        serializer.dumps(_nested(5000))
    assert serializer.loads(serializer.dumps({"after": [1]})) == {"after": [1]}


# The other half: inputs that look hostile but are valid.

META_KEYS = [
    "a*b",
    "a?b",
    "[x]",
    "[^x]",
    "[a-z]",
    "^caret",
    "back\\slash",
    "tail\\",
    "]",
    "[",
    "*",
    "?",
    "\\",
    "-",
    "{brace}",
    "é*中?😀",
    "x" * 1024,
]
HAND_ESCAPED = {"a*b": r"a\*b", "[x]": r"\[x\]", "tail\\": "tail\\\\", "*": r"\*"}


@pytest.mark.parametrize("key", META_KEYS, ids=[ascii(key)[:20] for key in META_KEYS])
async def test_hostile_keys_round_trip(state: StateManager, key: str) -> None:
    """Metacharacter keys round-trip and their escaped pattern lists exactly them, no decoys."""
    decoys = ["ab", "a-b", "x", "a", "tail", "b", "^", "é"]
    await state.save_many({**dict.fromkeys(decoys, 0), key: {"key": key}})
    assert await state.get(key) == {"key": key}
    assert await state.list_keys(escape_glob(key)) == [key]
    if key in HAND_ESCAPED:
        assert await state.list_keys(HAND_ESCAPED[key]) == [key]
    assert key in await state.list_keys("*")
    assert await state.delete(key)
    assert await state.list_keys(escape_glob(key)) == []


TRAVERSAL_KEYS = [
    "../../etc/passwd",
    "/abs/path",
    "..",
    ".",
    "a/../../b",
    "~/x",
    "..\\..\\windows",
    "%2e%2e%2fx",
    "state.json",
    "state.json.log",
    "state.json.lock",
    "state.json.1.tmp",
]


@pytest.mark.parametrize("key", TRAVERSAL_KEYS)
async def test_traversal_keys_stay_inside_the_store(tmp_path: Path, key: str) -> None:
    """Path-like keys (and the store's own file names) live in the store's files, nowhere else."""
    store = tmp_path / "deep" / "store"
    async with StateManager(backend=FileBackend(base_path=store)) as state:
        await state.save(key, {"v": 1})
        await state.flush()
        assert await state.list_keys(escape_glob(key)) == [key]
    async with StateManager(backend=FileBackend(base_path=store)) as state:
        assert await state.get(key) == {"v": 1}
    paths = tmp_path.rglob("*")  # noqa: ASYNC240  # the store is closed: nothing else runs
    found = sorted(str(path.relative_to(tmp_path)) for path in paths)
    assert found == [
        "deep",
        "deep/store",
        "deep/store/state.json",
        "deep/store/state.json.lock",
        "deep/store/state.json.log",
    ]
    assert (store / "state.json.log").stat().st_size == 0  # all in the snapshot


# Values, fuzzed: anything either saves (and reads back) or raises a SerializationError.

_ODD_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text()
    | st.binary(max_size=8)
    | st.decimals(allow_nan=False)
    | st.complex_numbers()
    | st.sampled_from([object(), print, ..., "\ud800", "a\udfffb"])
    | st.frozensets(st.integers(), max_size=2)
)
_ODD_VALUES = st.recursive(
    _ODD_SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=3) | st.integers() | st.none(), children, max_size=3)
        | st.sets(st.integers(), max_size=2)
    ),
    max_leaves=12,
)


@settings(max_examples=1000, deadline=None)
@given(value=_ODD_VALUES, fmt=st.sampled_from(["msgpack", "json"]))
def test_any_value_saves_or_raises_typed(value: object, fmt: Any) -> None:
    """Any value encodes and reads back, or raises a SerializationError naming a path; no other."""
    serializer = Serializer(fmt)
    try:
        raw = serializer.dumps(value)
    except SerializationError as exc:
        refused: SerializationError | None = exc
    else:
        refused = None
        assert serializer.loads(raw) == _as_stored(value)
    assert refused is None or refused.path.startswith("$")


def _as_stored(value: object) -> object:
    """What a stored value reads back as: tuples become lists."""
    if isinstance(value, dict):
        return {key: _as_stored(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_stored(item) for item in value]
    return value
