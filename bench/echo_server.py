"""A grpc.aio echo server answering every call with a fixed payload: the transport
ceiling a Build of the same response size is compared against. Same event loop policy as
`context-engine serve` (uvloop when installed).

With `--dsn`, each call first makes `--round-trips` trivial PostgreSQL round trips, each
on a connection from the service's own pool (`store.connect_pool`, `store.db.acquire`):
the storage floor, what a Build's round trips would cost if assembling took no time at
all (bench.transport passes one: the record a Build makes; a Build that reads its run's
head too makes two)."""

from __future__ import annotations

import argparse
import asyncio

import grpc

METHOD = "/bench.Echo/Echo"


async def serve(port: int, size: int, dsn: str = "", round_trips: int = 0) -> None:
    payload = b"x" * size
    pool = None
    if dsn:
        from context_engine.store import connect_pool
        from context_engine.store.db import acquire

        pool = await connect_pool(dsn, min_size=2, max_size=10)  # `serve`'s defaults

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        for _ in range(round_trips if pool is not None else 0):
            async with acquire(pool) as conn:
                await conn.fetchval("SELECT $1::int", 1)
        return payload

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(echo)},  # raw bytes both ways
    )
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"ready {port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0, help="0: a free port, printed")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--dsn", default="")
    parser.add_argument("--round-trips", type=int, default=1)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, args.size, args.dsn, args.round_trips))


if __name__ == "__main__":
    main()
