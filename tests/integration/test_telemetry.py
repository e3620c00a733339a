"""Telemetry through a real server: spans, the tracked metrics, JSON log lines, no content.

Spans and metrics go to in-memory exporters; OTLP goes to a collector started here on
loopback; the Prometheus endpoint is scraped over HTTP on loopback. A canary string is
sent in every content field and must appear in no log line, span and error message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from context_engine import telemetry
from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine.api.interceptors import RpcObserver
from context_engine.api.server import build_engine, build_server
from context_engine.api.usage import UsageOutcome
from context_engine.telemetry import JsonFormatter, RpcState, Telemetry

from .helpers import (
    TENANT,
    assistant,
    call,
    new_id,
    replica,
    result,
    spec,
    tool,
    user,
    wait_for,
)

pytestmark = pytest.mark.integration

CANARY = "CANARY-7f3e9a1c-do-not-log"
SERVICE = "/context_engine.v1.ContextEngine/"


class _Lines(logging.Handler):
    """Every log record of the process, formatted as the service formats them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def log_lines() -> Iterator[_Lines]:
    handler = _Lines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="module")
async def traced(pool: Any, log_lines: _Lines) -> AsyncIterator[dict[str, Any]]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    tel = Telemetry(tracer_provider, MeterProvider(metric_readers=[reader]))
    running = await build_server(build_engine(pool), "127.0.0.1:0", telemetry=tel)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield {
        "stub": pb_grpc.ContextEngineStub(channel),
        "spans": spans,
        "reader": reader,
        "logs": log_lines,
        "pool": pool,
    }
    await channel.close()
    await running.stop(0)
    tel.shutdown()


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Metric name -> its data points, from one collection."""
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def _total(points: dict[str, list[Any]], name: str, **attributes: Any) -> float:
    """Sum of counter values (or histogram counts) whose attributes include `attributes`."""
    total = 0.0
    for point in points.get(name, ()):
        if all(point.attributes.get(k) == v for k, v in attributes.items()):
            total += getattr(point, "value", None) or getattr(point, "count", 0)
    return total


def _now() -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(datetime(2026, 3, 1, 12, 0, tzinfo=UTC))
    return ts


async def _session_with_a_tool_loop(stub: Any, text: str) -> dict[str, Any]:
    """Plan, StartRun, AppendItems (assistant, call, result) and Build; `text` everywhere."""
    session_id = new_id()
    the_spec = spec()
    the_spec.agent.instructions = f"Help the user. {text}"
    the_spec.tools.append(tool("docs.search", description=f"Search the docs. {text}"))
    plan = await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=the_spec))
    run = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text=text)
        )
    )
    run_id = run.run.run_id
    await stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=1,
            items=[assistant(text), call("c1", args={"q": text}), result("c1", text)],
        )
    )
    built = await stub.Build(
        pb.BuildRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=run_id,
            now=_now(),
            step=pb.StepContext(recall=[pb.RecallLine(item_id="m1", text=text, source="memory")]),
        )
    )
    return {"session_id": session_id, "run_id": run_id, "plan": plan.plan, "build": built}


def _server_spans(spans: InMemorySpanExporter, method: str) -> list[ReadableSpan]:
    return [
        s
        for s in spans.get_finished_spans()
        if s.name == SERVICE + method and s.kind == SpanKind.SERVER
    ]


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait until `condition` holds. A refused call's status can reach the client before its
    server has written the call's log line and ended its span: grpc.aio's context.abort
    (api/errors.py) sends the status, then raises through the interceptors; a successful
    call's response leaves after both. So a test reading a refused call's line or span
    waits for it."""

    async def holds() -> bool:
        return condition()

    await wait_for(holds, timeout=10, what=what)


# --- spans -------------------------------------------------------------------------


async def test_a_span_per_rpc_with_child_spans(traced: dict[str, Any]) -> None:
    traced["spans"].clear()
    flow = await _session_with_a_tool_loop(traced["stub"], "hello")
    for method in ("Plan", "StartRun", "AppendItems", "Build"):
        assert len(_server_spans(traced["spans"], method)) == 1, method
    (build,) = _server_spans(traced["spans"], "Build")
    children = [
        s
        for s in traced["spans"].get_finished_spans()
        if s.parent is not None and s.parent.span_id == build.context.span_id
    ]
    names = {s.name for s in children}
    assert {"store.read", "assemble", "render", "store.write"} <= names
    assert "store.read_plan" not in names  # StartRun's admission kept the plan it read
    assert all(s.context.trace_id == build.context.trace_id for s in children)
    attributes = dict(build.attributes or {})
    assert attributes["context_engine.session_id"] == flow["session_id"]
    assert attributes["context_engine.run_id"] == flow["run_id"]
    assert attributes["context_engine.epoch"] == flow["plan"].epoch
    assert attributes["context_engine.prefix_sha256"] == flow["plan"].prefix_sha256
    assert attributes["rpc.grpc.status_code"] == 0


async def test_a_failed_rpc_span_carries_its_code_and_reason(traced: dict[str, Any]) -> None:
    traced["spans"].clear()
    with pytest.raises(grpc.aio.AioRpcError):
        await traced["stub"].GetPlan(pb.GetPlanRequest(tenant_id=TENANT, session_id=new_id()))
    await _until(lambda: bool(_server_spans(traced["spans"], "GetPlan")), "the GetPlan span")
    (span,) = _server_spans(traced["spans"], "GetPlan")
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert span.attributes["context_engine.error_reason"] == "SESSION_NOT_FOUND"
    assert not span.status.is_ok


# --- metrics -----------------------------------------------------------------------


async def test_rpc_and_session_metrics_are_recorded(traced: dict[str, Any]) -> None:
    stub, reader = traced["stub"], traced["reader"]
    before = _points(reader)
    flow = await _session_with_a_tool_loop(stub, "hello")
    await stub.Rotate(
        pb.RotateRequest(
            tenant_id=TENANT,
            session_id=flow["session_id"],
            from_epoch=1,
            reason=pb.PLAN_REASON_MODEL_CHANGED,
        )
    )
    after = _points(reader)

    def delta(name: str, **attributes: Any) -> float:
        return _total(after, name, **attributes) - _total(before, name, **attributes)

    assert delta("context_engine.sessions.opened", model="claude-sonnet-4-5") == 1
    assert delta("context_engine.runs.started") == 1
    assert delta("context_engine.epochs.rotated", reason="model_changed") == 1
    for method in ("Plan", "StartRun", "AppendItems", "Build", "Rotate"):
        labels = {"rpc.method": method, "rpc.grpc.status_code": "OK"}
        assert delta("context_engine.rpc.duration", **labels) == 1, method
        assert delta("context_engine.rpc.request.size", **{"rpc.method": method}) == 1
    if flow["build"].estimated_input_tokens:
        assert delta("context_engine.build.input_tokens") == 1


