"""GetBuild rebuilds a recorded request byte for byte; explain reads requests through it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Any
from uuid import UUID, uuid4

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine.api.convert import request_from_proto, request_to_proto
from context_engine.api.rpc_builds import rebuild
from context_engine.api.server import build_engine
from context_engine.cli import main
from context_engine.core.assemble import StepContext
from context_engine.core.build_record import (
    ASSEMBLER_KEY,
    ASSEMBLER_VERSION,
    IMAGE_KEY,
    INLINE_KEY,
    INPUTS_KEY,
    LEGACY_ASSEMBLER_VERSION,
    PAYLOAD_KEY,
    TOKENIZER_KEY,
    estimate_to_record,
    inputs_from_record,
    unbridged,
)
from context_engine.core.canonical import sha256_hex
from context_engine.core.rows import Region, Row
from context_engine.explain import explain, fetch_builds
from context_engine.providers import render
from context_engine.providers.texts import TOOL_ERROR_AS_TEXT

from .helpers import (
    TENANT,
    append_items,
    assistant,
    build_request,
    call,
    details,
    new_id,
    open_session,
    replica,
    replica_with_model,
    result,
    spec,
    start_child,
    start_run,
    update_state,
)


def _ts(dt: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(dt)
    return ts


STEP = pb.StepContext(
    recall=[pb.RecallLine(item_id="m1", text="Prefers trains.", source="belief")],
    knowledge=[pb.KnowledgePassage(item_id="k1", text="TGV timetable.", citation="sncf")],
)


async def _get(stub: Any, session_id: str, sequence: int, tenant: str = TENANT) -> Any:
    return await stub.GetBuild(
        pb.GetBuildRequest(tenant_id=tenant, session_id=session_id, request_sequence=sequence)
    )


async def test_get_build_returns_the_recorded_bytes(stub: Any, pool: Any, grpc_server: Any) -> None:
    session_id, _ = await open_session(stub)
    started = await start_run(stub, session_id, "Find a train.")
    run_id = started.run.run_id
    first = await stub.Build(
        pb.BuildRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=run_id,
            now=_ts(datetime(2026, 3, 14, 22, 59, tzinfo=UTC)),
            step=STEP,
        )
    )
    await stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=started.checkpoint_version,
            items=[call("c1"), result("c1", "the page")],
        )
    )
    # No clock given: the server reads its own, and GetBuild must still reproduce it.
    second = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id)
    )
    assert first.provider_payload and first.provider_api == "anthropic.messages"
    for built in (first, second):
        again = await _get(stub, session_id, built.request_sequence)
        assert again == built, "GetBuild answers with the Build response, byte for byte"

    async with pool.acquire() as conn:
        payload = await conn.fetchval(
            "SELECT payload FROM session_events WHERE session_id = $1 AND sequence = $2",
            UUID(session_id),
            first.request_sequence,
        )
    inputs = payload[INPUTS_KEY]
    assert inputs["now"] == "2026-03-14T22:59:00+00:00"
    assert [r["text"] for r in inputs["step"]["recall"]] == ["Prefers trains."]

    a, b = await fetch_builds(
        f"127.0.0.1:{grpc_server.port}",
        TENANT,
        session_id,
        [first.request_sequence, second.request_sequence],
    )
    explained = explain(a, b)
    assert explained.region is Region.BODY and not explained.defect
    assert explained.row in (Row.CONVERSATION, Row.RECALL)


async def test_the_explain_command_reads_a_session_through_get_build(
    stub: Any, grpc_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    session_id, _ = await open_session(stub)
    started = await start_run(stub, session_id, "hello")
    sequences = []
    for day in (14, 15):
        built = await stub.Build(
            pb.BuildRequest(
                tenant_id=TENANT,
                session_id=session_id,
                run_id=started.run.run_id,
                now=_ts(datetime(2026, 3, day, 12, tzinfo=UTC)),
            )
        )
        sequences.append(str(built.request_sequence))
    # The command runs its own event loop; the server keeps serving on this one.
    assert await _explain(grpc_server.port, session_id, *sequences) == 0
    out = capsys.readouterr().out
    assert "row 14 runtime metadata (Region B)" in out and "expected" in out
    # A GetBuild error is one line: the code, the details, the ErrorInfo reason.
    assert await _explain(grpc_server.port, new_id(), "1", "2") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("context-engine explain: GetBuild failed: NOT_FOUND: "), line
    assert line.endswith(" not found [SESSION_NOT_FOUND]"), line  # an unknown session


async def test_explain_reads_a_build_over_grpcs_default_receive_limit(
    grpc_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Build for a long-window model can pass gRPC's 4 MiB receive default, and the server
    sends it whole: explain's own channel refused it RESOURCE_EXHAUSTED while GetBuild
    served it (an audit)."""
    options = [("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_server.port}", options=options) as ch:
        big = pb_grpc.ContextEngineStub(ch)  # type: ignore[no-untyped-call]
        session_id, _ = await open_session(big, model_id="gpt-4.1")
        words = [f"station{n % 997} ticket{n % 991}" for n in range(150_000)]
        run_id = (await start_run(big, session_id, " ".join(words))).run.run_id
        sequences = []
        for _ in range(2):
            built = await big.Build(build_request(session_id, run_id))
            assert built.ByteSize() > 4 * 1024 * 1024
            sequences.append(str(built.request_sequence))
    assert await _explain(grpc_server.port, session_id, *sequences) == 0, capsys.readouterr()
    assert "identical" in capsys.readouterr().out


async def _explain(port: int, session_id: str, *argv: str) -> int:
    """`context-engine explain --session` against the server on `port`, in a thread."""
    target = f"127.0.0.1:{port}"
    command = ["explain", "--session", session_id, "--tenant", TENANT, "--target", target]
    return await asyncio.to_thread(main, [*command, *argv])


async def test_get_build_of_an_unknown_request_is_not_found(stub: Any) -> None:
    session_id, _ = await open_session(stub)
    started = await start_run(stub, session_id, "hello")
    built = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=started.run.run_id)
    )
    for tenant, session, sequence, reason_field in (
        (
            TENANT,
            session_id,
            built.request_sequence + 100,
            ("REQUEST_NOT_FOUND", "request_sequence"),
        ),
        # An event, but not a recorded request.
        (TENANT, session_id, built.request_sequence - 1, ("REQUEST_NOT_FOUND", "request_sequence")),
        # Another tenant's session is a missing one, as every session RPC answers.
        ("tenant-other", session_id, built.request_sequence, ("SESSION_NOT_FOUND", "session_id")),
        (TENANT, str(uuid4()), 1, ("SESSION_NOT_FOUND", "session_id")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _get(stub, session, sequence, tenant)
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
        reason, fields, _ = details(caught.value)
        assert (reason, fields) == (reason_field[0], [reason_field[1]])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _get(stub, session_id, 0)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_a_skill_loaded_after_a_build_does_not_change_its_rebuild(stub: Any) -> None:
    with_skill = spec()
    with_skill.skills.append(
        pb.SkillCatalogEntry(name="trip-planning", description="Plans trips.", version="1")
    )
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=with_skill))
    started = await start_run(stub, session_id, "hello")
    build = pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=started.run.run_id)
    before = await stub.Build(build)
    await stub.LoadSkill(
        pb.LoadSkillRequest(
            tenant_id=TENANT,
            session_id=session_id,
            name="trip-planning",
            body="Always compare two routes.",
            trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION,
            run_id=started.run.run_id,
        )
    )
    after = await stub.Build(build)
    assert after.request_sha256 != before.request_sha256, "the skill body entered row 11"
    assert await _get(stub, session_id, before.request_sequence) == before
    assert await _get(stub, session_id, after.request_sequence) == after


