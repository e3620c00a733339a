"""The fake provider, driven through the official SDKs over loopback HTTP.

Every cache assertion here is a documented provider rule (see the docstrings of
``context_engine.fake_provider.cache``); time moves only through the injected clock.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from context_engine.fake_provider import (
    OPENAI_CACHE_INCREMENT,
    FakeProvider,
    ManualClock,
    canonical_bytes,
    count_tokens,
)

SONNET = "claude-sonnet-4-6"  # minimum cacheable prefix 1024 tokens
HAIKU = "claude-haiku-4-5"  # minimum cacheable prefix 4096 tokens
GPT = "gpt-5"
POLICY = "Platform policy: be careful and precise. " * 150  # ~1,500 tokens
TOOL = {
    "name": "lookup",
    "description": "Look a fact up.",
    "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def fake(clock: ManualClock) -> Iterator[FakeProvider]:
    with FakeProvider(clock=clock) as provider:
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


def cached(text: str, ttl: str | None = None) -> dict[str, Any]:
    control: dict[str, str] = {"type": "ephemeral"}
    if ttl:
        control["ttl"] = ttl
    return {"type": "text", "text": text, "cache_control": control}


def ask(client: anthropic.Anthropic, **kwargs: Any) -> anthropic.types.Message:
    params: dict[str, Any] = {
        "model": SONNET,
        "max_tokens": 256,
        "system": [cached(POLICY)],
        "messages": [{"role": "user", "content": "hello"}],
    }
    params.update(kwargs)
    return client.messages.create(**params)


def system_tokens(text: str = POLICY) -> int:
    """Documented token rule of the fake: ceil(canonical bytes / 4) per block."""
    return count_tokens(canonical_bytes({"type": "text", "text": text}))


def http(url: str, payload: Any | None = None) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        url,
        data=data,
        headers={"content-type": "application/json"},
        method="POST" if data else "GET",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


# --- Anthropic: writes, reads, misses ------------------------------------------------------


def test_first_request_writes_and_identical_second_reads(claude: anthropic.Anthropic) -> None:
    first = ask(claude)
    second = ask(claude)

    assert first.usage.cache_creation_input_tokens == system_tokens()
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == system_tokens()
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens == system_tokens()
    assert second.usage.cache_creation_input_tokens == 0
    assert second.usage.input_tokens == first.usage.input_tokens > 0
    assert (first.id, second.id) == ("msg_fake000001", "msg_fake000002")
    assert second.content[0].text == "ok"


def test_one_changed_byte_in_the_system_prompt_misses(claude: anthropic.Anthropic) -> None:
    ask(claude)
    changed = ask(claude, system=[cached(POLICY[:-1] + "!")])

    assert changed.usage.cache_read_input_tokens == 0
    assert changed.usage.cache_creation_input_tokens == system_tokens()


def test_changing_only_the_last_user_message_still_hits_earlier_breakpoints(
    claude: anthropic.Anthropic, fake: FakeProvider
) -> None:
    history = [
        {"role": "user", "content": "What is the plan?"},
        {"role": "assistant", "content": [cached("The plan is to ship on Friday.")]},
    ]
    ask(claude, messages=[*history, {"role": "user", "content": [cached("Any risks?")]}])
    after = ask(claude, messages=[*history, {"role": "user", "content": [cached("Who owns it?")]}])

    record = fake.requests[-1].cache
    assert record is not None
    assert record["hit_block"] == "messages.1.content.0"
    assert after.usage.cache_read_input_tokens > system_tokens()
    assert after.usage.cache_creation_input_tokens > 0  # the new tail is written
    usage = after.usage
    total = usage.cache_read_input_tokens + usage.cache_creation_input_tokens + usage.input_tokens
    assert total == record["total_input_tokens"]


def test_changing_tool_choice_keeps_tools_and_system_but_misses_messages(
    claude: anthropic.Anthropic,
) -> None:
    messages = [{"role": "user", "content": [cached("Question " * 10)]}]
    first = ask(claude, tools=[TOOL], messages=messages)
    second = ask(claude, tools=[TOOL], messages=messages, tool_choice={"type": "any"})

    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_read_input_tokens < first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens > 0


@pytest.mark.parametrize(("appended", "hit"), [(20, "messages.0.content.4"), (21, "system.0")])
def test_lookback_finds_an_earlier_entry_within_twenty_blocks(
    claude: anthropic.Anthropic, fake: FakeProvider, appended: int, hit: str
) -> None:
    notes = [{"type": "text", "text": f"note {i}"} for i in range(5 + appended)]
    first = [*notes[:4], {**notes[4], "cache_control": {"type": "ephemeral"}}]
    ask(claude, messages=[{"role": "user", "content": first}])

    grown = [*notes[:-1], {**notes[-1], "cache_control": {"type": "ephemeral"}}]
    ask(claude, messages=[{"role": "user", "content": grown}])

    cache = fake.requests[-1].cache
    assert cache is not None
    assert cache["hit_block"] == hit


# --- Anthropic: TTLs ----------------------------------------------------------------------


def test_five_minute_entry_is_refreshed_by_reads_and_expires_when_idle(
    claude: anthropic.Anthropic, clock: ManualClock
) -> None:
    ask(claude)
    clock.advance(299)
    assert ask(claude).usage.cache_read_input_tokens == system_tokens()
    clock.advance(299)  # 598 s after the write, 299 s after the refreshing read
    assert ask(claude).usage.cache_read_input_tokens == system_tokens()
    clock.advance(301)
    expired = ask(claude)
    assert expired.usage.cache_read_input_tokens == 0
    assert expired.usage.cache_creation_input_tokens == system_tokens()


def test_one_hour_entry_outlives_five_minutes(
    claude: anthropic.Anthropic, clock: ManualClock
) -> None:
    first = ask(claude, system=[cached(POLICY, ttl="1h")])
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == system_tokens()
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == 0
    clock.advance(3000)
    assert ask(claude, system=[cached(POLICY, ttl="1h")]).usage.cache_read_input_tokens > 0
    clock.advance(3601)
    assert ask(claude, system=[cached(POLICY, ttl="1h")]).usage.cache_read_input_tokens == 0


def test_one_hour_before_five_minutes_bills_each_segment_at_its_ttl(
    claude: anthropic.Anthropic,
) -> None:
    memory = "Memory snapshot entry. " * 80
    response = ask(claude, system=[cached(POLICY, ttl="1h"), cached(memory, ttl="5m")])

    assert response.usage.cache_creation.ephemeral_1h_input_tokens == system_tokens()
    assert response.usage.cache_creation.ephemeral_5m_input_tokens == system_tokens(memory)


def test_one_hour_after_five_minutes_is_rejected(
    claude: anthropic.Anthropic, fake: FakeProvider
) -> None:
    tool = {**TOOL, "cache_control": {"type": "ephemeral", "ttl": "5m"}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(claude, tools=[tool], system=[cached(POLICY, ttl="1h")])

    body = caught.value.response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(
        "system.0.cache_control.ttl: a ttl='1h' cache_control block must not come after"
    )
    assert body["request_id"] == caught.value.response.headers["request-id"]
    assert fake.stats()["cache_entries"]["anthropic"] == 0


# --- Anthropic: validation ----------------------------------------------------------------


def test_more_than_four_breakpoints_is_a_bad_request(
    claude: anthropic.Anthropic, fake: FakeProvider
) -> None:
    fake.script.push_text("not consumed")
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(claude, system=[cached(f"part {i}") for i in range(5)])

    assert caught.value.status_code == 400
    assert caught.value.response.json()["error"] == {
        "type": "invalid_request_error",
        "message": "A maximum of 4 blocks with cache_control may be provided. Found 5.",
    }
    assert len(fake.script) == 1


def test_prefix_below_the_model_minimum_is_not_cached(
    claude: anthropic.Anthropic, fake: FakeProvider
) -> None:
    assert 1024 <= system_tokens() < 4096
    ask(claude, model=HAIKU)
    again = ask(claude, model=HAIKU)
    assert again.usage.cache_creation_input_tokens == 0
    assert again.usage.cache_read_input_tokens == 0
    assert again.usage.input_tokens == fake.requests[-1].cache["total_input_tokens"]
    assert fake.requests[-1].cache["ignored_breakpoints"] == ["system.0"]

    assert ask(claude, model=SONNET).usage.cache_creation_input_tokens == system_tokens()


def test_tool_result_needs_a_tool_use_in_the_previous_assistant_turn(
    claude: anthropic.Anthropic,
) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "I will not call a tool."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]},
    ]
    with pytest.raises(anthropic.BadRequestError, match=r"unexpected `tool_use_id`.*toolu_x"):
        ask(claude, messages=messages)


def test_tool_use_needs_its_tool_result_first_in_the_next_turn(
    claude: anthropic.Anthropic,
) -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [call]}]
    text = {"type": "text", "text": "also this"}

    with pytest.raises(anthropic.BadRequestError, match="without `tool_result` blocks"):
        ask(claude, messages=[*base, {"role": "user", "content": [text, result]}])
    # Results first, then text; consecutive user messages merge into one turn.
    ok = ask(
        claude,
        tools=[TOOL],
        messages=[
            *base,
            {"role": "user", "content": [result, text]},
            {"role": "user", "content": "and one more thing"},
        ],
    )
    assert ok.stop_reason == "end_turn"


def _one_tool_loop(tool_id: str) -> list[dict[str, Any]]:
    call = {"type": "tool_use", "id": tool_id, "name": "lookup", "input": {"q": "x"}}
    result = {"type": "tool_result", "tool_use_id": tool_id, "content": "42"}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]


USER_HI = {"role": "user", "content": "hi"}


def test_tool_use_ids_must_match_the_api_pattern(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="should match pattern"):
        ask(claude, tools=[TOOL], messages=_one_tool_loop("functions.lookup:0"))


def test_tool_blocks_need_tools_defined(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="must define tools"):
        ask(claude, messages=_one_tool_loop("toolu_1"))
    assert ask(claude, tools=[TOOL], messages=_one_tool_loop("toolu_1")).stop_reason == "end_turn"


def test_a_top_level_combinator_in_an_input_schema_is_a_bad_request(
    claude: anthropic.Anthropic,
) -> None:
    union = {**TOOL, "input_schema": {**TOOL["input_schema"], "anyOf": [{"required": ["q"]}]}}
    with pytest.raises(anthropic.BadRequestError, match="anyOf at the top level"):
        ask(claude, tools=[union], messages=[{"role": "user", "content": "hi"}])


def test_a_property_name_outside_anthropics_pattern_is_a_bad_request(
    claude: anthropic.Anthropic,
) -> None:
    bracketed = {**TOOL, "input_schema": {"type": "object", "properties": {"filter[id]": {}}}}
    with pytest.raises(anthropic.BadRequestError, match="Property keys should match"):
        ask(claude, tools=[bracketed], messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "integer", "exclusiveMinimum": True},  # draft 4's boolean form
        {"type": "array", "items": [{"type": "string"}]},  # draft 4's tuple form
        {"type": "string", "description": 3},
    ],
)
def test_an_input_schema_outside_draft_2020_12_is_a_bad_request(
    claude: anthropic.Anthropic, bad: dict[str, object]
) -> None:
    """Anthropic validates each tool's input schema against JSON Schema draft 2020-12 and
    refuses the request when it fails (Rule V13): the fake took such schemas, so only
    Plan's own check (core/tool_schema.py) stood between a worker and the 400."""
    schema = {"type": "object", "properties": {"q": bad}}
    with pytest.raises(anthropic.BadRequestError, match="must match JSON Schema draft 2020-12"):
        ask(claude, tools=[{**TOOL, "input_schema": schema}], messages=[USER_HI])
    fine = {"type": "object", "properties": {"q": {"type": "array", "prefixItems": [{}]}}}
    assert ask(claude, tools=[{**TOOL, "input_schema": fine}], messages=[USER_HI]).content


