"""api/wire.py composes the protobuf ModelRequest from cached bytes; it must be the message
convert.request_to_proto builds field by field, for every request assembly can produce."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.api import convert, wire
from context_engine.core import assemble
from context_engine.core.request import Block
from context_engine.core.rows import Row
from context_engine.core.trust import TrustLevel
from context_engine.providers import render

from .strategies import SCENARIO_SETTINGS, Scenario, scenarios


@SCENARIO_SETTINGS
@given(scenarios(), st.sampled_from(["anthropic", "openai", "unknown"]))
def test_composed_request_equals_the_field_by_field_message(sc: Scenario, provider: str) -> None:
    assembled = assemble(sc.inputs())
    assert assembled.request is not None
    request = replace(assembled.request, provider=provider)
    composed = wire.request_message(request)
    assert composed == convert.request_to_proto(request)
    assert composed.SerializeToString(deterministic=True) == convert.request_to_proto(
        request
    ).SerializeToString(deterministic=True)


def test_long_blocks_take_multi_byte_lengths() -> None:
    # Lengths over 127 and 16383 bytes need two- and three-byte varints.
    for size in (0, 127, 128, 16_383, 16_384, 300_000):
        block = Block(Row.CONVERSATION, TrustLevel.USER, "text", "u1", 3, text="x" * size)
        assert wire._block(block) == convert.block_to_proto(block).SerializeToString()
        assert wire._varint(size) == _reference_varint(size)


def _reference_varint(value: int) -> bytes:
    from google.protobuf.internal.encoder import _VarintBytes  # the library's own encoder

    return bytes(_VarintBytes(value))


@SCENARIO_SETTINGS
@given(scenarios())
def test_the_encoded_build_response_is_the_message_with_its_request(sc: Scenario) -> None:
    """Build answers with the head's bytes followed by the encoded budget, provider payload
    and request fields; parsed, that is the BuildResponse with those set field by field,
    and interceptors reading it see the same fields."""
    assembled = assemble(sc.inputs())
    assert assembled.request is not None
    payload = render(assembled.request).body
    head = pb.BuildResponse(request_sha256=assembled.request_sha256, epoch=3)
    head.pressure.fits = True
    encoded = wire.EncodedBuildResponse(
        head, wire.request_pieces(assembled.request), budget=assembled.budget, payload=payload
    )
    expected = pb.BuildResponse()
    expected.CopyFrom(head)
    expected.request.CopyFrom(convert.request_to_proto(assembled.request))
    expected.budget.extend(convert.budget_to_proto(assembled.budget))
    expected.provider_payload = payload
    assert pb.BuildResponse.FromString(encoded.SerializeToString()) == expected
    assert encoded.HasField("request") and encoded.HasField("pressure")
    assert encoded.request == expected.request
    assert list(encoded.budget) == list(expected.budget) and encoded.provider_payload == payload
    assert (encoded.epoch, encoded.request_sha256) == (3, assembled.request_sha256)
    empty = wire.EncodedBuildResponse(pb.BuildResponse(needs_compaction=True), None)
    assert not empty.HasField("request")
    assert pb.BuildResponse.FromString(empty.SerializeToString()) == pb.BuildResponse(
        needs_compaction=True
    )
