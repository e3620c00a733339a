"""Registers the servicer with request decoding the caller cannot turn into INTERNAL.

grpc's generated registration decodes requests before our code runs, and a request that
is not a valid message (truncated, invalid UTF-8 in a string field) surfaces as a bare
INTERNAL "Exception deserializing request!". That is the caller's mistake, so here a
failed decode becomes INVALID_ARGUMENT with ErrorInfo, like every other bad input.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.errors import InvalidFieldError
from .errors import status_for

__all__ = ["SERVICE_NAME", "add_servicer"]

SERVICE_NAME = "context_engine.v1.ContextEngine"


class _Undecodable:
    __slots__ = ("message_name",)

    def __init__(self, message_name: str) -> None:
        self.message_name = message_name


def _decoder(cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RecursionError):
            return _Undecodable(cls.DESCRIPTOR.name)

    return decode


def _guarded(method: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            code, status = status_for(
                InvalidFieldError(f"the request is not a valid {request.message_name} message")
            )
            await context.abort(
                code,
                status.message,
                trailing_metadata=(("grpc-status-details-bin", status.SerializeToString()),),
            )
        return await method(request, context)

    return handler


def add_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register every RPC of the ContextEngine service on `server`."""
    service = pb.DESCRIPTOR.services_by_name["ContextEngine"]
    handlers = {
        method.name: grpc.unary_unary_rpc_method_handler(
            _guarded(getattr(servicer, method.name)),
            request_deserializer=_decoder(getattr(pb, method.input_type.name)),
            response_serializer=lambda message: message.SerializeToString(),
        )
        for method in service.methods
    }
    generic = grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
