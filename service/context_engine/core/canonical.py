"""Canonical bytes: RFC 8785 (JSON Canonicalization Scheme) and SHA-256 over them.

Everything hashed goes through `canonical_bytes`, so a worker in any language can
recompute a hash with an off-the-shelf JCS library, and one value hashes the same in every
process under every PYTHONHASHSEED (sets are sorted before they get here; JCS sorts keys).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any, TypeVar

import rfc8785

__all__ = [
    "MAX_SAFE_INTEGER",
    "as_parsed",
    "canonical_bytes",
    "canonical_json_text",
    "comma_separated",
    "parse_json_object",
    "sha256_hex",
]


def canonical_bytes(value: Any) -> bytes:
    """RFC 8785 bytes of a JSON-compatible value (dicts, lists, str, int, bool, None).

    Fast path: for values without floats whose keys are all ASCII, the standard library's
    compact, key-sorted, non-ASCII-preserving output is byte-identical to RFC 8785 (same
    string escapes, integers in decimal, UTF-16 and code-point key order agree on ASCII).
    Anything else — floats, non-ASCII keys, integers beyond 2**53 — takes the reference
    implementation. tests/unit/test_canonical.py checks the equivalence property.
    """
    if _fast_path_ok(value):
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    return rfc8785.dumps(value)


_MAX_SAFE_INT = 2**53 - 1


def _fast_path_ok(value: Any) -> bool:
    # Scalars are checked where they stand; only containers go on the stack.
    stack: list[Any] = [[value]]
    while stack:
        container: Any = stack.pop()
        if type(container) is dict:
            for key in container:
                if type(key) is not str or not key.isascii():
                    return False
            members = container.values()
        else:
            members = container
        for item in members:
            kind = type(item)
            if kind is str or kind is bool or item is None:
                continue
            if kind is int:
                if -_MAX_SAFE_INT <= item <= _MAX_SAFE_INT:
                    continue
                return False
            if kind is dict or kind is list or kind is tuple:
                stack.append(item)
                continue
            return False  # floats and anything unusual: the reference implementation decides
    return True


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


P = TypeVar("P", str, bytes)


def comma_separated(members: Sequence[P], comma: P) -> list[P]:
    """A JSON array's members as pieces with `comma` between them, to be joined once with
    whatever surrounds them (a request is composed from memoized members, tens of kB: each
    join on the way would copy them again)."""
    pieces = [comma] * (2 * len(members) - 1) if members else []
    pieces[::2] = members
    return pieces


def canonical_json_text(document: str) -> str:
    """Re-serialize a JSON document canonically; raises ValueError when it is not JSON."""
    return canonical_bytes(json.loads(document)).decode("utf-8")


MAX_JSON_DEPTH = 64  # deeper documents are refused before anything recurses over them

# The largest integer an IEEE double, and so canonical JSON (RFC 8785), carries exactly.
MAX_SAFE_INTEGER = 2**53 - 1
# RFC 8785 writes a number below 1e21 in magnitude without an exponent, so a double between
# MAX_SAFE_INTEGER and 1e21 comes out as an integer literal no parser reads back exactly.
_EXPONENT_FROM = 1e21


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"JSON has no {name}")  # json.loads accepts NaN and Infinity


def _exact_number(node: Any) -> bool:
    """A number canonical JSON writes and reads back as the same value."""
    if isinstance(node, bool) or not isinstance(node, int | float):
        return True
    if isinstance(node, int):
        return abs(node) <= MAX_SAFE_INTEGER
    return math.isfinite(node) and not MAX_SAFE_INTEGER < abs(node) < _EXPONENT_FROM


def parse_json_object(document: str) -> dict[str, Any]:
    """Parse a JSON object; raises ValueError when it is not one, nests too deeply, or holds
    what canonical JSON or PostgreSQL cannot carry: NaN, infinities (1e400 parses to one),
    numbers that do not read back exactly, lone surrogates, U+0000. Whatever passes here
    canonicalizes, reads back the same, and can be stored; no message names content."""
    value = json.loads(document, parse_constant=_refuse_constant)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, dict):
            if any("\x00" in key for key in node):
                raise ValueError("JSON strings hold no U+0000")
            node = list(node.values())
        if isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, str):
            if "\x00" in node:
                raise ValueError("JSON strings hold no U+0000")
        elif not _exact_number(node):
            raise ValueError(f"JSON numbers are within +/-{MAX_SAFE_INTEGER} (2^53 - 1)")
    try:
        canonical_bytes(value)  # infinities, lone surrogates: its own errors are ValueErrors
    except ValueError:
        raise ValueError("JSON holds a value canonical JSON (RFC 8785) cannot carry") from None
    return value


def as_parsed(value: Any) -> Any:
    """A JSON value read back from PostgreSQL's jsonb as parse_json_object gave it: jsonb
    keeps a number as an exact numeric, so a double of 1e21 or more (which
    parse_json_object accepts, and which no request may send as an integer) comes back as
    an integer past MAX_SAFE_INTEGER, which canonical JSON refuses; it is the double again
    here. A stored spec holding one ("maximum": 1e21, or .NET's largest double in a
    generated OpenAPI schema) made every rebuild of its plan fail INTERNAL (an audit)."""
    if type(value) is int and not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
        return float(value)
    if isinstance(value, dict):
        return {k: as_parsed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_parsed(v) for v in value]
    return value
