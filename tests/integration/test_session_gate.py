"""Writes queued on one busy session take no other session's connections, and a lock wait
past the store's limit is SESSION_BUSY, not "the database is unavailable"
(api/session_gate.py, store/db.py LOCK_WAIT_SECONDS)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import asyncpg
import grpc
import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine.api.server import build_engine, build_server
from context_engine.api.session_gate import SessionGates
from context_engine.store import db
from context_engine.store.db import SessionBusyError, connect_pool
from context_engine.store.snapshots import _PERSON_LOCK

from .helpers import assistant, details, new_id, spec

POOL_SIZE = 4


async def _serve(dsn: str, lock_wait: float) -> AsyncIterator[tuple[Any, Any]]:
    pool = await connect_pool(dsn, min_size=1, max_size=POOL_SIZE)
    engine = build_engine(pool)
    engine.gates = SessionGates(wait_seconds=lock_wait)
    running = await build_server(engine, "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield engine, pb_grpc.ContextEngineStub(channel)
    finally:
        await channel.close()
        await running.stop(0)
        await pool.close()


@pytest.fixture
async def slow_locks(database_dsn: str) -> AsyncIterator[tuple[Any, Any]]:
    """A server whose writes wait the default 8 s for a session: longer than a pooled
    connection is waited for (5 s)."""
    async for served in _serve(database_dsn, 8.0):
        yield served


@pytest.fixture
async def quick_locks(
    database_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Any, Any]]:
    """A server whose writes wait 0.5 s for a session (store/db.py LOCK_WAIT_SECONDS)."""
    monkeypatch.setattr(db, "LOCK_WAIT_SECONDS", 0.5)
    async for served in _serve(database_dsn, 0.5):
        yield served


async def _session(stub: Any, tenant: str) -> tuple[str, str]:
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=spec()))
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=tenant, session_id=session_id, user_message=pb.UserMessage(text="Hi.")
        )
    )
    return session_id, started.run.run_id


def _append(stub: Any, tenant: str, session_id: str, run_id: str, key: str) -> Any:
    return stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=tenant,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=1,
            idempotency_key=key,
            items=[assistant("Noted.")],
        )
    )


async def _hold(dsn: str, tenant: str, session_id: str) -> asyncpg.Connection:
    """Another writer's transaction holding the session's row lock."""
    conn = await asyncpg.connect(dsn)
    await conn.execute("BEGIN")
    await conn.execute(
        "SELECT 1 FROM sessions WHERE tenant_id = $1 AND session_id = $2 FOR UPDATE",
        tenant,
        UUID(session_id),
    )
    return conn


async def test_writes_queued_on_a_busy_session_leave_the_pool_to_other_sessions(
    slow_locks: tuple[Any, Any], database_dsn: str
) -> None:
    """Twice the pool's connections' worth of AppendItems wait on one session another
    transaction holds. Another tenant's write is served meanwhile: the waiters queue on
    the session's gate, one of them on a connection (an audit: they took the whole pool,
    and every other call on the replica failed UNAVAILABLE after the 5 s pool wait). Once
    the lock is let go, each waiter is answered: one append lands, the others conflict on
    the version it took, and no gate is left behind."""
    engine, stub = slow_locks
    hot, hot_run = await _session(stub, "tenant-hot")
    other, other_run = await _session(stub, "tenant-other")
    holder = await _hold(database_dsn, "tenant-hot", hot)
    try:
        waiting = [
            asyncio.ensure_future(_append(stub, "tenant-hot", hot, hot_run, f"k{n}"))
            for n in range(2 * POOL_SIZE)
        ]
        await asyncio.sleep(0.3)  # all of them asked; none can be answered yet
        assert not any(w.done() for w in waiting)
        served = await _append(stub, "tenant-other", other, other_run, "k")
        assert served.checkpoint_version == 2
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()
    outcomes = await asyncio.gather(*waiting, return_exceptions=True)
    landed = [o for o in outcomes if not isinstance(o, BaseException)]
    assert [o.checkpoint_version for o in landed] == [2]
    for refused in (o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)):
        assert refused.code() == grpc.StatusCode.ABORTED
        assert details(refused)[0] == "CHECKPOINT_VERSION_CONFLICT"
    assert len(landed) + sum(isinstance(o, grpc.aio.AioRpcError) for o in outcomes) == len(waiting)
    assert len(engine.gates) == 0


async def test_a_lock_wait_past_the_limit_is_session_busy_and_writes_nothing(
    quick_locks: tuple[Any, Any], database_dsn: str
) -> None:
    """PostgreSQL is up; the session is held by another transaction past the store's lock
    wait (0.5 s here): ABORTED SESSION_BUSY, nothing written, and the same idempotency key
    lands once the session is free. It was the pool's command timeout, answered as
    UNAVAILABLE STORE_UNAVAILABLE."""
    _, stub = quick_locks
    session_id, run_id = await _session(stub, "tenant-busy")
    holder = await _hold(database_dsn, "tenant-busy", session_id)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await _append(stub, "tenant-busy", session_id, run_id, "k1")
        assert busy.value.code() == grpc.StatusCode.ABORTED
        assert details(busy.value)[0] == "SESSION_BUSY"
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()
    landed = await _append(stub, "tenant-busy", session_id, run_id, "k1")
    assert landed.checkpoint_version == 2


async def test_a_build_whose_record_waits_past_the_limit_is_session_busy(
    quick_locks: tuple[Any, Any], database_dsn: str
) -> None:
    """A Build records its request under the session's lock: held past the lock wait by
    another transaction, the Build (twice, from the run head this replica kept: a busy
    session is not retried from a head read afresh) is ABORTED SESSION_BUSY, records
    nothing, and leaves no gate; once the session is free it records."""
    engine, stub = quick_locks
    session_id, run_id = await _session(stub, "tenant-build")
    build = pb.BuildRequest(tenant_id="tenant-build", session_id=session_id, run_id=run_id)
    first = await stub.Build(build)  # this replica now keeps the run's head
    holder = await _hold(database_dsn, "tenant-build", session_id)
    try:
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await stub.Build(build)
            assert busy.value.code() == grpc.StatusCode.ABORTED
            assert details(busy.value)[0] == "SESSION_BUSY"
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()
    assert len(engine.gates) == 0
    again = await stub.Build(build)
    assert again.request_sequence == first.request_sequence + 1


async def test_a_persons_fence_held_past_the_limit_is_session_busy(
    quick_locks: tuple[Any, Any], database_dsn: str
) -> None:
    """Every lock a write waits for is bounded alike, not only the session's row: a Plan
    whose snapshot names a person an erasure is fencing waits on the person's fence first
    (a review: that wait ran into the 10 s statement timeout, answered UNAVAILABLE, which
    the clients' channels resend, each resend holding a connection as long)."""
    _, stub = quick_locks
    holder = await asyncpg.connect(database_dsn)
    await holder.execute("BEGIN")
    await holder.execute(
        "SELECT pg_advisory_xact_lock(" + _PERSON_LOCK.format(person="$2") + ")",
        "tenant-fence",
        "person-1",
    )
    memory = pb.MemoryItem(item_id="m1", text="Prefers trains.", person_ids=["person-1"])
    planned = spec(snapshot=pb.MemorySnapshot(snapshot_id="s1", items=[memory]))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await stub.Plan(
                pb.PlanRequest(tenant_id="tenant-fence", session_id=new_id(), spec=planned)
            )
        assert busy.value.code() == grpc.StatusCode.ABORTED
        assert details(busy.value)[0] == "SESSION_BUSY"
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()


async def test_a_gate_not_free_within_the_wait_is_session_busy() -> None:
    """A write waiting on the gate, behind one that holds it, gives up after the wait."""
    gates = SessionGates(wait_seconds=0.05)
    session = UUID(new_id())
    async with gates.held("t", session):
        with pytest.raises(SessionBusyError) as busy:
            async with gates.held("t", session):
                pass
        assert busy.value.reason == "SESSION_BUSY"
        assert busy.value.metadata == {"waited_seconds": "0.05"}
        async with gates.held("t", UUID(new_id())):  # another session's is its own
            assert len(gates) == 2
    assert len(gates) == 0