async def test_a_build_records_its_window_share_and_markers_and_the_pool_its_waits(
    traced: dict[str, Any], pool: Any
) -> None:
    """docs/operations.md: build.window_used is the estimate over the input budget,
    build.cache_markers counts each marker the request carries by name, store.pool.wait
    records the calls' waits for a connection, and the pool gauges read the pool."""
    stub, reader = traced["stub"], traced["reader"]
    before = _points(reader)
    flow = await _session_with_a_tool_loop(stub, "hello")
    built, flow_session, flow_run = flow["build"], flow["session_id"], flow["run_id"]
    after = _points(reader)

    def delta(name: str, **attributes: Any) -> float:
        return _total(after, name, **attributes) - _total(before, name, **attributes)

    def sum_delta(name: str) -> float:
        def total(points: dict[str, list[Any]]) -> float:
            return sum(p.sum for p in points.get(name, ()))

        return total(after) - total(before)

    assert built.input_budget_tokens > 0
    assert delta("context_engine.build.window_used", model="claude-sonnet-4-5") == 1
    assert sum_delta("context_engine.build.window_used") == pytest.approx(
        built.estimated_input_tokens / built.input_budget_tokens
    )
    names = [b.name for b in built.request.cache_breakpoints]
    assert "after_system" in names
    for name in set(names) | {"after_system", "after_tools", "carried_history", "run"}:
        assert delta("context_engine.build.cache_markers", marker=name) == names.count(name)
    # Plan, StartRun, AppendItems and Build each took a connection at least once.
    assert delta("context_engine.store.pool.wait") >= 4
    # A Build from a kept head takes its connection in the replica's shared round trip,
    # outside any RPC's context: recorded too (a review found none of those).
    before_builds = _points(reader)
    request = pb.BuildRequest(tenant_id=TENANT, session_id=flow_session, run_id=flow_run)
    for _ in range(3):
        await stub.Build(request)
    waits = _total(_points(reader), "context_engine.store.pool.wait") - _total(
        before_builds, "context_engine.store.pool.wait"
    )
    assert waits >= 3
    (most,) = after["context_engine.store.pool.max"]
    assert most.value == pool.get_max_size()
    states = {
        p.attributes["state"]: p.value for p in after["context_engine.store.pool.connections"]
    }
    assert set(states) == {"idle", "used"}
    assert 1 <= states["idle"] + states["used"] <= pool.get_max_size()


async def test_a_pool_wait_that_times_out_is_recorded(database_dsn: str) -> None:
    """store.pool.wait held only the waits that ended in a connection: with the pool run
    dry every wait timed out and none was recorded, so the p99 behind the pool alert read
    low when it mattered (an audit)."""
    from context_engine.store import connect_pool
    from context_engine.store.db import StoreUnavailableError, acquire

    reader = InMemoryMetricReader()
    tel = Telemetry(TracerProvider(), MeterProvider(metric_readers=[reader]))
    small = await connect_pool(database_dsn, min_size=1, max_size=1)
    tel.observe_pool(small)
    try:
        async with acquire(small):
            with pytest.raises(StoreUnavailableError):
                async with acquire(small, timeout=0.2):
                    pass
        (wait,) = _points(reader)["context_engine.store.pool.wait"]
        assert wait.count == 2  # the connection handed out, and the wait that timed out
        assert wait.sum >= 0.2
    finally:
        await small.close()
        tel.shutdown()


async def test_a_refused_rpc_is_counted_by_its_reason(traced: dict[str, Any]) -> None:
    """context_engine.rpc.errors counts every answer other than OK by method, code and the
    ErrorInfo reason it carries (an audit: the reason was in the log line only)."""
    stub, reader = traced["stub"], traced["reader"]
    before = _points(reader)
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.GetPlan(pb.GetPlanRequest(tenant_id=TENANT, session_id=str(uuid.uuid4())))
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.GetPlan(pb.GetPlanRequest(tenant_id=TENANT, session_id="not-a-uuid"))
    after = _points(reader)
    method = {"rpc.method": "GetPlan"}
    for code, reason in (("NOT_FOUND", "SESSION_NOT_FOUND"), ("INVALID_ARGUMENT", "INVALID_FIELD")):
        labels = {**method, "rpc.grpc.status_code": code, "reason": reason}
        counted = _total(after, "context_engine.rpc.errors", **labels)
        assert counted - _total(before, "context_engine.rpc.errors", **labels) == 1, code
    ok = {**method, "rpc.grpc.status_code": "OK"}
    assert _total(after, "context_engine.rpc.errors", **ok) == 0


async def test_a_build_made_again_from_a_fresh_head_is_counted(
    traced: dict[str, Any], pool: Any
) -> None:
    """docs/operations.md: context_engine.build.kept_head_retries counts a Build whose kept
    run head another replica had moved (why="moved"); a Build that confirms its kept head
    counts nothing."""
    stub, reader = traced["stub"], traced["reader"]
    other, channel, running = await replica(pool)
    try:
        session_id = new_id()
        await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec()))
        started = await stub.StartRun(
            pb.StartRunRequest(
                tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text="hi")
            )
        )
        build = pb.BuildRequest(
            tenant_id=TENANT, session_id=session_id, run_id=started.run.run_id, now=_now()
        )
        await stub.Build(build)
        before = _points(reader)
        await stub.Build(build)  # confirms the head it kept
        confirmed = _points(reader)
        await other.AppendItems(
            pb.AppendItemsRequest(
                tenant_id=TENANT,
                session_id=session_id,
                run_id=started.run.run_id,
                expected_checkpoint_version=started.checkpoint_version,
                items=[assistant("from the other replica")],
            )
        )
        await stub.Build(build)  # the kept head moved
        moved = _points(reader)
    finally:
        await channel.close()
        await running.stop(0)
    name = "context_engine.build.kept_head_retries"
    assert _total(confirmed, name) == _total(before, name)
    assert _total(moved, name, why="moved") - _total(confirmed, name, why="moved") == 1


async def test_a_retried_start_run_counts_its_run_and_rotation_once(
    traced: dict[str, Any],
) -> None:
    """A retry with the same idempotency key answers with the first response, rotated_plan
    included, byte for byte; it starts no run and rotates nothing, so it counts nothing:
    epochs are "explicit, logged, and counted", and a lost response must not inflate the
    epochs-per-session metric."""
    stub, reader = traced["stub"], traced["reader"]
    with_mail = spec()
    with_mail.tools.append(tool("mail.send", scopes=("mail.send",)))
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=with_mail))
    request = pb.StartRunRequest(
        tenant_id=TENANT,
        session_id=session_id,
        idempotency_key="retry-me",
        user_message=pb.UserMessage(text="hello"),
        admission=pb.RunAdmission(scopes=["calendar.read", "mail.send", "web.read"]),
    )
    before = _points(reader)
    first = await stub.StartRun(request)
    retried = await stub.StartRun(request)  # the first response was lost
    after = _points(reader)
    assert retried.SerializeToString() == first.SerializeToString()
    assert first.rotated_plan.reason == pb.PLAN_REASON_RUN_AUTHORITY_CHANGED

    def delta(name: str, **attributes: Any) -> float:
        return _total(after, name, **attributes) - _total(before, name, **attributes)

    assert delta("context_engine.runs.started") == 1
    assert delta("context_engine.epochs.rotated", reason="run_authority_changed") == 1
    labels = {"rpc.method": "StartRun", "rpc.grpc.status_code": "OK"}
    assert delta("context_engine.rpc.duration", **labels) == 2  # both calls were served


async def test_a_retried_rotation_counts_once(traced: dict[str, Any]) -> None:
    """A Rotate resent under its idempotency key answers with the first call's plan and
    rotates nothing: epochs per session must not count the lost answer's retry."""
    stub, reader = traced["stub"], traced["reader"]
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec()))
    request = pb.RotateRequest(
        tenant_id=TENANT,
        session_id=session_id,
        from_epoch=1,
        reason=pb.PLAN_REASON_OPERATOR_REVOCATION,
        idempotency_key="rotate-once",
    )
    before = _points(reader)
    first = await stub.Rotate(request)
    retried = await stub.Rotate(request)
    after = _points(reader)
    assert retried.SerializeToString() == first.SerializeToString()

    def delta(name: str, **attributes: Any) -> float:
        return _total(after, name, **attributes) - _total(before, name, **attributes)

    assert delta("context_engine.epochs.rotated", reason="operator_revocation") == 1
    labels = {"rpc.method": "Rotate", "rpc.grpc.status_code": "OK"}
    assert delta("context_engine.rpc.duration", **labels) == 2  # both calls were served


