"""Idempotency keys: a retried write returns its first result and writes nothing."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from ..core.errors import InvalidFieldError

__all__ = ["recall_response", "remember_response", "same_request"]


def same_request(stored: str, digest: str) -> bool:
    """Whether a stored request hash is `digest`'s request: its canonical hash, or (an
    api/request_hash.py RequestDigest) the hash of its bytes as sent, which a version
    before canonical ids stored (that module's Rule 3)."""
    return stored == digest or stored == getattr(digest, "as_sent", digest)


async def recall_response(
    conn: Any, tenant_id: str, session_id: UUID, key: str, operation: str, request_sha256: str
) -> dict[str, Any] | None:
    """The stored response for this key, or None. Call with the session locked to decide
    whether to write: a key found is committed, and final, so a hit needs no lock.

    Raises:
        InvalidFieldError: IDEMPOTENCY_KEY_REUSED when the key was used for another request.
    """
    if not key:
        return None
    row = await conn.fetchrow(
        "SELECT operation, request_sha256, response FROM idempotency_keys"
        " WHERE tenant_id = $1 AND session_id = $2 AND key = $3",
        tenant_id,
        session_id,
        key,
    )
    if row is None:
        return None
    if row["operation"] != operation or not same_request(row["request_sha256"], request_sha256):
        raise InvalidFieldError(
            "idempotency key was already used for a different request",
            field="idempotency_key",
            reason="IDEMPOTENCY_KEY_REUSED",
        )
    response: dict[str, Any] = row["response"]
    return response


async def remember_response(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    key: str,
    operation: str,
    request_sha256: str,
    response: dict[str, Any],
) -> None:
    if not key:
        return
    await conn.execute(
        "INSERT INTO idempotency_keys"
        " (tenant_id, session_id, key, operation, request_sha256, response)"
        " VALUES ($1, $2, $3, $4, $5, $6)",
        tenant_id,
        session_id,
        key,
        operation,
        request_sha256,
        response,
    )
