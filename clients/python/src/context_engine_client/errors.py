"""Typed errors: every failed RPC becomes a `ContextEngineError` subclass chosen by status.

The server sends google.rpc details with each status: ErrorInfo (a stable `reason` such as
"ORPHANED_TOOL_ITEM", a domain, metadata such as the offending class) and, when one field
is at fault, BadRequest field violations ("items[1].tool_result.call_id"). They are decoded
here once, so a worker matches on `reason` and `field_violations`, never on message text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from ._gen.context_engine.v1 import context_engine_pb2 as pb

__all__ = [
    "Aborted",
    "ClientError",
    "ContextEngineError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "Internal",
    "InvalidArgument",
    "NeedsCompaction",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "ToolLoopLimit",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "from_rpc_error",
]

_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One google.rpc.BadRequest field violation: the field path and what is wrong."""

    field: str
    description: str


class ClientError(Exception):
    """Base of everything this package raises."""


class ContextEngineError(ClientError):
    """A failed RPC, with the decoded status details.

    Attributes:
        code: the gRPC status code.
        message: the status message (never contains request content).
        reason: ErrorInfo.reason (ErrorReason without the prefix), "" when absent.
        domain: ErrorInfo.domain.
        metadata: ErrorInfo.metadata, e.g. {"class": "agent_instructions"}.
        field_violations: BadRequest field violations, in order.
        idempotency_key: the key a keyed write was sent with ("" for other calls). The
            write may have landed with only its answer lost (UNAVAILABLE, DEADLINE_EXCEEDED),
            or been refused with nothing written (ABORTED SESSION_BUSY): resend it with this
            key (`idempotency_key=`) to get the first answer rather than a second write.
        pending_request: set on every error a tool loop raises from its step's
            AppendItems, whether it failed after the loop's own resends (Unavailable,
            DeadlineExceeded) or was never resent (Unauthenticated, Internal, Cancelled...):
            the request itself (its key and items, the model's turn and the tool results),
            to resend unchanged with `Run.resend_append` before the loop runs again; None
            otherwise. (Another exception out of the append, a task's CancelledError say,
            carries it as the same attribute.) Where it failed with
            CHECKPOINT_VERSION_CONFLICT after the loop's own resend at the version the
            error names (`metadata["latest_version"]`), set
            `expected_checkpoint_version` to the newest such version before resending.
        session_id: on an error from `open_session`, the session id its Plan was sent
            with ("" otherwise): a Plan that timed out may have landed, and
            `open_session(spec, session_id=error.session_id)` finds it where a new id
            would open a second session.
    """

    # Whether resending the same request (same key, same bytes) may succeed: per class
    # (Unavailable, DeadlineExceeded), and per error for Aborted (by its reason).
    retryable = False

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str = "",
        domain: str = "",
        metadata: Mapping[str, str] | None = None,
        field_violations: tuple[FieldViolation, ...] = (),
    ) -> None:
        super().__init__(f"{code.name}: {message}" + (f" [{reason}]" if reason else ""))
        self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata: dict[str, str] = dict(metadata or {})
        self.field_violations = field_violations
        self.idempotency_key = ""
        self.pending_request: Any = None
        self.session_id = ""

    @property
    def field(self) -> str | None:
        """The first offending field path, if the server named one."""
        return self.field_violations[0].field if self.field_violations else None

    def __reduce__(self) -> tuple[Any, ...]:
        # An exception pickles (and copies) as cls(*args), args being the one formatted
        # message here: rebuilt from code and message, then the rest as state. A pending
        # request goes as its bytes (the generated classes cannot be pickled by name).
        state = dict(self.__dict__)
        pending = state.get("pending_request")
        if isinstance(pending, pb.AppendItemsRequest):
            state["pending_request"] = _PendingBytes(pending.SerializeToString())
        return _rebuild, (type(self), self.code, self.message, self.reason), state

    def __setstate__(self, state: dict[str, Any] | None) -> None:
        state = dict(state or {})
        pending = state.get("pending_request")
        if isinstance(pending, _PendingBytes):
            state["pending_request"] = pb.AppendItemsRequest.FromString(pending)
        self.__dict__.update(state)


class _PendingBytes(bytes):
    """A pickled error's pending AppendItemsRequest, serialized."""


