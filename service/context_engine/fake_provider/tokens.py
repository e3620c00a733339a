"""Deterministic token accounting used by the fake provider.

The fake does not tokenize like any real model. It only has to make cache hits behave
*relatively* like the real APIs, so the rule is simple and documented:

Rule 1. Every prompt unit (a tool definition, a system block, a message content block, an
        OpenAI input item) is serialized to canonical bytes: JSON with sorted keys, no
        whitespace, UTF-8, and every ``cache_control`` key removed at any depth (a cache
        marker is not prompt text; the Anthropic docs exclude it from the cached prefix).
Rule 2. A unit costs ``ceil(len(canonical_bytes) / 4)`` tokens.
Rule 3. Units never share a token: the token stream of a prompt is the concatenation of
        each unit's bytes cut into 4-byte chunks, so block boundaries are token boundaries.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "BYTES_PER_TOKEN",
    "canonical_bytes",
    "count_tokens",
    "strip_cache_control",
    "token_chunks",
]

BYTES_PER_TOKEN = 4


def strip_cache_control(value: Any) -> Any:
    """Return ``value`` with every ``cache_control`` key removed, recursively."""
    if isinstance(value, dict):
        return {k: strip_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [strip_cache_control(v) for v in value]
    return value


def canonical_bytes(value: Any) -> bytes:
    """Canonical bytes of one prompt unit (Rule 1)."""
    return json.dumps(
        strip_cache_control(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


def count_tokens(data: bytes | str) -> int:
    """Tokens of one unit's canonical bytes (Rule 2); a str is encoded as UTF-8 first."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return -(-len(data) // BYTES_PER_TOKEN)


def token_chunks(data: bytes) -> list[bytes]:
    """The unit's tokens as byte chunks (Rule 3)."""
    return [data[i : i + BYTES_PER_TOKEN] for i in range(0, len(data), BYTES_PER_TOKEN)]
