"""Neutral ModelRequest -> OpenAI Responses API request body (``POST /v1/responses``).

Rule 1 (order): ``instructions`` (the Region A system blocks, joined by a blank line),
then ``tools``, then ``input``: the order the prompt is cached in.
Rule 2 (bytes): RFC 8785 JSON, as for Anthropic; schemas, arguments and reasoning items are
re-parsed from their canonical or opaque JSON.
Rule 3 (items): one input item per neutral block, in order: user text -> a ``message`` with
one ``input_text`` part; assistant text -> a ``message`` with string content; a tool call ->
``function_call``; a tool result -> ``function_call_output`` whose ``output`` is the
enveloped content, verbatim, after ``TOOL_ERROR_AS_TEXT`` (core/fixed_texts.py) on its own
line when the call failed (the item has no error field; Anthropic's no-tools text form
says it the same way); an empty text block sends nothing. Tools are ``function``
tools with ``strict: false`` (the API's strict default would reject ordinary schemas).
Rule 4 (reasoning): a reasoning item from OpenAI is replayed verbatim from its opaque JSON
(id, summary, encrypted content), never rendered into text; one from another provider is
not sent, and neither is one the API would refuse: one not followed at once by the output
it was produced with (a function call or assistant text; since context-assembler@19),
named by its provider item id (``fc_...``, ``msg_...``: the API pairs a reasoning item
with the item after it by that id; since @24). Its payload must be of type ``reasoning``
(EngineError otherwise): anything else would replay as a message or call the hashed
request does not show. The function calls and assistant text after a reasoning item sent
in their message carry their logged ids (the text in the API's output form,
``output_text`` with its id and status), up to the next reasoning item or the first output
logged without an id; no other item carries one, since the API refuses
an item named by id whose reasoning is not sent, as an earlier run's is not (@24).
Rule 5 (cache): the Responses API caches implicitly and takes no markers; the request
carries ``prompt_cache_key`` = request.session_key, so every run, step and epoch of one
session routes to the same cache and no other session shares it.
Rule 6 (call ids): a ``function_call`` and its ``function_call_output`` carry the pair's
wire call id (providers/call_ids.py): the call id verbatim (the API restricts no
alphabet) where it is at most 64 characters, else cut and digested to 64 (since
context-assembler@21), unique in the request, the earliest pair keeping its id.
Function calls and their outputs are sent as they are when the request defines no tools:
the Responses API documents no rule against it (Anthropic's renderer turns them into text
then).

Speed: tools, input items and each message's items render once per process to canonical
JSON text (memoized on the frozen neutral values; a run's carried messages are the same
objects on every Build) and the body is composed from them in RFC 8785 key order;
tests/unit/test_providers.py checks the result is the canonical form of itself.

A change to the bytes rendered for a request bumps core/build_record.py ASSEMBLER_VERSION
(Rule 8 there). The failed-result line of Rule 3 came with context-assembler@2; a record of
@1 is rebuilt without it (``render(..., failed_result_line=False)``, providers/__init__.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate
from operator import attrgetter
from typing import Any

from ..core.canonical import canonical_bytes
from ..core.errors import EngineError
from ..core.identity_memo import IdentityMemo, RecentMemo
from ..core.items import REASONING_TYPES
from ..core.memo_budget import bounded_cache
from ..core.plan import SYSTEM_JOINS
from ..core.request import Block, Message, ModelRequest, ToolDefinition, repeated_run
from ..core.rows import Row
from .call_ids import BASE_IDS, MAX_ID_CHARS, VariantMemo, all_distinct, wire_call_ids
from .layout import PromptUnit, RenderedPayload
from .names import check_wire_names, wire_tool_name
from .texts import TOOL_ERROR_AS_TEXT

__all__ = [
    "API",
    "INSTRUCTIONS_SEPARATOR",
    "TOOL_ERROR_AS_TEXT",
    "prompt_units",
    "render",
    "text_paths",
]

API = "openai.responses"
INSTRUCTIONS_SEPARATOR = SYSTEM_JOINS["openai"]  # what the plan measures (core/plan.py)
_PROVIDER = "openai"


@dataclass(frozen=True, slots=True)
class _Piece:
    obj: Any  # a tool or input item (never mutated: pieces are shared); for instructions,
    # the segment's text
    row: Row
    item_id: str
    text: str = ""  # canonical JSON of obj (tools and input items)


@dataclass(frozen=True, slots=True)
class _Layout:
    instructions: list[_Piece]
    tools: list[_Piece]
    messages: list[_MessageItems]
    text: str  # the input items' canonical JSON, comma-separated

    @property
    def items(self) -> list[_Piece]:
        return [piece for m in self.messages for piece in m.pieces]


@dataclass(frozen=True, slots=True)
class _MessageItems:
    """One neutral message's input items (each block renders on its own, Rule 3)."""

    pieces: tuple[_Piece, ...]
    text: str  # their canonical JSON, comma-separated ("" when none)
    call_ids: tuple[str, ...]  # its calls' base ids (Rule 6)


