"""How `StateManager.update` (and a new session's state) merges a dict: `deep_merge`, `updater`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agenticstate.exceptions import InvalidArgumentError, MergeError

__all__ = ["deep_merge", "updater"]


def deep_merge(base: dict[str, Any], partial: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `partial` into `base` in place: nested dicts merge, everything else replaces."""
    for key, value in partial.items():
        current = base.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            base[key] = deep_merge(current, value)
        else:
            base[key] = value
    return base


def updater(key: str, change: Mapping[str, Any] | Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The function an update of `key` applies to its value: `change`, or a deep merge of it.

    Used by `StateManager.update` and `LocalView.update`.
    """
    if isinstance(change, Mapping):
        partial = change

        def merge(current: Any) -> Any:
            if not isinstance(current, dict):
                raise MergeError(
                    f"cannot merge a dict into the {type(current).__name__} stored at {key!r}"
                )
            return deep_merge(current, partial)

        return merge
    if callable(change):
        return change
    raise InvalidArgumentError(f"update() takes a dict or a function, not {type(change).__name__}")