async def test_a_skill_body_a_rotation_lowered_and_an_assembler_16_record_of_it(
    stub: Any, pool: Any
) -> None:
    """From context-assembler@17 a loaded body renders at its pinned entry's trust where a
    Rotate lowered it; GetBuild serves a record of @16, which rendered it at its load
    trust (bare), as @16 sent it."""

    def with_skill(trust: int) -> pb.PlanSpec:
        planned = spec()
        planned.skills.append(
            pb.SkillCatalogEntry(name="vendor", description="Vendor.", version="1", trust=trust)
        )
        return planned

    session_id = new_id()
    trusted = with_skill(pb.TRUST_LEVEL_TRUSTED_CONFIGURATION)
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=trusted))
    started = await start_run(stub, session_id, "hello")
    await stub.LoadSkill(
        pb.LoadSkillRequest(
            tenant_id=TENANT, session_id=session_id, name="vendor", body="Pay on receipt."
        )
    )
    await stub.Rotate(
        pb.RotateRequest(
            tenant_id=TENANT,
            session_id=session_id,
            from_epoch=1,
            reason=pb.PLAN_REASON_OPERATOR_REVOCATION,
            spec=with_skill(pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED),
        )
    )
    built = await stub.Build(build_request(session_id, started.run.run_id))
    bare = b'"text":"Skill vendor (1) loaded:\\nPay on receipt."'
    assert bare not in built.provider_payload  # enveloped now
    assert await _get(stub, session_id, built.request_sequence) == built
    as_sent = await _rebuilt(pool, session_id, started.run.run_id, built, entry_skill_trust=False)
    assert bare in as_sent.rendered.body
    await _served_as(stub, pool, session_id, built, as_sent, "context-assembler@16")


# --- the model's cache-marker budget (the registry's max_cache_breakpoints) -------------


async def _server_with_budget(pool: Any, budget: int) -> tuple[Any, Any, Any]:
    """A replica whose registry overlay lets the Anthropic model `claude-budget` send at
    most `budget` cache markers. -> (stub, channel, running server)."""
    return await replica_with_model(pool, "claude-budget", max_cache_breakpoints=budget)


async def test_a_smaller_breakpoint_budget_sends_fewer_markers_and_replays_them(
    pool: Any,
) -> None:
    """The spec: "a four-breakpoint provider sends all four and a smaller budget drops the
    run marker first"; the registry states each model's budget. The budget a payload was
    rendered with is recorded, so GetBuild returns the bytes sent even after an overlay
    changes the model's budget (a later Build renders under the new one)."""
    two, two_channel, two_server = await _server_with_budget(pool, 2)
    four, four_channel, four_server = await _server_with_budget(pool, 4)
    try:
        session_id, _ = await open_session(two, model_id="claude-budget")
        first = await start_run(two, session_id, "Find a train.")
        await two.AppendItems(
            pb.AppendItemsRequest(
                tenant_id=TENANT,
                session_id=session_id,
                run_id=first.run.run_id,
                expected_checkpoint_version=1,
                items=[pb.ConversationItem(assistant_message=pb.AssistantMessage(text="Sure."))],
            )
        )
        second = await start_run(two, session_id, "And back.")
        request = pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=second.run.run_id)
        built = await two.Build(request)
        wide = await four.Build(request)  # the same run under a four-marker budget
        assert wide.provider_payload.count(b'"cache_control"') == 3  # no run marker yet
        assert built.provider_payload.count(b'"cache_control"') == 2
        # The two kept are the prefix's: the history marker drops first.
        body = json.loads(built.provider_payload)
        assert "cache_control" in body["tools"][-1] and "cache_control" in body["system"][-1]
        assert b'"cache_control"' not in json.dumps(body["messages"]).encode()
        assert built.request_sha256 == wide.request_sha256  # one neutral request
        for replica in (two, four):
            again = await _get(replica, session_id, built.request_sequence)
            assert again.provider_payload == built.provider_payload
    finally:
        for channel, server in ((two_channel, two_server), (four_channel, four_server)):
            await channel.close()
            await server.stop(0)


# --- records of an older assembler (core/build_record.py, Rule 8) -----------------------

# The keys a record of context-assembler@1 lacks (the last release before they were added).
_NEWER_KEYS = (ASSEMBLER_KEY, PAYLOAD_KEY, IMAGE_KEY, INLINE_KEY)


async def _rewrite_record(
    pool: Any, session_id: str, sequence: int, change: Any, *, older_than_13: Any = None
) -> None:
    """Rewrite a model.request.started record in place (`change` maps its payload to the
    new one): a record as an older builder wrote it, without needing that builder. With
    `older_than_13` (an Engine), its figures are set to those of a rebuild that counts no
    renderer's fixed text, as context-assembler@12 and older counted (core/body_estimate.py
    Rule 6): GetBuild serves the record only if it reads the rewritten version as one of
    those (tests/unit/test_fixed_texts.py checks that counting against @12's own figures)."""
    async with pool.acquire() as conn:
        where = "WHERE session_id = $1 AND sequence = $2"
        payload = await conn.fetchval(
            f"SELECT payload FROM session_events {where}", UUID(session_id), sequence
        )
        changed = change(dict(payload))
        if older_than_13 is not None:
            rebuilt = await rebuild(older_than_13, TENANT, UUID(session_id), changed, counted=False)
            changed = {**changed, **estimate_to_record(rebuilt.assembled)}
        await conn.execute(
            f"UPDATE session_events SET payload = $3 {where}", UUID(session_id), sequence, changed
        )


def _as_legacy(payload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if k not in _NEWER_KEYS}


def _as_older(request: pb.ModelRequest) -> pb.ModelRequest:
    """`request` as context-assembler@7 and older made it: its cache markers name their
    items by id alone (no through_sequence), and a run marker naming the carried marker's
    id was left out (one marker was kept for the id)."""
    older = pb.ModelRequest()
    older.CopyFrom(request)
    del older.cache_breakpoints[:]
    carried = ""
    for marker in request.cache_breakpoints:
        if marker.name == "carried_history":
            carried = marker.through_item
        elif marker.name == "run" and marker.through_item == carried:
            continue
        kept = older.cache_breakpoints.add()
        kept.CopyFrom(marker)
        kept.through_sequence = 0
    return older


