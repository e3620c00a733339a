"""core/body_estimate.py Rule 6: the texts a renderer adds of its own (core/fixed_texts.py)
are in the estimate. For every tool block, what each form of rendering sends of it as text
(OpenAI's items, counted by the exact tokenizers; Anthropic's text form, counted by the
heuristic that counts Anthropic models) is within what the block is estimated at in that
form, less its message framing; a request's body budget
pays for the reply priming and the placeholder turn before any item is fitted; and the
counting GetBuild uses for a context-assembler@12 record gives @12's own figures."""

from __future__ import annotations

import hashlib
import importlib
import json
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from context_engine.core.body_estimate import (
    FixedTexts,
    block_tokens,
    fixed_texts_of,
    request_framing,
)
from context_engine.core.estimator import (
    MESSAGE_FRAMING_TOKENS,
    PPM,
    REQUEST_FRAMING_TOKENS,
    heuristic_count,
)
from context_engine.core.fixed_texts import HISTORY_CUT_PLACEHOLDER
from context_engine.core.items import ToolCall, ToolResult
from context_engine.core.rows import Row
from context_engine.core.trust import TrustLevel
from context_engine.providers import anthropic, openai
from context_engine.providers.call_ids import BASE_IDS
from context_engine.tokenizers import build_counters

assembly = importlib.import_module("context_engine.core.assemble")

SECRET = b"s" * 32
EXACT = {name: counter.count_text for name, counter in build_counters().items()}
# Anthropic's text form is counted by the counter Anthropic models count with: the
# heuristic (the registry ships no exact Claude tokenizer). Counted in pieces (the form's
# words, then each field), it bounds the heuristic's count of the joined text; an exact BPE
# tokenizer can count the joined text a token or two above its pieces (a generated example:
# `(Called tool jf with input {} as call 0_Tx-2)`, 17 cl100k tokens against pieces of 16),
# which is no figure any Anthropic request is counted with.
ANTHROPIC = {"heuristic": heuristic_count}
GATE = settings(max_examples=300, deadline=None)

names = st.from_regex(r"[a-z][a-z0-9_.]{0,24}", fullmatch=True)
# Provider-made ids, and a worker's own (any characters; Anthropic's base id replaces those
# outside [A-Za-z0-9_-]).
call_ids = st.from_regex(r"call_[A-Za-z0-9]{1,24}", fullmatch=True) | st.from_regex(
    r"[A-Za-z0-9_.:/-]{1,24}", fullmatch=True
)
# The suffix of an id an earlier pair of the request took (0: not moved).
moves = st.sampled_from([0, 2, 3, 9, 10, 42, 99])
contents = st.text(max_size=80) | st.sampled_from(["", "x", "404", "Not found.", "\n"])
trusts = st.sampled_from(list(TrustLevel))


def _estimated(block: Any, item: Any, count: Any, provider: str) -> int:
    """The block's estimate less its framing, in the form a request of `provider` without
    tools sends it (Anthropic's text form; OpenAI sends blocks with or without tools)."""
    fixed = fixed_texts_of(provider, defines_tools=False)
    return block_tokens(block, item, count, PPM, fixed_texts=fixed) - MESSAGE_FRAMING_TOKENS


def _sent(pieces: list[str], count: Any) -> int:
    return sum(count(p) for p in pieces if p)


def _moved(provider: str, call_id: str, move: int) -> str:
    """The wire id of a pair whose id moved (providers/call_ids.py Rule 2); "" if not."""
    return f"{BASE_IDS[provider](call_id)}-{move}" if move else ""


def _openai_result(block: Any, move: int = 0) -> list[str]:
    sent = openai._item("user", block, _moved("openai", block.call_id, move))
    assert sent is not None and sent["type"] == "function_call_output"
    return [sent["output"], sent["call_id"]]


def _text_form(block: Any, move: int = 0) -> list[str]:
    moved = _moved("anthropic", block.call_id, move)
    rendered = anthropic._render_block_as_text(block, moved)
    return [] if rendered is None else [rendered.obj["text"]]


