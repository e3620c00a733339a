"""A replica's later Builds of a run are made from the run head it kept, confirmed by the
record in the same round trip (api/engine.py Engine.build, store/records.py): one round
trip, not two. A head another replica moved meanwhile (items appended, the plan rotated)
writes nothing and is built again from a fresh read, so the answer is what a Build that
read the head would give; the SQL that confirms a head reads what the head read reads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from uuid import UUID

import grpc
import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.store import runs

from .helpers import (
    TENANT,
    append_items,
    assistant,
    build_request,
    details,
    heads_agree,
    new_id,
    open_session,
    replica,
    spec,
    start_run,
    update_state,
    wait_for,
)


@pytest.fixture
async def two(pool: Any) -> Any:
    """Two replicas over one database: (stub, engine) each."""
    made = [await replica(pool), await replica(pool)]
    yield [(stub, running.engine) for stub, _, running in made]
    for _, channel, running in made:
        await channel.close()
        await running.stop(0)


async def _requests(pool: Any, session_id: str) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        "SELECT payload FROM session_events WHERE tenant_id = $1 AND session_id = $2"
        " AND type = 'model.request.started' ORDER BY sequence",
        TENANT,
        UUID(session_id),
    )
    return [r["payload"] for r in rows]


def _texts(response: pb.BuildResponse) -> str:
    return " ".join(b.text for m in response.request.messages for b in m.blocks)


def _with_skill() -> pb.PlanSpec:
    out = spec()
    out.skills.append(
        pb.SkillCatalogEntry(name="trip-planning", description="Plans trips.", version="1")
    )
    return out


def _new_agent() -> pb.PlanSpec:
    out = _with_skill()
    out.agent.version, out.agent.instructions = "4", "New instructions."
    return out


def _rotation(session_id: str, from_epoch: int) -> pb.RotateRequest:
    return pb.RotateRequest(
        tenant_id=TENANT,
        session_id=session_id,
        from_epoch=from_epoch,
        reason=pb.PLAN_REASON_AGENT_CHANGED,
        spec=_new_agent(),
    )


def _load_skill(session_id: str, run_id: str) -> pb.LoadSkillRequest:
    return pb.LoadSkillRequest(
        tenant_id=TENANT,
        session_id=session_id,
        name="trip-planning",
        body="Always compare two routes.",
        trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION,
        run_id=run_id,
    )


async def test_a_second_build_of_a_run_reads_no_head(two: Any, pool: Any) -> None:
    (stub, engine), _ = two
    session_id, _ = await open_session(stub)
    run_id = (await start_run(stub, session_id, "first question")).run.run_id
    reads = engine._read_heads.calls
    first = await stub.Build(build_request(session_id, run_id))
    second = await stub.Build(build_request(session_id, run_id))
    assert engine._read_heads.calls == reads + 1  # the second confirmed the kept head
    assert second.request_sha256 == first.request_sha256
    assert second.request_sequence > first.request_sequence
    recorded = await _requests(pool, session_id)
    assert [r["request_sha256"] for r in recorded] == [first.request_sha256] * 2


async def test_writes_through_the_replica_move_its_kept_head(two: Any) -> None:
    """A run's steps through one replica: each Build after an append (or a working-state
    update) confirms the head the write moved and builds the checkpoint the write kept,
    the same bytes another replica builds from the checkpoint it reads."""
    (stub, engine), (other, _) = two
    session_id, _ = await open_session(stub)
    started = await start_run(stub, session_id, "first question")
    run_id = started.run.run_id
    await stub.Build(build_request(session_id, run_id))
    reads = engine._read_heads.calls
    appended = await append_items(
        stub, session_id, run_id, started.checkpoint_version, assistant("an answer")
    )
    built = await stub.Build(build_request(session_id, run_id))
    assert built.checkpoint_version == appended.checkpoint_version
    assert "an answer" in _texts(built)
    updated = await update_state(
        stub, session_id, run_id, appended.checkpoint_version, objective="Plan the trip."
    )
    built = await stub.Build(build_request(session_id, run_id))
    assert built.checkpoint_version == updated.checkpoint_version
    assert engine._read_heads.calls == reads  # neither Build read the head
    read = await other.Build(build_request(session_id, run_id, updated.checkpoint_version))
    assert read.request_sha256 == built.request_sha256
    assert read.provider_payload == built.provider_payload


async def test_a_head_moved_by_another_replica_builds_the_new_checkpoint_once(
    two: Any, pool: Any
) -> None:
    (a, engine), (b, _) = two
    session_id, _ = await open_session(a)
    started = await start_run(a, session_id, "first question")
    run_id = started.run.run_id
    await a.Build(build_request(session_id, run_id))  # A keeps the head: version 1
    appended = await append_items(
        b, session_id, run_id, started.checkpoint_version, assistant("an answer from B")
    )
    reads = engine._read_heads.calls
    built = await a.Build(build_request(session_id, run_id))
    assert built.checkpoint_version == appended.checkpoint_version
    assert "an answer from B" in _texts(built)
    assert engine._read_heads.calls == reads + 1  # the stale head was read afresh
    recorded = await _requests(pool, session_id)
    assert len(recorded) == 2, "the Build made from the stale head wrote a record"
    assert recorded[-1]["checkpoint_version"] == appended.checkpoint_version


async def test_a_build_of_a_named_version_is_not_moved_by_later_appends(two: Any) -> None:
    (a, engine), (b, _) = two
    session_id, _ = await open_session(a)
    started = await start_run(a, session_id, "first question")
    run_id, version = started.run.run_id, started.checkpoint_version
    first = await a.Build(build_request(session_id, run_id, version))
    await append_items(b, session_id, run_id, version, assistant("later"))
    reads = engine._read_heads.calls
    again = await a.Build(build_request(session_id, run_id, version))
    assert engine._read_heads.calls == reads  # the version was named: the head still holds
    assert again.checkpoint_version == version
    assert again.request_sha256 == first.request_sha256


async def test_a_plan_rotated_by_another_replica_is_built_on(two: Any) -> None:
    (a, _), (b, _) = two
    session_id, plan = await open_session(a)
    run_id = (await start_run(a, session_id, "first question")).run.run_id
    await a.Build(build_request(session_id, run_id))
    rotated = await b.Rotate(_rotation(session_id, plan.epoch))
    assert rotated.plan.epoch > plan.epoch
    built = await a.Build(build_request(session_id, run_id))
    assert built.epoch == rotated.plan.epoch
    assert built.prefix_sha256 == rotated.plan.prefix_sha256


async def test_a_skill_loaded_through_another_replica_is_built_with(two: Any) -> None:
    (a, _), (b, _) = two
    session_id = new_id()
    await a.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=_with_skill()))
    run_id = (await start_run(a, session_id, "first question")).run.run_id
    await a.Build(build_request(session_id, run_id))
    await b.LoadSkill(_load_skill(session_id, run_id))
    built = await a.Build(build_request(session_id, run_id))
    assert "Always compare two routes." in _texts(built)


async def test_the_confirming_sql_reads_what_the_head_read_reads(two: Any, pool: Any) -> None:
    """migrations/0013's run_head_state and run_latest_version against store/runs.py's
    head read, through the states a head moves by: appends, a rotation, a skill loaded, an
    erasure's revision bump (plans_revision written as an erasure writes it). Forks,
    continued lineages and sweeps: tests/integration/test_plan_service.py."""
    (stub, _), _ = two
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=_with_skill()))
    started = await start_run(stub, session_id, "first question")
    run_id = UUID(started.run.run_id)

    async def agree() -> None:
        assert await heads_agree(pool, session_id) == 1

    await agree()
    await append_items(
        stub, session_id, str(run_id), started.checkpoint_version, assistant("an answer")
    )
    await agree()
    await stub.Rotate(_rotation(session_id, 1))
    await agree()
    await stub.LoadSkill(_load_skill(session_id, str(run_id)))
    await agree()
    await pool.execute(
        "UPDATE sessions SET plans_revision = plans_revision + 1"
        " WHERE tenant_id = $1 AND session_id = $2",
        TENANT,
        UUID(session_id),
    )
    await agree()


async def test_the_confirming_head_read_finds_the_run_by_key_however_many_runs(
    two: Any, pool: Any
) -> None:
    """migrations/0014: run_head_state reads the run by its primary key, also in the generic
    plan PL/pgSQL settles on after a few calls. 0013's query named the session as well, and
    that plan read the run through runs_by_session, filtering out the session's other runs
    (a confirmed record cost PostgreSQL 0.17 ms in a session of 50 runs, 0.98 ms in one of
    5,000). The installed function's query, explained as a generic plan in a session of
    500 runs, probes runs_pkey and filters no row; a run named under another session has
    no head."""
    (stub, _), _ = two
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=_with_skill()))
    run_id = (await start_run(stub, session_id, "first question")).run.run_id
    source = await pool.fetchval("SELECT prosrc FROM pg_proc WHERE proname = 'run_head_state'")
    query = source.split("RETURN (", 1)[1].rsplit(");", 1)[0]
    for n, name in enumerate(("p_tenant", "p_session", "p_run"), 1):
        query = query.replace(name, f"${n}")
    # In a transaction rolled back after, rows and statistics alike: statistics from
    # before the session grew, as a long session's runs outgrow them between two analyses.
    # Of many sessions of a few runs each, where naming a session finds a few rows, as
    # naming the run does: the plan 0013's query got then scanned the session's runs.
    async with pool.acquire() as conn:
        transaction = conn.transaction()
        await transaction.start()
        try:
            await conn.execute(
                "WITH s AS (INSERT INTO sessions (tenant_id, session_id)"
                "  SELECT 'head-plan-stats', gen_random_uuid() FROM generate_series(1, 1000)"
                "  RETURNING tenant_id, session_id)"
                " INSERT INTO runs (tenant_id, session_id, run_id, epoch)"
                " SELECT s.tenant_id, s.session_id, gen_random_uuid(), 1"
                " FROM s, generate_series(1, 2)"
            )
            await conn.execute("ANALYZE runs")
            await conn.execute(
                "INSERT INTO runs (tenant_id, session_id, run_id, epoch)"
                " SELECT $1, $2, gen_random_uuid(), 1 FROM generate_series(1, 500)",
                TENANT,
                UUID(session_id),
            )
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            await conn.execute(f"PREPARE head_state (text, uuid, uuid) AS {query}")
            explained = await conn.fetchval(
                "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE"
                f" head_state('{TENANT}', '{session_id}', '{run_id}')"
            )
            await conn.execute("DEALLOCATE head_state")
        finally:
            await transaction.rollback()
    (plan,) = json.loads(explained) if isinstance(explained, str) else explained
    runs = [node for node in _nodes(plan["Plan"]) if node.get("Relation Name") == "runs"]
    assert [(n.get("Index Name"), n.get("Rows Removed by Filter", 0)) for n in runs] == [
        ("runs_pkey", 0)
    ]
    assert await heads_agree(pool, session_id) == 1
    other = await pool.fetchval(
        "SELECT run_head_state($1, $2, $3)", TENANT, UUID(new_id()), UUID(run_id)
    )
    assert other is None


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """A plan node of EXPLAIN (FORMAT JSON) and every node below it."""
    return [node, *(n for child in node.get("Plans", ()) for n in _nodes(child))]


async def test_a_session_seen_spread_over_replicas_reads_its_heads(two: Any) -> None:
    """Once another replica moved a head this one kept, the session's Builds here read
    their heads (Engine._heads_spread): each would otherwise be assembled twice."""
    (a, engine), (b, _) = two
    session_id, _ = await open_session(a)
    started = await start_run(a, session_id, "first question")
    run_id, version = started.run.run_id, started.checkpoint_version
    await a.Build(build_request(session_id, run_id))
    for n in range(3):
        version = (
            await append_items(b, session_id, run_id, version, assistant(f"answer {n}"))
        ).checkpoint_version
        reads, records = engine._read_heads.calls, engine._record_requests.calls
        built = await a.Build(build_request(session_id, run_id))
        assert built.checkpoint_version == version
        assert engine._read_heads.calls == reads + 1
        # The first found its kept head moved (a record refused, then one made); after it,
        # one record per Build.
        assert engine._record_requests.calls == records + (2 if n == 0 else 1)


async def test_writes_through_the_replica_that_move_heads_do_not_spread_the_session(
    two: Any,
) -> None:
    """A skill loaded or a plan rotated through this replica drops the heads it kept for
    the session, so the next Build reads its head (not a stale attempt) and the one after
    confirms it again."""
    (a, engine), _ = two
    session_id = new_id()
    plan = await a.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=_with_skill()))
    run_id = (await start_run(a, session_id, "first question")).run.run_id
    await a.Build(build_request(session_id, run_id))
    writes = (
        lambda: a.LoadSkill(_load_skill(session_id, run_id)),
        lambda: a.Rotate(_rotation(session_id, plan.plan.epoch)),
    )
    for write in writes:
        await write()
        reads, records = engine._read_heads.calls, engine._record_requests.calls
        await a.Build(build_request(session_id, run_id))
        await a.Build(build_request(session_id, run_id))
        assert engine._read_heads.calls == reads + 1
        assert engine._record_requests.calls == records + 2


async def test_a_head_moved_by_a_write_still_leaving_its_gate_does_not_spread_the_session(
    two: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write counts itself against the kept heads once it leaves the session's gate, after
    its commit. A sibling run's Build recorded in between found its kept head moved with no
    write counted, took it for another replica's, and marked a session served by one
    replica as spread, reading every head again from then on (an audit). The window is
    held open here: LoadSkill committed, its gate not yet left."""
    from context_engine.api import skills as skills_api

    (stub, engine), _ = two
    catalog = spec()
    catalog.skills.append(pb.SkillCatalogEntry(name="alpha", description="Routes.", version="1"))
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=catalog))
    first = (await start_run(stub, session_id, "first")).run.run_id
    second = (await start_run(stub, session_id, "second")).run.run_id
    for run_id in (first, second):
        await stub.Build(build_request(session_id, run_id))  # both heads kept
    real = skills_api.transaction
    committed, go = asyncio.Event(), asyncio.Event()

    @asynccontextmanager
    async def committed_then_wait(pool: Any, *args: Any) -> AsyncIterator[Any]:
        async with real(pool, *args) as conn:
            yield conn
        committed.set()  # committed and its connection back; the gate still held
        await go.wait()

    monkeypatch.setattr(skills_api, "transaction", committed_then_wait)
    loading = asyncio.ensure_future(
        stub.LoadSkill(
            pb.LoadSkillRequest(
                tenant_id=TENANT,
                session_id=session_id,
                name="alpha",
                body="Always compare two routes.",
                trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION,
                run_id=first,
            )
        )
    )
    await asyncio.wait_for(committed.wait(), 10)
    built = await stub.Build(build_request(session_id, second))  # its kept head moved
    go.set()
    await loading
    assert not engine._heads(TENANT, UUID(session_id)).spread
    assert "Always compare two routes." in _texts(built)


