"""Fuzz every RPC's request messages against a real server subprocess.

Inputs, once without auth and once with bearer auth on (the auth interceptor then sees
every input, decodable or not): structured messages generated from the proto descriptors
(random, oversized and empty fields, unknown enum values, deeply nested JSON schemas, ids
of real sessions of this tenant and of another tenant), well-formed requests with one to
three fields replaced by such values (they get past the first validation, into the checks
behind it), and raw bytes (truncated, random, invalid UTF-8 in string fields). Each must
get a proper status — never INTERNAL or UNKNOWN — the server must stay up, and afterwards
the database invariants that a partial write would break must hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from .helpers import TENANT, spec

SERVICE = pb.DESCRIPTOR.services_by_name["ContextEngine"]
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
TRIED: dict[str, int] = {}
# With bearer auth on, every call carries TENANT's token: a message naming another tenant
# is PERMISSION_DENIED, and the auth interceptor runs on every input, decodable or not.
TOKENS = {"fuzz-token-" + "f" * 24: TENANT, "fuzz-other-" + "o" * 24: "tenant-other"}
AUTH_ALLOWED = ALLOWED | {grpc.StatusCode.PERMISSION_DENIED}


def _bearer(tenant: str) -> tuple[tuple[str, str], ...]:
    token = next(t for t, owner in TOKENS.items() if owner == tenant)
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module", params=["open", "bearer"])
def server(request: pytest.FixtureRequest, database_dsn: str) -> Any:
    import socket

    bearer = request.param == "bearer"
    auth_env = (
        {"CONTEXT_ENGINE_AUTH": "bearer", "CONTEXT_ENGINE_AUTH_TOKENS": json.dumps(TOKENS)}
        if bearer
        else {}
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "context_engine.cli",
            "serve",
            "--listen",
            target,
            "--database-url",
            database_dsn,
        ],
        env={**os.environ, "CONTEXT_ENGINE_LOG_LEVEL": "ERROR", **auth_env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    channel = grpc.insecure_channel(target)
    health = health_pb2_grpc.HealthStub(channel)
    for _ in range(300):  # a bounded wait for readiness (at most about a minute)
        try:
            health.Check(health_pb2.HealthCheckRequest(), timeout=1)
            break
        except grpc.RpcError:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.2)
    else:
        pytest.fail("server did not become ready")
    stub = pb_grpc.ContextEngineStub(channel)
    ids = _seed(stub, bearer)
    yield channel, proc, ids, _bearer(TENANT) if bearer else ()
    channel.close()
    proc.terminate()
    proc.wait(timeout=20)


def _seed(stub: Any, bearer: bool) -> dict[str, list[str]]:
    """Real ids of this tenant and of another, for the fuzz to aim at."""
    ids: dict[str, list[str]] = {"session": [], "run": []}
    for tenant in (TENANT, "tenant-other"):
        session_id = str(uuid.uuid4())
        auth = _bearer(tenant) if bearer else ()
        stub.Plan(
            pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=spec()), metadata=auth
        )
        run = stub.StartRun(
            pb.StartRunRequest(
                tenant_id=tenant, session_id=session_id, user_message=pb.UserMessage(text="hi")
            ),
            metadata=auth,
        )
        # A recorded request, so GetBuild and ReportUsage aimed at it get past NOT_FOUND.
        stub.Build(
            pb.BuildRequest(tenant_id=tenant, session_id=session_id, run_id=run.run.run_id),
            metadata=auth,
        )
        ids["session"].append(session_id)
        ids["run"].append(run.run.run_id)
    return ids


def _deep_json(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + "{}" + "}}" * depth


def _strings(name: str, ids: dict[str, list[str]]) -> st.SearchStrategy[str]:
    base = st.one_of(
        st.text(max_size=40),
        st.just(""),
        st.integers(min_value=1_000, max_value=300_000).map(lambda n: "\u00e9" * n),
        st.sampled_from(["tenant-a", "tenant-other", "x" * 500]),
    )
    if name.endswith("session_id"):
        return st.one_of(st.sampled_from(ids["session"]), st.uuids().map(str), base)
    if name.endswith("run_id"):
        return st.one_of(st.sampled_from(ids["run"]), st.uuids().map(str), base)
    if name.endswith("_json"):
        json_values = st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats(allow_nan=False)
            | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=10,
        )
        return st.one_of(
            json_values.map(json.dumps),
            st.integers(min_value=60, max_value=900).map(_deep_json),
            # Valid JSON that canonical JSON or PostgreSQL cannot carry.
            st.sampled_from(
                ['{"a": 1e400}', '{"a": "\\ud800"}', '{"a": "\\u0000"}', '{"a": 2e16}', "{"]
            ),
            base,
        )
    return base


@st.composite
def _message(draw: Any, descriptor: Any, ids: dict[str, list[str]], depth: int = 0) -> Any:
    cls = getattr(pb, descriptor.name, None) or _message_class(descriptor)
    message = cls()
    for field in descriptor.fields:
        if field.containing_oneof is not None and draw(st.booleans()):
            continue
        if not draw(st.integers(0, 3)):
            continue
        repeated = field.is_repeated
        count = draw(st.integers(0, 3)) if repeated else 1
        for _ in range(count):
            value = draw(_value(field, ids, depth))
            if value is None:
                continue
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                (
                    getattr(message, field.name).add() if repeated else getattr(message, field.name)
                ).CopyFrom(value)
            elif repeated:
                getattr(message, field.name).append(value)
            else:
                setattr(message, field.name, value)
    return message


def _message_class(descriptor: Any) -> Any:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def _value(field: Any, ids: dict[str, list[str]], depth: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t == FieldDescriptor.TYPE_MESSAGE:
        if depth > 3:
            return st.none()
        return _message(field.message_type, ids, depth + 1)
    if t == FieldDescriptor.TYPE_STRING:
        return _strings(field.name, ids)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_ENUM:
        return st.integers(min_value=-3, max_value=40)
    if t in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SFIXED32,
    ):
        return st.integers(min_value=-(2**31), max_value=2**31 - 1)
    return st.integers(min_value=-(2**63), max_value=2**63 - 1)


def _invalid_utf8(data: bytes) -> bytes:
    # Field 1 (tenant_id in every request) as a length-delimited string of invalid UTF-8.
    return bytes([0x0A, 0x03, 0xFF, 0xFE, 0xFD]) + data


def _call(
    channel: grpc.Channel, method: str, payload: bytes, metadata: Any = ()
) -> grpc.StatusCode:
    rpc = channel.unary_unary(f"/context_engine.v1.ContextEngine/{method}")
    TRIED[method] = TRIED.get(method, 0) + 1
    try:
        rpc(payload, timeout=30, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@st.composite
def _case(draw: Any, ids: dict[str, list[str]]) -> tuple[str, bytes]:
    method = draw(st.sampled_from([m for m in SERVICE.methods]))
    message = draw(_message(method.input_type, ids))
    if hasattr(message, "tenant_id") and draw(st.booleans()):
        message.tenant_id = draw(st.sampled_from([TENANT, "tenant-other"]))
    payload = message.SerializeToString()
    mangle = draw(st.sampled_from(["none", "none", "truncate", "random", "utf8"]))
    if mangle == "truncate" and payload:
        payload = payload[: draw(st.integers(0, len(payload) - 1))]
    elif mangle == "random":
        payload = draw(st.binary(min_size=1, max_size=200))
    elif mangle == "utf8":
        payload = _invalid_utf8(payload)
    return method.name, payload


def _valid_requests(ids: dict[str, list[str]], new_session: str) -> dict[str, list[Any]]:
    """Well-formed requests per RPC that takes a session, aimed at this tenant's seeded
    session: mutating a few fields of these reaches the checks past the first validation,
    which wholly random messages seldom get through. The first of each is accepted; the
    others sit right at a refusal behind the first validation (a typed reasoning payload,
    a skill listed twice, trust a catalog entry or a passage may not claim, an
    admission-only Rotate reason, a child run with an admission), so their mutations
    explore both sides of it."""
    session, run = ids["session"][0], ids["run"][0]
    at = {"tenant_id": TENANT, "session_id": session}
    on_run = {**at, "run_id": run}
    step = pb.StepContext(
        recall=[
            pb.RecallLine(
                item_id="r1", text="Ana likes trains.", source="memory", person_ids=["ana"]
            )
        ],
        knowledge=[
            pb.KnowledgePassage(
                item_id="k1",
                text="Trains leave hourly.",
                citation="timetable p.2",
                trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION,
            )
        ],
        recall_floor_lines=1,
    )
    memory = spec(
        snapshot=pb.MemorySnapshot(
            snapshot_id="s1",
            recall_trace_id="t1",
            watermark=3,
            items=[pb.MemoryItem(item_id="m1", text="Ana is vegetarian.", person_ids=["ana"])],
        )
    )
    skill = pb.SkillCatalogEntry(name="triage", description="Sorts tickets.", version="1")
    twice, model_skill = spec(), spec()
    twice.skills.extend([skill, skill])
    model_skill.skills.add(name="triage", version="1", trust=pb.TRUST_LEVEL_MODEL)
    model_passage = pb.StepContext()
    model_passage.CopyFrom(step)
    model_passage.knowledge[0].trust = pb.TRUST_LEVEL_MODEL
    return {
        "Plan": [
            pb.PlanRequest(tenant_id=TENANT, session_id=new_session, spec=memory),
            pb.PlanRequest(tenant_id=TENANT, session_id=new_session, spec=twice),
            pb.PlanRequest(tenant_id=TENANT, session_id=new_session, spec=model_skill),
        ],
        "GetPlan": [pb.GetPlanRequest(**at, epoch=1)],
        "Rotate": [
            pb.RotateRequest(**at, from_epoch=1, reason=pb.PLAN_REASON_AGENT_CHANGED, spec=memory),
            pb.RotateRequest(
                **at, from_epoch=1, reason=pb.PLAN_REASON_RUN_AUTHORITY_CHANGED, spec=memory
            ),
        ],
        "StartRun": [
            pb.StartRunRequest(
                **at,
                idempotency_key="k",
                user_message=pb.UserMessage(text="hello"),
                admission=pb.RunAdmission(scopes=["web.read"]),
            ),
            pb.StartRunRequest(
                **at,
                idempotency_key="k-child",
                child=pb.ChildSeed(parent_run_id=run, instruction="Check the timetable."),
                admission=pb.RunAdmission(scopes=["web.read", "mail.send"]),
            ),
        ],
        "AppendItems": [
            pb.AppendItemsRequest(
                **on_run,
                expected_checkpoint_version=1,
                items=[
                    pb.ConversationItem(
                        tool_call=pb.ToolCall(
                            call_id="c1", tool_name="web.fetch", arguments_json="{}"
                        )
                    ),
                    pb.ConversationItem(
                        tool_result=pb.ToolResult(
                            call_id="c1", tool_name="web.fetch", content="page", trust=6
                        )
                    ),
                    pb.ConversationItem(assistant_message=pb.AssistantMessage(text="done")),
                ],
            ),
            pb.AppendItemsRequest(
                **on_run,
                expected_checkpoint_version=1,
                items=[
                    pb.ConversationItem(
                        reasoning=pb.ReasoningItem(
                            provider=pb.PROVIDER_ANTHROPIC,
                            opaque=b'{"type":"text","text":"I will answer."}',  # not thinking
                        )
                    ),
                    pb.ConversationItem(assistant_message=pb.AssistantMessage(text="done")),
                ],
            ),
        ],
        "Build": [
            pb.BuildRequest(**on_run, step=step),
            pb.BuildRequest(**on_run, step=model_passage),
        ],
        "GetBuild": [pb.GetBuildRequest(**at, request_sequence=3)],
        "ReportUsage": [
            pb.ReportUsageRequest(
                **at, request_sequence=3, model_id="claude-sonnet-4-5", input_tokens=900
            )
        ],
        "LoadSkill": [pb.LoadSkillRequest(**at, name="triage", body="Sort it.", trust=2)],
        "UpdateWorkingState": [
            pb.UpdateWorkingStateRequest(
                **on_run,
                expected_checkpoint_version=1,
                writer=pb.WRITER_USER,
                update=pb.WorkingStateUpdate(
                    objective="Plan the trip",
                    upsert_tasks=[pb.TaskState(task_id="t1", title="Book", status=1)],
                    add_facts=[pb.Fact(statement="Leaves Monday", source_event_ids=[1], trust=3)],
                ),
            )
        ],
        "PrepareCompaction": [pb.PrepareCompactionRequest(**on_run, checkpoint_version=1)],
        "CommitCompaction": [
            pb.CommitCompactionRequest(
                **on_run,
                expected_checkpoint_version=1,
                result=pb.CompactionResult(
                    summary="They talked.", source_event_ids=[1], replaced_through_sequence=1
                ),
            )
        ],
        "EraseSubject": [pb.EraseSubjectRequest(tenant_id=TENANT, person_id="nobody")],
    }


def _fields_in(message: Any) -> list[tuple[Any, Any]]:
    """(message, field) for every field of `message` and of the sub-messages it holds."""
    out = [(message, f) for f in message.DESCRIPTOR.fields]
    for field, value in message.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        for inner in value if field.is_repeated else [value]:
            out += _fields_in(inner)
    return out


@st.composite
def _mutated(draw: Any, ids: dict[str, list[str]]) -> tuple[str, bytes]:
    """A well-formed request with one to three fields replaced by fuzzed values."""
    seeds = _valid_requests(ids, str(draw(st.uuids())))
    method = draw(st.sampled_from(sorted(seeds)))
    seed = draw(st.sampled_from(seeds[method]))
    message = type(seed)()
    message.CopyFrom(seed)
    for _ in range(draw(st.integers(1, 3))):
        holder, field = draw(st.sampled_from(_fields_in(message)))
        value = draw(_value(field, ids, depth=2))
        if value is None:
            holder.ClearField(field.name)
        elif field.is_repeated:
            target = getattr(holder, field.name)
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                target.add().CopyFrom(value)
            else:
                target.append(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(holder, field.name).CopyFrom(value)
        else:
            setattr(holder, field.name, value)
    return method, message.SerializeToString()


def test_fuzz_every_rpc(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    channel, proc, ids, auth = server
    allowed = AUTH_ALLOWED if auth else ALLOWED
    TRIED.clear()
    examples = int(os.environ.get("FUZZ_EXAMPLES", "600"))

    @settings(
        # The bearer pass checks the auth path on every kind of input; a third as many.
        max_examples=examples // 3 if auth else examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.one_of(_case(ids), _mutated(ids)))
    def fuzz(case: tuple[str, bytes]) -> None:
        method, payload = case
        code = _call(channel, method, payload, auth)
        assert code in allowed, f"{method} answered {code.name} to {payload[:200]!r}"
        assert proc.poll() is None, "the server died"

    fuzz()
    # Every RPC at least once with an empty message, an undecodable one (a string field
    # holding invalid UTF-8) and bytes cut short, whatever the draw covered.
    for method in SERVICE.methods:
        for payload in (b"", b"\x12\xff\xff", b"\x12\x05ab"):
            code = _call(channel, method.name, payload, auth)
            assert code in allowed, f"{method.name} answered {code.name} to {payload!r}"
    # And every seed once as it is: each refusal it sits at is a proper status.
    for method, seeds in _valid_requests(ids, str(uuid.uuid4())).items():
        for n, seed in enumerate(seeds):
            code = _call(channel, method, seed.SerializeToString(), auth)
            assert code in allowed, f"{method} answered {code.name} to its seed {seed}"
            assert n == 0 or code is not grpc.StatusCode.OK, f"{method} took {seed}"
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    with capsys.disabled():
        total = sum(TRIED.values())
        mode = "bearer auth" if auth else "no auth"
        print(
            f"\nfuzz ({mode}): {total} inputs across {len(TRIED)} RPCs:"
            f" {dict(sorted(TRIED.items()))}"
        )
    assert len(TRIED) == len(SERVICE.methods)


async def test_no_partial_writes_after_fuzz(pool: Any, server: Any) -> None:
    """Invariants that any partial write would break, over everything the fuzz touched."""
    gaps = await pool.fetch(
        "SELECT s.tenant_id, s.session_id FROM sessions s"
        " LEFT JOIN session_events e USING (tenant_id, session_id)"
        " GROUP BY s.tenant_id, s.session_id, s.last_sequence"
        " HAVING count(e.sequence) <> s.last_sequence"
        " OR coalesce(max(e.sequence), 0) <> s.last_sequence"
    )
    assert not gaps, f"event sequences with gaps: {gaps[:3]}"
    planless = await pool.fetch(
        "SELECT s.session_id FROM sessions s WHERE s.current_epoch > 0 AND"
        " (SELECT count(*) FROM context_plans p WHERE p.tenant_id = s.tenant_id"
        "  AND p.session_id = s.session_id) < s.current_epoch"
    )
    assert not planless, f"sessions missing plan epochs: {planless[:3]}"
    # The current plan is the newest but for lazy continuations of other lineages: no
    # sweep, fork or merge above it (store/plans.py, lineages).
    behind = await pool.fetch(
        "SELECT s.session_id FROM sessions s JOIN context_plans p"
        " ON p.tenant_id = s.tenant_id AND p.session_id = s.session_id"
        " WHERE p.epoch > s.current_epoch"
        " AND (p.sweep OR coalesce(p.lineage, p.epoch) = p.epoch)"
    )
    assert not behind, f"sessions whose current plan is not the newest: {behind[:3]}"
    no_checkpoint = await pool.fetch(
        "SELECT r.run_id FROM runs r WHERE NOT EXISTS (SELECT 1 FROM run_checkpoints c"
        " WHERE c.tenant_id = r.tenant_id AND c.run_id = r.run_id AND c.version = 1)"
    )
    assert not no_checkpoint, f"runs without their first checkpoint: {no_checkpoint[:3]}"
    unseeded = await pool.fetch(
        "SELECT r.run_id FROM runs r WHERE r.seed_event_sequence IS NOT NULL AND NOT EXISTS"
        " (SELECT 1 FROM session_events e WHERE e.tenant_id = r.tenant_id"
        "  AND e.session_id = r.session_id AND e.sequence = r.seed_event_sequence"
        "  AND e.type = 'user.message.created' AND e.run_id = r.run_id)"
    )
    assert not unseeded, f"runs whose seed event is missing: {unseeded[:3]}"
