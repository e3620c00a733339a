"""Small constructors for the messages a worker writes most, and the tool-loop value types.

Everything here returns plain generated messages (`pb.ConversationItem`, `pb.ToolSpec`),
so a worker can mix these helpers with hand-built protos freely.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._gen.context_engine.v1 import context_engine_pb2 as pb

__all__ = [
    "ModelTurn",
    "ToolCallRequest",
    "ToolOutput",
    "Usage",
    "arguments_problem",
    "assistant_message",
    "reasoning",
    "tool",
    "tool_call",
    "tool_result",
    "user_message",
]


def _json(value: Mapping[str, Any] | str) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


# What the engine logs of a call's arguments (its canonical JSON, RFC 8785): an object, at
# most 64 levels deep, whose numbers read back exactly and whose strings hold no U+0000
# and no half of a surrogate pair.
_MAX_DEPTH = 64
_MAX_SAFE_INTEGER = 2**53 - 1
_EXPONENT_FROM = 1e21  # RFC 8785 writes a double below it as an integer literal


def arguments_problem(arguments: Mapping[str, Any] | str) -> str:
    """Why the engine would refuse to log a call with these arguments (AppendItems'
    INVALID_FIELD naming arguments_json), or "" when it would take them: a model's cut-off
    or non-object arguments, an integer past 2^53 such as a 64-bit id. The tool loop checks
    before it runs a tool, as a step it cannot log would be run again (a review)."""
    try:
        text = _json(arguments)
    except (TypeError, ValueError) as exc:  # a date, a Decimal, a set, NaN in a mapping
        return f"are not JSON-serializable ({exc})"
    if not text:
        return ""  # the engine reads no arguments as {} (a tool without parameters)
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        return f"are not JSON ({exc})" if isinstance(exc, ValueError) else "nest too deeply"
    if not isinstance(value, dict):
        return "are not a JSON object"
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > _MAX_DEPTH:
            return f"nest deeper than {_MAX_DEPTH} levels"
        if isinstance(node, dict):
            stack.extend((key, depth) for key in node)  # a key is a string, checked as one
            node = list(node.values())
        if isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, str):
            if "\x00" in node:
                return "hold U+0000"
            if any("\ud800" <= c <= "\udfff" for c in node):
                return "hold half a surrogate pair"
        elif isinstance(node, int) and not isinstance(node, bool):
            if abs(node) > _MAX_SAFE_INTEGER:
                return "hold an integer beyond 2^53 - 1 (send large ids as strings)"
        elif isinstance(node, float) and not (
            math.isfinite(node) and not _MAX_SAFE_INTEGER < abs(node) < _EXPONENT_FROM
        ):
            return "hold a number JSON cannot carry exactly"
    return ""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# The longest id the engine takes (a call id, a provider's item id): ids are keys of its
# indexes (api/convert.py MAX_ID_CHARS), counted in code points.
MAX_ID_CHARS = 200
# What a provider's item id may not hold (api/convert.py _provider_item_id): whitespace, as
# str.isspace() finds it, or a control character (U+0000-U+001F, U+007F-U+009F, U+2028,
# U+2029). Together, this class, code point for code point.
_NOT_IN_AN_ID = re.compile(r"[\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")


def _item_id_problem(value: str) -> str:
    """Why the engine would refuse `value` as a provider's item id (AppendItems'
    INVALID_FIELD naming provider_item_id), or "" when it would take it."""
    if len(value) > MAX_ID_CHARS:
        return f"is longer than {MAX_ID_CHARS} characters"
    if _NOT_IN_AN_ID.search(value):
        return "holds whitespace or a control character"
    return ""


# What the engine replays of a provider's reasoning (core/items.py): per provider, the
# "type"s it takes; per type, the keys it must hold (with their JSON types) and may hold.
_REASONING_TYPES: dict[int, frozenset[str]] = {
    pb.PROVIDER_ANTHROPIC: frozenset({"thinking", "redacted_thinking"}),
    pb.PROVIDER_OPENAI: frozenset({"reasoning"}),
}
_REASONING_FIELDS: dict[str, dict[str, type]] = {
    "thinking": {"thinking": str, "signature": str},
    "redacted_thinking": {"data": str},
    "reasoning": {"id": str, "summary": list},
}
_REASONING_KEYS: dict[str, frozenset[str]] = {
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}),
}


def _reasoning_problem(provider: int | str, opaque: bytes) -> str:
    """Why the engine would refuse to log a reasoning item (AppendItems' INVALID_FIELD
    naming its provider or opaque), or "" when it would take it. The provider as a number
    or, as protobuf takes it too, by its enum name (a review: the name was refused)."""
    number = provider
    if isinstance(provider, str):
        try:
            number = pb.Provider.Value(provider)
        except ValueError:
            return "names no provider (PROVIDER_ANTHROPIC or PROVIDER_OPENAI)"
    types = _REASONING_TYPES.get(int(number))
    if types is None:
        return "names no provider (PROVIDER_ANTHROPIC or PROVIDER_OPENAI)"
    if not opaque:
        return "is empty"
    try:
        text = bytes(opaque).decode("utf-8")
    except UnicodeDecodeError:
        return "is not UTF-8"
    problem = arguments_problem(text)  # the engine parses it as it parses arguments
    if problem:
        return f"is no JSON object the engine can store: its bytes {problem}"
    payload = json.loads(text)
    kind = payload.get("type")
    if not isinstance(kind, str) or kind not in types:
        return f'has a "type" other than {" or ".join(repr(t) for t in sorted(types))}'
    for key, json_type in _REASONING_FIELDS[kind].items():
        if not isinstance(payload.get(key), json_type):
            return f'is a {kind!r} item without "{key}"'
    unknown = sorted(payload.keys() - _REASONING_KEYS[kind])
    if unknown:
        return f"is a {kind!r} item holding {unknown[0]!r}, which the provider's type lacks"
    return ""


# U+0000, which the engine cannot store, and half a surrogate pair (json.loads gives one
# for "\ud83d", an emoji an API cut in UTF-16), which protobuf cannot encode as UTF-8:
# either failed the step after its tools had run, and every retry ran them again (audits).
_UNLOGGABLE = re.compile(r"[\x00\ud800-\udfff]")


def _loggable(text: str) -> str:
    """`text` with U+0000 and any half of a surrogate pair read as U+FFFD."""
    return _UNLOGGABLE.sub("\ufffd", text)


def user_message(text: str, *, item_id: str = "") -> pb.ConversationItem:
    """A user's message (further input inside a run)."""
    return pb.ConversationItem(item_id=item_id, user_message=pb.UserMessage(text=text))


