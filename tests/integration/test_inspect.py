"""`context-engine inspect SESSION` over a session driven through the real server."""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import UTC, datetime
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.inspect import run_inspect

from .helpers import TENANT, assistant, new_id, open_session, start_run

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


async def test_inspect_command_exit_codes(stub: Any, database_dsn: str) -> None:
    session_id, _ = await open_session(stub)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_ENGINE_")}
    env["DATABASE_URL"] = database_dsn

    async def inspect(*args: str) -> tuple[int, str, str]:
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

    code, out, _ = await inspect(session_id, "--width", "160")
    assert code == 0 and "Plans (epochs)" in out and session_id in out
    code, _, err = await inspect(new_id())
    assert code == 1 and "not found" in err
    code, _, err = await inspect("not-a-uuid")
    assert code == 1
    # An unreachable database: one line naming it, not an asyncpg traceback.
    env["DATABASE_URL"] = "postgresql://postgres@127.0.0.1:1/postgres"  # nothing on port 1
    code, _, err = await inspect(session_id)
    assert code == 1 and "Traceback" not in err, err
    assert err.strip() == (
        "context-engine inspect: cannot connect to PostgreSQL at 127.0.0.1:1/postgres:"
        " Connection refused"
    )