async def test_an_erasure_then_a_grant_counts_both_rotations(traced: dict[str, Any]) -> None:
    """An admission after an erasure with a grant rotates twice (core/epochs.py, Rule 2);
    the response shows the last, and both are counted."""
    stub, reader = traced["stub"], traced["reader"]
    person = f"ana-{new_id()}"
    with_mail = spec(
        snapshot=pb.MemorySnapshot(
            snapshot_id="s",
            items=[pb.MemoryItem(item_id="m1", text="Ana likes tea.", person_ids=[person])],
        )
    )
    with_mail.tools.append(tool("mail.send", scopes=("mail.send",)))
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=with_mail))
    await stub.EraseSubject(pb.EraseSubjectRequest(tenant_id=TENANT, person_id=person))
    before = _points(reader)
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT,
            session_id=session_id,
            user_message=pb.UserMessage(text="hello"),
            admission=pb.RunAdmission(scopes=["calendar.read", "mail.send", "web.read"]),
        )
    )
    after = _points(reader)
    assert started.rotated_plan.reason == pb.PLAN_REASON_RUN_AUTHORITY_CHANGED

    def delta(name: str, **attributes: Any) -> float:
        return _total(after, name, **attributes) - _total(before, name, **attributes)

    assert delta("context_engine.epochs.rotated", reason="snapshot_invalidated") == 1
    assert delta("context_engine.epochs.rotated", reason="run_authority_changed") == 1
    assert delta("context_engine.runs.started") == 1


async def test_a_rotation_of_every_lineage_counts_each_epoch(
    traced: dict[str, Any], pool: Any
) -> None:
    """A Rotate without spec after a grant starts one epoch, the current (granted) lineage's;
    the restricted run's lineage is continued at its next Build (store/plans.py). Every epoch
    is counted once, by the call that started it, as each is logged."""
    stub, reader = traced["stub"], traced["reader"]
    with_mail = spec()
    with_mail.tools.append(tool("mail.send", scopes=("mail.send",)))
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=with_mail))
    started = [
        await stub.StartRun(  # a restricted run, then a granted one
            pb.StartRunRequest(
                tenant_id=TENANT,
                session_id=session_id,
                user_message=pb.UserMessage(text="hello"),
                admission=pb.RunAdmission(scopes=scopes),
            )
        )
        for scopes in (["calendar.read", "web.read"], ["calendar.read", "mail.send", "web.read"])
    ]
    before = _points(reader)
    rotated = await stub.Rotate(
        pb.RotateRequest(
            tenant_id=TENANT,
            session_id=session_id,
            from_epoch=2,
            reason=pb.PLAN_REASON_AGENT_CHANGED,
        )
    )
    after_rotate = _points(reader)
    assert rotated.plan.epoch == 3
    for started_run in started * 2:  # the second round finds both lineages current
        await stub.Build(
            pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=started_run.run.run_id)
        )
    after = _points(reader)
    logged = await pool.fetchval(
        "SELECT count(*) FROM session_events WHERE type = 'context.epoch.rotated'"
        " AND session_id = $1 AND payload->>'reason' = 'agent_changed'",
        session_id,
    )
    assert logged == 2

    def delta(name: str, since: Any, until: Any, **attributes: Any) -> float:
        return _total(until, name, **attributes) - _total(since, name, **attributes)

    assert delta("context_engine.epochs.rotated", before, after_rotate) == 1
    assert delta("context_engine.epochs.rotated", after_rotate, after) == 1
    assert delta("context_engine.epochs.rotated", before, after, reason="agent_changed") == 2


async def _a_run(stub: Any) -> tuple[str, pb.BuildRequest]:
    """A new session with a run: (its id, the run's BuildRequest)."""
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec()))
    run = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text="hello")
        )
    )
    return session_id, pb.BuildRequest(
        tenant_id=TENANT, session_id=session_id, run_id=run.run.run_id, now=_now()
    )


async def test_a_retried_report_usage_records_its_usage_once(traced: dict[str, Any]) -> None:
    """A retry with the same idempotency key answers with the first response and records
    nothing (api/usage.py, Rule 3), so it must not feed the usage metrics again: a client
    retrying a lost response (UNAVAILABLE invites it) would otherwise skew the cached
    prefix ratio and the estimator error toward whatever it retried."""
    stub, reader = traced["stub"], traced["reader"]
    model = spec().model_id
    session_id, build = await _a_run(stub)
    await stub.Build(build)  # writes the epoch's cache: the next request is warm
    built = await stub.Build(build)
    report = pb.ReportUsageRequest(
        tenant_id=TENANT,
        session_id=session_id,
        request_sequence=built.request_sequence,
        model_id=model,
        idempotency_key="usage-1",
        input_tokens=built.estimated_input_tokens,  # twice the estimate: an underestimate
        cache_read_input_tokens=built.estimated_input_tokens,
        output_tokens=5,
    )
    before = _points(reader)
    first = await stub.ReportUsage(report)
    retried = await stub.ReportUsage(report)  # the first response was lost
    # The same request reported again under another key: learned from once, and its
    # estimate measured once (an audit: counted twice toward the underestimate alert).
    report.idempotency_key = "usage-2"
    await stub.ReportUsage(report)
    # A request whose first report was not learned from (nine times its estimate: no
    # drift explains it) is measured once too (a review).
    bogus = await stub.Build(build)
    for key in ("bogus-1", "bogus-2"):
        assert not (
            await stub.ReportUsage(
                pb.ReportUsageRequest(
                    tenant_id=TENANT,
                    session_id=session_id,
                    request_sequence=bogus.request_sequence,
                    model_id=model,
                    idempotency_key=key,
                    input_tokens=bogus.estimated_input_tokens * 9,
                    output_tokens=5,
                )
            )
        ).absorbed
    after = _points(reader)
    assert retried.SerializeToString() == first.SerializeToString()
    assert first.signed_error_ppm < telemetry.UNDERESTIMATE_PPM

    def delta(name: str, **attributes: Any) -> float:
        return _total(after, name, **attributes) - _total(before, name, **attributes)

    assert delta("context_engine.estimator.ratio", model=model) == 2
    assert delta("context_engine.prefix.cached_ratio", model=model) == 4
    assert delta("context_engine.estimator.underestimates", model=model) == 2
    labels = {"rpc.method": "ReportUsage", "rpc.grpc.status_code": "OK"}
    assert delta("context_engine.rpc.duration", **labels) == 5  # every call was served


async def test_a_reported_model_the_registry_lacks_is_one_label(traced: dict[str, Any]) -> None:
    """ReportUsage's model_id is the caller's string: a worker passing on a router's or a
    fine-tune's name, or any string, made a new series on four usage instruments per name,
    kept for the process's life. A model the registry lacks is labelled `unregistered`.
    Another model's answer measures nothing of the estimate made for the planned one: the
    estimator's metrics leave it out (an audit: recorded under the answering model's label
    against another model's estimate)."""
    stub, reader = traced["stub"], traced["reader"]
    session_id, build = await _a_run(stub)
    before = _points(reader)
    for n, model in enumerate(("router/some-model-a", "ft:some-model-b")):
        built = await stub.Build(build)
        report = pb.ReportUsageRequest(
            tenant_id=TENANT,
            session_id=session_id,
            request_sequence=built.request_sequence,
            model_id=model,
            idempotency_key=f"usage-{n}",
            input_tokens=built.estimated_input_tokens,
            output_tokens=5,
        )
        await stub.ReportUsage(report)
    after = _points(reader)
    cached, ratio = "context_engine.prefix.cached_ratio", "context_engine.estimator.ratio"
    # The first request of the epoch wrote the cache: its share is not measured (Rule 5).
    for name, added in ((cached, 1), (ratio, 0)):
        unregistered = _total(after, name, model="unregistered")
        assert unregistered - _total(before, name, model="unregistered") == added
        for model in ("router/some-model-a", "ft:some-model-b"):
            assert _total(after, name, model=model) == 0