def _hashed_whole(request: pb.ModelRequest) -> str:
    """request_sha256 as context-assembler@6 and older recorded it: the canonical request
    (as they made it, `_as_older`) hashed whole (core/request.py canonical_sha256), not in
    parts."""
    return sha256_hex(request_from_proto(_as_older(request)).canonical_bytes())


def _as_recorded_by_legacy(built: pb.BuildResponse) -> Any:
    """A record of `built` as context-assembler@1 wrote it: without the newer keys, and
    its request hash the whole request's."""
    whole = _hashed_whole(built.request)
    return lambda payload: {**_as_legacy(payload), "request_sha256": whole}


async def _failed_result_build(
    stub: Any, model_id: str, *, revoke_tools: bool = False
) -> tuple[str, pb.BuildResponse]:
    """A run whose tool call failed, built; `revoke_tools` rotates the roster empty first
    (an Anthropic request then sends its tool pairs as text)."""
    session_id, _ = await open_session(stub, model_id=model_id)
    started = await start_run(stub, session_id, "Which trains go to Lyon?")
    failed = pb.ConversationItem(
        tool_result=pb.ToolResult(
            call_id="c1", tool_name="web.fetch", content="HTTP 503", trust=6, is_error=True
        )
    )
    await stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=started.run.run_id,
            expected_checkpoint_version=started.checkpoint_version,
            items=[call("c1"), failed],
        )
    )
    if revoke_tools:
        bare = spec(model_id=model_id)
        del bare.tools[:]
        await stub.Rotate(
            pb.RotateRequest(
                tenant_id=TENANT,
                session_id=session_id,
                from_epoch=1,
                reason=pb.PLAN_REASON_OPERATOR_REVOCATION,
                spec=bare,
            )
        )
    built = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=started.run.run_id)
    )
    return session_id, built


async def _recorded(pool: Any, session_id: str, sequence: int) -> dict[str, Any]:
    async with pool.acquire() as conn:
        payload: dict[str, Any] = await conn.fetchval(
            "SELECT payload FROM session_events WHERE session_id = $1 AND sequence = $2",
            UUID(session_id),
            sequence,
        )
    return payload


async def test_a_build_records_its_assembler_and_payload_hash(stub: Any, pool: Any) -> None:
    """Every record names the assembler that built it and the SHA-256 of the payload sent,
    beside the figures it was cut with, so GetBuild can tell a record it still rebuilds
    from one it does not."""
    session_id, built = await _failed_result_build(stub, "gpt-5")
    payload = await _recorded(pool, session_id, built.request_sequence)
    assert payload[ASSEMBLER_KEY] == ASSEMBLER_VERSION == "context-assembler@29"
    assert payload[PAYLOAD_KEY] == hashlib.sha256(built.provider_payload).hexdigest()
    assert isinstance(payload[IMAGE_KEY], int) and isinstance(payload[INLINE_KEY], int)
    assert TOOL_ERROR_AS_TEXT.encode() in built.provider_payload
    assert await _get(stub, session_id, built.request_sequence) == built


async def test_get_build_of_a_record_hashed_whole_answers_with_its_recorded_hash(
    stub: Any, pool: Any, grpc_server: Any
) -> None:
    """context-assembler@7 hashes a request in parts (core/request.py
    Rule 1); @6 recorded the canonical request hashed whole. The bytes are the same, so
    GetBuild of an @6 record rebuilds them, checks them by the hash @6 recorded and
    answers with that hash; an @7 record is checked and answered by the new one."""
    session_id, built = await _failed_result_build(stub, "gpt-5")
    whole = _hashed_whole(built.request)
    assert whole != built.request_sha256
    await _rewrite_record(
        pool,
        session_id,
        built.request_sequence,
        lambda p: {**p, ASSEMBLER_KEY: "context-assembler@6", "request_sha256": whole},
        older_than_13=grpc_server.engine,
    )
    again = await _get(stub, session_id, built.request_sequence)
    assert again.request_sha256 == whole
    # The request as @6 made it: its markers without the sequences @8 names.
    assert any(marker.through_sequence for marker in built.request.cache_breakpoints)
    assert (again.request, again.provider_payload) == (
        _as_older(built.request),
        built.provider_payload,
    )
    # Recorded under this assembler with the whole hash, it is not the request it sent.
    await _rewrite_record(
        pool, session_id, built.request_sequence, lambda p: {**p, ASSEMBLER_KEY: ASSEMBLER_VERSION}
    )
    _, metadata = await _refusal(stub, session_id, built.request_sequence)
    assert metadata["recorded_assembler_version"] == ASSEMBLER_VERSION


def _marked(payload: bytes) -> list[str]:
    """The blocks of an Anthropic payload's messages that carry cache_control: each by the
    text the model reads in it (a tool result's content, a text block's text)."""
    blocks = [b for m in json.loads(payload)["messages"] for b in m["content"]]
    return [b.get("content", b.get("text", "")) for b in blocks if "cache_control" in b]


def _numbered(item: pb.ConversationItem, item_id: str) -> pb.ConversationItem:
    item.item_id = item_id
    return item


# The first run ends with its answer, or with its tool result: in both the second run
# numbers its call and result as the first did. (blocks marked under context-assembler@8,
# blocks marked as @7 and older sent it): @7 put the run marker on the first block of its
# id (the first run's result), and left it out when it named the carried marker's id.
_REUSED = {
    "answered": (["The TGV 6601 at 07:00.", "TGV 6602"], ["TGV 6601", "The TGV 6601 at 07:00."]),
    "unanswered": (["TGV 6601", "TGV 6602"], ["TGV 6601"]),
}