def test_whitespace_text_and_an_assistant_first_conversation_are_bad_requests(
    claude: anthropic.Anthropic,
) -> None:
    """What the renderer avoids because the API refuses it: text of whitespace alone (a
    block, a system block, a tool result's content) and a conversation that does not start
    with the user (the renderer's placeholder turn). The fake took all of them (an audit),
    so a renderer regression there would have passed the SDK tests."""
    blank = {"type": "text", "text": " \n "}
    with pytest.raises(anthropic.BadRequestError, match="non-whitespace text"):
        ask(claude, messages=[{"role": "user", "content": [blank]}])
    with pytest.raises(anthropic.BadRequestError, match="non-whitespace text"):
        ask(claude, system=[blank], messages=[{"role": "user", "content": "hi"}])
    loop = _one_tool_loop("toolu_1")
    loop[2]["content"][0]["content"] = "  "
    with pytest.raises(anthropic.BadRequestError, match="non-whitespace text"):
        ask(claude, tools=[TOOL], messages=loop)
    with pytest.raises(anthropic.BadRequestError, match='first message must use the "user"'):
        ask(
            claude,
            messages=[
                {"role": "assistant", "content": "Earlier answer."},
                {"role": "user", "content": "hi"},
            ],
        )


def test_thinking_tool_loop_must_replay_the_thinking_block(
    claude: anthropic.Anthropic, fake: FakeProvider
) -> None:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    fake.script.push_tool_call("lookup", {"q": "x"}, id="toolu_1", thinking="Check first.")
    turn = ask(claude, tools=[TOOL], thinking=thinking, max_tokens=2048)
    assert [b.type for b in turn.content] == ["thinking", "tool_use"]

    def follow_up(assistant_content: list[dict[str, Any]]) -> anthropic.types.Message:
        return ask(
            claude,
            tools=[TOOL],
            thinking=thinking,
            max_tokens=2048,
            messages=[
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": assistant_content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}],
                },
            ],
        )

    replayed = [b.model_dump(exclude_none=True) for b in turn.content]
    with pytest.raises(
        anthropic.BadRequestError, match="Expected `thinking` or `redacted_thinking`"
    ):
        follow_up(replayed[1:])
    assert follow_up(replayed).stop_reason == "end_turn"


