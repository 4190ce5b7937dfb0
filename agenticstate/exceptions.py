"""The exceptions agenticstate raises.

Every error derives from `AgenticStateError`; where one resembles a builtin, the builtin is its
second base, so `except ValueError` keeps working for code that does not know agenticstate.

```
AgenticStateError
 ├─ ConfigurationError(ValueError)        bad URL, unknown scheme, invalid option
 ├─ InvalidArgumentError(ValueError)      a bad argument to a call: ttl, version, limit
 │   ├─ InvalidKeyError                   empty, non-str, control characters, too long
 │   ├─ InvalidPatternError               the same rules, for glob patterns
 │   └─ MergeError(TypeError)             update() with a dict on a value that is not a dict
 ├─ MissingDependencyError(ImportError)   optional extra not installed
 ├─ BackendError                          the storage layer failed
 │   ├─ BackendUnavailableError           cannot connect, connection lost
 │   ├─ BackendTimeoutError(TimeoutError)
 │   ├─ WriteOutcomeUnknownError          the write may or may not have been applied
 │   ├─ CorruptStoreError                 the store's files are damaged: repair or restore
 │   ├─ ForeignRecordError                a key under the prefix holds another application's data
 │   └─ UnsupportedOperationError(NotImplementedError)  an optional operation (transact) is missing
 ├─ SerializationError                    a value cannot be encoded, or stored bytes decoded
 │   ├─ UnsupportedTypeError(TypeError)   sets, arbitrary objects, functions, ...
 │   ├─ NonStringKeyError(TypeError)      a dict key that is not a str
 │   ├─ InvalidNumberError(ValueError)    NaN, infinities, integers beyond 64 bits
 │   ├─ CycleError(ValueError)            a container that contains itself
 │   ├─ TooDeepError(ValueError)          nesting beyond the configured depth
 │   ├─ TooLargeError(ValueError)         encoded value beyond the configured size
 │   └─ DecodeError                       stored bytes are corrupt, truncated or invalid
 │       └─ DecryptionError               an encrypted value failed authentication
 ├─ NotFoundError(LookupError)            the key/agent/workflow/task/session/store does not exist
 ├─ ConflictError                         version mismatch, duplicate id, lost a claim
 ├─ InvalidTransitionError                a state machine refused the move
 │   └─ WorkflowCancelledError            the workflow was cancelled; its runner stops
 ├─ RetryExhaustedError                   a task or tool call gave up
 ├─ SubscriptionClosedError               the subscription was closed or overflowed
 └─ CursorExpiredError(LookupError)       the changes after a feed cursor were trimmed
```
"""

from __future__ import annotations

__all__ = [
    "AgenticStateError",
    "BackendError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "ConfigurationError",
    "ConflictError",
    "CorruptStoreError",
    "CursorExpiredError",
    "CycleError",
    "DecodeError",
    "DecryptionError",
    "ForeignRecordError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidNumberError",
    "InvalidPatternError",
    "InvalidTransitionError",
    "MergeError",
    "MissingDependencyError",
    "NonStringKeyError",
    "NotFoundError",
    "RetryExhaustedError",
    "SerializationError",
    "SubscriptionClosedError",
    "TooDeepError",
    "TooLargeError",
    "UnsupportedOperationError",
    "UnsupportedTypeError",
    "WorkflowCancelledError",
    "WriteOutcomeUnknownError",
]


class AgenticStateError(Exception):
    """The root of every error agenticstate raises."""


class ConfigurationError(AgenticStateError, ValueError):
    """A configuration value, URL or backend option is invalid."""


class InvalidArgumentError(AgenticStateError, ValueError):
    """An argument to a call is invalid; nothing was changed."""


class InvalidKeyError(InvalidArgumentError):
    """A state key is empty, not a str, too long or contains control characters."""


class InvalidPatternError(InvalidArgumentError):
    """A glob pattern is empty, not a str, too long or contains control characters."""


class MergeError(InvalidArgumentError, TypeError):
    """`update(key, partial_dict)` was asked to merge into a value that is not a dict."""


class MissingDependencyError(AgenticStateError, ImportError):
    """An optional dependency is not installed.

    The message names the extra to install, for example `pip install "agenticstate[redis]"`.
    """

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f'{package!r} is not installed; install it with: pip install "agenticstate[{extra}]"'
        )
        self.package = package
        self.extra = extra


class BackendError(AgenticStateError):
    """The storage layer failed."""


class BackendUnavailableError(BackendError):
    """The backend cannot be reached, or the connection to it was lost."""


class BackendTimeoutError(BackendError, TimeoutError):
    """The backend did not answer in time."""


