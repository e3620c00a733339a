"""The Python client (clients/python) drives a short session against the real server.

The server is the in-process grpc.aio server of tests/conftest.py over a fresh PostgreSQL
database; the client is imported from its source tree (tests/e2e/conftest.py).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from context_engine_client import (
    Aborted,
    BuildResult,
    ContextEngineClient,
    InvalidArgument,
    ModelTurn,
    NotFound,
    ToolCallRequest,
    ToolOutput,
    Usage,
    assistant_message,
    pb,
    tool,
    tool_result,
)

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


async def test_errors_are_typed_with_reason_and_field(client: Any) -> None:
    session = await client.open_session(_spec())
    run = await session.start_run("Hello")

    with pytest.raises(InvalidArgument) as orphan:
        await run.append(tool_result("never-called", "web.fetch", "text"))
    assert orphan.value.reason == "ORPHANED_TOOL_ITEM"
    assert orphan.value.field == "items[0].tool_result.call_id"
    assert run.checkpoint_version == 1  # bad input changed nothing

    stale = session.run(run.run_id, checkpoint_version=1)
    await run.append(_assistant("Hi."))
    with pytest.raises(Aborted) as conflict:
        await stale.append(_assistant("Hi again."))
    assert conflict.value.reason == "CHECKPOINT_VERSION_CONFLICT"

    with pytest.raises(NotFound) as missing:
        await client.session(str(uuid.uuid4()))
    assert missing.value.reason == "SESSION_NOT_FOUND"
    assert missing.value.field == "session_id"

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
