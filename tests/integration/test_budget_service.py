"""Budgets through the real gRPC server and real PostgreSQL: tiny windows (via
PlanSpec.policy_cap_tokens), pressure recorded as a write and never resolved inline, the
never-yield set failing loudly, and ReportUsage reconciling a per-model factor that a
checkpoint pins. Each test uses a tenant of its own: corrections are per tenant."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import grpc
import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb

from .helpers import (
    assistant,
    call,
    compaction_result,
    details,
    new_id,
    result,
    spec,
    spec_with_skill,
)

MODEL = "gpt-4o"  # exact o200k_base counts: sizes below are predictable
RESERVE = 1_000


def _tenant() -> str:
    return f"budget-{uuid.uuid4().hex[:12]}"


def _words(n: int, word: str = "lorem") -> str:
    return " ".join([word] * n)


async def _open(stub: Any, tenant: str, room: int, **kw: Any) -> tuple[str, pb.ContextPlan]:
    """A session whose window leaves `room` tokens above prefix + reserve (0: the model's)."""
    probe = await stub.Plan(
        pb.PlanRequest(
            tenant_id=tenant,
            session_id=new_id(),
            spec=spec(model_id=MODEL, reserve_output_tokens=RESERVE, **kw),
        )
    )
    cap = probe.plan.prefix_tokens + RESERVE + room if room else 0
    session_id = new_id()
    response = await stub.Plan(
        pb.PlanRequest(
            tenant_id=tenant,
            session_id=session_id,
            spec=spec(model_id=MODEL, reserve_output_tokens=RESERVE, policy_cap_tokens=cap, **kw),
        )
    )
    assert response.plan.prefix_tokens == probe.plan.prefix_tokens
    return session_id, response.plan


async def _start(stub: Any, tenant: str, session_id: str, text: str) -> str:
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=tenant, session_id=session_id, user_message=pb.UserMessage(text=text)
        )
    )
    return str(started.run.run_id)


async def _append(
    stub: Any, tenant: str, session_id: str, run_id: str, version: int, *items: Any
) -> int:
    response = await stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=tenant,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=version,
            items=list(items),
        )
    )
    return int(response.checkpoint_version)


async def _build(stub: Any, tenant: str, session_id: str, run_id: str, **kw: Any) -> Any:
    return await stub.Build(
        pb.BuildRequest(tenant_id=tenant, session_id=session_id, run_id=run_id, **kw)
    )


async def _events(pool: Any, tenant: str, session_id: str, kind: str) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        "SELECT sequence, payload FROM session_events WHERE tenant_id = $1 AND session_id = $2"
        " AND type = $3 ORDER BY sequence",
        tenant,
        UUID(session_id),
        kind,
    )
    return [{"sequence": r["sequence"], **r["payload"]} for r in rows]


def _body_budget(response: Any) -> int:
    available = response.input_budget_tokens - response.prefix_tokens
    return available - -(-available * 50_000 // 1_000_000)


def _carried_sequences(response: Any, current_run_seq: int) -> list[int]:
    return [
        b.source_sequence
        for m in response.request.messages
        for b in m.blocks
        if b.row == pb.ROW_CONVERSATION and 0 < b.source_sequence < current_run_seq
    ]


# --- pressure --------------------------------------------------------------------------


async def test_pressure_that_fits_drops_knowledge_lowest_ranked_first(stub: Any, pool: Any) -> None:
    tenant = _tenant()
    session_id, plan = await _open(stub, tenant, room=3_000)
    run_id = await _start(stub, tenant, session_id, "What does the handbook say?")
    plain = await _build(stub, tenant, session_id, run_id)
    assert plain.request_sequence > 0 and not plain.HasField("pressure")
    assert plain.input_budget_tokens == plan.prefix_tokens + 3_000
    slack = _body_budget(plain) - (plain.estimated_input_tokens - plain.prefix_tokens)
    passage = _words(slack * 6 // 10)  # one fits, two do not
    step = pb.StepContext(
        knowledge=[
            pb.KnowledgePassage(item_id="best", text=passage, citation="handbook p1"),
            pb.KnowledgePassage(item_id="worse", text=passage, citation="handbook p9"),
        ]
    )
    built = await _build(stub, tenant, session_id, run_id, step=step)
    assert not built.needs_compaction and built.request_sequence > 0
    assert built.pressure.fits
    assert [(s.step, list(s.item_ids)) for s in built.pressure.steps] == [
        ("drop_knowledge", ["knowledge:worse"])
    ]
    items = {b.item_id for m in built.request.messages for b in m.blocks}
    assert "knowledge:best" in items and "knowledge:worse" not in items
    assert built.estimated_input_tokens - built.prefix_tokens <= _body_budget(built)
    assert built.request.max_output_tokens == RESERVE
    budget = {c.class_name: c for c in built.budget}
    assert budget["knowledge"].items == 1 and budget["knowledge"].cap_items == 3
    assert budget["agent_instructions"].cap_tokens == 4_000
    # Recorded before the request it shaped, with fits and the steps taken.
    (pressure,) = await _events(pool, tenant, session_id, "context.budget.pressure")
    assert pressure["fits"] is True and pressure["sequence"] < built.request_sequence
    assert [s["step"] for s in pressure["steps"]] == ["drop_knowledge"]
    assert pressure["steps"][0]["item_ids"] == ["knowledge:worse"]


async def test_a_body_that_cannot_fit_needs_compaction_and_returns_no_request(
    stub: Any, pool: Any
) -> None:
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=4_000)
    first = await _start(stub, tenant, session_id, "Tell me everything.")
    await _append(stub, tenant, session_id, first, 1, assistant(_words(6_000)))
    run_id = await _start(stub, tenant, session_id, "And now?")
    step = pb.StepContext(knowledge=[pb.KnowledgePassage(item_id="k", text=_words(50))])
    before = await _events(pool, tenant, session_id, "model.request.started")
    built = await _build(stub, tenant, session_id, run_id, step=step)
    assert built.needs_compaction
    assert not built.HasField("request") and built.request_sequence == 0
    assert built.request_sha256 == "" and built.provider_payload == b""
    assert not built.pressure.fits
    assert [s.step for s in built.pressure.steps] == ["drop_knowledge", "compact"]
    assert built.pressure.body_tokens_after > built.pressure.body_budget_tokens
    # Pressure is resolved by a write (compaction), never inline: nothing was sent.
    assert await _events(pool, tenant, session_id, "model.request.started") == before
    (pressure,) = await _events(pool, tenant, session_id, "context.budget.pressure")
    assert pressure["fits"] is False and pressure["needs_compaction"] is True
    assert [s["step"] for s in pressure["steps"]] == ["drop_knowledge", "compact"]
    # Determinism: the same inputs report the same pressure.
    again = await _build(stub, tenant, session_id, run_id, step=step)
    assert again.pressure == built.pressure


async def test_old_tool_results_truncate_to_pointers_keeping_pairs(stub: Any) -> None:
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=6_000)
    run_id = await _start(stub, tenant, session_id, "Compare the three pages.")
    version = 1
    for n in range(3):
        version = await _append(
            stub,
            tenant,
            session_id,
            run_id,
            version,
            call(f"call_{n}"),
            result(f"call_{n}", _words(1_800, f"page{n}")),
        )
    built = await _build(stub, tenant, session_id, run_id)
    assert built.pressure.fits and not built.needs_compaction
    (truncation,) = built.pressure.steps
    assert truncation.step == "truncate_tool_results"
    blocks = [b for m in built.request.messages for b in m.blocks if b.HasField("tool_result")]
    calls = [b for m in built.request.messages for b in m.blocks if b.HasField("tool_call")]
    assert sorted(b.tool_result.call_id for b in blocks) == sorted(
        b.tool_call.call_id for b in calls
    )
    truncated = [b for b in blocks if "[truncated] tool.result" in b.tool_result.content]
    assert truncated and blocks[-1] not in truncated  # the pending result never yields
    assert [b.item_id for b in truncated] == list(truncation.item_ids)  # oldest first
    for b in truncated:
        assert 'truncated="true"' in b.tool_result.content
        assert b.trust == pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
        assert "(external_untrusted, " in b.tool_result.content