# --- Anthropic: scripted replies ----------------------------------------------------------


def test_scripted_tool_call_round_trips_through_the_sdk(
    claude: anthropic.Anthropic, fake: FakeProvider
) -> None:
    fake.script.push_tool_call("lookup", {"q": "cats"}, id="toolu_1", text="Let me look.")
    reply = ask(claude, tools=[TOOL])

    assert reply.stop_reason == "tool_use"
    text, tool_use = reply.content
    assert isinstance(text, anthropic.types.TextBlock)
    assert isinstance(tool_use, anthropic.types.ToolUseBlock)
    assert (tool_use.id, tool_use.name, tool_use.input) == ("toolu_1", "lookup", {"q": "cats"})

    follow_up = ask(
        claude,
        tools=[TOOL],
        messages=[
            {"role": "user", "content": "hello"},
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in reply.content],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "meow"}],
            },
        ],
    )
    assert follow_up.content[0].text == "ok"


def test_scripted_error_surfaces_as_the_sdk_status_error(
    claude: anthropic.Anthropic, fake: FakeProvider
) -> None:
    fake.script.push_error(529, "Overloaded")
    with pytest.raises(anthropic.APIStatusError) as caught:
        ask(claude)
    assert caught.value.status_code == 529
    assert caught.value.response.json()["error"] == {
        "type": "overloaded_error",
        "message": "Overloaded",
    }
    assert fake.stats()["cache_entries"]["anthropic"] == 0


