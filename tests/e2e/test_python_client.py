"""The Python client (clients/python) drives a short session against the real server.

The server is the in-process grpc.aio server of tests/conftest.py over a fresh PostgreSQL
database; the client is imported from its source tree (tests/e2e/conftest.py).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import pickle
import re
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta
from typing import Any
from uuid import UUID

import grpc
import grpc.experimental
import pytest

from context_engine_client import (
    Aborted,
    BuildResult,
    ClientError,
    ContextEngineClient,
    ContextEngineError,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ModelTurn,
    NotFound,
    ResourceExhausted,
    Run,
    Session,
    ToolCallRequest,
    ToolOutput,
    Unauthenticated,
    Unavailable,
    UnreportedUsage,
    Usage,
    arguments_problem,
    assistant_message,
    channel_options,
    pb,
    tool,
    tool_call,
    tool_result,
    user_message,
    wire_tool_name,
)
from context_engine_client.client import _timestamp

pytestmark = pytest.mark.integration

TENANT = "tenant-client-py"
NOW = datetime(2026, 3, 14, 23, 40, tzinfo=UTC)
SCHEMA = {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}


def _spec() -> pb.PlanSpec:
    return pb.PlanSpec(
        model_id="claude-sonnet-4-5",
        agent=pb.AgentSpec(agent_id="trips", version="1", instructions="Plan train trips."),
        principal=pb.Principal(principal_id="ada", scopes=["web.read"], scope_label="owner"),
        tools=[
            tool(
                "web.fetch",
                "Fetch a page.",
                SCHEMA,
                required_scopes=["web.read"],
                side_effect=pb.SIDE_EFFECT_NETWORK_READ,
            )
        ],
        environment=pb.SessionEnvironment(surface="chat", time_zone="Europe/Paris"),
    )


@pytest.fixture
async def client(grpc_server: Any) -> Any:
    async with ContextEngineClient(f"127.0.0.1:{grpc_server.port}", TENANT) as c:
        yield c


class ScriptedModel:
    """A model that asks for one tool, then answers; records what it was sent."""

    def __init__(self) -> None:
        self.seen: list[BuildResult] = []

    async def __call__(self, build: BuildResult) -> ModelTurn:
        self.seen.append(build)
        # What a provider would report: the prefix read from cache after the first call.
        cached = build.response.prefix_tokens if len(self.seen) > 1 else 0
        usage = Usage(
            input_tokens=build.response.estimated_input_tokens - cached,
            cache_read_input_tokens=cached,
            cache_creation_input_tokens=build.response.prefix_tokens - cached,
            output_tokens=40,
        )
        if len(self.seen) == 1:
            # A provider answers with the wire name ("web.fetch" is sent as "web-fetch").
            call = ToolCallRequest("call-1", "web-fetch", {"url": "https://trains.example"})
            return ModelTurn(text="Let me look.", tool_calls=[call], usage=usage)
        return ModelTurn(text="The 08:04 TGV gets you to Lyon by 10:00.", usage=usage)


async def _fetch(call: ToolCallRequest) -> ToolOutput:
    assert call.name == "web.fetch", "the tool loop maps wire names back"
    assert call.parsed_arguments() == {"url": "https://trains.example"}
    return ToolOutput("08:04 TGV 6601 Paris-Lyon", source="tool:web.fetch")


def _block_kinds(build: BuildResult) -> list[str]:
    return [
        str(block.WhichOneof("kind"))
        for message in build.request.messages
        for block in message.blocks
    ]


async def test_tool_loop_keeps_one_prefix_and_logs_the_pair(client: Any) -> None:
    session = await client.open_session(_spec())
    assert session.created and session.plan.epoch == 1
    assert session.unknown_tool_names == ()
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    assert run.checkpoint_version == 1

    model = ScriptedModel()
    clock = iter([NOW, NOW + timedelta(minutes=30)])  # crosses midnight in Paris
    result = await run.tool_loop(model, _fetch, now=lambda: next(clock))

    assert result.final.text.startswith("The 08:04 TGV")
    assert len(result.builds) == 2
    assert result.prefix_hashes == {session.plan.prefix_sha256}
    # Usage went back for each build: the second request read the whole prefix from cache.
    assert len(result.reports) == 2
    assert result.reports[0].cached_prefix_ppm == 0
    assert result.reports[1].cached_prefix_ppm == 1_000_000
    assert result.reports[1].factor_ppm > 0
    # One append per step: the call and its result went in together, then the answer.
    assert run.checkpoint_version == 3
    assert "tool_call" not in _block_kinds(result.builds[0])
    second = _block_kinds(result.builds[1])
    assert second.index("tool_call") < second.index("tool_result")
    logged = [
        block.tool_call.tool_name
        for message in result.builds[1].request.messages
        for block in message.blocks
        if block.WhichOneof("kind") == "tool_call"
    ]
    assert logged == ["web.fetch"]
    assert result.builds[1].tool_name("web-fetch") == "web.fetch"

    # Build is pure: the same checkpoint and clock give the same bytes.
    first, again = await run.build(now=NOW), await run.build(now=NOW)
    assert first.request_sha256 == again.request_sha256
    assert first.prefix_sha256 == again.prefix_sha256 == session.plan.prefix_sha256
    assert first.checkpoint_version == again.checkpoint_version == 3
    assert again.request_sequence > first.request_sequence


async def test_next_run_carries_history_under_the_same_prefix(client: Any) -> None:
    session = await client.open_session(_spec())
    first = await session.start_run("Trains to Lyon?")
    await first.tool_loop(ScriptedModel(), _fetch, now=NOW)
    second = await session.start_run("And back on Sunday?")
    built = await second.build(now=NOW)
    texts = [
        block.text
        for message in built.request.messages
        for block in message.blocks
        if block.WhichOneof("kind") == "text"
    ]
    assert any("08:04 TGV gets you to Lyon" in text for text in texts)
    assert built.prefix_sha256 == session.plan.prefix_sha256
    reopened = await client.session(session.session_id)
    assert reopened.plan.prefix_sha256 == session.plan.prefix_sha256


async def test_attachments_are_added_where_the_placements_say(client: Any) -> None:
    """payload_with_attachments inserts each attachment's part just before its message's
    text, the carried message's and the new one's, and changes nothing else."""
    session = await client.open_session(_spec())
    first = await session.start_run(
        "What is in this picture?", attachments=[pb.Attachment(kind="image", ref="store://p.png")]
    )
    await first.append([assistant_message("A cat on a train.")])
    second = await session.start_run(
        "And this report?", attachments=[pb.Attachment(kind="pdf", ref="store://r.pdf", pages=2)]
    )
    built = await second.build(now=NOW)
    assert [p.attachments[0].attachment.ref for p in built.attachment_placements] == [
        "store://p.png",
        "store://r.pdf",
    ]

    def part(send: pb.AttachmentSend) -> dict[str, Any]:
        assert send.content  # both fit the budget
        return {"type": "document", "source": {"type": "url", "url": send.attachment.ref}}

    sent = built.payload_with_attachments(part)
    assert sent == built.payload_with_attachments(part), "the same bytes every time"
    body, original = json.loads(sent), json.loads(built.provider_payload)
    texts = {"What is in this picture?": "store://p.png", "And this report?": "store://r.pdf"}
    found = 0
    for message in body["messages"]:
        content = message["content"]
        for n, block in enumerate(content):
            ref = next((r for t, r in texts.items() if t in block.get("text", "")), None)
            if ref is not None:
                assert content[n - 1]["source"]["url"] == ref  # just before its text
                found += 1
        message["content"] = [b for b in content if b.get("type") != "document"]
    assert found == 2 and body == original  # nothing else changed
    # Byte for byte, too: with no parts the payload is the server's, keys in its order.
    assert built.payload_with_attachments(lambda send: []) == built.provider_payload
    # A session without attachments keeps its payload's bytes.
    other = await client.open_session(_spec())
    plain = await (await other.start_run("No files.")).build(now=NOW)
    assert not plain.attachment_placements
    assert plain.payload_with_attachments(part) == plain.provider_payload


async def test_errors_are_typed_with_reason_and_field(client: Any) -> None:
    session = await client.open_session(_spec())
    run = await session.start_run("Hello")

    with pytest.raises(InvalidArgument) as orphan:
        await run.append(tool_result("never-called", "web.fetch", "text"))
    assert orphan.value.reason == "ORPHANED_TOOL_ITEM"
    assert orphan.value.field == "items[0].tool_result.call_id"
    assert run.checkpoint_version == 1  # bad input changed nothing
    # The key the wrapper made travels with the error, for a resend that must reuse it.
    assert orphan.value.idempotency_key
    with pytest.raises(InvalidArgument) as again:
        await run.append(
            tool_result("never-called", "web.fetch", "text"),
            idempotency_key=orphan.value.idempotency_key,
        )
    assert again.value.idempotency_key == orphan.value.idempotency_key

    stale = session.run(run.run_id, checkpoint_version=1)
    await run.append(_assistant("Hi."))
    with pytest.raises(Aborted) as conflict:
        await stale.append(_assistant("Hi again."))
    assert conflict.value.reason == "CHECKPOINT_VERSION_CONFLICT"

    with pytest.raises(NotFound) as missing:
        await client.session(str(uuid.uuid4()))
    assert missing.value.reason == "SESSION_NOT_FOUND"
    assert missing.value.field == "session_id"
    assert missing.value.idempotency_key == ""  # GetPlan sends none

    spec = _spec()
    spec.tools[0].input_schema_json = "{not json"
    with pytest.raises(InvalidArgument) as bad_spec:
        await client.open_session(spec)
    assert bad_spec.value.reason == "INVALID_FIELD"
    assert bad_spec.value.field == "spec.tools[0].input_schema_json"


def _assistant(text: str) -> pb.ConversationItem:
    return pb.ConversationItem(assistant_message=pb.AssistantMessage(text=text))


async def test_a_build_over_4_mib_is_received_on_the_clients_own_channel(client: Any) -> None:
    # gpt-4.1's window takes about 2.4 MB of text without compaction, and the response
    # carries it twice (the neutral request and the provider payload): past gRPC's 4 MiB
    # receive default, which the client raises.
    spec = _spec()
    spec.model_id = "gpt-4.1"
    session = await client.open_session(spec)
    run = await session.start_run("Summarise the notes below.")
    words = ("international", "administration", "understanding", "responsibility")
    for n in range(3):
        text = " ".join(words[(k * 7 + n) % len(words)] for k in range(60_000))
        await run.append(assistant_message(text))
    built = await run.build(now=NOW)
    assert not built.response.needs_compaction
    assert built.response.ByteSize() > 4 * 1024 * 1024


# --- retries: a write whose answer is lost ------------------------------------------------


class AnswerDroppingProxy:
    """A TCP proxy between client and server. Armed, it drops both connections at the first
    response HEADERS frame (HTTP/2 type 1 on a stream) the server sends: the server has
    answered, so the call was carried out, yet the client sees its connection drop before
    any response, as after a sidecar restart or a network blip: UNAVAILABLE, which the
    channel's retry policy resends."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.armed = False
        self.dropped = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, client_in: asyncio.StreamReader, client_out: Any) -> None:
        server_in, server_out = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def up() -> None:
            while data := await client_in.read(65536):
                server_out.write(data)
                await server_out.drain()
            server_out.close()

        async def down() -> None:
            pending = b""
            while data := await server_in.read(65536):
                pending += data
                frames = b""
                # A server's side of an HTTP/2 connection is frames from its first byte:
                # a 9-byte header (24-bit length, type, flags, stream id), then the payload.
                while len(pending) >= 9 and len(pending) >= 9 + int.from_bytes(pending[:3]):
                    end = 9 + int.from_bytes(pending[:3])
                    frame, pending = pending[:end], pending[end:]
                    if self.armed and frame[3] == 1 and int.from_bytes(frame[5:9]) & 0x7FFFFFFF:
                        self.armed = False
                        self.dropped += 1
                        client_out.transport.abort()
                        server_out.transport.abort()
                        return
                    frames += frame
                client_out.write(frames)
                await client_out.drain()
            client_out.close()

        await asyncio.gather(up(), down(), return_exceptions=True)


