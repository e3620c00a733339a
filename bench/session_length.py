"""Cost independent of session length: Build latency for sessions of 50, 500 and 5,000
turns at the same context window (a 16,000-token policy cap, which fifty turns already
fill, so every request is the same size), in one run. Prints the ratio 5,000 / 50. Bar: <= 1.2
(a Build reads and assembles what fits, never the whole log)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import grpc

from .harness import build_request, scratch_database, seed_session, server_process, stub_for

BAR = 1.2


async def run(lengths: list[int], builds: int, window: int) -> bool:
    medians: dict[int, float] = {}
    async with (
        scratch_database() as dsn,
        server_process(dsn) as target,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = stub_for(channel)
        sessions = {n: await seed_session(stub, n, policy_cap_tokens=window) for n in lengths}
        for n, (session_id, run_id) in sessions.items():
            request = build_request(session_id, run_id)
            await stub.Build(request)  # warm the plan cache
            samples = []
            for _ in range(builds):
                started = time.perf_counter()
                await stub.Build(request)
                samples.append((time.perf_counter() - started) * 1000)
            medians[n] = statistics.median(samples)
    print(f"session length: median Build latency over {builds} sequential builds")
    for n, ms in medians.items():
        print(f"  {n:5d} turns: {ms:7.2f} ms")
    ratio = medians[lengths[-1]] / medians[lengths[0]]
    ok = ratio <= BAR
    print(
        f"  {lengths[-1]} / {lengths[0]} = {ratio:.2f}  (bar <= {BAR}: {'PASS' if ok else 'FAIL'})"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="50,500,5000")
    parser.add_argument("--builds", type=int, default=30)
    parser.add_argument("--window", type=int, default=16_000, help="policy cap, tokens")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    return 0 if asyncio.run(run(lengths, args.builds, args.window)) else 1


if __name__ == "__main__":
    sys.exit(main())
