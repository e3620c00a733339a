"""The canonical fast path is byte-identical to the RFC 8785 reference implementation, and
every JSON document the API accepts canonicalizes and reads back as the same value."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from context_engine.core.canonical import (
    MAX_SAFE_INTEGER,
    canonical_bytes,
    canonical_json_text,
    parse_json_object,
)

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
    | st.text()  # includes control characters, quotes, backslashes, non-BMP, U+2028
)
_keys = st.text(alphabet=st.characters(max_codepoint=127), max_size=12)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_keys, inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(_values)
def test_fast_path_matches_the_reference(value: Any) -> None:
    assert canonical_bytes(value) == rfc8785.dumps(value)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=6),
        st.floats(allow_nan=False, allow_infinity=False) | st.integers() | st.text(),
        max_size=6,
    )
)
def test_floats_big_ints_and_non_ascii_keys_take_the_reference(value: dict[str, Any]) -> None:
    try:
        expected = rfc8785.dumps(value)
    except rfc8785.IntegerDomainError:
        return
    assert canonical_bytes(value) == expected


def test_known_vectors() -> None:
    assert (
        canonical_bytes({"b": 1, "a": [True, None, "é\n"]})
        == b'{"a":[true,null,"\xc3\xa9\\n"],"b":1}'
    )
    assert canonical_json_text('{"z": 1.0, "a": 1e21}') == '{"a":1e+21,"z":1}'


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_composed_request_bytes_and_hashes_equal_the_full_serialization(
    data: st.DataObject,
) -> None:
    from context_engine.core.request import (
        Block,
        CacheBreakpoint,
        Message,
        ModelRequest,
        ToolDefinition,
    )
    from context_engine.core.rows import Row
    from context_engine.core.trust import TrustLevel

    text = st.text(max_size=30)
    blocks = st.lists(
        st.builds(
            Block,
            row=st.sampled_from(list(Row)),
            trust=st.sampled_from(list(TrustLevel)),
            kind=st.sampled_from(["text", "tool_call", "tool_result", "reasoning"]),
            item_id=text,
            source_sequence=st.integers(0, 10**9),
            text=text,
            call_id=text,
            is_error=st.booleans(),
        ),
        max_size=4,
    )
    request = ModelRequest(
        provider=data.draw(st.sampled_from(["anthropic", "openai"])),
        model_id=data.draw(text),
        system=tuple(data.draw(blocks)),
        tools=tuple(
            ToolDefinition(name, data.draw(text), '{"type":"object"}')
            for name in data.draw(st.lists(text, max_size=2))
        ),
        messages=tuple(
            Message(data.draw(st.sampled_from(["user", "assistant"])), tuple(data.draw(blocks)))
            for _ in range(data.draw(st.integers(0, 3)))
        ),
        max_output_tokens=data.draw(st.integers(0, 10**6)),
        session_key=data.draw(text),
        cache_breakpoints=(CacheBreakpoint("after_system", data.draw(text), "5m", 0),),
    )
    assert request.canonical_bytes() == canonical_bytes(request.canonical())
    assert request.canonical_bytes() == rfc8785.dumps(request.canonical())
    assert (
        request.canonical_sha256() == hashlib.sha256(rfc8785.dumps(request.canonical())).hexdigest()
    )
    # request_sha256 (core/request.py Rule 1): the canonical request with each message, the
    # system blocks and the tools given by the SHA-256 of their own canonical bytes.
    canonical = request.canonical()

    def digest(value: Any) -> str:
        return hashlib.sha256(rfc8785.dumps(value)).hexdigest()

    hashed = {
        "cache_breakpoints": canonical["cache_breakpoints"],
        "max_output_tokens": canonical["max_output_tokens"],
        "messages_sha256": digest(canonical["messages"]),
        "model_id": canonical["model_id"],
        "provider": canonical["provider"],
        "session_key": canonical["session_key"],
        "system_sha256": digest(canonical["system"]),
        "tools_sha256": digest(canonical["tools"]),
    }
    assert request.hashed() == hashed
    assert request.request_sha256() == digest(hashed)
    # Every message counts, in its place: dropped or swapped, the hash differs.
    if request.messages:
        fewer = replace(request, messages=request.messages[1:])
        assert fewer.request_sha256() != request.request_sha256()
        swapped = replace(request, messages=request.messages[::-1])
        if swapped.messages != request.messages:
            assert swapped.request_sha256() != request.request_sha256()


@pytest.mark.parametrize(
    "document",
    [
        '{"a": NaN}',
        '{"a": [Infinity]}',
        '{"a": {"b": -Infinity}}',
        '{"a": 9007199254740992}',
        '{"a": -9007199254740992}',
        '{"": 1.2719778770148802e+16}',  # a double that canonicalizes to a 17-digit integer
        '{"a": 1e400}',  # parses to infinity
        '{"a": "\\ud800"}',  # a lone surrogate: no UTF-8 for it
        '{"\\udc00": 1}',
        '{"a": ["\\u0000"]}',  # PostgreSQL's jsonb stores no U+0000
        '{"\\u0000": 1}',
    ],
)
def test_values_canonical_json_or_postgresql_cannot_carry_are_refused(document: str) -> None:
    with pytest.raises(ValueError):
        parse_json_object(document)


@settings(max_examples=300)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=4),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
        max_leaves=8,
    )
)
def test_what_is_accepted_canonicalizes_and_reads_back(value: Any) -> None:
    document = json.dumps({"v": value})
    try:
        parsed = parse_json_object(document)
    except ValueError:
        return  # refused: nothing downstream ever sees it
    again = json.loads(canonical_bytes(parsed))
    assert canonical_bytes(again) == canonical_bytes(parsed)


def test_the_largest_exact_numbers_are_accepted() -> None:
    edge = f'{{"a": [{MAX_SAFE_INTEGER}, -{MAX_SAFE_INTEGER}, 1e21, -0.0]}}'
    assert (
        canonical_bytes(parse_json_object(edge))
        == b'{"a":[9007199254740991,-9007199254740991,1e+21,0]}'
    )
