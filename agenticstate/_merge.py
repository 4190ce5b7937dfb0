"""`deep_merge`: how `StateManager.update` (and a new session's state) merges a dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["deep_merge"]


def deep_merge(base: dict[str, Any], partial: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `partial` into `base` in place: nested dicts merge, everything else replaces."""
    for key, value in partial.items():
        current = base.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            base[key] = deep_merge(current, value)
        else:
            base[key] = value
    return base