def test_count_tokens_matches_the_billed_total(
    claude: anthropic.Anthropic, fake: FakeProvider
) -> None:
    counted = claude.messages.count_tokens(
        model=SONNET, system=[cached(POLICY)], messages=[{"role": "user", "content": "hello"}]
    )
    ask(claude)
    assert counted.input_tokens == fake.requests[-1].cache["total_input_tokens"]


# --- OpenAI -------------------------------------------------------------------------------


def respond(client: openai.OpenAI, **kwargs: Any) -> Any:
    params: dict[str, Any] = {
        "model": GPT,
        "instructions": POLICY,
        "input": "hello",
        "prompt_cache_key": "session-a",
    }
    params.update(kwargs)
    return client.responses.create(**params)


def test_openai_cached_tokens_come_in_128_token_steps(gpt: openai.OpenAI) -> None:
    first = respond(gpt)
    second = respond(gpt)
    longer = respond(
        gpt,
        input=[
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "hi " * 400}]},
            {"role": "user", "content": "next"},
        ],
    )

    n = first.usage.input_tokens
    assert first.usage.input_tokens_details.cached_tokens == 0
    step = 128  # documented; not the module constant, so a wrong constant fails here
    assert step == OPENAI_CACHE_INCREMENT
    assert second.usage.input_tokens_details.cached_tokens == n // step * step >= 1024
    # The longer prompt shares the first prompt's prefix up to "hello": the hit is that
    # prefix rounded down to a 128-token step.
    assert longer.usage.input_tokens_details.cached_tokens == n // step * step
    assert longer.usage.input_tokens > n
    assert second.usage.total_tokens == n + second.usage.output_tokens


