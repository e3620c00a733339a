"""Telemetry.shutdown waits for the exporters' flush within its budget and no longer: with
the collector unreachable the SDK's own timeouts added up to 35 s, past the Pod's kill
timeout (a telemetry audit)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from context_engine.telemetry import Telemetry, otel_environment_problem


def test_a_flush_that_does_not_end_is_given_up_after_the_budget() -> None:
    release = threading.Event()
    flushed: list[str] = []
    stuck = Telemetry(on_shutdown=[lambda: release.wait(60)])
    assert stuck.shutdown(budget_s=0.05) is False  # gave up: the flush still waits
    release.set()
    quick = Telemetry(on_shutdown=[lambda: flushed.append("done")])
    assert quick.shutdown(budget_s=5.0) is True
    assert flushed == ["done"]


def test_a_sampling_ratio_that_is_not_one_is_refused_by_name() -> None:
    """OTEL_TRACES_SAMPLER_ARG of 1.5 or NaN failed with a traceback after the migrations,
    and a typo sampled every trace (a telemetry audit); serve turns this into its one-line
    start-up error."""
    for text in ("1.5", "nan", "-0.1", "half"):
        with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
            Telemetry.from_environment(
                environ={"OTEL_TRACES_SAMPLER_ARG": text, "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}
            )
    assert Telemetry.from_environment(environ={"OTEL_TRACES_SAMPLER_ARG": "0.25"}) is not None


def test_otel_traces_sampler_is_honoured_or_refused() -> None:
    """OTEL_TRACES_SAMPLER was ignored (always_off sampled every trace), and its argument
    was read as a ratio whatever the sampler (an audit)."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    from context_engine.telemetry import sampler_from

    def made(**env: str) -> Any:
        tel = Telemetry.from_environment(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "x", **env})
        try:
            return tel.tracer_provider.sampler
        finally:
            tel.shutdown(budget_s=0.1)

    assert made(OTEL_TRACES_SAMPLER="always_off") is ALWAYS_OFF
    assert made(OTEL_TRACES_SAMPLER="always_on") is ALWAYS_ON
    ratio = made(OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG="0.25")
    assert ratio.get_description() == "TraceIdRatioBased{0.25}"
    assert made().get_description().startswith("ParentBased{root:TraceIdRatioBased{1.0}")
    parent_off = made(OTEL_TRACES_SAMPLER="parentbased_always_off")
    assert parent_off.get_description().startswith("ParentBased{root:AlwaysOffSampler")
    # The argument is a ratio's only.
    assert sampler_from({"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "x"})
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER='jaeger_remote'"):
        sampler_from({"OTEL_TRACES_SAMPLER": "jaeger_remote"})


def test_metrics_listen_under_a_disabled_sdk_is_refused() -> None:
    """OTEL_SDK_DISABLED=true turns the SDK's meters into no-ops: /metrics answered with no
    series and the readiness alert had no data (an audit)."""
    disabled = {"OTEL_SDK_DISABLED": "true"}
    assert "OTEL_SDK_DISABLED" in str(otel_environment_problem(disabled, metrics_listen=":9464"))
    assert otel_environment_problem(disabled) is None
    assert otel_environment_problem({}, metrics_listen=":9464") is None


def test_the_standard_otel_variables_name_the_service_and_turn_exporters_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A service.name in OTEL_RESOURCE_ATTRIBUTES was overridden by the default, and
    OTEL_SDK_DISABLED and OTEL_*_EXPORTER=none were ignored: any endpoint turned both
    exporters on (an audit). (The SDK reads OTEL_RESOURCE_ATTRIBUTES from the process.)"""
    attributes_env = "service.name=ctx-eu,deployment.environment=prod"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", attributes_env)
    named = Telemetry.from_environment(environ={"OTEL_RESOURCE_ATTRIBUTES": attributes_env})
    attributes = named.tracer_provider.resource.attributes
    assert attributes["service.name"] == "ctx-eu"
    assert attributes["deployment.environment"] == "prod"
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    default = Telemetry.from_environment(environ={})
    assert default.tracer_provider.resource.attributes["service.name"] == "context-engine"
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    on = Telemetry.from_environment(environ=endpoint)
    assert on.traces
    on.shutdown(budget_s=1.0)
    for off in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}):
        quiet = Telemetry.from_environment(environ={**endpoint, **off})
        assert not quiet.traces
        quiet.shutdown(budget_s=1.0)


def test_an_otlp_protocol_matters_only_for_a_signal_that_is_exported() -> None:
    """http/protobuf is refused where OTLP would be sent with it, and nowhere else (a
    review: an SDK turned off, or a signal with no endpoint, was refused too)."""
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    http = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert otel_environment_problem({**endpoint, **http})
    assert otel_environment_problem(http) is None
    assert otel_environment_problem({**endpoint, **http, "OTEL_SDK_DISABLED": "true"}) is None
    both_off = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    assert otel_environment_problem({**endpoint, **http, **both_off}) is None
    # A signal's own variable decides before the general one.
    own = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_METRICS_EXPORTER": "none"}
    assert otel_environment_problem({**endpoint, **http, **own}) is None
