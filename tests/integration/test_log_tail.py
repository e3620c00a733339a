"""A run's carried history read newest first through the real store (core/log_tail.py,
api/log_tail.py, migrations/0012_history_pairs.sql).

The trigger records, with each conversation event, the call a result answers and the
running count; the pages a Build reads then carry exactly what the whole range carries
(read by read_carried_items and folded by carried_history), for every page size, floor and
later run, over generated logs written in batches as AppendItems writes them, with child
runs' events and other events in between. And through the service: a fresh replica that
reads a long session a few events at a time builds, and GetBuild rebuilds, what the
replica that read each range whole built; a replica that served the session's last run
reads only the events since.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine.api import log_tail
from context_engine.core.items import ConversationItem, ReasoningItem
from context_engine.core.log_tail import LogTail
from context_engine.core.seeding import carried_history
from context_engine.store import events, sessions
from context_engine.store.db import acquire, connect_pool, transaction
from context_engine.store.events import EVENT_TYPE_OF_ITEM, NewEvent, item_payload
from tests.unit.strategies import messy_logs

from .helpers import (
    TENANT,
    append_items,
    assistant,
    build_request,
    call,
    create_database,
    drop_database,
    open_session,
    result,
    start_child,
    start_run,
)

NOW = datetime(2026, 9, 21, tzinfo=UTC)
PROPERTY = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- the store: what the pages carry is what the whole range carries ----------------------


@st.composite
def written_logs(draw: st.DrawFn) -> list[tuple[ConversationItem, str, bool]]:
    """(item, run label, in the conversation) in log order: a messy conversation log with
    child runs' items (same call ids, not the conversation) and other events between."""
    out: list[tuple[ConversationItem, str, bool]] = []
    for item in draw(messy_logs(max_events=50)):
        if isinstance(item, ReasoningItem):
            continue  # never logged (store/events.py, EVENT_TYPE_OF_ITEM)
        if draw(st.integers(0, 5)) == 0:
            out.append((item.model_copy(update={"item_id": f"k-{item.item_id}"}), "child", False))
        out.append((item, item.run_id, True))
    return out


def _event(item: ConversationItem | None, run: UUID, in_history: bool) -> NewEvent:
    if item is None:  # a Build's record between the items
        return NewEvent("context.budget.pressure", {"fits": True}, run_id=run)
    return NewEvent(
        EVENT_TYPE_OF_ITEM[item.kind],
        item_payload(item),
        run_id=run,
        item_id=item.item_id,
        in_history=in_history,
    )


async def _write(
    pool: Any, log: Sequence[tuple[ConversationItem, str, bool]], cuts: list[int]
) -> UUID:
    """A fresh session holding `log`, appended in batches split at `cuts` (each batch one
    statement, as one AppendItems), a non-conversation event after each batch."""
    session_id = uuid.uuid4()
    runs: dict[str, UUID] = {}
    bounds = [0, *sorted(set(cuts)), len(log)]
    async with transaction(pool) as conn:
        await sessions.ensure_session(conn, TENANT, session_id)
    for start, end in itertools.pairwise(bounds):
        batch = [
            _event(item, runs.setdefault(label, uuid.uuid4()), in_history)
            for item, label, in_history in log[start:end]
        ]
        async with transaction(pool) as conn:
            await sessions.lock_session(conn, TENANT, session_id)
            await events.append_events(
                conn,
                TENANT,
                session_id,
                [*batch, _event(None, runs.setdefault("r0", uuid.uuid4()), False)],
            )
    return session_id


async def _whole(
    conn: Any, session_id: UUID, floor: int, below: int
) -> tuple[ConversationItem, ...]:
    logged = await events.read_carried_items(
        conn, TENANT, session_id, below_sequence=below, above_sequence=floor
    )
    return carried_history(logged)


async def _check(conn: Any, session_id: UUID, tail: LogTail) -> None:
    whole = await _whole(conn, session_id, tail.floor, tail.below)
    assert tail.before + len(tail.history) == len(whole)
    assert tail.history == whole[tail.before :]
    if tail.complete:
        assert tail.before == 0


