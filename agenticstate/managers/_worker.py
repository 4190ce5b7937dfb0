"""The worker loop of a team's task queue: claim, run a handler under heartbeats, finish.

`OrchestrationStateManager.run_worker` builds a `Worker` and runs it. The loop uses only the
manager's public queue calls (`claim_task`, `heartbeat`, `complete_task`, `fail_task`,
`release_task`), so everything it does another process could do by hand, with the same
guarantees; docs/managers/orchestration.md describes it.

The shape follows arq's and SAQ's workers: the handler runs while a heartbeat task renews its
lease; an exception fails the task through the retry and dead-letter path; a lost lease
cancels the handler; a cancelled worker gives its task back before it goes.

A cancellation can land at any await of the loop, and a store call it interrupts may still
commit (SQLite's worker thread, a Redis command already sent). So the calls that change what
this worker holds are shielded, each for at most the lease: a claim the store made is always
either handed to the handler or given back (`release_task`), and a finished handler's outcome
is always recorded (`complete_task`, `fail_task`), never left in progress with no holder. A
heartbeat needs no shield: it changes no lease token, so the give-back after it works.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import anyio

from agenticstate.exceptions import (
    AgenticStateError,
    BackendError,
    BackendTimeoutError,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    SerializationError,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from datetime import timedelta

    from agenticstate.managers._task_queue import TaskClaim, TaskItem
    from agenticstate.managers.orchestration import OrchestrationStateManager

__all__ = ["Worker"]

_GIVE_BACK_TIMEOUT = 5.0
"""Seconds a cancelled worker spends giving its task back (else the lease runs out)."""


class Worker:
    """One worker of a team's queue (see `OrchestrationStateManager.run_worker`)."""

    def __init__(
        self,
        orch: OrchestrationStateManager,
        team_id: str,
        agent_id: str,
        handler: Callable[[TaskItem], Any],
        *,
        capability: str | None,
        lease: timedelta,
        heartbeat_interval: timedelta,
        poll_interval: timedelta,
        stop: anyio.Event | None,
        until_empty: bool,
        max_tasks: int | None,
        log: Any,
    ) -> None:
        if heartbeat_interval >= lease:
            # Each lease would run out before the heartbeat that renews it: every task longer
            # than the lease would be taken back, and run twice.
            raise InvalidArgumentError(
                f"heartbeat_interval ({heartbeat_interval.total_seconds():g} s) must be shorter "
                f"than the lease ({lease.total_seconds():g} s); a third of it or less leaves "
                "room for a missed heartbeat"
            )
        self.orch = orch
        self.team_id = team_id
        self.agent_id = agent_id
        self.handler = handler
        self.capability = capability
        self.lease = lease
        self.heartbeat_interval = heartbeat_interval.total_seconds()
        self.poll_interval = poll_interval.total_seconds()
        self.stop = stop
        self.until_empty = until_empty
        self.max_tasks = max_tasks
        self.log = log
        # A coroutine function runs on the loop; anything else in a worker thread, so that a
        # blocking handler does not stop the heartbeats.
        self._on_loop = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004  # an object with an async __call__
        )

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    async def run(self) -> int:
        """Claim and handle tasks until told to stop; return how many were handled."""
        handled = 0
        self.log.info("worker_started", team_id=self.team_id, agent_id=self.agent_id)
        try:
            while not self._stopping() and (self.max_tasks is None or handled < self.max_tasks):
                # A cancellation that came while the last outcome was recorded (shielded) ends
                # the loop here, before anything more is claimed.
                await anyio.lowlevel.checkpoint()
                try:
                    claim = await self._shielded(
                        self.orch.claim_task(
                            self.team_id,
                            self.agent_id,
                            capability=self.capability,
                            lease=self.lease,
                        ),
                        "claim_task",
                    )
                except BackendError as exc:
                    # The store is unreachable for now: wait and try again, as arq does.
                    self.log.warning(
                        "worker_claim_failed", team_id=self.team_id, error=type(exc).__name__
                    )
                    await self._idle()
                    continue
                if claim is None:
                    if self.until_empty:
                        break
                    await self._idle()
                    continue
                await self._handle(claim)
                handled += 1
        finally:
            self.log.info(
                "worker_stopped", team_id=self.team_id, agent_id=self.agent_id, handled=handled
            )
        return handled

    async def _shielded(self, call: Awaitable[Any], name: str) -> Any:
        """Await a queue call that a cancellation must not cut short, for at most the lease.

        Cancelled from outside meanwhile, the call still finishes (and the cancellation comes
        at the next unshielded await, where what it did is handed on or given back). A call
        slower than the lease is cancelled (its lease has run out by then, so anything it left
        in progress is taken back by the next claim) and raises `BackendTimeoutError`.
        """
        with anyio.move_on_after(self.lease.total_seconds(), shield=True):
            return await call
        raise BackendTimeoutError(f"{name} took longer than the worker's lease")

    async def _idle(self) -> None:
        """Wait a poll interval, or until `stop` is set."""
        with anyio.move_on_after(self.poll_interval):
            if self.stop is not None:
                await self.stop.wait()
            else:
                await anyio.sleep_forever()

    async def _call(self, task: TaskItem) -> Any:
        if self._on_loop:
            return await self.handler(task)
        result = await anyio.to_thread.run_sync(self.handler, task)
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            result = await result
        return result

    async def _handle(self, claim: TaskClaim) -> None:
        """Run the handler on a claimed task under heartbeats, then complete or fail it."""
        lost: list[bool] = []
        outcome: list[Any] = []
        error: list[Exception] = []
        try:
            # A cancellation that came while the claim was made (shielded) gives it back here,
            # before the handler starts.
            await anyio.lowlevel.checkpoint_if_cancelled()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeats, claim, tg.cancel_scope, lost)
                try:
                    outcome.append(await self._call(claim.task))
                except Exception as exc:  # noqa: BLE001  # any failure of the handler fails the task
                    error.append(exc)
                tg.cancel_scope.cancel()  # the heartbeats stop with the handler
        except BaseException:
            # Cancelled from outside (or interrupted): give the task back at once rather than
            # leave it until its lease runs out, then go.
            with anyio.move_on_after(_GIVE_BACK_TIMEOUT, shield=True):
                await self._give_back(claim)
            raise
        if lost:
            return  # another worker has it now; the handler was cancelled
        try:
            if error:
                self.log.warning(
                    "task_handler_failed",
                    team_id=self.team_id,
                    task_id=claim.task_id,
                    error=type(error[0]).__name__,
                )
                await self._shielded(
                    self.orch.fail_task(
                        self.team_id,
                        claim.task_id,
                        f"{type(error[0]).__name__}: {error[0]}",
                        lease_token=claim.lease_token,
                    ),
                    "fail_task",
                )
            else:
                await self._shielded(
                    self.orch.complete_task(
                        self.team_id, claim.task_id, outcome[0], lease_token=claim.lease_token
                    ),
                    "complete_task",
                )
        except SerializationError:
            # complete_task failed the task itself (its result cannot be stored).
            self.log.warning("task_result_unstorable", team_id=self.team_id, task_id=claim.task_id)
        except (ConflictError, NotFoundError):
            # The lease ran out and another worker took the task (or it was deleted) between the
            # last heartbeat and now: that worker's outcome counts.
            self.log.warning("task_lease_lost", team_id=self.team_id, task_id=claim.task_id)

    async def _heartbeats(
        self, claim: TaskClaim, handler: anyio.CancelScope, lost: list[bool]
    ) -> None:
        """Renew the claim's lease every `heartbeat_interval` until cancelled or lost."""
        while True:
            await anyio.sleep(self.heartbeat_interval)
            try:
                await self.orch.heartbeat(
                    self.team_id, claim.task_id, claim.lease_token, lease=self.lease
                )
            except (ConflictError, NotFoundError):
                # Another worker took the task (this one stalled past its lease), or it was
                # deleted: stop the handler, whose outcome no longer counts.
                self.log.warning("task_lease_lost", team_id=self.team_id, task_id=claim.task_id)
                lost.append(True)
                handler.cancel()
                return
            except BackendError as exc:
                # Try again at the next beat: the lease outlasts a few missed ones.
                self.log.warning(
                    "task_heartbeat_failed",
                    team_id=self.team_id,
                    task_id=claim.task_id,
                    error=type(exc).__name__,
                )

    async def _give_back(self, claim: TaskClaim) -> None:
        try:
            await self.orch.release_task(self.team_id, claim.task_id, lease_token=claim.lease_token)
        except AgenticStateError as exc:
            # Finished, lost or unreachable: the lease running out puts it back if need be.
            self.log.warning(
                "task_give_back_failed",
                team_id=self.team_id,
                task_id=claim.task_id,
                error=type(exc).__name__,
            )
