"""api/interceptors.py Layered: the service's interceptors as one. Over a real grpc.aio
server, each layer wraps a method's handler once, on its first call, and every call then
runs every layer, outermost first; an unknown method stays UNIMPLEMENTED and is not kept;
each layer is still an interceptor on its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from context_engine.api.interceptors import Behavior, Layer, Layered, _wrap

_METHOD = "/test.Echo/Echo"


class Recording(Layer):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.wraps = name, log, 0

    def wrap(self, method: str, handler: grpc.RpcMethodHandler | None) -> Any:
        self.wraps += 1
        return _wrap(handler, self._unary)

    def _unary(self, behavior: Behavior) -> Behavior:
        async def recorded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.log.append(self.name)
            return await behavior(request, context)

        return recorded


async def _serve(interceptors: list[Any]) -> tuple[grpc.aio.Server, int]:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _calls(port: int, method: str, n: int) -> list[bytes]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call: Callable[..., Any] = channel.unary_unary(method)
        return [await call(f"m{k}".encode()) for k in range(n)]


async def test_layers_wrap_once_per_method_and_run_on_every_call_in_order() -> None:
    log: list[str] = []
    outer, inner = Recording("outer", log), Recording("inner", log)
    server, port = await _serve([Layered([outer, inner])])
    try:
        assert await _calls(port, _METHOD, 5) == [f"m{k}".encode() for k in range(5)]
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await _calls(port, "/test.Echo/Nothing", 1)
        with pytest.raises(grpc.aio.AioRpcError):
            await _calls(port, "/test.Echo/Nothing", 1)
    finally:
        await server.stop(0)
    assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (outer.wraps, inner.wraps) == (1, 1)  # the unknown method was never wrapped
    assert log == ["outer", "inner"] * 5


async def test_a_layer_alone_is_an_interceptor_that_wraps_every_call() -> None:
    log: list[str] = []
    alone = Recording("alone", log)
    server, port = await _serve([alone])
    try:
        await _calls(port, _METHOD, 3)
    finally:
        await server.stop(0)
    assert (alone.wraps, log) == (3, ["alone"] * 3)
