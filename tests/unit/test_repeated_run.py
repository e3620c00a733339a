"""ModelRequest.repeated: the interior of a run's carried suffix, serialized as one memoized
fragment (core/request.py with_repeated_run; the canonical bytes, the wire bytes and the
Anthropic turns). A hint never changes a byte: every serializer gives with it what it gives
without it, wherever the hint lies, whatever markers land inside it, whatever ids repeat;
a hint that does not hold (other objects, out of range) is ignored; and the hint assembly
sets always holds, so the fast path is the one Builds take."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from context_engine.api.convert import request_to_proto
from context_engine.api.wire import request_bytes, request_message
from context_engine.core import assemble, canonical_bytes
from context_engine.core.request import (
    CacheBreakpoint,
    Message,
    ModelRequest,
    RepeatedRun,
    repeated_run,
)
from context_engine.providers import anthropic, openai

from .strategies import SCENARIO_SETTINGS, Scenario, scenarios


def _assembled(sc: Scenario) -> ModelRequest:
    assembled = assemble(sc.inputs())
    assert assembled.request is not None
    return assembled.request


def _bytes_of(request: ModelRequest, budget: int) -> tuple[bytes, ...]:
    return (
        request.canonical_bytes(),
        request_bytes(request),
        anthropic.render(request, budget).body,
        openai.render(request).body,
    )


def _without_hint(request: ModelRequest) -> ModelRequest:
    return replace(request, repeated=None)


_ANY_SCENARIO = st.one_of(
    scenarios(),
    scenarios(modes=("loop", "answered"), carried_reasoning=True),
    scenarios(modes=("loop", "answered"), reuse_call_ids=True),
)


@settings(SCENARIO_SETTINGS, max_examples=60)
@given(_ANY_SCENARIO, st.integers(0, 4), st.data())
def test_a_hint_anywhere_changes_no_byte(sc: Scenario, budget: int, data: st.DataObject) -> None:
    request = _assembled(sc)
    messages = request.messages
    start = data.draw(st.integers(0, len(messages)))
    end = data.draw(st.integers(start, len(messages)))
    ids = [b.item_id for m in messages for b in m.blocks] or ["x"]
    # History markers aimed anywhere: inside the run they send Anthropic's layout back to
    # the messages one by one.
    names = data.draw(st.lists(st.sampled_from(["carried_history", "run", "x"]), max_size=3))
    marks = tuple(
        CacheBreakpoint(name, data.draw(st.sampled_from(ids)), priority=2 + k)
        for k, name in enumerate(names)
    )
    kept = tuple(b for b in request.cache_breakpoints if b.name.startswith("after_"))
    plain = replace(request, cache_breakpoints=kept + marks, repeated=None)
    hinted = replace(plain, repeated=RepeatedRun(messages, start, tuple(messages[start:end])))
    assert _bytes_of(hinted, budget) == _bytes_of(plain, budget)
    assert hinted.canonical_bytes() == canonical_bytes(hinted.canonical())
    assert request_message(hinted) == request_to_proto(hinted)


@settings(SCENARIO_SETTINGS, max_examples=30)
@given(_ANY_SCENARIO, st.data())
def test_a_hint_that_does_not_hold_is_refused_or_ignored(sc: Scenario, data: st.DataObject) -> None:
    request = _assembled(sc)
    messages = request.messages
    if not messages:
        return
    start = data.draw(st.integers(-2, len(messages) + 2))
    # Equal messages that are other objects, or a run that runs past the end: not a hint.
    copies = tuple(Message(m.role, m.blocks) for m in messages[max(start, 0) :])
    long = (*messages[max(start, 0) :], *messages[:1])
    run = data.draw(st.sampled_from([copies, long]))
    if run:
        with pytest.raises(ValueError, match="very messages"):
            RepeatedRun(messages, start, run)
    # A request rebuilt with other messages keeps the hint, which then holds for nothing.
    rebuilt = replace(request, messages=tuple(Message(m.role, m.blocks) for m in messages))
    assert repeated_run(rebuilt) is None
    assert _bytes_of(rebuilt, 4) == _bytes_of(_without_hint(request), 4)


@settings(SCENARIO_SETTINGS, max_examples=60)
@given(_ANY_SCENARIO)
def test_the_hint_assembly_sets_holds(sc: Scenario) -> None:
    request = _assembled(sc)
    assert request.repeated is not None
    if request.repeated.run:
        assert repeated_run(request) is request.repeated
    assert _bytes_of(request, 4) == _bytes_of(_without_hint(request), 4)


@settings(SCENARIO_SETTINGS, max_examples=60)
@given(_ANY_SCENARIO, st.integers(0, 4), st.data())
def test_a_payload_hash_resumed_after_the_run_is_the_bodys_hash(
    sc: Scenario, budget: int, data: st.DataObject
) -> None:
    """RenderedPayload.sha256 resumes hashing after the repeated run's turns from the state
    kept on the run's layout (providers/layout.py StablePrefix): at the first render, at
    the renders after it, with another head before the run (max_tokens) and another tail
    after it (the last message gone), it is the SHA-256 of the body."""
    request = _assembled(sc)
    messages = request.messages
    if data.draw(st.booleans()):  # text past ASCII: its UTF-8 bytes outnumber its characters
        messages = tuple(
            Message(
                m.role,
                tuple(replace(b, text=b.text + " é—") if b.kind == "text" else b for b in m.blocks),
            )
            for m in messages
        )
        request = replace(request, messages=messages)
    start = data.draw(st.integers(0, len(messages)))
    end = data.draw(st.integers(start, len(messages)))
    run = tuple(messages[start:end])  # one tuple: the memos are keyed on it
    hinted = replace(request, repeated=RepeatedRun(messages, start, run))
    variants = [hinted, hinted, replace(hinted, max_output_tokens=request.max_output_tokens + 1)]
    if end < len(messages):
        shorter = messages[:-1]
        variants.append(
            replace(hinted, messages=shorter, repeated=RepeatedRun(shorter, start, run))
        )
    for variant in variants * 2:
        rendered = anthropic.render(variant, budget)
        stable = rendered.stable
        event(f"stable prefix: {stable is not None}")
        assert rendered.sha256() == hashlib.sha256(rendered.body).hexdigest()
        if stable is not None:
            assert rendered.body.startswith((stable.head + stable.piece).encode("utf-8"))
            assert hashlib.sha256(stable.head.encode("utf-8")).digest() in stable.states
        plain = openai.render(variant)
        assert plain.sha256() == hashlib.sha256(plain.body).hexdigest()


@settings(SCENARIO_SETTINGS, max_examples=60)
@given(_ANY_SCENARIO, st.data())
def test_a_request_hash_resumed_after_the_run_is_the_hash_of_its_parts(
    sc: Scenario, data: st.DataObject
) -> None:
    """ModelRequest.request_sha256 hashes the messages array resuming after the repeated
    run, from the state kept per head before it (core/request.py Rule 1): the first time,
    the times after, with another head (a message before the run changed or gone), another
    tail and no hint, it is the SHA-256 of the canonical parts (`hashed()`)."""
    request = _assembled(sc)
    messages = request.messages
    start = data.draw(st.integers(0, len(messages)))
    end = data.draw(st.integers(start, len(messages)))
    run = tuple(messages[start:end])  # one tuple: the states are kept on it
    hinted = replace(request, repeated=RepeatedRun(messages, start, run))
    variants = [hinted, hinted]
    if start:  # another head: its first message's text changed, or the message gone
        first = messages[0]
        changed = Message(first.role, tuple(replace(b, text=b.text + "!") for b in first.blocks))
        for head in ((changed, *messages[1:start]), messages[1:start]):
            moved = (*head, *messages[start:])
            variants.append(
                replace(hinted, messages=moved, repeated=RepeatedRun(moved, len(head), run))
            )
    if end < len(messages):  # another tail
        shorter = messages[:-1]
        variants.append(
            replace(hinted, messages=shorter, repeated=RepeatedRun(shorter, start, run))
        )
    for variant in [*variants, *variants, _without_hint(hinted)]:
        expected = hashlib.sha256(canonical_bytes(variant.hashed())).hexdigest()
        assert variant.request_sha256() == expected


def test_a_long_runs_items_are_rendered_and_costed_once_across_its_builds() -> None:
    """A run's items arrive as new objects at each Build and find their rendering and cost
    by content (core/assemble.py, _render_memo and _cost_memo). The memos dropped their
    oldest entries past 8,192: a run of more items than that missed every one of them at
    every Build, each Build costing ten times what the next one costs now (a triage:
    16,000 items took 0.9-1.3 s a Build, 0.1 s warm). The second Build derives nothing."""
    import importlib
    from datetime import UTC, datetime

    from context_engine.core import Checkpoint, PlanSpec
    from context_engine.core.items import AssistantMessage, UserMessage
    from context_engine.core.spec import PlatformPolicySpec

    items = [
        UserMessage(item_id="u", text="go", sequence=1, run_id="r"),
        *(
            AssistantMessage(item_id=f"a{n}", text=f"step {n}", sequence=n + 2, run_id="r")
            for n in range(9_000)
        ),
    ]
    spec = PlanSpec(model_id="m", policy=PlatformPolicySpec(version="v1", text="policy"))
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)

    def build() -> None:
        # Items read afresh, as from a new checkpoint read: equal content, new objects.
        fresh = tuple(i.model_copy() for i in items)
        checkpoint = Checkpoint(run_id="r", version=1, items=fresh)
        scenario = Scenario(spec=spec, secret=b"s" * 32, checkpoint=checkpoint, carried=(), now=now)
        assert assemble(scenario.inputs()).request is not None

    build()
    assembly = importlib.import_module("context_engine.core.assemble")
    costed = assembly._cost_memo._function
    calls: list[object] = []

    def counted(*args: object) -> object:
        calls.append(args[0])
        return costed(*args)

    assembly._cost_memo._function = counted
    try:
        build()
    finally:
        assembly._cost_memo._function = costed
    assert calls == []