@pytest.mark.parametrize("first_run", list(_REUSED))
@pytest.mark.parametrize("assembler", ["context-assembler@7", "context-assembler@6"])
async def test_runs_that_reuse_item_ids_get_markers_on_their_own_items(
    stub: Any, pool: Any, grpc_server: Any, first_run: str, assembler: str
) -> None:
    """Item ids are unique within a run only. A worker that numbers each run's items alike
    gets its history markers on the items they close, the carried history's last and the
    building run's last result, each named with its session sequence. GetBuild of such a
    record of @7 or older (request hashed in parts from @7, whole before) serves what that
    assembler sent."""
    session_id, _ = await open_session(stub, model_id="claude-sonnet-4-5")
    first = await start_run(stub, session_id, "Which trains go to Lyon?")
    items = [_numbered(call("c1"), "call-1"), _numbered(result("c1", "TGV 6601"), "result-1")]
    if first_run == "answered":
        items.append(_numbered(assistant("The TGV 6601 at 07:00."), "answer-1"))
    await append_items(stub, session_id, first.run.run_id, first.checkpoint_version, *items)
    second = await start_run(stub, session_id, "And back on Sunday?")
    items = [_numbered(call("c1"), "call-1"), _numbered(result("c1", "TGV 6602"), "result-1")]
    run_id, version = second.run.run_id, second.checkpoint_version
    appended = await append_items(stub, session_id, run_id, version, *items)
    built = await stub.Build(build_request(session_id, second.run.run_id))

    markers = {m.name: m for m in built.request.cache_breakpoints}
    assert (markers["run"].through_item, markers["run"].through_sequence) == (
        "result-1",
        appended.sequences[1],
    )
    closes = "answer-1" if first_run == "answered" else "result-1"
    assert markers["carried_history"].through_item == closes
    assert 0 < markers["carried_history"].through_sequence < appended.sequences[0]
    now, then = _REUSED[first_run]
    assert _marked_texts(built.provider_payload) == now

    older = _as_older(built.request)
    sent = render(request_from_proto(older)).body
    assert _marked_texts(sent) == then
    recorded = (
        _hashed_whole(built.request)
        if assembler == "context-assembler@6"
        else request_from_proto(older).request_sha256()
    )
    await _rewrite_record(
        pool,
        session_id,
        built.request_sequence,
        lambda p: {**p, ASSEMBLER_KEY: assembler, "request_sha256": recorded},
        older_than_13=grpc_server.engine,
    )
    await _rewrite_record(
        pool, session_id, built.request_sequence, lambda p: {**p, PAYLOAD_KEY: sha256_hex(sent)}
    )
    again = await _get(stub, session_id, built.request_sequence)
    assert (again.request, again.provider_payload, again.request_sha256) == (older, sent, recorded)


async def test_a_result_sent_as_its_excerpt_is_marked_and_an_older_record_rebuilds_unmarked(
    stub: Any, pool: Any, grpc_server: Any
) -> None:
    """A tool result sent as the pipeline's excerpt (context_content) is a truncation: its
    envelope is marked truncated="true", as the engine's own excerpts are; one whose
    excerpt is its content is not. GetBuild of a record of @8, which sent the excerpt
    unmarked, serves those bytes: the oracle is this build with the one mark removed."""
    session_id, _ = await open_session(stub, model_id="claude-sonnet-4-5")
    started = await start_run(stub, session_id, "Which trains go to Lyon?")
    excerpt = "TGV 6601 Paris-Lyon 07:00 (1 of 40 rows)"
    cut = result("c1", "TGV 6601 Paris-Lyon 07:00\n" + "TGV 66xx Paris-Lyon later\n" * 39)
    cut.tool_result.context_content = excerpt
    whole = result("c2", "TGV 6602 Lyon-Paris 18:04")
    whole.tool_result.context_content = "TGV 6602 Lyon-Paris 18:04"
    run_id, version = started.run.run_id, started.checkpoint_version
    await append_items(stub, session_id, run_id, version, call("c1"), cut, call("c2"), whole)
    built = await stub.Build(build_request(session_id, run_id))
    results = {
        b.tool_result.content.rsplit("\n", 2)[-2]: b.tool_result.content
        for m in built.request.messages
        for b in m.blocks
        if b.WhichOneof("kind") == "tool_result"
    }
    assert 'truncated="true"' in results[excerpt].split("\n", 1)[0]
    assert "truncated" not in results["TGV 6602 Lyon-Paris 18:04"]
    assert built.provider_payload.count(b'truncated=\\"true\\"') == 1

    older = pb.ModelRequest()
    older.CopyFrom(built.request)
    for message in older.messages:
        for block in message.blocks:
            if block.WhichOneof("kind") == "tool_result":
                block.tool_result.content = block.tool_result.content.replace(
                    ' truncated="true"', ""
                )
    sent = built.provider_payload.replace(b' truncated=\\"true\\"', b"")
    assert render(request_from_proto(older)).body == sent
    # The figures @8 recorded: the engine's rebuild of an older record (its estimate is a
    # few tokens short of this one's, the mark unsent), whose bytes are the oracle's.
    rebuilt = await grpc_server.engine.build(
        TENANT,
        UUID(session_id),
        UUID(run_id),
        built.checkpoint_version,
        datetime.fromtimestamp(1_790_000_000, UTC),
        StepContext(),
        record=False,
        marked_excerpts=False,
        fixed_texts=False,  # @8 counted no renderer's fixed text
    )
    assert rebuilt.rendered is not None and rebuilt.rendered.body == sent
    figures = estimate_to_record(rebuilt.assembled)
    recorded = request_from_proto(older).request_sha256()
    await _rewrite_record(
        pool,
        session_id,
        built.request_sequence,
        lambda p: {
            **p,
            **figures,
            ASSEMBLER_KEY: "context-assembler@8",
            "request_sha256": recorded,
            PAYLOAD_KEY: sha256_hex(sent),
        },
    )
    again = await _get(stub, session_id, built.request_sequence)
    assert (again.request, again.provider_payload, again.request_sha256) == (older, sent, recorded)


def _marked_texts(payload: bytes) -> list[str]:
    """Each marked block of `_marked` by the one fixture text it holds."""
    texts = ("The TGV 6601 at 07:00.", "TGV 6601", "TGV 6602")
    return [next(t for t in texts if t in block) for block in _marked(payload)]


# The failed-result line as it appears in a payload (canonical JSON escapes the newline).
_LINE = json.dumps(TOOL_ERROR_AS_TEXT + "\n")[1:-1].encode()


@pytest.mark.parametrize(
    ("model_id", "revoke_tools"), [("gpt-5", False), ("claude-sonnet-4-5", True)]
)
async def test_get_build_of_a_legacy_record_serves_failed_results_as_they_were_sent(
    stub: Any, pool: Any, grpc_server: Any, model_id: str, revoke_tools: bool
) -> None:
    """docs/api.md GetBuild: "the same bytes and hashes". context-assembler@1 sent a failed
    result to OpenAI, and to Anthropic without tools, without the "(The tool call failed.)"
    line, and its records name no assembler (request_sha256 covers the neutral request
    only, the same either way): GetBuild renders such a record as it was sent, rather than
    serve a payload the provider never received."""
    session_id, built = await _failed_result_build(stub, model_id, revoke_tools=revoke_tools)
    assert _LINE in built.provider_payload
    legacy = _as_recorded_by_legacy(built)
    await _rewrite_record(
        pool, session_id, built.request_sequence, legacy, older_than_13=grpc_server.engine
    )

    again = await _get(stub, session_id, built.request_sequence)
    # The hash it recorded (the neutral request's: the same either way), not today's.
    assert again.request_sha256 == _hashed_whole(built.request) != built.request_sha256
    # Without tools, its text form named no call ids either (@11 names them).
    sent = built.provider_payload.replace(_LINE, b"")
    assert again.provider_payload == (_without_call_ids(sent) if revoke_tools else sent)