async def test_a_retried_commit_compaction_counts_one_compaction_at_its_committed_depth(
    traced: dict[str, Any],
) -> None:
    """A retry with the same idempotency key answers with the first response and commits
    nothing, so the compactions metric (compactions per thousand turns, share reaching
    depth 2) must not move again. The depth counted is the committed summary's: the
    request's result.depth may be left 0 (core/compaction.py accepts it)."""
    stub, reader = traced["stub"], traced["reader"]
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec()))
    for text, call_id in (("Find a hotel in Lyon", "c1"), ("Check the calendar", "c2")):
        run = await stub.StartRun(
            pb.StartRunRequest(
                tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text=text)
            )
        )
        run_id = run.run.run_id
        await stub.AppendItems(
            pb.AppendItemsRequest(
                tenant_id=TENANT,
                session_id=session_id,
                run_id=run_id,
                expected_checkpoint_version=1,
                items=[call(call_id), result(call_id, "a page"), assistant("Found one.")],
            )
        )
    prepared = await stub.PrepareCompaction(
        pb.PrepareCompactionRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id)
    )
    assert prepared.depth == 1
    commit = pb.CommitCompactionRequest(
        tenant_id=TENANT,
        session_id=session_id,
        run_id=run_id,
        expected_checkpoint_version=prepared.checkpoint_version,
        idempotency_key="compact-1",
        result=pb.CompactionResult(
            summary="The user wants a hotel in Lyon; the agent fetched a page (elided).",
            source_event_ids=list(prepared.source_event_ids),
            elided=list(prepared.elided),
            replaced_through_sequence=prepared.replaced_through_sequence,
            tokens_before=prepared.tokens_before,
            tokens_after=20,
            compactor_version="worker-compactor@1",
            prompt_version=prepared.prompt_version,
        ),  # depth left 0
    )
    before = _points(reader)
    first = await stub.CommitCompaction(commit)
    retried = await stub.CommitCompaction(commit)  # the first response was lost
    after = _points(reader)
    assert retried.SerializeToString() == first.SerializeToString()

    def delta(name: str, **attributes: Any) -> float:
        return _total(after, name, **attributes) - _total(before, name, **attributes)

    assert delta("context_engine.compactions") == 1
    assert delta("context_engine.compactions", depth="1") == 1


def _memory_spec(person: str) -> pb.PlanSpec:
    return spec(
        snapshot=pb.MemorySnapshot(
            snapshot_id="snap-1",
            recall_trace_id="trace-1",
            watermark=7,
            items=[
                pb.MemoryItem(item_id="m1", text="Ana is allergic to nuts.", person_ids=[person]),
                pb.MemoryItem(item_id="m2", text="The office is in Lyon.", source="belief"),
            ],
        )
    )


async def test_a_rotation_a_build_or_plan_makes_after_an_erasure_is_counted(
    traced: dict[str, Any], pool: Any
) -> None:
    """Spec, Prefix epochs: epochs are "explicit, logged, and counted"; epochs per session
    is a tracked metric (target 1.0). After an erasure the next Build or Plan starts a
    snapshot_invalidated epoch and logs context.epoch.rotated; neither response can say it
    rotated (Plan answers created=false), so each call counts its own rotation, once."""
    stub, reader = traced["stub"], traced["reader"]
    person = f"ana-{new_id()}"
    built_session, planned_session = new_id(), new_id()
    for session_id in (built_session, planned_session):
        await stub.Plan(
            pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=_memory_spec(person))
        )
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT, session_id=built_session, user_message=pb.UserMessage(text="hi")
        )
    )
    await stub.EraseSubject(pb.EraseSubjectRequest(tenant_id=TENANT, person_id=person))
    before = _points(reader)

    build = pb.BuildRequest(tenant_id=TENANT, session_id=built_session, run_id=started.run.run_id)
    assert (await stub.Build(build)).epoch == 2  # the Build rotated first
    replan = pb.PlanRequest(tenant_id=TENANT, session_id=planned_session, spec=spec())
    replanned = await stub.Plan(replan)
    assert (replanned.plan.epoch, replanned.created) == (2, False)
    assert replanned.plan.reason == pb.PLAN_REASON_SNAPSHOT_INVALIDATED
    # Neither call rotates again: the new plans are not invalidated.
    assert (await stub.Build(build)).epoch == 2
    assert (await stub.Plan(replan)).plan.epoch == 2
    after = _points(reader)
    rotated = await pool.fetchval(
        "SELECT count(*) FROM session_events WHERE type = 'context.epoch.rotated'"
        " AND session_id = ANY($1::uuid[])",
        [built_session, planned_session],
    )
    assert rotated == 2  # both rotations are in the log

    def delta(name: str, **attributes: Any) -> float:
        return _total(after, name, **attributes) - _total(before, name, **attributes)

    assert delta("context_engine.epochs.rotated", reason="snapshot_invalidated") == 2
    assert delta("context_engine.epochs.rotated") == 2
    assert delta("context_engine.sessions.opened") == 0


async def test_a_build_that_rotates_and_then_fails_still_counts_its_rotation(
    traced: dict[str, Any],
) -> None:
    """A Build commits its snapshot_invalidated rotation in a transaction of its own, which
    stands if the Build then fails (docs/api.md); the next Build does not rotate again, so
    the failed Build is the only call that can count that epoch."""
    stub, reader = traced["stub"], traced["reader"]
    person = f"ana-{new_id()}"
    session_id = new_id()
    await stub.Plan(
        pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=_memory_spec(person))
    )
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text="hi")
        )
    )
    await stub.EraseSubject(pb.EraseSubjectRequest(tenant_id=TENANT, person_id=person))
    before = _points(reader)
    stale = pb.BuildRequest(
        tenant_id=TENANT,
        session_id=session_id,
        run_id=started.run.run_id,
        # A recall made before the erasure: the Build is refused after it rotated.
        step=pb.StepContext(
            recall=[pb.RecallLine(item_id="r1", text="Ana is allergic.", person_ids=[person])]
        ),
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Build(stale)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    fresh = pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=started.run.run_id)
    assert (await stub.Build(fresh)).epoch == 2  # rotated by the refused Build
    after = _points(reader)

    def delta(name: str, **attributes: Any) -> float:
        return _total(after, name, **attributes) - _total(before, name, **attributes)

    assert delta("context_engine.epochs.rotated", reason="snapshot_invalidated") == 1
    assert delta("context_engine.epochs.rotated") == 1


def _budget_exceeded_status() -> bytes:
    info = any_pb2.Any()
    info.Pack(
        error_details_pb2.ErrorInfo(
            reason="BUDGET_EXCEEDED", domain="context-engine", metadata={"class": "constraints"}
        )
    )
    return status_pb2.Status(
        code=code_pb2.FAILED_PRECONDITION, message="over", details=[info]
    ).SerializeToString()


class _CannedEngine:
    """Responses a finished engine returns, so the observer's derivations are tested
    independently of how far the budget, usage and compaction work has come."""

    async def Build(self, request: pb.BuildRequest, context: Any) -> pb.BuildResponse:
        if request.run_id == "overflow":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "over",
                trailing_metadata=(("grpc-status-details-bin", _budget_exceeded_status()),),
            )
        return pb.BuildResponse(
            request=pb.ModelRequest(model_id="m-1"),
            epoch=1,
            estimated_input_tokens=12_000,
            pressure=pb.PressureReport(
                fits=False,
                steps=[pb.YieldStep(step="drop_knowledge"), pb.YieldStep(step="compact")],
            ),
            needs_compaction=True,
        )

    async def ReportUsage(self, request: Any, context: Any) -> Any:
        if request.idempotency_key == "handler-records":
            telemetry.record_usage(request.model_id, 10_000, 0, first_of_epoch=True)
        return pb.ReportUsageResponse(signed_error_ppm=-80_000, cached_prefix_ppm=950_000)

    async def CommitCompaction(self, request: Any, context: Any) -> Any:
        return pb.CommitCompactionResponse(checkpoint_version=3)


