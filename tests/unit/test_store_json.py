"""store/db.py encode_json writes json parameters (and, in binary form, encode_jsonb
jsonb ones): the same text as the standard library's compact encoder with
ensure_ascii=False (which it replaced for speed) for every value the store writes, and
floats that are not numbers still refused by PostgreSQL (written as NaN / Infinity, not
turned into null)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import PydanticSerializationError

from context_engine.store.db import decode_jsonb, encode_json, encode_jsonb

_STANDARD = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.text()  # control characters, quotes, backslashes, U+2028, non-BMP
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=40,
)


@settings(max_examples=500, deadline=None)
@given(_values)
def test_the_text_is_the_standard_encoders(value: object) -> None:
    try:
        expected = _STANDARD.encode(value)
    except UnicodeEncodeError:
        return  # a lone surrogate: neither is sent (asyncpg cannot encode it)
    assert encode_json(value) == expected
    assert json.loads(encode_json(value)) == json.loads(expected)


def test_a_float_that_is_not_a_number_is_written_as_postgresql_refuses_it() -> None:
    for value, text in ((math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")):
        assert encode_json({"x": value}) == '{"x":' + text + "}"


@settings(max_examples=300, deadline=None)
@given(_values)
def test_jsonb_is_sent_in_binary_form_with_the_same_text(value: object) -> None:
    """jsonb travels in PostgreSQL's binary form (store/db.py encode_jsonb): the version
    byte 1, then encode_json's text as UTF-8; decode_jsonb reads it back."""
    try:
        text = encode_json(value)
    except PydanticSerializationError:
        return  # a lone surrogate: refused by both forms alike
    assert encode_jsonb(value) == b"\x01" + text.encode("utf-8")
    assert decode_jsonb(encode_jsonb(value)) == json.loads(text)


def test_a_jsonb_value_of_another_binary_version_is_refused() -> None:
    with pytest.raises(ValueError, match="version"):
        decode_jsonb(b"\x02{}")