def _without_call_ids(payload: bytes) -> bytes:
    """An Anthropic no-tools payload of _failed_result_build as context-assembler@10 and
    older sent it: its call and result naming no call id."""
    call = json.dumps(" as call c1)")[1:-1].encode()  # as the JSON string holds it
    result = json.dumps("(Result of call c1)\n")[1:-1].encode()
    assert call in payload and result in payload
    return payload.replace(call, b")").replace(result, b"")


async def test_get_build_of_an_assembler_10_record_serves_its_text_form_as_it_was_sent(
    stub: Any, pool: Any, grpc_server: Any
) -> None:
    """context-assembler@11 names each pair's call id in Anthropic's no-tools text form;
    @10 named none. The neutral request is the same, so GetBuild of an @10 record renders
    the text form as @10 did and serves the bytes its payload hash recorded; an @11
    record of the same request is served as built."""
    session_id, built = await _failed_result_build(stub, "claude-sonnet-4-5", revoke_tools=True)
    assert json.dumps("(Result of call c1)")[1:-1].encode() in built.provider_payload
    assert await _get(stub, session_id, built.request_sequence) == built
    older = _without_call_ids(built.provider_payload)
    await _rewrite_record(
        pool,
        session_id,
        built.request_sequence,
        lambda p: {
            **p,
            ASSEMBLER_KEY: "context-assembler@10",
            PAYLOAD_KEY: hashlib.sha256(older).hexdigest(),
        },
        older_than_13=grpc_server.engine,
    )
    again = await _get(stub, session_id, built.request_sequence)
    assert (again.request_sha256, again.provider_payload) == (built.request_sha256, older)


def _as_the_users(built: pb.BuildResponse, item_id: str) -> tuple[str, bytes]:
    """(request_sha256, provider payload) of `built` as context-assembler@2 sent it: the
    child's message `item_id` as the user's words, USER in a <user> envelope, not its
    parent's (MODEL, <delegated>). The nonce is the item's either way."""
    request = pb.ModelRequest()
    request.CopyFrom(built.request)
    payload = built.provider_payload
    for block in (b for m in request.messages for b in m.blocks if b.item_id == item_id):
        nonce = block.text.rsplit(":", 1)[1][:-1]
        users = block.text.replace(
            '<delegated source="parent agent"', '<user source="user"', 1
        ).replace(f"</delegated:{nonce}>", f"</user:{nonce}>")
        payload = payload.replace(json.dumps(block.text).encode(), json.dumps(users).encode())
        block.trust, block.text = pb.TRUST_LEVEL_USER, users
    return _hashed_whole(request), payload


@pytest.mark.parametrize("assembler", ["context-assembler@2", LEGACY_ASSEMBLER_VERSION])
async def test_get_build_of_an_older_child_record_serves_its_instruction_as_it_was_sent(
    stub: Any, pool: Any, assembler: str
) -> None:
    """Up to context-assembler@2 a child run's instruction went out as the user's words
    (<user>, USER); @3 sends it as its parent's (<delegated>, MODEL). The checkpoint holds
    the instruction as it always did, so GetBuild of an older record renders it as that
    assembler did, and serves what the provider was sent then, not today's bytes."""
    session_id, _ = await open_session(stub)
    parent = (await start_run(stub, session_id, "Plan the trip")).run.run_id
    child = (await start_child(stub, session_id, parent, "Find a train to Lyon.")).run.run_id
    await stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=child,
            expected_checkpoint_version=1,
            items=[call("c1"), result("c1", "TGV 6601")],
        )
    )
    built = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=child, step=STEP)
    )
    assert b"<delegated source=" in built.provider_payload
    assert await _get(stub, session_id, built.request_sequence) == built

    request_sha256, payload = _as_the_users(built, f"instruction:{child}")
    assert b'<delegated source=\\"parent' not in payload
    assert request_sha256 != built.request_sha256

    # The figures an older assembler recorded are those of the request it sent (Rule 9):
    # the same Build with the instruction read as the user's.
    async with pool.acquire() as conn:
        recorded = await conn.fetchval(
            "SELECT payload FROM session_events WHERE session_id = $1 AND sequence = $2",
            UUID(session_id),
            built.request_sequence,
        )
    now, step = inputs_from_record(recorded)
    as_sent = await build_engine(pool).build(
        TENANT,
        UUID(session_id),
        UUID(child),
        built.checkpoint_version,
        now,
        step,
        record=False,
        delegated_messages=False,
        marker_sequences=False,
        fixed_texts=False,
    )
    assert as_sent.assembled.request is not None
    assert as_sent.assembled.request.canonical_sha256() == request_sha256
    figures = estimate_to_record(as_sent.assembled)

    def older(record: dict[str, Any]) -> dict[str, Any]:
        sent = {**record, **figures, "request_sha256": request_sha256}
        if assembler == LEGACY_ASSEMBLER_VERSION:
            return _as_legacy(sent)  # no payload hash: the request hash alone is checked
        return {**sent, ASSEMBLER_KEY: assembler, PAYLOAD_KEY: sha256_hex(payload)}

    await _rewrite_record(pool, session_id, built.request_sequence, older)
    again = await _get(stub, session_id, built.request_sequence)
    assert (again.request_sha256, again.provider_payload) == (request_sha256, payload)
    sent = [b for m in again.request.messages for b in m.blocks if b.item_id.startswith("instr")]
    assert [(b.row, b.trust) for b in sent] == [(pb.ROW_CONVERSATION, pb.TRUST_LEVEL_USER)]
    assert sent[0].text.startswith('<user source="user"')


async def _refusal(stub: Any, session_id: str, sequence: int) -> tuple[str, dict[str, str]]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _get(stub, session_id, sequence)
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
    reason, fields, metadata = details(caught.value)
    assert reason == "REQUEST_NOT_FOUND" and fields == ["request_sequence"]
    return caught.value.details() or "", metadata


