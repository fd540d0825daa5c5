"""The agent's life in phases, and the stop requests that move it on (agent.py composes the parts;
this decides where in its life it is and what a stop means now).

Why: docs/decisions/shutdown-the-kubelet-sees.md.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any, Awaitable, Callable, Iterable


class Phase(enum.Enum):
    """Where the agent is in its life: it only moves on, RUNNING first and STOPPING last."""

    RUNNING = "running"  # from construction: serving, or on its way to
    HANDED_OVER = "handed over"  # an in-place upgrade's child has the kubelet and the unit; a stop follows
    HANDING_OVER = "handing over"  # a stop serves on until a successor is ready (close)
    STOPPING = "stopping"  # STOPPING=1 said: the side, the checker and the helper close; nothing more is said


class Lifecycle:
    """The phase, and the stops asked for: the first ends the agent's wait, a second ends a
    handover's wait for a successor at once. Construct it inside the running event loop."""

    def __init__(self) -> None:
        self.phase = Phase.RUNNING
        self._stop = asyncio.Event()
        self._stopped_again = asyncio.Event()

    def stop(self) -> None:
        if self._stop.is_set():
            self._stopped_again.set()
        self._stop.set()

    def handed_over(self) -> None:
        """An in-place upgrade's child has the kubelet and the unit: a stop, with no handover of ours."""
        self.phase = Phase.HANDED_OVER
        self.stop()

    @property
    def may_upgrade(self) -> bool:
        return self.phase is Phase.RUNNING

    @property
    def leaving(self) -> bool:
        """Whether our stop has begun (we serve on at most until a successor is ready), or an
        in-place upgrade's child has taken over from us."""
        return self.phase is not Phase.RUNNING

    @property
    def speaking(self) -> bool:
        """Whether the agent still says how it stands (after STOPPING=1 nothing more is said)."""
        return self.phase is not Phase.STOPPING

    async def until_stopped(self, tasks: Iterable[asyncio.Future[Any]]) -> None:
        """Until stop(); raises what a task that ended first raised (they run until cancelled)."""
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
        for task in done:
            if task is not stop_wait:
                raise task.exception() or RuntimeError("an agent task ended unexpectedly")

    async def begin_stopping(self, hand_over: Callable[[asyncio.Event], Awaitable[None]]) -> bool:
        """Whether this is the close that stops the agent (a later one does nothing): a running
        agent first serves on through `hand_over` (given the event a second stop sets); one an
        upgrade's child replaced has nothing to hand over. Then STOPPING."""
        if self.phase in (Phase.HANDING_OVER, Phase.STOPPING):
            return False
        if self.phase is Phase.RUNNING:
            self.phase = Phase.HANDING_OVER
            await hand_over(self._stopped_again)
        self.phase = Phase.STOPPING
        return True
