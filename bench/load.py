"""Load and faults, loopback only, bounded in time.

Load: a closed-loop mix of StartRun / AppendItems / Build / ReportUsage over many sessions
for a fixed time against a `context-engine serve` subprocess. Afterwards every
acknowledged write is looked up in PostgreSQL. Reports p50/p99 per RPC and the error count
(bar: zero errors).

--faults: the run uses a private embedded PostgreSQL (pgserver) that is stopped a third of
the way in and restarted at two thirds. During the outage RPCs must fail fast with
UNAVAILABLE (never hang past their deadline); afterwards the same server process recovers
without a restart; nothing acknowledged is lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.store import apply_migrations

from .harness import TENANT, plan_spec, scratch_database, server_process, stub_for

DEADLINE_S = 5.0


@dataclass
class Ledger:
    """What the server acknowledged, to be found in the database afterwards."""

    runs: set[str] = field(default_factory=set)
    items: set[tuple[str, int]] = field(default_factory=set)  # (item_id, sequence)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    slowest_error_s: float = 0.0


async def _call(ledger: Ledger, name: str, coro: Any) -> Any:
    started = time.perf_counter()
    try:
        result = await coro
    except grpc.aio.AioRpcError as exc:
        elapsed = time.perf_counter() - started
        ledger.errors[f"{name}:{exc.code().name}"] += 1
        ledger.slowest_error_s = max(ledger.slowest_error_s, elapsed)
        raise
    ledger.latencies[name].append((time.perf_counter() - started) * 1000)
    return result


async def _worker(stub: Any, session_id: str, stop_at: float, ledger: Ledger, n: int) -> None:
    turn = 0
    while time.monotonic() < stop_at:
        turn += 1
        try:
            started = await _call(
                ledger,
                "StartRun",
                stub.StartRun(
                    pb.StartRunRequest(
                        tenant_id=TENANT,
                        session_id=session_id,
                        user_message=pb.UserMessage(text=f"worker {n} turn {turn}"),
                    ),
                    timeout=DEADLINE_S,
                ),
            )
            run_id, version = started.run.run_id, started.checkpoint_version
            ledger.runs.add(run_id)
            call_id = f"c{turn}"
            appended = await _call(
                ledger,
                "AppendItems",
                stub.AppendItems(
                    pb.AppendItemsRequest(
                        tenant_id=TENANT,
                        session_id=session_id,
                        run_id=run_id,
                        expected_checkpoint_version=version,
                        items=[
                            pb.ConversationItem(
                                tool_call=pb.ToolCall(
                                    call_id=call_id,
                                    tool_name="tool_00",
                                    arguments_json=json.dumps({"q": "x"}),
                                )
                            ),
                            pb.ConversationItem(
                                tool_result=pb.ToolResult(
                                    call_id=call_id,
                                    tool_name="tool_00",
                                    content="result " * 40,
                                    trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
                                )
                            ),
                        ],
                    ),
                    timeout=DEADLINE_S,
                ),
            )
            ledger.items.update(zip(appended.item_ids, appended.sequences, strict=True))
            build_request = pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id)
            built = await _call(ledger, "Build", stub.Build(build_request, timeout=DEADLINE_S))
            await _call(
                ledger,
                "ReportUsage",
                stub.ReportUsage(
                    pb.ReportUsageRequest(
                        tenant_id=TENANT,
                        session_id=session_id,
                        request_sequence=built.request_sequence,
                        model_id="claude-sonnet-4-5",
                        input_tokens=max(1, built.estimated_input_tokens // 2),
                        output_tokens=20,
                    ),
                    timeout=DEADLINE_S,
                ),
            )
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)  # back off a little; the next turn starts a fresh run


async def _verify(dsn: str, ledger: Ledger) -> tuple[int, int]:
    conn = await asyncpg.connect(dsn)
    try:
        runs = {str(r["run_id"]) for r in await conn.fetch("SELECT run_id FROM runs")}
        items = {
            (r["item_id"], r["sequence"])
            for r in await conn.fetch(
                "SELECT item_id, sequence FROM session_events WHERE item_id IS NOT NULL"
            )
        }
    finally:
        await conn.close()
    return len(ledger.runs - runs), len(ledger.items - items)


async def _drive(target: str, dsn: str, sessions: int, seconds: float, fault: Any = None) -> Ledger:
    ledger = Ledger()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = stub_for(channel)
        ids = [str(uuid.uuid4()) for _ in range(sessions)]
        for session_id in ids:
            await stub.Plan(
                pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=plan_spec())
            )
        stop_at = time.monotonic() + seconds
        tasks = [_worker(stub, sid, stop_at, ledger, n) for n, sid in enumerate(ids)]
        if fault is not None:
            tasks.append(fault(seconds))
        await asyncio.gather(*tasks)
    return ledger


def _report(ledger: Ledger, lost: tuple[int, int], seconds: float) -> None:
    total = sum(len(v) for v in ledger.latencies.values())
    print(f"  {total} acknowledged calls in {seconds:.0f}s ({total / seconds:.0f}/s)")
    for name, values in sorted(ledger.latencies.items()):
        data = sorted(values)
        p50, p99 = data[len(data) // 2], data[min(len(data) - 1, int(0.99 * len(data)))]
        print(f"  {name:12s} n={len(data):6d}  p50 {p50:7.2f} ms  p99 {p99:7.2f} ms")
    print(f"  errors: {dict(ledger.errors) or 'none'}")
    print(f"  acknowledged but missing afterwards: runs {lost[0]}, items {lost[1]}")


async def run_load(sessions: int, seconds: float) -> bool:
    async with scratch_database() as dsn, server_process(dsn) as target:
        ledger = await _drive(target, dsn, sessions, seconds)
        lost = await _verify(dsn, ledger)
    print(f"load: {sessions} sessions, closed loop, {seconds:.0f}s")
    _report(ledger, lost, seconds)
    ok = not ledger.errors and lost == (0, 0)
    print(f"  zero errors and nothing lost: {'PASS' if ok else 'FAIL'}")
    return ok


async def run_faults(sessions: int, seconds: float) -> bool:
    import pgserver

    with tempfile.TemporaryDirectory() as tmp:
        pg = pgserver.get_server(tmp, cleanup_mode="stop")
        dsn = pg.get_uri()
        conn = await asyncpg.connect(dsn)
        await apply_migrations(conn)
        await conn.close()
        outage: dict[str, float] = {}

        async def fault(total: float) -> None:
            await asyncio.sleep(total / 3)
            pid = pg.get_pid()
            assert pid is not None
            os.kill(pid, signal.SIGINT)  # PostgreSQL's fast shutdown
            outage["down"] = time.monotonic()
            await asyncio.sleep(total / 3)
            while _alive(pid):  # a restart racing the old postmaster's exit fails
                await asyncio.sleep(0.1)
            await asyncio.to_thread(pg.ensure_postgres_running)
            outage["up"] = time.monotonic()

        async with server_process(dsn) as target:
            ledger = await _drive(target, dsn, sessions, seconds, fault)
            # After the restart the same server process must serve again.
            recovered = ledger.latencies["Build"] and ledger.latencies["StartRun"]
            lost = await _verify(dsn, ledger)
        pg.cleanup()
    print(
        f"faults: PostgreSQL stopped at {seconds / 3:.0f}s and restarted at {2 * seconds / 3:.0f}s"
    )
    _report(ledger, lost, seconds)
    only_unavailable = all(k.endswith(":UNAVAILABLE") for k in ledger.errors)
    fast = ledger.slowest_error_s <= DEADLINE_S + 1.0
    print(
        f"  failures were UNAVAILABLE only: {only_unavailable};"
        f" slowest failure {ledger.slowest_error_s:.2f}s"
        f" (deadline {DEADLINE_S:.0f}s)"
    )
    ok = bool(recovered) and only_unavailable and fast and lost == (0, 0) and bool(ledger.errors)
    print(f"  fail fast, recover without restart, lose nothing: {'PASS' if ok else 'FAIL'}")
    return ok


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--faults", action="store_true")
    args = parser.parse_args(argv)
    runner = run_faults if args.faults else run_load
    return 0 if asyncio.run(runner(args.sessions, args.seconds)) else 1


if __name__ == "__main__":
    sys.exit(main())