def render(request: ModelRequest) -> RenderedPayload:
    """The Responses API body for `request`.

    Raises:
        PreconditionError: two tool names share a wire name.
        EngineError: a reasoning item's opaque payload is not a JSON object of the
            provider's reasoning type (core/items.py REASONING_TYPES).
    """
    layout = _layout(request)
    # Keys in RFC 8785 order: input, instructions, max_output_tokens, model,
    # prompt_cache_key, tools.
    parts = ['{"input":[' + layout.text + "]"]
    if layout.instructions:
        parts.append('"instructions":' + _text("".join(p.obj for p in layout.instructions)))
    parts += [
        '"max_output_tokens":' + str(request.max_output_tokens),
        '"model":' + _text(request.model_id),
        '"prompt_cache_key":' + _text(request.session_key),
    ]
    if layout.tools:
        parts.append('"tools":[' + ",".join(p.text for p in layout.tools) + "]")
    return RenderedPayload(API, (",".join(parts) + "}").encode("utf-8"))


def prompt_units(request: ModelRequest) -> tuple[PromptUnit, ...]:
    """The prompt as OpenAI caches it: instructions segments, tools, input items."""
    layout = _layout(request)
    out = [
        PromptUnit(f"instructions[{n}]", p.row, p.item_id, p.obj.encode("utf-8"))
        for n, p in enumerate(layout.instructions)
    ]
    out += [
        PromptUnit(f"tools[{n}]", p.row, p.item_id, p.text.encode("utf-8"))
        for n, p in enumerate(layout.tools)
    ]
    out += [
        PromptUnit(f"input[{n}]", p.row, p.item_id, p.text.encode("utf-8"))
        for n, p in enumerate(layout.items)
    ]
    return tuple(out)


def text_paths(
    request: ModelRequest, blocks: Iterable[tuple[int, int]], *, text_call_ids: bool = True
) -> dict[tuple[int, int], str]:
    """Where each of `blocks` (message index, block index in request.messages: user text
    blocks) landed in the body: the path of its ``input_text`` part,
    ``input[i].content[0]`` (Rule 3: one input item per block that sends something). A
    block that sent nothing is absent. What the adapter finds a message's attachments'
    place by. `text_call_ids` changes nothing here: OpenAI sends calls as items always.

    A message's first input index is the items of the messages before it: the repeated
    run's (core/request.py RepeatedRun) counted once per run, the others' from their
    memoized items, so a Build's cost does not grow with its carried history."""
    messages, hint = request.messages, repeated_run(request)
    start, run = (hint.start, hint.run) if hint is not None else (0, ())
    end = start + len(run)
    outside = _message_items.many([*messages[:start], *messages[end:]])
    before = list(accumulate(map(len, map(_PIECES, outside)), initial=0))
    inside = _run_offsets(run) if run else (0,)
    out: dict[tuple[int, int], str] = {}
    for n, k in blocks:
        if n < start:
            at = before[n]
        elif n < end:
            at = before[start] + inside[n - start]
        else:
            at = before[n - len(run)] + inside[-1]
        message = messages[n]
        sent = [_input_item(message.role, b) is not None for b in message.blocks[: k + 1]]
        block = message.blocks[k]
        if sent[k] and block.kind == "text" and message.role == "user":
            out[n, k] = f"input[{at + sum(sent[:k])}].content[0]"
    return out


