"""OpenTelemetry for the service: spans, the tracked metrics, one JSON log line per RPC.

Rules:
1. Nothing recorded here carries message content. Spans, metrics and log lines carry ids,
   hashes, counts, codes and durations, and only the fields named in `RPC_FIELDS`; a log
   record's exception is reduced to its type and frames, because an exception's message
   may quote the input that caused it.
2. Each server owns one `Telemetry` (its providers and instruments). The RPC observer
   (api/interceptors.py) makes it current for the duration of a call, so `span()`,
   `annotate()` and the `record_*()` functions called from engine code reach the right
   one, and do nothing outside an RPC.
3. The instruments are one table, `METRICS`; docs/operations.md lists the same names.
4. A `record_*()` function called by a handler marks its kind as recorded for the call;
   the observer then skips deriving the same measurement from the response, so nothing
   is counted twice and every RPC with a response is counted at least once, except an
   idempotent replay: its handler calls `record_replay`, which marks the kind and counts
   nothing (the first call counted it; a replayed response repeats what it reported).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode

from . import __version__

__all__ = [
    "MALFORMED",
    "METRICS",
    "RPC_FIELDS",
    "JsonFormatter",
    "RpcState",
    "Telemetry",
    "annotate",
    "configure_logging",
    "record_budget_exceeded",
    "record_build",
    "record_compaction",
    "record_pool_wait",
    "record_pressure",
    "record_replay",
    "record_rotation",
    "record_run_started",
    "record_session_opened",
    "record_usage",
    "recorded",
    "safe_fields",
    "span",
    "traced",
]

P = ParamSpec("P")
R = TypeVar("R")

SCOPE = "context_engine"
# The most a shutdown waits for the exporters' flush (Telemetry.shutdown); each OTLP export
# is given as long, so one that can reach the collector is not cut short.
FLUSH_BUDGET_S = 5.0
# Estimator error below this (in ppm, negative = underestimate) counts as an underestimate
# beyond the safety margin: the spec's 5% margin.
UNDERESTIMATE_PPM = -50_000

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TENANT = re.compile(r"[A-Za-z0-9._:@/+=-]{1,200}")

# The only fields an RPC's log line and span may carry, each with the shape it must have.
# Values come from requests too, so a field of the wrong shape (a caller could put
# anything in `run_id`) is written as "<malformed>", never verbatim.
RPC_FIELDS: Mapping[str, Callable[[Any], bool]] = {
    "tenant_id": lambda v: isinstance(v, str) and _TENANT.fullmatch(v) is not None,
    # The authenticated identity's tenant (auth on): tenant_id is what the request claims.
    "caller_tenant": lambda v: isinstance(v, str) and _TENANT.fullmatch(v) is not None,
    "session_id": lambda v: isinstance(v, str) and _UUID.fullmatch(v) is not None,
    "run_id": lambda v: isinstance(v, str) and _UUID.fullmatch(v) is not None,
    "epoch": lambda v: isinstance(v, int),
    "prefix_sha256": lambda v: isinstance(v, str) and _HEX64.fullmatch(v) is not None,
    "request_sha256": lambda v: isinstance(v, str) and _HEX64.fullmatch(v) is not None,
    "request_sequence": lambda v: isinstance(v, int),
    "checkpoint_version": lambda v: isinstance(v, int),
}
MALFORMED = "<malformed>"


def safe_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Only RPC_FIELDS, each verbatim when well-formed and MALFORMED otherwise."""
    return {
        key: value if RPC_FIELDS[key](value) else MALFORMED
        for key, value in fields.items()
        if key in RPC_FIELDS
    }


