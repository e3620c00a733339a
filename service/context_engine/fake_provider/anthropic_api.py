"""Anthropic Messages API (``POST /v1/messages``): validation, prompt blocks, rendering.

Validation rules. Each is a 400 ``invalid_request_error`` the real API also returns (docs:
"Messages API", "Handle tool calls", "Prompt caching", "Errors"); messages copy the real
API's wording where it is known.

Rule V1. ``anthropic-version`` header present; an API key (``x-api-key`` or bearer) present.
Rule V2. ``model`` string, ``max_tokens`` integer >= 1, ``messages`` non-empty list; no
         streaming (the fake answers whole messages only).
Rule V3. Roles are ``user``/``assistant``. Consecutive same-role messages are allowed: the API
         merges them into one turn ("Messages API": consecutive turns are combined).
Rule V4. Content is a non-empty string or list; text blocks hold more than whitespace (as
         does a ``tool_result``'s text content, a string or its text blocks); each block
         type is allowed for its role (``BLOCK_TYPES_BY_ROLE``).
Rule V5. Every ``tool_result`` names a ``tool_use`` id of the previous assistant turn; every
         ``tool_use`` of an assistant turn followed by a user turn is answered by a
         ``tool_result`` in the leading run of that user turn (results come first).
Rule V6. ``tool_use`` ids are unique; they and ``tool_result.tool_use_id`` match
         ``TOOL_USE_ID``; tool names are unique and match ``TOOL_NAME``.
Rule V7. At most ``MAX_CACHE_BREAKPOINTS`` ``cache_control`` markers, counting the top-level
         automatic-caching marker; type ``ephemeral``; ``ttl`` ``5m`` or ``1h``; not on
         thinking blocks or empty text blocks.
Rule V8. In processing order tools -> system -> messages, no ``ttl="1h"`` marker follows a
         ``ttl="5m"`` (or TTL-less) one ("Mixing different TTLs").
Rule V9. Extended thinking: ``budget_tokens`` >= 1024 and < ``max_tokens``; a final
         assistant (prefill) message does not end with whitespace.
Rule V10. With thinking enabled, when the request ends in a tool loop (the last user turn
          carries ``tool_result`` blocks), the assistant turn before it starts with a
          ``thinking``/``redacted_thinking`` block ("Extended thinking": preserving thinking
          blocks during tool use).
Rule V11. A request with ``tool_use`` or ``tool_result`` blocks defines ``tools``.
Rule V12. The first message is the user's.
Rule V13. A custom tool's ``input_schema`` is valid JSON Schema draft 2020-12 ("JSON schema
          is invalid. It must match JSON Schema draft 2020-12"), checked with the
          ``jsonschema`` package (a dev dependency, as is this fake's every use).
Rule V14. An assistant message does not end with a ``thinking`` or ``redacted_thinking``
          block ("The final block in an assistant message cannot be `thinking`", as
          reported by the API's users; context-assembler@22 sent such turns).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator

from .cache import AnthropicBlock, AnthropicCacheResult
from .errors import FakeApiError
from .ids import IdFactory
from .script import Reply
from .tokens import canonical_bytes, count_tokens

__all__ = [
    "BLOCK_TYPES_BY_ROLE",
    "ERROR_TYPE_BY_STATUS",
    "MAX_CACHE_BREAKPOINTS",
    "TOOL_USE_ID",
    "MessagesRequest",
    "error_body",
    "parse_request",
    "render_message",
]

ERROR_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}

BLOCK_TYPES_BY_ROLE: dict[str, frozenset[str]] = {
    "user": frozenset({"text", "image", "document", "search_result", "tool_result"}),
    "assistant": frozenset({"text", "tool_use", "thinking", "redacted_thinking"}),
}
NOT_CACHEABLE_BLOCKS = frozenset({"thinking", "redacted_thinking"})
MAX_CACHE_BREAKPOINTS = 4
CACHE_TTLS = ("5m", "1h")
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
# Anthropic's rule for the names under a tool's input_schema.properties.
_PROPERTY_KEY = re.compile(r"[a-zA-Z0-9_.-]{1,64}")
MIN_THINKING_BUDGET = 1024


@dataclass(frozen=True)
class MessagesRequest:
    """A validated request, reduced to what the cache and the renderer need."""

    model: str
    max_tokens: int
    blocks: tuple[AnthropicBlock, ...]
    messages_salt: bytes

    @property
    def input_tokens(self) -> int:
        return sum(b.tokens for b in self.blocks)


@lru_cache(maxsize=1024)
def _valid_draft_2020_12(schema_json: str) -> bool:
    """Rule V13: whether an input schema (as canonical JSON) passes JSON Schema draft
    2020-12's metaschema, formats unchecked: the `jsonschema` package's validator, an
    implementation independent of Plan's own check (core/tool_schema.py). Memoized: the
    same tools come with every request of a session."""
    return bool(_METASCHEMA.is_valid(json.loads(schema_json)))


_METASCHEMA = Draft202012Validator(Draft202012Validator.META_SCHEMA)


def _bad(message: str) -> FakeApiError:
    return FakeApiError(400, message, type="invalid_request_error")


@dataclass
class _Marker:
    path: str
    ttl: str
    block_index: int


def parse_request(
    body: Any, headers: Mapping[str, str], *, count_only: bool = False
) -> MessagesRequest:
    """Validate a Messages (or count_tokens) request body; raise ``FakeApiError``."""
    if not headers.get("anthropic-version"):
        raise _bad("anthropic-version: header is required")
    if not (headers.get("x-api-key") or headers.get("authorization")):
        raise FakeApiError(401, "x-api-key header is required", type="authentication_error")
    if not isinstance(body, dict):
        raise _bad("Request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model: Field required")
    max_tokens = body.get("max_tokens", 0 if count_only else None)
    if not count_only:
        if max_tokens is None:
            raise _bad("max_tokens: Field required")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _bad("max_tokens: Input should be greater than or equal to 1")
    if body.get("stream"):
        raise _bad("stream: the fake provider does not stream; send stream=false")
    _check_thinking(body.get("thinking"), max_tokens if not count_only else None)

    blocks: list[AnthropicBlock] = []
    markers: list[_Marker] = []
    _tools(body.get("tools"), blocks, markers)
    _system(body.get("system"), blocks, markers)
    normalized = _messages(body.get("messages"), blocks, markers)
    _check_tools_defined(body.get("tools"), normalized)
    _check_thinking_in_tool_loop(body.get("thinking"), normalized)
    _automatic_marker(body.get("cache_control"), blocks, markers)
    _check_markers(markers)

    ttl_by_block: dict[int, str] = {}
    for marker in markers:
        ttl_by_block.setdefault(marker.block_index, marker.ttl)
        if marker.ttl == "1h":
            ttl_by_block[marker.block_index] = "1h"
    final = tuple(replace(b, ttl=ttl_by_block.get(i)) for i, b in enumerate(blocks))
    salt = canonical_bytes(
        {"thinking": body.get("thinking"), "tool_choice": body.get("tool_choice")}
    )
    return MessagesRequest(
        model=model, max_tokens=max_tokens or 0, blocks=final, messages_salt=salt
    )


def _check_thinking(thinking: Any, max_tokens: int | None) -> None:
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in (
        "enabled",
        "disabled",
        "adaptive",
    ):
        raise _bad("thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'")
    if thinking["type"] != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
        raise _bad(
            "thinking.enabled.budget_tokens: Input should be greater than or equal to "
            f"{MIN_THINKING_BUDGET}"
        )
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("`max_tokens` must be greater than `thinking.budget_tokens`")


def _marker_of(value: Any, path: str, block_index: int) -> _Marker | None:
    """Validate one ``cache_control`` value (Rule V7)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise _bad(f"{path}.cache_control.type: Input should be 'ephemeral'")
    ttl = value.get("ttl", "5m")
    if ttl not in CACHE_TTLS:
        raise _bad(f"{path}.cache_control.ttl: Input should be '5m' or '1h'")
    return _Marker(path=path, ttl=ttl, block_index=block_index)


