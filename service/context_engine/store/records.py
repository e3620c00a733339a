"""Build's write: a request's record (migrations/0005, 0008), many per round trip (0011).

record_requests is store/batches.py's round trip for Engine.build: the records of the
Builds that queued while the last round trip was in flight, in one statement and one
transaction. Each answer is the record's model.request.started sequence or one of
record_model_request's refusal codes, the engine's to turn into an error.

A record may carry the run head its Build was made from, kept by the replica rather than
read for this Build (Engine.build): the statement then records it only if the run's head
is still that one, read once the record's session lock is held (migrations/0018 to 0020;
0013 read it just before), and answers STALE_HEAD, writing nothing, if not. So a Build of
a run this replica has built before makes one round trip, not two; the engine builds again
from a fresh head when the kept one is stale. A head read in its own round trip is as old
as the time between that read and the record; a confirmed one is newer.

The shared round trip never waits for a lock (migrations/0018, and 0020 for a record that
goes alone): a record whose session or person lock another transaction holds is answered
BUSY, and its Build sends it again on a connection of its own (`record`, migrations/0019),
waiting for its own session only. One session's long
lock (a compaction's commit, an erasure) used to hold every Build of the replica behind
it, and fail them UNAVAILABLE past the statement timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any
from uuid import UUID

import asyncpg

from .db import StoreUnavailableError, acquire, lock_wait_ms

# Where a round trip gets its connection: a pooled one each time, or one held across
# round trips (store/db.py HeldConnection.use).
Connect = Callable[[], AbstractAsyncContextManager[Any]]

__all__ = [
    "BUSY",
    "NO_SESSION",
    "PERSON_ERASED",
    "PLAN_INVALIDATED",
    "STALE_HEAD",
    "RequestRecord",
    "people_named",
    "record",
    "record_requests",
]

# record_model_request's refusals (migrations/0005 and 0008): nothing of the record lands.
PLAN_INVALIDATED, NO_SESSION, PERSON_ERASED = -1, -2, -3
# This module's own refusals, nothing of the record landing: the record's kept head is no
# longer the run's (migrations/0013); another transaction holds a lock the record needs,
# for which the shared round trip does not wait (migrations/0018: send it with record()).
STALE_HEAD, BUSY = -4, -5


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One Build's record_model_request arguments (migrations/0008 names them)."""

    tenant_id: str
    session_id: UUID
    epoch: int
    run_id: UUID
    pressure: dict[str, Any] | None  # context.budget.pressure, when a yield ran
    used: dict[str, Any] | None  # context.snapshot.used, for a nonempty snapshot
    snapshot_id: str
    recall_trace_id: str
    request: dict[str, Any] | None  # model.request.started; None: it needs compaction
    # The kept head the Build was made from, to confirm (None: a head read for this Build):
    # its RunHead.state, and its latest checkpoint version when the Build took the latest.
    head_state: str | None = None
    latest_version: int | None = None


# A record on its own, waiting for its session's locks (record()), then confirming its
# kept head (arguments 10 and 11, migrations/0019: STALE_HEAD, nothing written, if the
# write it waited for moved it). It waits as long as any write does (store/db.py
# LOCK_WAIT_SECONDS, for its people's fences and its session's row in all: migrations/
# 0022; then SESSION_BUSY).
_ONE = (
    "SELECT record_model_request_waiting_within($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
)
# A lone record of the shared round trip, waiting for no lock (migrations/0020: BUSY).
_ONE_NOWAIT = "SELECT record_model_request_nowait($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
# The shared round trip's records, none waiting for a lock (migrations/0018: BUSY).
_NOWAIT = (
    "SELECT record_model_requests_nowait($1::text[], $2::uuid[], $3::bigint[],"
    " $4::uuid[], $5::jsonb[], $6::jsonb[], $7::text[], $8::text[], $9::jsonb[], $10::text[],"
    " $11::bigint[])"
)


