"""Two replicas over one PostgreSQL, each with its own pool and server: writes racing under
the same idempotency key take effect exactly once, and every caller gets the same answer;
usage reports racing for one tenant's correction factor each count once.

Where a race is the point, it is made certain rather than hoped for (`_overlapping`): a
side connection holds the session's row lock while one call per replica is sent, and is
released only once PostgreSQL shows both calls waiting on it, so neither replica has
answered before the other has started; sequential calls would pass the same assertions."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from uuid import UUID

import asyncpg
import grpc
import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from .helpers import TENANT, assistant, call, new_id, open_session, result, spec, wait_for
from .test_lifecycle import _lock_session, _lock_waiters


@pytest.fixture
async def replicas(database_dsn: str) -> AsyncIterator[list[Any]]:
    from context_engine.api.server import build_engine, build_server
    from context_engine.store import connect_pool

    pools, servers, channels = [], [], []
    for _ in range(2):
        pool = await connect_pool(database_dsn, min_size=1, max_size=4)
        running = await build_server(build_engine(pool), "127.0.0.1:0")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        pools.append(pool)
        servers.append(running)
        channels.append(channel)
    yield [pb_grpc.ContextEngineStub(c) for c in channels]
    for channel in channels:
        await channel.close()
    for running in servers:
        await running.stop(0)
    for pool in pools:
        await pool.close()


def _start(session_id: str, key: str) -> pb.StartRunRequest:
    """A run's start under idempotency key `key`."""
    return pb.StartRunRequest(
        tenant_id=TENANT,
        session_id=session_id,
        idempotency_key=key,
        user_message=pb.UserMessage(text="one run, please"),
    )


def _append(session_id: str, run_id: str, key: str) -> pb.AppendItemsRequest:
    """A tool pair and an answer appended to the run's first checkpoint under `key`."""
    return pb.AppendItemsRequest(
        tenant_id=TENANT,
        session_id=session_id,
        run_id=run_id,
        expected_checkpoint_version=1,
        idempotency_key=key,
        items=[call("c1"), result("c1", "page"), assistant("done")],
    )


async def test_idempotent_writes_take_effect_once_across_replicas(
    replicas: list[Any], pool: Any
) -> None:
    first, second = replicas
    session_id, _ = await open_session(first)
    start = _start(session_id, "start-1")
    started = await asyncio.gather(*(r.StartRun(start) for r in replicas * 3))
    assert len({s.SerializeToString(deterministic=True) for s in started}) == 1
    run_id = started[0].run.run_id

    append = _append(session_id, run_id, "append-1")
    appended = await asyncio.gather(*(r.AppendItems(append) for r in (first, second) * 3))
    assert len({a.SerializeToString(deterministic=True) for a in appended}) == 1
    assert appended[0].checkpoint_version == 2

    sid = UUID(session_id)
    runs = await pool.fetchval("SELECT count(*) FROM runs WHERE session_id = $1", sid)
    items = await pool.fetchval(
        "SELECT count(*) FROM session_events WHERE session_id = $1 AND item_id IS NOT NULL", sid
    )
    versions = await pool.fetchval(
        "SELECT max(version) FROM run_checkpoints WHERE run_id = $1", UUID(run_id)
    )
    assert (runs, items, versions) == (1, 4, 2)  # the seeding message + three items


