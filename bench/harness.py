"""Shared benchmark machinery: a scratch database, a server subprocess, seeded sessions
and a closed-loop load generator. Everything talks to 127.0.0.1 only, and every loop is
bounded in time and count."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import urlsplit

import asyncpg
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc

BASE_DSN = os.environ.get(
    "BENCH_DATABASE_URL",
    os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
)
TENANT = "bench"


@asynccontextmanager
async def scratch_database() -> AsyncIterator[str]:
    """A fresh, migrated database, dropped afterwards."""
    from context_engine.store import apply_migrations

    name = f"ce_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(BASE_DSN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    dsn = BASE_DSN.rpartition("/")[0] + "/" + name
    conn = await asyncpg.connect(dsn)
    await apply_migrations(conn)
    await conn.close()
    try:
        yield dsn
    finally:
        admin = await asyncpg.connect(BASE_DSN)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@asynccontextmanager
async def server_process(
    dsn: str,
    *extra: str,
    module: str = "context_engine.cli",
    started: Callable[[int], None] | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[str]:
    """`context-engine serve` in a subprocess (its own core); yields its address.
    `module`: what `python -m` runs (bench.stack_server: the same server, Build memoized);
    `started` is given the process id. It binds port 0 and the address is read from its
    "listening on" line (a port picked here and bound there could be taken in between);
    its log goes to a file, which a pipe nobody reads would block once full. `env`: more
    of its environment (settings, CONTEXT_ENGINE_*)."""
    env = {**os.environ, "CONTEXT_ENGINE_LOG_LEVEL": "WARNING", **(env or {})}
    command = [sys.executable, "-m", module, "serve", "--listen", "127.0.0.1:0"]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [*command, "--database-url", dsn, *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        try:
            target = await listening_address(proc, log)
            await wait_serving(target, proc)
            if started is not None:
                started(proc.pid)
            yield target
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def listening_address(proc: subprocess.Popen[bytes], log: IO[bytes]) -> str:
    """HOST:PORT from the "context-engine listening on HOST:PORT" line `serve` prints once
    it is up (within a minute); its log's tail if it exits first."""
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
    if b"listening on" not in line:
        proc.wait(timeout=20)
        log.seek(0)
        raise RuntimeError(f"server exited: {log.read().decode(errors='replace')[-2000:]}")
    return line.decode().rsplit(" ", 1)[1].strip()


async def wait_serving(target: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + 60
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with status {proc.returncode}")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"server at {target} did not become ready")


def plan_spec(
    tools: int = 6,
    snapshot_items: int = 0,
    skills: int = 0,
    policy_cap_tokens: int = 0,
    reserve_output_tokens: int = 0,
) -> pb.PlanSpec:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    return pb.PlanSpec(
        model_id="claude-sonnet-4-5",
        agent=pb.AgentSpec(agent_id="bench", version="1", instructions="You are a careful agent."),
        principal=pb.Principal(principal_id="p", scopes=["read"], scope_label="owner"),
        tools=[
            pb.ToolSpec(
                name=f"tool_{n:02d}",
                description=f"Tool number {n}. Looks things up.",
                input_schema_json=json.dumps(schema),
                side_effect=pb.SIDE_EFFECT_NONE,
            )
            for n in range(tools)
        ],
        skills=[
            pb.SkillCatalogEntry(name=f"skill_{n}", description="Does a thing well.", version="1")
            for n in range(skills)
        ],
        snapshot=pb.MemorySnapshot(
            snapshot_id="snap",
            recall_trace_id="trace",
            watermark=1,
            items=[
                pb.MemoryItem(
                    item_id=f"m{n}", text=f"The user prefers option {n}.", source="belief"
                )
                for n in range(snapshot_items)
            ],
        ),
        environment=pb.SessionEnvironment(surface="chat", time_zone="UTC"),
        policy_cap_tokens=policy_cap_tokens,
        reserve_output_tokens=reserve_output_tokens,
    )


async def seed_session(
    stub: Any,
    turns: int,
    *,
    tools: int = 6,
    policy_cap_tokens: int = 0,
    reserve_output_tokens: int = 0,
) -> tuple[str, str]:
    """A session with `turns` completed turns (user, tool call, tool result, answer) and a
    fresh run on top. Returns (session_id, run_id of the fresh run)."""
    session_id = str(uuid.uuid4())
    spec = plan_spec(
        tools, policy_cap_tokens=policy_cap_tokens, reserve_output_tokens=reserve_output_tokens
    )
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec))
    for turn in range(turns):
        started = await stub.StartRun(
            pb.StartRunRequest(
                tenant_id=TENANT,
                session_id=session_id,
                user_message=pb.UserMessage(text=f"Question {turn}: what about item {turn}?"),
            )
        )
        call_id = f"c{turn}"
        await stub.AppendItems(
            pb.AppendItemsRequest(
                tenant_id=TENANT,
                session_id=session_id,
                run_id=started.run.run_id,
                expected_checkpoint_version=started.checkpoint_version,
                items=[
                    pb.ConversationItem(
                        tool_call=pb.ToolCall(
                            call_id=call_id,
                            tool_name="tool_00",
                            arguments_json=json.dumps({"q": str(turn)}),
                        )
                    ),
                    pb.ConversationItem(
                        tool_result=pb.ToolResult(
                            call_id=call_id,
                            tool_name="tool_00",
                            trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
                            content=f"Result {turn}: " + "lorem ipsum dolor sit amet " * 8,
                        )
                    ),
                    pb.ConversationItem(
                        assistant_message=pb.AssistantMessage(text=f"Answer {turn}: it is fine.")
                    ),
                ],
            )
        )
    fresh = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text="And now?")
        )
    )
    return session_id, fresh.run.run_id