def assistant_message(
    text: str, *, item_id: str = "", provider_item_id: str = ""
) -> pb.ConversationItem:
    """The model's text. `provider_item_id`: OpenAI's id of the output message (``msg_...``),
    which pairs it with the turn's reasoning when the engine replays that."""
    return pb.ConversationItem(
        item_id=item_id,
        assistant_message=pb.AssistantMessage(text=text, provider_item_id=provider_item_id),
    )


def tool_call(
    call_id: str,
    name: str,
    arguments: Mapping[str, Any] | str,
    *,
    task_id: str = "",
    item_id: str = "",
    provider_item_id: str = "",
) -> pb.ConversationItem:
    """The model's tool call; `arguments` is a JSON object (a mapping or its text).
    `provider_item_id`: OpenAI's id of the ``function_call`` output item (``fc_...``, not
    its call id), which pairs it with the turn's reasoning when the engine replays that."""
    return pb.ConversationItem(
        item_id=item_id,
        tool_call=pb.ToolCall(
            call_id=call_id,
            tool_name=name,
            arguments_json=_json(arguments),
            task_id=task_id,
            provider_item_id=provider_item_id,
        ),
    )


# The engine refuses a result's source longer than this (INVALID_FIELD): an attribution,
# not content. tool_result cuts a longer one (a signed URL, say) rather than fail the step.
MAX_SOURCE_CHARS = 2_048


def tool_result(
    call_id: str,
    name: str,
    content: str,
    *,
    trust: int = pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
    source: str = "",
    is_error: bool = False,
    artifact_ref: str = "",
    context_content: str = "",
    item_id: str = "",
) -> pb.ConversationItem:
    """A tool's result. Trust defaults to EXTERNAL_UNTRUSTED: say so when it is better.
    A `source` over MAX_SOURCE_CHARS is cut to it, ending in "…". `context_content`: the
    excerpt the request sends in place of `content` (marked truncated), which the log keeps
    whole; a large output needs one, as a result the model is about to read never yields
    (one larger than the request's body fails every Build of its run). An empty `name`
    takes its call's on the server, which then names the source by it too. U+0000, which
    the engine cannot store, and half a surrogate pair, which protobuf cannot encode, are
    sent as U+FFFD (a tool's output holding one failed the whole step)."""
    source = _loggable(source or (f"tool:{name}" if name else ""))
    if len(source) > MAX_SOURCE_CHARS:
        source = source[: MAX_SOURCE_CHARS - 1] + "…"
    return pb.ConversationItem(
        item_id=item_id,
        tool_result=pb.ToolResult(
            call_id=call_id,
            tool_name=name,
            content=_loggable(content),
            trust=trust,  # type: ignore[arg-type]
            source=source,
            is_error=is_error,
            artifact_ref=artifact_ref,
            context_content=_loggable(context_content),
        ),
    )