async def _overlapping(
    dsn: str, session_id: str, calls: list[Callable[[], Awaitable[Any]]]
) -> list[Any]:
    """Run `calls` at once, each held in PostgreSQL on the session's row lock until all of
    them wait there; their answers, or the errors they raised."""
    locker = await _lock_session(dsn, session_id)
    try:
        tasks = [asyncio.ensure_future(c()) for c in calls]

        async def all_waiting() -> bool:
            return await _lock_waiters(locker) >= len(calls)

        await wait_for(all_waiting, what=f"{len(calls)} calls waiting on the session lock")
    finally:
        await locker.execute("ROLLBACK")
        await locker.close()
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_keyed_writes_that_overlap_on_two_replicas_take_effect_once(
    replicas: list[Any], pool: Any, database_dsn: str
) -> None:
    """StartRun, AppendItems and Rotate, each sent to both replicas under one key while
    both calls are provably in flight: one effect each, the same answer to both callers.
    And Rotate without a key, overlapping: one epoch, the other caller ABORTED."""
    session_id, _ = await open_session(replicas[0])
    sid = UUID(session_id)

    def on_both(method: str, request: Any) -> list[Callable[[], Awaitable[Any]]]:
        return [lambda r=r: getattr(r, method)(request) for r in replicas]

    start = _start(session_id, "start-overlap")
    started = await _overlapping(database_dsn, session_id, on_both("StartRun", start))
    assert len({s.SerializeToString(deterministic=True) for s in started}) == 1, started
    run_id = started[0].run.run_id

    append = _append(session_id, run_id, "append-overlap")
    appended = await _overlapping(database_dsn, session_id, on_both("AppendItems", append))
    assert len({a.SerializeToString(deterministic=True) for a in appended}) == 1, appended
    assert appended[0].checkpoint_version == 2

    changed = spec()
    changed.agent.version = "4"
    rotate = pb.RotateRequest(
        tenant_id=TENANT,
        session_id=session_id,
        from_epoch=1,
        reason=pb.PLAN_REASON_AGENT_CHANGED,
        spec=changed,
        idempotency_key="rotate-overlap",
    )
    rotated = await _overlapping(database_dsn, session_id, on_both("Rotate", rotate))
    assert len({r.SerializeToString(deterministic=True) for r in rotated}) == 1, rotated
    assert rotated[0].plan.epoch == 2

    unkeyed = pb.RotateRequest()
    unkeyed.CopyFrom(rotate)
    unkeyed.from_epoch, unkeyed.idempotency_key = 2, ""
    unkeyed.spec.agent.version = "5"
    outcomes = await _overlapping(database_dsn, session_id, on_both("Rotate", unkeyed))
    winners = [o for o in outcomes if isinstance(o, pb.RotateResponse)]
    losers = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert [w.plan.epoch for w in winners] == [3], outcomes
    assert [e.code() for e in losers] == [grpc.StatusCode.ABORTED], outcomes

    counts = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM runs WHERE session_id = $1) AS runs,"
        " (SELECT count(*) FROM session_events WHERE session_id = $1"
        "  AND item_id IS NOT NULL) AS items,"
        " (SELECT count(*) FROM session_events WHERE session_id = $1"
        "  AND type = 'context.epoch.rotated') AS rotations,"
        " (SELECT max(version) FROM run_checkpoints WHERE run_id = $2) AS version",
        sid,
        UUID(run_id),
    )
    # The seeding message and three items; two rotations (keyed once, unkeyed once).
    assert dict(counts) == {"runs": 1, "items": 4, "rotations": 2, "version": 2}


async def test_a_replica_extending_its_kept_log_builds_what_a_cold_one_builds(
    replicas: list[Any],
) -> None:
    """A replica keeps the log it has read and reads only the turns since (api/engine.py,
    Engine._logged); one that has read nothing reads it all. Every run's Build is the same
    request either way, call ids reused across runs included."""
    warm, cold = replicas
    session_id, _ = await open_session(warm)
    now = pb.BuildRequest().now
    now.FromSeconds(1_790_000_000)
    built: list[tuple[pb.BuildRequest, pb.BuildResponse]] = []
    for turn in range(4):
        started = await warm.StartRun(
            pb.StartRunRequest(
                tenant_id=TENANT,
                session_id=session_id,
                user_message=pb.UserMessage(text=f"question {turn}"),
            )
        )
        run_id = started.run.run_id
        build = pb.BuildRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=run_id,
            checkpoint_version=started.checkpoint_version,
            now=now,
        )
        built.append((build, await warm.Build(build)))  # the first Build of each run
        await warm.AppendItems(
            pb.AppendItemsRequest(
                tenant_id=TENANT,
                session_id=session_id,
                run_id=run_id,
                expected_checkpoint_version=started.checkpoint_version,
                items=[call("c1"), result("c1", f"page {turn}"), assistant(f"answer {turn}")],
            )
        )
    # Newest run first: the cold replica reads each run's log whole (an older run's seed
    # lies below what it has kept), so nothing it builds comes from an extension.
    for build, response in reversed(built):
        again = await cold.Build(build)
        assert again.request_sha256 == response.request_sha256
        assert again.provider_payload == response.provider_payload
    assert len({r.request_sha256 for _, r in built}) == len(built)