def test_openai_entries_are_routed_by_prompt_cache_key(gpt: openai.OpenAI) -> None:
    respond(gpt, prompt_cache_key="session-a")
    assert respond(gpt, prompt_cache_key="session-b").usage.input_tokens_details.cached_tokens == 0
    assert respond(gpt, prompt_cache_key="session-a").usage.input_tokens_details.cached_tokens > 0
    no_key = gpt.responses.create(model=GPT, instructions=POLICY, input="hello")
    assert no_key.usage.input_tokens_details.cached_tokens == 0


def test_openai_prompts_under_1024_tokens_are_never_cached(gpt: openai.OpenAI) -> None:
    respond(gpt, instructions="Be brief.")
    again = respond(gpt, instructions="Be brief.")
    assert again.usage.input_tokens < 1024
    assert again.usage.input_tokens_details.cached_tokens == 0


def test_openai_entries_expire_after_five_idle_minutes(
    gpt: openai.OpenAI, clock: ManualClock
) -> None:
    respond(gpt)
    clock.advance(299)
    assert respond(gpt).usage.input_tokens_details.cached_tokens > 0
    clock.advance(301)
    assert respond(gpt).usage.input_tokens_details.cached_tokens == 0


def test_openai_an_array_schema_without_items_is_a_bad_request(gpt: openai.OpenAI) -> None:
    """OpenAI refuses "array schema missing items" in a function's parameters, strict or
    not (the fake took it: an audit)."""
    tool = {
        "type": "function",
        "name": "tag",
        "strict": False,
        "parameters": {"type": "object", "properties": {"tags": {"type": "array"}}},
    }
    with pytest.raises(openai.BadRequestError, match="array schema missing items"):
        gpt.responses.create(model="gpt-4o", input="hi", tools=[tool])
    tool["parameters"]["properties"]["tags"]["items"] = {"type": "string"}
    assert gpt.responses.create(model="gpt-4o", input="hi", tools=[tool]).output