async def test_a_head_moved_by_this_replicas_own_write_does_not_spread_the_session(
    two: Any,
) -> None:
    """A Build made from a kept head while a write through the same replica moved it (the
    write landed between the Build's start and its record) finds it moved; that is the
    replica's own write, not another replica's, so the session keeps its heads."""
    (stub, engine), _ = two
    session_id, _ = await open_session(stub)
    started = await start_run(stub, session_id, "first question")
    run_id = started.run.run_id
    await stub.Build(build_request(session_id, run_id))
    heads = engine._heads(TENANT, UUID(session_id))
    writes = heads.writes  # what a Build beginning now sees
    await append_items(stub, session_id, run_id, started.checkpoint_version, assistant("a"))
    engine._head_moved(TENANT, UUID(session_id), heads, writes)
    assert not engine._heads(TENANT, UUID(session_id)).spread
    # With no write through this replica in between, it is another replica's.
    heads = engine._heads(TENANT, UUID(session_id))
    engine._head_moved(TENANT, UUID(session_id), heads, heads.writes)
    assert engine._heads(TENANT, UUID(session_id)).spread


async def test_a_head_read_before_the_replicas_own_append_is_not_kept(two: Any) -> None:
    """A Build whose head read began before an append through the same replica finished
    after it, and kept that older head: the next Build found it moved with no write since
    to explain it, and the session was taken for one another replica serves (an audit:
    every later Build there read its head). Such a head is not kept."""
    (stub, engine), _ = two
    session_id, _ = await open_session(stub)
    started = await start_run(stub, session_id, "first question")
    run_id = started.run.run_id
    read = engine._read_heads._run
    appended = asyncio.Event()

    async def read_then_wait(keys: Any) -> Any:
        rows = await read(keys)
        await asyncio.wait_for(appended.wait(), 10)  # the append lands meanwhile
        return rows

    engine._read_heads._run = read_then_wait
    try:
        first = asyncio.ensure_future(stub.Build(build_request(session_id, run_id)))
        await wait_for(lambda: _true(engine._read_heads.calls > 0), timeout=10, what="head read")
        await append_items(stub, session_id, run_id, started.checkpoint_version, assistant("a"))
        appended.set()
        await first
    finally:
        engine._read_heads._run = read
    heads = engine._heads(TENANT, UUID(session_id))
    assert heads is not None and UUID(run_id) not in heads.by_run
    for _ in range(3):
        await stub.Build(build_request(session_id, run_id))
    heads = engine._heads(TENANT, UUID(session_id))
    assert not heads.spread and UUID(run_id) in heads.by_run


