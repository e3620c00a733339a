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

from context_engine.store.db import _init_connection, decode_jsonb, encode_json, encode_jsonb

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
    text = encode_json(value)
    assert encode_jsonb(value) == b"\x01" + text.encode("utf-8")
    assert decode_jsonb(encode_jsonb(value)) == json.loads(text)


def test_jsonb_in_binary_form_refuses_and_keeps_what_the_text_form_did() -> None:
    """A lone surrogate cannot be sent in either form; a float that is not a number is
    written as PostgreSQL refuses it, as encode_json writes it; another binary version of
    jsonb than 1 is refused on reading."""
    for encode in (encode_json, encode_jsonb):
        with pytest.raises(PydanticSerializationError):
            encode({"x": "\ud800"})
    assert encode_jsonb({"x": math.nan}) == b'\x01{"x":NaN}'
    with pytest.raises(ValueError, match="version"):
        decode_jsonb(b"\x02{}")


async def test_the_pool_registers_jsonb_in_binary_form_and_json_in_text() -> None:
    """What each connection of the pool is set up with (store/db.py _init_connection):
    read from a stand-in that records the registrations, not from a database."""

    class Registrations:
        def __init__(self) -> None:
            self.codecs: dict[str, dict[str, object]] = {}

        async def set_type_codec(self, name: str, **options: object) -> None:
            self.codecs[name] = options

    conn = Registrations()
    await _init_connection(conn)  # type: ignore[arg-type]
    assert conn.codecs["jsonb"]["format"] == "binary"
    assert conn.codecs["jsonb"]["encoder"] is encode_jsonb
    assert conn.codecs["jsonb"]["decoder"] is decode_jsonb
    assert conn.codecs["json"].get("format", "text") == "text"
    assert conn.codecs["json"]["encoder"] is encode_json