async def _built(stub: Any, tenant: str) -> tuple[str, pb.BuildResponse]:
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=spec()))
    run = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=tenant, session_id=session_id, user_message=pb.UserMessage(text="hello")
        )
    )
    request = pb.BuildRequest(tenant_id=tenant, session_id=session_id, run_id=run.run.run_id)
    request.now.FromSeconds(1_790_000_000)
    return session_id, await stub.Build(request)


async def test_first_usage_reports_racing_on_two_replicas_each_count_once(
    replicas: list[Any], pool: Any
) -> None:
    """Four sessions of one tenant report their first request's usage at once, on
    alternating replicas. The session lock does not order them, and no correction row
    exists yet to lock: each absorbed report must still be one sample of the tenant's
    factor (api/usage.py, Rule 3). Repeated on fresh tenants, as the race needs overlap."""
    model = spec().model_id
    lost: list[tuple[int, int]] = []
    for _ in range(6):
        tenant = f"usage-race-{uuid.uuid4().hex[:10]}"
        built = [await _built(replicas[n % 2], tenant) for n in range(4)]
        await asyncio.gather(
            *(
                replicas[n % 2].ReportUsage(
                    pb.ReportUsageRequest(
                        tenant_id=tenant,
                        session_id=session_id,
                        request_sequence=b.request_sequence,
                        model_id=model,
                        input_tokens=b.estimated_input_tokens * 2,
                        output_tokens=10,
                        idempotency_key=f"u-{n}",
                    )
                )
                for n, (session_id, b) in enumerate(built)
            )
        )
        samples = await pool.fetchval(
            "SELECT samples FROM estimator_corrections WHERE tenant_id = $1 AND model_id = $2",
            tenant,
            model,
        )
        absorbed = await pool.fetchval(
            "SELECT count(*) FROM usage_reports WHERE tenant_id = $1 AND absorbed", tenant
        )
        if (samples, absorbed) != (4, 4):
            lost.append((absorbed, samples))
    assert lost == [], "(absorbed reports, samples in the factor) of the attempts that lost some"


async def test_what_a_replica_keeps_is_weighed_in_bytes(stub: Any, grpc_server: Any) -> None:
    """A replica's kept checkpoints and histories were bounded by items held (weight: item
    count + 1): a checkpoint whose one item is a 3 MB tool result (one request, under
    max_request_bytes) weighed 2, so a full cache of such sessions held ~300 GiB. The
    weight is now the bytes held, so the budget (replica_cache_bytes) bounds memory."""
    from context_engine.api.kept import DEFAULT_CACHE_BYTES

    kept = grpc_server.engine._kept
    tenant = f"kept-{uuid.uuid4().hex[:12]}"
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=spec()))
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=tenant, session_id=session_id, user_message=pb.UserMessage(text="fetch")
        )
    )
    big = "lorem ipsum " * 250_000  # 3 MB
    await stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=tenant,
            session_id=session_id,
            run_id=started.run.run_id,
            expected_checkpoint_version=started.checkpoint_version,
            items=[call("c1"), result("c1", big), assistant("Fetched.")],
        )
    )
    await stub.Build(
        pb.BuildRequest(tenant_id=tenant, session_id=session_id, run_id=started.run.run_id)
    )
    mine = [(value, weight) for key, (value, weight) in kept._entries.items() if tenant in key]
    checkpoints = [v for v, _ in mine if hasattr(v, "items") and not isinstance(v, tuple)]
    assert checkpoints and any(big in getattr(i, "content", "") for i in checkpoints[0].items)
    # The checkpoint holding the result weighs at least its bytes; what is kept in all
    # stays within the budget (three quarters of replica_cache_bytes; plans have the rest).
    assert sum(w for _, w in mine) >= len(big)
    assert kept._max + grpc_server.engine._plans._max == DEFAULT_CACHE_BYTES
    assert kept._weight <= kept._max


