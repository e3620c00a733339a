"""Child spans (telemetry.span) never carry an exception's message: the SDK's default
handling records the message and stack as a span event and the status description, and a
message can quote input (a validation error's input_value). docs/security.md, "What is
never logged"."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from context_engine import telemetry
from context_engine.telemetry import RpcState, Telemetry

CANARY = "CANARY-2b7d4e-input-value"


def test_a_child_span_records_an_exceptions_type_never_its_message() -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tel = Telemetry(provider)
    token = telemetry.begin(tel, RpcState("Build"))
    try:
        with (
            tel.tracer.start_as_current_span("rpc"),
            pytest.raises(ValueError),
            telemetry.span("store.read"),
        ):
            raise ValueError(f"bad checkpoint: input_value={CANARY}")
    finally:
        telemetry.end(token)
    (child,) = [s for s in spans.get_finished_spans() if s.name == "store.read"]
    assert child.status.status_code is StatusCode.ERROR
    assert child.status.description == "ValueError"
    shown = repr((child.status, child.events, dict(child.attributes or {})))
    assert CANARY not in shown
    assert not child.events
    assert trace.get_current_span() is trace.INVALID_SPAN
