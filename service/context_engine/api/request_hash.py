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
"""

from __future__ import annotations

import hashlib
from typing import Any
from uuid import UUID

__all__ = ["request_sha256"]


def request_sha256(request: Any, ids: dict[str, UUID | None] | None = None) -> str:
    """sha256 hex of `request` with each of `ids` (dotted path -> parsed id) canonical."""
    respelled = {
        path: str(value)
        for path, value in (ids or {}).items()
        if value is not None and _get(request, path) != str(value)
    }
    if respelled:
        copy = type(request)()
        copy.CopyFrom(request)
        for path, value in respelled.items():
            *parents, name = path.split(".")
            message = copy
            for parent in parents:
                message = getattr(message, parent)
            setattr(message, name, value)
        request = copy
    return hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()


def _get(request: Any, path: str) -> Any:
    for name in path.split("."):
        request = getattr(request, name)
    return request