def reasoning(provider: int, opaque: bytes, *, item_id: str = "") -> pb.ConversationItem:
    """A provider-opaque reasoning item, replayed verbatim within its run only."""
    return pb.ConversationItem(
        item_id=item_id,
        reasoning=pb.ReasoningItem(provider=provider, opaque=opaque),  # type: ignore[arg-type]
    )


def tool(
    name: str,
    description: str,
    input_schema: Mapping[str, Any] | str,
    *,
    required_scopes: Sequence[str] = (),
    side_effect: int = pb.SIDE_EFFECT_UNSPECIFIED,
    builtin: bool | None = None,
    server: str = "",
) -> pb.ToolSpec:
    """A tool for a PlanSpec's candidate list.

    Say what the tool does to the world (`side_effect`): left unspecified, the engine
    treats it as the most consequential kind. `builtin` defaults to `not server`: a tool
    some server provides is a discovered one, whose description the engine does not trust.
    """
    return pb.ToolSpec(
        name=name,
        description=description,
        input_schema_json=_json(input_schema),
        required_scopes=list(required_scopes),
        side_effect=side_effect,  # type: ignore[arg-type]
        builtin=not server if builtin is None else builtin,
        server=server,
    )


@dataclass(frozen=True, slots=True)
class Usage:
    """A model response's token usage, as ReportUsage wants it.

    `input_tokens` is the uncached input (Anthropic's input_tokens; OpenAI's input_tokens
    minus cached_tokens).
    """

    input_tokens: int
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @classmethod
    def from_anthropic(cls, usage: Mapping[str, Any]) -> Usage:
        """From an Anthropic Messages response's `usage` object."""
        return cls(
            input_tokens=int(usage.get("input_tokens") or 0),
            output_tokens=int(usage.get("output_tokens") or 0),
            cache_read_input_tokens=int(usage.get("cache_read_input_tokens") or 0),
            cache_creation_input_tokens=int(usage.get("cache_creation_input_tokens") or 0),
        )

    @classmethod
    def from_openai(cls, usage: Mapping[str, Any]) -> Usage:
        """From an OpenAI Responses response's `usage` object."""
        details = usage.get("input_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        return cls(
            input_tokens=int(usage.get("input_tokens") or 0) - cached,
            output_tokens=int(usage.get("output_tokens") or 0),
            cache_read_input_tokens=cached,
        )


@dataclass(frozen=True, slots=True)
class ToolCallRequest:
    """A tool call the model asked for."""

    call_id: str
    name: str
    arguments: Mapping[str, Any] | str = field(default_factory=dict)
    task_id: str = ""
    # OpenAI's id of the function_call output item (fc_...): see tool_call.
    provider_item_id: str = ""

    def arguments_json(self) -> str:
        return _json(self.arguments)

    def parsed_arguments(self) -> Any:
        """The arguments as JSON values; none ("", as providers send them for a tool
        without parameters) is {}, as the engine reads it."""
        return json.loads(self.arguments_json() or "{}")


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """What a tool returned, with the trust its content deserves."""

    content: str
    trust: int = pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    is_error: bool = False
    source: str = ""
    artifact_ref: str = ""
    # The excerpt the request sends in place of `content` (tool_result): give one for an
    # output that may not fit the request.
    context_content: str = ""


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """One model response, reduced to what the engine logs.

    `reasoning` holds (provider, opaque JSON bytes) pairs, replayed verbatim within the run.
    From OpenAI, give `text_item_id` (the output message's ``msg_...`` id) and each call's
    `provider_item_id`: the API pairs a replayed reasoning item with the item after it by
    that id, and the engine replays no reasoning whose following item has none. `items`
    orders a turn as reasoning, text, then calls, which pairs one reasoning item with its
    output: log a response that interleaves several reasoning items with its outputs item
    by item, in its own order (reasoning, assistant_message, tool_call).
    `model` is the model that answered, the provider response's `model` ("" for the
    request's own): ReportUsage sends it, since the engine learns only from reports of
    the model the request was built for. A turn without tool calls ends the tool loop.
    """

    text: str = ""
    tool_calls: Sequence[ToolCallRequest] = ()
    reasoning: Sequence[tuple[int, bytes]] = ()
    usage: Usage | None = None
    model: str = ""
    text_item_id: str = ""

    def items(self) -> list[pb.ConversationItem]:
        """The turn as conversation items: reasoning, text, then tool calls."""
        out = [reasoning(provider, opaque) for provider, opaque in self.reasoning]
        if self.text:
            # U+0000 (and half a surrogate pair), which the engine cannot take, as
            # U+FFFD: the step's append failed after its tools ran (a review).
            text = _loggable(self.text)
            out.append(assistant_message(text, provider_item_id=self.text_item_id))
        out += [
            tool_call(
                c.call_id,
                c.name,
                c.arguments,
                task_id=c.task_id,
                provider_item_id=c.provider_item_id,
            )
            for c in self.tool_calls
        ]
        return out