@pytest.fixture(scope="module")
async def canned() -> AsyncIterator[dict[str, Any]]:
    reader = InMemoryMetricReader()
    tel = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    server = grpc.aio.server(interceptors=[RpcObserver(tel)])
    engine = _CannedEngine()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(engine, name),
            request_deserializer=getattr(pb, f"{req}Request").FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )
        for name, req in (
            ("Build", "Build"),
            ("ReportUsage", "ReportUsage"),
            ("CommitCompaction", "CommitCompaction"),
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("context_engine.v1.ContextEngine", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield {"stub": pb_grpc.ContextEngineStub(channel), "reader": reader}
    await channel.close()
    await server.stop(0)


async def test_budget_usage_and_compaction_metrics_follow_responses(
    canned: dict[str, Any],
) -> None:
    stub, reader = canned["stub"], canned["reader"]
    await stub.Build(pb.BuildRequest(run_id="r"))
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Build(pb.BuildRequest(run_id="overflow"))
    await stub.ReportUsage(pb.ReportUsageRequest(model_id="m-1"))
    await stub.CommitCompaction(pb.CommitCompactionRequest(result=pb.CompactionResult(depth=2)))
    points = _points(reader)
    assert _total(points, "context_engine.budget.pressure", fits="false") == 1
    assert _total(points, "context_engine.budget.yield_steps", step="drop_knowledge") == 1
    assert _total(points, "context_engine.budget.yield_steps", step="compact") == 1
    assert _total(points, "context_engine.budget.exceeded", **{"class": "constraints"}) == 1
    assert _total(points, "context_engine.build.input_tokens", model="m-1") == 1
    assert _total(points, "context_engine.compactions", depth="2") == 1
    assert _total(points, "context_engine.estimator.underestimates", model="m-1") == 1
    (ratio,) = points["context_engine.prefix.cached_ratio"]
    assert (ratio.count, ratio.sum) == (1, pytest.approx(0.95))
    (accuracy,) = points["context_engine.estimator.ratio"]
    assert accuracy.sum == pytest.approx(0.92)
    (error,) = points["context_engine.estimator.signed_error"]
    assert error.value == pytest.approx(-0.08)
    code = {"rpc.method": "Build", "rpc.grpc.status_code": "FAILED_PRECONDITION"}
    assert _total(points, "context_engine.rpc.duration", **code) == 1


async def test_a_handler_that_records_is_not_counted_twice(canned: dict[str, Any]) -> None:
    stub, reader = canned["stub"], canned["reader"]
    before = _points(reader)
    await stub.ReportUsage(pb.ReportUsageRequest(model_id="m-2", idempotency_key="handler-records"))
    after = _points(reader)
    assert _total(after, "context_engine.estimator.ratio", model="m-2") == 1
    assert _total(before, "context_engine.estimator.ratio", model="m-2") == 0
    # first_of_epoch: the cache is being written, so no cached-prefix sample for it.
    assert _total(after, "context_engine.prefix.cached_ratio", model="m-2") == 0


async def test_the_first_request_of_an_epoch_does_not_feed_the_cached_prefix_ratio(
    traced: dict[str, Any],
) -> None:
    """docs/operations.md: cached_ratio leaves out the first request of each epoch (it writes
    the provider's cache). The ReportUsage handler decides it from the log."""
    stub, reader = traced["stub"], traced["reader"]
    model = spec().model_id
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec()))

    async def build_and_report(text: str) -> tuple[float, float]:
        """(cached_ratio samples, estimator samples) the report added."""
        run = await stub.StartRun(
            pb.StartRunRequest(
                tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text=text)
            )
        )
        built = await stub.Build(
            pb.BuildRequest(
                tenant_id=TENANT, session_id=session_id, run_id=run.run.run_id, now=_now()
            )
        )
        before = _points(reader)
        await stub.ReportUsage(
            pb.ReportUsageRequest(
                tenant_id=TENANT,
                session_id=session_id,
                request_sequence=built.request_sequence,
                model_id=model,
                input_tokens=built.estimated_input_tokens // 2,
                cache_read_input_tokens=built.estimated_input_tokens // 2,
                output_tokens=5,
            )
        )
        after = _points(reader)

        def added(name: str) -> float:
            return _total(after, name, model=model) - _total(before, name, model=model)

        return added("context_engine.prefix.cached_ratio"), added("context_engine.estimator.ratio")

    assert await build_and_report("first") == (0, 1)  # epoch 1 writes the cache
    assert await build_and_report("second") == (1, 1)  # and this one reads it
    await stub.Rotate(
        pb.RotateRequest(
            tenant_id=TENANT,
            session_id=session_id,
            from_epoch=1,
            reason=pb.PLAN_REASON_MODEL_CHANGED,
        )
    )
    assert await build_and_report("third") == (0, 1)  # epoch 2's first request
    assert await build_and_report("fourth") == (1, 1)


async def test_usage_reports_measure_history_reuse_against_the_preceding_request(
    traced: dict[str, Any],
) -> None:
    """api/usage.py, Rule 6: cache-read input against the preceding request's full input,
    answered (ReportUsageResponse.reuse_ppm), stored, and recorded as
    context_engine.input.reuse_ratio; unset where unmeasured."""
    stub, reader, pool = traced["stub"], traced["reader"], traced["pool"]
    model = spec().model_id
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec()))

    async def start(text: str) -> str:
        started = await stub.StartRun(
            pb.StartRunRequest(
                tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text=text)
            )
        )
        return str(started.run.run_id)

    async def build(run_id: str) -> int:
        built = await stub.Build(
            pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id, now=_now())
        )
        return int(built.request_sequence)

    def report(sequence: int, uncached: int, read: int, written: int = 0) -> Any:
        return pb.ReportUsageRequest(
            tenant_id=TENANT,
            session_id=session_id,
            request_sequence=sequence,
            model_id=model,
            input_tokens=uncached,
            cache_read_input_tokens=read,
            cache_creation_input_tokens=written,
            output_tokens=5,
            idempotency_key=f"r{sequence}",
        )

    async def reported(request: Any) -> tuple[Any, float]:
        """(the answer, reuse_ratio samples the report added)."""
        before = _total(_points(reader), "context_engine.input.reuse_ratio", model=model)
        answer = await stub.ReportUsage(request)
        after = _total(_points(reader), "context_engine.input.reuse_ratio", model=model)
        return answer, after - before

    first_run = await start("first")
    one, two, three = [await build(first_run) for _ in range(3)]
    answer, samples = await reported(report(one, 1_000, 0))
    assert not answer.HasField("reuse_ppm") and samples == 0  # nothing precedes it
    # Three is reported before two, its predecessor: unmeasured, and stays so.
    answer, samples = await reported(report(three, 1_000, 600))
    assert not answer.HasField("reuse_ppm") and samples == 0
    answer, samples = await reported(report(two, 200, 900, 100))
    assert answer.reuse_ppm == 900 * 10**6 // 1_000 and samples == 1  # one's 1,000 read
    replayed, samples = await reported(report(two, 200, 900, 100))
    assert replayed == answer and samples == 0
    # A run's first request is measured against the session's latest before it (three's
    # 1,600), and a read beyond that counts as all of it.
    second_run = await start("second")
    four = await build(second_run)
    answer, samples = await reported(report(four, 10, 2_000))
    assert answer.reuse_ppm == 10**6 and samples == 1
    five = await build(second_run)
    answer, _ = await reported(report(five, 1_500, 505))
    assert answer.reuse_ppm == 505 * 10**6 // 2_010  # four's, the run's previous request
    # A child's requests between two of its parent's: the parent's next is measured
    # against its own previous request (five's 2,005), not the child's.
    child = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT,
            session_id=session_id,
            child=pb.ChildSeed(parent_run_id=second_run, instruction="Look it up."),
        )
    )
    for sequence in [await build(str(child.run.run_id)) for _ in range(2)]:
        await reported(report(sequence, 100, 0))
    six = await build(second_run)
    answer, _ = await reported(report(six, 1_000, 1_002))
    assert answer.reuse_ppm == 1_002 * 10**6 // 2_005

    stored = await pool.fetch(
        "SELECT request_sequence, reuse_ppm, response FROM usage_reports"
        " WHERE tenant_id = $1 AND session_id = $2 ORDER BY request_sequence",
        TENANT,
        uuid.UUID(session_id),
    )
    # The child's two read nothing from cache: 0 each, measured (five's, then its own).
    assert [r["reuse_ppm"] for r in stored] == [None, 900_000, None, 10**6, 251_243, 0, 0, 499_750]
    assert all("reuse_ppm" not in r["response"] for r in stored)  # migrations/0024
    events = await pool.fetch(
        "SELECT payload FROM session_events WHERE tenant_id = $1 AND session_id = $2"
        " AND type = 'model.usage.reported' ORDER BY sequence",
        TENANT,
        uuid.UUID(session_id),
    )
    assert [e["payload"]["reuse_ppm"] for e in events] == [
        None,
        None,
        900_000,
        10**6,
        251_243,
        0,
        0,
        499_750,
    ]


