"""Build's round trips shared under load (store/batches.py, store/records.py,
migrations/0011): many Builds at once over several sessions each get the record of their
own request, in their session's order, through fewer round trips than Builds; a record
PostgreSQL refuses fails its own Build only, and a refusal code (an unknown session, an
erased person) stops no other record of the batch."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any
from uuid import UUID

import asyncpg
import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.store import records, runs
from context_engine.store.db import HeldConnection, StoreUnavailableError, acquire
from context_engine.store.records import (
    BUSY,
    NO_SESSION,
    PERSON_ERASED,
    PLAN_INVALIDATED,
    STALE_HEAD,
    RequestRecord,
)

from .helpers import TENANT, assistant, new_id, open_session, replica, start_run, wait_for


async def _runs(stub: Any, sessions: int, runs_per_session: int) -> list[tuple[str, str]]:
    """(session_id, run_id) of fresh runs, each with one completed turn in its session."""
    out = []
    for _ in range(sessions):
        session_id, _ = await open_session(stub)
        for n in range(runs_per_session):
            started = await start_run(stub, session_id, f"question {n}")
            await stub.AppendItems(
                pb.AppendItemsRequest(
                    tenant_id=TENANT,
                    session_id=session_id,
                    run_id=started.run.run_id,
                    expected_checkpoint_version=started.checkpoint_version,
                    items=[assistant(f"answer {n}")],
                )
            )
            out.append((session_id, started.run.run_id))
    return out


def _build(session_id: str, run_id: str) -> pb.BuildRequest:
    request = pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id)
    request.now.FromSeconds(1_790_000_000)
    return request


async def test_concurrent_builds_share_round_trips_and_each_gets_its_own_record(
    pool: Any,
) -> None:
    stub, channel, running = await replica(pool)
    try:
        runs = await _runs(stub, sessions=4, runs_per_session=3)
        requests = [_build(s, r) for s, r in runs] * 4  # every run built four times at once
        heads, writes = running.engine._read_heads, running.engine._record_requests
        before = (heads.calls, heads.round_trips, writes.calls, writes.round_trips)
        built = await asyncio.gather(*(stub.Build(r) for r in requests))
        calls = heads.calls - before[0], writes.calls - before[2]
        trips = heads.round_trips - before[1], writes.round_trips - before[3]
    finally:
        await channel.close()
        await running.stop(0)
    # A Build made from a head this replica kept reads none (Engine.build): the runs built
    # first read theirs, and those built after them confirm it in their record.
    assert len(runs) <= calls[0] <= len(requests) and calls[1] == len(requests)
    # Rounds shared: the 48 records always overlap. The head reads (a dozen, the first
    # Build of each run) overlap only as the event loop interleaves them, which a loaded
    # machine need not do (CI saw 14 reads in 14 rounds); their sharing is
    # tests/unit/test_batches.py's, decided there by the test, not by timing.
    assert trips[0] <= calls[0] and trips[1] < calls[1]
    for request, response in zip(requests, built, strict=True):
        row = await pool.fetchrow(
            "SELECT run_id, payload FROM session_events WHERE tenant_id = $1"
            " AND session_id = $2 AND sequence = $3 AND type = 'model.request.started'",
            TENANT,
            UUID(request.session_id),
            response.request_sequence,
        )
        assert row is not None, "an acknowledged Build has no record"
        assert str(row["run_id"]) == request.run_id
        assert row["payload"]["request_sha256"] == response.request_sha256
    by_session: dict[str, list[int]] = {}
    for request, response in zip(requests, built, strict=True):
        by_session.setdefault(request.session_id, []).append(response.request_sequence)
    for session_id, sequences in by_session.items():
        assert len(set(sequences)) == len(sequences)  # one record per Build
        logged = await pool.fetch(
            "SELECT sequence FROM session_events WHERE tenant_id = $1 AND session_id = $2"
            " AND type = 'model.request.started' ORDER BY sequence",
            TENANT,
            UUID(session_id),
        )
        assert sorted(sequences) == [r["sequence"] for r in logged]


def _record(session_id: str, run_id: str, tenant: str = TENANT, **request: Any) -> RequestRecord:
    return RequestRecord(
        tenant_id=tenant,
        session_id=UUID(session_id),
        epoch=1,
        run_id=UUID(run_id),
        pressure=None,
        used=None,
        snapshot_id="",
        recall_trace_id="",
        request={"run_id": run_id, "probe": True, **request},
    )


async def _probes(pool: Any, session_id: str) -> list[int]:
    rows = await pool.fetch(
        "SELECT sequence FROM session_events WHERE tenant_id = $1 AND session_id = $2"
        " AND type = 'model.request.started' AND payload ? 'probe' ORDER BY sequence",
        TENANT,
        UUID(session_id),
    )
    return [r["sequence"] for r in rows]


@pytest.mark.parametrize("held", [False, True], ids=["pooled", "held"])
async def test_a_record_postgresql_refuses_fails_alone(stub: Any, pool: Any, held: bool) -> None:
    """Also through a held connection (Engine's record batcher, store/db.py
    HeldConnection): the failed batch hands it back, each record is sent again on its own,
    and the next batch acquires one afresh."""
    (session_id, run_id), (other_session, other_run) = await _runs(stub, 2, 1)
    poison = _record(session_id, run_id, tenant="bad\x00tenant")  # text cannot hold U+0000
    connection = HeldConnection(pool) if held else None
    connect = {"connection": connection.use} if connection is not None else {}
    answers = await records.record_requests(
        pool, [_record(session_id, run_id), poison, _record(other_session, other_run)], **connect
    )
    assert isinstance(answers[1], asyncpg.PostgresError)
    assert isinstance(answers[0], int) and isinstance(answers[2], int)
    assert await _probes(pool, session_id) == [answers[0]]
    assert await _probes(pool, other_session) == [answers[2]]
    with pytest.raises(asyncpg.PostgresError):  # alone, the refusal is the caller's error
        await records.record_requests(pool, [poison], **connect)
    after = await records.record_requests(pool, [_record(session_id, run_id)] * 2, **connect)
    assert await _probes(pool, session_id) == [answers[0], *after]
    if connection is not None:
        await connection.release()


async def test_records_answered_before_postgresql_went_away_keep_their_answers(
    stub: Any, pool: Any
) -> None:
    """A batch PostgreSQL refused is sent again record by record; when PostgreSQL went
    away in the middle of that, every Build of the batch was failed UNAVAILABLE, one whose
    record had committed too, so its request was recorded and never returned (an audit).
    The records sent keep their answers; the rest are answered unavailable, unsent."""
    runs_ = sorted(await _runs(stub, 2, 1), key=lambda pair: UUID(pair[0]))
    (first_session, first_run), (second_session, second_run) = runs_
    poison = _record(first_session, first_run, tenant="bad\x00tenant")  # sorts first
    connects = 0

    @asynccontextmanager
    async def connect() -> AsyncIterator[Any]:
        nonlocal connects
        connects += 1
        if connects == 4:  # the batch, the poison alone, the first alone: then it is away
            raise StoreUnavailableError("PostgreSQL went away (simulated)")
        async with acquire(pool) as conn:
            yield conn

    batch = [_record(second_session, second_run), poison, _record(first_session, first_run)]
    answers = await records.record_requests(pool, batch, connection=connect)
    assert isinstance(answers[1], asyncpg.PostgresError)
    assert isinstance(answers[2], int)
    assert await _probes(pool, first_session) == [answers[2]]
    assert isinstance(answers[0], StoreUnavailableError)
    assert await _probes(pool, second_session) == []
    assert connects == 4  # nothing was sent once it was away


async def test_refusal_codes_in_a_batch_stop_no_other_record(stub: Any, pool: Any) -> None:
    (session_id, run_id), (other_session, other_run) = await _runs(stub, 2, 1)
    person = f"person-{new_id()}"
    await stub.EraseSubject(pb.EraseSubjectRequest(tenant_id=TENANT, person_id=person))
    erased = await pool.fetchval(
        "SELECT count(*) FROM erased_people WHERE tenant_id = $1 AND person_sha256 = $2",
        TENANT,
        hashlib.sha256(person.encode()).hexdigest(),
    )
    assert erased == 1
    batch = [
        _record(session_id, run_id),
        _record(new_id(), run_id),  # no such session
        _record(other_session, other_run, people=[person]),  # names an erased person
        _record(other_session, other_run),
        _record(session_id, run_id),
    ]
    answers = await records.record_requests(pool, batch)
    assert answers[1] == NO_SESSION and answers[2] == PERSON_ERASED
    landed = [a for n, a in enumerate(answers) if n not in (1, 2)]
    assert all(isinstance(a, int) and a > 0 for a in landed)
    # Each session's records in the order they were given, nothing of the refused ones.
    assert await _probes(pool, session_id) == [answers[0], answers[4]]
    assert answers[0] < answers[4]  # type: ignore[operator]
    assert await _probes(pool, other_session) == [answers[3]]


async def test_a_record_on_an_invalidated_plan_is_refused_alone(stub: Any, pool: Any) -> None:
    """migrations/0016: the record reads the plan's `invalidated` column, generated from
    the stored plan, so a plan rewritten as invalidated (as an erasure's redaction writes
    it, store/snapshots.py) refuses the records made on it, alone and in a batch, while
    another session's record lands."""
    (session_id, run_id), (other_session, other_run) = await _runs(stub, 2, 1)
    invalidated = "SELECT invalidated FROM context_plans WHERE tenant_id = $1 AND session_id = $2"
    assert await pool.fetchval(invalidated, TENANT, UUID(session_id)) is False
    await pool.execute(
        "UPDATE context_plans SET plan = jsonb_set(plan, '{invalidated}', 'true')"
        " WHERE tenant_id = $1 AND session_id = $2",
        TENANT,
        UUID(session_id),
    )
    assert await pool.fetchval(invalidated, TENANT, UUID(session_id)) is True
    assert await records.record_requests(pool, [_record(session_id, run_id)]) == [PLAN_INVALIDATED]
    batch = [_record(session_id, run_id), _record(other_session, other_run)]
    answers = await records.record_requests(pool, batch)
    assert answers[0] == PLAN_INVALIDATED and isinstance(answers[1], int) and answers[1] > 0
    assert await _probes(pool, session_id) == []
    assert await _probes(pool, other_session) == [answers[1]]