async def test_get_build_refuses_a_record_that_does_not_rebuild_naming_both_assemblers(
    stub: Any, pool: Any
) -> None:
    """A record an older assembler built may not rebuild: a later estimator, image figure
    or yield order cuts it otherwise (an old record then failed INTERNAL "does not rebuild
    to its recorded bytes"), or the current one refuses it. That is the record's state,
    not a server fault: FAILED_PRECONDITION REQUEST_NOT_FOUND naming the recorded and the
    current assembler, and never other bytes. The payload hash is checked too where the
    record holds one (the request hash covers the neutral request only)."""
    session_id, built = await _failed_result_build(stub, "claude-sonnet-4-5")
    sequence = built.request_sequence

    # As if @1 had cut it otherwise: its recorded hash is not the rebuild's.
    await _rewrite_record(
        pool, session_id, sequence, lambda p: {**_as_legacy(p), "request_sha256": "0" * 64}
    )
    message, metadata = await _refusal(stub, session_id, sequence)
    assert metadata == {
        "recorded_assembler_version": LEGACY_ASSEMBLER_VERSION,
        "assembler_version": ASSEMBLER_VERSION,
    }
    assert LEGACY_ASSEMBLER_VERSION in message and ASSEMBLER_VERSION in message

    # A current record whose payload was sent otherwise than it renders now.
    await _rewrite_record(
        pool,
        session_id,
        sequence,
        lambda p: {
            **p,
            "request_sha256": built.request_sha256,
            ASSEMBLER_KEY: ASSEMBLER_VERSION,
            PAYLOAD_KEY: "f" * 64,
        },
    )
    _, metadata = await _refusal(stub, session_id, sequence)
    assert metadata["recorded_assembler_version"] == ASSEMBLER_VERSION

    # What the current assembler refuses to build (here: a never-yield correction line
    # too large for the body) is not rebuilt either, and not answered BUDGET_EXCEEDED.
    def oversized(payload: dict[str, Any]) -> dict[str, Any]:
        inputs = payload[INPUTS_KEY]
        line = {"item_id": "memory:c1", "text": "Ana moved. " * 120_000, "person_ids": []}
        step = {**inputs["step"], "corrections": [line]}
        return {**_as_legacy(payload), INPUTS_KEY: {**inputs, "step": step}}

    await _rewrite_record(pool, session_id, sequence, oversized)
    message, _ = await _refusal(stub, session_id, sequence)
    assert "BUDGET_EXCEEDED" in message


async def test_get_build_refuses_a_record_another_token_counter_counted(
    stub: Any, pool: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/operations.md, Not kept: a replica whose tiktoken rank file is missing counts
    with the heuristic (as after a models_file tokenizer change). It rebuilds a short
    request to the same bytes, but not to the estimate, budget and pressure figures it was
    sent with: refused, naming both tokenizers, never answered with other figures. A record
    from before the tokenizer was recorded is refused on its figures. The replica that
    counts as it was counted still serves it."""
    session_id, _ = await open_session(stub, model_id="gpt-4o")
    run_id = (await start_run(stub, session_id, "hello " * 50)).run.run_id
    built = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id)
    )
    sequence = built.request_sequence
    assert (await _recorded(pool, session_id, sequence))[TOKENIZER_KEY] == "o200k_base"
    heuristic, channel, running = await replica(pool)
    try:
        message, metadata = await _refusal(heuristic, session_id, sequence)
        assert metadata == {
            "recorded_assembler_version": ASSEMBLER_VERSION,
            "assembler_version": ASSEMBLER_VERSION,
            "recorded_tokenizer": "o200k_base",
            "tokenizer": "heuristic",
        }
        assert "o200k_base" in message and "heuristic" in message
        # explain names it in one line, with the metadata.
        assert await _explain(running.port, session_id, str(sequence), str(sequence)) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("context-engine explain: GetBuild failed: FAILED_PRECONDITION: ")
        assert line.endswith(
            f" [REQUEST_NOT_FOUND assembler_version={ASSEMBLER_VERSION}"
            f" recorded_assembler_version={ASSEMBLER_VERSION}"
            " recorded_tokenizer=o200k_base tokenizer=heuristic]"
        ), line

        await _rewrite_record(
            pool, session_id, sequence, lambda p: {k: v for k, v in p.items() if k != TOKENIZER_KEY}
        )
        message, metadata = await _refusal(heuristic, session_id, sequence)
        assert "estimated_input_tokens differs" in message and "tokenizer" not in metadata
        assert await _get(stub, session_id, sequence) == built
    finally:
        await channel.close()
        await running.stop(0)


async def test_a_record_another_tokenizer_cuts_otherwise_is_refused_naming_both(
    stub: Any, pool: Any
) -> None:
    """Counted with the heuristic, a long history is cut elsewhere, so the rebuild's bytes
    differ: the refusal said only "the rebuild differs", naming two equal assembler
    versions, and nothing pointed at the tokenizer (an audit). It names both."""
    plan_spec = spec(model_id="gpt-4")
    plan_spec.reserve_output_tokens = 1024
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=plan_spec))
    for n in range(6):
        run = await start_run(stub, session_id, f"q{n} " + "lorem ipsum " * 200)
        await append_items(
            stub, session_id, run.run.run_id, run.checkpoint_version, assistant("answer " * 300)
        )
    run_id = (await start_run(stub, session_id, "final")).run.run_id
    built = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id)
    )
    assert (await _recorded(pool, session_id, built.request_sequence))[TOKENIZER_KEY] == (
        "cl100k_base"
    )
    heuristic, channel, running = await replica(pool)
    try:
        message, metadata = await _refusal(heuristic, session_id, built.request_sequence)
    finally:
        await channel.close()
        await running.stop(0)
    assert metadata["recorded_tokenizer"] == "cl100k_base"
    assert metadata["tokenizer"] == "heuristic"
    assert "counted with cl100k_base and this server counts with heuristic" in message
    assert "the rebuild differs from the recorded bytes" in message


def _working_state(request: pb.ModelRequest) -> str:
    blocks = [b.text for m in request.messages for b in m.blocks if b.item_id == "working-state"]
    assert len(blocks) == 1
    return str(blocks[0])


async def test_the_working_state_names_its_writers_and_an_assembler_11_record_is_served_as_sent(
    stub: Any, pool: Any
) -> None:
    """context-assembler@12: a fact's line names its writer (a fact the model concluded
    from the user's words is established, and says the model concluded it) and a question
    the runtime added says it is the model's conversation.ask_user text; @11 named
    neither. GetBuild of an @11 record renders the block as @11 did and serves the request
    and payload it recorded."""
    session_id, _ = await open_session(stub)
    started = (await start_run(stub, session_id, "Trains to Lyon on Friday?")).run
    run_id, seed = started.run_id, started.seed_event_sequence
    fact = pb.Fact(statement="The user travels on Friday.", source_event_ids=[seed])
    updated = await update_state(stub, session_id, run_id, 1, add_facts=[fact])
    ask = pb.ConversationItem(
        tool_call=pb.ToolCall(
            call_id="ask1",
            tool_name="conversation.ask_user",
            arguments_json=json.dumps({"question": "First or second class?"}),
        )
    )
    unanswered = pb.ConversationItem(  # an error is no answer: the question stays open
        tool_result=pb.ToolResult(
            call_id="ask1",
            tool_name="conversation.ask_user",
            content="no answer",
            trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION,
            is_error=True,
        )
    )
    await append_items(stub, session_id, run_id, updated.checkpoint_version, ask, unanswered)
    built = await stub.Build(build_request(session_id, run_id))
    block = _working_state(built.request)
    established = rf"^- \[model #\d+\] Established \(events #{seed}\): The user travels"
    assert re.search(established, block, re.M)
    asked = r"^- \[runtime #\d+\] the model asked: First or second"
    assert re.search(asked, block, re.M)
    assert await _get(stub, session_id, built.request_sequence) == built

    as_sent = await _rebuilt(
        pool, session_id, run_id, built, named_writers=False, fixed_texts=False
    )
    assert as_sent.assembled.request is not None and as_sent.rendered is not None
    older_block = _working_state(request_to_proto(as_sent.assembled.request))
    assert f"\n- Established (events #{seed}): The user travels" in older_block
    assert "\n- [runtime #" in older_block and "the model asked" not in older_block
    await _served_as(stub, pool, session_id, built, as_sent, "context-assembler@11")


async def test_a_wide_turn_carries_a_bridge_and_an_assembler_14_record_is_served_without(
    stub: Any, pool: Any
) -> None:
    """core/cache_hints.py Rule 8: a step whose latest turn spans more than the provider's
    lookback carries a bridge marker where the previous step's run marker was, in
    after_tools' place (context-assembler@15). GetBuild serves it as sent, and serves a
    record of @14, which sent no bridge, with its markers as @14 made them."""
    session_id, _ = await open_session(stub, model_id="claude-sonnet-4-5")
    earlier = await start_run(stub, session_id, "Hello.")
    await append_items(
        stub, session_id, earlier.run.run_id, earlier.checkpoint_version, assistant("Hi.")
    )
    started = await start_run(stub, session_id, "Fetch these twelve pages.")
    run_id, version = started.run.run_id, started.checkpoint_version
    for step in range(2):
        calls = [call(f"s{step}c{n}") for n in range(12)]
        results = [result(f"s{step}c{n}", f"page {step}.{n}") for n in range(12)]
        appended = await append_items(
            stub, session_id, run_id, version, assistant(f"step {step}"), *calls, *results
        )
        version = appended.checkpoint_version
    built = await stub.Build(build_request(session_id, run_id))
    names = [m.name for m in built.request.cache_breakpoints]
    assert "bridge" in names and "after_tools" not in names
    again = await _get(stub, session_id, built.request_sequence)
    assert (again.request, again.provider_payload) == (built.request, built.provider_payload)

    older = request_to_proto(unbridged(request_from_proto(built.request)))
    assert [m.name for m in older.cache_breakpoints] == [
        "after_system",
        "after_tools",
        "carried_history",
        "run",
    ]
    sent = render(request_from_proto(older)).body
    recorded = request_from_proto(older).request_sha256()
    await _rewrite_record(
        pool,
        session_id,
        built.request_sequence,
        lambda p: {
            **p,
            ASSEMBLER_KEY: "context-assembler@14",
            "request_sha256": recorded,
            PAYLOAD_KEY: sha256_hex(sent),
        },
    )
    served = await _get(stub, session_id, built.request_sequence)
    assert (served.request, served.provider_payload, served.request_sha256) == (
        older,
        sent,
        recorded,
    )


async def test_a_bare_passage_is_cited_and_an_assembler_15_record_is_served_without(
    stub: Any, pool: Any
) -> None:
    """A bare knowledge passage (TRUSTED_CONFIGURATION) leads with its citation
    (context-assembler@16); GetBuild serves it as sent, and serves a record of @15, which
    sent the passage's text alone, as @15 sent it: the oracle is this Build's inputs
    rebuilt without bare passages' citations."""
    session_id, _ = await open_session(stub, model_id="claude-sonnet-4-5")
    started = await start_run(stub, session_id, "How long do refunds take?")
    passage = pb.KnowledgePassage(
        item_id="k1",
        text="Refunds take 5 days.",
        citation="handbook.pdf p3",
        trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION,
    )
    built = await stub.Build(
        pb.BuildRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=started.run.run_id,
            step=pb.StepContext(knowledge=[passage]),
        )
    )
    assert b"[handbook.pdf p3] Refunds take 5 days." in built.provider_payload
    assert await _get(stub, session_id, built.request_sequence) == built

    as_sent = await _rebuilt(pool, session_id, started.run.run_id, built, cited_passages=False)
    assert as_sent.assembled.request is not None and as_sent.rendered is not None
    payload = as_sent.rendered.body
    assert b"Refunds take 5 days." in payload and b"handbook.pdf" not in payload

    await _served_as(stub, pool, session_id, built, as_sent, "context-assembler@15")


