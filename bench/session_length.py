"""Cost independent of session length: Build latency for sessions of 50, 500 and 5,000
turns at the same context window (a 16,000-token policy cap with 4,096 tokens reserved for
output, which fifty turns already fill, so every request is about the same size), in one
run. Prints the ratio 5,000 / 50, and each length's request size and history cut: every
Build must return a request (one that needs compaction would measure nothing). Bar: <= 1.2
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
RESERVE_TOKENS = 4_096


async def run(lengths: list[int], builds: int, window: int) -> bool:
    medians: dict[int, float] = {}
    async with (
        scratch_database() as dsn,
        server_process(dsn) as target,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = stub_for(channel)
        sessions = {
            n: await seed_session(
                stub, n, policy_cap_tokens=window, reserve_output_tokens=RESERVE_TOKENS
            )
            for n in lengths
        }
        requests = {n: build_request(*ids) for n, ids in sessions.items()}
        shapes: dict[int, str] = {}
        for n, request in requests.items():
            built = await stub.Build(request)  # warm the plan cache and the kept history
            if built.needs_compaction:
                print(f"{n} turns: the request needs compaction; raise --window")
                return False
            shapes[n] = (
                f"request {built.request.ByteSize():,} bytes,"
                f" {built.pressure.history_items_dropped:,} carried items cut"
            )
        # Interleaved, one Build of each length per round, so both lengths see the same
        # machine (a checkpoint or autovacuum after seeding would otherwise land on one).
        samples: dict[int, list[float]] = {n: [] for n in requests}
        for _ in range(builds):
            for n, request in requests.items():
                started = time.perf_counter()
                await stub.Build(request)
                samples[n].append((time.perf_counter() - started) * 1000)
        medians = {n: statistics.median(s) for n, s in samples.items()}
    print(f"session length: median Build latency over {builds} sequential builds")
    for n, ms in medians.items():
        print(f"  {n:5d} turns: {ms:7.2f} ms  ({shapes[n]})")
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