async def test_knowledge_comes_back_into_room_the_cap_frees_in_carried_history(
    stub: Any,
) -> None:
    """A passage dropped for the fit (history, a large carried tool result in it, counted
    at its floor) comes back once the tool-result cap has made that result a pointer: the
    cap pass pins the history cut it read, and the request that cut makes has room for the
    passage (core/yield_ladder.py, Rule 2). Before context-assembler@8 it stayed out."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=6_400)
    first = await _start(stub, tenant, session_id, "Fetch the page.")
    page = result("call_0", _words(4_000, "page"))
    await _append(stub, tenant, session_id, first, 1, call("call_0"), page, assistant("Done."))
    run_id = await _start(stub, tenant, session_id, "Summarize it with the handbook.")
    passage = _words(1_300, "rule")
    step = pb.StepContext(
        knowledge=[
            pb.KnowledgePassage(item_id="best", text=passage, citation="handbook p1"),
            pb.KnowledgePassage(item_id="worse", text=passage, citation="handbook p9"),
        ]
    )
    built = await _build(stub, tenant, session_id, run_id, step=step)
    assert built.pressure.fits and not built.needs_compaction
    # Both passages kept; the carried result the only yield, truncated for the cap.
    (truncation,) = built.pressure.steps
    assert truncation.step == "truncate_tool_results"
    items = {b.item_id for m in built.request.messages for b in m.blocks}
    assert {"knowledge:best", "knowledge:worse"} <= items
    results = [b for m in built.request.messages for b in m.blocks if b.HasField("tool_result")]
    assert [b.item_id for b in results] == list(truncation.item_ids)
    assert "[truncated] tool.result" in results[0].tool_result.content
    assert built.estimated_input_tokens - built.prefix_tokens <= _body_budget(built)
    # Without the cap's room, the two passages and the whole result do not fit.
    costs = {c.class_name: c.tokens for c in built.budget}
    assert costs["knowledge"] + 4_000 > _body_budget(built) - costs["user_message"]


async def test_an_image_is_costed_at_the_models_registry_figure(stub: Any) -> None:
    """The registry's image_tokens (gpt-4o-mini: 48,200) reaches Build's estimate through
    the server's catalog; it used to stop at an estimator path Build never called."""
    tenant = _tenant()
    session_id = new_id()
    await stub.Plan(
        pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=spec(model_id="gpt-4o-mini"))
    )
    run_id = str(
        (
            await stub.StartRun(
                pb.StartRunRequest(
                    tenant_id=tenant,
                    session_id=session_id,
                    user_message=pb.UserMessage(
                        text="What is in this picture?",
                        attachments=[pb.Attachment(kind="image", ref="photo.png")],
                    ),
                )
            )
        ).run.run_id
    )
    built = await _build(stub, tenant, session_id, run_id)
    assert built.estimated_input_tokens - built.prefix_tokens >= 48_200