async def _read_every_way(
    pool: Any, session_id: UUID, floor: int, belows: list[int], pages: list[int]
) -> None:
    sizes = iter(pages)
    async with acquire(pool) as conn:
        tail = (
            await log_tail.read_newest(
                conn, TENANT, session_id, floor, belows[0], None, next(sizes, 2)
            )
        ).tail
        await _check(conn, session_id, tail)
        for below in belows[1:]:
            # A later run: the events since extend the tail (or, more than a page of
            # them, the newest page is read afresh).
            read = await log_tail.read_newest(
                conn, TENANT, session_id, floor, below, tail, next(sizes, 2)
            )
            tail = read.tail
            await _check(conn, session_id, tail)
        while not tail.complete:
            tail = (await log_tail.read_older(conn, TENANT, session_id, tail, next(sizes, 3))).tail
            await _check(conn, session_id, tail)


def test_the_pages_read_from_the_store_carry_what_the_whole_range_carries(
    database_dsn: str,
) -> None:
    loop = asyncio.new_event_loop()  # its own loop: hypothesis drives a sync test
    pool = loop.run_until_complete(connect_pool(database_dsn, min_size=1, max_size=2))

    @PROPERTY
    @given(written_logs(), st.data())
    def check(log: list[tuple[ConversationItem, str, bool]], data: st.DataObject) -> None:
        cuts = data.draw(st.lists(st.integers(0, len(log)), max_size=6))
        session_id = loop.run_until_complete(_write(pool, log, cuts))
        # Sequences are 1..n: the log's events, and one more event after each batch.
        top = len(log) + len(set(cuts) | {0, len(log)}) + 1
        floor = data.draw(st.sampled_from([0, 0, *range(1, top)]))
        belows = sorted(data.draw(st.lists(st.integers(floor, top + 1), min_size=1, max_size=3)))
        pages = data.draw(st.lists(st.integers(1, 6), max_size=8))
        loop.run_until_complete(_read_every_way(pool, session_id, floor, belows, pages))

    try:
        check()
    finally:
        loop.run_until_complete(pool.close())
        loop.close()


