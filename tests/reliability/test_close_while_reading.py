"""A manager closed while its subscriptions read: iteration ends quietly, on every backend.

The cancellation suite's twin, closing instead of cancelling: for each backend, rounds of a
store written with a backlog (more than a page of the feed), then readers (a replay from
`EARLIEST`, a replay from a change's cursor, a live watch; on Redis also one whose pub/sub
connection was just killed, so it is reconnecting and catching up) and a callback subscribed
with `since=`, and the manager closed after a random number of event-loop checkpoints: so the
close lands at every await of a replay, a page read, the switch to live, a reconnect's catch-up
and a live read. Each reader's iteration must end without an error (what it yielded is a run
of the feed in order), and no `subscription_failed` is logged.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from agenticstate import EARLIEST, FeedRetention, StateConfig, StateManager
from tests.helpers import BACKEND_MAKERS, REDIS_BACKENDS, backend_params

if TYPE_CHECKING:
    from pathlib import Path

    from agenticstate import StateChange

ROUNDS = 12
BACKLOG = 1_200  # more than one page of a replay on every backend
WAIT = 20.0
# Seconds: about as long as the replays of a round take on each backend (2 cores, loaded).
DELAY = {
    "memory": 0.05,
    "file": 0.2,
    "sqlite": 0.5,
    "redis": 0.5,
    "redis-cluster": 0.8,
    "postgres": 0.5,
}


class Reader:
    """One reader: what it yielded and how its iteration ended."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[StateChange] = []
        self.error: BaseException | None = None
        self.ended = anyio.Event()

    async def read(self, state: StateManager, since: str | None) -> None:
        try:
            async for change in state.changes("*", since=since, max_buffer=100_000):
                self.seen.append(change)
                await anyio.lowlevel.checkpoint()
        except Exception as exc:  # noqa: BLE001  # any error is the failure this test looks for
            self.error = exc
        finally:
            self.ended.set()


def _note(called: list[Any], key: str, old: object, new: object) -> None:
    called.append(key)


async def _kill_pubsub(url: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme.endswith("+cluster"):
        hosts = [hp.rpartition(":") for hp in parts.netloc.rpartition("@")[2].split(",")]
        admins = [aioredis.Redis(host=host, port=int(port)) for host, _, port in hosts]
    else:
        admins = [aioredis.Redis.from_url(url)]
    for admin in admins:
        async with admin:
            await admin.client_kill_filter(_type="pubsub")


@pytest.mark.parametrize("kind", backend_params())
async def test_a_close_at_any_await_ends_reading_quietly(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Closing the manager wherever its replays, reconnects and live reads are: each iteration
    ends without an error, having yielded a run of the feed in order."""
    rng = random.Random(kind)
    for round_ in range(ROUNDS):
        backend_cm = BACKEND_MAKERS[kind](
            request, tmp_path / str(round_), feed=FeedRetention(max_changes=100_000)
        )
        with capture_logs() as logs:
            async with backend_cm as backend:
                state = StateManager(StateConfig(), backend=backend)
                await state.open()
                cursor = await state.feed_cursor()
                await state.save_many({f"k{n}": n for n in range(BACKLOG)})
                middle = await state.feed_cursor()
                readers = [Reader("earliest"), Reader("cursor"), Reader("middle"), Reader("live")]
                called: list[Any] = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(readers[0].read, state, EARLIEST)
                    tg.start_soon(readers[1].read, state, cursor)
                    tg.start_soon(readers[2].read, state, middle)
                    tg.start_soon(readers[3].read, state, None)
                    state.subscribe("*", functools.partial(_note, called), since=cursor)
                    if kind in REDIS_BACKENDS and rng.random() < 0.5:
                        # A reconnect on its way: the live reads catch up when it is back.
                        for _ in range(rng.randrange(20)):
                            await anyio.lowlevel.checkpoint()
                        url = request.getfixturevalue(
                            "redis_cluster_url" if kind == "redis-cluster" else "redis_url"
                        )
                        await _kill_pubsub(url)
                        await state.save("after", 1)
                    # Anywhere from before the first read to the end of the replays.
                    if round_ % 3:  # (every third round: at once)
                        await anyio.sleep(rng.random() * DELAY[kind])
                    for _ in range(rng.randrange(400)):
                        await anyio.lowlevel.checkpoint()
                    await state.aclose()
                    with anyio.fail_after(WAIT):
                        for reader in readers:
                            await reader.ended.wait()
        for reader in readers:
            assert reader.error is None, (kind, round_, reader.name, repr(reader.error))
            keys = [change.key for change in reader.seen if change.key.startswith("k")]
            if reader.name in ("earliest", "cursor") and kind != "redis-cluster":
                assert keys == [f"k{n}" for n in range(len(keys))], reader.name  # a run, in order
        assert not [event for event in logs if event["event"] == "subscription_failed"]
