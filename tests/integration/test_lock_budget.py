"""A statement that waits for several locks in turn waits for all of them within one
budget (store/db.py LOCK_WAIT_SECONDS, migrations/0022), so waiting is SESSION_BUSY, never
the pool's statement timeout. The locks are held by other connections of the test; the
budget and the pool's command timeout are shortened so each test takes a second or two."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from uuid import UUID

import asyncpg
import grpc
import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.store import connect_pool, db, records, snapshots
from context_engine.store.db import SessionBusyError, transaction
from context_engine.store.records import RequestRecord

from .helpers import TENANT, details, new_id, open_session, start_run

pytestmark = pytest.mark.integration

BUDGET = 1.0  # LOCK_WAIT_SECONDS here
COMMAND_TIMEOUT = 1.6  # the pool's: past the budget, short of two waits of it
FENCE = "SELECT hashtextextended('erasure' || chr(31) || $1 || chr(31) || $2, 0)"


@asynccontextmanager
async def _held(dsn: str, statement: str, *args: Any, for_seconds: float) -> AsyncIterator[None]:
    """A lock `statement` takes on a connection of its own, in a transaction that ends
    `for_seconds` later (in the background) or when the block ends."""
    conn = await asyncpg.connect(dsn)
    transaction = conn.transaction()
    await transaction.start()
    await conn.execute(statement, *args)

    async def release() -> None:
        await asyncio.sleep(for_seconds)
        await transaction.rollback()

    ending = asyncio.ensure_future(release())
    try:
        yield
    finally:
        if not ending.done():
            ending.cancel()
            await transaction.rollback()
        await conn.close()


async def _by_key(dsn: str, people: Sequence[str]) -> list[str]:
    """`people` in the order their fences are taken (by lock key)."""
    conn = await asyncpg.connect(dsn)
    try:
        keys = {p: await conn.fetchval(FENCE, TENANT, p) for p in people}
    finally:
        await conn.close()
    return sorted(people, key=keys.__getitem__)


@pytest.fixture
async def short_pool(database_dsn: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    monkeypatch.setattr(db, "LOCK_WAIT_SECONDS", BUDGET)
    pool = await connect_pool(database_dsn, min_size=1, max_size=2, command_timeout=COMMAND_TIMEOUT)
    yield pool
    await pool.close()


async def test_a_busy_record_waits_for_its_fence_and_its_row_within_one_budget(
    stub: Any, database_dsn: str, short_pool: Any
) -> None:
    """A Build's record answered busy waits on its own for the person it names, then its
    session's row: each wait had the whole budget, and the two outlasted the statement's
    timeout, STORE_UNAVAILABLE with PostgreSQL up (an audit). It is SESSION_BUSY now."""
    session_id, plan = await open_session(stub)
    run_id = (await start_run(stub, session_id, "Hello")).run.run_id
    person = f"ana-{new_id()}"
    record = RequestRecord(
        tenant_id=TENANT,
        session_id=UUID(session_id),
        epoch=plan.epoch,
        run_id=UUID(run_id),
        pressure=None,
        used=None,
        snapshot_id="",
        recall_trace_id="",
        request={"people": [person]},
    )
    fence = f"SELECT pg_advisory_xact_lock(({FENCE}))"
    row = "SELECT 1 FROM sessions WHERE tenant_id = $1 AND session_id = $2 FOR UPDATE"
    async with (
        _held(database_dsn, fence, TENANT, person, for_seconds=0.9 * BUDGET),
        _held(database_dsn, row, TENANT, UUID(session_id), for_seconds=10),
    ):
        with pytest.raises(SessionBusyError):
            await asyncio.wait_for(records.record(short_pool, record), 30)


async def test_fences_of_people_erased_one_after_another_are_waited_for_within_one_budget(
    database_dsn: str, short_pool: Any
) -> None:
    """Plan's, Rotate's and a recall's people fences, taken in one statement: one wait
    each, so two people being erased in turn outlasted the statement's timeout."""
    first, second = await _by_key(database_dsn, [f"ana-{new_id()}", f"bo-{new_id()}"])
    fence = f"SELECT pg_advisory_xact_lock(({FENCE}))"
    async with (
        _held(database_dsn, fence, TENANT, first, for_seconds=0.9 * BUDGET),
        _held(database_dsn, fence, TENANT, second, for_seconds=10),
    ):
        with pytest.raises(SessionBusyError):
            async with transaction(short_pool) as conn:
                await asyncio.wait_for(snapshots.fence_people(conn, TENANT, [first, second]), 30)


async def test_an_erasure_a_session_kept_busy_says_what_it_did_and_to_resend(
    stub: Any, database_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An erasure redacts each session in a transaction of its own: one kept busy answers
    SESSION_BUSY once the person is recorded as erased and the sessions before it are
    redacted. Its message said "nothing was written: retry under the idempotency key",
    neither of which holds for EraseSubject (an audit). It says what was done and to
    resend, which finishes the erasure."""
    monkeypatch.setattr(db, "LOCK_WAIT_SECONDS", BUDGET)
    person = f"ana-{new_id()}"
    snapshot = pb.MemorySnapshot(
        snapshot_id="snap-1", items=[pb.MemoryItem(item_id="m1", text="Ana", person_ids=[person])]
    )
    session_id, _ = await open_session(stub, snapshot=snapshot)
    row = "SELECT 1 FROM sessions WHERE tenant_id = $1 AND session_id = $2 FOR UPDATE"
    erase = pb.EraseSubjectRequest(tenant_id=TENANT, person_id=person)
    async with _held(database_dsn, row, TENANT, UUID(session_id), for_seconds=10):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.EraseSubject(erase)
    assert caught.value.code() is grpc.StatusCode.ABORTED
    assert details(caught.value)[0] == "SESSION_BUSY"
    message = caught.value.details() or ""
    assert "recorded as erased" in message and "resend EraseSubject" in message
    assert "nothing was written" not in message
    assert list((await stub.EraseSubject(erase)).invalidated_session_ids) == [session_id]
