"""Listing one thread and namespace: ids and namespaces that need escaping come back exact."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langgraph")

from langgraph.checkpoint.base import empty_checkpoint

from agenticstate import StateManager
from agenticstate.langgraph import CheckpointSaver

AWKWARD = ["plain", "a:b", "%41", "x*", "{t}", "é 漢", "z%"]


@pytest.mark.parametrize("ns", ["", "sub:graph|1", "%2F", "*"])
async def test_one_namespace_lists_escaped_ids_newest_first(ns: str) -> None:
    """Checkpoint ids and namespaces with escaped characters list back exact, newest first,
    with and without a limit, and never mix with another namespace."""
    async with StateManager() as state:
        saver = CheckpointSaver(state)
        for other in ("", "other"):
            if other != ns:
                checkpoint: Any = empty_checkpoint()
                checkpoint["id"] = "zzz"
                await saver.aput(
                    {"configurable": {"thread_id": "t", "checkpoint_ns": other}}, checkpoint, {}, {}
                )
        config: Any = {"configurable": {"thread_id": "t", "checkpoint_ns": ns}}
        for checkpoint_id in AWKWARD:
            checkpoint = empty_checkpoint()
            checkpoint["id"] = checkpoint_id
            await saver.aput(config, checkpoint, {}, {})
        scoped: Any = {"configurable": {"thread_id": "t", "checkpoint_ns": ns}}
        listed = [t.config["configurable"]["checkpoint_id"] async for t in saver.alist(scoped)]
        assert listed == sorted(AWKWARD, reverse=True)
        page = [t async for t in saver.alist(scoped, limit=3)]
        assert [t.config["configurable"]["checkpoint_id"] for t in page] == listed[:3]
        assert {t.config["configurable"]["checkpoint_ns"] for t in page} == {ns}
        # Every namespace of the thread: each tuple names its own namespace.
        thread: Any = {"configurable": {"thread_id": "t"}}
        every = [
            (t.config["configurable"]["checkpoint_ns"], t.config["configurable"]["checkpoint_id"])
            async for t in saver.alist(thread)
        ]
        expected = [(ns, checkpoint_id) for checkpoint_id in AWKWARD]
        expected += [(other, "zzz") for other in ("", "other") if other != ns]
        assert every == sorted(expected, key=lambda item: (item[1], item[0]), reverse=True)
        newest = [
            t.config["configurable"]["checkpoint_id"] async for t in saver.alist(thread, limit=2)
        ]
        assert newest == [checkpoint_id for _, checkpoint_id in every[:2]]
