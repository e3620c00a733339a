"""The hash an idempotent write keeps with its key, to tell a retry from a reused key.

Rule 1: the request's deterministic protobuf bytes, with every id the handler parsed as a
UUID in its canonical spelling (lower case, hyphenated). A retry that spells the same
session or run another way ("8F0C…", "{8f0c…}", "urn:uuid:8f0c…", all of which
`convert.parse_uuid` accepts) names the same thing, so it is the same request and replays
the first answer, where it was refused as IDEMPOTENCY_KEY_REUSED (an audit, for
ReportUsage; every idempotent write hashed the spelling). A request already in canonical
spelling hashes as it did before this rule, so keys stored then still match.
Rule 2: ids are named by their dotted path from the request ("child.parent_run_id"); an
unset one (a run id the server chose) is hashed as sent.
Rule 3 (a fleet mid-upgrade): a key stored by a version before Rule 1 holds the hash of
the bytes as sent, so the digest carries that too (`RequestDigest.as_sent`), and a stored
hash matching either is the same request (store/idempotency.py `same_request`): a
byte-identical retry of a request spelt otherwise than canonically still replays where
its first call was stored by an older replica (a review). What is stored is the canonical
hash. The other direction, a first call stored here and its retry on an older replica,
is refused there (IDEMPOTENCY_KEY_REUSED) for such a request; docs/operations.md says so.
"""

from __future__ import annotations

import hashlib
from typing import Any
from uuid import UUID

__all__ = ["RequestDigest", "request_sha256"]


class RequestDigest(str):
    """The canonical hash (the string itself: what is stored), with the hash of the bytes
    as sent (Rule 3). A str, so every layer that passes a request hash along passes this
    unchanged, and the store compares both (store/idempotency.py same_request)."""

    as_sent: str

    def __new__(cls, canonical: str, as_sent: str) -> RequestDigest:
        digest = super().__new__(cls, canonical)
        digest.as_sent = as_sent
        return digest


def request_sha256(request: Any, ids: dict[str, UUID | None] | None = None) -> RequestDigest:
    """sha256 hex of `request` with each of `ids` (dotted path -> parsed id) canonical."""
    as_sent = _sha256(request)
    respelled = {
        path: str(value)
        for path, value in (ids or {}).items()
        if value is not None and _get(request, path) != str(value)
    }
    if not respelled:
        return RequestDigest(as_sent, as_sent)
    copy = type(request)()
    copy.CopyFrom(request)
    for path, value in respelled.items():
        *parents, name = path.split(".")
        message = copy
        for parent in parents:
            message = getattr(message, parent)
        setattr(message, name, value)
    return RequestDigest(_sha256(copy), as_sent)


def _sha256(request: Any) -> str:
    return hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()


def _get(request: Any, path: str) -> Any:
    for name in path.split("."):
        request = getattr(request, name)
    return request