_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_SIZE_BUCKETS = tuple(float(4**k * 256) for k in range(10))  # 256 B .. 64 MiB
_TOKEN_BUCKETS = tuple(float(1000 * 2**k) for k in range(11))  # 1k .. 1M tokens
_RATIO_BUCKETS = (0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
_ESTIMATOR_BUCKETS = (0.8, 0.9, 0.95, 0.98, 1.0, 1.02, 1.05, 1.1, 1.2, 1.5)
_WINDOW_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0)
# A free connection is handed over in microseconds; a wait of milliseconds means the pool
# is exhausted and calls queue behind each other.
_WAIT_BUCKETS = (0.0001, 0.001, 0.005, 0.025, 0.1, 0.5, 1, 2.5, 5)


@dataclass(frozen=True, slots=True)
class Metric:
    # "counter" | "histogram" | "gauge" | "observed" (a gauge read when a reader collects:
    # Telemetry.observe_pool)
    kind: str
    unit: str
    description: str
    buckets: tuple[float, ...] = ()


# name -> instrument. Prometheus names: dots become underscores, the unit is appended
# ("_seconds", "_bytes"; a ratio's unit "1" adds nothing) and counters end in "_total"
# (docs/operations.md).
METRICS: Mapping[str, Metric] = {
    "context_engine.rpc.duration": Metric(
        "histogram", "s", "Server time per RPC, by method and status code.", _DURATION_BUCKETS
    ),
    "context_engine.rpc.errors": Metric(
        "counter",
        "{rpc}",
        "RPCs answered other than OK, by method, status code and error reason.",
    ),
    "context_engine.rpc.request.size": Metric(
        "histogram", "By", "Serialized size of each request message, by method.", _SIZE_BUCKETS
    ),
    "context_engine.build.input_tokens": Metric(
        "histogram",
        "{token}",
        "Estimated input tokens of each built request (prefix exact, body and framing estimated).",
        _TOKEN_BUCKETS,
    ),
    "context_engine.build.window_used": Metric(
        "histogram",
        "1",
        "Each built request's estimated input tokens over its input budget (1: the limit).",
        _WINDOW_BUCKETS,
    ),
    "context_engine.build.cache_markers": Metric(
        "counter", "{marker}", "Cache markers placed on built requests, by marker name."
    ),
    "context_engine.sessions.opened": Metric(
        "counter", "{session}", "Sessions whose first plan (epoch 1) was created."
    ),
    "context_engine.epochs.rotated": Metric(
        "counter", "{epoch}", "Prefix epochs started after the first, by reason."
    ),
    "context_engine.runs.started": Metric("counter", "{run}", "Runs (turns) started."),
    "context_engine.prefix.cached_ratio": Metric(
        "histogram",
        "1",
        "Share of the prefix served from the provider cache, per reported request.",
        _RATIO_BUCKETS,
    ),
    "context_engine.input.reuse_ratio": Metric(
        "histogram",
        "1",
        "Cache-read input against the preceding request's full input, per reported request.",
        _RATIO_BUCKETS,
    ),
    "context_engine.estimator.ratio": Metric(
        "histogram",
        "1",
        "Estimated / actual input tokens per reported request (below 1: underestimate).",
        _ESTIMATOR_BUCKETS,
    ),
    "context_engine.estimator.signed_error": Metric(
        "gauge", "1", "Latest signed estimator error per model: (estimated - actual) / actual."
    ),
    "context_engine.estimator.underestimates": Metric(
        "counter", "{request}", "Reported requests underestimated by more than the 5% margin."
    ),
    "context_engine.compactions": Metric(
        "counter", "{compaction}", "Compactions committed, by resulting summary depth."
    ),
    "context_engine.budget.pressure": Metric(
        "counter", "{build}", "Builds on which a yield step ran, by whether the result fits."
    ),
    "context_engine.budget.yield_steps": Metric("counter", "{step}", "Yield steps taken, by step."),
    "context_engine.budget.exceeded": Metric(
        "counter", "{build}", "Builds refused because the never-yield set does not fit."
    ),
    "context_engine.build.kept_head_retries": Metric(
        "counter",
        "{build}",
        "Builds made again from a fresh head read after one made from a kept head, by why.",
    ),
    "context_engine.store.ready": Metric(
        "gauge", "1", "1 while PostgreSQL answers the readiness probe, else 0."
    ),
    "context_engine.store.pool.wait": Metric(
        "histogram", "s", "Time a call waited for a pooled PostgreSQL connection.", _WAIT_BUCKETS
    ),
    "context_engine.store.pool.connections": Metric(
        "observed", "{connection}", "The request pool's open connections, by state (idle, used)."
    ),
    "context_engine.store.pool.max": Metric(
        "observed", "{connection}", "The most connections the request pool may open."
    ),
}