def _add_block(
    blocks: list[AnthropicBlock],
    markers: list[_Marker],
    path: str,
    region: str,
    unit: Any,
    raw: Any,
) -> None:
    data = canonical_bytes(unit)
    cacheable = not (isinstance(raw, dict) and raw.get("type") in NOT_CACHEABLE_BLOCKS)
    blocks.append(AnthropicBlock(path, region, data, count_tokens(data), cacheable=cacheable))
    if isinstance(raw, dict):
        marker = _marker_of(raw.get("cache_control"), path, len(blocks) - 1)
        if marker is not None:
            markers.append(marker)
        # A marker nested in a tool_result's content caches through the enclosing block.
        nested = raw.get("content")
        if isinstance(nested, list):
            for k, inner in enumerate(nested):
                if isinstance(inner, dict):
                    m = _marker_of(
                        inner.get("cache_control"), f"{path}.content.{k}", len(blocks) - 1
                    )
                    if m is not None:
                        markers.append(m)


def _tools(tools: Any, blocks: list[AnthropicBlock], markers: list[_Marker]) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _bad("tools: Input should be a valid list")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        path = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _bad(f"{path}: Input should be a valid dictionary")
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad(f"{path}.name: String should match pattern '{TOOL_NAME.pattern}'")
        if tool.get("type") in (None, "custom"):
            schema = tool.get("input_schema")
            if not isinstance(schema, dict) or schema.get("type") != "object":
                raise _bad(f"{path}.input_schema: Input should be a JSON Schema of type 'object'")
            if any(k in schema for k in ("allOf", "anyOf", "oneOf")):
                raise _bad(
                    f"{path}.custom.input_schema: input_schema does not support oneOf, allOf, "
                    "or anyOf at the top level"
                )
            properties = schema.get("properties", {})
            if isinstance(properties, dict) and not all(
                _PROPERTY_KEY.fullmatch(k) for k in properties
            ):
                raise _bad(
                    f"{path}.custom.input_schema.properties: Property keys should match"
                    f" pattern '^{_PROPERTY_KEY.pattern}$'"
                )
            if not _valid_draft_2020_12(json.dumps(schema, sort_keys=True)):
                raise _bad(
                    f"{path}.custom.input_schema: JSON schema is invalid. It must match JSON"
                    " Schema draft 2020-12 (https://json-schema.org/draft/2020-12). Learn"
                    " more about tool use at https://docs.claude.com/en/docs/tool-use."
                )
        if name in seen:
            raise _bad("tools: Tool names must be unique.")
        seen.add(name)
        _add_block(blocks, markers, path, "tools", tool, tool)