@GATE
@given(
    call_id=call_ids,
    tool=names,
    content=contents,
    trust=trusts,
    failed=st.booleans(),
    move=moves,
)
def test_a_results_estimate_covers_what_each_rendering_sends_of_it(
    call_id: str, tool: str, content: str, trust: TrustLevel, failed: bool, move: int
) -> None:
    """OpenAI sends a failed result's TOOL_ERROR_AS_TEXT line before its content;
    Anthropic without tools sends the TOOL_RESULT_AS_TEXT line, then that line, then the
    content. Both are counted in the block's estimate."""
    item = ToolResult(
        item_id="r1",
        call_id=call_id,
        tool_name=tool,
        content=content,
        is_error=failed,
        trust=trust,
        sequence=3,
        run_id="current",
    )
    block = assembly._render(Row.CONVERSATION, item, SECRET)
    for count in EXACT.values():
        openai_sent = _sent(_openai_result(block, move), count)
        assert openai_sent <= _estimated(block, item, count, "openai")
    for count in ANTHROPIC.values():
        assert _sent(_text_form(block, move), count) <= _estimated(block, item, count, "anthropic")


@GATE
@given(
    call_id=call_ids,
    tool=names,
    arguments=st.sampled_from(["{}", '{"q":"x"}', '{"a":[1,2]}']),
    move=moves,
)
def test_a_calls_estimate_covers_what_each_rendering_sends_of_it(
    call_id: str, tool: str, arguments: str, move: int
) -> None:
    """Anthropic without tools sends a call as TOOL_CALL_AS_TEXT around its name,
    arguments and call id; OpenAI sends the three as a function_call's fields."""
    item = ToolCall(
        item_id="c1",
        call_id=call_id,
        tool_name=tool,
        arguments_json=arguments,
        sequence=2,
        run_id="current",
    )
    block = assembly._render(Row.CONVERSATION, item, SECRET)
    sent = openai._item("assistant", block, _moved("openai", call_id, move))
    assert sent is not None
    for count in EXACT.values():
        fields = [sent["name"], sent["arguments"], sent["call_id"]]
        assert _sent(fields, count) <= _estimated(block, item, count, "openai")
    for count in ANTHROPIC.values():
        assert _sent(_text_form(block, move), count) <= _estimated(block, item, count, "anthropic")


def test_a_short_failed_result_was_under_its_estimate_without_the_fixed_texts() -> None:
    """What the gate above would have caught under context-assembler@12's counting (which
    GetBuild still uses to rebuild those records): a failed result of a few characters
    sends more than its estimate, about the failed line's size under."""
    item = ToolResult(
        item_id="r1",
        call_id="call_1",
        tool_name="t",
        content="404",
        is_error=True,
        trust=TrustLevel.TRUSTED_CONFIGURATION,
        sequence=3,
        run_id="current",
    )
    block = assembly._render(Row.CONVERSATION, item, SECRET)
    count = EXACT["o200k_base"]
    legacy = (
        block_tokens(block, item, count, PPM, fixed_texts=FixedTexts.NONE) - MESSAGE_FRAMING_TOKENS
    )
    current = _estimated(block, item, count, "openai")
    sent = _sent(_openai_result(block), count)
    assert legacy < sent <= current