def _columns(records: Sequence[RequestRecord]) -> list[list[Any]]:
    return [
        [r.tenant_id for r in records],
        [r.session_id for r in records],
        [r.epoch for r in records],
        [r.run_id for r in records],
        [r.pressure for r in records],
        [r.used for r in records],
        [r.snapshot_id for r in records],
        [r.recall_trace_id for r in records],
        [r.request for r in records],
        [r.head_state for r in records],
        [r.latest_version for r in records],
    ]


def people_named(record: RequestRecord) -> int:
    """How many people fences `record` takes (its request's `people`): what a shared round
    trip's records hold together is bounded by it (store/batches.py, Rule 5)."""
    people = record.request.get("people") if record.request is not None else None
    return len(people) if isinstance(people, list) else 0


async def record_requests(
    pool: Any, records: Sequence[RequestRecord], *, connection: Connect | None = None
) -> list[int | Exception]:
    """Record every request whose locks are free, each answered with its sequence or
    refusal code: BUSY for one whose session or person lock another transaction holds.

    Records are sent sorted by (tenant, session), arrival order kept within a session, so
    a session's sequences follow the order its Builds were made in (but for a BUSY one,
    which lands after those that went on without it). When the statement
    fails for a reason other than PostgreSQL being away, each record is sent again on its
    own, so a record that cannot land fails its own Build only. Should PostgreSQL go away
    meanwhile, the records already answered keep their answers and the rest are answered
    with that StoreUnavailableError, unsent but for the one in flight, which may have
    committed (an audit: one answered with its sequence was failed UNAVAILABLE, its
    request never returned).
    `connection`: where each round trip gets its connection (None: acquired from `pool`
    for each).

    Raises:
        StoreUnavailableError: PostgreSQL is away for the batch's shared statement: every
            record of the batch fails alike.
    """
    connect = connection or partial(acquire, pool)
    order = sorted(range(len(records)), key=lambda n: (records[n].tenant_id, records[n].session_id))
    ordered = [records[n] for n in order]
    try:
        answers = await _nowait(connect, ordered)
    except StoreUnavailableError:
        raise
    except asyncpg.PostgresError:
        if len(ordered) == 1:
            raise
        answers = []
        away: StoreUnavailableError | None = None
        for r in ordered:
            if away is None:
                try:
                    answers.append(await _alone(connect, r))
                    continue
                except StoreUnavailableError as exc:
                    away = exc
            answers.append(away)
    out: list[int | Exception] = [0] * len(records)
    for n, answer in zip(order, answers, strict=True):
        out[n] = answer
    return out


async def record(pool: Any, record: RequestRecord) -> int:
    """One record on a pooled connection of its own, waiting for its session's locks: a
    record the shared round trip answered BUSY.

    Raises:
        StoreUnavailableError: PostgreSQL is away.
        SessionBusyError: a lock it needed stayed held past LOCK_WAIT_SECONDS.
        asyncpg.PostgresError: PostgreSQL refused the record.
    """
    async with acquire(pool) as conn:
        arguments = [c[0] for c in _columns([record])]
        return int(await conn.fetchval(_ONE, *arguments, lock_wait_ms()))


async def _nowait(connect: Connect, records: Sequence[RequestRecord]) -> list[int | Exception]:
    async with connect() as conn:
        if len(records) == 1:  # the common case, without the arrays (migrations/0020)
            return [int(await conn.fetchval(_ONE_NOWAIT, *(c[0] for c in _columns(records))))]
        return list(await conn.fetchval(_NOWAIT, *_columns(records)))


async def _alone(connect: Connect, record: RequestRecord) -> int | Exception:
    """One record of a batch that failed, sent again on its own: its answer, or what
    PostgreSQL refused it with (that Build's error alone)."""
    try:
        (answer,) = await _nowait(connect, [record])
        return answer
    except StoreUnavailableError:
        raise
    except asyncpg.PostgresError as exc:
        refused: Exception = exc
        return refused
