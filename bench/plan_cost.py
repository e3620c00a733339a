"""Plan cost: Plan with a 40-tool roster, skills and a snapshot, and Rotate; per-call
medians over a fixed number of calls, against GetPlan (a read of the same plan) measured in
the same run as the baseline.

Each session's spec is its own: every description, instruction and memory its plan renders
names the session, so no Plan is made of those renderings an earlier one left in the
server's memos (tool and skill names and the input schema are shared); each Rotate sends a
spec whose texts all changed (a new version); a Rotate without a spec (the sweep an
operator's change makes: the pinned spec rebuilt, the spec the Rotate before it rendered)
is measured apart (an audit: every Plan sent one spec, and the Rotate measured was the
sweep alone; a review: with only the instructions changed, the tools, skills and memories
were still memo hits).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid

import grpc

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb

from .harness import TENANT, plan_spec, scratch_database, server_process, stub_for


async def _timed(coro: object) -> float:
    started = time.perf_counter()
    await coro  # type: ignore[misc]
    return (time.perf_counter() - started) * 1000


def _spec(n: int, version: str = "1") -> pb.PlanSpec:
    """Session `n`'s spec: every text the plan renders (instructions, each tool's and
    skill's description, each memory) names the session and `version`, so nothing of it
    is in the server's memos before its Plan (or its Rotate) renders it."""
    spec = plan_spec(tools=40, snapshot_items=30, skills=10)
    mark = f" (session {n}, version {version})"
    spec.agent.version = version
    spec.agent.instructions += mark
    for tool in spec.tools:
        tool.description += mark
    for skill in spec.skills:
        skill.description += mark
    for memory in spec.snapshot.items:
        memory.text += mark
    return spec


async def run(calls: int) -> None:
    async with (
        scratch_database() as dsn,
        server_process(dsn) as target,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = stub_for(channel)
        plan_ms, rotate_ms, sweep_ms, read_ms = [], [], [], []
        for n in range(calls):
            session_id = str(uuid.uuid4())
            spec = _spec(n)
            plan_ms.append(
                await _timed(
                    stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec))
                )
            )
            read_ms.append(
                await _timed(
                    stub.GetPlan(pb.GetPlanRequest(tenant_id=TENANT, session_id=session_id))
                )
            )
            changed = _spec(n, version="2")
            at = {"tenant_id": TENANT, "session_id": session_id}
            rotate_ms.append(
                await _timed(
                    stub.Rotate(
                        pb.RotateRequest(
                            **at, from_epoch=1, reason=pb.PLAN_REASON_AGENT_CHANGED, spec=changed
                        )
                    )
                )
            )
            sweep_ms.append(
                await _timed(
                    stub.Rotate(
                        pb.RotateRequest(**at, from_epoch=2, reason=pb.PLAN_REASON_AGENT_CHANGED)
                    )
                )
            )
    base = statistics.median(read_ms)
    print(f"plan cost: 40 tools, 10 skills, 30 snapshot items; {calls} sessions, a spec each")
    for name, values in (
        ("GetPlan (baseline)", read_ms),
        ("Plan", plan_ms),
        ("Rotate (new spec)", rotate_ms),
        ("Rotate (no spec)", sweep_ms),
    ):
        med = statistics.median(values)
        print(f"  {name:18s} median {med:7.2f} ms   ({med / base:5.1f}x GetPlan)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    asyncio.run(run(args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
