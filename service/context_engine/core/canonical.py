"""Canonical bytes: RFC 8785 (JSON Canonicalization Scheme) and SHA-256 over them.

Everything hashed goes through `canonical_bytes`, so a worker in any language can
recompute a hash with an off-the-shelf JCS library, and one value hashes the same in every
process under every PYTHONHASHSEED (sets are sorted before they get here; JCS sorts keys).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import rfc8785

__all__ = ["canonical_bytes", "canonical_json_text", "parse_json_object", "sha256_hex"]


def canonical_bytes(value: Any) -> bytes:
    """RFC 8785 bytes of a JSON-compatible value (dicts, lists, str, int, bool, None)."""
    return rfc8785.dumps(value)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json_text(document: str) -> str:
    """Re-serialize a JSON document canonically; raises ValueError when it is not JSON."""
    return canonical_bytes(json.loads(document)).decode("utf-8")


def parse_json_object(document: str) -> dict[str, Any]:
    """Parse a JSON object; raises ValueError when it is not one."""
    value = json.loads(document)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value