async def test_a_head_is_not_kept_across_its_entrys_eviction(two: Any, pool: Any) -> None:
    """The kept heads live in a bounded cache and count writes from 0 when made again: a
    head read at 0 writes, an append, the entry evicted, and the head was kept into the new
    entry at 0 (a review). The entry read at is compared too."""
    (stub, engine), _ = two
    session_id, _ = await open_session(stub)
    started = await start_run(stub, session_id, "first question")
    run_id = UUID(started.run.run_id)
    # An entry made afresh (as after an eviction): the head is read at 0 writes.
    engine._kept.drop(("heads", TENANT, UUID(session_id)))
    seen = engine._writes(TENANT, UUID(session_id))
    assert seen[1] == 0
    head = await runs.read_run_head(pool, TENANT, UUID(session_id), run_id)
    await append_items(stub, session_id, started.run.run_id, 1, assistant("a"))
    engine._kept.drop(("heads", TENANT, UUID(session_id)))
    engine._writes(TENANT, UUID(session_id))  # made again, counting from 0
    engine._keep_head(TENANT, UUID(session_id), head, seen)
    assert run_id not in engine._heads(TENANT, UUID(session_id)).by_run


async def _true(value: bool) -> bool:
    return value


async def _alter_stored_checkpoint(pool: Any, run_id: str, version: int, text: str) -> None:
    """Rewrite a stored checkpoint's first item text behind the service's back (nothing in
    the service rewrites a stored version): what a replica that reads it would see."""
    await pool.execute(
        "UPDATE run_checkpoints SET body = jsonb_set(body, '{items,0,text}', to_jsonb($3::text))"
        " WHERE tenant_id = $1 AND run_id = $2 AND version = $4",
        TENANT,
        UUID(run_id),
        text,
        version,
    )


