"""Draining on shutdown: calls queued in the transport are answered, not cancelled.

grpc core cancels every call it has accepted but not yet handed to a handler the moment
the server stops (a loaded event loop can have dozens queued), and those calls' clients
see CANCELLED, which retry policies do not retry. So the listener is closed only once
that queue has been worked off. After SIGTERM (health is NOT_SERVING by then):

1. **Linger**: every call that arrives is served as usual, until none has arrived for
   QUIET seconds (clients that watch health have gone) or `linger` seconds have passed.
2. **Refuse**: a call that still arrives gets UNAVAILABLE with ErrorInfo reason
   SHUTTING_DOWN before its handler runs (nothing is read or written; the clients' retry
   policy retries it, and their tool loops send a Build, which the policy leaves out,
   again). Calls already running finish. Once none has been running for
   QUIET seconds, the queue behind them has been dispatched and refused too, and the
   phase ends, however many retries keep arriving (each is refused in microseconds; what
   moves a client to another replica is the listener closing, not more refusals).
3. The caller then stops the server with what is left of the grace period.

Both phases end at the grace period at the latest. A call that lands in the moment
between the last refusal and the listener closing (a client retrying at that instant),
or whose request is still being received, is still cancelled by grpc core.

The health service is not counted: a Watch stream would hold the drain open, and probes
must see NOT_SERVING throughout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from .interceptors import UNAUTHENTICATED_SERVICES, Behavior, Layer, abort_with, wrap_unless

__all__ = ["QUIET", "SHUTTING_DOWN", "Drain"]

QUIET = 0.2  # seconds without a new call (linger) or without a running one (refusing)
SHUTTING_DOWN = "SHUTTING_DOWN"
_POLL = 0.02


class Drain(Layer):
    """Counts running calls and, once refusing, answers new ones UNAVAILABLE."""

    def __init__(
        self,
        *,
        skip: Iterable[str] = UNAUTHENTICATED_SERVICES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._skip = frozenset(skip)
        self._clock = clock
        self.running = 0
        self.refusing = False
        self.last_arrival = clock()
        self._idle_since = clock()  # when `running` last fell to zero

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler | None
    ) -> grpc.RpcMethodHandler | None:
        return wrap_unless(self._skip, method, handler, self._unary)

    def _unary(self, behavior: Behavior) -> Behavior:
        async def counted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.last_arrival = self._clock()
            if self.refusing:
                await abort_with(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    "the server is shutting down; retry on another replica",
                    SHUTTING_DOWN,
                )
            self.running += 1
            try:
                return await behavior(request, context)
            finally:
                self.running -= 1
                if not self.running:
                    self._idle_since = self._clock()

        return counted

    def _quiet(self) -> bool:
        return self._clock() - self.last_arrival >= QUIET

    def _idle(self, since: float) -> bool:
        """Nothing has run for QUIET seconds (counted from `since` at the earliest)."""
        return not self.running and self._clock() - max(self._idle_since, since) >= QUIET

    async def drain(self, linger: float, grace: float) -> None:
        """Linger (at most `linger` s), then refuse until idle; both within `grace` s."""
        start = self._clock()
        await self._until(self._quiet, start + min(linger, grace))
        self.refusing = True
        refusing_since = self._clock()
        await self._until(lambda: self._idle(refusing_since), start + grace)

    async def _until(self, done: Callable[[], bool], deadline: float) -> None:
        while not done() and self._clock() < deadline:
            await asyncio.sleep(_POLL)