async def test_records_confirming_kept_heads_land_only_where_the_head_holds(
    stub: Any, pool: Any
) -> None:
    """store/records.py, migrations/0013: a record carrying the head its Build was made
    from lands only while that head is the run's (its state, and its latest checkpoint
    version when given); one whose head moved is answered STALE_HEAD and writes nothing,
    alone or in a batch beside records that land."""
    (session_id, run_id), (other_session, other_run) = await _runs(stub, 2, 1)
    head = await runs.read_run_head(pool, TENANT, UUID(session_id), UUID(run_id))

    def confirming(latest: int | None, state: str = head.state) -> RequestRecord:
        plain = _record(session_id, run_id)
        return replace(plain, head_state=state, latest_version=latest)

    moved_state = f"{head.effective_epoch}/{head.skills_loaded + 1}/0/0"
    batch = [
        confirming(head.latest_version),  # holds
        confirming(head.latest_version + 1),  # a newer checkpoint than there is
        confirming(None, moved_state),  # a skill more than the session has
        confirming(None),  # holds; the Build named its version
        _record(other_session, other_run),  # carries no head
    ]
    answers = await records.record_requests(pool, batch)
    assert answers[1] == STALE_HEAD and answers[2] == STALE_HEAD
    assert await _probes(pool, session_id) == [answers[0], answers[3]]
    assert await _probes(pool, other_session) == [answers[4]]
    # Alone, through the one-record statement.
    assert await records.record_requests(pool, [confirming(head.latest_version + 1)]) == [
        STALE_HEAD
    ]
    (alone,) = await records.record_requests(pool, [confirming(head.latest_version)])
    assert await _probes(pool, session_id) == [answers[0], answers[3], alone]


