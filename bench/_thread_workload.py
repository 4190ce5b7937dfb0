"""A LangGraph chat thread: `turns` user turns through a two-node graph on `CheckpointSaver`.

The graph's state is a `messages` channel reduced with `add_messages`; each turn adds a user
message, then the two nodes (`agent`, `review`) each add one of their own. Every message's text
is `MESSAGE_CHARS` long and depends only on its turn, so two runs store the same bytes. The
feed-size test and `bench.bench_feed_size` run it with the change feed on and off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from agenticstate.langgraph import CheckpointSaver

if TYPE_CHECKING:
    from agenticstate import StateManager

__all__ = ["MESSAGE_CHARS", "run_thread"]

MESSAGE_CHARS = 800


class _Chat(TypedDict):
    messages: Annotated[list[Any], add_messages]


def _text(kind: str, turn: int) -> str:
    head = f"{kind} {turn}: "
    return head + "".join(chr(97 + (turn * 7 + i) % 26) for i in range(MESSAGE_CHARS - len(head)))


def _graph(saver: CheckpointSaver) -> Any:
    def agent(state: _Chat) -> dict[str, Any]:
        turn = len(state["messages"]) // 3
        return {"messages": [AIMessage(_text("agent", turn), id=f"a{turn}")]}

    def review(state: _Chat) -> dict[str, Any]:
        turn = len(state["messages"]) // 3
        return {"messages": [AIMessage(_text("review", turn), id=f"r{turn}")]}

    builder = StateGraph(_Chat)
    builder.add_node("agent", agent)
    builder.add_node("review", review)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "review")
    builder.add_edge("review", END)
    return builder.compile(checkpointer=saver)


async def run_thread(state: StateManager, turns: int, thread: str = "t1") -> None:
    """Run `turns` turns of one thread on `state` (opened by the caller)."""
    graph = _graph(CheckpointSaver(state))
    config: Any = {"configurable": {"thread_id": thread}}
    for turn in range(turns):
        await graph.ainvoke(
            {"messages": [HumanMessage(_text("user", turn), id=f"u{turn}")]}, config
        )