def build_request(session_id: str, run_id: str) -> pb.BuildRequest:
    request = pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id)
    request.now.FromSeconds(1_790_000_000)
    return request


@dataclass
class LoadResult:
    calls: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    error_codes: dict[str, int] = field(default_factory=dict)
    # CPU milliseconds per call by process (bench.transport measures it).
    cpu_ms: dict[str, float] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    def pct(self, p: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        data = sorted(self.latencies_ms)
        return data[min(len(data) - 1, int(p / 100 * len(data)))]

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")


async def closed_loop(
    call: Callable[[int], Awaitable[Any]],
    *,
    concurrency: int,
    seconds: float,
    max_calls: int = 10**7,
) -> LoadResult:
    """`concurrency` workers each issue the next call as soon as the last one returns."""
    result = LoadResult()
    stop_at = time.monotonic() + seconds
    counter = 0

    async def worker() -> None:
        nonlocal counter
        while time.monotonic() < stop_at and counter < max_calls:
            counter += 1
            n = counter
            started = time.perf_counter()
            try:
                await call(n)
            except grpc.aio.AioRpcError as exc:
                result.errors += 1
                result.error_codes[exc.code().name] = result.error_codes.get(exc.code().name, 0) + 1
            else:
                result.calls += 1
                result.latencies_ms.append((time.perf_counter() - started) * 1000)

    begin = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.seconds = time.monotonic() - begin
    return result


def stub_for(channel: grpc.aio.Channel) -> pb_grpc.ContextEngineStub:
    return pb_grpc.ContextEngineStub(channel)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process `pid` (all its threads) has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def database_backend_cpu(dsn: str) -> dict[int, float]:
    """CPU seconds used so far by each PostgreSQL backend connected to `dsn`'s database,
    by pid (pg_stat_activity, asked over a connection to BASE_DSN's database so the
    question is not counted; the CPU read from /proc, so the server must be local).
    Excluded: backends of other databases (other workers' load) and the processes the
    whole cluster shares (postmaster, checkpointer, background and WAL writers, the
    autovacuum launcher), which serve every database at once."""
    database = urlsplit(dsn).path.lstrip("/")
    conn = await asyncpg.connect(BASE_DSN)
    try:
        pids = [
            r["pid"]
            for r in await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1", database
            )
        ]
    finally:
        await conn.close()
    used: dict[int, float] = {}
    for pid in pids:
        try:
            used[pid] = cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited since the query
    return used


def backend_cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the backends used between two database_backend_cpu samples: a backend
    that started in between counts whole, one that exited in between counts nothing (an
    undercount, never a negative)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def process_running(pid: int) -> bool:
    """Whether process `pid` still runs: it exists and is not a zombie (a child that
    exited and has not been waited for still answers os.kill(pid, 0))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