async def _holding(pool: Any, sql: str, *args: Any) -> tuple[Any, Any]:
    """A connection of its own inside a transaction that has run `sql` (taken a lock)."""
    conn = await pool.acquire()
    transaction = conn.transaction()
    await transaction.start()
    await conn.execute(sql, *args)
    return conn, transaction


async def _let_go(pool: Any, held: tuple[Any, Any]) -> None:
    conn, transaction = held
    await transaction.rollback()
    await pool.release(conn)


async def _waiting_for_a_lock(pool: Any) -> bool:
    """Whether some backend of this database waits for a lock (the Build's own record)."""
    return bool(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    )


_LOCK_SESSION = "SELECT 1 FROM sessions WHERE tenant_id = $1 AND session_id = $2 FOR UPDATE"
_LOCK_PERSON = (
    "SELECT pg_advisory_xact_lock(hashtextextended('erasure' || chr(31) || $1 || chr(31) || $2, 0))"
)


async def test_a_record_whose_lock_is_held_is_answered_busy_and_holds_up_no_other(
    stub: Any, pool: Any
) -> None:
    """migrations/0018: the shared round trip takes no lock it would wait for. A record
    whose session row, or whose person's erasure fence, another transaction holds is
    answered BUSY and writes nothing, the others land at once; sent on its own
    (records.record) it waits for that lock alone, and lands once it is let go."""
    (session_id, run_id), (other_session, other_run) = await _runs(stub, 2, 1)
    person = f"person-{new_id()}"
    for lock, args, record in (
        (_LOCK_SESSION, (TENANT, UUID(session_id)), _record(session_id, run_id)),
        (_LOCK_PERSON, (TENANT, person), _record(session_id, run_id, people=[person])),
    ):
        before = await _probes(pool, session_id)
        held = await _holding(pool, lock, *args)
        try:
            answers = await records.record_requests(
                pool, [record, _record(other_session, other_run)]
            )
            assert answers[0] == BUSY and isinstance(answers[1], int) and answers[1] > 0
            # Alone, through the one-record function (migrations/0020), the same.
            assert await records.record_requests(pool, [record]) == [BUSY]
            assert await _probes(pool, session_id) == before
            waiting = asyncio.create_task(records.record(pool, record))
            # Another session's records land while this one waits for its lock.
            (more,) = await records.record_requests(pool, [_record(other_session, other_run)])
            assert isinstance(more, int) and more > answers[1]
            assert not waiting.done()
        finally:
            await _let_go(pool, held)
        landed = await waiting
        assert await _probes(pool, session_id) == [*before, landed]