@pytest.mark.parametrize(
    ("kind", "size", "value"),
    [
        ("pdf", "pages", 0),  # counted as one page, sent whole
        ("text_file", "text_length", 0),  # counted as nothing, sent whole
        ("pdf", "pages", 2**53 - 1),  # its tokens overflowed the placement's int64
        ("pdf", "pages", -5),  # refused naming the attachment, not the field (an audit)
        ("image", "text_length", -1),  # a count its kind does not use
    ],
)
async def test_an_attachment_needs_a_size_its_content_can_be_counted_by(
    stub: Any, pool: Any, kind: str, size: str, value: int
) -> None:
    """A PDF without its pages was counted at one page and a text file without its length
    at nothing, and each sent whole (a silent overflow); a PDF of 2^53 - 1 pages failed
    every Build that reached it INTERNAL, each after recording the request (an audit).
    StartRun refuses them naming the field, and writes nothing."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    before = await pool.fetchval("SELECT count(*) FROM session_events WHERE tenant_id = $1", tenant)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.StartRun(
            pb.StartRunRequest(
                tenant_id=tenant,
                session_id=session_id,
                user_message=pb.UserMessage(
                    text="Summarize this.",
                    attachments=[pb.Attachment(kind=kind, ref="f", **{size: value})],
                ),
            )
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    field = f"user_message.attachments[0].{size}"
    assert details(refused.value)[:2] == ("INVALID_FIELD", [field])
    after = await pool.fetchval("SELECT count(*) FROM session_events WHERE tenant_id = $1", tenant)
    assert after == before


def _types(value: Any) -> set[str]:
    """Every "type" a JSON value holds, at any depth."""
    if isinstance(value, dict):
        own = {value["type"]} if isinstance(value.get("type"), str) else set()
        return own.union(*(_types(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_types(v) for v in value))
    return set()


async def test_a_pdf_past_the_budget_costs_its_label_and_builds_on_a_small_window(
    stub: Any,
) -> None:
    """A 21-page PDF (67,200 tokens) is larger than the whole 64,000-token attachment
    budget, so it is always sent as its marker. It was charged that budget all the same,
    and on gpt-3.5-turbo's 16,385-token window every Build of its run failed
    BUDGET_EXCEEDED naming user_message (an audit). It costs its label alone."""
    tenant = _tenant()
    session_id = new_id()
    opened = pb.PlanRequest(
        tenant_id=tenant, session_id=session_id, spec=spec(model_id="gpt-3.5-turbo")
    )
    await stub.Plan(opened)
    pdf = pb.Attachment(kind="pdf", ref="store://annual-report.pdf", pages=21)
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=tenant,
            session_id=session_id,
            user_message=pb.UserMessage(text="Summarize this.", attachments=[pdf]),
        )
    )
    built = await _build(stub, tenant, session_id, str(started.run.run_id))
    assert built.provider_payload and built.estimated_input_tokens < 16_385
    (placed,) = built.attachment_placements
    assert [(a.content_tokens, a.content) for a in placed.attachments] == [(67_200, False)]


@pytest.mark.parametrize(
    ("model_id", "api"),
    [("claude-sonnet-4-5", "anthropic.messages"), ("gpt-4o-mini", "openai.responses")],
)
async def test_attachments_stay_out_of_the_payload_and_their_message_is_named(
    stub: Any, model_id: str, api: str
) -> None:
    """An attachment is a reference the engine never resolves: Build costs it but puts no
    attachment part or reference in `provider_payload` (docs/api.md says so), and the
    message's block names the item, by id and session sequence, for the adapter to add
    them beside it."""
    tenant = _tenant()
    session_id = new_id()
    await stub.Plan(
        pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=spec(model_id=model_id))
    )
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=tenant,
            session_id=session_id,
            seed_item_id="u-attached",
            user_message=pb.UserMessage(
                text="Compare these two.",
                attachments=[
                    pb.Attachment(kind="image", ref="store://photo-7.png"),
                    pb.Attachment(kind="pdf", ref="store://report-7.pdf", pages=3),
                ],
            ),
        )
    )
    built = await _build(stub, tenant, session_id, str(started.run.run_id))
    assert built.provider_api == api
    assert b"Compare these two." in built.provider_payload
    assert b"photo-7" not in built.provider_payload and b"report-7" not in built.provider_payload
    attachment_parts = {"image", "document", "file", "input_image", "input_file"}
    assert not _types(json.loads(built.provider_payload)) & attachment_parts
    # Costed all the same: three PDF pages at 3,200 tokens each, and the image.
    assert built.estimated_input_tokens - built.prefix_tokens > 3 * 3_200
    (block,) = [
        b for m in built.request.messages for b in m.blocks if "Compare these two." in b.text
    ]
    assert (block.row, block.item_id) == (pb.ROW_USER_INPUT, "u-attached")
    assert block.source_sequence == started.run.seed_event_sequence > 0
    # Where the adapter adds them: the part holding the message's text, and all of both
    # contents (an image and three PDF pages are well within the 64,000-token budget).
    (placed,) = built.attachment_placements
    assert (placed.item_id, placed.source_sequence) == ("u-attached", block.source_sequence)
    part = _at(json.loads(built.provider_payload), placed.payload_path)
    assert part["text"] == block.text and "Compare these two." in part["text"]
    assert [(a.attachment.ref, a.content) for a in placed.attachments] == [
        ("store://photo-7.png", True),
        ("store://report-7.pdf", True),
    ]
    assert placed.attachments[1].content_tokens == 3 * 3_200
    assert placed.share_tokens == sum(a.content_tokens for a in placed.attachments)
    again = await stub.GetBuild(
        pb.GetBuildRequest(
            tenant_id=tenant, session_id=session_id, request_sequence=built.request_sequence
        )
    )
    assert list(again.attachment_placements) == list(built.attachment_placements)


def _at(payload: dict[str, Any], path: str) -> Any:
    """The value at a payload path such as "messages[2].content[1]"."""
    value: Any = payload
    for name, index in re.findall(r"(\w+)\[(\d+)\]", path):
        value = value[name][int(index)]
    return value


async def test_a_requests_images_share_one_attachment_budget(stub: Any) -> None:
    """ADR-0120: the adapter sends at most 64,000 tokens of attachment content per request.
    Four gpt-4o-mini images (48,200 each) in four turns were estimated at 192,800 tokens,
    over the 128,000-token window, so the earlier turns were cut; counted against the one
    budget they all fit, and the record rebuilds to the same bytes."""
    tenant = _tenant()
    session_id = new_id()
    await stub.Plan(
        pb.PlanRequest(
            tenant_id=tenant,
            session_id=session_id,
            spec=spec(model_id="gpt-4o-mini", reserve_output_tokens=RESERVE),
        )
    )

    async def turn(n: int) -> tuple[str, int]:
        started = await stub.StartRun(
            pb.StartRunRequest(
                tenant_id=tenant,
                session_id=session_id,
                user_message=pb.UserMessage(
                    text=f"And picture {n}?",
                    attachments=[pb.Attachment(kind="image", ref=f"photo{n}.png")],
                ),
            )
        )
        return str(started.run.run_id), int(started.checkpoint_version)

    for n in range(3):
        run_id, version = await turn(n)
        await _append(stub, tenant, session_id, run_id, version, assistant(f"Picture {n}: a cat."))
    run_id, _ = await turn(3)
    built = await _build(stub, tenant, session_id, run_id)
    assert built.request.messages and not built.needs_compaction
    body = built.estimated_input_tokens - built.prefix_tokens
    assert 64_000 < body < 64_000 + 1_000  # the content once, plus texts and labels
    turns = [
        b
        for m in built.request.messages
        for b in m.blocks
        if b.row == pb.ROW_CONVERSATION and b.source_sequence > 0
    ]
    # Every earlier turn, question and answer (the new question is row 15, the last).
    assert len(turns) == 6 and "Picture 0: a cat." in turns[1].text
    assert built.request.messages[-1].blocks[-1].row == pb.ROW_USER_INPUT
    again = await stub.GetBuild(
        pb.GetBuildRequest(
            tenant_id=tenant, session_id=session_id, request_sequence=built.request_sequence
        )
    )
    assert (again.request_sha256, again.provider_payload) == (
        built.request_sha256,
        built.provider_payload,
    )
    # Newest first: the new picture's 48,200 tokens are sent; the 15,800 left cannot take
    # another, so the three earlier pictures go as their markers.
    placements = built.attachment_placements
    assert [p.share_tokens for p in placements] == [0, 0, 15_800, 48_200]
    assert [a.content for p in placements for a in p.attachments] == [False, False, False, True]
    assert list(again.attachment_placements) == list(placements)
    payload = json.loads(built.provider_payload)
    for n, p in enumerate(placements):
        assert f"picture {n}?" in _at(payload, p.payload_path)["text"]


# --- the never-yield set ---------------------------------------------------------------


async def test_a_never_yield_set_over_the_body_fails_and_records_exceeded(
    stub: Any, pool: Any
) -> None:
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=2_000)
    run_id = await _start(stub, tenant, session_id, _words(5_000))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _build(stub, tenant, session_id, run_id)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reason, _, metadata = details(caught.value)
    assert reason == "BUDGET_EXCEEDED" and metadata["class"] == "user_message"
    (exceeded,) = await _events(pool, tenant, session_id, "context.budget.exceeded")
    assert exceeded["class"] == "user_message" and exceeded["run_id"] == run_id
    assert int(exceeded["never_yield_tokens"]) > int(exceeded["body_budget_tokens"])
    assert await _events(pool, tenant, session_id, "model.request.started") == []


async def test_a_recall_floor_over_recalls_cap_is_refused_and_writes_nothing(
    stub: Any, pool: Any
) -> None:
    """Recall is capped at 2,000 tokens and its floor never trims: a floor over the cap is
    the caller's to lower (INVALID_ARGUMENT naming step.recall_floor_lines), nothing is
    recorded, and the same lines with a floor within the cap are built."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "Plan my week.")
    lines = [pb.RecallLine(item_id=f"m{n}", text=_words(300, f"fact{n}")) for n in range(12)]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _build(
            stub,
            tenant,
            session_id,
            run_id,
            step=pb.StepContext(recall=lines, recall_floor_lines=12),
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reason, fields, metadata = details(caught.value)
    assert (reason, fields) == ("INVALID_FIELD", ["step.recall_floor_lines"])
    assert int(metadata["floor_tokens"]) > int(metadata["cap_tokens"]) == 2_000
    assert await _events(pool, tenant, session_id, "model.request.started") == []
    assert await _events(pool, tenant, session_id, "context.budget.exceeded") == []
    built = await _build(
        stub, tenant, session_id, run_id, step=pb.StepContext(recall=lines, recall_floor_lines=2)
    )
    recall = [u for u in built.budget if u.class_name == "recall"]
    assert recall and recall[0].tokens <= 2_000


async def test_correction_lines_share_recalls_cap(stub: Any, pool: Any) -> None:
    """Row 13 is in-turn recall and the correction lines, capped at 2,000 tokens; the
    corrections never yield and were uncapped: 100 lines of 285 tokens were sent beside
    recall at its own cap (an audit). Recall now holds what they leave, and lines over
    the cap alone are refused naming step.corrections, recording nothing."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "Plan my week.")
    # About 230 tokens a recall line and 330 a correction line, envelopes included.
    recall = [pb.RecallLine(item_id=f"m{n}", text=_words(100, f"fact{n}")) for n in range(6)]
    many = [pb.RecallLine(item_id=f"c{n}", text=_words(150, f"fix{n}")) for n in range(12)]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _build(
            stub, tenant, session_id, run_id, step=pb.StepContext(recall=recall, corrections=many)
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reason, fields, metadata = details(caught.value)
    assert (reason, fields) == ("INVALID_FIELD", ["step.corrections"])
    assert int(metadata["corrections_tokens"]) > int(metadata["cap_tokens"]) == 2_000
    assert await _events(pool, tenant, session_id, "model.request.started") == []
    few = many[:3]
    built = await _build(
        stub, tenant, session_id, run_id, step=pb.StepContext(recall=recall, corrections=few)
    )
    usage = {u.class_name: u for u in built.budget}
    corrections, kept = usage["corrections"], usage["recall"]
    assert corrections.items == 3 and corrections.cap_tokens == 2_000
    assert 0 < kept.items < 6 and corrections.tokens + kept.tokens <= 2_000
    # With them, a floor that leaves no room beside them is the floor's to lower.
    with pytest.raises(grpc.aio.AioRpcError) as floored:
        await _build(
            stub,
            tenant,
            session_id,
            run_id,
            step=pb.StepContext(recall=recall, corrections=few, recall_floor_lines=5),
        )
    assert details(floored.value)[1] == ["step.recall_floor_lines"]


@pytest.fixture
async def own_server(pool: Any) -> AsyncIterator[Any]:
    """A server of this test's own: its engine's token counter can be changed."""
    from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
    from context_engine.api.server import build_engine, build_server

    running = await build_server(build_engine(pool), "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield running, pb_grpc.ContextEngineStub(channel)
    await channel.close()
    await running.stop(0)


async def _long_objective(stub: Any, tenant: str, session_id: str, run_id: str) -> None:
    """A 300-word objective written on checkpoint 1 (1,800 characters)."""
    await stub.UpdateWorkingState(
        pb.UpdateWorkingStateRequest(
            tenant_id=tenant,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=1,
            writer=pb.WRITER_USER,
            update=pb.WorkingStateUpdate(objective=_words(300)),
        )
    )


async def test_a_working_state_over_its_block_under_a_changed_counter_records_exceeded(
    own_server: Any, pool: Any
) -> None:
    """docs/api.md: a Build refused with BUDGET_EXCEEDED logs context.budget.exceeded. The
    working-state block raised it while Build's inputs were made, before the try that
    records the refusal, so that refusal left no trace. Only a changed token counter gets
    there (transitions refuse the state otherwise): here the engine's counter becomes one
    token per character after the state was written."""
    running, stub = own_server
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "Plan the trip.")
    await _long_objective(stub, tenant, session_id, run_id)
    running.engine._token_counter = lambda model_id: len  # 1,800 characters: 1,800 tokens
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _build(stub, tenant, session_id, run_id)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reason, _, metadata = details(caught.value)
    assert reason == "BUDGET_EXCEEDED" and metadata["class"] == "working_state"
    (exceeded,) = await _events(pool, tenant, session_id, "context.budget.exceeded")
    assert exceeded["class"] == "working_state" and exceeded["run_id"] == run_id
    assert exceeded["checkpoint_version"] == 2 and exceeded["cap_tokens"] == "1000"
    assert await _events(pool, tenant, session_id, "model.request.started") == []


async def test_a_refusal_built_from_a_kept_head_is_recorded_once(
    own_server: Any, pool: Any
) -> None:
    """A Build of a run the replica built before is made from the head it kept; a refusal
    from it is decided again from a fresh head read (api/engine.py Engine.build), and only
    that second attempt records context.budget.exceeded: one event, not two."""
    running, stub = own_server
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "Plan the trip.")
    await _build(stub, tenant, session_id, run_id)  # the replica keeps the run's head
    await _long_objective(stub, tenant, session_id, run_id)
    kept = running.engine._heads(tenant, UUID(session_id))
    assert kept is not None and UUID(run_id) in kept.by_run  # what the Build is made from
    reads = running.engine._read_heads.calls
    running.engine._token_counter = lambda model_id: len  # as in the test above
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _build(stub, tenant, session_id, run_id)
    assert details(caught.value)[0] == "BUDGET_EXCEEDED"
    assert running.engine._read_heads.calls == reads + 1  # decided again from a fresh read
    (exceeded,) = await _events(pool, tenant, session_id, "context.budget.exceeded")
    assert exceeded["checkpoint_version"] == 2


async def test_a_prefix_class_over_its_cap_fails_the_plan_naming_it(stub: Any) -> None:
    tenant = _tenant()
    session_id = new_id()
    too_long = spec(model_id=MODEL)
    too_long.agent.instructions = _words(4_500)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Plan(pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=too_long))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reason, fields, metadata = details(caught.value)
    assert reason == "PREFIX_CLASS_OVER_CAP" and metadata["class"] == "agent_instructions"
    assert fields == ["spec.agent.instructions"]
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session_id))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND  # nothing was written


async def test_a_capacity_with_no_room_for_a_body_fails_plan_and_rotate(stub: Any) -> None:
    """A policy cap below the prefix, or an output reserve of the whole window, left every
    Build of the session BUDGET_EXCEEDED naming user_message. Plan and Rotate (which
    rebuilds the plan) refuse it at session open, naming the field to change."""
    tenant = _tenant()
    session_id = new_id()
    capped = spec(model_id=MODEL, policy_cap_tokens=2_000)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Plan(pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=capped))
    reason, fields, metadata = details(caught.value)
    assert (caught.value.code(), reason, fields) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
        ["spec.policy_cap_tokens"],
    )
    assert int(metadata["prefix_tokens"]) > 0
    await stub.Plan(
        pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=spec(model_id=MODEL))
    )
    reserved = spec(model_id=MODEL, reserve_output_tokens=10_000_000)  # over any window
    with pytest.raises(grpc.aio.AioRpcError) as rotated:
        await stub.Rotate(
            pb.RotateRequest(
                tenant_id=tenant,
                session_id=session_id,
                from_epoch=1,
                reason=pb.PLAN_REASON_AGENT_CHANGED,
                spec=reserved,
            )
        )
    reason, fields, _ = details(rotated.value)
    assert (rotated.value.code(), reason, fields) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
        ["spec.reserve_output_tokens"],
    )


async def _least_accepted(accepts: Any, low: int, high: int) -> int:
    """The least value in [low, high] that `accepts` (monotone), which `high` must be."""
    assert await accepts(high)
    while low < high:
        mid = (low + high) // 2
        if await accepts(mid):
            high = mid
        else:
            low = mid + 1
    return low


# A Wednesday, whose row 14 is the widest (assemble.runtime_row_cost), and a Monday.
_WEDNESDAY = 1_790_164_800  # 2026-09-23 12:00 UTC
_MONDAY = 1_789_992_000  # 2026-09-21 12:00 UTC


async def _build_at(stub: Any, tenant: str, session_id: str, run_id: str, seconds: int) -> Any:
    request = pb.BuildRequest(tenant_id=tenant, session_id=session_id, run_id=run_id)
    request.now.FromSeconds(seconds)
    return await stub.Build(request)


async def _shortest_run_builds(stub: Any, tenant: str, plan_spec: pb.PlanSpec, at: int) -> str:
    """Open a session of `plan_spec`, start a one-character run and Build it at `at`; the
    session's id."""
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=plan_spec))
    run_id = await _start(stub, tenant, session_id, ".")
    built = await _build_at(stub, tenant, session_id, run_id, at)
    assert built.provider_payload and not built.needs_compaction
    return session_id