# --- the per-RPC state the observer keeps --------------------------------------------


@dataclass(slots=True)
class RpcState:
    """What one RPC's log line and span will say; filled from request, engine, response."""

    method: str
    fields: dict[str, Any] = field(default_factory=dict)
    recorded: set[str] = field(default_factory=set)
    # The caller's W3C trace id when no server span carries one (tracing off): the log
    # line still joins the worker's trace.
    trace_id: str = ""


_current: ContextVar[tuple[Telemetry, RpcState] | None] = ContextVar(
    "context_engine_telemetry", default=None
)


def begin(telemetry: Telemetry, state: RpcState) -> Token[tuple[Telemetry, RpcState] | None]:
    """Make `telemetry` and `state` current for this RPC (the observer calls this)."""
    return _current.set((telemetry, state))


def end(token: Token[tuple[Telemetry, RpcState] | None]) -> None:
    _current.reset(token)


def otel_environment_problem(env: Mapping[str, str], *, metrics_listen: str = "") -> str | None:
    """Why the standard OTel variables ask for what this server does not do, or None: its
    exporters speak OTLP over gRPC only, so OTEL_EXPORTER_OTLP_PROTOCOL (or the traces' or
    metrics' own) naming another would send nothing where its endpoint listens (an audit:
    it was ignored without a word). And OTEL_SDK_DISABLED=true makes the SDK's meters
    no-ops, so `metrics_listen`'s endpoint would answer with no series (another audit).
    `serve` refuses either before the database is touched."""
    if metrics_listen and env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return (
            f"metrics_listen={metrics_listen!r} with OTEL_SDK_DISABLED=true: the SDK's meters"
            " are off, so /metrics would hold no series (unset one of them)"
        )
    general = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    for signal in ("TRACES", "METRICS"):
        if _exporter_off(env, signal) or not (
            env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or general
        ):
            continue  # nothing of this signal is exported: its protocol is moot (a review)
        for name in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = env.get(name, "").strip()
            if protocol:
                if protocol != "grpc":
                    return f"{name}={protocol!r}: this server exports OTLP over gRPC only ('grpc')"
                break  # the signal's own variable decides before the general one
    return None


def _endpoint(env: Mapping[str, str], signal: str) -> str:
    """Where `signal` ("TRACES", "METRICS") is exported over OTLP ("" for nowhere)."""
    if _exporter_off(env, signal):
        return ""
    return env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


def traces_exported(env: Mapping[str, str]) -> bool:
    """Whether spans leave the process: only then are the sampler variables read."""
    return bool(_endpoint(env, "TRACES"))


def _exporter_off(env: Mapping[str, str], signal: str) -> bool:
    """OTEL_SDK_DISABLED=true, or OTEL_<signal>_EXPORTER=none: no exporter for `signal`."""
    return (
        env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        or env.get(f"OTEL_{signal}_EXPORTER", "").strip().lower() == "none"
    )


def _names_service(env: Mapping[str, str]) -> bool:
    """Whether OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names the service."""
    if env.get("OTEL_SERVICE_NAME"):
        return True
    pairs = env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(pair.partition("=")[0].strip() == "service.name" for pair in pairs)


