"""A LangGraph graph on agenticstate: interrupt, restart, resume, time travel, long-term memory,
and a stale writer refused (the thread is never forked silently).

Install: `pip install ".[langgraph]"` (from a checkout; see the README).
"""

import operator
from typing import Annotated, Any, TypedDict

import anyio
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from agenticstate import StateConfig, StateManager
from agenticstate.langgraph import CheckpointSaver, StaleCheckpointError, Store


class Draft(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    verdict: str


def write(state: Draft) -> Draft:
    return {"log": ["drafted"]}


def review(state: Draft) -> Draft:
    verdict = interrupt({"question": "publish the draft?"})  # waits for a human
    return {"log": [f"reviewed:{verdict}"], "verdict": str(verdict)}


def publish(state: Draft) -> Draft:
    return {"log": ["published" if state["verdict"] == "yes" else "shelved"]}


def build(saver: CheckpointSaver, store: Store) -> Any:
    graph = StateGraph(Draft)
    graph.add_node("write", write)
    graph.add_node("review", review)
    graph.add_node("publish", publish)
    graph.add_edge(START, "write")
    graph.add_edge("write", "review")
    graph.add_edge("review", "publish")
    graph.add_edge("publish", END)
    return graph.compile(checkpointer=saver, store=store)


STORE = StateConfig(backend="file", file_path="./state/graphs.json")
THREAD = {"configurable": {"thread_id": "post-42"}}
RACE = {"configurable": {"thread_id": "post-43"}}


async def main() -> None:
    # 1. Run until the interrupt; then the process "exits" (the state manager closes).
    async with StateManager(STORE) as state:
        saver = CheckpointSaver(state)
        for old_thread in ("post-42", "post-43"):  # a run before this one left them: start over
            await saver.adelete_thread(old_thread)
        graph = build(saver, Store(state))
        paused = await graph.ainvoke({"log": []}, THREAD)
        print("waiting for:", paused["__interrupt__"][0].value)

    # 2. A later process opens the same store and resumes with the human's answer.
    async with StateManager(STORE) as state:
        saver, store = CheckpointSaver(state), Store(state)
        graph = build(saver, store)
        done = await graph.ainvoke(Command(resume="yes"), THREAD)
        print("resumed:", done["log"])
        assert done["log"] == ["drafted", "reviewed:yes", "published"]

        # 3. Time travel: fork from the checkpoint before the review, answer differently.
        history = [snapshot async for snapshot in graph.aget_state_history(THREAD)]
        before_review = next(s for s in history if s.next == ("review",))
        fork = await graph.aupdate_state(before_review.config, {"log": ["edited"]})
        forked = await graph.ainvoke(Command(resume="no"), fork)
        print("forked:", forked["log"])
        assert forked["log"] == ["drafted", "edited", "reviewed:no", "shelved"]
        old = await graph.aget_state(history[0].config)  # the first branch is still there
        assert old.values["log"][-1] == "published"

        # 4. Long-term memory, shared by every thread: namespaces, filters, TTL in minutes.
        await store.aput(("users", "ada"), "style", {"tone": "short", "rank": 2}, ttl=60)
        found = await store.asearch(("users",), filter={"rank": {"$gte": 2}})
        print("memories:", [(item.key, item.value) for item in found])
        assert [item.key for item in found] == ["style"]

        # 5. Worker A loads the thread head; worker B moves it; A's next write is refused.
        race = RACE
        await graph.ainvoke({"log": []}, race)  # paused at the review
        seen_by_a = await saver.aget_tuple(race)  # what LangGraph loads when A resumes
        await graph.ainvoke(Command(resume="yes"), race)  # B resumes and finishes first
        try:  # A's run now writes its next checkpoint on top of the head it loaded
            await saver.aput(seen_by_a.config, seen_by_a.checkpoint, seen_by_a.metadata, {})
        except StaleCheckpointError as exc:
            print("refused: built on", exc.expected_head, "but the head is", exc.actual_head)
        else:
            raise AssertionError("a stale write must be refused")
        final = await graph.aget_state(race)
        assert final.values["log"] == ["drafted", "reviewed:yes", "published"]


if __name__ == "__main__":
    anyio.run(main)
