"""Measure the server's memory and CPU under a short, bounded load on loopback.

The resource requests in deploy/k8s/*.yaml come from this script's output:

    .venv/bin/python deploy/measure.py --database-url postgresql://postgres@127.0.0.1/postgres

It creates a scratch database, starts `context-engine serve` on a free loopback port as a
child process, drives --workers concurrent workers through --sessions sessions each (Plan,
StartRun, then --steps rounds of AppendItems + Build with a growing tool history) using the
Python client, samples the server's RSS with psutil, then stops the server and drops the
database. It prints RSS at idle and its peak under load, CPU seconds per request, and
requests per CPU-second. Every loop is bounded by count; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
import time
import uuid
from pathlib import Path

import asyncpg
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python" / "src"))

from context_engine_client import (  # noqa: E402
    ContextEngineClient,
    pb,
    tool,
    tool_call,
    tool_result,
)

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
PAGE = "Timetable: " + " ".join(f"{h:02d}:04 TGV {6600 + h}" for h in range(24))


def _spec() -> pb.PlanSpec:
    return pb.PlanSpec(
        model_id="claude-sonnet-4-5",
        agent=pb.AgentSpec(agent_id="load", version="1", instructions="Answer briefly. " * 40),
        principal=pb.Principal(principal_id="p", scopes=["web.read"], scope_label="owner"),
        tools=[
            tool(f"tool.{i}", f"Tool number {i}.", SCHEMA, required_scopes=["web.read"])
            for i in range(8)
        ],
        environment=pb.SessionEnvironment(surface="chat", time_zone="Europe/Berlin"),
    )


async def _worker(target: str, sessions: int, steps: int, counter: list[int]) -> None:
    async with ContextEngineClient(target, f"load-{uuid.uuid4().hex[:8]}") as client:
        for _ in range(sessions):
            session = await client.open_session(_spec())
            run = await session.start_run("Find me a train.")
            counter[0] += 2
            for step in range(steps):
                call_id = f"c{step}"
                await run.append(
                    tool_call(call_id, "tool.1", {"q": f"page {step}"}),
                    tool_result(call_id, "tool.1", PAGE),
                )
                await run.build()
                counter[0] += 2


async def _sample(process: psutil.Process, peak: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1/postgres")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    base, _, _ = args.database_url.rpartition("/")
    name = f"ce_measure_{os.getpid()}"
    admin = await asyncpg.connect(args.database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    server = await asyncio.create_subprocess_exec(
        str(ROOT / ".venv" / "bin" / "context-engine"),
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        f"{base}/{name}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert server.stdout is not None
        port = None
        while port is None:
            line = (await server.stdout.readline()).decode()
            if not line:
                raise SystemExit("the server exited before listening")
            if match := re.search(r"listening on [\d.]+:(\d+)", line):
                port = int(match.group(1))
        process = psutil.Process(server.pid)
        target = f"127.0.0.1:{port}"
        # Warm up one session so imports and the pool are in place, then read idle RSS.
        await _worker(target, 1, 1, [0])
        idle_rss = process.memory_info().rss
        cpu_before = sum(process.cpu_times()[:2])
        peak, counter, stop = [idle_rss], [0], asyncio.Event()
        sampler = asyncio.create_task(_sample(process, peak, stop))
        started = time.monotonic()
        await asyncio.gather(
            *(_worker(target, args.sessions, args.steps, counter) for _ in range(args.workers))
        )
        elapsed = time.monotonic() - started
        stop.set()
        await sampler
        cpu = sum(process.cpu_times()[:2]) - cpu_before
        mib = 1024 * 1024
        print(f"load: {args.workers} workers x {args.sessions} sessions x {args.steps} steps")
        print(f"requests: {counter[0]} in {elapsed:.1f}s wall, {cpu:.1f}s server CPU")
        print(f"RSS idle: {idle_rss / mib:.0f} MiB, peak under load: {peak[0] / mib:.0f} MiB")
        print(f"CPU per request: {1000 * cpu / counter[0]:.2f} ms")
        print(f"requests per server CPU-second: {counter[0] / cpu:.0f}")
    finally:
        server.terminate()
        await server.wait()
        admin = await asyncpg.connect(args.database_url)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