def _layout(request: ModelRequest) -> _Layout:
    messages = _message_items.many(request.messages)
    if not all_distinct(map(_CALL_IDS, messages)):  # Rule 6: rare, and then walked once
        for n, wire in wire_call_ids(request.messages, _BASE_ID, _MAX_ID).items():
            messages[n] = _relaid(request.messages[n], wire)
    check_wire_names(t.name for t in request.tools)  # names.py Rule 2: the tools alone
    texts = [b for b in request.system if b.text]
    instructions = [
        _Piece((INSTRUCTIONS_SEPARATOR if n else "") + b.text, b.row, b.item_id)
        for n, b in enumerate(texts)
    ]
    tools = [_tool(t) for t in request.tools]
    text = ",".join(filter(None, map(_TEXT, messages)))
    return _Layout(instructions, tools, messages, text)


# A block, its wire call id where it moved ("" else: Rule 6) and its input item.
_Sent = tuple[Block, str, _Piece]


def _render_message(message: Message, moved: tuple[str, ...] = ()) -> _MessageItems:
    """`moved`: each block's wire call id where it is not the base id, else "" (Rule 6)."""
    sent: list[_Sent] = []
    for k, block in enumerate(message.blocks):
        call_id = moved[k] if moved else ""
        piece = _input_item(message.role, block, call_id)
        if piece is not None:
            sent.append((block, call_id, piece))
    pieces = tuple(_paired(message.role, sent, _followed_reasoning(sent)))
    return _MessageItems(
        pieces,
        ",".join(p.text for p in pieces),
        tuple(_BASE_ID(b.call_id) for b in message.blocks if b.kind == "tool_call"),
    )


def _followed_reasoning(sent: list[_Sent]) -> set[int]:
    """Rule 4: the indexes in `sent` of the reasoning items to send, those the API takes:
    followed at once by the output they were produced with (a ``function_call`` or an
    assistant ``message``) named by its provider item id. A turn whose only output was
    reasoning (a model that ran out of output tokens reasoning, or answered with empty
    text) failed every later request of its run (an audit), and so, by public reports, does
    one whose output was logged without its id (@23 and older sent it). Within one
    message: a turn's reasoning and its output are one message."""
    return {
        n
        for n, (block, _, _) in enumerate(sent[:-1])
        if block.kind == "reasoning"
        and sent[n + 1][0].kind in _PRODUCED_WITH
        and sent[n + 1][0].provider_item_id
    }


def _paired(role: str, sent: list[_Sent], followed: set[int]) -> Iterable[_Piece]:
    """Rule 4: `sent` without the reasoning items not `followed`, and with the provider
    item ids of the outputs after a reasoning item sent, up to the next reasoning item or
    the first output without an id (the API pairs a reasoning item with the item after it
    by id, and refuses one whose following item names none). Outputs before any reasoning,
    after one not sent or an output without an id, or in a message whose reasoning is not
    sent (an earlier run's turn) carry none: the API refuses an item whose reasoning is
    missing. Since context-assembler@24."""
    reasoned = False
    for n, (block, call_id, piece) in enumerate(sent):
        if block.kind == "reasoning":
            reasoned = n in followed
            if not reasoned:
                continue
        elif reasoned and block.provider_item_id:
            piece = _input_item(role, block, call_id, paired=True) or piece
        else:
            # An output logged without its id is no item of the reasoning's turn the API
            # knows, and ends the run of outputs it pairs (the fake provider's W7).
            reasoned = False
        yield piece


# The blocks a reasoning item is produced with (function calls and assistant text): a
# user message never follows it at once.
_PRODUCED_WITH = frozenset({"tool_call", "text"})