async def test_an_append_continuing_a_version_the_replica_holds_reads_no_checkpoint(
    two: Any, pool: Any
) -> None:
    """AppendItems reads the run and its latest checkpoint in one round trip
    (store/runs.py read_run_checkpoint), and when this replica holds that version (it
    built it, or wrote it) the body is neither sent nor parsed again: the append continues
    the version it holds. Another replica, holding none, reads the stored one."""
    (a, _), (b, _) = two
    session_id, _ = await open_session(a)
    started = await start_run(a, session_id, "first question")
    run_id, version = started.run.run_id, started.checkpoint_version
    await a.Build(build_request(session_id, run_id))  # A holds version 1
    await _alter_stored_checkpoint(pool, run_id, version, "altered in storage")
    by_a = await append_items(a, session_id, run_id, version, assistant("an answer"))
    built = await b.Build(build_request(session_id, run_id, by_a.checkpoint_version))
    assert "first question" in _texts(built) and "altered in storage" not in _texts(built)
    # B holds version 2 now (it built it); A's write of version 3 is read by B afresh.
    await _alter_stored_checkpoint(pool, run_id, by_a.checkpoint_version, "altered again")
    by_b = await append_items(b, session_id, run_id, by_a.checkpoint_version, assistant("more"))
    built = await a.Build(build_request(session_id, run_id, by_b.checkpoint_version))
    assert "altered again" not in _texts(built) and "more" in _texts(built)
    other = await start_run(a, session_id, "second question")
    await _alter_stored_checkpoint(pool, other.run.run_id, 1, "read from storage")
    fresh = await append_items(b, session_id, other.run.run_id, 1, assistant("an answer"))
    built = await a.Build(build_request(session_id, other.run.run_id, fresh.checkpoint_version))
    assert "read from storage" in _texts(built)  # B held no version of this run


async def test_an_append_at_a_version_another_replica_moved_on_from_conflicts(
    two: Any,
) -> None:
    """A version this replica holds that is no longer the latest is a conflict, as before,
    naming the latest; an append at the latest reads it."""
    (a, _), (b, _) = two
    session_id, _ = await open_session(a)
    started = await start_run(a, session_id, "first question")
    run_id, version = started.run.run_id, started.checkpoint_version
    await a.Build(build_request(session_id, run_id))  # A holds version 1
    moved = await append_items(b, session_id, run_id, version, assistant("from B"))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await append_items(a, session_id, run_id, version, assistant("from A"))
    assert refused.value.code() == grpc.StatusCode.ABORTED
    reason, fields, metadata = details(refused.value)
    assert reason == "CHECKPOINT_VERSION_CONFLICT" and fields == ["expected_checkpoint_version"]
    assert metadata["latest_version"] == str(moved.checkpoint_version)
    done = await append_items(a, session_id, run_id, moved.checkpoint_version, assistant("A"))
    built = await b.Build(build_request(session_id, run_id, done.checkpoint_version))
    assert "from B" in _texts(built) and "from A" not in _texts(built)
