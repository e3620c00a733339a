"""A grpc.aio echo server answering every call with a fixed payload: the transport
ceiling a Build of the same response size is compared against. Same event loop policy as
`context-engine serve` (uvloop when installed)."""

from __future__ import annotations

import argparse
import asyncio

import grpc

METHOD = "/bench.Echo/Echo"


async def serve(port: int, size: int) -> None:
    payload = b"x" * size

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return payload

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(echo)},  # raw bytes both ways
    )
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, args.size))


if __name__ == "__main__":
    main()