async def test_a_fresh_head_build_takes_the_skills_its_head_counted(
    replicas: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Build that reads its run's head, then the session's loaded skills, uses only the
    skills the head counted: one loaded in between (after a Rotate on another replica put
    it in the catalog) belongs with a later plan than the head's, and the record of a head
    read now confirms nothing, so the request would mix the two (an audit). The window
    between the two reads is made certain: the skills read itself lets the other replica
    rotate and load first."""
    from context_engine.store import skills as skill_store

    a, b = replicas
    session_id = new_id()
    triage = pb.SkillCatalogEntry(name="triage", description="Sort.", version="1")
    first = spec()
    first.skills.append(triage)
    await b.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=first))
    started = await b.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text="hi")
        )
    )
    run_id = started.run.run_id
    await b.LoadSkill(
        pb.LoadSkillRequest(
            tenant_id=TENANT, session_id=session_id, name="triage", body="Triage body."
        )
    )
    read_loaded = skill_store.read_loaded
    fired: list[bool] = []  # once: LoadSkill reads the loaded skills too
    meanwhile: list[int] = []

    async def rotating_first(conn: Any, tenant: str, session: str) -> Any:
        if not fired:
            fired.append(True)
            second = spec()
            second.skills.extend(
                [triage, pb.SkillCatalogEntry(name="refunds", description="Refunds.", version="2")]
            )
            rotated = await b.Rotate(
                pb.RotateRequest(
                    tenant_id=TENANT,
                    session_id=session_id,
                    from_epoch=1,
                    reason=pb.PLAN_REASON_AGENT_CHANGED,
                    spec=second,
                )
            )
            await b.LoadSkill(
                pb.LoadSkillRequest(
                    tenant_id=TENANT, session_id=session_id, name="refunds", body="Refunds body."
                )
            )
            meanwhile.append(rotated.plan.epoch)
        return await read_loaded(conn, tenant, session)

    monkeypatch.setattr(skill_store, "read_loaded", rotating_first)
    built = await a.Build(pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id))
    assert meanwhile == [2] and built.epoch == 1
    bodies = {
        block.item_id
        for message in built.request.messages
        for block in message.blocks
        if block.item_id.startswith("skill-body:")
    }
    assert bodies == {"skill-body:triage"}
    again = await a.Build(pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id))
    assert again.epoch == 2


async def test_a_keyed_rotate_resent_behind_an_erasure_answers_with_its_first_plan(
    replicas: list[Any], database_dsn: str
) -> None:
    """A Rotate whose snapshot names a person, in flight on one replica, an erasure of that
    person after it, and the Rotate's resend on the other replica: the resend waited for
    the people fence behind the erasure, which the first call let through once it landed,
    and was refused PERSON_ERASED, though its rotation exists (an audit). It answers with
    the first call's plan; a new rotation naming the person is still refused."""
    session_id, _ = await open_session(replicas[0])
    named = spec()
    named.agent.version = "4"
    named.snapshot.CopyFrom(
        pb.MemorySnapshot(
            snapshot_id="snap-2",
            recall_trace_id="t",
            watermark=1,
            items=[
                pb.MemoryItem(
                    item_id="m1", text="Lives in Berlin.", source="memory:1", person_ids=["p-x"]
                )
            ],
        )
    )
    rotate = pb.RotateRequest(
        tenant_id=TENANT,
        session_id=session_id,
        from_epoch=1,
        reason=pb.PLAN_REASON_SNAPSHOT_INVALIDATED,
        spec=named,
        idempotency_key="rotate-behind-erasure",
    )
    locker = await _lock_session(database_dsn, session_id)
    monitor = await asyncpg.connect(database_dsn)
    try:
        calls = [
            lambda: replicas[0].Rotate(rotate),  # fenced, then waits on the session's row
            lambda: replicas[0].EraseSubject(
                pb.EraseSubjectRequest(tenant_id=TENANT, person_id="p-x")
            ),  # waits for the fence the Rotate holds
            lambda: replicas[1].Rotate(rotate),  # the resend: waits behind the erasure
        ]
        tasks = []
        for n, send in enumerate(calls, start=1):
            tasks.append(asyncio.ensure_future(send()))

            async def waiting(n: int = n) -> bool:
                # Any lock, the people fence's advisory ones too, held up by another.
                blocked = "SELECT count(DISTINCT pid) FROM pg_locks WHERE NOT granted"
                return int(await monitor.fetchval(blocked)) >= n

            await wait_for(waiting, what=f"{n} calls waiting")
    finally:
        await monitor.close()
        await locker.execute("ROLLBACK")
        await locker.close()
    first, erased, resent = await asyncio.gather(*tasks)
    assert first.plan.epoch == 2 and erased.redacted_items >= 1
    assert resent.plan.epoch == 2
    fresh = pb.RotateRequest()
    fresh.CopyFrom(rotate)
    fresh.from_epoch, fresh.idempotency_key = 2, "another"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await replicas[1].Rotate(fresh)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