@pytest.fixture
async def proxied(grpc_server: Any) -> AsyncIterator[tuple[AnswerDroppingProxy, Any]]:
    proxy = AnswerDroppingProxy(grpc_server.port)
    await proxy.start()
    async with ContextEngineClient(f"127.0.0.1:{proxy.port}", f"t-{uuid.uuid4()}") as c:
        yield proxy, c
    await proxy.stop()


async def _events(pool: Any, session_id: str, kind: str) -> int:
    count: int = await pool.fetchval(
        "SELECT count(*) FROM session_events WHERE session_id = $1 AND type = $2",
        UUID(session_id),
        kind,
    )
    return count


async def test_a_rotation_whose_answer_is_lost_is_resent_and_answers_once(
    proxied: tuple[AnswerDroppingProxy, Any], pool: Any
) -> None:
    """Session.rotate sends an idempotency key: the channel's resend of a rotation that
    landed answers with its plan, rather than EPOCH_CONFLICT for a rotation that happened."""
    proxy, client = proxied
    session = await client.open_session(_spec())
    proxy.armed = True
    plan = await session.rotate(pb.PLAN_REASON_AGENT_CHANGED, detail="v2")
    assert proxy.dropped == 1
    assert plan.epoch == session.plan.epoch == 2
    assert (await session.refresh_plan()).epoch == 2
    assert await _events(pool, session.session_id, "context.epoch.rotated") == 1


async def test_an_offer_whose_answer_is_lost_is_recorded_once(
    proxied: tuple[AnswerDroppingProxy, Any], pool: Any
) -> None:
    proxy, client = proxied
    session = await client.open_session(_spec())
    await session.start_run("I live in Paris.")
    proxy.armed = True
    offered = await session.offer_fact_candidates()
    assert proxy.dropped == 1
    assert offered.event_sequence > 0
    assert await _events(pool, session.session_id, "memory.fact_candidates.offered") == 1


async def test_a_build_whose_answer_is_lost_is_not_resent_by_the_channel(
    proxied: tuple[AnswerDroppingProxy, Any], pool: Any
) -> None:
    """A Build whose answer was lost was recorded; the channel's retry policy resent it,
    recording a second request the worker never saw, which no usage is reported for (a
    review). Build has no retry policy: the caller sees UNAVAILABLE, one request recorded."""
    proxy, client = proxied
    session = await client.open_session(_spec())
    run = await session.start_run("Trains to Lyon?")
    proxy.armed = True
    with pytest.raises(ContextEngineError) as lost:
        await run.build()
    assert proxy.dropped == 1 and lost.value.code.name == "UNAVAILABLE"
    assert await _events(pool, session.session_id, "model.request.started") == 1
    assert (await run.build()).request_sequence > 0  # a Build of one's own still goes


# --- the rest of the wrapper --------------------------------------------------------------

RESERVE = 1024


async def _run_over_its_budget(client: Any) -> tuple[Any, Any]:
    """A run whose body does not fit until the history before it is compacted."""
    probe = await client.open_session(_spec())
    spec = _spec()
    spec.reserve_output_tokens = RESERVE
    spec.policy_cap_tokens = probe.plan.prefix_tokens + RESERVE + 4_000
    session = await client.open_session(spec)
    first = await session.start_run("Tell me everything.")
    await first.append(assistant_message(" ".join(["lorem"] * 6_000)))
    return session, await session.start_run("And now?")


async def _summarize(prepared: Any) -> str:
    return "The assistant said a lot of lorem."


async def test_every_rpc_has_a_method_and_a_channel_of_ones_own_gets_the_retry_policy(
    grpc_server: Any,
) -> None:
    """GetBuild and EraseSubject were reachable only through `call()`; a client given its
    own channel lacked the retry policy the README promised (`channel_options()`)."""
    import grpc

    target = f"127.0.0.1:{grpc_server.port}"
    async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
        client = ContextEngineClient(target, TENANT, channel=channel)
        session = await client.open_session(_spec())
        run = await session.start_run("Trains to Lyon?")
        built = await run.build(now=NOW)
        again = await client.get_build(session.session_id, built.request_sequence)
        assert again.provider_payload == built.provider_payload
        assert again.request_sha256 == built.request_sha256
        erased = await client.erase_subject(f"nobody-{uuid.uuid4()}")
        assert list(erased.bound_run_ids) == [] and erased.redacted_items == 0
    options = dict(channel_options())
    assert options["grpc.enable_retries"] == 1
    assert "UNAVAILABLE" in options["grpc.service_config"]


