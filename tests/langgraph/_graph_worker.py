"""The graphs the LangGraph tests drive, and a worker process that drives them.

`python -m tests.langgraph._graph_worker SPEC COMMAND THREAD` where SPEC is JSON
`{"url": ..., "options": {...}, "prefix": ...}` naming a shared backend:

- `resume THREAD ANSWER`: resume the approval graph's `interrupt()` with ANSWER; print the result.
- `race THREAD NAME`: continue the paused counter graph; inside the node print `ready`, wait
  for a line on stdin, then finish; print `ok` or `stale EXPECTED ACTUAL`.
"""

from __future__ import annotations

import json
import operator
import sys
from typing import TYPE_CHECKING, Annotated, Any, TypedDict, cast

import anyio
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt

from agenticstate import StateConfig, StateManager
from agenticstate.backends import open_backend
from agenticstate.langgraph import CheckpointSaver, StaleCheckpointError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from langgraph.graph.state import CompiledStateGraph


class Approval(TypedDict, total=False):
    """The approval graph's state."""

    steps: Annotated[list[str], operator.add]
    answer: str


def _plan(state: Approval) -> Approval:
    return {"steps": ["plan"]}


def _ask(state: Approval) -> Approval:
    answer = interrupt({"question": "ship it?"})
    return {"steps": ["ask"], "answer": str(answer)}


def _finish(state: Approval) -> Approval:
    return {"steps": [f"finish:{state['answer']}"]}


def approval_graph(saver: Any) -> CompiledStateGraph[Any, Any, Any, Any]:
    """plan -> ask (interrupts for an answer) -> finish."""
    builder = StateGraph(Approval)
    builder.add_node("plan", _plan)
    builder.add_node("ask", _ask)
    builder.add_node("finish", _finish)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "ask")
    builder.add_edge("ask", "finish")
    builder.add_edge("finish", END)
    return builder.compile(checkpointer=saver)


class Counter(TypedDict, total=False):
    """The counter graph's state."""

    count: int
    by: Annotated[list[str], operator.add]


def counter_graph(
    saver: CheckpointSaver, work: Callable[[Counter], Awaitable[Counter]] | None = None
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """start -> work -> done, paused before `work` (the step two workers race on)."""

    async def default_work(state: Counter) -> Counter:
        return {"count": state.get("count", 0) + 1, "by": ["work"]}

    def start(state: Counter) -> Counter:
        return {"count": state.get("count", 0) + 1, "by": ["start"]}

    def done(state: Counter) -> Counter:
        return {"count": state.get("count", 0) + 1, "by": ["done"]}

    builder = StateGraph(Counter)
    builder.add_node("start", start)
    builder.add_node("work", cast("Any", work or default_work))
    builder.add_node("done", done)
    builder.add_edge(START, "start")
    builder.add_edge("start", "work")
    builder.add_edge("work", "done")
    builder.add_edge("done", END)
    return builder.compile(checkpointer=saver, interrupt_before=["work"])


def _say(line: str) -> None:
    """One protocol line to the parent test, at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _main(spec: dict[str, Any], command: str, thread: str, arg: str) -> None:
    backend = open_backend(spec["url"], **spec.get("options", {}))
    async with StateManager(StateConfig(), backend=backend) as state:
        saver = CheckpointSaver(state, prefix=spec["prefix"])
        config: Any = {"configurable": {"thread_id": thread}}
        if command == "resume":
            result = await approval_graph(saver).ainvoke(Command(resume=arg), config)
            _say(json.dumps(result))
            return

        async def work(state: Counter) -> Counter:
            _say("ready")
            await anyio.to_thread.run_sync(sys.stdin.readline)
            return {"count": state.get("count", 0) + 1, "by": [arg]}

        try:
            await counter_graph(saver, work).ainvoke(None, config)
        except StaleCheckpointError as exc:
            _say(f"stale {exc.expected_head} {exc.actual_head}")
            return
        _say("ok")


if __name__ == "__main__":
    anyio.run(_main, json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])


class Fan(TypedDict, total=False):
    """The fan-out graph's state."""

    log: Annotated[list[str], operator.add]
    items: list[str]


def fan_graph(saver: Any) -> CompiledStateGraph[Any, Any, Any, Any]:
    """Two parallel branches -> a subgraph that interrupts -> three `Send` workers."""

    def sub_ask(state: Fan) -> Fan:
        return {"log": [f"sub_ask:{interrupt('sub?')}"]}

    sub = StateGraph(Fan)
    sub.add_node("a", lambda state: {"log": ["sub_a"]})
    sub.add_node("ask", sub_ask)
    sub.add_edge(START, "a")
    sub.add_edge("a", "ask")
    sub.add_edge("ask", END)

    def fan(state: Fan) -> list[Send]:
        return [Send("work", {"items": [x]}) for x in ("x", "y", "z")]

    builder = StateGraph(Fan)
    builder.add_node("p1", lambda state: {"log": ["p1"]})
    builder.add_node("p2", lambda state: {"log": ["p2"]})
    builder.add_node("sub", sub.compile())
    builder.add_node("work", lambda state: {"log": ["w:" + state["items"][0]]})
    builder.add_edge(START, "p1")
    builder.add_edge(START, "p2")
    builder.add_edge("p1", "sub")
    builder.add_edge("p2", "sub")
    builder.add_conditional_edges("sub", fan, ["work"])
    builder.add_edge("work", END)
    return builder.compile(checkpointer=saver)