@given(factor=st.integers(PPM, 4 * PPM))
def test_a_requests_framing_is_the_priming_and_the_placeholder_turn(factor: int) -> None:
    placeholder = -(-heuristic_count(HISTORY_CUT_PLACEHOLDER) * factor // PPM)
    assert request_framing(heuristic_count, factor) == (
        REQUEST_FRAMING_TOKENS + placeholder + MESSAGE_FRAMING_TOKENS
    )
    assert request_framing(heuristic_count, factor, counted=False) == 0


def test_only_anthropic_without_tools_counts_the_text_forms_words() -> None:
    assert fixed_texts_of("anthropic", defines_tools=False) is FixedTexts.TEXT
    assert fixed_texts_of("anthropic", defines_tools=True) is FixedTexts.BLOCKS
    assert fixed_texts_of("openai", defines_tools=False) is FixedTexts.BLOCKS
    assert fixed_texts_of("openai", defines_tools=True, counted=False) is FixedTexts.NONE


# --- the counting of context-assembler@12, which GetBuild uses for its records -----------


def _pairs(run: str, start: int, n: int) -> list[Any]:
    """`n` tool pairs of run `run` from sequence `start`: every third call failed."""
    items: list[Any] = []
    for k in range(n):
        call_id, seq = f"call_{run}{k}", start + 2 * k
        items.append(
            ToolCall(
                item_id=f"{run}c{k}",
                call_id=call_id,
                tool_name="web.fetch",
                arguments_json=f'{{"q":"x{k}"}}',
                sequence=seq,
                run_id=run,
            )
        )
        failed = k % 3 == 0
        items.append(
            ToolResult(
                item_id=f"{run}r{k}",
                call_id=call_id,
                tool_name="web.fetch",
                content="HTTP 503" if failed else f"row {k} " * (40 + k),
                is_error=failed,
                trust=TrustLevel.EXTERNAL_UNTRUSTED,
                sequence=seq + 1,
                run_id=run,
            )
        )
    return items


def _figures(count: Any, room: int, counted: bool) -> dict[str, Any]:
    """estimate_to_record of a 20-pair carried run and a 30-pair current one with five
    knowledge passages, in an Anthropic plan without tools (its pairs go as text) whose
    body is `room` tokens."""
    from context_engine.core import BuildInputs, Checkpoint, StepContext, assemble
    from context_engine.core.build_record import estimate_to_record
    from context_engine.core.items import AssistantMessage, KnowledgePassageItem, UserMessage

    from .strategies import small_plan

    carried = [
        UserMessage(item_id="u0", text="Start.", sequence=1, run_id="r0"),
        *_pairs("r0", 2, 20),
        AssistantMessage(item_id="a0", text="Done before.", sequence=42, run_id="r0"),
    ]
    run = [
        UserMessage(item_id="u1", text="Go on.", sequence=43, run_id="cur"),
        *_pairs("cur", 44, 30),
    ]
    probe = small_plan(200_000, 0, 1_000, secret=SECRET, count=count)
    cap = probe.prefix_tokens + 1_000 + room
    passages = tuple(
        KnowledgePassageItem(item_id=f"k{i}", text=f"passage {i} " * 30, rank=i) for i in range(5)
    )
    built = assemble(
        BuildInputs(
            tenant_id="t",
            plan=small_plan(200_000, cap, 1_000, secret=SECRET, count=count),
            secret=SECRET,
            checkpoint=Checkpoint(run_id="cur", version=1, items=tuple(run)),
            carried=tuple(carried),
            now=datetime(2026, 12, 6, tzinfo=UTC),
            step=StepContext(knowledge=passages),
            count_tokens=count,
            fixed_texts=counted,
        )
    )
    return {"needs_compaction": built.needs_compaction, **estimate_to_record(built)}


# Measured with context-assembler@12's code (4cfeb33): (needs compaction, estimated input
# tokens, SHA-256 of every figure as canonical JSON).
_AT_12 = {
    ("heuristic", 60_000): (
        False,
        10_848,
        "fcbcbede4294794b91be375ca0438512cda1bf30562630da8b7e5757b8550e37",
    ),
    ("heuristic", 4_000): (
        True,
        6_230,
        "b7d12b5b60381fda7d606d817dfb83ae003790f5e595498b5ee777c560902fa6",
    ),
    ("o200k_base", 60_000): (
        False,
        9_454,
        "4edc36918fee8b640c22a5f8fd1ce41ecc287fccdec25898d64af6a520c4b2ad",
    ),
    ("o200k_base", 9_000): (
        False,
        5_310,
        "ce3aad5c6ab097784dce12e63279493bd10c5a5d414ab9f214d31a477023aa60",
    ),
}


def test_a_rebuild_of_an_assembler_12_record_counts_as_12_did() -> None:
    """GetBuild serves a record only when its rebuild's figures match (core/build_record.py
    Rule 9): counting without the fixed texts gives @12's own, budget binding or not, and
    counting with them gives more."""
    counters = {"heuristic": heuristic_count, **EXACT}
    for (name, room), (compacts, estimated, digest) in _AT_12.items():
        figures = _figures(counters[name], room, counted=False)
        now = _figures(counters[name], room, counted=True)
        assert now["estimated_input_tokens"] > figures["estimated_input_tokens"]
        if name == "heuristic":
            # The heuristic itself moved at context-assembler@21 (a punctuation run's
            # repeats, core/estimator.py): its @12 figures are not reproduced, and GetBuild
            # refuses such a record on its figures (core/build_record.py Rule 9).
            continue
        canonical = json.dumps(figures, sort_keys=True).encode()
        assert (figures["needs_compaction"], figures["estimated_input_tokens"]) == (
            compacts,
            estimated,
        )
        assert hashlib.sha256(canonical).hexdigest() == digest
        assert now["estimated_input_tokens"] > estimated
