"""`context-engine inspect SESSION` over a session driven through the real server."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.inspect import run_inspect

from .helpers import (
    TENANT,
    admin_execute,
    assistant,
    create_database,
    drop_database,
    dsn_on_test_server,
    new_id,
    open_session,
    spec,
    start_run,
)
from .test_budget_service import MODEL, _append, _build, _start, _tenant, _words
from .test_compaction_service import _commit, _prepare

pytestmark = pytest.mark.integration

CANARY = "CANARY-inspect-0c1d"


async def _session(stub: Any) -> tuple[str, pb.ContextPlan, pb.ContextPlan, list[pb.BuildResponse]]:
    session_id, plan = await open_session(stub)
    run = (await start_run(stub, session_id, f"plan a trip {CANARY}")).run
    now = Timestamp()
    now.FromDatetime(datetime(2026, 3, 1, 12, 0, tzinfo=UTC))
    builds = [
        await stub.Build(
            pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run.run_id, now=now)
        )
    ]
    await stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=run.run_id,
            expected_checkpoint_version=1,
            items=[assistant(f"sure {CANARY}")],
        )
    )
    rotated = await stub.Rotate(
        pb.RotateRequest(
            tenant_id=TENANT,
            session_id=session_id,
            from_epoch=1,
            reason=pb.PLAN_REASON_MODEL_CHANGED,
            detail="operator test",
        )
    )
    run = (await start_run(stub, session_id, "and back")).run
    builds.append(
        await stub.Build(
            pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run.run_id, now=now)
        )
    )
    return session_id, plan, rotated.plan, builds


async def test_inspect_prints_epochs_hashes_and_a_bar_per_request(
    stub: Any, database_dsn: str
) -> None:
    session_id, first, second, builds = await _session(stub)
    console = Console(record=True, width=200, color_system=None)
    await run_inspect(database_dsn, session_id, None, console)
    text = console.export_text()
    assert session_id in text and TENANT in text
    assert "session_opened" in text and "model_changed" in text
    assert first.prefix_sha256[:16] in text and second.prefix_sha256[:16] in text
    for build in builds:
        assert str(build.request_sequence) in text
        assert build.prefix_sha256[:12] in text
    assert "█" in text  # the bars
    assert "context.epoch.rotated" in text and "from_epoch=1" in text
    assert "one prefix hash per epoch (2 epoch(s))" in text
    assert CANARY not in text  # no content, ever


def _env(database_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_ENGINE_")}
    return {**env, "DATABASE_URL": database_url}


async def _command(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """`context-engine inspect ARGS` in a process of its own -> (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "context_engine.cli",
        "inspect",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_inspect_command_exit_codes(stub: Any, database_dsn: str) -> None:
    session_id, _ = await open_session(stub)
    env = _env(database_dsn)

    async def inspect(*args: str) -> tuple[int, str, str]:
        return await _command(env, *args)

    code, out, _ = await inspect(session_id, "--width", "160")
    assert code == 0 and "Plans (epochs)" in out and session_id in out
    code, _, err = await inspect(new_id())
    assert code == 1 and "not found" in err
    # A malformed argument is usage (exit 2), named before anything starts (an audit: the
    # id gave exit 1 with a bare "badly formed hexadecimal UUID string", and a negative
    # width exit 0 with no output).
    code, _, err = await inspect("not-a-uuid")
    assert code == 2 and "'not-a-uuid' is not a session id" in err
    code, _, err = await inspect(session_id, "--width", "-5")
    assert code == 2 and "'-5' is not a width (0: auto)" in err
    code, out, _ = await inspect(session_id, "--width", "0")  # 0 is auto, the default
    assert code == 0 and session_id in out
    # An unreachable database: one line naming it, not an asyncpg traceback.
    env["DATABASE_URL"] = "postgresql://postgres@127.0.0.1:1/postgres"  # nothing on port 1
    code, _, err = await inspect(session_id)
    assert code == 1 and "Traceback" not in err, err
    assert err.strip() == (
        "context-engine inspect: cannot connect to PostgreSQL at 127.0.0.1:1/postgres:"
        " Connection refused"
    )


async def test_inspect_pairs_a_pressure_event_only_with_the_request_of_its_build(
    stub: Any, database_dsn: str
) -> None:
    """context.budget.pressure precedes the request its Build shaped (a run's first request
    has its context.snapshot.used between the two); a Build that needs compaction records
    the pressure and no request. That pressure stays in the context events: the run's next
    request (after compaction it fits) shows none."""
    tenant = _tenant()
    memory = pb.MemorySnapshot(
        snapshot_id="snap-1", items=[pb.MemoryItem(item_id="m1", text="Lives in Lyon.")]
    )
    session_id = new_id()
    await stub.Plan(
        pb.PlanRequest(
            tenant_id=tenant,
            session_id=session_id,
            # About 4,000 tokens above the prefix and the output reserve.
            spec=spec(
                model_id=MODEL,
                reserve_output_tokens=1_000,
                policy_cap_tokens=5_500,
                snapshot=memory,
            ),
        )
    )
    first = await _start(stub, tenant, session_id, "Tell me everything.")
    passage = _words(2_000)  # one fits the ~3,800-token body, two do not
    step = pb.StepContext(
        knowledge=[
            pb.KnowledgePassage(item_id="best", text=passage),
            pb.KnowledgePassage(item_id="worse", text=passage),
        ]
    )
    yielded = await _build(stub, tenant, session_id, first, step=step)
    assert [s.step for s in yielded.pressure.steps] == ["drop_knowledge"]
    await _append(stub, tenant, session_id, first, 1, assistant(_words(6_000)))
    run_id = await _start(stub, tenant, session_id, "And now?")
    needs = await _build(stub, tenant, session_id, run_id)
    assert needs.needs_compaction and needs.request_sequence == 0
    prepared = await _prepare(stub, session_id, run_id, tenant=tenant)
    await _commit(stub, session_id, run_id, prepared, "Asked for everything.", tenant=tenant)
    fits = await _build(stub, tenant, session_id, run_id)
    assert fits.request_sequence > 0 and not fits.HasField("pressure")

    console = Console(record=True, width=250, color_system=None)
    await run_inspect(database_dsn, session_id, tenant, console)
    lines = console.export_text().splitlines()

    def line_of(sequence: int, table: str) -> str:
        start = next(i for i, ln in enumerate(lines) if ln.startswith(table))
        return next(ln for ln in lines[start:] if ln.startswith(f"│ {sequence} "))

    assert "context.snapshot.used" in line_of(yielded.request_sequence - 1, "Context events")
    assert (
        line_of(yielded.request_sequence, "Requests").rstrip(" │").endswith("fits:drop_knowledge")
    )
    shown = line_of(fits.request_sequence, "Requests")
    assert "needs_compaction" not in shown and "OVER" not in shown, shown
    pressure = fits.request_sequence - 1
    while "context.budget.pressure" not in line_of(pressure, "Context events"):
        pressure -= 1
    assert "needs_compaction=True" in line_of(pressure, "Context events")


async def test_a_needs_compaction_pressure_is_not_the_next_requests(
    stub: Any, database_dsn: str
) -> None:
    """A Build that needs compaction (a step's corrections too large for the body) records
    its pressure and no request; the run's next Build, without them, fits with no yield
    and records its request at the very next sequence. That request showed the first
    Build's `OVER:compact needs_compaction` (an audit)."""
    tenant = _tenant()
    session_id = new_id()
    await stub.Plan(
        pb.PlanRequest(
            tenant_id=tenant,
            session_id=session_id,
            spec=spec(model_id=MODEL, reserve_output_tokens=1_000, policy_cap_tokens=5_500),
        )
    )
    run_id = await _start(stub, tenant, session_id, "Tell me.")
    await _append(stub, tenant, session_id, run_id, 1, assistant(_words(2_500)))
    # Within row 13's 2,000-token cap (context-assembler@29), beside the run's exchange.
    step = pb.StepContext(
        corrections=[pb.RecallLine(item_id="c1", text=_words(1_500), source="correction")]
    )
    needs = await _build(stub, tenant, session_id, run_id, step=step)
    assert needs.needs_compaction and needs.request_sequence == 0
    fits = await _build(stub, tenant, session_id, run_id)
    assert fits.request_sequence > 0 and not fits.HasField("pressure")

    console = Console(record=True, width=250, color_system=None)
    await run_inspect(database_dsn, session_id, tenant, console)
    lines = console.export_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Requests"))
    shown = next(ln for ln in lines[start:] if ln.startswith(f"│ {fits.request_sequence} "))
    assert "needs_compaction" not in shown and "OVER" not in shown, shown
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Context events"))
    pressure = next(ln for ln in lines[start:] if ln.startswith(f"│ {fits.request_sequence - 1} "))
    assert "context.budget.pressure" in pressure and "needs_compaction=True" in pressure


async def test_inspect_of_a_database_it_cannot_read_is_one_line(database_dsn: str) -> None:
    """docs/operations.md: exit 1 with one line naming why, never an asyncpg traceback: a
    database without the schema (not migrated), and a user without the right to read it."""
    bare = await create_database(migrate=False)
    try:
        code, _, err = await _command(_env(bare), new_id())
    finally:
        await drop_database(bare)
    assert code == 1 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith("context-engine inspect: schema not migrated at ")
    assert line.endswith(
        f'/{bare.rpartition("/")[2]} (relation "sessions" does not exist):'
        " run `context-engine migrate`"
    )

    role = f"ce_noread_{uuid.uuid4().hex[:8]}"  # a role of its own, dropped after
    await admin_execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        as_role = dsn_on_test_server(database_dsn.rpartition("/")[2], user=role)
        code, _, err = await _command(_env(as_role), new_id())
    finally:
        await admin_execute(f'DROP ROLE "{role}"')
    assert code == 1 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith(
        "context-engine inspect: the database user may not read the context-engine tables at"
    )
    assert line.endswith(": permission denied for table sessions")
