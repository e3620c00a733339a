"""Build against the transport ceiling.

A grpc.aio echo server returning a payload the size of a Build response, and the real
Build for a fifty-turn session stored in PostgreSQL, each under the same closed-loop load
(64 in flight, loopback) for the same time, in one run. Prints Build throughput divided by
echo throughput and both p50/p99. Bar: Build >= 1/3 of echo.

Also measured, to show where the gap lies: the storage floor, the same echo making two
trivial PostgreSQL round trips per call through the service's pool (Build reads its run
and records its request: two round trips it cannot skip). Build / floor is what
assembling, rendering and the service's interceptors cost on top of that.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import grpc

from .echo_server import METHOD
from .harness import (
    LoadResult,
    build_request,
    closed_loop,
    free_port,
    scratch_database,
    seed_session,
    server_process,
    stub_for,
)

BAR = 1 / 3


async def run(seconds: float, concurrency: int, turns: int) -> bool:
    async with (
        scratch_database() as dsn,
        server_process(dsn) as target,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = stub_for(channel)
        session_id, run_id = await seed_session(stub, turns)
        request = build_request(session_id, run_id)
        size = (await stub.Build(request)).ByteSize()
        build = await closed_loop(
            lambda n: stub.Build(request), concurrency=concurrency, seconds=seconds
        )
        floor = await _echo(size, concurrency, seconds, "--dsn", dsn, "--round-trips", "2")
    baseline = await _echo(size, concurrency, seconds)

    ratio = build.throughput / baseline.throughput
    print(
        f"transport ceiling: {turns}-turn session, response {size} bytes,"
        f" {concurrency} in flight, {seconds:.0f}s each"
    )
    rows = (
        ("echo ", baseline),
        ("floor", floor),  # echo + Build's two PostgreSQL round trips, nothing assembled
        ("Build", build),
    )
    for name, r in rows:
        print(
            f"  {name} {r.throughput:8.0f} calls/s  p50 {r.p50:6.2f} ms"
            f"  p99 {r.pct(99):6.2f} ms  errors {r.errors}"
        )
    print(
        f"  floor / echo = {floor.throughput / baseline.throughput:.3f}"
        f"  (echo plus two trivial PostgreSQL round trips per call)"
    )
    print(f"  Build / floor = {build.throughput / floor.throughput:.3f}")
    ok = ratio >= BAR and build.errors == 0
    print(
        f"  Build / echo throughput = {ratio:.3f}  (bar >= {BAR:.3f}: {'PASS' if ok else 'FAIL'})"
    )
    return ok


async def _echo(size: int, concurrency: int, seconds: float, *extra: str) -> LoadResult:
    """Closed-loop load on bench.echo_server answering `size` bytes (`extra`: its flags)."""
    port = free_port()
    echo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.echo_server",
            "--port",
            str(port),
            "--size",
            str(size),
            *extra,
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == b"ready"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(METHOD)
            await call(b"x")
            return await closed_loop(lambda n: call(b"x"), concurrency=concurrency, seconds=seconds)
    finally:
        echo.terminate()
        echo.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=50)
    args = parser.parse_args(argv)
    return 0 if asyncio.run(run(args.seconds, args.concurrency, args.turns)) else 1


if __name__ == "__main__":
    sys.exit(main())
