"""The two error families of the core, translated to gRPC in exactly one place (api/errors).

Rule 1: `RequestError` means the caller is wrong; retrying the same request fails again.
Rule 2: `EngineError` means we failed; the caller did nothing wrong.
Every RequestError names a stable `reason` (the proto's ErrorReason without its prefix)
and, where one field is at fault, the field path as the caller spelled it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "BudgetExceededError",
    "ConflictError",
    "EngineError",
    "InvalidFieldError",
    "NotFoundError",
    "PreconditionError",
    "RequestError",
]


class RequestError(Exception):
    """The request is wrong. Maps to a 4xx-like gRPC status."""

    reason: str = "INVALID_FIELD"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if reason is not None:
            self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidFieldError(RequestError):
    """A field is missing or malformed (INVALID_ARGUMENT)."""


class NotFoundError(RequestError):
    """An unknown id, or one owned by another tenant (NOT_FOUND; indistinguishable)."""

    reason = "SESSION_NOT_FOUND"


class PreconditionError(RequestError):
    """The state forbids the call, e.g. a plan that cannot open (FAILED_PRECONDITION)."""


class BudgetExceededError(PreconditionError):
    """The never-yield set alone does not fit its class, or the body does not fit after
    every yield with nothing left to compact (FAILED_PRECONDITION)."""

    reason = "BUDGET_EXCEEDED"


class ConflictError(RequestError):
    """A lost optimistic race; re-read and retry (ABORTED)."""


class EngineError(Exception):
    """We failed. Never raised for something the caller did."""