async def _rebuilt(
    pool: Any, session_id: str, run_id: str, built: pb.BuildResponse, **older: bool
) -> Any:
    """The engine's rebuild of `built` from its recorded inputs, as an older assembler
    built it (`older`: Engine.build's flags), unrecorded."""
    recorded = await _recorded(pool, session_id, built.request_sequence)
    now, step = inputs_from_record(recorded)
    return await build_engine(pool).build(
        TENANT,
        UUID(session_id),
        UUID(run_id),
        built.checkpoint_version,
        now,
        step,
        record=False,
        **older,
    )


async def _served_as(
    stub: Any, pool: Any, session_id: str, built: pb.BuildResponse, as_sent: Any, version: str
) -> None:
    """Rewrite `built`'s record as `version` recorded what `as_sent` (the engine's rebuild
    as that version built it) sent; GetBuild then serves those bytes, not `built`'s."""
    payload = as_sent.rendered.body

    def older(record: dict[str, Any]) -> dict[str, Any]:
        return {
            **record,
            **estimate_to_record(as_sent.assembled),
            "request_sha256": as_sent.assembled.request_sha256,
            ASSEMBLER_KEY: version,
            PAYLOAD_KEY: sha256_hex(payload),
        }

    await _rewrite_record(pool, session_id, built.request_sequence, older)
    again = await _get(stub, session_id, built.request_sequence)
    assert (again.request_sha256, again.provider_payload) == (
        as_sent.assembled.request_sha256,
        payload,
    )
    assert again.request_sha256 != built.request_sha256


@pytest.mark.parametrize(
    ("change", "names"),
    [
        # A recall line with a field the current model forbids (a rollback's).
        (
            lambda p: {
                **p,
                INPUTS_KEY: {
                    **p[INPUTS_KEY],
                    "step": {
                        **p[INPUTS_KEY]["step"],
                        "recall": [{**p[INPUTS_KEY]["step"]["recall"][0], "score": 0.5}],
                    },
                },
            },
            "step.recall of its recorded build inputs cannot be read back",
        ),
        (
            lambda p: {**p, INPUTS_KEY: {**p[INPUTS_KEY], "now": "yesterday"}},
            "now of its recorded build inputs cannot be read back",
        ),
        (
            lambda p: {**p, INPUTS_KEY: {"step": p[INPUTS_KEY]["step"]}},
            "now of its recorded build inputs cannot be read back",
        ),
        (
            lambda p: {k: v for k, v in p.items() if k != "checkpoint_version"},
            "recorded without the run, version or epoch it was built at",
        ),
    ],
)
async def test_a_record_this_build_cannot_read_back_is_not_found_not_internal(
    stub: Any, pool: Any, change: Any, names: str
) -> None:
    """Recorded inputs this build cannot parse failed INTERNAL "internal error" (an audit);
    docs/api.md promises FAILED_PRECONDITION REQUEST_NOT_FOUND for a record this build
    cannot read back, and the message says where."""
    session_id, _ = await open_session(stub)
    run_id = (await start_run(stub, session_id, "Trains?")).run.run_id
    built = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id, step=STEP)
    )
    await _rewrite_record(pool, session_id, built.request_sequence, change)
    message, _ = await _refusal(stub, session_id, built.request_sequence)
    assert names in message, message


