"""Usage reports racing for one correction: ReportUsage under closed-loop load when every
session belongs to one tenant (each absorbed report moves that tenant's factor for the
model, so the reports race for one row of estimator_corrections), against the same load
over sessions of one tenant each (no two reports share a correction), measured in the
same run. Prints throughput, p50 and p99 of both and the ratio shared / separate, and
checks afterwards that every acknowledged report is one sample of its factor."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from typing import Any

import asyncpg
import grpc

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb

from .harness import (
    LoadResult,
    build_request,
    closed_loop,
    plan_spec,
    scratch_database,
    server_process,
    stub_for,
)


async def _built_session(stub: Any, tenant: str) -> pb.ReportUsageRequest:
    """A session of `tenant` with one Build; the report of that request (no key yet)."""
    session_id = str(uuid.uuid4())
    await stub.Plan(pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=plan_spec(6)))
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=tenant, session_id=session_id, user_message=pb.UserMessage(text="hello")
        )
    )
    request = build_request(session_id, started.run.run_id)
    request.tenant_id = tenant
    built = await stub.Build(request)
    return pb.ReportUsageRequest(
        tenant_id=tenant,
        session_id=session_id,
        request_sequence=built.request_sequence,
        model_id=plan_spec(6).model_id,
        input_tokens=built.estimated_input_tokens + 7,
        output_tokens=20,
    )


async def _phase(
    stub: Any, reports: list[pb.ReportUsageRequest], concurrency: int, seconds: float
) -> LoadResult:
    """Each call reports a session's request again under a new key: a new sample."""

    async def call(n: int) -> None:
        report = pb.ReportUsageRequest()
        report.CopyFrom(reports[n % len(reports)])
        report.idempotency_key = f"r{n}"
        await stub.ReportUsage(report)

    return await closed_loop(call, concurrency=concurrency, seconds=seconds)


async def _lost(dsn: str, tenants: set[str]) -> int:
    """Absorbed reports that are not a sample of their tenant's factor (0 when none)."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT (SELECT count(*) FROM usage_reports WHERE absorbed"
            "  AND tenant_id = ANY($1::text[])) AS absorbed,"
            " (SELECT coalesce(sum(samples), 0) FROM estimator_corrections"
            "  WHERE tenant_id = ANY($1::text[])) AS samples",
            sorted(tenants),
        )
    finally:
        await conn.close()
    return int(row["absorbed"]) - int(row["samples"])


async def run(sessions: int, concurrency: int, seconds: float) -> bool:
    async with (
        scratch_database() as dsn,
        server_process(dsn) as target,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = stub_for(channel)
        shared_tenant = f"shared-{uuid.uuid4().hex[:8]}"
        separate_tenants = [f"own-{n}-{uuid.uuid4().hex[:8]}" for n in range(sessions)]
        shared = [await _built_session(stub, shared_tenant) for _ in range(sessions)]
        separate = [await _built_session(stub, t) for t in separate_tenants]
        # Warm both paths (the first report of each correction inserts its row).
        await _phase(stub, separate, concurrency, 1.0)
        await _phase(stub, shared, concurrency, 1.0)
        base = await _phase(stub, separate, concurrency, seconds)
        contended = await _phase(stub, shared, concurrency, seconds)
        lost = await _lost(dsn, {shared_tenant, *separate_tenants})
    print(f"usage contention: {sessions} sessions, {concurrency} in flight, {seconds:.0f} s each")
    for name, result in (("separate tenants (baseline)", base), ("one tenant", contended)):
        print(
            f"  {name:28s} {result.throughput:7.0f} reports/s   p50 {result.p50:6.2f} ms"
            f"   p99 {result.pct(99):6.2f} ms   errors {result.errors}"
        )
    ratio = contended.throughput / base.throughput if base.throughput else 0.0
    print(f"  one tenant / separate: {ratio:.2f} of the throughput")
    print(f"  absorbed reports missing from their factor: {lost}")
    return lost == 0 and base.errors == 0 and contended.errors == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    return 0 if asyncio.run(run(args.sessions, args.concurrency, args.seconds)) else 1


if __name__ == "__main__":
    sys.exit(main())