# A usage answer as the first version stored it: no first_of_epoch, no later key.
_FIRST_STORED_OUTCOME = {
    "model_id": "m",
    "factor_ppm": 1_000_000,
    "samples": 1,
    "signed_error_ppm": 0,
    "cached_prefix_ppm": 0,
    "estimated_input_tokens": 10,
    "actual_input_tokens": 10,
    "absorbed": True,
}


def test_a_usage_response_stored_by_a_later_version_reads_without_its_new_keys() -> None:
    """A mixed fleet: a key this version does not know is left out, not refused."""
    read = UsageOutcome.from_json({**_FIRST_STORED_OUTCOME, "a_later_field": 3})
    assert read == UsageOutcome.from_json(_FIRST_STORED_OUTCOME)


def test_a_usage_response_stored_without_first_of_epoch_reads_as_not_first() -> None:
    assert UsageOutcome.from_json(_FIRST_STORED_OUTCOME).first_of_epoch is False


def test_record_functions_outside_an_rpc_do_nothing() -> None:
    reader = InMemoryMetricReader()
    tel = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    telemetry.record_compaction(1)
    with telemetry.span("assemble"):
        pass
    assert _total(_points(reader), "context_engine.compactions") == 0
    token = telemetry.begin(tel, RpcState("Test"))
    try:
        telemetry.record_compaction(1)
        telemetry.record_rotation("agent_changed")
    finally:
        telemetry.end(token)
    points = _points(reader)
    assert _total(points, "context_engine.compactions", depth="1") == 1
    assert _total(points, "context_engine.epochs.rotated", reason="agent_changed") == 1


# --- logs and content --------------------------------------------------------------


async def test_log_lines_are_json_and_nothing_carries_content(traced: dict[str, Any]) -> None:
    stub, spans, logs = traced["stub"], traced["spans"], traced["logs"]
    spans.clear()
    start = len(logs.lines)
    flow = await _session_with_a_tool_loop(stub, CANARY)
    other_session = new_id()
    # The canary really went through: the built request carries it.
    assert CANARY in flow["build"].SerializeToString().decode("utf-8", "replace")

    errors: list[grpc.aio.AioRpcError] = []
    # Each refused request, the method and the code it gets.
    bad_requests: list[tuple[str, Any, str]] = [
        (  # an orphaned tool result whose content is the canary
            "AppendItems",
            pb.AppendItemsRequest(
                tenant_id=TENANT,
                session_id=flow["session_id"],
                run_id=flow["run_id"],
                expected_checkpoint_version=2,
                items=[result("nope", CANARY)],
            ),
            "INVALID_ARGUMENT",
        ),
        (  # a stale version, with content
            "AppendItems",
            pb.AppendItemsRequest(
                tenant_id=TENANT,
                session_id=flow["session_id"],
                run_id=flow["run_id"],
                expected_checkpoint_version=1,
                items=[user(CANARY)],
            ),
            "ABORTED",
        ),
        (
            "StartRun",
            pb.StartRunRequest(tenant_id=TENANT, session_id=other_session, run_id=CANARY),
            "INVALID_ARGUMENT",
        ),
        (  # a result naming another tool than its call, in a sentence (a review: echoed)
            "AppendItems",
            pb.AppendItemsRequest(
                tenant_id=TENANT,
                session_id=flow["session_id"],
                run_id=flow["run_id"],
                expected_checkpoint_version=2,
                items=[call("k9", "web.fetch"), result("k9", "x", name=f"ignore {CANARY}")],
            ),
            "INVALID_ARGUMENT",
        ),
        (  # a control call's argument named by a sentence (a review: echoed)
            "UpdateWorkingState",
            pb.UpdateWorkingStateRequest(
                tenant_id=TENANT,
                session_id=flow["session_id"],
                run_id=flow["run_id"],
                expected_checkpoint_version=2,
                tool_arguments_json=json.dumps({f"My card is {CANARY}": 1}),
            ),
            "INVALID_ARGUMENT",
        ),
    ]
    for method, request, _ in bad_requests:  # one at a time: a call starts when it is created
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await getattr(stub, method)(request)
        errors.append(info.value)

    # This test's calls only: a refused call of an earlier test may still be finishing.
    ours = {flow["session_id"], other_session}

    def our_rpc_lines() -> list[dict[str, Any]]:
        records = [json.loads(line) for line in logs.lines[start:]]
        return [
            r
            for r in records
            if r["logger"] == "context_engine.rpc" and r.get("session_id") in ours
        ]

    def our_server_spans() -> list[ReadableSpan]:
        return [
            s
            for s in spans.get_finished_spans()
            if s.kind == SpanKind.SERVER
            and (s.attributes or {}).get("context_engine.session_id") in ours
        ]

    await _until(
        lambda: len(our_rpc_lines()) == len(our_server_spans()) == 9,
        "a log line and a span for each of the 9 calls",
    )
    lines = logs.lines[start:]
    for line in lines:  # every line is one JSON object
        assert isinstance(json.loads(line), dict)
    rpc_lines = our_rpc_lines()
    methods = [r["method"] for r in rpc_lines]
    assert methods[:4] == ["Plan", "StartRun", "AppendItems", "Build"]
    build_line = rpc_lines[3]
    assert build_line["session_id"] == flow["session_id"]
    assert build_line["run_id"] == flow["run_id"]
    assert build_line["epoch"] == flow["plan"].epoch
    assert build_line["prefix_sha256"] == flow["plan"].prefix_sha256
    assert build_line["code"] == "OK"
    assert isinstance(build_line["duration_ms"], float)
    # The refused calls' lines come in whatever order their servers finished them; each is
    # told apart by its method and request size.
    expected = [(method, request.ByteSize(), code) for method, request, code in bad_requests]
    assert len(set(expected)) == len(expected)
    logged = [(r["method"], r["request_bytes"], r["code"]) for r in rpc_lines[4:]]
    assert sorted(logged) == sorted(expected)
    (start_line,) = [r for r in rpc_lines[4:] if r["method"] == "StartRun"]
    assert start_line["run_id"] == telemetry.MALFORMED  # a caller's text is never echoed

    for line in lines:
        assert CANARY not in line
    for span in spans.get_finished_spans():
        texts = [str(v) for v in (span.attributes or {}).values()]
        texts += [str(span.status.description or ""), span.name]
        for event in span.events:
            texts += [event.name, *(str(v) for v in (event.attributes or {}).values())]
        assert not any(CANARY in text for text in texts), span.name
    for error in errors:
        assert CANARY not in (error.details() or "")
        raw = dict(error.trailing_metadata() or ()).get("grpc-status-details-bin", b"")
        assert CANARY.encode() not in raw


