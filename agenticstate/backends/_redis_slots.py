"""Cluster slots for the Redis backend's own keys: `slot_tag` puts a name in a given slot.

A write's script may touch one slot only, so the feed stream and the history list a write
appends to must sit in the written key's slot: their names carry `{slot_tag(slot)}`.
"""

from __future__ import annotations

import binascii
import itertools
import string

__all__ = ["SLOTS", "slot_tag", "slot_tail"]

SLOTS = 16384
"""Hash slots in a Redis Cluster."""

_TAG_ALPHABET = string.digits + string.ascii_letters
_slot_tags: list[str] = []


def _build_slot_tags() -> list[str]:
    """For each slot, the first string of `_TAG_ALPHABET` (shortest first) that hashes to it.

    Strings of up to three characters cover every slot; the search takes about 25 ms.
    """
    table: list[str | None] = [None] * SLOTS
    missing = SLOTS
    for length in itertools.count(1):
        for letters in itertools.product(_TAG_ALPHABET, repeat=length):
            tag = "".join(letters)
            slot = binascii.crc_hqx(tag.encode(), 0) % SLOTS
            if table[slot] is None:
                table[slot] = tag
                missing -= 1
                if not missing:
                    return [found for found in table if found is not None]
    raise AssertionError("unreachable")  # pragma: no cover  # itertools.count never ends


def slot_tag(slot: int) -> str:
    """A short alphanumeric string whose cluster slot is `slot`: `{tag}` in a name puts it there.

    `key_slot("{" + slot_tag(s) + "}anything") == s` for every slot `s` in 0..16383.
    """
    if not _slot_tags:
        _slot_tags.extend(_build_slot_tags())
    return _slot_tags[slot]


def slot_tail(prefix: str, slot: int) -> str:
    """A key prefix with `slot`'s tag: the part after a namespace of our keys in that slot.

    `prefix{TAG}`, or `{TAG}prefix` when the prefix holds a brace (the first `{...}` of a name is
    its hash tag, so the tag must come first there). The feed's streams and counters, the
    revision counters and the key indexes of one prefix and slot are named with it.
    """
    tag = "{" + slot_tag(slot) + "}"
    return tag + prefix if "{" in prefix else prefix + tag
