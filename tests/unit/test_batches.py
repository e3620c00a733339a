"""store/batches.py: calls made while a round trip is in flight share the next one, each
caller gets its own answer, and a caller that gives up harms no one. The round trip here
is a plain coroutine that records what it was sent and waits for a permit the test gives,
so which calls share a round trip is decided by the test, not by timing."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from context_engine.store.batches import Batcher


class RoundTrips:
    """A round trip that answers each key with its square, or with the ValueError the
    test chose for it, once the test lets it (`allow(n)`: n more round trips end)."""

    def __init__(self, *, fail_keys: frozenset[int] = frozenset()) -> None:
        self.sent: list[list[int]] = []
        self.permits = asyncio.Semaphore(0)
        self.fail_keys = fail_keys
        self.raise_next: Exception | None = None

    def allow(self, n: int = 100) -> None:
        for _ in range(n):
            self.permits.release()

    async def __call__(self, keys: Sequence[int]) -> list[int | BaseException]:
        self.sent.append(list(keys))
        await self.permits.acquire()
        if self.raise_next is not None:
            error, self.raise_next = self.raise_next, None
            raise error
        return [ValueError(f"no {k}") if k in self.fail_keys else k * k for k in keys]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_call_is_sent_at_once_and_alone() -> None:
    trips = RoundTrips()
    batcher: Batcher[int, int] = Batcher(trips)
    call = asyncio.ensure_future(batcher(3))
    await settle()
    assert trips.sent == [[3]]  # sent before it could end: nothing waits to batch
    trips.allow()
    assert await call == 9


async def test_calls_made_during_a_round_trip_share_the_next_one() -> None:
    trips = RoundTrips()
    batcher: Batcher[int, int] = Batcher(trips)
    first = asyncio.ensure_future(batcher(1))
    await settle()
    rest = [asyncio.ensure_future(batcher(k)) for k in range(2, 12)]
    await settle()
    assert trips.sent == [[1]]  # the rest wait for the first round trip to end
    trips.allow()
    assert await first == 1
    assert await asyncio.gather(*rest) == [k * k for k in range(2, 12)]
    assert trips.sent == [[1], list(range(2, 12))]


async def test_a_round_trip_takes_at_most_the_limit() -> None:
    trips = RoundTrips()
    batcher: Batcher[int, int] = Batcher(trips, limit=4)
    first = asyncio.ensure_future(batcher(0))
    await settle()
    rest = [asyncio.ensure_future(batcher(k)) for k in range(1, 10)]
    trips.allow()
    assert [await first, *await asyncio.gather(*rest)] == [k * k for k in range(10)]
    assert trips.sent == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]


async def test_a_round_trip_takes_at_most_the_weight_but_always_one_call() -> None:
    """Rule 5: Build's records weigh the people each names, whose fences one transaction
    holds together (64 records of 256 people each filled PostgreSQL's shared lock table:
    an audit). A call heavier than the bound goes alone."""
    trips = RoundTrips()
    batcher: Batcher[int, int] = Batcher(trips, weigh=lambda k: k, max_weight=10)
    first = asyncio.ensure_future(batcher(0))
    await settle()
    rest = [asyncio.ensure_future(batcher(k)) for k in (4, 5, 2, 30, 1, 9)]
    trips.allow()
    assert [await first, *await asyncio.gather(*rest)] == [0, 16, 25, 4, 900, 1, 81]
    assert trips.sent == [[0], [4, 5], [2], [30], [1, 9]]


async def test_each_caller_gets_its_own_error() -> None:
    trips = RoundTrips(fail_keys=frozenset({5}))
    batcher: Batcher[int, int] = Batcher(trips)
    first = asyncio.ensure_future(batcher(1))
    await settle()
    rest = [asyncio.ensure_future(batcher(k)) for k in (4, 5, 6)]
    trips.allow()
    assert await first == 1
    answers = await asyncio.gather(*rest, return_exceptions=True)
    assert answers[0] == 16 and answers[2] == 36
    assert isinstance(answers[1], ValueError) and str(answers[1]) == "no 5"


async def test_a_failed_round_trip_fails_its_calls_only() -> None:
    trips = RoundTrips()
    batcher: Batcher[int, int] = Batcher(trips)
    trips.raise_next = ConnectionError("away")
    first = asyncio.ensure_future(batcher(1))
    await settle()
    second = asyncio.ensure_future(batcher(2))
    trips.allow()
    with pytest.raises(ConnectionError, match="away"):
        await first
    assert await second == 4  # the next round trip is sent and answered as usual
    assert trips.sent == [[1], [2]]


async def test_a_caller_that_gives_up_is_not_sent_and_harms_no_one() -> None:
    trips = RoundTrips()
    batcher: Batcher[int, int] = Batcher(trips)
    first = asyncio.ensure_future(batcher(1))
    await settle()
    quitter = asyncio.ensure_future(batcher(2))
    stayer = asyncio.ensure_future(batcher(3))
    await settle()
    quitter.cancel()
    trips.allow()
    assert await first == 1
    assert await stayer == 9
    with pytest.raises(asyncio.CancelledError):
        await quitter
    assert trips.sent == [[1], [3]]


async def test_a_caller_that_gives_up_in_flight_leaves_the_others_answered() -> None:
    trips = RoundTrips()
    batcher: Batcher[int, int] = Batcher(trips)
    first = asyncio.ensure_future(batcher(1))
    await settle()
    a, b = asyncio.ensure_future(batcher(2)), asyncio.ensure_future(batcher(3))
    trips.allow(1)
    assert await first == 1
    await settle()
    assert trips.sent[-1] == [2, 3]  # both were sent; then one caller gives up
    a.cancel()
    trips.allow(1)
    assert await b == 9
    with pytest.raises(asyncio.CancelledError):
        await a


async def test_after_the_queue_empties_the_next_call_is_sent_at_once_again() -> None:
    trips = RoundTrips()
    trips.allow()
    batcher: Batcher[int, int] = Batcher(trips)
    assert await batcher(2) == 4
    assert await batcher(3) == 9
    assert trips.sent == [[2], [3]]


async def test_idle_runs_once_the_queue_empties_and_a_call_meanwhile_is_still_sent() -> None:
    """Rule 4: `idle` is awaited once round trips stop, not between round trips that
    follow one another; a call made while it runs starts round trips of its own."""
    trips = RoundTrips()
    idle_calls: list[list[list[int]]] = []
    idle_done: list[bool] = []
    release = asyncio.Event()

    async def idle() -> None:
        idle_calls.append([list(s) for s in trips.sent])
        await release.wait()
        idle_done.append(True)

    batcher: Batcher[int, int] = Batcher(trips, idle=idle)
    first = asyncio.ensure_future(batcher(1))
    await settle()
    second = asyncio.ensure_future(batcher(2))
    trips.allow(2)
    assert [await first, await second] == [1, 4]
    await settle()
    assert idle_calls == [[[1], [2]]]  # once, after both round trips, not between them
    late = asyncio.ensure_future(batcher(3))  # while idle still runs
    trips.allow(1)
    assert await late == 9
    assert trips.sent == [[1], [2], [3]]
    assert len(idle_calls) == 2 and not idle_done  # the late call's round trips stopped too
    release.set()
    await settle()
    assert idle_done == [True, True]
