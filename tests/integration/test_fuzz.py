"""Fuzz every RPC's request messages against a real server subprocess.

Inputs, once without auth and once with bearer auth on (the auth interceptor then sees
every input, decodable or not): structured messages generated from the proto descriptors
(random, oversized and empty fields, unknown enum values, deeply nested JSON schemas, ids
of real sessions of this tenant and of another tenant), well-formed requests with up to
three fields replaced by such values, mostly fields of content rather than the ids and
versions that aim them (each at a fresh session made for the example, in a state where the
request as seeded is accepted: they get past the first validation, into the checks and the
writes behind it, among them invalid UTF-8 in a content field), and raw bytes (truncated,
random). How many inputs each RPC got, and how many of the drawn ones it accepted, is
printed. Each must get a proper status — never INTERNAL or UNKNOWN — and the server must
stay up. The server runs on a database of its own with a 256 KiB request limit, so the
larger inputs reach the size limit and the rest the handlers.

Nothing a refused call did may stay: the database is read before and after every call
(`_Ledger`: each table's rows, hashed), and a call answered with anything but OK must
leave it as it was, save the two writes docs/api.md names (a Build refused BUDGET_EXCEEDED
logs context.budget.exceeded; a Build first commits a rotation its lineage is due). With
bearer auth on, a decodable message naming the other tenant, within the size limit, must
be PERMISSION_DENIED, and that tenant's rows must be as the seed left them. Afterwards the
invariants that a partial write would break must hold over the fuzz's database.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine.api import wire

from .helpers import TENANT, create_database, drop_database, spec

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
OUTCOMES: dict[tuple[str, str], int] = {}  # (method, status) of the drawn inputs
# With bearer auth on, every call carries TENANT's token: a message naming another tenant
# is PERMISSION_DENIED, and the auth interceptor runs on every input, decodable or not.
TOKENS = {"fuzz-token-" + "f" * 24: TENANT, "fuzz-other-" + "o" * 24: "tenant-other"}
AUTH_ALLOWED = ALLOWED | {grpc.StatusCode.PERMISSION_DENIED}
OTHER = "tenant-other"
# The server's request limit here; the transport refuses more than twice it before any
# interceptor runs (api/server.py), the size interceptor anything over it.
MAX_REQUEST_BYTES = 256 * 1024
# The refusals that write, by (method, status): docs/api.md, "A request that fails writes
# nothing, with two deliberate exceptions". Each may add these event types, and touch
# these tables, and nothing else.
WRITING_REFUSALS: dict[tuple[str, grpc.StatusCode], frozenset[str]] = {
    ("Build", grpc.StatusCode.FAILED_PRECONDITION): frozenset(
        {"context.budget.exceeded", "context.epoch.rotated"}
    ),
    ("Build", grpc.StatusCode.ABORTED): frozenset({"context.epoch.rotated"}),
    ("Build", grpc.StatusCode.NOT_FOUND): frozenset({"context.epoch.rotated"}),
    ("Build", grpc.StatusCode.INVALID_ARGUMENT): frozenset({"context.epoch.rotated"}),
}
REFUSAL_TABLES = frozenset({"sessions", "session_events", "context_plans"})


class _Ledger:
    """The fuzz database's rows, read between calls on a connection of its own: per table
    the row count and an order-free sum of row hashes (an insert, update or delete changes
    it), and the set of logged events (tenant, session, sequence, type)."""

    def __init__(self, dsn: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._conn = self._loop.run_until_complete(asyncpg.connect(dsn))
        tables = self._loop.run_until_complete(
            self._conn.fetch(
                "SELECT table_name, bool_or(column_name = 'tenant_id') AS tenanted"
                " FROM information_schema.columns WHERE table_schema = 'public'"
                " AND table_name <> 'schema_migrations' GROUP BY table_name ORDER BY 1"
            )
        )
        self.tables = [(r["table_name"], r["tenanted"]) for r in tables]

    def _run(self, query: str, *args: Any) -> list[Any]:
        return list(self._loop.run_until_complete(self._conn.fetch(query, *args)))

    def rows(self, tenant: str | None = None) -> dict[str, tuple[int, int]]:
        """{table: (rows, sum of row hashes)}, of one tenant's rows when `tenant` is given
        (the tables that have a tenant_id)."""
        parts = [
            f"SELECT '{name}', count(*), coalesce(sum(hashtext(t::text)), 0) FROM {name} t"
            + (" WHERE tenant_id = $1" if tenant is not None else "")
            for name, tenanted in self.tables
            if tenant is None or tenanted
        ]
        query = " UNION ALL ".join(parts)
        rows = self._run(query, tenant) if tenant is not None else self._run(query)
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    def events(self) -> set[tuple[str, str, int, str]]:
        rows = self._run("SELECT tenant_id, session_id::text, sequence, type FROM session_events")
        return {tuple(r) for r in rows}  # type: ignore[misc]

    def close(self) -> None:
        self._loop.run_until_complete(self._conn.close())
        self._loop.close()


def _bearer(tenant: str) -> tuple[tuple[str, str], ...]:
    token = next(t for t, owner in TOKENS.items() if owner == tenant)
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def fuzz_dsn() -> Iterator[str]:
    """A database of the fuzz's own: the ledger reads all of it between calls, and the
    invariants afterwards cover what the fuzz wrote and nothing else."""
    dsn = asyncio.run(create_database())
    yield dsn
    asyncio.run(drop_database(dsn))


@pytest.fixture(scope="module", params=["open", "bearer"])
def server(request: pytest.FixtureRequest, fuzz_dsn: str) -> Any:
    bearer = request.param == "bearer"
    auth_env = (
        {"CONTEXT_ENGINE_AUTH": "bearer", "CONTEXT_ENGINE_AUTH_TOKENS": json.dumps(TOKENS)}
        if bearer
        else {}
    )

    # Port 0, the address read from serve's "listening on" line (a port picked here and
    # bound there could be another run's by then); the log goes to a file, since a pipe
    # nobody reads would stall the server once full.
    command = [sys.executable, "-m", "context_engine.cli", "serve", "--listen", "127.0.0.1:0"]
    env = {
        **os.environ,
        "CONTEXT_ENGINE_LOG_LEVEL": "ERROR",
        "CONTEXT_ENGINE_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
        **auth_env,
    }
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [*command, "--database-url", fuzz_dsn], env=env, stdout=subprocess.PIPE, stderr=log
        )
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # printed once serving, or EOF if it exits
        if "listening on" not in line:
            proc.wait(timeout=20)
            log.seek(0)
            pytest.fail(f"server did not start: {log.read().decode(errors='replace')[-2000:]}")
        channel = grpc.insecure_channel(line.rsplit(" ", 1)[1].strip())
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        ids = _seed(pb_grpc.ContextEngineStub(channel), bearer)
        yield channel, proc, ids, _bearer(TENANT) if bearer else (), log
        channel.close()
        proc.terminate()
        proc.wait(timeout=20)


def _seed(stub: Any, bearer: bool) -> dict[str, list[str]]:
    """Real ids of this tenant and of another, for the fuzz to aim at."""
    ids: dict[str, list[str]] = {"session": [], "run": []}
    for tenant in (TENANT, OTHER):
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
        st.sampled_from(["tenant-a", OTHER, "x" * 500]),
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
        # Mostly a few; sometimes many (a long list of ids or items under the size limit).
        count = draw(st.integers(0, 3) | st.integers(40, 400)) if repeated else 1
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
        # Short, or oversized (an opaque reasoning payload near and over the limit).
        return st.binary(max_size=64) | st.integers(1_000, 300_000).map(lambda n: b"{" * n)
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
    # Field 1 (tenant_id in every request but ListControlTools', which has no fields) as a
    # length-delimited string of invalid UTF-8.
    return bytes([0x0A, 0x03, 0xFF, 0xFE, 0xFD]) + data


# A string field's value swapped, after serializing, for as many bytes of invalid UTF-8:
# the lengths around it stay right, so only the string is bad.
_SENTINEL = "\x01\x02bad-utf8-\x02\x01"  # an even length
_BAD_UTF8 = b"\xff\xfe" * (len(_SENTINEL) // 2)  # never in UTF-8: 0xFE and 0xFF


def _call(
    channel: grpc.Channel, method: str, payload: bytes, metadata: Any = ()
) -> grpc.StatusCode:
    """One call's status. A refusal the service makes names its reason (google.rpc.ErrorInfo
    in the status details): only the transport's own refusal of a message over twice the
    limit has none."""
    rpc = channel.unary_unary(f"/context_engine.v1.ContextEngine/{method}")
    TRIED[method] = TRIED.get(method, 0) + 1
    try:
        rpc(payload, timeout=30, metadata=metadata)
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
        trailers = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
        if len(payload) <= 2 * MAX_REQUEST_BYTES:
            assert "grpc-status-details-bin" in trailers, (
                f"{method} answered {code.name} without details to {payload[:200]!r}"
            )
        return code
    return grpc.StatusCode.OK


@st.composite
def _case(draw: Any, ids: dict[str, list[str]]) -> tuple[str, bytes]:
    method = draw(st.sampled_from([m for m in SERVICE.methods]))
    message = draw(_message(method.input_type, ids))
    if hasattr(message, "tenant_id") and draw(st.booleans()):
        message.tenant_id = draw(st.sampled_from([TENANT, OTHER]))
    payload = message.SerializeToString()
    mangle = draw(st.sampled_from(["none", "none", "truncate", "random", "utf8"]))
    if mangle == "truncate" and payload:
        payload = payload[: draw(st.integers(0, len(payload) - 1))]
    elif mangle == "random":
        payload = draw(st.binary(min_size=1, max_size=200))
    elif mangle == "utf8":
        payload = _invalid_utf8(payload)
    return method.name, payload


@dataclass(frozen=True)
class _Fresh:
    """A session of this tenant made for one example, in a state where each RPC's first
    seed is accepted: a plan whose catalog holds `triage`, a finished run (the history a
    compaction takes) and a second run with a tool pair and a recorded Build, and what
    PrepareCompaction prepared for it."""

    session: str
    first_run: str
    run: str
    version: int  # the second run's checkpoint version
    request_sequence: int  # its recorded Build
    prepared: Any  # PrepareCompactionResponse


def _fresh_spec() -> pb.PlanSpec:
    out = spec()
    out.skills.add(name="triage", description="Sorts tickets.", version="1")
    return out


def _fresh(channel: grpc.Channel, auth: Any) -> _Fresh:
    """A new session in the state _Fresh describes (its calls are not fuzz inputs)."""
    stub = pb_grpc.ContextEngineStub(channel)
    session = str(uuid.uuid4())
    at = {"tenant_id": TENANT, "session_id": session}
    stub.Plan(pb.PlanRequest(**at, spec=_fresh_spec()), metadata=auth)
    runs = []
    for text, items in (
        (
            "Find a train.",
            [
                _tool_call("c1"),
                _tool_result("c1"),
                pb.ConversationItem(assistant_message=pb.AssistantMessage(text="The 8:04.")),
            ],
        ),
        ("And back?", [_tool_call("c2"), _tool_result("c2")]),
    ):
        started = stub.StartRun(
            pb.StartRunRequest(**at, user_message=pb.UserMessage(text=text)), metadata=auth
        )
        appended = stub.AppendItems(
            pb.AppendItemsRequest(
                **at, run_id=started.run.run_id, expected_checkpoint_version=1, items=items
            ),
            metadata=auth,
        )
        runs.append((started.run.run_id, appended.checkpoint_version))
    (first_run, _), (run, version) = runs
    built = stub.Build(pb.BuildRequest(**at, run_id=run), metadata=auth)
    prepared = stub.PrepareCompaction(pb.PrepareCompactionRequest(**at, run_id=run), metadata=auth)
    return _Fresh(session, first_run, run, version, built.request_sequence, prepared)


def _tool_call(call_id: str) -> pb.ConversationItem:
    return pb.ConversationItem(
        tool_call=pb.ToolCall(call_id=call_id, tool_name="web.fetch", arguments_json="{}")
    )


def _tool_result(call_id: str) -> pb.ConversationItem:
    return pb.ConversationItem(
        tool_result=pb.ToolResult(call_id=call_id, tool_name="web.fetch", content="page", trust=6)
    )


def _valid_requests(fresh: _Fresh, new_session: str) -> dict[str, list[Any]]:
    """Well-formed requests per RPC, aimed at a fresh session: mutating a few fields of
    these reaches the checks past the first validation, and the writes behind them, which
    wholly random messages seldom get through. The first of each is accepted on that
    session (an audit: aimed at one long-lived session, most were refused by the state the
    fuzz had left it in, so few mutations reached a write); the others sit right at a
    refusal behind the first validation (a typed reasoning payload, a skill listed twice,
    trust a catalog entry or a passage may not claim, an admission-only Rotate reason, a
    child run with an admission), so their mutations explore both sides of it."""
    session, run = fresh.session, fresh.run
    at = {"tenant_id": TENANT, "session_id": session}
    on_run = {**at, "run_id": run}
    key = str(uuid.uuid4())  # each example's keyed writes take effect, not replay
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
    prepared = fresh.prepared
    summary = "The user asked for trains."
    return {
        "Plan": [
            pb.PlanRequest(tenant_id=TENANT, session_id=new_session, spec=memory),
            pb.PlanRequest(tenant_id=TENANT, session_id=new_session, spec=twice),
            pb.PlanRequest(tenant_id=TENANT, session_id=new_session, spec=model_skill),
        ],
        "GetPlan": [pb.GetPlanRequest(**at, epoch=1)],
        "Rotate": [
            pb.RotateRequest(
                **at,
                from_epoch=1,
                reason=pb.PLAN_REASON_AGENT_CHANGED,
                spec=memory,
                idempotency_key=key,
            ),
            pb.RotateRequest(
                **at, from_epoch=1, reason=pb.PLAN_REASON_RUN_AUTHORITY_CHANGED, spec=memory
            ),
        ],
        "StartRun": [
            pb.StartRunRequest(
                **at,
                idempotency_key=key,
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
                expected_checkpoint_version=fresh.version,
                idempotency_key=key,
                items=[
                    _tool_call("c3"),
                    _tool_result("c3"),
                    pb.ConversationItem(assistant_message=pb.AssistantMessage(text="done")),
                ],
            ),
            pb.AppendItemsRequest(
                **on_run,
                expected_checkpoint_version=fresh.version,
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
        "GetBuild": [pb.GetBuildRequest(**at, request_sequence=fresh.request_sequence)],
        "ReportUsage": [
            pb.ReportUsageRequest(
                **at,
                request_sequence=fresh.request_sequence,
                model_id="claude-sonnet-4-5",
                input_tokens=900,
                idempotency_key=key,
            )
        ],
        "LoadSkill": [pb.LoadSkillRequest(**at, name="triage", body="Sort it.")],
        "UpdateWorkingState": [
            pb.UpdateWorkingStateRequest(
                **on_run,
                expected_checkpoint_version=fresh.version,
                writer=pb.WRITER_USER,
                idempotency_key=key,
                update=pb.WorkingStateUpdate(
                    objective="Plan the trip",
                    upsert_tasks=[pb.TaskState(task_id="t1", title="Book", status=1)],
                ),
            )
        ],
        "PrepareCompaction": [
            pb.PrepareCompactionRequest(**on_run, checkpoint_version=fresh.version)
        ],
        "CommitCompaction": [
            pb.CommitCompactionRequest(
                **on_run,
                expected_checkpoint_version=prepared.checkpoint_version,
                idempotency_key=key,
                result=pb.CompactionResult(
                    summary=summary,
                    source_event_ids=list(prepared.source_event_ids),
                    elided=list(prepared.elided),
                    replaced_through_sequence=prepared.replaced_through_sequence,
                    depth=prepared.depth,
                    tokens_before=prepared.tokens_before,
                    tokens_after=len(summary) // 4,
                    compactor_version="fuzz@1",
                    prompt_version=prepared.prompt_version,
                ),
            )
        ],
        "EraseSubject": [pb.EraseSubjectRequest(tenant_id=TENANT, person_id="nobody")],
        "OfferFactCandidates": [pb.OfferFactCandidatesRequest(**at, idempotency_key=key)],
        "ListControlTools": [pb.ListControlToolsRequest()],
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


# What aims a request at the fresh session's state rather than saying what to do there.
_ADDRESSING = frozenset(
    {
        "tenant_id",
        "session_id",
        "run_id",
        "parent_run_id",
        "expected_checkpoint_version",
        "checkpoint_version",
        "request_sequence",
        "from_epoch",
        "epoch",
        "idempotency_key",
    }
)


@st.composite
def _mutated(
    draw: Any, seeds: dict[str, list[Any]], ids: dict[str, list[str]]
) -> tuple[str, bytes]:
    """A well-formed request with up to three fields replaced by fuzzed values."""
    method = draw(st.sampled_from(sorted(seeds)))
    seed = draw(st.sampled_from(seeds[method]))
    message = type(seed)()
    message.CopyFrom(seed)
    fields = _fields_in(message)  # none in ListControlToolsRequest
    # Mostly content: a request whose ids and versions stay those of the fresh session
    # goes on past them, to the checks and the write behind (none: the seed as it is).
    for _ in range(draw(st.integers(0, 3)) if fields else 0):
        held = _fields_in(message)
        content = [(h, f) for h, f in held if f.name not in _ADDRESSING]
        holder, field = draw(
            st.sampled_from(content if content and draw(st.integers(0, 3)) else held)
        )
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
    strings = [
        (holder, field)
        for holder, field in _fields_in(message)
        if field.type == FieldDescriptor.TYPE_STRING and not field.is_repeated
    ]
    if strings and draw(st.integers(0, 4)) == 0:
        # Invalid UTF-8 in one string field of a request that is otherwise well formed:
        # content, a tool's arguments, an id.
        holder, field = draw(st.sampled_from(strings))
        setattr(holder, field.name, _SENTINEL)
        payload = message.SerializeToString()
        return method, payload.replace(_SENTINEL.encode(), _BAD_UTF8, 1)
    return method, message.SerializeToString()


def _expected(method: str, payload: bytes, auth: bool) -> set[grpc.StatusCode] | None:
    """The answers an input must get when it is pinned down (None: any proper status):
    over twice the limit the transport refuses it, over the limit the size interceptor
    does (before auth, and whether or not it decodes: it measures the bytes as sent);
    with auth, a decodable message naming another tenant is PERMISSION_DENIED; a string
    of invalid UTF-8 does not decode."""
    if len(payload) > MAX_REQUEST_BYTES:
        return {grpc.StatusCode.RESOURCE_EXHAUSTED}
    if _BAD_UTF8 in payload:
        return {grpc.StatusCode.INVALID_ARGUMENT}
    message = _message_class(SERVICE.methods_by_name[method].input_type)()
    try:
        message.ParseFromString(payload)
    except DecodeError:
        return {grpc.StatusCode.INVALID_ARGUMENT}
    other = getattr(message, "tenant_id", "") not in ("", TENANT)
    if auth and other:
        return {grpc.StatusCode.PERMISSION_DENIED}
    return None


def _checked_call(
    channel: grpc.Channel, ledger: _Ledger, method: str, payload: bytes, auth: Any
) -> grpc.StatusCode:
    """One call, with the database read before and after: a refusal changes nothing but
    what WRITING_REFUSALS allows it."""
    rows, events = ledger.rows(), ledger.events()
    code = _call(channel, method, payload, auth)
    if code is grpc.StatusCode.OK:
        return code
    changed = {t for t, figures in ledger.rows().items() if rows.get(t) != figures}
    logged = {e[3] for e in ledger.events() - events}
    may_log = WRITING_REFUSALS.get((method, code), frozenset())
    assert logged <= may_log and changed <= (REFUSAL_TABLES if logged else set()), (
        f"{method} answered {code.name} yet changed {sorted(changed)}, logging"
        f" {sorted(logged)}, for {payload[:200]!r}"
    )
    return code


def test_fuzz_every_rpc(server: Any, fuzz_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    channel, proc, ids, auth, log = server
    allowed = AUTH_ALLOWED if auth else ALLOWED
    TRIED.clear()
    OUTCOMES.clear()
    examples = int(os.environ.get("FUZZ_EXAMPLES", "600"))
    ledger = _Ledger(fuzz_dsn)
    others = ledger.rows(OTHER)

    @settings(
        # The bearer pass checks the auth path on every kind of input; a third as many.
        max_examples=examples // 3 if auth else examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        if data.draw(st.booleans(), label="mutate a seed"):
            seeds = _valid_requests(_fresh(channel, auth), str(uuid.uuid4()))
            method, payload = data.draw(_mutated(seeds, ids))
        else:
            method, payload = data.draw(_case(ids))
        code = _checked_call(channel, ledger, method, payload, auth)
        OUTCOMES[method, code.name] = OUTCOMES.get((method, code.name), 0) + 1
        assert code in allowed, f"{method} answered {code.name} to {payload[:200]!r}"
        expected = _expected(method, payload, bool(auth))
        assert expected is None or code in expected, (
            f"{method} answered {code.name}, not {sorted(c.name for c in expected)},"
            f" to {payload[:200]!r}"
        )
        assert proc.poll() is None, "the server died"

    fuzz()
    drawn = dict(TRIED)
    # Every RPC at least once with an empty message, an undecodable one (field 1 as a
    # string of invalid UTF-8; an unknown field to ListControlToolsRequest, which has
    # none), bytes cut short and one over the size limit, whatever the draw covered.
    over = wire.field(1, b"a" * (MAX_REQUEST_BYTES + 1))
    for method in SERVICE.methods:
        for payload in (b"", b"\x0a\x02\xff\xfe", b"\x12\x05ab", over):
            code = _checked_call(channel, ledger, method.name, payload, auth)
            assert code in allowed, f"{method.name} answered {code.name} to {payload[:20]!r}"
            expected = _expected(method.name, payload, bool(auth))
            assert expected is None or code in expected, (method.name, code, payload[:20])
    # And every seed once as it is, each on a fresh session: the first is accepted, each
    # refusal the others sit at is a proper status.
    for method in sorted(_valid_requests(_fresh(channel, auth), str(uuid.uuid4()))):
        seeds = _valid_requests(_fresh(channel, auth), str(uuid.uuid4()))[method]
        for n, seed in enumerate(seeds):
            code = _checked_call(channel, ledger, method, seed.SerializeToString(), auth)
            assert code in allowed, f"{method} answered {code.name} to its seed {seed}"
            assert (code is grpc.StatusCode.OK) == (n == 0), f"{method}: {code.name} to {seed}"
    if auth:
        # Every call carried this tenant's token: the other tenant's rows are as seeded.
        assert ledger.rows(OTHER) == others, "a call on this tenant's token changed another's"
    ledger.close()
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    # Nothing went wrong unseen. The server logs at ERROR only here, so any line is one:
    # grpc's core on a handler that failed (an answer it could not send, an exception it
    # caught), the engine's "unhandled error", asyncio's unretrieved task exception, or a
    # traceback written to stderr past the formatter.
    log.seek(0)
    logged = [line for line in log.read().decode(errors="replace").splitlines() if line]
    assert logged == [], "the server logged:\n" + "\n".join(logged[-20:])
    with capsys.disabled():
        total = sum(TRIED.values())
        mode = "bearer auth" if auth else "no auth"
        print(
            f"\nfuzz ({mode}): {total} inputs across {len(TRIED)} RPCs:"
            f" {dict(sorted(TRIED.items()))}"
        )
        accepted = {m: n for (m, code), n in sorted(OUTCOMES.items()) if code == "OK"}
        print(f"  drawn inputs accepted (a write path reached, where the RPC writes): {accepted}")
    # The draw reached every RPC (the fixed loop above calls each whatever it drew).
    if sum(drawn.values()) >= 400:
        assert set(drawn) == set(SERVICE.methods_by_name), sorted(
            set(SERVICE.methods_by_name) - set(drawn)
        )


async def test_no_partial_writes_after_fuzz(fuzz_dsn: str, server: Any) -> None:
    """Invariants that any partial write would break, over everything the fuzz wrote."""
    pool = await asyncpg.connect(fuzz_dsn)
    try:
        await _invariants(pool)
    finally:
        await pool.close()


async def _invariants(pool: Any) -> None:
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
    skipped = await pool.fetch(
        "SELECT tenant_id, run_id FROM run_checkpoints GROUP BY tenant_id, run_id"
        " HAVING count(*) <> max(version) OR min(version) <> 1"
    )
    assert not skipped, f"runs whose checkpoint versions skip: {skipped[:3]}"
    unrecorded = await pool.fetch(
        "SELECT u.session_id, u.request_sequence FROM usage_reports u WHERE NOT EXISTS"
        " (SELECT 1 FROM session_events e WHERE e.tenant_id = u.tenant_id"
        "  AND e.session_id = u.session_id AND e.sequence = u.request_sequence"
        "  AND e.type = 'model.request.started')"
    )
    assert not unrecorded, f"usage reports without their request: {unrecorded[:3]}"