async def _migrated_with_data(logs: list[list[tuple[ConversationItem, str, bool]]]) -> None:
    """Sessions written under the schema before 0012, then 0012 applied to them: its fill
    gives every range the same bounded reads as the trigger would have."""
    import asyncpg

    from context_engine.store import apply_migrations
    from context_engine.store.migrate import migration_files

    dsn = await create_database(migrate=False)
    try:
        conn = await asyncpg.connect(dsn)
        try:
            async with conn.transaction():  # what apply_migrations did before 0012
                await conn.execute(
                    "CREATE TABLE schema_migrations (version text PRIMARY KEY,"
                    " applied_at timestamptz NOT NULL DEFAULT now())"
                )
                for version, sql in migration_files():
                    if version < "0012":
                        await conn.execute(sql)
                        await conn.execute("INSERT INTO schema_migrations VALUES ($1)", version)
            pool = await connect_pool(dsn, min_size=1, max_size=2)
            try:
                written = [await _write(pool, log, [len(log) // 2]) for log in logs]
                assert await pool.fetchval("SELECT to_regproc('session_events_carried')") is None
                later = [version for version, _ in migration_files() if version >= "0012"]
                assert await apply_migrations(conn) == later
                assert later[0] == "0012_history_pairs"
                for log, session_id in zip(logs, written, strict=True):
                    top = len(log) + 3
                    for floor in range(0, top, 3):
                        await _read_every_way(pool, session_id, floor, [top], [2, 3])
            finally:
                await pool.close()
        finally:
            await conn.close()
    finally:
        await drop_database(dsn)


def test_the_migration_fills_an_existing_log_as_the_trigger_fills_a_new_one() -> None:
    @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(written_logs(), min_size=4, max_size=8))
    def check(logs: list[list[tuple[ConversationItem, str, bool]]]) -> None:
        asyncio.run(_migrated_with_data(logs))

    check()


# --- the service: a fresh replica's first Builds ------------------------------------------


def _words(head: str, count: int) -> str:
    """Text that does not compress into a few tokens (a repeated phrase does)."""
    return " ".join([head, *(f"w{n * 7919 % 10007}" for n in range(count))])


@pytest.fixture
async def fresh_replica(pool: Any) -> Any:
    """A second server over the same database that has served nothing yet."""
    from context_engine.api.server import build_engine, build_server

    running = await build_server(build_engine(pool), "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield pb_grpc.ContextEngineStub(channel), running.engine
    await channel.close()
    await running.stop(0)


async def _turns(stub: Any, session_id: str, turns: range) -> None:
    """Turns of long questions answered by a long tool result and a short answer."""
    for turn in turns:
        started = await start_run(stub, session_id, _words(f"Question {turn}:", 120))
        page = result("c1", _words(f"page {turn}", 60))
        await append_items(
            stub, session_id, started.run.run_id, 1, call("c1"), page, assistant("Fine.")
        )


async def test_a_fresh_replica_reading_a_few_events_at_a_time_builds_what_a_whole_read_built(
    stub: Any, fresh_replica: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eighty turns behind a 16,000-token window, a run whose call is answered sixty turns
    later, a run that died mid-loop, a child run. The shared replica read the session as it
    grew, each range within its first page (nothing left unread); the fresh one reads three
    events, then six, then twelve..., stops far short of the start, and builds the same
    bytes, fit and cut, and GetBuild rebuilds the recorded bytes."""
    cold, engine = fresh_replica
    session_id, _ = await open_session(stub, policy_cap_tokens=16_000, reserve_output_tokens=4_096)
    waiting = (await start_run(stub, session_id, "Fetch the slow one.")).run.run_id
    await append_items(stub, session_id, waiting, 1, call("slow"))  # answered 60 turns on
    await _turns(stub, session_id, range(10))
    dead = (await start_run(stub, session_id, "Fetch and die.")).run.run_id
    await append_items(stub, session_id, dead, 1, call("c1"))  # never answered
    child = (await start_child(stub, session_id, dead, "Look it up.")).run.run_id
    await append_items(stub, session_id, child, 1, call("c1"), result("c1", "found"))
    await _turns(stub, session_id, range(10, 60))
    await append_items(stub, session_id, waiting, 2, result("slow", "at last " * 30))
    await _turns(stub, session_id, range(60, 80))
    built: list[tuple[pb.BuildRequest, pb.BuildResponse]] = []
    for text in ("And now?", "And then?", "And after that?"):
        started = await start_run(stub, session_id, text)
        request = build_request(session_id, started.run.run_id, version=1)
        built.append((request, await stub.Build(request)))
        await append_items(stub, session_id, started.run.run_id, 1, assistant("Noted."))
    assert built[-1][1].pressure.history_items_dropped > 100  # the window cuts

    monkeypatch.setattr(log_tail, "FIRST_PAGE", 3)
    monkeypatch.setattr(log_tail, "GROWTH", 2)
    for request, response in reversed(built):  # newest first: no extension helps
        again = await cold.Build(request)
        assert again.request_sha256 == response.request_sha256
        assert again.provider_payload == response.provider_payload
        assert again.pressure == response.pressure
        assert list(again.budget) == list(response.budget)
        rebuilt = await cold.GetBuild(
            pb.GetBuildRequest(
                tenant_id=TENANT, session_id=session_id, request_sequence=response.request_sequence
            )
        )
        assert rebuilt.provider_payload == response.provider_payload
    tails = [  # Kept entries are (value, weight); a carried value is (tail, weight)
        value[0]
        for key, (value, _) in engine._kept._entries.items()
        if key[0] == "carried" and str(key[2]) == session_id
    ]
    assert min(t.before for t in tails) > 100  # the pages stopped far short of the start


async def test_a_rebuild_with_unmarked_excerpts_reads_back_as_far_as_they_reach(
    stub: Any, grpc_server: Any, pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record of context-assembler@8 or older is rebuilt with its excerpts unmarked, which
    cost less than marked ones: the shell read the log back until the marked history
    reached the window and only then unmarked it, so the window reached past what a replica
    paging the log had read, and the rebuild was refused there while a replica holding the
    whole range served it (a review). The reach is measured on the history as sent: every
    page size builds the bytes the whole range builds."""
    from context_engine.api.server import build_engine
    from context_engine.core.assemble import StepContext

    session_id, _ = await open_session(stub, policy_cap_tokens=16_000, reserve_output_tokens=4_096)
    for turn in range(90):
        started = await start_run(stub, session_id, _words(f"Q{turn}", 20))
        excerpted = pb.ConversationItem(
            tool_result=pb.ToolResult(
                call_id="c1",
                tool_name="web.fetch",
                content=_words(f"full {turn}", 400),
                context_content=f"excerpt {turn}",
                trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
            )
        )
        await append_items(
            stub, session_id, started.run.run_id, 1, call("c1"), excerpted, assistant("ok")
        )
    run_id = (await start_run(stub, session_id, "Now?")).run.run_id
    arguments = (TENANT, UUID(session_id), UUID(run_id), 1, NOW, StepContext())
    monkeypatch.setattr(log_tail, "FIRST_PAGE", 100_000)  # the whole range at once
    whole = await grpc_server.engine.build(*arguments, record=False, marked_excerpts=False)
    assert whole.assembled.pressure.history_items_dropped > 100  # the window cuts
    monkeypatch.setattr(log_tail, "GROWTH", 1)
    for page in range(1, 7):
        monkeypatch.setattr(log_tail, "FIRST_PAGE", page)
        paged = await build_engine(pool).build(*arguments, record=False, marked_excerpts=False)
        assert paged.assembled.request_sha256 == whole.assembled.request_sha256, page


async def test_a_run_compacted_mid_session_builds_the_same_from_a_fresh_replica(
    stub: Any, fresh_replica: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A summary floor in the middle of the carried range: the fresh replica reads the
    count at the floor and the results straddling it (store/events.py, read_floor_facts)."""
    cold, _ = fresh_replica
    session_id, _ = await open_session(stub, policy_cap_tokens=16_000, reserve_output_tokens=4_096)
    await _turns(stub, session_id, range(80))
    run_id = (await start_run(stub, session_id, "Sum it up and go on.")).run.run_id
    prepared = await stub.PrepareCompaction(
        pb.PrepareCompactionRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=run_id,
            checkpoint_version=1,
            through_sequence=20,
        )
    )
    committed = await stub.CommitCompaction(
        pb.CommitCompactionRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=1,
            result=pb.CompactionResult(
                summary="They asked about the first items.",
                source_event_ids=list(prepared.source_event_ids),
                elided=list(prepared.elided),
                replaced_through_sequence=prepared.replaced_through_sequence,
                depth=prepared.depth,
                tokens_before=prepared.tokens_before,
                tokens_after=8,
                compactor_version="worker-compactor@1",
                prompt_version=prepared.prompt_version,
            ),
        )
    )
    request = build_request(session_id, run_id, version=committed.checkpoint_version)
    warm = await stub.Build(request)
    assert warm.pressure.history_items_dropped > 0
    monkeypatch.setattr(log_tail, "FIRST_PAGE", 4)
    again = await cold.Build(request)
    assert (again.request_sha256, again.provider_payload) == (
        warm.request_sha256,
        warm.provider_payload,
    )
    assert again.pressure == warm.pressure


async def test_a_replica_that_served_the_last_run_reads_only_the_events_since(
    fresh_replica: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each new run's first Build reads the log from the previous run's seed on, not from
    the start, and never more than a page."""
    replica, _ = fresh_replica
    reads: list[tuple[int, int, int]] = []  # (below, above, events read) of each read
    real = events.read_history_page

    async def spied(
        conn: Any, tenant: str, session: UUID, below: int, above: int, limit: int
    ) -> Any:
        rows = await real(conn, tenant, session, below, above, limit)
        reads.append((below, above, len(rows)))
        return rows

    monkeypatch.setattr(events, "read_history_page", spied)
    session_id, _ = await open_session(replica)
    seeds: list[int] = []
    for turn in range(6):
        started = await start_run(replica, session_id, f"q{turn}")
        seeds.append(started.run.seed_event_sequence)
        reads.clear()
        await replica.Build(build_request(session_id, started.run.run_id))
        if turn:
            assert [(below, above) for below, above, _ in reads] == [(seeds[-1], seeds[-2] - 1)]
            assert reads[0][2] == 4  # the previous run's seed and its three items
        items = (call("c1"), result("c1", "x"), assistant("ok"))
        await append_items(replica, session_id, started.run.run_id, 1, *items)
