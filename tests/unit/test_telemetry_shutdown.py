"""Telemetry.shutdown waits for the exporters' flush within its budget and no longer: with
the collector unreachable the SDK's own timeouts added up to 35 s, past the Pod's kill
timeout (a telemetry audit)."""

from __future__ import annotations

import threading

import pytest

from context_engine.telemetry import Telemetry


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