async def test_a_build_waiting_for_its_sessions_lock_holds_up_no_other_sessions_build(
    pool: Any,
) -> None:
    """An audit: while one session's lock was held (a compaction's commit, an erasure),
    every other Build of the replica waited in the shared record round trip behind it, and
    failed UNAVAILABLE past the statement timeout. Now the locked session's Build waits
    alone and lands once the lock is let go; another session's Build is answered
    meanwhile, on the same replica."""
    stub, channel, running = await replica(pool)
    try:
        (session_id, run_id), (other_session, other_run) = await _runs(stub, 2, 1)
        held = await _holding(pool, _LOCK_SESSION, TENANT, UUID(session_id))
        try:
            locked = asyncio.ensure_future(stub.Build(_build(session_id, run_id)))
            await wait_for(lambda: _waiting_for_a_lock(pool), timeout=10, what="a lock wait")
            other = await stub.Build(_build(other_session, other_run))
            assert other.request_sequence > 0
            assert not locked.done()
        finally:
            await _let_go(pool, held)
        assert (await locked).request_sequence > 0
    finally:
        await channel.close()
        await running.stop(0)


async def test_a_busy_record_sent_alone_checks_its_head_after_the_write_it_waited_for(
    stub: Any, pool: Any
) -> None:
    """A record answered BUSY is sent on its own and waits for the lock; the write that
    held the lock may move the run's head, and the record is then STALE_HEAD (its Build is
    made again), not written from the head it had. Before, the head was checked before the
    wait (a review)."""
    (session_id, run_id), _ = await _runs(stub, 2, 1)
    head = await runs.read_run_head(pool, TENANT, UUID(session_id), UUID(run_id))
    record = replace(
        _record(session_id, run_id), head_state=head.state, latest_version=head.latest_version
    )
    held = await _holding(pool, _LOCK_SESSION, TENANT, UUID(session_id))
    try:
        (answer,) = await records.record_requests(pool, [record])
        assert answer == BUSY
        waiting = asyncio.create_task(records.record(pool, record))
        await wait_for(lambda: _waiting_for_a_lock(pool), timeout=10, what="the resend's wait")
        # The lock holder's write moves the head (a revision, as an erasure's rewrite).
        await held[0].execute(
            "UPDATE sessions SET plans_revision = plans_revision + 1"
            " WHERE tenant_id = $1 AND session_id = $2",
            TENANT,
            UUID(session_id),
        )
    finally:
        await held[1].commit()
        await pool.release(held[0])
    assert await waiting == STALE_HEAD
    assert await _probes(pool, session_id) == []


async def test_records_waiting_for_a_lock_leave_the_pool_to_everyone_else(
    database_dsn: str,
) -> None:
    """Each Build whose record is BUSY waits on a connection of its own; with many at once
    (an erasure locking the people of many sessions) they took the whole pool, and every
    other session's Build failed UNAVAILABLE (a review). At most half the pool waits."""
    from context_engine.store import connect_pool

    small = await connect_pool(database_dsn, min_size=1, max_size=4)
    stub, channel, running = await replica(small)
    try:
        (session_id, run_id), (other_session, other_run) = await _runs(stub, 2, 1)
        held = await _holding(small, _LOCK_SESSION, TENANT, UUID(session_id))
        try:
            locked = [
                asyncio.ensure_future(stub.Build(_build(session_id, run_id))) for _ in range(6)
            ]
            await wait_for(lambda: _waiting_for_a_lock(small), timeout=10, what="a lock wait")
            other = await stub.Build(_build(other_session, other_run))
            assert other.request_sequence > 0
            assert not any(b.done() for b in locked)
        finally:
            await _let_go(small, held)
        assert all(b.request_sequence > 0 for b in await asyncio.gather(*locked))
    finally:
        await channel.close()
        await running.stop(0)
        await small.close()
