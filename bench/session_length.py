"""Cost independent of session length: Build latency for sessions of 50, 500 and 5,000
turns at the same context window (a 16,000-token policy cap with 4,096 tokens reserved for
output, which fifty turns already fill, so every request is about the same size), in one
run. Three cases, each printed with its own ratio 5,000 / 50 and its own PASS/FAIL:

- repeated step: the same BuildRequest of one run, again and again (the run's carried
  history is kept by the replica after its first Build: this is a run's later steps);
- new run: StartRun (not timed), then that run's first Build (timed), once per length per
  round, interleaved across lengths: the step every turn begins with, on a replica that
  has served the session before (it reads the log since the previous run);
- cold (`--cold-servers N`, default 9; 0 skips it): a freshly started server, warmed on an
  unrelated session, then the first Build of each session on it (the order rotated per
  server): a restarted replica or one the session has not reached yet. It reads the
  session's log newest first, only as far back as the window reaches (core/log_tail.py).

Every Build must return a request (one that needs compaction would measure nothing); each
length's request size and history cut are printed. Bar: <= 1.2 (a Build reads and
assembles what fits, never the whole log); the exit status is 0 only when every case
measured holds (the cold one included, unless `--cold-servers 0` skips it)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
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

BAR = 1.2
RESERVE_TOKENS = 4_096

# Per length: the latencies in ms, and the shape of the last request built.
Measured = tuple[dict[int, list[float]], dict[int, str]]


class NeedsCompaction(Exception):
    """A Build returned no request: the window is too small for the lengths."""


async def _timed_build(stub: Any, request: pb.BuildRequest) -> tuple[float, Any]:
    started = time.perf_counter()
    built = await stub.Build(request)
    elapsed = (time.perf_counter() - started) * 1000
    if built.needs_compaction:
        raise NeedsCompaction(request.session_id)
    return elapsed, built


def _shape(built: Any) -> str:
    return (
        f"request {built.request.ByteSize():,} bytes,"
        f" {built.pressure.history_items_dropped:,} carried items cut"
    )


def _case(name: str, samples: dict[int, list[float]], shapes: dict[int, str]) -> bool:
    medians = {n: statistics.median(s) for n, s in samples.items()}
    lengths = list(medians)
    print(f"  {name}")
    for n, ms in medians.items():
        print(f"    {n:5d} turns: {ms:7.2f} ms  n={len(samples[n])}  ({shapes[n]})")
    ratio = medians[lengths[-1]] / medians[lengths[0]]
    ok = ratio <= BAR
    print(
        f"    {lengths[-1]} / {lengths[0]} = {ratio:.2f}"
        f"  (bar <= {BAR}: {'PASS' if ok else 'FAIL'})"
    )
    return ok


async def _repeated(stub: Any, sessions: dict[int, tuple[str, str]], builds: int) -> Measured:
    """The same request of each length, interleaved one per length per round, so every
    length sees the same machine (a checkpoint or autovacuum after seeding would otherwise
    land on one)."""
    requests = {n: build_request(*ids) for n, ids in sessions.items()}
    shapes = {n: _shape((await _timed_build(stub, r))[1]) for n, r in requests.items()}
    samples: dict[int, list[float]] = {n: [] for n in requests}
    for _ in range(builds):
        for n, request in requests.items():
            samples[n].append((await _timed_build(stub, request))[0])
    return samples, shapes


async def _new_runs(stub: Any, sessions: dict[int, tuple[str, str]], builds: int) -> Measured:
    """Per round and length: StartRun outside the timer, then its first Build timed. Each
    new run replaces the session's run in `sessions`."""
    samples: dict[int, list[float]] = {n: [] for n in sessions}
    shapes: dict[int, str] = {}
    for turn in range(builds):
        for n, (session_id, _) in sessions.items():
            started = await stub.StartRun(
                pb.StartRunRequest(
                    tenant_id=TENANT,
                    session_id=session_id,
                    user_message=pb.UserMessage(text=f"And after {turn}?"),
                )
            )
            run_id = started.run.run_id
            elapsed, built = await _timed_build(stub, build_request(session_id, run_id))
            samples[n].append(elapsed)
            shapes[n] = _shape(built)
            sessions[n] = (session_id, run_id)
    return samples, shapes


async def _cold(
    dsn: str, sessions: dict[int, tuple[str, str]], servers: int, window: int
) -> Measured:
    """Per fresh server: warm the process on an unrelated one-turn session, then the first
    Build of each length's session on it, the order rotated from server to server."""
    samples: dict[int, list[float]] = {n: [] for n in sessions}
    shapes: dict[int, str] = {}
    order = list(sessions)
    for k in range(servers):
        async with (
            server_process(dsn) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            stub = stub_for(channel)
            warm = await seed_session(
                stub, 1, policy_cap_tokens=window, reserve_output_tokens=RESERVE_TOKENS
            )
            for _ in range(3):
                await stub.Build(build_request(*warm))
            for n in order[k % len(order) :] + order[: k % len(order)]:
                elapsed, built = await _timed_build(stub, build_request(*sessions[n]))
                samples[n].append(elapsed)
                shapes[n] = _shape(built)
    return samples, shapes


async def run(lengths: list[int], builds: int, window: int, cold_servers: int) -> bool:
    async with scratch_database() as dsn:
        async with (
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
            try:
                repeated = await _repeated(stub, sessions, builds)
                new_run = await _new_runs(stub, sessions, builds)
            except NeedsCompaction as exc:
                print(f"session {exc}: the request needs compaction; raise --window")
                return False
        cold = await _cold(dsn, sessions, cold_servers, window) if cold_servers else None
    print(f"session length: median Build latency, {builds} interleaved rounds")
    ok = _case("repeated step (the same Build of one run again):", *repeated)
    ok = _case("new run (StartRun untimed, then the run's first Build timed):", *new_run) and ok
    if cold is not None:
        ok = (
            _case(
                "cold (the first Build of each session on a freshly started server,"
                f" {cold_servers} of them):",
                *cold,
            )
            and ok
        )
    print(f"  every case holds: {'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="50,500,5000")
    parser.add_argument("--builds", type=int, default=30)
    parser.add_argument("--window", type=int, default=16_000, help="policy cap, tokens")
    parser.add_argument(
        "--cold-servers",
        type=int,
        # One first Build per length per server: nine samples, as the case is in the exit
        # status and a fresh process's first Build varies more than a warm one's.
        default=9,
        help="fresh servers for the cold case (one first Build per length each); 0 skips it",
    )
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    ok = asyncio.run(run(lengths, args.builds, args.window, args.cold_servers))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