def _system(system: Any, blocks: list[AnthropicBlock], markers: list[_Marker]) -> None:
    if system is None:
        return
    if isinstance(system, str):
        if system:
            unit = {"type": "text", "text": system}
            _add_block(blocks, markers, "system", "system", unit, None)
        return
    if not isinstance(system, list):
        raise _bad("system: Input should be a valid string or list")
    for j, block in enumerate(system):
        path = f"system.{j}"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _bad(f"{path}.type: Input should be 'text'")
        _check_text(block, path)
        _add_block(blocks, markers, path, "system", block, block)


def _check_text(block: dict[str, Any], path: str) -> None:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{path}.text: Field required")
    if not text:
        if block.get("cache_control") is not None:
            raise _bad(f"{path}.text: cache_control cannot be set for empty text blocks")
        raise _bad("messages: text content blocks must be non-empty")
    if not text.strip():
        raise _bad("messages: text content blocks must contain non-whitespace text")


_Messages = list[tuple[str, list[dict[str, Any]]]]


def _messages(messages: Any, blocks: list[AnthropicBlock], markers: list[_Marker]) -> _Messages:
    if messages is None:
        raise _bad("messages: Field required")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: at least one message is required")
    normalized: _Messages = []
    seen_tool_use: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages.{i}: Input should be a valid dictionary")
        role = message.get("role")
        if role not in BLOCK_TYPES_BY_ROLE:
            raise _bad(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = message.get("content")
        is_final_assistant = role == "assistant" and i == len(messages) - 1
        if isinstance(content, str):
            if not content and not is_final_assistant:
                raise _bad(
                    f"messages.{i}: all messages must have non-empty content except for the "
                    "optional final assistant message"
                )
            content_blocks = [{"type": "text", "text": content}] if content else []
            raw_blocks: list[Any] = [None] * len(content_blocks)
        elif isinstance(content, list):
            if not content and not is_final_assistant:
                raise _bad(
                    f"messages.{i}: all messages must have non-empty content except for the "
                    "optional final assistant message"
                )
            content_blocks, raw_blocks = content, content
        else:
            raise _bad(f"messages.{i}.content: Input should be a valid string or list")
        for j, block in enumerate(content_blocks):
            path = f"messages.{i}.content.{j}"
            _check_block(block, role, path, seen_tool_use)
            _add_block(
                blocks, markers, path, "messages", {"role": role, "block": block}, raw_blocks[j]
            )
        if role == "assistant" and content_blocks:  # Rule V14
            final = content_blocks[-1]
            if isinstance(final, dict) and final.get("type") in NOT_CACHEABLE_BLOCKS:
                raise _bad(
                    f"messages.{i}: The final block in an assistant message cannot be"
                    f" `{final['type']}`."
                )
        normalized.append((role, content_blocks))
    if normalized[0][0] != "user":  # Rule V12
        raise _bad('messages: first message must use the "user" role')
    _check_pairing(normalized)
    last_role, last_blocks = normalized[-1]
    if last_role == "assistant" and last_blocks:
        tail = last_blocks[-1]
        if tail.get("type") == "text" and tail["text"] != tail["text"].rstrip():
            raise _bad("messages: final assistant content cannot end with trailing whitespace")
    return normalized


def _check_tools_defined(tools: Any, messages: _Messages) -> None:
    """Rule V11."""
    if tools:
        return
    if any(b["type"] in ("tool_use", "tool_result") for _, blocks in messages for b in blocks):
        raise _bad("Requests which include `tool_use` or `tool_result` blocks must define tools.")


def _check_thinking_in_tool_loop(thinking: Any, messages: _Messages) -> None:
    """Rule V10."""
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "adaptive"):
        return
    last_user = max((i for i, (role, _) in enumerate(messages) if role == "user"), default=None)
    if last_user is None or not any(b["type"] == "tool_result" for b in messages[last_user][1]):
        return
    assistant = max(
        (i for i, (role, _) in enumerate(messages[:last_user]) if role == "assistant"),
        default=None,
    )
    if assistant is None or not messages[assistant][1]:
        return
    first = messages[assistant][1][0]["type"]
    if first not in ("thinking", "redacted_thinking"):
        raise _bad(
            f"messages.{assistant}.content.0.type: Expected `thinking` or `redacted_thinking`, "
            f"but found `{first}`. When `thinking` is enabled, a final `assistant` message must "
            "start with a thinking block (preceeding the lastmost set of `tool_use` and "
            "`tool_result` blocks). We recommend you include thinking blocks from previous "
            "turns. To avoid this requirement, disable `thinking`."
        )