async def test_a_tool_loop_again_after_an_append_whose_answer_was_lost_runs_no_tool_twice(
    client: Any,
) -> None:
    """The step's append commits, but its answer never arrives (a deadline passed while
    it committed). The loop built from the checkpoint it last saw, so calling it again sent
    the model the log without the results and ran the tool a second time; now each step
    builds the latest checkpoint. The usage report follows the append, so it cannot lose
    the step's items either."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = run.client.call
    lost: list[str] = []

    async def answer_lost_once(method: str, request: Any, *, timeout: Any = None) -> Any:
        response = await real_call(method, request, timeout=timeout)
        if method == "AppendItems" and not lost:
            lost.append(request.idempotency_key)
            raise TimeoutError("the append's answer was lost")
        return response

    run.client.call = answer_lost_once  # type: ignore[method-assign]
    model, fetched = ScriptedModel(), []

    async def fetch(call: ToolCallRequest) -> ToolOutput:
        fetched.append(call.call_id)
        return await _fetch(call)

    with pytest.raises(TimeoutError):
        await run.tool_loop(model, fetch, now=NOW)
    assert fetched == ["call-1"] and lost
    result = await run.tool_loop(model, fetch, now=NOW)
    assert fetched == ["call-1"], "the tool ran again"
    assert "tool_result" in _block_kinds(result.builds[0])  # the logged result, seen
    assert result.final.text.startswith("The 08:04 TGV")
    assert run.checkpoint_version == 3


async def test_a_usage_report_that_fails_does_not_lose_the_final_answer(client: Any) -> None:
    """The reports follow the appends; one that fails (the engine unreachable after the
    final answer was appended) raised out of the loop, so the caller lost the answer and a
    second tool_loop asked the model again and appended a second one. The loop now returns
    the answer with the failed reports, which resend under the build's own key."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = run.client.call

    async def usage_unreachable(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "ReportUsage":
            raise Unavailable(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        return await real_call(method, request, timeout=timeout)

    run.client.call = usage_unreachable  # type: ignore[method-assign]
    result = await run.tool_loop(ScriptedModel(), _fetch, now=NOW)
    run.client.call = real_call  # type: ignore[method-assign]
    assert result.final.text.startswith("The 08:04 TGV") and not result.reports
    assert [type(e).__name__ for _, _, e in result.unreported] == ["Unavailable"] * 2
    assert run.checkpoint_version == 3  # the pair, then the one final answer
    for entry in result.unreported:
        build, usage, _ = entry  # a tuple still, with the model that answered besides
        report = await session.report_usage(build, usage, model=entry.model)
        assert report.samples >= 1

    # A report refused for what it says is kept too, not resendable (retryable False):
    # raised, it lost the final answer just the same (an audit).
    async def bad_usage(build: BuildResult) -> ModelTurn:
        return ModelTurn(text="Done.", usage=Usage(input_tokens=-1))

    other = await session.start_run("And back?")
    kept = await other.tool_loop(bad_usage, _fetch, now=NOW)
    assert kept.final.text == "Done."
    assert [type(e).__name__ for _, _, e in kept.unreported] == ["InvalidArgument"]
    assert not kept.unreported[0][2].retryable

    # Nor a usage the request cannot carry (a review: protobuf's TypeError was raised).
    async def float_usage(build: BuildResult) -> ModelTurn:
        return ModelTurn(text="Done again.", usage=Usage(input_tokens=12.5))  # type: ignore[arg-type]

    third = await session.start_run("And the day after?")
    kept = await third.tool_loop(float_usage, _fetch, now=NOW)
    assert kept.final.text == "Done again."
    assert [type(e).__name__ for _, _, e in kept.unreported] == ["TypeError"]


async def test_an_error_that_ends_the_loop_carries_the_reports_it_could_not_send(
    client: Any,
) -> None:
    """A report that failed at step one, then an append that fails for good at step two:
    the raised error carries the unsent report (`unreported`) and the builds, which the
    loop dropped before (an audit)."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = run.client.call
    appends: list[str] = []

    async def failing(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "ReportUsage":
            raise Unavailable(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        if method == "AppendItems":
            appends.append(request.idempotency_key)
            if len(appends) == 2:
                raise Internal(grpc.StatusCode.INTERNAL, "a proxy failed")
        return await real_call(method, request, timeout=timeout)

    run.client.call = failing  # type: ignore[method-assign]
    with pytest.raises(Internal) as caught:
        await run.tool_loop(ScriptedModel(), _fetch, now=NOW)
    run.client.call = real_call  # type: ignore[method-assign]
    unsent = caught.value.unreported  # type: ignore[attr-defined]
    # Step one's report, and step two's: its append failed, the model's tokens were spent
    # all the same (an audit: that usage was lost).
    assert [type(e).__name__ for _, _, e in unsent] == ["Unavailable", "Unavailable"]
    builds = caught.value.builds  # type: ignore[attr-defined]
    assert len(builds) == 2
    assert [b for b, _, _ in unsent] == builds
    assert caught.value.pending_request is not None
    # The step's turn, and that it was the final answer: resend it and stop.
    assert caught.value.final is True  # type: ignore[attr-defined]
    assert caught.value.turn.text.startswith("The 08:04 TGV")  # type: ignore[attr-defined]


async def test_a_final_answer_whose_append_failed_is_resent_not_asked_again(
    client: Any, pool: Any
) -> None:
    """docs said: resend `pending_request`, then call tool_loop again. For the final answer
    that asked the model again and appended a second answer (an audit). The error now says
    it was the final one and carries it: resent, the log holds one answer."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = run.client.call
    appends = 0

    async def failing(method: str, request: Any, *, timeout: Any = None) -> Any:
        nonlocal appends
        if method == "AppendItems":
            appends += 1
            if appends == 2:
                raise Internal(grpc.StatusCode.INTERNAL, "a proxy failed")
        return await real_call(method, request, timeout=timeout)

    run.client.call = failing  # type: ignore[method-assign]
    with pytest.raises(Internal) as caught:
        await run.tool_loop(ScriptedModel(), _fetch, now=NOW)
    run.client.call = real_call  # type: ignore[method-assign]
    error: Any = caught.value
    assert error.final is True
    # Its usage was reported all the same (the engine answered: not kept unsent).
    assert error.unreported == []
    await run.resend_append(error.pending_request)
    assert await _answers(pool, run.session_id) == ["Let me look.", error.turn.text]


async def _answers(pool: Any, session_id: str) -> list[str]:
    """The assistant messages logged in a session, in order."""
    rows = await pool.fetch(
        "SELECT payload FROM session_events WHERE session_id = $1"
        " AND type = 'assistant.message.created' ORDER BY sequence",
        UUID(session_id),
    )
    return [r["payload"].get("text", "") for r in rows]


async def test_a_final_answer_overtaken_by_a_later_write_is_asked_again(
    client: Any, pool: Any
) -> None:
    """The user's next message lands while the model writes its final answer. Rebased
    after it, the stale answer left that message unanswered, and the loop returned as if
    done (an audit). Nothing of the overtaken answer is written now: its usage is reported
    and the model is asked again, with the new message in its request."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    model = ScriptedModel()
    asked: list[str] = []

    async def answering_while_the_user_writes(build: BuildResult) -> ModelTurn:
        turn = await model(build)
        asked.append(turn.text)
        if len(asked) == 2:  # the first final answer
            other = session.run(run.run_id, checkpoint_version=run.checkpoint_version)
            await other.append(user_message("Actually, make it Marseille."))
        return turn

    result = await run.tool_loop(answering_while_the_user_writes, _fetch, now=NOW)
    assert len(asked) == 3 and len(result.builds) == 3
    assert "Marseille" in result.builds[-1].provider_payload.decode()
    assert await _answers(pool, run.session_id) == ["Let me look.", result.final.text]
    assert len(result.reports) == 3  # the overtaken answer's tokens were spent too


async def test_a_tool_that_raises_still_reports_the_models_usage(client: Any) -> None:
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")

    async def broken(call: ToolCallRequest) -> ToolOutput:
        raise RuntimeError("the tool's backend is down")

    with pytest.raises(RuntimeError) as caught:
        await run.tool_loop(ScriptedModel(), broken, now=NOW)
    error: Any = caught.value
    assert error.final is False and error.turn.tool_calls
    assert error.unreported == []  # reported: it was lost before (an audit)
    report = await session.report_usage(error.builds[0], error.turn.usage)
    assert report.samples >= 1  # the same key: the report landed once


async def test_a_callers_channel_options_win_over_the_clients(grpc_server: Any) -> None:
    """grpc takes an option's first value and the client's came first, so a caller's
    receive limit (or retry switch) was silently ignored (an audit)."""
    target = f"127.0.0.1:{grpc_server.port}"
    async with ContextEngineClient(
        target, TENANT, options=[("grpc.max_receive_message_length", 100)]
    ) as small:
        with pytest.raises(ResourceExhausted):
            await small.open_session(_spec())


async def test_a_token_is_checked_before_it_is_sent(grpc_server: Any) -> None:
    """A bearer token went in clear to any target, and one with a line ending raised
    grpc's own error at the first call (an audit)."""
    token = "t" * 32
    for target in ("10.1.2.3:50051", "engine.example:443", "ipv4:127.0.0.1:1,10.0.0.1:1"):
        with pytest.raises(ValueError, match="in clear"):
            ContextEngineClient(target, TENANT, token)
        ContextEngineClient(target, TENANT, token, allow_insecure_token=True)
        ContextEngineClient(target, TENANT, token, credentials=grpc.ssl_channel_credentials())
    for target in ("127.0.0.1:50051", "localhost:1", "[::1]:1", "unix:/tmp/engine.sock"):
        ContextEngineClient(target, TENANT, token)
    with pytest.raises(ValueError, match="header value"):
        ContextEngineClient("127.0.0.1:1", TENANT, token + "\n")
    with pytest.raises(ValueError, match=r"grpc\.aio"):
        ContextEngineClient("x", TENANT, channel=grpc.insecure_channel("127.0.0.1:1"))
    # The tenant may be left to the identity, where there is one.
    with pytest.raises(ValueError, match="tenant_id"):
        ContextEngineClient("127.0.0.1:1", "")
    ContextEngineClient("127.0.0.1:1", "", token)


def test_insecure_credentials_are_plaintext_for_a_token() -> None:
    """grpc.experimental.insecure_channel_credentials() given as credentials= skipped the
    check, and grpc.aio opened a plaintext channel with them: the token went in clear to
    any target (an audit)."""
    token, insecure = "t" * 32, grpc.experimental.insecure_channel_credentials()
    with pytest.raises(ValueError, match="in clear"):
        ContextEngineClient("10.1.2.3:50051", TENANT, token, credentials=insecure)
    ContextEngineClient(
        "10.1.2.3:50051", TENANT, token, credentials=insecure, allow_insecure_token=True
    )
    ContextEngineClient("127.0.0.1:1", TENANT, token, credentials=insecure)


def test_an_ipv4_mapped_loopback_is_loopback_as_in_typescript_and_go() -> None:
    """ipaddress finds ::ffff:127.0.0.1 loopback from Python 3.13 only; Node's BlockList
    and Go's net.IP always did, so the clients disagreed on it (an audit)."""
    from context_engine_client.client import is_loopback

    mapped = ["[::ffff:127.0.0.1]:1", "::ffff:127.8.9.10", "ipv6:[::ffff:127.0.0.1]:1"]
    assert all(map(is_loopback, mapped))
    assert not any(map(is_loopback, ["[::ffff:10.0.0.1]:1", "ipv6:[::ffff:127.0.0.1]:1,[::2]:1"]))


def test_the_client_and_explain_agree_on_loopback() -> None:
    from context_engine.explain import is_loopback as engines
    from context_engine_client.client import is_loopback

    targets = [
        "127.0.0.1:1", "127.8.9.10:1", "localhost:1", "LOCALHOST", "[::1]:1", "::1",
        "ipv4:127.0.0.1:1,127.0.0.2:1", "ipv4:127.0.0.1:1,10.0.0.1:1", "ipv6:[::1]:1",
        "dns:///localhost:1", "dns:localhost:1", "unix:/s", "unix-abstract:s",
        "10.0.0.1:1", "engine:1", "[2001:db8::1]:1", "dns:///engine.example:443", "",
        "[::ffff:127.0.0.1]:1", "ipv6:[::ffff:127.0.0.1]:1", "[::ffff:10.0.0.1]:1",
    ]  # fmt: skip
    # The mapped addresses too: explain took them as not loopback below Python 3.13.
    assert [is_loopback(t) for t in targets] == [engines(t) for t in targets]
    assert sum(map(is_loopback, targets)) == 14


async def test_a_client_made_outside_the_loop_serves_in_it(grpc_server: Any) -> None:
    """A grpc.aio channel belongs to the loop it was opened on: a client made where no
    loop runs (a sync factory, here a thread) failed its first call on the loop that used
    it ("attached to a different loop": an audit)."""
    made = await asyncio.to_thread(ContextEngineClient, f"127.0.0.1:{grpc_server.port}", TENANT)
    async with made:
        assert (await made.open_session(_spec())).created


async def test_a_step_whose_append_meets_a_later_write_goes_after_it_and_runs_no_tool_twice(
    client: Any,
) -> None:
    """The user's next message lands on the run while its tool runs: the step's append is
    refused CHECKPOINT_VERSION_CONFLICT. Raised with a request that named the old version,
    it could never be resent as docs said, and a second tool_loop ran the tool again (an
    audit). The loop now resends it once, same key, at the version the error names."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    fetched: list[str] = []

    async def fetch_while_the_user_writes(call: ToolCallRequest) -> ToolOutput:
        fetched.append(call.call_id)
        other = session.run(run.run_id, checkpoint_version=run.checkpoint_version)
        await other.append(user_message("Actually, make it Marseille."))
        return await _fetch(call)

    result = await run.tool_loop(ScriptedModel(), fetch_while_the_user_writes, now=NOW)
    assert fetched == ["call-1"]
    assert result.final.text.startswith("The 08:04 TGV")
    assert run.checkpoint_version == 4  # the user's message, the step, the final answer


async def test_a_resend_of_an_old_append_does_not_take_the_version_back(client: Any) -> None:
    session = await client.open_session(_spec())
    run = await session.start_run("Hello")
    first = run._append_request([_assistant("One.")], None)
    await run.resend_append(first)
    await run.append(_assistant("Two."))
    assert run.checkpoint_version == 3
    again = await run.resend_append(first)  # landed long ago: its first answer
    assert again.checkpoint_version == 2
    assert run.checkpoint_version == 3  # was taken back to 2 (an audit)
    await run.append(_assistant("Three."))  # no spurious version conflict


async def test_open_session_errors_carry_the_session_id_the_plan_was_sent_with(
    client: Any,
) -> None:
    """Plan is made safe to resend by its session id: a timed-out Plan may have landed,
    and resending with the error's session_id finds it (a new id opens a second one)."""
    bad = _spec()
    bad.model_id = "no-such-model"
    with pytest.raises(InvalidArgument) as caught:
        await client.open_session(bad)
    assert UUID(caught.value.session_id)
    with pytest.raises(InvalidArgument) as named:
        await client.open_session(bad, session_id=caught.value.session_id)
    assert named.value.session_id == caught.value.session_id


async def test_a_closed_client_raises_the_clients_own_error(grpc_server: Any) -> None:
    closed = ContextEngineClient(f"127.0.0.1:{grpc_server.port}", TENANT)
    await closed.close()
    with pytest.raises(ClientError):  # grpc's UsageError leaked out (an audit)
        await closed.open_session(_spec())


def test_a_naive_now_is_this_hosts_local_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """datetime.now() is naive local time; protobuf read it as UTC, so the date shown to
    the model was off by the host's offset (an audit: 23:40 in Paris became the next day)."""
    monkeypatch.setenv("TZ", "Europe/Paris")
    time.tzset()
    try:
        naive = datetime(2026, 3, 14, 23, 40)
        stamp = _timestamp(naive)
        assert stamp.ToDatetime(tzinfo=UTC) == datetime(2026, 3, 14, 22, 40, tzinfo=UTC)
    finally:
        monkeypatch.undo()  # TZ as it was, then the process's zone read from it again
        time.tzset()


async def test_a_schemas_decimals_keep_their_bytes_when_attachments_are_added(
    client: Any,
) -> None:
    """payload_with_attachments serializes as the engine does (RFC 8785): json.dumps wrote
    0.00001 as 1e-05, so the cached tool definitions changed bytes whenever a request
    carried attachments (an audit)."""
    spec = _spec()
    spec.tools[0].input_schema_json = json.dumps(
        {
            "type": "object",
            "properties": {"ratio": {"type": "number", "multipleOf": 0.00001, "maximum": 1.5e-7}},
        }
    )
    session = await client.open_session(spec)
    run = await session.start_run(
        "Look at this.", attachments=[pb.Attachment(kind="image", ref="store://p.png")]
    )
    built = await run.build(now=NOW)
    assert b"0.00001" in built.provider_payload
    assert built.payload_with_attachments(lambda send: []) == built.provider_payload


async def test_the_tool_loop_compacts_when_the_body_does_not_fit(client: Any) -> None:
    _, run = await _run_over_its_budget(client)
    prepared: list[Any] = []

    async def summarize(input: Any) -> str:
        prepared.append(input)
        return await _summarize(input)

    async def call_model(build: BuildResult) -> ModelTurn:
        return ModelTurn(text="Done.", usage=Usage(input_tokens=10, output_tokens=2))

    async def run_tool(call: ToolCallRequest) -> str:
        raise AssertionError("no tools")

    result = await run.tool_loop(call_model, run_tool, summarize=summarize)
    assert len(prepared) == 1, "the loop compacted once"
    assert result.final.text == "Done."


async def test_a_large_tool_output_goes_with_its_excerpt_and_the_loop_goes_on(
    client: Any,
) -> None:
    """A result the model is about to read never yields: one larger than the body failed
    every Build of its run, and the tool loop had no way to give the output its excerpt
    (a client audit). ToolOutput.context_content is sent in its place; the log keeps the
    whole content."""
    probe = await client.open_session(_spec())
    spec = _spec()
    spec.reserve_output_tokens = RESERVE
    spec.policy_cap_tokens = probe.plan.prefix_tokens + RESERVE + 4_000
    session = await client.open_session(spec)
    run = await session.start_run("Fetch the long page.")
    page = " ".join(["timetable"] * 9_000)
    turns = iter(
        [
            ModelTurn(tool_calls=[ToolCallRequest("call-1", "web.fetch", {"url": "u"})]),
            ModelTurn(text="It is long; the 08:04 TGV."),
        ]
    )

    async def call_model(build: BuildResult) -> ModelTurn:
        return next(turns)

    async def run_tool(call: ToolCallRequest) -> ToolOutput:
        return ToolOutput(page, artifact_ref="pages/1", context_content=page[:2_000])

    result = await run.tool_loop(call_model, run_tool, now=NOW)
    assert result.final.text.startswith("It is long")
    sent = result.builds[-1].response.request
    results = [b.tool_result for m in sent.messages for b in m.blocks if b.HasField("tool_result")]
    assert results and all(len(r.content) < 4_000 for r in results)


async def test_a_compaction_retried_by_hand_with_its_key_lands_once(client: Any) -> None:
    """A CommitCompaction that timed out may have landed: compact again with its key (and
    the same summary) and the commit that landed answers."""
    _, run = await _run_over_its_budget(client)
    before = run.checkpoint_version
    compacted = await run.compact(_summarize, idempotency_key="compact-1")
    assert compacted == before + 1
    # The first attempt's answer was lost: its Run still holds the version it compacted.
    retry = run.session.run(run.run_id, checkpoint_version=before)
    assert await retry.compact(_summarize, idempotency_key="compact-1") == compacted
    assert not (await run.build(now=NOW)).needs_compaction


async def test_rotate_load_skill_update_working_state_and_a_child_run(client: Any) -> None:
    spec = _spec()
    spec.skills.append(
        pb.SkillCatalogEntry(
            name="rail",
            description="Rail tips.",
            version="1",
            trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION,
        )
    )
    session = await client.open_session(spec)
    run = await session.start_run("Trains to Lyon?")
    loaded = await session.load_skill(
        "rail", "Prefer TGV.", trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION, run_id=run.run_id
    )
    assert list(loaded.loaded) == ["rail"]
    # Naming no trust keeps the entry's: the same body again is a retry.
    again = await session.load_skill("rail", "Prefer TGV.", run_id=run.run_id)
    assert list(again.loaded) == ["rail"] and not again.newly_loaded
    updated = await run.update_working_state(
        pb.WorkingStateUpdate(objective="Find a train", add_constraints=["No night trains"]),
        writer=pb.WRITER_USER,
    )
    assert updated.checkpoint_version == run.checkpoint_version == 2
    own_id = str(uuid.uuid4())
    child = await session.start_child_run(run.run_id, "Look up the timetable.", run_id=own_id)
    assert child.run_id == own_id  # named by the caller, as start_run allows
    assert child.seed_event_sequence is None and child.checkpoint_version == 1
    plan = await session.rotate(pb.PLAN_REASON_AGENT_CHANGED, detail="v2")
    assert plan.epoch == session.plan.epoch == 2
    typo = _spec()
    typo.agent.enabled_tools.append("web.fetchh")
    await session.rotate(pb.PLAN_REASON_AGENT_CHANGED, spec=typo)
    assert session.unknown_tool_names == ("web.fetchh",)  # the rotated spec's, not Plan's
    await session.rotate(pb.PLAN_REASON_BUILDER_UPGRADED)  # no spec: the pinned one's stand
    assert session.unknown_tool_names == ("web.fetchh",)
    tools = await client.control_tools()
    assert [t.name for t in tools] == ["context.update_working_state"]


def _texts(build: BuildResult) -> str:
    """Every text the request carries, as one string (its serialized bytes)."""
    return build.request.SerializeToString().decode("utf-8", "replace")


async def test_the_tool_loop_relays_the_models_control_calls_itself(client: Any) -> None:
    """The model's context.update_working_state calls go to the engine as the model sent
    them; a refusal comes back to the model as the call's error result, which it corrects.
    The worker's run_tool never sees them."""
    spec = _spec()
    spec.tools.extend(await client.control_tools())
    session = await client.open_session(spec)
    run = await session.start_run("Trains to Lyon, never at night.")
    wire = wire_tool_name("context.update_working_state")
    seen: list[BuildResult] = []

    async def model(build: BuildResult) -> ModelTurn:
        seen.append(build)
        user_id = re.findall(r'<user source="user" id="([^"]+)"', _texts(build))[0]
        fact = {"statement": "The user avoids night trains"}
        if len(seen) == 1:  # cites what it cannot: an id no envelope shows
            arguments = {"add_facts": [{**fact, "source_item_ids": ["u-99"]}]}
        elif len(seen) == 2:
            arguments = {"add_facts": [{**fact, "source_item_ids": [user_id]}]}
        else:
            return ModelTurn(text="Noted: day trains only.")
        return ModelTurn(tool_calls=[ToolCallRequest(f"c{len(seen)}", wire, arguments)])

    async def run_tool(call: ToolCallRequest) -> ToolOutput:
        raise AssertionError(f"{call.name} is the engine's to run")

    result = await run.tool_loop(model, run_tool, now=NOW)
    assert result.final.text == "Noted: day trains only."
    # The refusal reached the model as the call's error result, naming the entry and the
    # id, in an envelope: it quotes the model's words, and no fact rests on it as trusted.
    refusal = re.search(
        r'<untrusted source="engine:context.update_working_state"[^>]*>\n'
        r"Not applied \(INVALID_FIELD at update\.add_facts\[0\]\.source_item_ids\[0\]\)"
        r": [^\n]*u-99",
        _texts(seen[1]),
    )
    assert refusal is not None
    block = _texts(seen[2])
    assert "Established" in block and "The user avoids night trains" in block
    assert "Established" in _texts(await run.build(now=NOW))  # the state holds it


async def test_a_call_the_engine_cannot_log_is_answered_not_run(client: Any) -> None:
    """Arguments the engine refuses to log (cut off, not an object, a 64-bit integer), and
    a tool output holding U+0000, failed the step's append after its tools had run, and
    the loop's retry ran them again (a review). Such a call is logged with no arguments
    and answered as an error, never run; U+0000 is sent as U+FFFD; the step lands."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains to Lyon?")
    wire = wire_tool_name("web.fetch")
    ran: list[str] = []
    turns = 0

    async def model(build: BuildResult) -> ModelTurn:
        nonlocal turns
        turns += 1
        if turns > 1:
            return ModelTurn(text="Done.")
        calls = [
            ToolCallRequest("cut", wire, '{"url": "https://tra'),
            ToolCallRequest("list", wire, '["https://trains.example"]'),
            ToolCallRequest("big", wire, '{"url": "x", "id": 18446744073709551615}'),
            ToolCallRequest("date", wire, {"on": date(2026, 3, 15)}),
            ToolCallRequest("ok", wire, {"url": "https://trains.example"}),
            # None, as providers send it for a tool without parameters: the engine's {}.
            ToolCallRequest("none", wire, ""),
        ]
        return ModelTurn(text="Checking\x00 now.", tool_calls=calls)

    async def run_tool(call: ToolCallRequest) -> ToolOutput:
        ran.append(call.call_id)
        return ToolOutput("08:04 TGV\x006601", source="tool:web.fetch")

    assert arguments_problem({"url": "x"}) == ""
    result = await run.tool_loop(model, run_tool, now=NOW)
    assert result.final.text == "Done." and ran == ["ok", "none"]
    told = _texts(result.builds[1])
    assert told.count("Not run: the call's arguments") == 4
    assert "are not a JSON object" in told and "beyond 2^53 - 1" in told
    assert "are not JSON-serializable" in told
    assert "08:04 TGV\ufffd6601" in told and "Checking\ufffd now." in told


def _logged_calls(build: BuildResult, run: Run) -> list[pb.ToolCall]:
    """The run's tool calls a build shows, in order."""
    return [
        block.tool_call
        for message in build.request.messages
        for block in message.blocks
        if block.WhichOneof("kind") == "tool_call" and block.run_id == run.run_id
    ]


_THINKING = json.dumps({"type": "thinking", "thinking": "Hmm.", "signature": "s"}).encode()


@pytest.mark.parametrize(
    "case",
    [
        "no call id",
        "a call id over 200 characters",
        "a call id twice in the turn",
        "a call id of an earlier step",
        "no tool name",
        "a reasoning item the engine cannot replay",
    ],
)
async def test_a_turn_the_engine_cannot_log_runs_no_tool(client: Any, case: str) -> None:
    """A call whose id the engine refuses (empty, over 200 characters, used twice in the
    run) or that names no tool, and a reasoning item it cannot replay, ran the step's
    tools, then the append was refused INVALID_FIELD: the results were lost, the pending
    request could not be resent, and the next tool_loop ran the tools again (an audit).
    Such a turn now raises ClientError before any tool of the step runs, carrying the
    turn; its usage is reported."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains to Lyon?")
    wire = wire_tool_name("web.fetch")
    ran: list[str] = []
    turns = 0

    def call(call_id: str, url: str = "https://trains.example") -> ToolCallRequest:
        return ToolCallRequest(call_id, wire, {"url": url})

    async def model(build: BuildResult) -> ModelTurn:
        nonlocal turns
        turns += 1
        usage = Usage(input_tokens=10, output_tokens=5)
        if case == "a call id of an earlier step":
            # Some providers number their calls per response: call_0 again at step two.
            return ModelTurn(tool_calls=[call("call_0", f"https://t/{turns}")], usage=usage)
        bad = {
            "no call id": [call("ok"), call("")],
            "a call id over 200 characters": [call("ok"), call("c" * 201)],
            "a call id twice in the turn": [call("c1"), call("c1", "https://other")],
            "no tool name": [call("ok"), ToolCallRequest("c2", "", {})],
            "a reasoning item the engine cannot replay": [call("ok")],
        }[case]
        reasoning = [(pb.PROVIDER_ANTHROPIC, _THINKING)]
        if case == "a reasoning item the engine cannot replay":
            reasoning.append((pb.PROVIDER_ANTHROPIC, b'{"type": "thinking"}'))  # no signature
        return ModelTurn(text="Looking.", tool_calls=bad, reasoning=reasoning, usage=usage)

    async def run_tool(request: ToolCallRequest) -> ToolOutput:
        ran.append(request.call_id)
        return ToolOutput("08:04 TGV 6601", source="tool:web.fetch")

    with pytest.raises(ClientError) as caught:
        await run.tool_loop(model, run_tool, now=NOW)
    error: Any = caught.value
    assert not isinstance(error, ContextEngineError)
    assert "cannot be logged" in str(error) and "no tool was run" in str(error)
    # The earlier step's call ran and is logged; the refused step ran nothing.
    assert ran == (["call_0"] if case == "a call id of an earlier step" else [])
    assert error.final is False and error.turn.tool_calls
    assert getattr(error, "pending_request", None) is None
    assert error.unreported == [] and len(error.builds) == turns  # its usage was reported
    logged = _logged_calls(await run.build(now=NOW), run)
    assert [c.call_id for c in logged] == ran


def test_a_reasoning_provider_by_enum_name_is_taken_as_protobuf_takes_it() -> None:
    """protobuf takes a provider by its enum name, and the engine logs such an item; the
    tool loop's check refused it (a review)."""
    from context_engine_client.items import _reasoning_problem

    opaque = b'{"type":"reasoning","id":"rs_1","summary":[]}'
    assert _reasoning_problem("PROVIDER_OPENAI", opaque) == ""
    assert _reasoning_problem(pb.PROVIDER_OPENAI, opaque) == ""
    assert "names no provider" in _reasoning_problem("PROVIDER_NOPE", opaque)


async def test_a_provider_item_id_the_engine_refuses_is_logged_as_none(client: Any) -> None:
    """A provider item id over 200 characters or holding whitespace (the text's or a
    call's) failed the step's append after its tools had run (an audit). It only pairs a
    replayed reasoning item, and the model cannot correct it: the step is logged without
    it, its tools run once, and a good id beside it is kept."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains to Lyon?")
    wire = wire_tool_name("web.fetch")
    ran: list[str] = []
    turns = 0

    async def model(build: BuildResult) -> ModelTurn:
        nonlocal turns
        turns += 1
        if turns > 1:
            return ModelTurn(text="Done.")
        calls = [
            ToolCallRequest("c1", wire, {"url": "a"}, provider_item_id="fc 1"),
            ToolCallRequest("c2", wire, {"url": "b"}, provider_item_id="f" * 201),
            ToolCallRequest("c3", wire, {"url": "c"}, provider_item_id="fc\u20283"),
            ToolCallRequest("c4", wire, {"url": "d"}, provider_item_id="fc_4"),
        ]
        return ModelTurn(text="Looking.", text_item_id="msg\t1", tool_calls=calls)

    async def run_tool(call: ToolCallRequest) -> ToolOutput:
        ran.append(call.call_id)
        return ToolOutput("page", source="tool:web.fetch")

    result = await run.tool_loop(model, run_tool, now=NOW)
    assert result.final.text == "Done." and ran == ["c1", "c2", "c3", "c4"]
    logged = _logged_calls(result.builds[1], run)
    assert [(c.call_id, c.provider_item_id) for c in logged] == [
        ("c1", ""),
        ("c2", ""),
        ("c3", ""),
        ("c4", "fc_4"),
    ]
    texts = [
        block.provider_item_id
        for message in result.builds[1].request.messages
        for block in message.blocks
        if block.WhichOneof("kind") == "text" and block.text == "Looking."
    ]
    assert texts == [""]


async def test_a_task_id_of_no_task_is_dropped_and_the_results_kept(client: Any, pool: Any) -> None:
    """A call's task_id naming no task of the run's working state (which no RPC reads
    before the append) failed the step's append for good after its tools had run: the
    results were lost, and the next tool_loop ran the tools again (an audit). The step is
    sent again without it (as the proto says to), under the same key: the tools ran once,
    the results are logged, and a task the state holds still moves."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains to Lyon?")
    await run.update_working_state(
        pb.WorkingStateUpdate(upsert_tasks=[pb.TaskState(task_id="t1", title="Find a train")])
    )
    wire = wire_tool_name("web.fetch")
    ran: list[str] = []
    turns = 0
    keys: list[str] = []
    real_call = run.client.call

    async def counting(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "AppendItems":
            keys.append(request.idempotency_key)
        return await real_call(method, request, timeout=timeout)

    async def model(build: BuildResult) -> ModelTurn:
        nonlocal turns
        turns += 1
        if turns > 1:
            return ModelTurn(text="Done.")
        calls = [
            ToolCallRequest("c1", wire, {"url": "a"}, task_id="t-unknown"),
            ToolCallRequest("c2", wire, {"url": "b"}, task_id="t1"),
            ToolCallRequest("c3", wire, {"url": "c"}, task_id="t-other"),
        ]
        return ModelTurn(tool_calls=calls)

    async def run_tool(call: ToolCallRequest) -> ToolOutput:
        ran.append(call.call_id)
        return ToolOutput("page", source="tool:web.fetch")

    run.client.call = counting  # type: ignore[method-assign]
    try:
        result = await run.tool_loop(model, run_tool, now=NOW)
    finally:
        run.client.call = real_call  # type: ignore[method-assign]
    assert result.final.text == "Done." and ran == ["c1", "c2", "c3"]
    # Refused naming c1's, then c3's; sent a third time, under the step's one key.
    assert len(keys) == 4 and len(set(keys[:3])) == 1
    rows = await pool.fetch(
        "SELECT payload FROM session_events WHERE session_id = $1"
        " AND type = 'tool.call.created' ORDER BY sequence",
        UUID(run.session_id),
    )
    logged = [(r["payload"]["call_id"], r["payload"].get("task_id", "")) for r in rows]
    assert logged == [("c1", ""), ("c2", "t1"), ("c3", "")]
    assert 'Task "t1" (done)' in _texts(result.builds[1])


async def test_a_cancellation_while_reporting_keeps_the_usage_and_the_steps_turn(
    client: Any,
) -> None:
    """tool_loop cancelled while it reports a step's usage: the report caught Exception
    only, so the usage was lost (not in `unreported`) and the cancellation carried
    neither the step's turn nor, after a failed append, its pending request (an audit).
    The usage is kept unsent with the cancellation, which carries what the step's error
    did."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = run.client.call
    reporting = asyncio.Event()
    failing_append = False

    async def hanging(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "AppendItems" and failing_append:
            raise Internal(grpc.StatusCode.INTERNAL, "a proxy failed")
        if method == "ReportUsage" and (failing_append or len(model.seen) == 2):
            reporting.set()
            await asyncio.sleep(60)
        return await real_call(method, request, timeout=timeout)

    # The final answer's report hangs: its append landed.
    model = ScriptedModel()
    run.client.call = hanging  # type: ignore[method-assign]
    task = asyncio.create_task(run.tool_loop(model, _fetch, now=NOW))
    await reporting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError) as caught:
        await task
    error: Any = caught.value
    assert [entry[0] for entry in error.unreported] == [error.builds[1]]
    assert isinstance(error.unreported[0][2], asyncio.CancelledError)
    assert error.final is True and error.turn.text.startswith("The 08:04 TGV")
    assert getattr(error, "pending_request", None) is None
    build, usage, _ = error.unreported[0]
    run.client.call = real_call  # type: ignore[method-assign]
    assert (await session.report_usage(build, usage)).samples >= 1

    # A step's append fails for good, and its report hangs: cancelled, the error that
    # ends the loop still carries the request to resend.
    other = await session.start_run("And back?")
    model = ScriptedModel()
    reporting.clear()
    failing_append = True
    run.client.call = hanging  # type: ignore[method-assign]
    task = asyncio.create_task(other.tool_loop(model, _fetch, now=NOW))
    await reporting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError) as caught:
        await task
    run.client.call = real_call  # type: ignore[method-assign]
    error = caught.value
    assert isinstance(error.__context__, Internal)
    assert error.pending_request is not None and error.final is False
    assert error.turn.tool_calls and len(error.unreported) == 1
    await other.resend_append(error.pending_request)
    result = await other.tool_loop(model, _fetch, now=NOW)
    assert result.final.text.startswith("The 08:04 TGV")


async def test_half_a_surrogate_pair_in_a_tools_output_is_sent_as_u_fffd(client: Any) -> None:
    """json.loads gives half a surrogate pair for "\\ud83d" (an emoji an API cut in
    UTF-16); protobuf cannot encode it, so the step raised UnicodeEncodeError after its
    tool had run, with nothing to resend, and every retry ran the tool again (an audit).
    It is sent as U+FFFD, as the TypeScript client sends it."""
    half = json.loads('"\\ud83d"')
    session = await client.open_session(_spec())
    run = await session.start_run("Trains to Lyon?")
    ran: list[str] = []
    turns = 0

    async def model(build: BuildResult) -> ModelTurn:
        nonlocal turns
        turns += 1
        if turns > 1:
            return ModelTurn(text=f"Done {half}.")
        call = ToolCallRequest("c1", wire_tool_name("web.fetch"), {"url": "https://t"})
        return ModelTurn(text=f"Checking{half}.", tool_calls=[call])

    async def run_tool(call: ToolCallRequest) -> ToolOutput:
        ran.append(call.call_id)
        return ToolOutput(f"Caf\u00e9 {half}", source=f"tool:{half}")

    result = await run.tool_loop(model, run_tool, now=NOW)
    assert ran == ["c1"] and result.final.text == f"Done {half}."
    assert "Caf\u00e9 \ufffd" in _texts(result.builds[1])
    assert "Checking\ufffd." in _texts(result.builds[1])
    item = tool_result("c2", "web.fetch", "\udc00x", source=half, context_content=half)
    assert (item.tool_result.content, item.tool_result.source) == ("\ufffdx", "\ufffd")
    assert item.tool_result.context_content == "\ufffd"


async def test_a_control_call_that_meets_a_later_write_is_told_and_the_step_is_kept(
    client: Any,
) -> None:
    """The user's next message lands while the model thinks: the control call is refused
    CHECKPOINT_VERSION_CONFLICT. The model decided without that message, so its update is
    not sent again after it (a review: a resend overruled the user's newer write); the
    call's result says so, and the step, its other tools' results too, goes after the
    message (a review: the step was lost)."""
    spec = _spec()
    spec.tools.extend(await client.control_tools())
    session = await client.open_session(spec)
    run = await session.start_run("Trains to Lyon?")
    wire = wire_tool_name("context.update_working_state")
    turns = 0

    async def model(build: BuildResult) -> ModelTurn:
        nonlocal turns
        turns += 1
        if turns > 1:
            return ModelTurn(text="Done.")
        other = session.run(run.run_id, checkpoint_version=run.checkpoint_version)
        await other.append(user_message("Make it Marseille."))
        calls = [
            ToolCallRequest("f1", "web-fetch", {"url": "https://trains.example"}),
            ToolCallRequest("w1", wire, {"objective": "Trains to Marseille"}),
        ]
        return ModelTurn(tool_calls=calls)

    result = await run.tool_loop(model, _fetch, now=NOW)
    assert result.final.text == "Done."
    told = _texts(result.builds[1])
    assert "Make it Marseille." in told and "08:04 TGV 6601" in told
    assert "Not applied: the run moved on" in told
    assert told.count("Trains to Marseille") == 1  # the call's arguments, not the state


async def test_a_control_call_the_build_did_not_offer_goes_to_run_tool(client: Any) -> None:
    """A model not given the control tool that calls it wrote text, not a state write: it
    goes to run_tool like any call (a review: the loop applied an injected objective)."""
    session = await client.open_session(_spec())  # no control tools
    run = await session.start_run("Trains to Lyon?")
    ran: list[str] = []

    async def model(build: BuildResult) -> ModelTurn:
        if ran:
            return ModelTurn(text="Done.")
        call = ToolCallRequest("w1", "context.update_working_state", {"objective": "INJECTED"})
        return ModelTurn(tool_calls=[call])

    async def run_tool(call: ToolCallRequest) -> ToolOutput:
        ran.append(call.name)
        return ToolOutput("No such tool.", is_error=True)

    await run.tool_loop(model, run_tool, now=NOW)
    assert ran == ["context.update_working_state"]
    # Only the logged call's arguments hold it: no working-state block shows it.
    texts = _texts(await run.build(now=NOW))
    assert texts.count("INJECTED") == texts.count('"INJECTED"') == 1


def _spec_with_mail() -> pb.PlanSpec:
    """The spec, with a tool only a run admitted with the mail.send scope gets (its
    admission rotates the session)."""
    spec = _spec()
    spec.tools.append(
        tool(
            "mail.send",
            "Send.",
            {"type": "object"},
            required_scopes=["mail.send"],
            side_effect=pb.SIDE_EFFECT_NETWORK_WRITE,
        )
    )
    return spec


async def test_a_replayed_start_run_does_not_take_the_session_back_an_epoch(
    client: Any,
) -> None:
    """A StartRun resent with its key replays the first answer, rotated_plan included.
    When the session has rotated since, that plan is older than Session.plan: keeping it
    would make the next rotate name a stale from_epoch (EPOCH_CONFLICT)."""
    session = await client.open_session(_spec_with_mail())
    admission = pb.RunAdmission(scopes=["mail.send"])
    first = await session.start_run("Mail me.", admission=admission, idempotency_key="run-1")
    assert session.plan.epoch == first.epoch == 2  # the admission rotated
    rotated = await session.rotate(pb.PLAN_REASON_AGENT_CHANGED)
    assert rotated.epoch == 3
    again = await session.start_run("Mail me.", admission=admission, idempotency_key="run-1")
    assert again.run_id == first.run_id  # the first answer, replayed
    assert session.plan.epoch == 3
    assert (await session.rotate(pb.PLAN_REASON_BUILDER_UPGRADED)).epoch == 4


async def test_a_childs_continued_lineage_does_not_become_the_sessions_plan(
    client: Any,
) -> None:
    """A child of a run parked behind a sweep continues its parent's lineage first, and
    StartRun returns that continuation as rotated_plan. It is not the session's current
    plan: Session.plan stays the current one, so the next rotate names it as from_epoch
    instead of failing EPOCH_CONFLICT."""
    session = await client.open_session(_spec_with_mail())
    parked = await session.start_run("Trains to Lyon?")  # epoch 1
    await session.start_run("Mail me.", admission=pb.RunAdmission(scopes=["mail.send"]))
    swept = await session.rotate(pb.PLAN_REASON_AGENT_CHANGED)  # a sweep: epoch 3
    child = await session.start_child_run(parked.run_id, "Look up the timetable.")
    assert child.epoch == 4 and session.plan.epoch == swept.epoch == 3  # lineage 1 continued
    plan = await session.rotate(pb.PLAN_REASON_BUILDER_UPGRADED)
    assert plan.epoch == session.plan.epoch == 5
    assert plan.epoch == (await session.refresh_plan()).epoch


# --- the model that answered, resent appends, deadlines, epochs ----------------------------


def _answering(model: str) -> Any:
    """A model that answers at once, reporting the usage Build estimated, as `model`."""

    async def call_model(build: BuildResult) -> ModelTurn:
        usage = Usage(input_tokens=build.response.estimated_input_tokens, output_tokens=5)
        return ModelTurn(text="The 08:04.", usage=usage, model=model)

    return call_model


async def test_usage_is_reported_under_the_model_that_answered(client: Any) -> None:
    """ReportUsage named the planned model whatever answered, so the engine learnt from a
    report of another model. It sends ModelTurn.model: another model's report is recorded
    but moves no factor; a dated snapshot of the planned model counts as it."""
    session = await client.open_session(_spec())
    real_call = client.call
    sent: list[str] = []

    async def record(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "ReportUsage":
            sent.append(request.model_id)
        return await real_call(method, request, timeout=timeout)

    client.call = record
    other = await (await session.start_run("Lyon?")).tool_loop(_answering("gpt-4o"), _fetch)
    dated = _answering("claude-sonnet-4-5-20250929")
    same = await (await session.start_run("Lyon?")).tool_loop(dated, _fetch)
    planned = await (await session.start_run("Lyon?")).tool_loop(_answering(""), _fetch)
    assert sent == ["gpt-4o", "claude-sonnet-4-5-20250929", "claude-sonnet-4-5"]
    assert not other.reports[0].absorbed  # recorded, not learnt from
    assert same.reports[0].absorbed and planned.reports[0].absorbed


async def test_a_steps_append_that_fails_is_resent_with_the_same_key(client: Any) -> None:
    """A step's append that failed DeadlineExceeded (landed, its answer lost) or
    Unavailable raised out of the loop with its key: the caller could only ask the model
    and run the tools again. The loop resends the same request itself, with twice the
    deadline after a DeadlineExceeded (docs/api.md: retry with a longer deadline)."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = client.call
    keys: list[str] = []
    deadlines: list[float] = []

    async def flaky(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "AppendItems":
            keys.append(request.idempotency_key)
            deadlines.append(timeout)
            if len(keys) == 1:
                await real_call(method, request, timeout=timeout)
                raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "answer lost")
            if len(keys) == 2:
                raise Unavailable(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        return await real_call(method, request, timeout=timeout)

    client.call = flaky
    fetched: list[str] = []

    async def fetch(call: ToolCallRequest) -> ToolOutput:
        fetched.append(call.call_id)
        return await _fetch(call)

    result = await run.tool_loop(ScriptedModel(), fetch, now=NOW, timeout=5)
    assert result.final.text.startswith("The 08:04 TGV") and fetched == ["call-1"]
    assert len(keys) == 4 and keys[0] == keys[1] == keys[2] != keys[3]
    # Doubled after the DeadlineExceeded, not after the Unavailable; the next step's anew.
    assert deadlines == [5, 10, 10, 5]
    assert run.checkpoint_version == 3  # the pair once (the resend replayed), the answer


async def test_a_busy_session_is_retryable_and_the_loop_resends_and_keeps_the_answer(
    client: Any,
) -> None:
    """ABORTED SESSION_BUSY (another write held the session past the server's lock wait)
    wrote nothing: it is `.retryable`, unlike a lost race, so the loop resends the step's
    append unchanged and keeps a usage report that met it in `unreported` rather than
    raising past the appended final answer (a client audit: both were raised)."""
    # A result naming no tool takes its call's on the server, which names the source by it.
    assert tool_result("c1", "", "x").tool_result.source == ""
    assert tool_result("c1", "web.fetch", "x").tool_result.source == "tool:web.fetch"
    busy = Aborted(grpc.StatusCode.ABORTED, "busy", reason="SESSION_BUSY")
    lost = Aborted(grpc.StatusCode.ABORTED, "moved", reason="CHECKPOINT_VERSION_CONFLICT")
    assert busy.retryable and not lost.retryable
    assert pickle.loads(pickle.dumps(busy)).retryable
    # Per class for the rest, readable on the class as before.
    assert [
        c.__name__ for c in (Aborted, Unavailable, DeadlineExceeded, NotFound) if c.retryable
    ] == [
        "Unavailable",
        "DeadlineExceeded",
    ]
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = client.call
    keys: list[str] = []

    async def contended(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "AppendItems":
            keys.append(request.idempotency_key)
            if len(keys) == 1:
                raise busy
        if method == "ReportUsage":
            raise busy
        return await real_call(method, request, timeout=timeout)

    client.call = contended
    result = await run.tool_loop(ScriptedModel(), _fetch, now=NOW)
    client.call = real_call
    assert result.final.text.startswith("The 08:04 TGV")
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2]
    assert [e.reason for _, _, e in result.unreported] == ["SESSION_BUSY"] * 2
    assert run.checkpoint_version == 3


@pytest.mark.parametrize(
    ("kind", "code", "reason"),
    [
        (Aborted, grpc.StatusCode.ABORTED, "SESSION_BUSY"),
        (Aborted, grpc.StatusCode.ABORTED, "EPOCH_CONFLICT"),
        (Unavailable, grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"),
    ],
)
async def test_a_build_refused_for_a_passing_cause_is_built_again(
    client: Any, kind: Any, code: Any, reason: str
) -> None:
    """A Build refused ABORTED SESSION_BUSY (retryable), EPOCH_CONFLICT (an erasure raced
    it: docs/api.md says build again) or UNAVAILABLE SHUTTING_DOWN (a draining replica,
    before its handler ran; the channel does not resend a Build) wrote nothing: the loop
    builds once more and goes on to the answer. It ended the loop on each (a client
    audit; the Go example rebuilt; a review for the drain). A second refusal in a row is
    the caller's to see."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = client.call
    builds: list[int] = []
    refused = kind(code, "refused", reason=reason)

    async def racing(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "Build":
            builds.append(1)
            if len(builds) == 1:
                raise refused
        return await real_call(method, request, timeout=timeout)

    client.call = racing
    result = await run.tool_loop(ScriptedModel(), _fetch, now=NOW)
    assert result.final.text.startswith("The 08:04 TGV")
    assert len(builds) == 3  # the refused one, then one per step

    async def refusing(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "Build":
            raise refused
        return await real_call(method, request, timeout=timeout)

    client.call = refusing
    with pytest.raises(kind) as caught:
        await (await session.start_run("And back?")).tool_loop(ScriptedModel(), _fetch, now=NOW)
    client.call = real_call
    assert caught.value.reason == reason


async def test_a_build_that_may_have_been_recorded_is_not_built_again(client: Any) -> None:
    """DEADLINE_EXCEEDED (or UNAVAILABLE) may come after the Build was recorded: built
    again, the first would be a request no usage is reported for, first of its epoch in
    the record while the one sent is not (a review). The loop leaves it to the caller."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = client.call
    builds: list[int] = []

    async def slow(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "Build":
            builds.append(1)
            await real_call(method, request, timeout=timeout)  # recorded; the answer lost
            raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "answer lost")
        return await real_call(method, request, timeout=timeout)

    client.call = slow
    with pytest.raises(DeadlineExceeded):
        await run.tool_loop(ScriptedModel(), _fetch, now=NOW)
    client.call = real_call
    assert builds == [1]


async def test_a_steps_append_that_keeps_failing_raises_with_the_request(client: Any) -> None:
    """When every resend fails, the error carries the request: resent, the next loop sees
    the step's results and runs no tool twice."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = client.call
    keys: list[str] = []

    async def down(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "AppendItems":
            keys.append(request.idempotency_key)
            raise Unavailable(grpc.StatusCode.UNAVAILABLE, "the engine went away")
        return await real_call(method, request, timeout=timeout)

    client.call = down
    model, fetched = ScriptedModel(), []

    async def fetch(call: ToolCallRequest) -> ToolOutput:
        fetched.append(call.call_id)
        return await _fetch(call)

    with pytest.raises(Unavailable) as failed:
        await run.tool_loop(model, fetch, now=NOW)
    pending = failed.value.pending_request
    # Sent 3 times: the first send and 2 resends.
    assert len(keys) == 3 and len(set(keys)) == 1 and pending.idempotency_key == keys[0]
    assert [i.WhichOneof("kind") for i in pending.items] == [
        "assistant_message",
        "tool_call",
        "tool_result",
    ]
    client.call = real_call
    await run.resend_append(pending)
    result = await run.tool_loop(model, fetch, now=NOW)
    assert fetched == ["call-1"], "the tool ran again"
    assert result.final.text.startswith("The 08:04 TGV") and run.checkpoint_version == 3


@pytest.mark.parametrize(
    "error",
    [
        InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "refused"),
        Unauthenticated(grpc.StatusCode.UNAUTHENTICATED, "the token expired"),
        Internal(grpc.StatusCode.INTERNAL, "a proxy failed"),
        ResourceExhausted(grpc.StatusCode.RESOURCE_EXHAUSTED, "too large"),
        ContextEngineError(grpc.StatusCode.CANCELLED, "cancelled"),
    ],
    ids=lambda error: error.code.name,
)
async def test_a_steps_append_that_fails_for_good_raises_with_the_request(
    client: Any, error: ContextEngineError
) -> None:
    """The request was attached only when the resends ran out: an error that is never
    resent (an expired token, a proxy's INTERNAL...) was raised bare though the tools had
    run. Every error out of the step's append carries it now, after one attempt."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains from Paris to Lyon tomorrow?")
    real_call = client.call
    sent: list[pb.AppendItemsRequest] = []

    async def refuse(method: str, request: Any, *, timeout: Any = None) -> Any:
        if method == "AppendItems":
            sent.append(request)
            raise error
        return await real_call(method, request, timeout=timeout)

    client.call = refuse
    model, fetched = ScriptedModel(), []

    async def fetch(call: ToolCallRequest) -> ToolOutput:
        fetched.append(call.call_id)
        return await _fetch(call)

    with pytest.raises(type(error)) as failed:
        await run.tool_loop(model, fetch, now=NOW)
    client.call = real_call
    assert len(sent) == 1, "resent though refused for what it is"
    assert failed.value.pending_request is sent[0]
    await run.resend_append(failed.value.pending_request)
    result = await run.tool_loop(model, fetch, now=NOW)
    assert fetched == ["call-1"], "the tool ran again"
    assert result.final.text.startswith("The 08:04 TGV") and run.checkpoint_version == 3


async def test_every_method_takes_a_deadline_of_its_own(client: Any) -> None:
    session = await client.open_session(_spec(), timeout=10)
    run = await session.start_run("Lyon?", timeout=10)
    with pytest.raises(DeadlineExceeded):
        await run.build(now=NOW, timeout=1e-6)
    # Not a GetPlan: answered from the server's kept plan within grpc's timer slack, it
    # can land before a microsecond's deadline is seen to pass (a flaky run). Every
    # wrapper's deadline reaching the stub is test_every_wrapper_sends_its_deadline's.
    # None (the default) and 0 are the client's deadline (30 s), not an expired one.
    assert (await run.build(now=NOW)).checkpoint_version == 1
    assert (await run.build(now=NOW, timeout=0)).checkpoint_version == 1


async def test_a_client_timeout_of_zero_is_no_deadline(grpc_server: Any) -> None:
    """The client's own timeout 0 went to grpc as a deadline already past, and every call
    failed DEADLINE_EXCEEDED; the TypeScript client's timeoutMs 0 is no deadline (a
    review). It is no deadline here too; a negative one is refused when made."""
    target = f"127.0.0.1:{grpc_server.port}"
    async with ContextEngineClient(target, TENANT, timeout=0) as unbounded:
        assert unbounded.timeout is None
        assert await unbounded.control_tools()
    with pytest.raises(ValueError, match="timeout"):
        ContextEngineClient(target, TENANT, timeout=-1)


async def test_a_negative_call_timeout_is_refused_before_anything_is_sent() -> None:
    """A method's own timeout=-1 went to grpc as a deadline already past: the call failed
    DEADLINE_EXCEEDED without being sent, which reads as a slow engine and which the tool
    loop resent (an audit). It is refused as the client's own negative timeout is."""
    client = ContextEngineClient("127.0.0.1:1", TENANT)
    client.stub = stub = RecordingStub()
    with pytest.raises(ValueError, match="ListControlTools: timeout"):
        await client.control_tools(timeout=-0.5)
    assert stub.deadlines == []
    await client.control_tools(timeout=0)
    assert stub.deadlines == [("ListControlTools", 30.0)]


class RecordingStub:
    """Stands in for the generated stub: answers every RPC with its empty response and
    records the deadline each was sent with, as `call` resolved it."""

    def __init__(self) -> None:
        self.deadlines: list[tuple[str, float | None]] = []

    def __getattr__(self, method: str) -> Any:
        service = pb.DESCRIPTOR.services_by_name["ContextEngine"]
        response = getattr(pb, service.methods_by_name[method].output_type.name)

        async def rpc(request: Any, *, timeout: float | None, metadata: Any) -> Any:
            self.deadlines.append((method, timeout))
            return response()

        return rpc


async def _no_tool(call: ToolCallRequest) -> str:
    raise AssertionError("no tools")


# Every wrapper that takes `timeout=`, called with `kw` (test_..._covers_every_wrapper
# checks the list is complete).
DEADLINE_WRAPPERS: dict[str, Any] = {
    "ContextEngineClient.call": lambda c, s, r, **kw: c.call(
        "ListControlTools", pb.ListControlToolsRequest(), **kw
    ),
    "ContextEngineClient.open_session": lambda c, s, r, **kw: c.open_session(_spec(), **kw),
    "ContextEngineClient.session": lambda c, s, r, **kw: c.session("s", epoch=1, **kw),
    "ContextEngineClient.report_usage": lambda c, s, r, **kw: c.report_usage(
        "s", 1, "m", Usage(1), **kw
    ),
    "ContextEngineClient.get_build": lambda c, s, r, **kw: c.get_build("s", 1, **kw),
    "ContextEngineClient.erase_subject": lambda c, s, r, **kw: c.erase_subject("p", **kw),
    "ContextEngineClient.control_tools": lambda c, s, r, **kw: c.control_tools(**kw),
    "Session.start_run": lambda c, s, r, **kw: s.start_run("Hi", **kw),
    "Session.start_child_run": lambda c, s, r, **kw: s.start_child_run("r", "Go.", **kw),
    "Session.refresh_plan": lambda c, s, r, **kw: s.refresh_plan(**kw),
    "Session.rotate": lambda c, s, r, **kw: s.rotate(pb.PLAN_REASON_AGENT_CHANGED, **kw),
    "Session.offer_fact_candidates": lambda c, s, r, **kw: s.offer_fact_candidates(**kw),
    "Session.load_skill": lambda c, s, r, **kw: s.load_skill("rail", "Prefer TGV.", **kw),
    "Session.report_usage": lambda c, s, r, **kw: s.report_usage(
        BuildResult(pb.BuildResponse()), Usage(1), **kw
    ),
    "Run.append": lambda c, s, r, **kw: r.append(_assistant("Hi."), **kw),
    "Run.resend_append": lambda c, s, r, **kw: r.resend_append(pb.AppendItemsRequest(), **kw),
    "Run.build": lambda c, s, r, **kw: r.build(**kw),
    "Run.report_usage": lambda c, s, r, **kw: r.report_usage(
        BuildResult(pb.BuildResponse()), Usage(1), **kw
    ),
    "Run.update_working_state": lambda c, s, r, **kw: r.update_working_state(
        pb.WorkingStateUpdate(objective="x"), **kw
    ),
    "Run.apply_control_call": lambda c, s, r, **kw: r.apply_control_call(
        ToolCallRequest("c1", "context.update_working_state", {"objective": "x"}), **kw
    ),
    "Run.compact": lambda c, s, r, **kw: r.compact(_summarize, **kw),
    "Run.tool_loop": lambda c, s, r, **kw: r.tool_loop(_answering("m"), _no_tool, **kw),
}


@pytest.mark.parametrize(
    ("given", "expected"),
    [({"timeout": 7.0}, 7.0), ({}, 12.5), ({"timeout": 0}, 12.5), ({"timeout": None}, 12.5)],
    ids=["given", "omitted", "zero", "none"],
)
@pytest.mark.parametrize("wrapper", sorted(DEADLINE_WRAPPERS))
async def test_every_wrapper_sends_its_deadline(
    wrapper: str, given: dict[str, Any], expected: float
) -> None:
    """The deadline tests covered build, refresh_plan and call: a wrapper dropping its
    `timeout` passed them. Each RPC of each wrapper gets the deadline given, and the
    client's (12.5 s here) when none is, or 0."""
    client = ContextEngineClient("127.0.0.1:1", TENANT, timeout=12.5)
    stub = client.stub = RecordingStub()
    session = Session(client, "s", pb.ContextPlan(epoch=1, model_id="m"), False, True)
    run = Run(session, "r", 1, epoch=1)
    try:
        await DEADLINE_WRAPPERS[wrapper](client, session, run, **given)
    finally:
        await client.close()
    assert stub.deadlines, "no RPC made"
    assert {deadline for _, deadline in stub.deadlines} == {expected}, stub.deadlines


def test_the_deadline_test_covers_every_wrapper() -> None:
    taking = {
        f"{cls.__name__}.{name}"
        for cls in (ContextEngineClient, Session, Run)
        for name, method in vars(cls).items()
        if not name.startswith("_")
        and callable(method)
        and "timeout" in inspect.signature(method).parameters
    }
    assert taking == set(DEADLINE_WRAPPERS)


def test_an_unreported_usage_copies_and_pickles() -> None:
    """UnreportedUsage (a tuple with a `model`) raised TypeError on copy.copy: copy
    called its __new__ with the tuple's items as one argument. Its error and build
    pickle too (the generated message classes cannot be pickled by name)."""
    error = Unavailable(grpc.StatusCode.UNAVAILABLE, "the engine went away", reason="R")
    error.idempotency_key = "usage:s:3"
    error.pending_request = pb.AppendItemsRequest(idempotency_key="k", run_id="r")
    entry = UnreportedUsage(
        BuildResult(pb.BuildResponse(request_sequence=3, epoch=2)), Usage(10), error, "gpt-4o"
    )
    for copied in (
        copy.copy(entry),
        copy.deepcopy(entry),
        pickle.loads(pickle.dumps(entry)),
    ):
        build, usage, again = copied  # a 3-tuple still
        assert type(copied) is UnreportedUsage and copied.model == "gpt-4o"
        assert (build.request_sequence, build.epoch, usage) == (3, 2, Usage(10))
        assert type(again) is Unavailable and str(again) == str(error)
        assert (again.code, again.message, again.reason) == (error.code, error.message, "R")
        assert again.idempotency_key == "usage:s:3"
        assert again.pending_request == error.pending_request
    assert copy.copy(entry) == entry


async def test_attaching_at_an_older_epoch_keeps_the_current_plan(client: Any) -> None:
    """client.session(id, epoch=1) made epoch 1's plan the session's current one, so its
    next rotate failed EPOCH_CONFLICT; the epoch asked for is `requested_plan` now."""
    session = await client.open_session(_spec())
    await session.rotate(pb.PLAN_REASON_AGENT_CHANGED)
    attached = await client.session(session.session_id, epoch=1)
    assert (attached.plan.epoch, attached.requested_plan.epoch) == (2, 1)
    assert (await attached.rotate(pb.PLAN_REASON_BUILDER_UPGRADED)).epoch == 3
    assert (await client.session(session.session_id)).requested_plan.epoch == 3


async def test_a_runs_epoch_follows_its_builds(client: Any) -> None:
    """Run.epoch was StartRun's forever; a rotation reaches the run at its next build."""
    session = await client.open_session(_spec())
    run = await session.start_run("Trains to Lyon?")
    assert run.epoch == 1
    await session.rotate(pb.PLAN_REASON_AGENT_CHANGED)
    built = await run.build(now=NOW)
    assert built.epoch == run.epoch == 2


async def test_a_long_source_is_cut_to_what_the_engine_accepts(grpc_server: Any) -> None:
    """The engine refuses a result's source over 2,048 characters (INVALID_FIELD); a tool's
    long signed URL would have failed the whole step's append. tool_result cuts it, and the
    engine takes the cut one."""
    url = "https://cdn.example/file?sig=" + "x" * 5_000
    item = tool_result("c1", "web.fetch", "page", source=url)
    assert len(item.tool_result.source) == 2_048
    assert item.tool_result.source.endswith("…")
    assert tool_result("c1", "web.fetch", "page").tool_result.source == "tool:web.fetch"
    async with ContextEngineClient(f"127.0.0.1:{grpc_server.port}", TENANT) as client:
        session = await client.open_session(_spec())
        run = await session.start_run("Fetch it.")
        call = tool_call("c1", "web.fetch", {"q": "x"})
        appended = await run.append([call, item])
        assert appended.checkpoint_version == 2


async def test_tool_defaults_and_a_channel_with_options(grpc_server: Any) -> None:
    """tool() made every tool a side-effect-free built-in: unspecified (the engine's most
    consequential) now, and a tool from a server is a discovered one. Channel options
    given with a channel of one's own were silently ignored."""
    plain = tool("web.fetch", "Fetch.", SCHEMA)
    assert (plain.side_effect, plain.builtin) == (pb.SIDE_EFFECT_UNSPECIFIED, True)
    assert not tool("mcp.fetch", "Fetch.", SCHEMA, server="mcp://tools").builtin
    target = f"127.0.0.1:{grpc_server.port}"
    async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
        with pytest.raises(ValueError, match="options="):
            ContextEngineClient(target, TENANT, channel=channel, options=[("grpc.x", 1)])


def test_a_turn_logs_its_outputs_provider_item_ids() -> None:
    """OpenAI pairs a replayed reasoning item with the output after it by that output's id,
    and the engine replays no reasoning whose output was logged without one: a turn's items
    carry the text's and each call's ids."""
    turn = ModelTurn(
        text="Let me look.",
        text_item_id="msg_1",
        tool_calls=[ToolCallRequest("call-1", "web.fetch", {}, provider_item_id="fc_1")],
        reasoning=[(pb.PROVIDER_OPENAI, b'{"type":"reasoning","id":"rs_1","summary":[]}')],
    )
    reasoning, text, call = turn.items()
    assert reasoning.reasoning.opaque.startswith(b'{"type":"reasoning"')
    assert text.assistant_message.provider_item_id == "msg_1"
    assert call.tool_call.provider_item_id == "fc_1"