def test_an_exception_in_a_log_record_is_reduced_to_type_and_frames() -> None:
    try:
        raise ValueError(f"bad input: {CANARY}")
    except ValueError:
        record = logging.getLogger("x").makeRecord(
            "x", logging.ERROR, __file__, 1, "failed", (), exc_info=__import__("sys").exc_info()
        )
    line = JsonFormatter().format(record)
    parsed = json.loads(line)
    assert parsed["exc_type"] == "ValueError" and parsed["exc_frames"]
    assert CANARY not in line


# --- exporters ---------------------------------------------------------------------


async def test_prometheus_endpoint_serves_the_metrics() -> None:
    tel = Telemetry.from_environment("127.0.0.1:0", environ={})
    try:
        token = telemetry.begin(tel, RpcState("Build"))
        try:
            telemetry.record_session_opened("m-1")
            telemetry.record_pressure(True, ["drop_knowledge"])
        finally:
            telemetry.end(token)
        tel.finish_rpc(RpcState("Build"), code="OK", duration_s=0.012, request_bytes=300)
        url = f"http://127.0.0.1:{tel.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    finally:
        tel.shutdown()
    text = body.decode()
    assert 'context_engine_sessions_opened_total{model="m-1"' in text
    assert "context_engine_budget_pressure_total" in text
    assert "context_engine_rpc_duration_seconds_bucket" in text
    assert "context_engine_rpc_request_size_bytes_bucket" in text


def test_instruments_no_reader_collects_are_not_recorded() -> None:
    """Without an OTLP endpoint or a Prometheus listener no reader collects the metrics:
    the measurements would go nowhere, so the SDK is not asked to record them (three
    histograms per Build). With a reader (above and below) every one is recorded."""
    unread = Telemetry.from_environment("", environ={})
    assert unread.metrics_read is False and Telemetry().metrics_read is False
    reader = InMemoryMetricReader()
    read = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    assert read.metrics_read is True
    touched: list[str] = []

    class Spy:
        def __init__(self, name: str) -> None:
            self.name = name

        def record(self, *args: Any) -> None:
            touched.append(self.name)

        add = set = record

    for tel in (unread, read):
        tel._instruments = {name: Spy(name) for name in tel._instruments}
        tel.finish_rpc(RpcState("Build"), code="OK", duration_s=0.01, request_bytes=300)
        tel.add("context_engine.runs.started", 1)
        tel.set_gauge("context_engine.store.ready", 1.0)
    assert touched == [
        "context_engine.rpc.duration",
        "context_engine.rpc.request.size",
        "context_engine.runs.started",
        "context_engine.store.ready",
    ]
    unread.shutdown()
    read.shutdown()


class _Collector(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    def __init__(self) -> None:
        self.spans: list[str] = []
        self.metrics: list[str] = []

    async def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans += [s.name for s in scope.spans]
            return trace_service_pb2.ExportTraceServiceResponse()
        for resource in request.resource_metrics:
            for scope in resource.scope_metrics:
                self.metrics += [m.name for m in scope.metrics]
        return metrics_service_pb2.ExportMetricsServiceResponse()


async def test_otlp_export_when_the_endpoint_is_configured(pool: Any) -> None:
    collector = _Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tel = Telemetry.from_environment(
        "", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    )
    running = await build_server(build_engine(pool), "127.0.0.1:0", telemetry=tel)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=new_id(), spec=spec()))
        await running.stop(0)
        await asyncio.to_thread(tel.shutdown)  # flushes both exporters to the collector
    finally:
        await server.stop(0)
    assert SERVICE + "Plan" in collector.spans
    assert "store.read_plan" not in collector.spans  # Plan reads no stored plan
    assert "context_engine.rpc.duration" in collector.metrics
    assert "context_engine.sessions.opened" in collector.metrics


async def test_a_request_on_an_epoch_an_interleaved_run_left_is_not_first(
    traced: dict[str, Any],
) -> None:
    """Runs on two epochs interleave (run A keeps epoch 1 across run B's admission): A's
    second request is warm, though the request before it was on epoch 2."""
    stub, reader = traced["stub"], traced["reader"]
    model = spec().model_id
    session_id = new_id()
    mail = spec()
    mail.tools.append(tool("mail.search", scopes=("mail.read",)))  # what B's grant admits
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=mail))

    async def start(text: str, **admission: Any) -> str:
        request = pb.StartRunRequest(
            tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text=text)
        )
        if admission:
            request.admission.CopyFrom(pb.RunAdmission(**admission))
        return str((await stub.StartRun(request)).run.run_id)

    async def cached_samples_added(run_id: str) -> float:
        built = await stub.Build(
            pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id, now=_now())
        )
        before = _total(_points(reader), "context_engine.prefix.cached_ratio", model=model)
        await stub.ReportUsage(
            pb.ReportUsageRequest(
                tenant_id=TENANT,
                session_id=session_id,
                request_sequence=built.request_sequence,
                model_id=model,
                input_tokens=10,
                output_tokens=5,
            )
        )
        after = _total(_points(reader), "context_engine.prefix.cached_ratio", model=model)
        return after - before

    a = await start("on epoch 1")
    assert await cached_samples_added(a) == 0  # epoch 1's first
    b = await start("with more scope", scopes=["calendar.read", "web.read", "mail.read"])
    assert await cached_samples_added(b) == 0  # epoch 2's first (B's admission rotated)
    assert await cached_samples_added(a) == 1  # epoch 1 again: its cache was written


@pytest.fixture(scope="module")
async def untraced(pool: Any, log_lines: _Lines) -> AsyncIterator[dict[str, Any]]:
    """A server whose telemetry records no spans (no exporter: the sampler is ALWAYS_OFF)."""
    tel = Telemetry()
    assert not tel.traces
    running = await build_server(build_engine(pool), "127.0.0.1:0", telemetry=tel)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield {"stub": pb_grpc.ContextEngineStub(channel), "logs": log_lines}
    await channel.close()
    await running.stop(0)
    tel.shutdown()


async def test_a_log_line_joins_the_callers_trace_with_tracing_on(
    traced: dict[str, Any],
) -> None:
    await _joins_the_callers_trace(traced, tracing=True)


async def test_a_log_line_joins_the_callers_trace_with_tracing_off(
    untraced: dict[str, Any],
) -> None:
    await _joins_the_callers_trace(untraced, tracing=False)