@pytest.mark.parametrize("held_in", ["recall", "snapshot"])
async def test_an_erasure_committing_during_the_rebuild_is_not_served(
    stub: Any, monkeypatch: pytest.MonkeyPatch, held_in: str
) -> None:
    """GetBuild read the record's redacted flag before rebuilding: an erasure committing
    in between left the rebuild on the lines it had read, which still matched the recorded
    hash, and the erased person's line was served after EraseSubject returned (an audit).
    The erasure is made to commit inside the rebuild here, of a person named by a recall
    line of the record or by a memory of the plan's snapshot."""
    from context_engine.api import rpc_builds

    person = f"carol-{new_id()}"
    secret = [pb.RecallLine(item_id="r1", text="CAROL_SECRET is vegan.", person_ids=[person])]
    memory = pb.MemorySnapshot(
        snapshot_id="snap-1",
        items=[
            pb.MemoryItem(item_id="m1", text="CAROL_SECRET lives in Lyon.", person_ids=[person])
        ],
    )
    if held_in == "snapshot":
        session_id, _ = await open_session(stub, snapshot=memory)
        step = pb.StepContext()
    else:
        session_id, _ = await open_session(stub)
        step = pb.StepContext(recall=secret)
    run_id = (await start_run(stub, session_id, "Who?")).run.run_id
    built = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id, step=step)
    )
    real = rpc_builds.rebuild

    async def erased_meanwhile(*args: Any, **kwargs: Any) -> Any:
        rebuilt = await real(*args, **kwargs)
        erased = await stub.EraseSubject(pb.EraseSubjectRequest(tenant_id=TENANT, person_id=person))
        assert erased.redacted_requests + len(erased.invalidated_session_ids) >= 1
        return rebuilt

    monkeypatch.setattr(rpc_builds, "rebuild", erased_meanwhile)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _get(stub, session_id, built.request_sequence)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert details(refused.value)[0] == "REQUEST_REDACTED"
    assert "CAROL_SECRET" not in (refused.value.details() or "")


async def test_a_record_not_rebuilt_whose_skipped_memory_was_erased_is_not_redacted(
    stub: Any, pool: Any
) -> None:
    """A record this assembler does not reproduce, on a plan an erasure invalidated for a
    memory the snapshot's cap had skipped: the bytes sent never held it. It was answered
    REQUEST_REDACTED ("held the erased memories", "ask again"), losing the assembler
    versions REQUEST_NOT_FOUND names (an audit)."""
    person = f"pia-{new_id()}"
    snapshot = pb.MemorySnapshot(
        snapshot_id="snap",
        items=[
            pb.MemoryItem(item_id="m1", text="The office is in Lyon."),
            pb.MemoryItem(item_id="big", text="PIA_DETAIL " * 1400, person_ids=[person]),
        ],
    )
    session_id, plan = await open_session(stub, snapshot=snapshot)
    assert b"PIA_DETAIL" not in plan.prefix_document  # left out by the snapshot's cap
    run_id = (await start_run(stub, session_id, "Where is the office?")).run.run_id
    built = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id)
    )
    # As a record an earlier assembler built looks to this one: its hash is not ours (its
    # first digit changed: one that was "f" already made this test pass by chance).
    await pool.execute(
        "UPDATE session_events SET payload = payload || jsonb_build_object('request_sha256',"
        " CASE WHEN left(payload ->> 'request_sha256', 1) = '0' THEN '1' ELSE '0' END"
        " || substr(payload ->> 'request_sha256', 2))"
        " WHERE session_id = $1 AND sequence = $2",
        UUID(session_id),
        built.request_sequence,
    )
    await stub.EraseSubject(pb.EraseSubjectRequest(tenant_id=TENANT, person_id=person))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _get(stub, session_id, built.request_sequence)
    reason, fields, metadata = details(refused.value)
    assert (reason, fields) == ("REQUEST_NOT_FOUND", ["request_sequence"])
    assert "assembler_version" in metadata and "recorded_assembler_version" in metadata


async def test_a_request_that_never_held_the_erased_memory_is_still_served(stub: Any) -> None:
    """docs/security.md: a request built on a plan whose snapshot an erasure redacted, but
    which never rendered the erased memory (the snapshot's cap left it out), still rebuilds
    to its recorded bytes and is served. Every request of the epoch was refused instead,
    with a message saying it held the erased memories (an audit). One that did hold them
    is refused."""
    person = f"ana-{new_id()}"
    snapshot = pb.MemorySnapshot(
        snapshot_id="snap",
        items=[
            pb.MemoryItem(item_id="m1", text="The office is in Lyon."),
            pb.MemoryItem(item_id="big", text="ANA_DETAIL " * 1400, person_ids=[person]),
        ],
    )
    session_id, plan = await open_session(stub, snapshot=snapshot)
    assert b"ANA_DETAIL" not in plan.prefix_document  # left out by the snapshot's cap
    run_id = (await start_run(stub, session_id, "Where is the office?")).run.run_id
    built = await stub.Build(
        pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id)
    )
    erased = await stub.EraseSubject(pb.EraseSubjectRequest(tenant_id=TENANT, person_id=person))
    assert list(erased.invalidated_session_ids) == [session_id]
    served = await _get(stub, session_id, built.request_sequence)
    assert served.request_sha256 == built.request_sha256
    # A memory the request did render: refused.
    held = f"bob-{new_id()}"
    rendered = pb.MemorySnapshot(
        snapshot_id="snap",
        items=[pb.MemoryItem(item_id="m2", text="BOB_DETAIL likes tea.", person_ids=[held])],
    )
    other, _ = await open_session(stub, snapshot=rendered)
    other_run = (await start_run(stub, other, "Tea?")).run.run_id
    shown = await stub.Build(pb.BuildRequest(tenant_id=TENANT, session_id=other, run_id=other_run))
    await stub.EraseSubject(pb.EraseSubjectRequest(tenant_id=TENANT, person_id=held))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _get(stub, other, shown.request_sequence)
    assert details(refused.value)[0] == "REQUEST_REDACTED"
