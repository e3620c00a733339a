"""Build against the transport ceiling.

A grpc.aio echo server returning a payload the size of a Build response, and the real
Build for a fifty-turn session stored in PostgreSQL, each under the same closed-loop load
(64 in flight, loopback) for the same time, in one run. Prints Build throughput divided by
echo throughput and both p50/p99. Bar: Build >= 1/3 of echo.

Also measured, to show where the gap lies:
- stack: the real server with Build's storage and assembly taken away (bench.stack_server:
  Engine.build memoized), so only the service's per-call stack runs: interceptors, request
  parsing, the response composed and serialized, grpc.
- Build, nothing kept: the real Build on a server that keeps nothing it read
  (replica_cache_bytes 0), so every call reads the run's head, checkpoint and carried
  history from PostgreSQL. The Build row's server keeps them from its first call on, as
  a replica does for the runs it serves (an audit: that row reads the session from
  PostgreSQL only once, and its only database work per call is the record it writes).
  Informational: the bar is on the Build row.
- floor: the echo making one trivial PostgreSQL round trip per call through the
  service's pool: the one a Build cannot skip, its record (since 2026-12-01 a Build of a
  run the replica built before is made from the run head it kept, which the record
  confirms; before, it read the head in a round trip of its own, and the floor made two).
The load generator treats every server alike: it sends the request as bytes serialized
once and takes the response as bytes, unparsed (a Build response is checked once, before
the load). Until 2026-12-01 it parsed every BuildResponse into protobuf objects and none
of the echo's, which charged Build's side of the shared two cores with the client's
parsing (0.86 against 0.37 ms of load-generator CPU per call).

And for each, the CPU milliseconds per call of the server process, the load generator
(this process) and PostgreSQL: on two shared cores, their sum is what bounds calls per
second. PostgreSQL's figure is the backends connected to the benchmark's own scratch
database (pids from pg_stat_activity, sampled before and after each measurement, CPU from
/proc; a backend that exits in between is not counted). The postmaster and the processes
the cluster shares (checkpointer, background and WAL writers, autovacuum launcher) are
excluded, as is every other database's load, so it is a lower bound on what the
benchmark costs PostgreSQL; it needs the server on this machine. (It used to sum every
postgres process on the machine: other workers' load counted, and a backend exiting
between the two samples made it negative.)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from .echo_server import METHOD
from .harness import (
    LoadResult,
    backend_cpu_delta,
    build_request,
    closed_loop,
    cpu_seconds,
    database_backend_cpu,
    scratch_database,
    seed_session,
    server_process,
    stub_for,
)

BAR = 1 / 3
BUILD_METHOD = "/context_engine.v1.ContextEngine/Build"


async def run(seconds: float, concurrency: int, turns: int) -> bool:
    server: list[int] = []
    stack_server: list[int] = []
    async with (
        scratch_database() as dsn,
        server_process(dsn, started=server.append) as target,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = stub_for(channel)
        session_id, run_id = await seed_session(stub, turns)
        request = build_request(session_id, run_id)
        built = await stub.Build(request)
        if built.needs_compaction or not built.provider_payload:
            raise RuntimeError("the benchmark's Build returned no request")
        size = built.ByteSize()
        body = request.SerializeToString()
        build = await _measured(server[0], _raw_build(channel), body, concurrency, seconds, dsn)
        unkept: list[int] = []
        async with (
            server_process(
                dsn, started=unkept.append, env={"CONTEXT_ENGINE_REPLICA_CACHE_BYTES": "0"}
            ) as u,
            grpc.aio.insecure_channel(u) as unkept_channel,
        ):
            reading = _raw_build(unkept_channel)
            await reading(body)
            read = await _measured(unkept[0], reading, body, concurrency, seconds, dsn)
        async with (
            server_process(dsn, module="bench.stack_server", started=stack_server.append) as s,
            grpc.aio.insecure_channel(s) as stack_channel,
        ):
            stack_build = _raw_build(stack_channel)
            await stack_build(body)  # the one real build it then repeats
            stack = await _measured(stack_server[0], stack_build, body, concurrency, seconds, dsn)
        floor = await _echo(size, concurrency, seconds, dsn)
    baseline = await _echo(size, concurrency, seconds)

    ratio = build.throughput / baseline.throughput
    # Both servers install uvloop when it is importable (the same interpreter runs them).
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    print(
        f"transport ceiling: {turns}-turn session, response {size} bytes,"
        f" {concurrency} in flight, {seconds:.0f}s each, servers on {loop}"
    )
    print("  CPU ms per call: server / load generator / PostgreSQL (this database's backends)")
    rows = (
        ("echo ", baseline),
        ("stack", stack),  # the service's per-call stack: Build memoized, no storage
        ("floor", floor),  # echo + Build's PostgreSQL round trip, nothing assembled
        ("Build", build),
        ("read ", read),  # Build on a replica that keeps nothing: PostgreSQL every call
    )
    for name, r in rows:
        cpu = " / ".join(f"{r.cpu_ms[k]:.2f}" for k in ("server", "client", "postgres"))
        print(
            f"  {name} {r.throughput:8.0f} calls/s  p50 {r.p50:6.2f} ms"
            f"  p99 {r.pct(99):6.2f} ms  errors {r.errors}  CPU {cpu}"
        )
    print(
        f"  stack / echo = {stack.throughput / baseline.throughput:.3f}"
        f"  (the service's own per-call stack, with storage and assembly free)"
    )
    print(
        f"  floor / echo = {floor.throughput / baseline.throughput:.3f}"
        f"  (echo plus one trivial PostgreSQL round trip per call, as Build's record)"
    )
    print(f"  Build / floor = {build.throughput / floor.throughput:.3f}")
    print(
        f"  read / echo = {read.throughput / baseline.throughput:.3f}"
        "  (Build reading the session from PostgreSQL every call: informational)"
    )
    # The server is one process whose main thread is the bound: a core's worth of CPU per
    # second spread over the Builds the bar asks for is the most each may take.
    needed = 1000 / (BAR * baseline.throughput)
    print(
        f"  the bar at this echo: Build at <= {needed:.2f} ms of server CPU per call"
        f" (one core's worth over {BAR * baseline.throughput:.0f} Builds/s);"
        f" it took {build.cpu_ms['server']:.2f}"
    )
    # Every row error-free: a failing echo would lower the baseline and flatter the ratio.
    errors = {name.strip(): r.errors for name, r in rows if r.errors}
    if errors:
        print(f"  errors: {errors}")
    ok = ratio >= BAR and not errors
    print(
        f"  Build / echo throughput = {ratio:.3f}  (bar >= {BAR:.3f}: {'PASS' if ok else 'FAIL'})"
    )
    return ok


async def _measured(
    pid: int,
    method: Callable[[Any], Awaitable[Any]],
    message: Any,
    concurrency: int,
    seconds: float,
    dsn: str | None,
) -> LoadResult:
    """Closed-loop load of `method(message)`, with CPU per call of server `pid`, this
    process and the PostgreSQL backends of `dsn`'s database (None: it uses none)
    recorded on the result."""
    database_before = await database_backend_cpu(dsn) if dsn else {}
    before = _cpu(pid)
    result = await closed_loop(lambda n: method(message), concurrency=concurrency, seconds=seconds)
    after = _cpu(pid)
    database_after = await database_backend_cpu(dsn) if dsn else {}
    calls = max(result.calls + result.errors, 1)
    result.cpu_ms = {k: (after[k] - before[k]) * 1000 / calls for k in before}
    result.cpu_ms["postgres"] = backend_cpu_delta(database_before, database_after) * 1000 / calls
    return result


def _raw_build(channel: grpc.aio.Channel) -> Callable[[bytes], Awaitable[bytes]]:
    """Build with the request and response as bytes, as the echo is called: the load
    generator does the same work per call whichever server it loads."""
    return channel.unary_unary(BUILD_METHOD)  # type: ignore[return-value]


def _cpu(pid: int) -> dict[str, float]:
    return {"server": cpu_seconds(pid), "client": cpu_seconds(os.getpid())}


async def _echo(size: int, concurrency: int, seconds: float, dsn: str | None = None) -> LoadResult:
    """Closed-loop load on bench.echo_server answering `size` bytes; with `dsn`, making
    one trivial round trip per call to that database through the service's pool."""
    extra = ("--dsn", dsn, "--round-trips", "1") if dsn else ()
    echo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.echo_server",
            "--size",
            str(size),
            *extra,
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert echo.stdout is not None
        ready, port = echo.stdout.readline().decode().split()  # "ready PORT", once it listens
        assert ready == "ready", ready
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(METHOD)
            await call(b"x")
            return await _measured(echo.pid, call, b"x", concurrency, seconds, dsn)
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