def _capped(cap: int) -> pb.PlanSpec:
    return spec(model_id=MODEL, policy_cap_tokens=cap, reserve_output_tokens=RESERVE)


async def _plan_accepts(stub: Any, tenant: str, cap: int, factor: int | None = None) -> bool:
    """Whether Plan opens a session at policy cap `cap`; a refusal names the cap, and
    (`factor`) the estimator factor it was checked at."""
    request = pb.PlanRequest(tenant_id=tenant, session_id=new_id(), spec=_capped(cap))
    try:
        await stub.Plan(request)
    except grpc.aio.AioRpcError as refused:
        _, fields, metadata = details(refused)
        assert fields == ["spec.policy_cap_tokens"]
        assert factor is None or metadata["estimator_factor_ppm"] == str(factor)
        return False
    return True


async def test_the_least_capacity_plan_accepts_builds_the_shortest_run_on_any_day(
    stub: Any,
) -> None:
    """Plan refuses a capacity whose every Build would fail: its body must hold the
    runtime row on any day and the least run seed, a one-character message under the id
    the server assigns. An audit found the least capacity Plan took failing every Build:
    the row was counted undated, the seed not at all."""
    tenant = _tenant()
    least = await _least_accepted(
        lambda cap: _plan_accepts(stub, tenant, cap), RESERVE, RESERVE + 4_000
    )
    for seconds in (_WEDNESDAY, _MONDAY):  # a session each: a second run carries the first
        await _shortest_run_builds(stub, tenant, _capped(least), seconds)


