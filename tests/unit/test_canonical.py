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