# OTEL_TRACES_SAMPLER's values this server honours (the SDK's own names) -> the sampler,
# given the ratio (OTEL_TRACES_SAMPLER_ARG, read only for the ratio samplers). Unset: the
# parent-based ratio, so a worker's sampled trace continues here. Any other value is
# refused at start: it was ignored without a word, always_off included (an audit).
_SAMPLERS: dict[str, Callable[[float], Sampler]] = {
    "parentbased_traceidratio": lambda r: ParentBased(TraceIdRatioBased(r)),
    "traceidratio": TraceIdRatioBased,
    "parentbased_always_on": lambda _: ParentBased(ALWAYS_ON),
    "always_on": lambda _: ALWAYS_ON,
    "parentbased_always_off": lambda _: ParentBased(ALWAYS_OFF),
    "always_off": lambda _: ALWAYS_OFF,
}


def sampler_from(env: Mapping[str, str]) -> Sampler:
    """The sampler OTEL_TRACES_SAMPLER (and its ARG) name.

    Raises:
        ValueError: a sampler this server does not honour, or a ratio sampler whose
            argument is not a ratio from 0 to 1.
    """
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_traceidratio"
    if name not in _SAMPLERS:
        raise ValueError(
            f"OTEL_TRACES_SAMPLER={name!r} is not one this server honours ({', '.join(_SAMPLERS)})"
        )
    ratio = sampling_ratio(env.get("OTEL_TRACES_SAMPLER_ARG") or "1.0") if "ratio" in name else 1.0
    return _SAMPLERS[name](ratio)


def sampling_ratio(text: str) -> float:
    """OTEL_TRACES_SAMPLER_ARG as a ratio of traces kept.

    Raises:
        ValueError: not a number from 0 to 1 (a typo sampled every trace, and 1.5 or NaN
            failed with a traceback after the migrations had run).
    """
    try:
        ratio = float(text)
    except ValueError:
        ratio = math.nan
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={text!r} is not a ratio from 0 to 1")
    return ratio


class span:
    """A child span of the current RPC's span; a no-op outside an RPC.

    Usable as `with` and as `async with` (so it can share a line with `async with
    acquire(...)`). Attribute values must be ids, counts or flags, never content (rule 1).
    """

    def __init__(self, name: str, **attributes: str | int | bool) -> None:
        self._name = name
        self._attributes = {f"context_engine.{k}": v for k, v in attributes.items()}
        self._cm: Any = None

    def __enter__(self) -> None:
        current = _current.get()
        # Under a span that is not recording (tracing off, or this trace not sampled) the
        # samplers Telemetry configures (ALWAYS_OFF, ParentBased) would not record a child
        # either; making one costs the SDK's id generation and context switching per call.
        if current is not None and trace.get_current_span().is_recording():
            # Not the SDK's own handling of an exception: it puts the exception's message
            # and stack on the span, and a message can quote input (a validation error's
            # input_value). __exit__ records the exception's type alone.
            self._cm = current[0].tracer.start_as_current_span(
                self._name,
                attributes=self._attributes,
                record_exception=False,
                set_status_on_exception=False,
            )
            self._cm.__enter__()

    def __exit__(self, kind: Any, value: Any, stack: Any) -> None:
        if self._cm is not None:
            if kind is not None:
                trace.get_current_span().set_status(Status(StatusCode.ERROR, kind.__name__))
            self._cm.__exit__(kind, value, stack)
            self._cm = None

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, kind: Any, value: Any, stack: Any) -> None:
        self.__exit__(kind, value, stack)