async def test_plan_and_rotate_check_the_least_capacity_at_the_tenants_factor(
    stub: Any,
) -> None:
    """A run's checkpoints pin the tenant's estimator factor, and Build scales the
    framing, the runtime row and the seed by it; Plan checked its capacity at the neutral
    factor, so a tenant whose provider had read twice the estimate was given a capacity
    every Build failed (an audit). Plan and Rotate with a spec check it at the factor a
    new run pins; a session planned before is still answered when reopened."""
    tenant = _tenant()
    neutral = await _least_accepted(
        lambda cap: _plan_accepts(stub, tenant, cap, 1_000_000), RESERVE, RESERVE + 4_000
    )
    early = pb.PlanRequest(tenant_id=tenant, session_id=new_id(), spec=_capped(neutral))
    assert (await stub.Plan(early)).created
    learner = new_id()
    plain = spec(model_id=MODEL, reserve_output_tokens=RESERVE)
    await stub.Plan(pb.PlanRequest(tenant_id=tenant, session_id=learner, spec=plain))
    run_id = await _start(stub, tenant, learner, _words(3_000))
    built = await _build_at(stub, tenant, learner, run_id, _WEDNESDAY)
    report = _usage(
        tenant,
        learner,
        built.request_sequence,
        input_tokens=2 * built.estimated_input_tokens,
        idempotency_key="learn",
    )
    learned = await stub.ReportUsage(report)
    assert learned.absorbed and learned.factor_ppm > 1_900_000
    least = await _least_accepted(
        lambda cap: _plan_accepts(stub, tenant, cap, learned.factor_ppm),
        RESERVE,
        RESERVE + 4_000,
    )
    assert least > neutral
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Plan(
            pb.PlanRequest(tenant_id=tenant, session_id=new_id(), spec=_capped(neutral))
        )
    assert "(scaled by the estimator's 2." in (refused.value.details() or "")
    # The session planned before the factor was learned is answered as it is.
    reopened = await stub.Plan(early)
    assert not reopened.created and reopened.spec_matches
    # Its spec is still validated, at the neutral factor: one leaving no body is refused.
    bare = pb.PlanRequest(tenant_id=tenant, session_id=early.session_id, spec=_capped(RESERVE + 1))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Plan(bare)
    _, fields, metadata = details(refused.value)
    assert fields == ["spec.policy_cap_tokens"]
    assert metadata["estimator_factor_ppm"] == "1000000"
    for seconds in (_WEDNESDAY, _MONDAY):
        session_id = await _shortest_run_builds(stub, tenant, _capped(least), seconds)
    # Rotate with a spec is checked alike: the capacity below the least is refused.
    rotate = pb.RotateRequest(
        tenant_id=tenant,
        session_id=session_id,
        from_epoch=1,
        reason=pb.PLAN_REASON_AGENT_CHANGED,
        spec=_capped(least - 1),
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Rotate(rotate)
    assert details(refused.value)[1] == ["spec.policy_cap_tokens"]


async def test_a_skill_loaded_at_the_edge_of_its_room_leaves_the_shortest_run_a_build(
    stub: Any,
) -> None:
    """LoadSkill's room is what the body leaves beside the runtime row and the least run
    seed: a body admitted at its edge still lets a one-character message under the
    server's id build (an audit: the seed was left out, and every such Build failed)."""
    tenant = _tenant()
    capped = spec_with_skill(pb.TRUST_LEVEL_TRUSTED_CONFIGURATION)
    capped.model_id = MODEL
    capped.policy_cap_tokens, capped.reserve_output_tokens = 4_000, RESERVE
    loaded: dict[int, str] = {}

    async def refuses(words: int) -> bool:
        session_id = new_id()
        await stub.Plan(pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=capped))
        load = pb.LoadSkillRequest(
            tenant_id=tenant, session_id=session_id, name="vendor", body=_words(words)
        )
        try:
            await stub.LoadSkill(load)
        except grpc.aio.AioRpcError as refused:
            assert details(refused)[0] == "SKILL_LIMIT"
            return True
        loaded[words] = session_id
        return False

    largest = await _least_accepted(refuses, 1, 4_000) - 1
    for seconds in (_WEDNESDAY, _MONDAY):  # a session each: a second run carries the first
        assert not await refuses(largest)
        session_id = loaded[largest]
        run_id = await _start(stub, tenant, session_id, ".")
        built = await _build_at(stub, tenant, session_id, run_id, seconds)
        assert built.provider_payload and not built.needs_compaction