def test_openai_function_call_output_needs_its_function_call(gpt: openai.OpenAI) -> None:
    items = [
        {"role": "user", "content": "hello"},
        {"type": "function_call_output", "call_id": "call_404", "output": "42"},
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        respond(gpt, input=items)
    assert caught.value.response.json() == {
        "error": {
            "message": "No tool call found for function call output with call_id call_404.",
            "type": "invalid_request_error",
            "param": "input",
            "code": None,
        }
    }


def test_openai_call_ids_over_64_characters_are_a_bad_request(gpt: openai.OpenAI) -> None:
    call_id = "c" * 65
    items = [
        {"role": "user", "content": "hello"},
        {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": call_id, "output": "42"},
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        respond(gpt, input=items)
    error = caught.value.response.json()["error"]
    assert (error["param"], error["code"]) == ("input[1].call_id", "string_above_max_length")
    items[1]["call_id"] = items[2]["call_id"] = "c" * 64
    respond(gpt, input=items)


def test_openai_reasoning_items_are_replayed_with_their_following_item(
    gpt: openai.OpenAI,
) -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e"}
    call = {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"}
    paired = {**call, "id": "fc_1"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "1"}
    user = {"role": "user", "content": "hello"}

    with pytest.raises(openai.BadRequestError, match="without its required following item"):
        respond(gpt, store=False, input=[user, reasoning, output])
    # Rule W6: the following item is named by its id, which pairs it with the reasoning.
    with pytest.raises(openai.BadRequestError, match="without its required following item"):
        respond(gpt, store=False, input=[user, reasoning, call, output])
    bare = {k: v for k, v in reasoning.items() if k != "encrypted_content"}
    with pytest.raises(openai.BadRequestError, match="not persisted when `store` is set to false"):
        respond(gpt, store=False, input=[user, bare, paired, output])
    assert respond(gpt, store=False, input=[user, reasoning, paired, output]).output_text == "ok"
    # Rule W7: an output named by its id comes after its reasoning.
    with pytest.raises(openai.BadRequestError, match="'fc_1' of type 'function_call' was provided"):
        respond(gpt, store=False, input=[user, paired, output])
    text = {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
    }
    with pytest.raises(openai.BadRequestError, match="'msg_1' of type 'message' was provided"):
        respond(gpt, store=False, input=[user, text, paired, output])
    turn = [user, reasoning, text, paired, output]
    assert respond(gpt, store=False, input=turn).output_text == "ok"
    # An output without its id between: not one turn's output, every item of which has one.
    unnamed = {"type": "message", "role": "assistant", "content": "Looking."}
    with pytest.raises(openai.BadRequestError, match="'fc_1' of type 'function_call' was provided"):
        respond(gpt, store=False, input=[user, reasoning, text, unnamed, paired, output])


def test_openai_scripted_function_call_round_trips(gpt: openai.OpenAI, fake: FakeProvider) -> None:
    tools = [
        {
            "type": "function",
            "name": "lookup",
            "description": "Look a fact up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            "strict": False,
        }
    ]
    fake.script.push_tool_call("lookup", {"q": "dogs"}, thinking="think", provider="openai")
    first = respond(gpt, tools=tools, include=["reasoning.encrypted_content"], store=False)

    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    assert call.type == "function_call"
    assert call.name == "lookup" and json.loads(call.arguments) == {"q": "dogs"}
    assert first.usage.output_tokens_details.reasoning_tokens > 0

    second = respond(
        gpt,
        tools=tools,
        store=False,
        input=[
            {"role": "user", "content": "hello"},
            reasoning.model_dump(exclude_none=True),
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "woof"},
        ],
    )
    assert second.output_text == "ok"
    assert second.usage.input_tokens_details.cached_tokens > 0


# --- control endpoints and entry point ------------------------------------------------------


def test_script_stats_and_reset_over_http(
    claude: anthropic.Anthropic, gpt: openai.OpenAI, fake: FakeProvider
) -> None:
    queued = http(
        fake.base_url + "/_fake/script",
        [
            {
                "provider": "openai",
                "tool_calls": [{"name": "lookup", "arguments": {"q": "x"}, "id": "call_9"}],
            },
            {"text": "second"},
        ],
    )
    assert queued == {"queued": 2, "pending_replies": 2}

    assert ask(claude).content[0].text == "second"  # the OpenAI-pinned reply is skipped
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
    call = respond(gpt, tools=tools).output[0]
    assert (call.type, call.call_id) == ("function_call", "call_9")

    stats = http(fake.base_url + "/_fake/stats?include=request")
    assert [r["provider"] for r in stats["requests"]] == ["anthropic", "openai"]
    assert stats["requests"][0]["usage"]["cache_creation_input_tokens"] == system_tokens()
    assert stats["requests"][1]["request"]["prompt_cache_key"] == "session-a"
    assert "request" not in http(fake.base_url + "/_fake/stats")["requests"][0]

    assert http(fake.base_url + "/_fake/reset", {}) == {"reset": True}
    assert http(fake.base_url + "/_fake/stats")["requests"] == []
    again = ask(claude)
    assert again.id == "msg_fake000001"
    assert again.usage.cache_creation_input_tokens == system_tokens()


def test_only_loopback_addresses_are_served() -> None:
    with pytest.raises(ValueError, match="loopback"):
        FakeProvider().start(host="0.0.0.0")


def test_module_entry_point_prints_its_base_url() -> None:
    service = Path(__file__).resolve().parents[2] / "service"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(service), os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "context_engine.fake_provider", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        assert process.stdout is not None
        base_url = process.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:")
        assert http(base_url + "/_fake/stats")["requests"] == []
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
    assert process.returncode == 0


def test_a_port_in_use_is_a_start_up_failure_in_one_line() -> None:
    """A taken port is not a usage error: exit 1 and one line, not argparse's usage and
    exit 2 (an operator audit)."""
    from context_engine.fake_provider.__main__ import main

    taken = FakeProvider()
    base_url = taken.start(host="127.0.0.1", port=0)
    try:
        listen = base_url.removeprefix("http://")
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert main(["--listen", listen]) == 1
        line = err.getvalue().strip()
        assert "\n" not in line and f"cannot listen on {listen}" in line, line
    finally:
        taken.stop()


@pytest.mark.parametrize("listen", ["127.0.0.1:70000", "0.0.0.0:0", "127.0.0.1:x"])
def test_a_listen_address_it_cannot_take_is_usage(listen: str) -> None:
    """A port out of range failed in an OverflowError traceback, and a host off loopback is
    the caller's mistake, not a start-up failure (a review)."""
    from context_engine.fake_provider.__main__ import main

    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exited:
        main(["--listen", listen])
    assert exited.value.code == 2