def traced(name: str, fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` run inside a child span `name`: `traced("assemble", assemble)(inputs)`."""

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with span(name):
            return fn(*args, **kwargs)

    return call


def annotate(**fields: Any) -> None:
    """Add fields from RPC_FIELDS to the current RPC's log line and span."""
    current = _current.get()
    if current is None:
        return
    state = current[1]
    for key, value in fields.items():
        if key not in RPC_FIELDS:
            raise ValueError(f"{key} is not an RPC field")
        if value not in (None, "", 0):
            state.fields[key] = value if isinstance(value, int) else str(value)


def recorded() -> frozenset[str]:
    """The kinds the current RPC's handler has recorded itself (rule 4)."""
    current = _current.get()
    return frozenset(current[1].recorded) if current is not None else frozenset()


def _record(kind: str, fn: Callable[[Telemetry], None]) -> None:
    current = _current.get()
    if current is None:
        return
    current[1].recorded.add(kind)
    fn(current[0])


# --- the functions handlers call -------------------------------------------------------


def record_session_opened(model_id: str) -> None:
    """A session's first plan was created."""
    _record("session", lambda t: t.add("context_engine.sessions.opened", 1, model=model_id))


def record_rotation(reason: str) -> None:
    """A new prefix epoch started (reason: the PlanReason's lower-case name)."""
    _record("rotation", lambda t: t.add("context_engine.epochs.rotated", 1, reason=reason))


def record_run_started() -> None:
    _record("run", lambda t: t.add("context_engine.runs.started", 1))


def record_replay(kind: str) -> None:
    """An idempotent replay of a call that counted `kind`: nothing to count again (rule 4)."""
    _record(kind, lambda t: None)


def record_kept_head_retry(why: str) -> None:
    """A Build made from a kept run head is made again from a fresh read: its record found
    the head `moved`, or what it built was `refused` (api/engine.py Engine.build)."""
    _record(
        "kept_head_retry",
        lambda t: t.add("context_engine.build.kept_head_retries", 1, why=why),
    )


def record_build(
    model_id: str, estimated_input_tokens: int, input_budget_tokens: int, markers: Sequence[str]
) -> None:
    """A request was built: its estimated input size, how much of its budget that is, and
    the cache markers it carries (a provider with fewer breakpoints drops history ones)."""

    def fn(t: Telemetry) -> None:
        t.record("context_engine.build.input_tokens", estimated_input_tokens, model=model_id)
        if input_budget_tokens > 0:
            used = estimated_input_tokens / input_budget_tokens
            t.record("context_engine.build.window_used", used, model=model_id)
        for marker in markers:
            t.add("context_engine.build.cache_markers", 1, marker=marker)

    _record("build", fn)


def record_pool_wait(seconds: float) -> None:
    """A call waited `seconds` for a pooled connection (store/db.py). Recorded to the
    telemetry of the pool's server whether or not an RPC is current: Build's shared round
    trips (store/batches.py) run in a context of their own, and they are most of a busy
    replica's connections (a review found none of them recorded)."""
    current = _current.get()
    telemetry = current[0] if current is not None else _pool_telemetry
    if telemetry is not None:
        telemetry.record("context_engine.store.pool.wait", seconds)


# The telemetry of the server whose pool is observed (Telemetry.observe_pool): what
# record_pool_wait reaches outside an RPC.
_pool_telemetry: Telemetry | None = None


def record_pressure(fits: bool, steps: Sequence[str]) -> None:
    """A yield ladder ran on a Build: whether the result fits, and the steps taken."""

    def fn(t: Telemetry) -> None:
        t.add("context_engine.budget.pressure", 1, fits=str(fits).lower())
        for step in steps:
            t.add("context_engine.budget.yield_steps", 1, step=step)

    _record("pressure", fn)


def record_budget_exceeded(class_name: str) -> None:
    """A Build was refused: the never-yield set does not fit; `class_name` is its largest
    class as BUDGET_EXCEEDED names it (metadata "class")."""
    _record(
        "exceeded",
        lambda t: t.add("context_engine.budget.exceeded", 1, **{"class": class_name or "body"}),
    )


def record_usage(
    model_id: str,
    signed_error_ppm: int,
    cached_prefix_ppm: int,
    *,
    first_of_epoch: bool = False,
    reuse_ppm: int | None = None,
    measures_estimate: bool = True,
) -> None:
    """A usage report: estimator error and prefix cache share of one request.

    The estimator's error only from a report that measures the estimate
    (`measures_estimate`: the request's first report, by the model it was estimated for).

    The cached prefix ratio is measured after the first request of an epoch (which writes
    the cache); pass first_of_epoch=True for that request and only the estimator is fed.
    History reuse (api/usage.py, Rule 6) is recorded when measured (not None), the first
    request of an epoch included: what a rotation costs the history cache shows there.
    """

    def fn(t: Telemetry) -> None:
        if measures_estimate:
            ratio = 1 + signed_error_ppm / 1_000_000
            t.record("context_engine.estimator.ratio", ratio, model=model_id)
            t.set_gauge(
                "context_engine.estimator.signed_error",
                signed_error_ppm / 1_000_000,
                model=model_id,
            )
            if signed_error_ppm < UNDERESTIMATE_PPM:
                t.add("context_engine.estimator.underestimates", 1, model=model_id)
        if not first_of_epoch:
            t.record(
                "context_engine.prefix.cached_ratio", cached_prefix_ppm / 1_000_000, model=model_id
            )
        if reuse_ppm is not None:
            t.record("context_engine.input.reuse_ratio", reuse_ppm / 1_000_000, model=model_id)

    _record("usage", fn)


def record_compaction(depth: int) -> None:
    """A compaction was committed; depth is the resulting summary's (1 or 2)."""
    _record("compaction", lambda t: t.add("context_engine.compactions", 1, depth=str(depth)))


# --- providers and instruments ---------------------------------------------------------


class Telemetry:
    """One server's tracer, meter and instruments, and what must be shut down with it."""

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        *,
        on_shutdown: Sequence[Callable[[], object]] = (),
        metrics_read: bool | None = None,
    ) -> None:
        self.tracer_provider = tracer_provider or TracerProvider(sampler=ALWAYS_OFF)
        self.meter_provider = meter_provider or MeterProvider()
        # Whether any reader collects the instruments (None: a provider given is assumed
        # read; without one, none is). Unread, a measurement goes nowhere, and recording it
        # is the SDK's work per call (about 3.6 us a histogram, three per Build), so the
        # instruments are skipped.
        self.metrics_read = meter_provider is not None if metrics_read is None else metrics_read
        self.tracer = self.tracer_provider.get_tracer(SCOPE, __version__)
        meter = self.meter_provider.get_meter(SCOPE, __version__)
        self._instruments: dict[str, Any] = {}
        for name, metric in METRICS.items():
            if metric.kind == "counter":
                inst: Any = meter.create_counter(name, metric.unit, metric.description)
            elif metric.kind == "gauge":
                inst = meter.create_gauge(name, metric.unit, metric.description)
            elif metric.kind == "observed":
                continue  # made with what it observes (observe_pool)
            else:
                inst = meter.create_histogram(
                    name,
                    metric.unit,
                    metric.description,
                    explicit_bucket_boundaries_advisory=metric.buckets,
                )
            self._instruments[name] = inst
        self._meter = meter
        self._pool: Any = None  # what the pool gauges read (observe_pool)
        self._on_shutdown = list(on_shutdown)
        # The Prometheus endpoint's bound port (0: none); useful when configured as port 0.
        self.metrics_port = 0

    @property
    def traces(self) -> bool:
        """Whether any span can be recorded. Without an exporter the sampler is ALWAYS_OFF,
        and the server leaves out the span interceptor: it would make an unrecorded span,
        with fresh ids and a context switch, on every call (about 15 % of a small call)."""
        return self.tracer_provider.sampler is not ALWAYS_OFF

    @classmethod
    def from_environment(
        cls, metrics_listen: str = "", environ: Mapping[str, str] | None = None
    ) -> Telemetry:
        """Production telemetry: OTLP when OTEL_EXPORTER_OTLP_*ENDPOINT is set, and a
        Prometheus endpoint on `metrics_listen` (HOST:PORT) when given."""
        env = os.environ if environ is None else environ
        # The default name only where the environment names none: given here, it overrode
        # a service.name in OTEL_RESOURCE_ATTRIBUTES (an audit).
        resource = Resource.create(
            {"service.version": __version__}
            | ({} if _names_service(env) else {"service.name": "context-engine"})
        )
        traces_endpoint = _endpoint(env, "TRACES")
        metrics_endpoint = _endpoint(env, "METRICS")
        # Sampling: the standard knobs (sampler_from); without an exporter nothing is
        # recorded at all, and the sampler variables are not read.
        sampler = sampler_from(env) if traces_endpoint else ALWAYS_OFF
        # shutdown_on_exit off on both: their exit hooks would run a second, unbudgeted
        # shutdown after a flush `shutdown` gave up on (5 s more, a review measured).
        tracer_provider = TracerProvider(
            shutdown_on_exit=False,
            resource=resource,
            sampler=sampler if traces_endpoint else ALWAYS_OFF,
        )
        readers: list[MetricReader] = []
        on_shutdown: list[Callable[[], object]] = []
        if traces_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            tracer_provider.add_span_processor(
                BatchSpanProcessor(
                    OTLPSpanExporter(endpoint=traces_endpoint, timeout=FLUSH_BUDGET_S)
                )
            )
        if metrics_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter,
            )
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers.append(
                PeriodicExportingMetricReader(
                    OTLPMetricExporter(endpoint=metrics_endpoint, timeout=FLUSH_BUDGET_S)
                )
            )
        metrics_port = 0
        if metrics_listen:
            import prometheus_client
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            registry = prometheus_client.CollectorRegistry()
            readers.append(PrometheusMetricReader(registry=registry))
            host, _, port = metrics_listen.rpartition(":")
            server, _thread = prometheus_client.start_http_server(
                int(port), addr=host.strip("[]"), registry=registry
            )
            metrics_port = server.server_port
            on_shutdown.append(server.shutdown)
            on_shutdown.append(server.server_close)
        meter_provider = MeterProvider(
            resource=resource, metric_readers=readers, shutdown_on_exit=False
        )
        telemetry = cls(
            tracer_provider, meter_provider, on_shutdown=on_shutdown, metrics_read=bool(readers)
        )
        telemetry.metrics_port = metrics_port
        return telemetry

    def add(self, name: str, amount: int, **attributes: str) -> None:
        if self.metrics_read:
            self._instruments[name].add(amount, attributes)

    def record(self, name: str, value: float, **attributes: str) -> None:
        if value >= 0 and self.metrics_read:  # histograms take non-negative values only
            self._instruments[name].record(value, attributes)

    def set_gauge(self, name: str, value: float, **attributes: str) -> None:
        if self.metrics_read:
            self._instruments[name].set(value, attributes)

    def observe_pool(self, pool: Any) -> None:
        """Report `pool`'s connections (an asyncpg.Pool) whenever a reader collects; a
        second call observes its pool instead. The callbacks run on the reader's thread
        and only read the pool's counts."""
        global _pool_telemetry
        first = self._pool is None
        self._pool = pool
        _pool_telemetry = self
        if not first or not self.metrics_read:
            return

        def connections(_options: CallbackOptions) -> list[Observation]:
            idle, size = self._pool.get_idle_size(), self._pool.get_size()
            return [
                Observation(idle, {"state": "idle"}),
                Observation(max(size - idle, 0), {"state": "used"}),
            ]

        def most(_options: CallbackOptions) -> list[Observation]:
            return [Observation(self._pool.get_max_size())]

        for name, callback in (
            ("context_engine.store.pool.connections", connections),
            ("context_engine.store.pool.max", most),
        ):
            metric = METRICS[name]
            self._meter.create_observable_gauge(name, [callback], metric.unit, metric.description)

    def shutdown(self, budget_s: float = FLUSH_BUDGET_S) -> bool:
        """Flush exporters and stop the Prometheus endpoint, for at most `budget_s`; False
        when the budget ran out first (what is left is dropped with the process).

        The SDK's own timeouts add up past any grace an orchestrator gives: with the
        collector unreachable, a full span queue took 35 s (a batch processor's 30 s join,
        each export's own 10 s deadline, then the metrics'), and the pod was killed
        mid-flush (a telemetry audit). So the flush runs on a daemon thread, waited for
        `budget_s` at most."""

        def flush() -> None:
            for fn in self._on_shutdown:
                fn()
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown()

        flushing = threading.Thread(target=flush, name="telemetry-flush", daemon=True)
        flushing.start()
        flushing.join(budget_s)
        return not flushing.is_alive()

    # The observer's side: one call at the end of each RPC.
    def finish_rpc(
        self,
        state: RpcState,
        *,
        code: str,
        duration_s: float,
        request_bytes: int,
        reason: str = "",
    ) -> None:
        """Record the RPC's duration and size, set its span's fields, write its log line."""
        if self.metrics_read:
            self.record("context_engine.rpc.duration", duration_s, **_rpc_attrs(state, code))
            if code != "OK":
                # `reason` is the service's own ErrorInfo reason (an ErrorReason name), or
                # none: a fixed set, as the method and code are.
                self.add("context_engine.rpc.errors", 1, **_rpc_attrs(state, code), reason=reason)
            self.record(
                "context_engine.rpc.request.size", request_bytes, **{"rpc.method": state.method}
            )
        current_span = trace.get_current_span()
        recording, logged = current_span.is_recording(), logs_rpcs()
        if not (recording or logged):
            return  # the fields go to a span and a log line, and neither is written
        fields = safe_fields(state.fields)
        if recording:
            for key, value in fields.items():
                current_span.set_attribute(f"context_engine.{key}", value)
            if reason:
                current_span.set_attribute("context_engine.error_reason", reason)
        if not logged:
            return
        line: dict[str, Any] = {
            "method": state.method,
            "code": code,
            "duration_ms": round(duration_s * 1000, 3),
            "request_bytes": request_bytes,
            **fields,
        }
        if reason:
            line["reason"] = reason
        context = current_span.get_span_context()
        if context.is_valid:
            line["trace_id"] = f"{context.trace_id:032x}"
        elif state.trace_id:
            line["trace_id"] = state.trace_id
        _rpc_log.info("rpc", extra={"fields": line})


def logs_rpcs() -> bool:
    """Whether a per-RPC log line will be written (INFO on `context_engine.rpc`)."""
    return _rpc_log.isEnabledFor(logging.INFO)


def propagated_trace_id(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The trace id of the caller's W3C `traceparent` metadata, or "" (none, or malformed).
    Read with the same propagator the span interceptor uses."""
    carrier = {key: value for key, value in metadata or () if key == "traceparent"}
    if not carrier:
        return ""
    context = trace.get_current_span(_W3C.extract(carrier)).get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""


_W3C = TraceContextTextMapPropagator()


def _rpc_attrs(state: RpcState, code: str) -> dict[str, str]:
    return {"rpc.method": state.method, "rpc.grpc.status_code": code}


# --- logging -------------------------------------------------------------------------

_rpc_log = logging.getLogger("context_engine.rpc")


class JsonFormatter(logging.Formatter):
    """One JSON object per line. An exception is reduced to its type and frames (rule 1)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info and record.exc_info[0] is not None:
            out["exc_type"] = record.exc_info[0].__name__
            out["exc_frames"] = [
                f"{frame.filename}:{frame.lineno} {frame.name}"
                for frame in traceback.extract_tb(record.exc_info[2])
            ]
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines; the same fields, the same exception reduction."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        text = f"{self.formatTime(record)} {record.levelname} {record.name} {record.getMessage()}"
        text += "".join(f" {k}={v}" for k, v in fields.items())
        if record.exc_info and record.exc_info[0] is not None:
            text += f" exc_type={record.exc_info[0].__name__}"
        return text


_FORMATTERS: Mapping[str, type[logging.Formatter]] = {
    "json": JsonFormatter,
    "text": TextFormatter,
}


def configure_logging(level: str, log_format: str) -> None:
    """Route every logger to stderr through the chosen formatter."""
    handler = logging.StreamHandler()
    handler.setFormatter(_FORMATTERS[log_format]())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