TOOL_USE_ID = re.compile(r"^[a-zA-Z0-9_-]+$")


def _check_tool_id(value: str, path: str) -> None:
    if not TOOL_USE_ID.fullmatch(value):
        raise _bad(f"{path}: String should match pattern '^[a-zA-Z0-9_-]+$'")


def _check_block(block: Any, role: str, path: str, seen_tool_use: set[str]) -> None:
    """Rules V4, V6, V7 for one message content block."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _bad(f"{path}.type: Field required")
    kind = block["type"]
    if kind not in BLOCK_TYPES_BY_ROLE[role]:
        allowed = ", ".join(sorted(BLOCK_TYPES_BY_ROLE[role]))
        raise _bad(f"{path}.type: '{kind}' blocks are not allowed in {role} messages ({allowed})")
    if kind in NOT_CACHEABLE_BLOCKS and block.get("cache_control") is not None:
        raise _bad(f"{path}.{kind}.cache_control: Extra inputs are not permitted")
    if kind == "text":
        _check_text(block, path)
    elif kind == "tool_use":
        tool_id, name = block.get("id"), block.get("name")
        if not isinstance(tool_id, str) or not isinstance(name, str):
            raise _bad(f"{path}: tool_use blocks need string 'id' and 'name'")
        if not isinstance(block.get("input"), dict):
            raise _bad(f"{path}.input: Input should be a valid dictionary")
        _check_tool_id(tool_id, f"{path}.id")
        if tool_id in seen_tool_use:
            raise _bad(f"{path}: `tool_use` ids must be unique")
        seen_tool_use.add(tool_id)
    elif kind == "tool_result":
        if not isinstance(block.get("tool_use_id"), str):
            raise _bad(f"{path}.tool_use_id: Field required")
        _check_tool_id(block["tool_use_id"], f"{path}.tool_use_id")
        inner = block.get("content")
        if inner is not None and not isinstance(inner, str | list):
            raise _bad(f"{path}.content: Input should be a valid string or list")
        if isinstance(inner, str) and inner and not inner.strip():
            raise _bad("messages: text content blocks must contain non-whitespace text")
        for k, part in enumerate(inner if isinstance(inner, list) else ()):
            if isinstance(part, dict) and part.get("type") == "text":
                _check_text(part, f"{path}.content.{k}")
    elif kind == "thinking":
        if not isinstance(block.get("thinking"), str) or not isinstance(
            block.get("signature"), str
        ):
            raise _bad(f"{path}: thinking blocks need string 'thinking' and 'signature'")
    elif kind == "redacted_thinking" and not isinstance(block.get("data"), str):
        raise _bad(f"{path}.data: Field required")


def _check_pairing(messages: _Messages) -> None:
    """Rule V5 over turns (consecutive same-role messages merged, Rule V3)."""
    turns: list[tuple[str, list[tuple[int, int, dict[str, Any]]]]] = []
    for i, (role, blocks) in enumerate(messages):
        entries = [(i, j, b) for j, b in enumerate(blocks)]
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(entries)
        else:
            turns.append((role, entries))
    for t, (role, entries) in enumerate(turns):
        if role != "user":
            continue
        previous = turns[t - 1][1] if t > 0 else []
        offered = {b["id"]: i for i, _, b in previous if b["type"] == "tool_use"}
        leading: set[str] = set()
        for _, _, b in entries:
            if b["type"] != "tool_result":
                break
            leading.add(b["tool_use_id"])
        missing = [tid for tid in offered if tid not in leading]
        if missing:
            i = offered[missing[0]]
            raise _bad(
                f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
                "corresponding `tool_result` block in the next message."
            )
        for i, j, b in entries:
            if b["type"] == "tool_result" and b["tool_use_id"] not in offered:
                raise _bad(
                    f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` "
                    f"blocks: {b['tool_use_id']}. Each `tool_result` block must have a "
                    "corresponding `tool_use` block in the previous message."
                )


def _automatic_marker(value: Any, blocks: list[AnthropicBlock], markers: list[_Marker]) -> None:
    """Top-level ``cache_control`` ("automatic caching"): a marker on the last cacheable
    block, using one of the four slots."""
    if value is None:
        return
    for index in range(len(blocks) - 1, -1, -1):
        if blocks[index].cacheable:
            marker = _marker_of(value, "cache_control", index)
            if marker is not None:
                markers.append(marker)
            return


def _check_markers(markers: list[_Marker]) -> None:
    """Rules V7 (count) and V8 (TTL order)."""
    if len(markers) > MAX_CACHE_BREAKPOINTS:
        raise _bad(
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(markers)}."
        )
    ordered = sorted(markers, key=lambda m: m.block_index)
    seen_short = False
    for marker in ordered:
        if marker.ttl == "1h" and seen_short:
            raise _bad(
                f"{marker.path}.cache_control.ttl: a ttl='1h' cache_control block must not come "
                "after a ttl='5m' cache_control block. Note that blocks are processed in the "
                "following order: `tools`, `system`, `messages`."
            )
        seen_short = seen_short or marker.ttl == "5m"


# --- rendering ---------------------------------------------------------------------------


def usage_json(result: AnthropicCacheResult, output_tokens: int) -> dict[str, Any]:
    """The ``usage`` object exactly as the real API shapes it."""
    return {
        "input_tokens": result.input_tokens,
        "cache_creation_input_tokens": result.cache_creation_input_tokens,
        "cache_read_input_tokens": result.cache_read_input_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": result.ephemeral_5m_input_tokens,
            "ephemeral_1h_input_tokens": result.ephemeral_1h_input_tokens,
        },
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def render_message(
    request: MessagesRequest, reply: Reply, result: AnthropicCacheResult, ids: IdFactory
) -> dict[str, Any]:
    """A ``message`` object for ``reply``; ``stop_reason`` is ``tool_use`` when it calls
    tools, ``max_tokens`` when its text exceeds ``max_tokens``, else ``end_turn``."""
    content: list[dict[str, Any]] = []
    if reply.thinking is not None:
        content.append(
            {"type": "thinking", "thinking": reply.thinking, "signature": ids.next("sig")}
        )
    if reply.text is not None:
        content.append({"type": "text", "text": reply.text})
    for call in reply.tool_calls:
        content.append(
            {
                "type": "tool_use",
                "id": call.id or ids.next("toolu"),
                "name": call.name,
                "input": dict(call.arguments),
            }
        )
    output_tokens = sum(count_tokens(canonical_bytes(block)) for block in content)
    stop_reason = "tool_use" if reply.tool_calls else "end_turn"
    if not reply.tool_calls and output_tokens > request.max_tokens:
        stop_reason, output_tokens = "max_tokens", request.max_tokens
    return {
        "id": ids.next("msg"),
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage_json(result, output_tokens),
    }


def error_body(error: FakeApiError, request_id: str) -> dict[str, Any]:
    """The documented error shape ("Errors": error shapes)."""
    kind = error.type or ERROR_TYPE_BY_STATUS.get(error.status, "api_error")
    return {
        "type": "error",
        "error": {"type": kind, "message": error.message},
        "request_id": request_id,
    }
