"""The one place core and store errors become gRPC statuses.

Each status carries google.rpc details: ErrorInfo (a stable reason, domain, metadata) and,
when one field is at fault, BadRequest naming it. Unexpected exceptions become INTERNAL
with no detail from the exception (it could carry content); they are logged instead.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from ..core.errors import (
    ConflictError,
    InvalidFieldError,
    NotFoundError,
    PreconditionError,
    RequestError,
)
from ..store.db import StoreUnavailableError

__all__ = ["DETAILS_KEY", "DOMAIN", "error_info", "grpc_errors", "status_for"]

DOMAIN = "context-engine"
DETAILS_KEY = "grpc-status-details-bin"  # the trailing metadata that carries the details
_log = logging.getLogger("context_engine.api")

# Table, not branches: the first matching class decides the code (subclasses first).
_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (ConflictError, grpc.StatusCode.ABORTED),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidFieldError, grpc.StatusCode.INVALID_ARGUMENT),
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (StoreUnavailableError, grpc.StatusCode.UNAVAILABLE),
)


# A refusal's message and metadata can quote what the caller sent (an id, a name). gRPC
# clients refuse trailing metadata past 16 KiB (a value) and may past 8 KiB (in all): a
# message quoting a 13,000-character browser profile id reached the client as a bare
# RESOURCE_EXHAUSTED, its details lost (the fuzz test). So the message, which the status
# carries three times (grpc-message, Status.message, the field violation), is bounded in
# UTF-8 bytes, as each metadata value is.
MAX_MESSAGE_BYTES = 2_048
MAX_METADATA_BYTES = 256


def _bounded(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes (on a character boundary), ending in "…"."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", "ignore") + "…"


def status_for(exc: Exception) -> tuple[grpc.StatusCode, status_pb2.Status]:
    code = next((c for cls, c in _CODES if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)
    details: list[Any] = []
    if isinstance(exc, RequestError):
        message = _bounded(exc.message, MAX_MESSAGE_BYTES)
        metadata = {k: _bounded(v, MAX_METADATA_BYTES) for k, v in exc.metadata.items()}
        details.append(
            error_details_pb2.ErrorInfo(reason=exc.reason, domain=DOMAIN, metadata=metadata)
        )
        if exc.field:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=exc.field, description=message
            )
            details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    elif isinstance(exc, StoreUnavailableError):
        message = "the database is unavailable; retry with backoff"
        details.append(error_details_pb2.ErrorInfo(reason="STORE_UNAVAILABLE", domain=DOMAIN))
    else:
        message = "internal error"
    packed = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    proto = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=packed)
    return code, proto


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def grpc_errors(method: F) -> F:
    """Decorate a servicer method: typed errors become statuses with details."""

    @wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except (RequestError, StoreUnavailableError) as exc:
            code, proto = status_for(exc)
        except Exception:
            _log.exception("unhandled error in %s", method.__name__)
            code, proto = status_for(RuntimeError())
        await context.abort(
            code,
            proto.message,
            trailing_metadata=((DETAILS_KEY, proto.SerializeToString()),),
        )

    return wrapper  # type: ignore[return-value]


def error_info(trailing_metadata: Any) -> tuple[str, dict[str, str]]:
    """ErrorInfo (reason, metadata) from a status's trailing metadata; ("", {}) without."""
    for key, value in trailing_metadata or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            for detail in status_pb2.Status.FromString(value).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason, dict(info.metadata)
    return "", {}