# --- ReportUsage and the pinned factor -------------------------------------------------


async def _factor(pool: Any, tenant: str) -> tuple[int, int] | None:
    row = await pool.fetchrow(
        "SELECT factor_ppm, samples FROM estimator_corrections"
        " WHERE tenant_id = $1 AND model_id = $2",
        tenant,
        MODEL,
    )
    return (row["factor_ppm"], row["samples"]) if row else None


def _usage(tenant: str, session_id: str, sequence: int, **kw: Any) -> pb.ReportUsageRequest:
    return pb.ReportUsageRequest(
        tenant_id=tenant,
        session_id=session_id,
        request_sequence=sequence,
        model_id=kw.pop("model_id", MODEL),
        **kw,
    )


async def test_report_usage_moves_the_factor_and_a_rebuild_of_the_same_checkpoint_cuts_the_same(
    stub: Any, pool: Any
) -> None:
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=14_000)
    for n in range(8):
        earlier = await _start(stub, tenant, session_id, f"question {n}")
        await _append(stub, tenant, session_id, earlier, 1, assistant(_words(1_200, f"w{n}")))
    run_id = await _start(stub, tenant, session_id, "And the last one?")
    seed = await pool.fetchval(
        "SELECT seed_event_sequence FROM runs WHERE tenant_id = $1 AND run_id = $2",
        tenant,
        UUID(run_id),
    )
    first = await _build(stub, tenant, session_id, run_id)
    kept_before = _carried_sequences(first, seed)
    assert 0 < len(kept_before) < 16  # the history cut binds

    # The provider read twice what we estimated: the factor rises, the error is negative.
    actual = 2 * first.estimated_input_tokens
    report = _usage(
        tenant,
        session_id,
        first.request_sequence,
        input_tokens=actual - 300,
        cache_read_input_tokens=300,
        output_tokens=50,
        idempotency_key="u-1",
    )
    answered = await stub.ReportUsage(report)
    assert answered.factor_ppm > 1_900_000 and answered.samples == 1
    assert answered.signed_error_ppm == (first.estimated_input_tokens - actual) * 10**6 // actual
    assert answered.cached_prefix_ppm == min(10**6, 300 * 10**6 // first.prefix_tokens)
    assert await _factor(pool, tenant) == (answered.factor_ppm, 1)
    # Idempotent by key: a retry answers the same and counts nothing twice.
    assert await stub.ReportUsage(report) == answered
    assert await _factor(pool, tenant) == (answered.factor_ppm, 1)
    changed = _usage(
        tenant, session_id, first.request_sequence, input_tokens=7, idempotency_key="u-1"
    )
    with pytest.raises(grpc.aio.AioRpcError) as reused:
        await stub.ReportUsage(changed)
    assert reused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(reused.value)[0] == "IDEMPOTENCY_KEY_REUSED"

    # A rebuild of the same checkpoint reads the factor pinned on it: the same cut, bytes.
    again = await _build(stub, tenant, session_id, run_id, checkpoint_version=1)
    assert again.request_sha256 == first.request_sha256
    assert again.estimated_input_tokens == first.estimated_input_tokens
    assert _carried_sequences(again, seed) == kept_before

    # A new checkpoint pins the current factor: the body is estimated at twice the size,
    # so the cut moves later.
    version = await _append(stub, tenant, session_id, run_id, 1, assistant("Let me check."))
    pinned = await pool.fetchval(
        "SELECT estimator_factor_ppm FROM run_checkpoints WHERE tenant_id = $1"
        " AND run_id = $2 AND version = $3",
        tenant,
        UUID(run_id),
        version,
    )
    assert pinned == answered.factor_ppm
    later = await _build(stub, tenant, session_id, run_id)
    assert len(_carried_sequences(later, seed)) < len(kept_before)

    # Another tenant's budgets are untouched.
    assert await _factor(pool, _tenant()) is None


async def test_every_checkpoint_written_pins_the_factor_current_then(stub: Any, pool: Any) -> None:
    """api/usage.py Rule 4: a checkpoint pins the factor current when it is written.
    AppendItems and StartRun did; UpdateWorkingState and CommitCompaction copied the
    checkpoint before theirs, factor and all, so a factor learned since reached the run's
    Builds only at its next append (an audit)."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=14_000)
    earlier = await _start(stub, tenant, session_id, "question 0")
    await _append(stub, tenant, session_id, earlier, 1, assistant(_words(1_200)))
    run_id = await _start(stub, tenant, session_id, "And the last one?")
    first = await _build(stub, tenant, session_id, run_id)

    async def pinned(version: int) -> int:
        factor: int = await pool.fetchval(
            "SELECT estimator_factor_ppm FROM run_checkpoints WHERE tenant_id = $1"
            " AND run_id = $2 AND version = $3",
            tenant,
            UUID(run_id),
            version,
        )
        return factor

    async def learn(build: Any, times: float) -> int:
        actual = int(times * build.estimated_input_tokens)
        report = _usage(tenant, session_id, build.request_sequence, input_tokens=actual)
        answered = await stub.ReportUsage(report)
        assert answered.absorbed
        return int(answered.factor_ppm)

    learned = await learn(first, 2)
    assert await pinned(1) == 1_000_000
    updated = await stub.UpdateWorkingState(
        pb.UpdateWorkingStateRequest(
            tenant_id=tenant,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=1,
            writer=pb.WRITER_USER,
            update=pb.WorkingStateUpdate(add_constraints=["No night trains"]),
        )
    )
    assert await pinned(updated.checkpoint_version) == learned > 1_000_000
    again = await _build(stub, tenant, session_id, run_id)
    relearned = await learn(again, 1.5)
    assert relearned != learned
    prepared = await stub.PrepareCompaction(
        pb.PrepareCompactionRequest(tenant_id=tenant, session_id=session_id, run_id=run_id)
    )
    committed = await stub.CommitCompaction(
        pb.CommitCompactionRequest(
            tenant_id=tenant,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=prepared.checkpoint_version,
            result=compaction_result(prepared, "The user asked a question."),
        )
    )
    assert await pinned(committed.checkpoint_version) == relearned


async def test_a_body_read_longer_than_estimated_is_learned_at_its_own_ratio(
    stub: Any,
) -> None:
    """The factor scales the body alone; it was learned from the whole request's ratio, so
    behind a large exact prefix a body read at twice its estimate moved it by a few
    percent, and a larger body later was estimated short (an audit). With an exact
    prefix the body's own ratio is learned: in full for a body of a quarter of the
    request or more, and at most four times the request's excess for a smaller one (the
    provider's margin over our prefix count reads as the body's: one report 7% high over
    a small body set a tenant's factor to 3.3x, another audit)."""
    tenant = _tenant()
    instructions = "Follow the travel policy carefully. " * 400  # a large, exact prefix
    agent = pb.AgentSpec(agent_id="a", version="1", instructions=instructions)
    session_id, _ = await _open(stub, tenant, room=0, agent=agent)
    run_id = await _start(stub, tenant, session_id, "Trains to Lyon?")
    built = await _build(stub, tenant, session_id, run_id)
    body = built.estimated_input_tokens - built.prefix_tokens
    assert built.prefix_tokens > 10 * body
    answered = await stub.ReportUsage(
        _usage(
            tenant,
            session_id,
            built.request_sequence,
            input_tokens=built.prefix_tokens + 2 * body,
        )
    )
    magnified = 1 + 4 * body / built.estimated_input_tokens  # the body's own would be 2.0
    assert answered.absorbed
    assert answered.factor_ppm == pytest.approx(magnified * 1_000_000, rel=1e-4)
    # A body's ratio of 12x is not learned (a review: the body's set the factor to 4x
    # outright): at most four times the request's excess, a second sample of the mean.
    again = await _build(stub, tenant, session_id, run_id)
    body = again.estimated_input_tokens - again.prefix_tokens
    extreme = _usage(
        tenant, session_id, again.request_sequence, input_tokens=again.prefix_tokens + 12 * body
    )
    whole = (again.prefix_tokens + 12 * body) / again.estimated_input_tokens
    assert whole < 1.5
    learned = await stub.ReportUsage(extreme)
    # Its estimate is the run's checkpoint's (the factor pinned before the first report),
    # so the excess it teaches is of an uncorrected body.
    sample = 1_000_000 * (1 + 4 * (whole - 1))
    assert learned.absorbed
    assert learned.factor_ppm == pytest.approx((answered.factor_ppm + sample) / 2, rel=1e-3)
    assert learned.factor_ppm < 12 * 1_000_000 * 0.5


async def test_a_request_that_sent_attachment_content_teaches_no_factor(
    stub: Any, pool: Any
) -> None:
    """An image's content is counted at a fixed figure no factor scales; its reports pulled a
    learned factor toward the figure's own error (an audit: 1.5 down to 1.01 over a dozen
    reports). Recorded, not absorbed."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=tenant,
            session_id=session_id,
            user_message=pb.UserMessage(
                text="What is in this picture?",
                attachments=[pb.Attachment(kind="image", ref="photo.png")],
            ),
        )
    )
    built = await _build(stub, tenant, session_id, str(started.run.run_id))
    answered = await stub.ReportUsage(
        _usage(
            tenant,
            session_id,
            built.request_sequence,
            input_tokens=built.estimated_input_tokens // 2,
        )
    )
    assert not answered.absorbed and answered.samples == 0
    assert await _factor(pool, tenant) is None


async def test_report_usage_from_another_model_is_recorded_but_learns_nothing(
    stub: Any, pool: Any
) -> None:
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "hi")
    built = await _build(stub, tenant, session_id, run_id)
    other = await stub.ReportUsage(
        _usage(
            tenant,
            session_id,
            built.request_sequence,
            model_id="gpt-4.1",
            input_tokens=5 * built.estimated_input_tokens,
        )
    )
    assert other.factor_ppm == 1_000_000 and other.samples == 0 and not other.absorbed
    assert await _factor(pool, tenant) is None
    (reported,) = await _events(pool, tenant, session_id, "model.usage.reported")
    assert reported["absorbed"] is False and reported["model_id"] == "gpt-4.1"


@pytest.mark.parametrize("times", [10**9, 1 / 100])
async def test_report_usage_no_drift_explains_is_recorded_but_learns_nothing(
    stub: Any, pool: Any, times: float
) -> None:
    """A report a billion times the estimate (or a hundredth of it) is a bogus report or a
    mis-registered tokenizer, not drift. Taken, it set the tenant's factor to 4x at once
    (its first sample outright) and every later session of the model was refused
    BUDGET_EXCEEDED, or to the floor, hiding real underestimates (an audit). It is
    recorded, not absorbed; a report within [0.1x, 4x] of the estimate still is."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "hi")
    built = await _build(stub, tenant, session_id, run_id)
    bogus = await stub.ReportUsage(
        _usage(
            tenant,
            session_id,
            built.request_sequence,
            input_tokens=max(1, int(built.estimated_input_tokens * times)),
            idempotency_key="bogus",
        )
    )
    assert not bogus.absorbed and bogus.factor_ppm == 1_000_000 and bogus.samples == 0
    assert await _factor(pool, tenant) is None
    fair = await stub.ReportUsage(
        _usage(
            tenant,
            session_id,
            built.request_sequence,
            input_tokens=built.estimated_input_tokens * 3,
            idempotency_key="fair",
        )
    )
    assert fair.absorbed and fair.samples == 1 and fair.factor_ppm > 2_900_000


async def test_a_run_continued_on_another_model_applies_no_factor_of_the_old_one(
    stub: Any, pool: Any
) -> None:
    """The factor resets when the model changes (the spec). A run whose checkpoint pinned
    the old model's factor, continued after a MODEL_CHANGED rotation, applied it on the new
    model (3.5x here; at 4x every Build of the run was refused BUDGET_EXCEEDED), and
    ReportUsage then learned the new model's factor against it (an audit). The checkpoint
    names the model its factor is for; a Build on another model applies none."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    first = await _start(stub, tenant, session_id, "hi")
    built = await _build(stub, tenant, session_id, first)
    learned = await stub.ReportUsage(
        _usage(
            tenant,
            session_id,
            built.request_sequence,
            input_tokens=built.estimated_input_tokens * 7 // 2,
        )
    )
    assert learned.absorbed and learned.factor_ppm > 3_000_000
    run_id = await _start(stub, tenant, session_id, "and now?")  # pins 3.5x for gpt-4o
    pinned = await _build(stub, tenant, session_id, run_id)
    assert pinned.request_sequence > 0
    (recorded,) = [
        e
        for e in await _events(pool, tenant, session_id, "model.request.started")
        if e["run_id"] == run_id
    ]
    assert recorded["estimator_factor_ppm"] == learned.factor_ppm
    rotated = spec(model_id="claude-sonnet-4-5", reserve_output_tokens=RESERVE)
    await stub.Rotate(
        pb.RotateRequest(
            tenant_id=tenant,
            session_id=session_id,
            from_epoch=1,
            reason=pb.PLAN_REASON_MODEL_CHANGED,
            spec=rotated,
        )
    )
    moved = await _build(stub, tenant, session_id, run_id)  # the same checkpoint
    assert moved.request.model_id == "claude-sonnet-4-5"
    recorded = [
        e
        for e in await _events(pool, tenant, session_id, "model.request.started")
        if e["run_id"] == run_id
    ]
    assert recorded[-1]["estimator_factor_ppm"] == 1_000_000


async def test_a_request_reported_again_under_another_key_is_learned_once(
    stub: Any, pool: Any
) -> None:
    """One response is one sample: a report under a second key (another worker's resend,
    a client without the fixed key) was learned again, contradictory figures too (an
    audit). It is recorded, not absorbed; the factor is the first report's."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "hi")
    built = await _build(stub, tenant, session_id, run_id)
    estimated = built.estimated_input_tokens
    first = await stub.ReportUsage(
        _usage(
            tenant,
            session_id,
            built.request_sequence,
            input_tokens=2 * estimated,
            idempotency_key="a",
        )
    )
    again = await stub.ReportUsage(
        _usage(
            tenant,
            session_id,
            built.request_sequence,
            input_tokens=estimated // 2,
            idempotency_key="b",
        )
    )
    assert first.absorbed and not again.absorbed
    assert (again.factor_ppm, again.samples) == (first.factor_ppm, 1)
    assert await _factor(pool, tenant) == (first.factor_ppm, 1)
    reported = await _events(pool, tenant, session_id, "model.usage.reported")
    assert [r["absorbed"] for r in reported] == [True, False]


async def test_report_usage_of_a_request_another_tokenizer_counted_learns_nothing(
    stub: Any, pool: Any
) -> None:
    """A request whose estimate another tokenizer counted (a replica configured apart, a
    registry change) says nothing about this replica's tokenizer for the model: reported,
    it is recorded and moves no factor. Before, it was learned as this tokenizer's."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "hi")
    built = await _build(stub, tenant, session_id, run_id)
    await pool.execute(
        "UPDATE session_events SET payload = jsonb_set(payload, '{tokenizer}', '\"elsewhere\"')"
        " WHERE tenant_id = $1 AND session_id = $2 AND sequence = $3",
        tenant,
        UUID(session_id),
        built.request_sequence,
    )
    report = _usage(
        tenant, session_id, built.request_sequence, input_tokens=3 * built.estimated_input_tokens
    )
    answered = await stub.ReportUsage(report)
    assert not answered.absorbed and answered.samples == 0
    assert await _factor(pool, tenant) is None
    # The same report of a request this replica's tokenizer counted is learned.
    built = await _build(stub, tenant, session_id, run_id)
    report = _usage(
        tenant, session_id, built.request_sequence, input_tokens=3 * built.estimated_input_tokens
    )
    assert (await stub.ReportUsage(report)).absorbed


@pytest.mark.parametrize("suffix", ["-20250929", "-2024-08-06"])
async def test_report_usage_under_a_dated_snapshot_of_the_planned_model_is_learned(
    stub: Any, pool: Any, suffix: str
) -> None:
    """A provider's response names the snapshot that answered ("claude-sonnet-4-5-20250929"
    for a request to "claude-sonnet-4-5"): a worker passing it on was told nothing, and the
    factor never moved. The snapshot counts as the planned model, and the response says
    whether the report was absorbed; a lookalike that is not a date is another model."""
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "hi")
    built = await _build(stub, tenant, session_id, run_id)
    tokens = 2 * built.estimated_input_tokens
    lookalike = await stub.ReportUsage(
        _usage(
            tenant, session_id, built.request_sequence, model_id=MODEL + "-v2", input_tokens=tokens
        )
    )
    assert not lookalike.absorbed and await _factor(pool, tenant) is None
    built = await _build(stub, tenant, session_id, run_id)
    dated = await stub.ReportUsage(
        _usage(
            tenant, session_id, built.request_sequence, model_id=MODEL + suffix, input_tokens=tokens
        )
    )
    assert dated.absorbed and dated.samples == 1 and dated.factor_ppm > 1_000_000
    assert await _factor(pool, tenant) == (dated.factor_ppm, 1)


async def test_report_usage_rejects_bad_input_and_unknown_requests(stub: Any, pool: Any) -> None:
    tenant = _tenant()
    session_id, _ = await _open(stub, tenant, room=0)
    run_id = await _start(stub, tenant, session_id, "hi")
    built = await _build(stub, tenant, session_id, run_id)
    cases = [
        (_usage(tenant, session_id, 0, input_tokens=5), "request_sequence"),
        (_usage(tenant, session_id, built.request_sequence, input_tokens=-1), "input_tokens"),
        (_usage(tenant, session_id, built.request_sequence, model_id=""), "model_id"),
        (_usage(tenant, session_id, built.request_sequence), "input_tokens"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.ReportUsage(request)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert details(bad.value)[1] == [field]
    not_a_request = built.request_sequence - 1  # the run's seeding message
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.ReportUsage(_usage(tenant, session_id, not_a_request, input_tokens=5))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert details(missing.value)[0] == "REQUEST_NOT_FOUND"
    with pytest.raises(grpc.aio.AioRpcError) as foreign:
        await stub.ReportUsage(
            _usage(_tenant(), session_id, built.request_sequence, input_tokens=5)
        )
    assert foreign.value.code() == grpc.StatusCode.NOT_FOUND
    assert await _events(pool, tenant, session_id, "model.usage.reported") == []
    assert await _factor(pool, tenant) is None


async def test_an_openai_plan_counts_its_instructions_as_sent(stub: Any) -> None:
    """OpenAI's `instructions` join Region A's blocks with a blank line, which the plan's
    prefix_tokens left uncounted (each block counted alone): with 20 skills, a tight
    request went 8 tokens over its budget (an audit). The system classes now hold the
    instructions as sent, counted by the model's own tokenizer."""
    from context_engine.tokenizers import load_encodings

    encoding = load_encodings(None)["o200k_base"]
    plan_spec = spec(model_id=MODEL, reserve_output_tokens=RESERVE)
    for n in range(20):
        plan_spec.skills.append(
            pb.SkillCatalogEntry(name=f"skill{n}", description=f"Does thing {n}", version="1")
        )
    tenant, session_id = _tenant(), new_id()
    planned = await stub.Plan(
        pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=plan_spec)
    )
    run_id = await _start(stub, tenant, session_id, "Hello")
    built = await _build_at(stub, tenant, session_id, run_id, _WEDNESDAY)
    instructions = json.loads(built.provider_payload)["instructions"]
    sent = len(encoding.encode(instructions, disallowed_special=()))
    classes = planned.plan.prefix_classes
    system = sum(c.tokens for c in classes if c.class_name != "tool_definitions")
    assert instructions.count("\n\n") >= 20 and sent <= system, (sent, system)
