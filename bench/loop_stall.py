"""What a Build of hostile content costs every other caller of the replica.

Content dense with look-alike envelope delimiters ("‹ｕser" repeated: a fetched page can
hold anything) is escaped by Python work per delimiter, about 0.2 s a MB
(core/envelope.py). A run's own tool result is rendered whole, so the first Build of a run
holding a 2 MB one spends that long assembling. On the event loop, every other call of the
replica waited as long (2026-12-07: 0.4 s); in a worker thread (api/engine.py off_loop)
they wait a scheduling interval or two.

Measured on one real server: while a first Build of such a run is in flight, a second
client sends GetPlan of another session one after another; its longest latency is the
stall. The baseline is the same while a Build of a plain run of the same size is in flight
(its content takes the C paths). Printed: both Builds' latencies, both longest GetPlans and
their ratio. Bar: the hostile Build's longest GetPlan at most 10 times the plain one's (a
few of the interpreter's 5 ms switch intervals; on the loop it was 100 times).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from typing import Any

import grpc

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb

from .harness import (
    TENANT,
    build_request,
    scratch_database,
    seed_session,
    server_process,
    stub_for,
)

BAR = 10.0
HOSTILE = "\u2039\uff55ser "  # reads as "<user ": every unit is a delimiter to escape
PLAIN = "The quick brown fox jumps over the lazy dog. "


async def _run_holding(stub: Any, session_id: str, content: str) -> str:
    """A new run of `session_id` whose completed exchange holds `content` as an untrusted
    tool result, followed by a small pending pair: its id."""
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text="Read it")
        )
    )

    def pair(call_id: str, text: str) -> list[pb.ConversationItem]:
        return [
            pb.ConversationItem(
                tool_call=pb.ToolCall(call_id=call_id, tool_name="tool_00", arguments_json="{}")
            ),
            pb.ConversationItem(
                tool_result=pb.ToolResult(
                    call_id=call_id,
                    tool_name="tool_00",
                    trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
                    content=text,
                )
            ),
        ]

    await stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=started.run.run_id,
            expected_checkpoint_version=started.checkpoint_version,
            items=[
                *pair("big", content),
                pb.ConversationItem(assistant_message=pb.AssistantMessage(text="Read it.")),
                *pair("small", "ok"),
            ],
        )
    )
    return str(started.run.run_id)


async def _stall(stub: Any, session_id: str, run_id: str, probe: str) -> tuple[float, float]:
    """(the Build's latency, the longest GetPlan of `probe` while it ran), in ms."""
    done = asyncio.Event()
    longest = 0.0

    async def probing() -> None:
        nonlocal longest
        while not done.is_set():
            started = time.perf_counter()
            await stub.GetPlan(pb.GetPlanRequest(tenant_id=TENANT, session_id=probe))
            longest = max(longest, (time.perf_counter() - started) * 1000)

    prober = asyncio.create_task(probing())
    await asyncio.sleep(0.2)  # the prober's first calls warm its path
    longest = 0.0
    started = time.perf_counter()
    await stub.Build(build_request(session_id, run_id), timeout=60)
    took = (time.perf_counter() - started) * 1000
    done.set()
    await prober
    return took, longest


async def run(megabytes: int, repeat: int) -> bool:
    rows: dict[str, list[tuple[float, float]]] = {"plain": [], "hostile": []}
    async with (
        scratch_database() as dsn,
        server_process(dsn) as target,
        grpc.aio.insecure_channel(target) as building,
        grpc.aio.insecure_channel(target) as probing,
    ):
        stub = _Both(stub_for(building), stub_for(probing))
        probe, _ = await seed_session(stub, 2)
        for n in range(repeat):
            for name, unit in (("plain", PLAIN), ("hostile", HOSTILE)):
                session_id, _ = await seed_session(stub, 2)
                # Distinct every time: nothing of it is in the server's memos.
                content = f"{uuid.uuid4()} {n} " + unit * (megabytes * 2**20 // len(unit))
                run_id = await _run_holding(stub, session_id, content)
                rows[name].append(await _stall(stub, session_id, run_id, probe))
    plain = max(stall for _, stall in rows["plain"])
    hostile = max(stall for _, stall in rows["hostile"])
    print(f"loop stall: a first Build of a run holding {megabytes} MB, {repeat} times each")
    for name in ("plain", "hostile"):
        builds = ", ".join(f"{took:.0f}" for took, _ in rows[name])
        stalls = ", ".join(f"{stall:.1f}" for _, stall in rows[name])
        print(f"  {name:8} Build ms: {builds}; longest GetPlan meanwhile, ms: {stalls}")
    ratio = hostile / plain if plain else float("inf")
    ok = ratio <= BAR
    print(
        f"  longest GetPlan, hostile / plain = {ratio:.2f}"
        f"  (bar <= {BAR:.0f}: {'PASS' if ok else 'FAIL'})"
    )
    return ok


class _Both:
    """One stub whose GetPlan goes through a channel of its own (a second client)."""

    def __init__(self, stub: Any, prober: Any) -> None:
        self._stub, self.GetPlan = stub, prober.GetPlan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    return 0 if asyncio.run(run(args.megabytes, args.repeat)) else 1


if __name__ == "__main__":
    sys.exit(main())
