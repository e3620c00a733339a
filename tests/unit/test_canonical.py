"""The canonical fast path is byte-identical to the RFC 8785 reference implementation."""

from __future__ import annotations

from typing import Any

import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from context_engine.core.canonical import canonical_bytes, canonical_json_text

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
def test_composed_request_bytes_equal_the_full_serialization(data: st.DataObject) -> None:
    from context_engine.core.request import Block, CacheBreakpoint, Message, ModelRequest
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
        tools=(),
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