# A run's carried messages are the same objects on every Build (core/identity_memo.py);
# one that misses is rendered from the block memo below rather than hashed whole.
_message_items = IdentityMemo(_render_message, 16_384, by_value=False)
# A carried message's moved ids are the same on every Build (call_ids.py, Rule 2).
_relaid = VariantMemo(_render_message)
# A run's input items before each of its messages (and in all, last): made once per run.
_run_offsets: RecentMemo[tuple[Message, ...], tuple[int, ...]] = RecentMemo(
    lambda run: tuple(
        accumulate(map(len, map(attrgetter("pieces"), _message_items.many(run))), initial=0)
    ),
    weigh_depth=1,
)
_BASE_ID = BASE_IDS[_PROVIDER]
_MAX_ID = MAX_ID_CHARS[_PROVIDER]
_CALL_IDS = attrgetter("call_ids")
_TEXT = attrgetter("text")
_PIECES = attrgetter("pieces")


# Rendering is a pure function of frozen neutral values; the memos change only how often it
# runs. Bounded like core/request.py's fragments.
@bounded_cache(1024)
def _tool(tool: ToolDefinition) -> _Piece:
    obj: dict[str, Any] = {
        "type": "function",
        "name": wire_tool_name(tool.name),
        "parameters": json.loads(tool.input_schema_json),
        "strict": False,
    }
    if tool.description:
        obj["description"] = tool.description
    return _Piece(obj, Row.TOOL_DEFINITIONS, f"tool:{tool.name}", _json(obj))


@bounded_cache(16_384)
def _input_item(role: str, block: Block, call_id: str = "", paired: bool = False) -> _Piece | None:
    obj = _item(role, block, call_id, paired)
    return None if obj is None else _Piece(obj, block.row, block.item_id, _json(obj))


def _json(value: Any) -> str:
    return canonical_bytes(value).decode("utf-8")


@bounded_cache(256)
def _text(value: str) -> str:
    return _json(value)


def _item(
    role: str, block: Block, call_id: str = "", paired: bool = False
) -> dict[str, Any] | None:
    """One neutral block's input item (Rules 3, 4, 6); None when it sends nothing.
    `call_id` is the pair's wire id when it moved; "" sends the call's base id. `paired`:
    the item follows its reasoning, and carries its provider item id (Rule 4)."""
    match block.kind:
        case "text":
            if not block.text:
                return None
            if role == "assistant" and paired:  # the output form: the API's, with its id
                return {
                    "type": "message",
                    "role": "assistant",
                    "id": block.provider_item_id,
                    "status": "completed",
                    "content": [{"type": "output_text", "text": block.text, "annotations": []}],
                }
            if role == "assistant":
                return {"type": "message", "role": "assistant", "content": block.text}
            return {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": block.text}],
            }
        case "tool_call":
            call = {
                "type": "function_call",
                "call_id": call_id or _BASE_ID(block.call_id),
                "name": wire_tool_name(block.tool_name),
                "arguments": block.arguments_json or "{}",
            }
            return {**call, "id": block.provider_item_id} if paired else call
        case "tool_result":
            wire_id = call_id or _BASE_ID(block.call_id)
            output = block.text
            if block.is_error:  # Rule 3: the engine's line, outside the tool's envelope
                output = f"{TOOL_ERROR_AS_TEXT}\n{output}" if output else TOOL_ERROR_AS_TEXT
            return {"type": "function_call_output", "call_id": wire_id, "output": output}
        case "reasoning":
            if block.provider != _PROVIDER:
                return None
            return _opaque(block)
    raise EngineError(f"no OpenAI rendering for block kind {block.kind!r}")


def _opaque(block: Block) -> dict[str, Any]:
    """The reasoning payload to replay. AppendItems checked its type; checked again here,
    since a payload of another type would replay as a message or call the hashed request
    does not show."""
    try:
        value = json.loads(block.opaque)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise EngineError(f"reasoning item {block.item_id!r} is not a JSON object")
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in REASONING_TYPES[_PROVIDER]:
        raise EngineError(f"reasoning item {block.item_id!r} is not a {_PROVIDER} reasoning item")
    return value
