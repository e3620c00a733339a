"""Registers the servicer with request decoding the caller cannot turn into INTERNAL.

grpc's generated registration decodes requests before our code runs, and a request that
is not a valid message (truncated, invalid UTF-8 in a string field) surfaces as a bare
INTERNAL "Exception deserializing request!". That is the caller's mistake, so here a
failed decode becomes INVALID_ARGUMENT with ErrorInfo, like every other bad input. So does
a decoded request holding what nothing downstream can take (_unstorable), checked once
here for every RPC rather than field by field.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.canonical import MAX_SAFE_INTEGER
from ..core.errors import InvalidFieldError
from .errors import status_for

__all__ = ["SERVICE_NAME", "add_servicer"]

SERVICE_NAME = "context_engine.v1.ContextEngine"


class _Undecodable:
    """Stands in for a request that failed to decode. Interceptors that run before the
    handler see an empty message of the right type (every attribute read and write
    delegates to one: auth fills in an empty tenant_id), except that it measures the bytes
    received (ByteSize), so the size limit refuses an oversize one REQUEST_TOO_LARGE
    first, as it does a decodable one; the handler sees this class and answers
    INVALID_ARGUMENT."""

    __slots__ = ("_empty", "_size", "message_name")

    def __init__(self, cls: Any, size: int) -> None:
        object.__setattr__(self, "_empty", cls())
        object.__setattr__(self, "_size", size)
        object.__setattr__(self, "message_name", cls.DESCRIPTOR.name)

    def ByteSize(self) -> int:  # protobuf's name: what the size limit reads
        return int(self._size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._empty, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._empty, name, value)


def _decoder(cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RecursionError):
            return _Undecodable(cls, len(data))

    return decode


# Plans, checkpoints and requests are hashed as canonical JSON (RFC 8785), which carries
# no integer beyond MAX_SAFE_INTEGER exactly: an int64 past it could never be hashed.
_SAFE_INTEGER = MAX_SAFE_INTEGER


def _unstorable(message: Any, prefix: str = "") -> tuple[str, str] | None:
    """(path, why) of the first field the store or the hashes cannot take: a string
    holding U+0000, which PostgreSQL cannot store in text or jsonb, or an integer beyond
    what canonical JSON carries exactly. None when there is none."""
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        values = value if field.is_repeated else [value]
        for n, item in enumerate(values):
            where = f"{path}[{n}]" if field.is_repeated else path
            if isinstance(item, str):
                if "\x00" in item:
                    return where, "contains U+0000, which is not allowed"
            elif isinstance(item, int):
                if abs(item) > _SAFE_INTEGER:
                    return where, f"is beyond +/-{_SAFE_INTEGER} (2^53 - 1)"
            elif field.message_type is not None and not isinstance(item, bytes):
                found = _unstorable(item, where + ".")
                if found:
                    return found
    return None


def _guarded(method: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        problem: InvalidFieldError | None = None
        if isinstance(request, _Undecodable):
            problem = InvalidFieldError(
                f"the request is not a valid {request.message_name} message"
            )
        elif (found := _unstorable(request)) is not None:
            field, why = found
            problem = InvalidFieldError(f"{field} {why}", field=field)
        if problem is not None:
            code, status = status_for(problem)
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