async def _joins_the_callers_trace(server: dict[str, Any], *, tracing: bool) -> None:
    """The line carries the trace id of the caller's traceparent, whether a server span
    exists (tracing on) or the observer reads the metadata itself (tracing off, no span
    interceptor); with tracing off, a call without one, or with a malformed one, gets no
    made-up id."""
    stub, logs = server["stub"], server["logs"]
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    sent = {
        new_id(): (("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),),
        new_id(): (),
        new_id(): (("traceparent", "00-not-a-trace-01"),),
    }
    for session_id, metadata in sent.items():
        with pytest.raises(grpc.aio.AioRpcError):  # no such session: still one line
            await stub.GetPlan(
                pb.GetPlanRequest(tenant_id=TENANT, session_id=session_id), metadata=metadata
            )

    def lines() -> dict[str, dict[str, Any]]:
        records = (json.loads(line) for line in list(logs.lines))
        return {r["session_id"]: r for r in records if r.get("session_id") in sent}

    await _until(lambda: len(lines()) == len(sent), "a line for each call")
    joined, plain, malformed = (lines()[s] for s in sent)
    assert joined["trace_id"] == trace_id
    if not tracing:
        assert "trace_id" not in plain and "trace_id" not in malformed


async def test_a_start_cancelled_after_its_commit_is_counted_once(pool: Any) -> None:
    """StartRun counted the run and its rotation after reading the rotated plan: a call
    whose deadline passed in that read, after the commit, was counted by neither it nor
    its retry, which replays (an audit: 58 of 60 runs counted). Counted once."""
    reader = InMemoryMetricReader()
    tel = Telemetry(TracerProvider(), MeterProvider(metric_readers=[reader]))
    engine = build_engine(pool)
    running = await build_server(engine, "127.0.0.1:0", telemetry=tel)
    read_plan = engine.get_plan

    async def slow_plan(*args: Any, **kw: Any) -> Any:
        await asyncio.sleep(1.0)  # past the call's deadline, after the commit
        return await read_plan(*args, **kw)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            session_id = new_id()
            mail = spec()
            mail.tools.append(tool("mail.search", scopes=("mail.read",)))
            await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=mail))
            request = pb.StartRunRequest(
                tenant_id=TENANT,
                session_id=session_id,
                user_message=pb.UserMessage(text="hello"),
                idempotency_key="start-1",
                admission=pb.RunAdmission(scopes=["calendar.read", "web.read", "mail.read"]),
            )
            engine.get_plan = slow_plan  # type: ignore[method-assign]
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stub.StartRun(request, timeout=0.5)
            assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(1.0)  # the handler, cancelled, is done
            engine.get_plan = read_plan  # type: ignore[method-assign]
            retried = await stub.StartRun(request)
            assert retried.rotated_plan.epoch == 2
        points = _points(reader)
        assert _total(points, "context_engine.runs.started") == 1
        assert _total(points, "context_engine.epochs.rotated") == 1
    finally:
        await running.stop(0)
        tel.shutdown()


class _CancelledCall:
    """A unary call's context with `budget` seconds to its deadline when it begins (None:
    no deadline), cancelled with `left` still on the server's copy of it."""

    def __init__(self, budget: float | None, left: float | None) -> None:
        self.remaining, self.left = budget, left

    def time_remaining(self) -> float | None:
        return self.remaining

    def invocation_metadata(self) -> tuple[()]:
        return ()


async def _cancel(request: Any, context: _CancelledCall) -> None:
    context.remaining = context.left  # the cancellation arrives with this much left
    raise asyncio.CancelledError


async def test_a_call_cancelled_as_its_deadline_passes_is_counted_deadline_exceeded() -> None:
    """The client's copy of a deadline fires first: its cancel reached the handler with
    0.3-3.3 ms left on the server's copy, and the call was counted CANCELLED while the
    client saw DEADLINE_EXCEEDED (an audit). Within a tolerance of the deadline (50 ms
    plus 1% of the timeout, for grpc-timeout's rounding) it is DEADLINE_EXCEEDED; a call
    cancelled by hand well before its deadline, or without one, stays CANCELLED."""
    reader = InMemoryMetricReader()
    tel = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    observer = RpcObserver(tel)
    cases = {  # (seconds to the deadline at the start, at the cancellation) -> code
        (0.3, 0.0): "DEADLINE_EXCEEDED",
        (0.3, 0.0033): "DEADLINE_EXCEEDED",
        (1.0, 0.0092): "DEADLINE_EXCEEDED",
        (2.0, 0.045): "DEADLINE_EXCEEDED",
        (30.0, 0.3): "DEADLINE_EXCEEDED",
        (1.0, 0.5): "CANCELLED",
        (30.0, 29.0): "CANCELLED",
        (30.0, 0.4): "CANCELLED",
        (None, None): "CANCELLED",
    }
    try:
        for n, (budget, left) in enumerate(cases):
            handler = observer.wrap(
                f"{SERVICE}Case{n}", grpc.unary_unary_rpc_method_handler(_cancel)
            )
            with pytest.raises(asyncio.CancelledError):
                await handler.unary_unary(pb.BuildRequest(), _CancelledCall(budget, left))
        points = _points(reader)
        for n, ((budget, left), code) in enumerate(cases.items()):
            labels = {"rpc.method": f"Case{n}", "rpc.grpc.status_code": code}
            assert _total(points, "context_engine.rpc.errors", **labels) == 1, (budget, left)
            assert _total(points, "context_engine.rpc.duration", **labels) == 1, (budget, left)
    finally:
        tel.shutdown()


async def test_calls_out_of_time_behind_a_session_lock_are_recorded_deadline_exceeded(
    traced: dict[str, Any],
) -> None:
    """Builds and AppendItems queued behind a session's row lock until their deadlines
    passed: the client saw DEADLINE_EXCEEDED, and the server counted, logged and marked
    some CANCELLED, its copy of the deadline having a few ms left when the client's cancel
    arrived (an audit: 1-3 of 6). Each is recorded DEADLINE_EXCEEDED; one cancelled by
    hand long before its deadline is recorded CANCELLED."""
    stub, reader, spans, logs, pool = (
        traced[k] for k in ("stub", "reader", "spans", "logs", "pool")
    )
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec()))
    run = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text="hi")
        )
    )
    build = pb.BuildRequest(
        tenant_id=TENANT, session_id=session_id, run_id=run.run.run_id, now=_now()
    )
    append = pb.AppendItemsRequest(
        tenant_id=TENANT,
        session_id=session_id,
        run_id=run.run.run_id,
        expected_checkpoint_version=1,
        items=[assistant("hello")],
    )
    # 1-10 s timeouts: grpc-timeout rounds them up in 10 ms steps, so the server's copy of
    # each deadline runs some ms behind the client's.
    timed = [(stub.Build, build, 1.0), (stub.Build, build, 1.25)]
    timed += [(stub.AppendItems, append, 1.0), (stub.AppendItems, append, 1.25)]
    traced["spans"].clear()
    before = _points(reader)

    async def out_of_time(method: Any, request: Any, timeout: float) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await method(request, timeout=timeout)
        return caught.value.code()

    async with pool.acquire() as holder, holder.transaction():
        await holder.execute(
            "SELECT 1 FROM sessions WHERE session_id = $1 FOR UPDATE", uuid.UUID(session_id)
        )
        by_hand = stub.AppendItems(append, timeout=60)
        codes = asyncio.gather(*(out_of_time(*call) for call in timed))
        await asyncio.sleep(0.3)
        by_hand.cancel()
        with pytest.raises(asyncio.CancelledError):
            await by_hand
        assert await codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * len(timed)

    def errors(method: str, code: str) -> float:
        labels = {"rpc.method": method, "rpc.grpc.status_code": code}
        return _total(_points(reader), "context_engine.rpc.errors", **labels) - _total(
            before, "context_engine.rpc.errors", **labels
        )

    def lines() -> list[tuple[str, str]]:
        records = (json.loads(line) for line in list(logs.lines))
        return sorted(
            (r["method"], r["code"])
            for r in records
            if r.get("session_id") == session_id and r.get("method") in ("Build", "AppendItems")
        )

    def marked() -> list[int]:
        return sorted(
            span.attributes["rpc.grpc.status_code"]
            for method in ("Build", "AppendItems")
            for span in _server_spans(spans, method)
        )

    await _until(lambda: len(lines()) == len(timed) + 1, "a line for each call")
    await _until(lambda: len(marked()) == len(timed) + 1, "a span for each call")
    assert lines() == [
        ("AppendItems", "CANCELLED"),
        ("AppendItems", "DEADLINE_EXCEEDED"),
        ("AppendItems", "DEADLINE_EXCEEDED"),
        ("Build", "DEADLINE_EXCEEDED"),
        ("Build", "DEADLINE_EXCEEDED"),
    ]
    assert errors("Build", "DEADLINE_EXCEEDED") == 2
    assert errors("AppendItems", "DEADLINE_EXCEEDED") == 2
    assert errors("AppendItems", "CANCELLED") == 1
    assert errors("Build", "CANCELLED") == 0
    cancelled, exceeded = grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED
    assert marked() == sorted([cancelled.value[0]] + [exceeded.value[0]] * len(timed))