def _rebuild(
    cls: type[ContextEngineError], code: grpc.StatusCode, message: str, reason: str
) -> ContextEngineError:
    return cls(code, message, reason=reason)


class InvalidArgument(ContextEngineError):
    """The request is wrong; the same request fails again."""


class NotFound(ContextEngineError):
    """An unknown id, or one owned by another tenant (indistinguishable)."""


class FailedPrecondition(ContextEngineError):
    """The state forbids the call (a plan that cannot open, a run in the wrong state)."""


class Aborted(ContextEngineError):
    """A lost optimistic race (checkpoint version, epoch): re-read and retry.

    Except reason "SESSION_BUSY": another write held the session past the server's lock
    wait and nothing was written. That one is `.retryable`: resend the same request with
    backoff, under the idempotency_key it was sent with, without re-reading (an earlier
    attempt under that key may have landed; a re-read and a new key would write twice).
    """

    def __init__(self, code: grpc.StatusCode, message: str, **details: Any) -> None:
        super().__init__(code, message, **details)
        self.retryable = self.reason == "SESSION_BUSY"


class ResourceExhausted(ContextEngineError):
    """The request is larger than the server accepts (REQUEST_TOO_LARGE)."""


class Unauthenticated(ContextEngineError):
    """No valid credentials (bearer token or client certificate)."""


class PermissionDenied(ContextEngineError):
    """The identity may not act for the requested tenant."""


class Unavailable(ContextEngineError):
    """The server or its database is unreachable; retry with backoff.

    The channel has already retried the same request. A write may have landed before the
    answer was lost: retry it with the idempotency_key it was sent with (pass one to
    start_run / start_child_run / append / update_working_state to be able to), or a
    fresh key writes it twice.
    """

    retryable = True


class DeadlineExceeded(ContextEngineError):
    """The call's deadline passed before the server answered. As with Unavailable, a write
    retried by hand must reuse its idempotency_key."""

    retryable = True


class Unimplemented(ContextEngineError):
    """The server does not implement this RPC (an older server)."""


class Internal(ContextEngineError):
    """The server failed; the caller did nothing wrong."""


# Table, not branches: status code -> error class. Anything unlisted is a plain
# ContextEngineError.
_BY_CODE: dict[grpc.StatusCode, type[ContextEngineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.INTERNAL: Internal,
}


def _status(raw: Any) -> status_pb2.Status | None:
    """The details trailer's Status; None when absent or unreadable (the error is then
    typed by its code and message alone, never a protobuf DecodeError; likewise a detail
    that cannot be read is left out)."""
    if not isinstance(raw, bytes):
        return None
    try:
        return status_pb2.Status.FromString(raw)
    except DecodeError:
        return None


def from_rpc_error(error: grpc.RpcError) -> ContextEngineError:
    """Decode a grpc error (sync or aio) into the typed error for its status."""
    code: grpc.StatusCode = error.code()
    message: str = error.details() or ""
    trailing: Any = error.trailing_metadata() or ()
    raw = next((value for key, value in trailing if key == _DETAILS_KEY), None)
    reason, domain, metadata, violations = "", "", {}, []
    status = _status(raw)
    if status is not None:
        message = status.message or message
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            bad = error_details_pb2.BadRequest()
            try:
                if detail.Is(info.DESCRIPTOR) and detail.Unpack(info):
                    reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
                elif detail.Is(bad.DESCRIPTOR) and detail.Unpack(bad):
                    violations += [
                        FieldViolation(v.field, v.description) for v in bad.field_violations
                    ]
            except DecodeError:  # an unreadable detail is left out; the error stays typed
                continue
    cls = _BY_CODE.get(code, ContextEngineError)
    return cls(
        code,
        message,
        reason=reason,
        domain=domain,
        metadata=metadata,
        field_violations=tuple(violations),
    )


class NeedsCompaction(ClientError):
    """Build reported needs_compaction and the tool loop was given no summarizer."""

    def __init__(self, build: Any) -> None:
        super().__init__(
            "the run's body does not fit even after every cheaper yield: compact "
            "(Run.compact) and build again"
        )
        self.build = build


class ToolLoopLimit(ClientError):
    """The tool loop took max_steps model turns without a final answer."""

    def __init__(self, steps: int) -> None:
        super().__init__(f"no final answer after {steps} model turns")
        self.steps = steps
