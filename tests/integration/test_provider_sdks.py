"""Real clients accept our bytes: Build's provider_payload, sent unchanged by the official
`anthropic` and `openai` SDKs to the caching fake provider, is accepted, answered and
parsed, and the session's second request reads the cache the first one wrote.

The worker loop here is the one a real worker runs: Build -> send provider_payload ->
append what the model did (reasoning items verbatim, tool calls with their wire names
mapped back) and the tool results -> Build again.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.fake_provider import FakeProvider, ManualClock
from context_engine.providers import tool_name_from_wire, usage_from_provider

from .helpers import TENANT, assistant, call, open_session, result, spec, start_run

# Long enough that the prefix passes both providers' minimum cacheable length on the fake.
POLICY = pb.PlatformPolicy(
    version="policy-long", text="Platform policy: check every source twice. " * 115
)
# claude-sonnet-4-5 would do as well, but the SDK warns that it is deprecated (an error here).
MODELS = {"anthropic": "claude-opus-4-1", "openai": "gpt-5"}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider(clock=ManualClock()) as provider:
        yield provider


@pytest.fixture
def claude(fake: FakeProvider) -> Iterator[anthropic.Anthropic]:
    client = anthropic.Anthropic(base_url=fake.base_url, api_key="test", max_retries=0)
    yield client
    client.close()


@pytest.fixture
def gpt(fake: FakeProvider) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=fake.base_url + "/v1", api_key="test", max_retries=0)
    yield client
    client.close()


class Worker:
    """One run of a worker against the engine and a provider client."""

    def __init__(self, stub: Any, provider: str, client: Any) -> None:
        self.stub, self.provider, self.client = stub, provider, client
        self.session_id = ""
        self.run_id = ""
        self.version = 0
        self.payloads: list[dict[str, Any]] = []

    async def open(self, text: str) -> None:
        self.session_id, _ = await open_session(
            self.stub, model_id=MODELS[self.provider], policy=POLICY
        )
        started = await self.stub.StartRun(
            pb.StartRunRequest(
                tenant_id=TENANT,
                session_id=self.session_id,
                user_message=pb.UserMessage(text=text),
            )
        )
        self.run_id, self.version = started.run.run_id, started.checkpoint_version

    async def build(self) -> pb.BuildResponse:
        response = await self.stub.Build(
            pb.BuildRequest(tenant_id=TENANT, session_id=self.session_id, run_id=self.run_id)
        )
        assert (
            response.provider_api
            == f"{self.provider}.{'messages' if self.provider == 'anthropic' else 'responses'}"
        )
        return response

    def send(self, build: pb.BuildResponse) -> tuple[Any, list[pb.ConversationItem]]:
        """Send the payload unchanged; return the response and the items it produced."""
        payload = json.loads(build.provider_payload)
        self.payloads.append(payload)
        names = [t.name for t in build.request.tools]
        if self.provider == "anthropic":
            message = self.client.messages.create(**payload)
            return message, [self._anthropic_item(b, names) for b in message.content]
        response = self.client.responses.create(**payload)
        return response, [self._openai_item(i, names) for i in response.output]

    def _anthropic_item(self, block: Any, names: list[str]) -> pb.ConversationItem:
        if block.type in ("thinking", "redacted_thinking"):
            opaque = json.dumps(block.model_dump()).encode()
            return pb.ConversationItem(
                reasoning=pb.ReasoningItem(provider=pb.PROVIDER_ANTHROPIC, opaque=opaque)
            )
        if block.type == "tool_use":
            return pb.ConversationItem(
                tool_call=pb.ToolCall(
                    call_id=block.id,
                    tool_name=tool_name_from_wire(names, block.name),
                    arguments_json=json.dumps(block.input),
                )
            )
        return pb.ConversationItem(assistant_message=pb.AssistantMessage(text=block.text))

    def _openai_item(self, item: Any, names: list[str]) -> pb.ConversationItem:
        if item.type == "reasoning":
            opaque = json.dumps(item.model_dump(exclude_none=True)).encode()
            return pb.ConversationItem(
                reasoning=pb.ReasoningItem(provider=pb.PROVIDER_OPENAI, opaque=opaque)
            )
        # Each output keeps its item id, which pairs it with its reasoning on replay.
        if item.type == "function_call":
            return pb.ConversationItem(
                tool_call=pb.ToolCall(
                    call_id=item.call_id,
                    tool_name=tool_name_from_wire(names, item.name),
                    arguments_json=item.arguments,
                    provider_item_id=item.id,
                )
            )
        return pb.ConversationItem(
            assistant_message=pb.AssistantMessage(
                text=item.content[0].text, provider_item_id=item.id
            )
        )

    async def append(self, items: list[pb.ConversationItem]) -> None:
        done = await self.stub.AppendItems(
            pb.AppendItemsRequest(
                tenant_id=TENANT,
                session_id=self.session_id,
                run_id=self.run_id,
                expected_checkpoint_version=self.version,
                items=items,
            )
        )
        self.version = done.checkpoint_version


def _results(items: list[pb.ConversationItem]) -> list[pb.ConversationItem]:
    calls = [i.tool_call for i in items if i.WhichOneof("kind") == "tool_call"]
    return [result(c.call_id, f"page for {c.arguments_json}", name=c.tool_name) for c in calls]


def _usage(provider: str, response: Any) -> Any:
    return usage_from_provider(
        f"{provider}.{'messages' if provider == 'anthropic' else 'responses'}",
        response.usage.model_dump(),
    )


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_the_sdks_send_build_payloads_unchanged_and_the_cache_is_read(
    stub: Any, fake: FakeProvider, claude: anthropic.Anthropic, gpt: openai.OpenAI, provider: str
) -> None:
    worker = Worker(stub, provider, claude if provider == "anthropic" else gpt)
    await worker.open("Find the earliest train to Lyon.")
    # Three model turns: a tool call with reasoning, a second tool call, a final answer.
    fake.script.push_tool_call(
        "web-fetch", {"q": "trains"}, thinking="Look it up.", provider=provider
    )
    fake.script.push_tool_call("calendar-list", {"q": "saturday"}, provider=provider)
    fake.script.push_text("The 07:04 TGV.", provider=provider)
    fake.script.push_text("The 18:56 TGV.", provider=provider)
    usages = []
    for _ in range(3):
        build = await worker.build()
        response, items = worker.send(build)
        record = fake.requests[-1]
        assert record.status == 200, record.error
        assert record.request == json.loads(build.provider_payload), "sent unchanged"
        usages.append(_usage(provider, response))
        await worker.append(items + _results(items))
    # The next run's first request carries run 1 as history (the carried-history marker).
    started = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT,
            session_id=worker.session_id,
            user_message=pb.UserMessage(text="And back on Sunday?"),
        )
    )
    worker.run_id, worker.version = started.run.run_id, started.checkpoint_version
    response, _ = worker.send(await worker.build())
    usages.append(_usage(provider, response))

    first, second, third, fourth = usages
    assert first.cache_read_input_tokens == 0
    assert second.cache_read_input_tokens > 0, "the second request reads the prefix"
    assert third.cache_read_input_tokens > second.cache_read_input_tokens, (
        "the history window grows the cached prefix"
    )
    assert fourth.cache_read_input_tokens >= third.cache_read_input_tokens, (
        "the next run reads the history the last one cached"
    )
    if provider == "anthropic":
        replayed = [
            b
            for m in worker.payloads[1]["messages"]
            for b in m["content"]
            if b["type"] == "thinking"
        ]
        assert replayed and replayed[0]["thinking"] == "Look it up.", "replayed verbatim"
        assert all(
            b["type"] != "thinking" for m in worker.payloads[2]["messages"] for b in m["content"]
        ), "only the latest turn's reasoning is replayed"
    else:
        assert {r.prompt_cache_key for r in fake.requests} == {
            worker.payloads[0]["prompt_cache_key"]
        }
        replayed = worker.payloads[1]["input"]
        at = next(n for n, i in enumerate(replayed) if i.get("type") == "reasoning")
        assert replayed[at + 1]["id"].startswith("fc_"), "paired with its call by id"
        assert not any(
            i.get("type") == "reasoning" or "id" in i for i in worker.payloads[2]["input"]
        ), "only the latest turn's reasoning is replayed, and no id without it"


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_the_payload_bytes_are_accepted_as_they_are(
    stub: Any, fake: FakeProvider, provider: str
) -> None:
    """No client in between: POST Build's bytes themselves."""
    worker = Worker(stub, provider, None)
    await worker.open("hello")
    build = await worker.build()
    path, headers = (
        ("/v1/messages", {"x-api-key": "test", "anthropic-version": "2023-06-01"})
        if provider == "anthropic"
        else ("/v1/responses", {"authorization": "Bearer test"})
    )
    request = urllib.request.Request(
        fake.base_url + path,
        data=build.provider_payload,
        headers={"content-type": "application/json", **headers},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200
        body = json.loads(answer.read())
    assert body["usage"]["output_tokens"] > 0
    assert fake.requests[-1].request == json.loads(build.provider_payload)


async def _next_run(worker: Worker, text: str) -> None:
    started = await start_run(worker.stub, worker.session_id, text)
    worker.run_id, worker.version = started.run.run_id, started.checkpoint_version


def _tool_blocks(payload: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        b
        for m in payload["messages"]
        for b in m["content"]
        if b["type"] in ("tool_use", "tool_result")
    ]


async def test_runs_reusing_a_call_id_outside_the_anthropic_alphabet_are_accepted(
    stub: Any, fake: FakeProvider, claude: anthropic.Anthropic
) -> None:
    """Call ids are unique per run only and AppendItems takes any non-empty id; the Messages
    API wants unique ids matching ^[a-zA-Z0-9_-]+$. The earlier pair keeps its mapped id."""
    worker = Worker(stub, "anthropic", claude)
    await worker.open("Trains to Lyon?")
    odd = "functions.web_fetch:0"
    await worker.append([call(odd), result(odd, "06:04 TGV"), assistant("The 06:04.")])
    await _next_run(worker, "And back?")
    await worker.append([call(odd), result(odd, "18:04 TGV")])
    fake.script.push_text("The 18:04.", provider="anthropic")
    worker.send(await worker.build())
    assert fake.requests[-1].status == 200, fake.requests[-1].error
    blocks = _tool_blocks(worker.payloads[-1])
    assert [b.get("id") or b["tool_use_id"] for b in blocks] == [
        "functions_web_fetch_0",
        "functions_web_fetch_0",
        "functions_web_fetch_0-2",
        "functions_web_fetch_0-2",
    ]


async def test_a_rotation_to_no_tools_sends_the_carried_pairs_as_text(
    stub: Any, fake: FakeProvider, claude: anthropic.Anthropic
) -> None:
    """The Messages API rejects tool_use/tool_result blocks in a request that defines no
    tools; an operator revocation of the last tool keeps the carried pairs, sent as text
    naming the pair's call id on both sides."""
    worker = Worker(stub, "anthropic", claude)
    await worker.open("Trains to Lyon?")
    await worker.append([call("toolu_01"), result("toolu_01", "06:04 TGV"), assistant("6:04")])
    plan = (
        await stub.GetPlan(pb.GetPlanRequest(tenant_id=TENANT, session_id=worker.session_id))
    ).plan
    revoked = spec(model_id=MODELS["anthropic"], policy=POLICY)
    del revoked.tools[:]
    rotated = await stub.Rotate(
        pb.RotateRequest(
            tenant_id=TENANT,
            session_id=worker.session_id,
            from_epoch=plan.epoch,
            reason=pb.PLAN_REASON_OPERATOR_REVOCATION,
            spec=revoked,
        )
    )
    assert list(rotated.plan.tool_names) == []
    await _next_run(worker, "Thanks!")
    fake.script.push_text("You're welcome.", provider="anthropic")
    build = await worker.build()
    worker.send(build)
    assert fake.requests[-1].status == 200, fake.requests[-1].error
    payload = worker.payloads[-1]
    assert "tools" not in payload and not _tool_blocks(payload)
    texts = [b["text"] for m in payload["messages"] for b in m["content"]]
    results = [b for m in build.request.messages for b in m.blocks if b.HasField("tool_result")]
    assert [f"(Result of call toolu_01)\n{r.tool_result.content}" for r in results] == [
        t for t in texts if "06:04 TGV" in t
    ]
    assert any(t.startswith("(Called tool web.fetch with input ") for t in texts)
    assert any(t.endswith(" as call toolu_01)") for t in texts)


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_overlapping_runs_are_accepted_in_every_later_run(
    stub: Any, fake: FakeProvider, claude: anthropic.Anthropic, gpt: openai.OpenAI, provider: str
) -> None:
    """Run 1 calls a tool and waits; the user writes again and run 2 answers; then run 1's
    result lands. Every later run carries run 2's turn between run 1's call and result,
    which Anthropic refused as blocks on every request (an audit): it gets that pair as
    text where it lies, OpenAI as items paired by call id."""
    worker = Worker(stub, provider, claude if provider == "anthropic" else gpt)
    await worker.open("Book me a train to Lyon.")
    first_run = worker.run_id
    await worker.append([assistant("Checking."), call("toolu_01")])  # run 1 waits
    first_version = worker.version
    await _next_run(worker, "Also, what is 2+2?")
    await worker.append([assistant("4.")])
    worker.run_id, worker.version = first_run, first_version
    await worker.append([result("toolu_01", "06:04 TGV"), assistant("Booked the 06:04.")])
    for text in ("Thanks!", "And the return?"):
        await _next_run(worker, text)
        fake.script.push_text("Noted.", provider=provider)
        built = await worker.build()
        worker.send(built)
        assert fake.requests[-1].status == 200, fake.requests[-1].error
        replayed = await stub.GetBuild(
            pb.GetBuildRequest(
                tenant_id=TENANT,
                session_id=worker.session_id,
                request_sequence=built.request_sequence,
            )
        )
        assert replayed.provider_payload == built.provider_payload
    if provider == "anthropic":
        payload = worker.payloads[-1]
        assert not _tool_blocks(payload)
        texts = [b["text"] for m in payload["messages"] for b in m["content"]]
        assert any(t.startswith("(Result of call toolu_01)\n") and "06:04 TGV" in t for t in texts)


@pytest.mark.parametrize("nudged", [False, True])
async def test_a_turn_of_thinking_alone_keeps_the_tool_loops_thinking(
    stub: Any, claude: anthropic.Anthropic, nudged: bool
) -> None:
    """A model turn that sent thinking alone (cut off at max_tokens, or an empty end_turn
    with blank text) after a tool loop's turn: that turn's thinking was dropped, and with
    thinking on the API refused every later request of the run, its tool_use leading an
    assistant turn without the thinking block that must lead it (a review). The payload,
    sent with thinking on, is accepted."""

    def thinking(signature: str) -> pb.ConversationItem:
        block = {"type": "thinking", "thinking": f"Plan {signature}.", "signature": signature}
        opaque = json.dumps(block).encode()
        return pb.ConversationItem(
            reasoning=pb.ReasoningItem(provider=pb.PROVIDER_ANTHROPIC, opaque=opaque)
        )

    session_id, _ = await open_session(stub, model_id=MODELS["anthropic"], policy=POLICY)
    started = await start_run(stub, session_id, "Find trains to Lyon.")
    worker = Worker(stub, "anthropic", claude)
    worker.session_id, worker.run_id = session_id, started.run.run_id
    worker.version = started.checkpoint_version
    await worker.append([thinking("s1"), call("toolu_1"), result("toolu_1", "TGV 07:04")])
    alone = (
        [
            thinking("s2"),
            assistant("  "),
            pb.ConversationItem(user_message=pb.UserMessage(text="Please go on.")),
        ]
        if nudged
        else [thinking("s2")]
    )
    await worker.append(alone)
    payload = json.loads((await worker.build()).provider_payload)
    payload["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    payload["max_tokens"] = max(payload["max_tokens"], 4096)
    message = claude.messages.create(**payload)
    assert message.content