class WriteOutcomeUnknownError(BackendError):
    """A write was sent but its outcome is unknown (the connection failed before the reply).

    The write may or may not have been applied. It is never retried blindly: read the key (and its
    version) to find out.
    """

    def __init__(self, key: str, message: str = "") -> None:
        super().__init__(message or f"the outcome of the write to {key!r} is unknown")
        self.key = key


class CorruptStoreError(BackendError):
    """The store's files are damaged (bit rot, a hand edit, a partial copy): it is not opened.

    Not a passing failure: retrying gives the same answer. The message says where the damage is
    and what to do (for a file store, `FileBackend.repair`, or `agenticstate repair`).
    """


class ForeignRecordError(BackendError):
    """A key under the store's prefix holds something agenticstate did not write.

    On a Redis shared with other applications, a key of theirs under the same prefix (or any
    key, under the empty prefix): a list, a hash, a string without a record's header. Reading
    it raises this; listings that read headers only (`Backend.stat_many`, `value_sizes`) give
    it as `None`, as a missing key, so one foreign key does not hide the others.
    """

    def __init__(self, key: str, message: str = "") -> None:
        super().__init__(message or f"the record at {key!r} is not an agenticstate record")
        self.key = key


class UnsupportedOperationError(BackendError, NotImplementedError):
    """This backend does not implement an optional operation (`Backend.transact`).

    Callers that can do without it catch it and fall back to the operations every backend has.
    """


class SerializationError(AgenticStateError):
    """A value cannot be encoded, or stored bytes cannot be decoded.

    Attributes:
        path: Where in the value the problem is, as a JSONPath-like string (`$.a[2]`).
    """

    def __init__(self, message: str, *, path: str = "$") -> None:
        super().__init__(f"{message} at {path}" if path else message)
        self.path = path


class UnsupportedTypeError(SerializationError, TypeError):
    """The value holds an object of a type agenticstate does not store (a set, a function, ...)."""


class NonStringKeyError(SerializationError, TypeError):
    """A dict in the value has a key that is not a str."""


class InvalidNumberError(SerializationError, ValueError):
    """A float is NaN or infinite, or an int does not fit in 64 bits."""


class CycleError(SerializationError, ValueError):
    """A container in the value contains itself."""


class TooDeepError(SerializationError, ValueError):
    """The value is nested deeper than the configured maximum depth."""


class TooLargeError(SerializationError, ValueError):
    """The encoded value is larger than the configured maximum size."""


class DecodeError(SerializationError):
    """Stored bytes are corrupt, truncated, oversized when decompressed, or fail validation."""


class DecryptionError(DecodeError):
    """An encrypted value failed authentication, names an unknown key, or was stored in plain.

    Raised instead of returning a value that was altered, moved from another key or namespace,
    or encrypted with a key the keyring does not hold (see `agenticstate.Encryption`).
    """


class NotFoundError(AgenticStateError, LookupError):
    """The key, agent, workflow, task, session or store does not exist.

    A store: one opened without creating it (`SQLiteBackend(path, create=False)`).
    """


class ConflictError(AgenticStateError):
    """A write lost a race: version mismatch, duplicate id, or a claim taken by someone else.

    Attributes:
        key: The key the conflict is about, where there is one.
        expected: The version the caller expected, where there is one.
        actual: The version found (0 when the key does not exist), where known.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        expected: int | None = None,
        actual: int | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.actual = actual


class InvalidTransitionError(AgenticStateError):
    """A state machine refused a move; nothing was changed."""


class WorkflowCancelledError(InvalidTransitionError):
    """The workflow was cancelled: its runner gets this at the next step boundary.

    Attributes:
        workflow_id: The workflow.
        reason: The reason given to `cancel()`, if any.
    """

    def __init__(self, workflow_id: str, reason: str | None = None) -> None:
        detail = f": {reason}" if reason else ""
        super().__init__(f"workflow {workflow_id!r} was cancelled{detail}")
        self.workflow_id = workflow_id
        self.reason = reason


class RetryExhaustedError(AgenticStateError):
    """A task, tool call or atomic update gave up after its last attempt."""


class SubscriptionClosedError(AgenticStateError):
    """The subscription was closed, or it fell behind and overflowed its buffer.

    Attributes:
        reason: `"overflow"` when the subscriber fell behind (re-read the state you need and
            subscribe again), `"closed"` when it was closed.
    """

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or f"subscription {reason}")
        self.reason = reason


class CursorExpiredError(AgenticStateError, LookupError):
    """The changes after a feed cursor are no longer retained: resuming from it would skip some.

    Re-read the state you need (or subscribe with `on_gap="resync"`) and go on from a new cursor.

    Attributes:
        cursor: The cursor that was given.
    """

    def __init__(self, cursor: str, message: str = "") -> None:
        super().__init__(message or f"the changes after cursor {cursor!r} are no longer retained")
        self.cursor = cursor
