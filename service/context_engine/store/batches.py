"""Calls that arrive while a round trip is in flight share the next one.

A Build makes at most two round trips: it reads its run's head (unless the replica kept it
from the run's previous Build, which the record then confirms: store/records.py) and it
records its request. Under load most of what they cost is per round trip, not per row: on the
client, a pooled connection acquired and released, a statement bound, sent and parsed,
the event loop woken for each; in PostgreSQL, a statement planned and executed and, for a
write, a transaction committed (a WAL flush). Measured on this project's benchmark host,
one record_model_request cost PostgreSQL 0.47 ms of CPU alone and 0.17 ms each in a
batch of sixteen; a run-head read 0.11 ms alone and 0.01 ms each in a batch of sixteen.

Rule 1 (no added wait): the first call starts a round trip at once, alone. Calls made
while it is in flight queue, and the next round trip takes all of them (at most `limit`)
as soon as one finishes. One call at a time therefore sees the latency it saw before;
many at a time share round trips in proportion to how many there are.
Rule 2 (one answer each): `run(keys)` answers every key, in order, with its value or the
exception meant for that caller alone. An exception raised by `run` itself answers every
call of the round trip: PostgreSQL away fails them all, as it would have one by one.
Rule 3 (no orphans): a caller that gives up (its deadline, a cancelled RPC) stops waiting;
its key may still be in a round trip already sent, which then lands or not as a lone
round trip sent at that moment would have.
Rule 5 (weight): with `weigh`, a round trip also takes no more than `max_weight` of the
calls' weights in all, but always at least one call: Build's records weigh the people each
names, whose fences one transaction takes together (a batch of 64 records naming 256
people each held 16,384 advisory locks at once, past PostgreSQL's shared lock table, which
failed other databases' transactions too: an audit).
Rule 4 (idle): `idle`, when given, is awaited each time the queue empties and round trips
stop; a call made while it runs starts round trips of its own. Build's record batcher hands
back the connection its round trips held (store/db.py HeldConnection): under load round
trips follow one another and share one connection without a pool acquire and release
each; once they stop, no connection stays out of the pool.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Batcher"]

K = TypeVar("K")
V = TypeVar("V")


class Batcher(Generic[K, V]):
    def __init__(
        self,
        run: Callable[[Sequence[K]], Awaitable[Sequence[V | BaseException]]],
        *,
        limit: int = 64,
        idle: Callable[[], Awaitable[None]] | None = None,
        weigh: Callable[[K], int] | None = None,
        max_weight: int = 0,
    ) -> None:
        self._run = run
        self._limit = limit
        self._weigh = weigh
        self._max_weight = max_weight
        self._idle = idle
        self._queued: list[tuple[K, asyncio.Future[V]]] = []
        # The task sending round trips while any call waits (None: none is), held so the
        # loop does not lose it.
        self._flusher: asyncio.Task[None] | None = None
        # How many calls were made and how many round trips answered them (tests read it).
        self.calls = 0
        self.round_trips = 0

    async def __call__(self, key: K) -> V:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[V] = loop.create_future()
        self._queued.append((key, future))
        self.calls += 1
        if self._flusher is None:
            # A context of its own: the round trips serve every caller, so none of them
            # inherits the first caller's (its RPC's telemetry state, its span).
            self._flusher = loop.create_task(self._flush(), context=contextvars.Context())
        return await future

    async def _flush(self) -> None:
        """Round trips until the queue is empty (Rule 1)."""
        try:
            while self._queued:
                taken = self._taken()
                batch, self._queued = self._queued[:taken], self._queued[taken:]
                live = [(k, f) for k, f in batch if not f.done()]  # Rule 3: gave up
                if live:
                    await self._answer(live)
        finally:
            self._flusher = None
            for _, future in self._queued:  # only when cancelled: nothing will answer them
                future.cancel()
            self._queued = []
            if self._idle is not None:  # Rule 4
                await self._idle()

    def _taken(self) -> int:
        """How many queued calls the next round trip takes (Rules 1 and 5)."""
        most = min(self._limit, len(self._queued))
        if self._weigh is None:
            return most
        weight = 0
        for n in range(most):
            weight += self._weigh(self._queued[n][0])
            if n > 0 and weight > self._max_weight:
                return n
        return most

    async def _answer(self, batch: list[tuple[K, asyncio.Future[V]]]) -> None:
        self.round_trips += 1
        try:
            values = await self._run([k for k, _ in batch])
        except asyncio.CancelledError:  # the loop is shutting down
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # Rule 2: the round trip itself failed
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        if len(values) != len(batch):
            error = RuntimeError(f"a batch of {len(batch)} was answered with {len(values)}")
            values = [error] * len(batch)
        for (_, future), value in zip(batch, values, strict=True):
            if future.done():
                continue
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)
