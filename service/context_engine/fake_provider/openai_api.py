"""OpenAI Responses API (``POST /v1/responses``): validation, prompt units, rendering.

Validation rules. Each is a 400 the real API also returns (docs: "Responses API reference",
"Function calling", "Error codes"); messages copy the real API's wording where known.

Rule W1. An API key (``Authorization: Bearer ...``) is present (else 401).
Rule W2. ``model`` is a string; ``input`` is a string or a list of items;
         ``max_output_tokens`` >= 16; ``prompt_cache_retention`` is ``in_memory``/``24h``.
         The fake does not stream and keeps no server-side state, so ``stream`` and
         ``previous_response_id`` are refused rather than silently ignored.
Rule W3. Item types are those in ``ITEM_TYPES`` (an item with a ``role`` and no ``type`` is a
         message); message roles and content part types follow ``PART_TYPES_BY_ROLE``.
Rule W4. Every ``function_call_output`` answers an earlier ``function_call`` with the same
         ``call_id``; every ``function_call`` is answered by a later output. A ``call_id``
         is at most ``MAX_CALL_ID_CHARS`` (64) characters ("string_above_max_length").
Rule W5. Function tools have a name matching ``TOOL_NAME``; ``parameters`` is an object in
         which every array schema has ``items`` ("array schema missing items", a 400 whether
         or not the function is strict).
Rule W6. A ``reasoning`` item is immediately followed by the item it was produced with (an
         assistant ``message`` or a ``function_call``) carrying its ``id``, and, when
         ``store`` is false, carries its ``encrypted_content`` (the fake, like a
         ``store=false`` request, cannot look an item up by id). Replay reasoning verbatim
         ("Reasoning models": keeping reasoning items in context). Users of the API report
         "Item 'rs_...' of type 'reasoning' was provided without its required following
         item" for a following item without its id.
Rule W7. An assistant ``message`` or ``function_call`` carrying an ``id`` follows a
         ``reasoning`` item, at once or after other such items carrying theirs (one model
         turn's output, every item of which has its id):
         users report "Item 'fc_...' of type 'function_call' was provided without its
         required 'reasoning' item" for a reasoning model's item replayed without its
         reasoning. Stricter than the API for a model without reasoning, whose items it
         takes back with their ids; the engine sends ids only beside reasoning.

Prompt units, in the order the cache sees them: ``instructions`` (one unit), each tool,
each input item. An item's ``id`` and ``status`` are bookkeeping, not prompt text, and are
left out of its canonical bytes.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .cache import OPENAI_RETENTION_SECONDS, OpenAICacheResult
from .errors import FakeApiError
from .ids import IdFactory
from .script import Reply
from .tokens import canonical_bytes, count_tokens

__all__ = [
    "ERROR_TYPE_BY_STATUS",
    "ITEM_TYPES",
    "PART_TYPES_BY_ROLE",
    "ResponsesRequest",
    "error_body",
    "parse_request",
    "render_response",
]

ERROR_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    429: "tokens",
    500: "server_error",
    503: "server_error",
}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_INPUT_PARTS = frozenset({"input_text", "input_image", "input_file"})
PART_TYPES_BY_ROLE: dict[str, frozenset[str]] = {
    "user": _INPUT_PARTS,
    "system": _INPUT_PARTS,
    "developer": _INPUT_PARTS,
    "assistant": frozenset({"output_text", "refusal"}),
}
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MIN_MAX_OUTPUT_TOKENS = 16
_NOT_PROMPT_TEXT = ("id", "status")


@dataclass(frozen=True)
class ResponsesRequest:
    body: dict[str, Any]
    model: str
    units: tuple[bytes, ...]
    prompt_cache_key: str | None
    retention: str
    max_output_tokens: int | None
    include_encrypted_reasoning: bool


def _bad(message: str, param: str | None = None, code: str | None = None) -> FakeApiError:
    return FakeApiError(400, message, type="invalid_request_error", param=param, code=code)


def _missing(param: str) -> FakeApiError:
    return _bad(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def parse_request(body: Any, headers: Mapping[str, str]) -> ResponsesRequest:
    """Validate a Responses request body; raise ``FakeApiError``."""
    auth = headers.get("authorization", "")
    if not auth.lower().startswith("bearer ") or not auth[7:].strip():
        raise FakeApiError(
            401,
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            type="invalid_request_error",
        )
    if not isinstance(body, dict):
        raise _bad("We could not parse the JSON body of your request.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _missing("model")
    if body.get("stream"):
        raise _bad("The fake provider does not stream; send stream=false.", "stream")
    if body.get("previous_response_id") is not None:
        raise _bad(
            "The fake provider keeps no responses; send the full input instead.",
            "previous_response_id",
        )
    max_output = body.get("max_output_tokens")
    if max_output is not None and (
        not isinstance(max_output, int) or max_output < MIN_MAX_OUTPUT_TOKENS
    ):
        raise _bad(
            "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= "
            f"{MIN_MAX_OUTPUT_TOKENS}, but got {max_output} instead.",
            "max_output_tokens",
            "integer_below_min_value",
        )
    retention = body.get("prompt_cache_retention") or "in_memory"
    if retention not in OPENAI_RETENTION_SECONDS:
        raise _bad(
            f"Invalid value: '{retention}'. Supported values are: 'in_memory' and '24h'.",
            "prompt_cache_retention",
            "invalid_value",
        )
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise _bad("Invalid type for 'prompt_cache_key': expected a string.", "prompt_cache_key")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("Invalid type for 'instructions': expected a string.", "instructions")

    units: list[bytes] = []
    if instructions:
        units.append(canonical_bytes({"instructions": instructions}))
    units.extend(_tools(body.get("tools")))
    units.extend(_input(body.get("input"), store=body.get("store", True) is not False))
    include = body.get("include") or ()
    return ResponsesRequest(
        body=body,
        model=model,
        units=tuple(units),
        prompt_cache_key=key,
        retention=retention,
        max_output_tokens=max_output,
        include_encrypted_reasoning="reasoning.encrypted_content" in include,
    )


def _tools(tools: Any) -> list[bytes]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("Invalid type for 'tools': expected an array.", "tools")
    units = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise _missing(f"tools[{i}].type")
        if tool["type"] == "function":
            name = tool.get("name")
            if not isinstance(name, str):
                raise _missing(f"tools[{i}].name")
            if not TOOL_NAME.match(name):
                raise _bad(
                    f"Invalid 'tools[{i}].name': string does not match pattern. Expected a "
                    f"string that matches the pattern '{TOOL_NAME.pattern}'.",
                    f"tools[{i}].name",
                    "invalid_value",
                )
            params = tool.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise _bad(f"Invalid type for 'tools[{i}].parameters': expected an object.")
            missing = _array_without_items(params) if params is not None else None
            if missing is not None:  # Rule W5
                raise _bad(
                    f"Invalid schema for function '{name}': In context={missing},"
                    " array schema missing items.",
                    f"tools[{i}].parameters",
                    "invalid_function_parameters",
                )
        units.append(canonical_bytes(tool))
    return units


def _array_without_items(schema: Any, path: tuple[str, ...] = ()) -> str | None:
    """The context, as OpenAI's message writes it (`('properties', 'tags')`), of the first
    array schema in `schema` without `items`; None if none."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if (kind == "array" or (isinstance(kind, list) and "array" in kind)) and "items" not in schema:
        return repr(path)
    for key, value in schema.items():
        children: list[tuple[tuple[str, ...], Any]]
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(
            value, dict
        ):
            children = [((key, name), child) for name, child in value.items()]
        elif key in ("anyOf", "allOf", "oneOf", "prefixItems") and isinstance(value, list):
            children = [((key, str(n)), child) for n, child in enumerate(value)]
        elif key in ("items", "additionalProperties", "not"):
            children = [((key,), value)]
        else:
            continue
        for step, child in children:
            found = _array_without_items(child, path + step)
            if found is not None:
                return found
    return None


def _input(items: Any, *, store: bool) -> list[bytes]:
    if items is None:
        raise _missing("input")
    if isinstance(items, str):
        return [canonical_bytes({"type": "message", "role": "user", "content": items})]
    if not isinstance(items, list):
        raise _bad("Invalid type for 'input': expected a string or an array.", "input")
    units = []
    calls: dict[str, int] = {}
    answered: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad(f"Invalid type for 'input[{i}]': expected an object.", f"input[{i}]")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_TYPES:
            supported = ", ".join(f"'{t}'" for t in ITEM_TYPES)
            raise _bad(
                f"Invalid value: '{kind}'. Supported values are: {supported}.",
                f"input[{i}].type",
                "invalid_value",
            )
        if kind in _OUTPUT_TYPES and item.get("id") is not None:
            _check_reasoned(items, i, kind)
        if kind == "message":
            _check_message(item, i)
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if not isinstance(item.get(field), str):
                    raise _missing(f"input[{i}].{field}")
            _check_call_id(item["call_id"], i)
            calls[item["call_id"]] = i
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _missing(f"input[{i}].call_id")
            _check_call_id(call_id, i)
            if not isinstance(item.get("output"), str | list):
                raise _missing(f"input[{i}].output")
            if call_id not in calls:
                raise _bad(
                    f"No tool call found for function call output with call_id {call_id}.",
                    "input",
                )
            answered.add(call_id)
        elif kind == "reasoning":
            if not isinstance(item.get("summary"), list):
                raise _missing(f"input[{i}].summary")
            _check_reasoning(items, i, store=store)
        unit = {k: v for k, v in item.items() if k not in _NOT_PROMPT_TEXT}
        unit["type"] = kind
        units.append(canonical_bytes(unit))
    for call_id in calls:
        if call_id not in answered:
            raise _bad(f"No tool output found for function call {call_id}.", "input")
    return units


def _check_reasoning(items: list[Any], i: int, *, store: bool) -> None:
    """Rule W6."""
    item = items[i]
    item_id = item.get("id", "")
    encrypted = item.get("encrypted_content")
    if encrypted is not None and not isinstance(encrypted, str):
        raise _bad(f"Invalid type for 'input[{i}].encrypted_content'.", f"input[{i}]")
    if not store and encrypted is None:
        raise _bad(
            f"Item with id '{item_id}' not found. Items are not persisted when `store` is set "
            "to false. Try again with `store` set to true, or remove this item from your input.",
            "input",
        )
    following = items[i + 1] if i + 1 < len(items) else {}
    if _output_type(following) is None or not isinstance(following.get("id"), str):
        raise _bad(
            f"Item '{item_id}' of type 'reasoning' was provided without its required following "
            "item.",
            "input",
        )


_OUTPUT_TYPES = ("message", "function_call")


def _output_type(item: Any) -> str | None:
    """A model output item's type (an assistant message or a function call); None for any
    other item."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "function_call" or (kind == "message" and item.get("role") == "assistant"):
        return str(kind)
    return None


def _check_reasoned(items: list[Any], i: int, kind: str) -> None:
    """Rule W7."""
    if _output_type(items[i]) is None:
        return  # a user message's id is not a model output's
    j = i - 1  # back over the turn's earlier outputs, each named by its id as this one is
    while j >= 0 and _output_type(items[j]) is not None and "id" in items[j]:
        j -= 1
    before = items[j] if j >= 0 else None
    if not (isinstance(before, dict) and before.get("type") == "reasoning"):
        raise _bad(
            f"Item '{items[i]['id']}' of type '{kind}' was provided without its required "
            "'reasoning' item.",
            "input",
        )


MAX_CALL_ID_CHARS = 64


def _check_call_id(call_id: str, i: int) -> None:
    """Rule W4's length bound."""
    if len(call_id) > MAX_CALL_ID_CHARS:
        raise _bad(
            f"Invalid 'input[{i}].call_id': string too long. Expected a string with maximum"
            f" length {MAX_CALL_ID_CHARS}, but got a string with length {len(call_id)}"
            " instead.",
            f"input[{i}].call_id",
            "string_above_max_length",
        )


def _check_message(item: dict[str, Any], i: int) -> None:
    role = item.get("role")
    if role not in PART_TYPES_BY_ROLE:
        raise _bad(
            f"Invalid value: '{role}'. Supported values are: 'user', 'assistant', 'system', "
            "and 'developer'.",
            f"input[{i}].role",
            "invalid_value",
        )
    content = item.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _missing(f"input[{i}].content")
    allowed = PART_TYPES_BY_ROLE[role]
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            supported = ", ".join(f"'{t}'" for t in sorted(allowed))
            raise _bad(
                f"Invalid value: '{kind}'. Supported values are: {supported}.",
                f"input[{i}].content[{k}]",
                "invalid_value",
            )
        if kind in ("input_text", "output_text") and not isinstance(part.get("text"), str):
            raise _missing(f"input[{i}].content[{k}].text")


# --- rendering ---------------------------------------------------------------------------


def render_response(
    request: ResponsesRequest,
    reply: Reply,
    result: OpenAICacheResult,
    ids: IdFactory,
    created_at: float,
) -> dict[str, Any]:
    """A completed ``response`` object for ``reply`` with documented ``usage`` fields."""
    output: list[dict[str, Any]] = []
    reasoning_tokens = 0
    if reply.thinking is not None:
        reasoning_tokens = count_tokens(reply.thinking)
        encrypted = base64.b64encode(reply.thinking.encode("utf-8")).decode("ascii")
        output.append(
            {
                "id": ids.next("rs"),
                "type": "reasoning",
                "summary": [],
                "encrypted_content": encrypted if request.include_encrypted_reasoning else None,
            }
        )
    visible: list[dict[str, Any]] = []
    if reply.text is not None:
        visible.append(
            {
                "id": ids.next("msg"),
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": reply.text, "annotations": [], "logprobs": []}
                ],
            }
        )
    for call in reply.tool_calls:
        visible.append(
            {
                "id": ids.next("fc"),
                "type": "function_call",
                "call_id": call.id or ids.next("call"),
                "name": call.name,
                "arguments": json.dumps(dict(call.arguments), separators=(",", ":")),
                "status": "completed",
            }
        )
    output.extend(visible)
    output_tokens = reasoning_tokens + sum(count_tokens(canonical_bytes(v)) for v in visible)
    body = request.body
    return {
        "id": ids.next("resp"),
        "object": "response",
        "created_at": int(created_at),
        "status": "completed",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": request.max_output_tokens,
        "metadata": body.get("metadata") or {},
        "model": request.model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "prompt_cache_key": request.prompt_cache_key,
        "prompt_cache_retention": body.get("prompt_cache_retention"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "service_tier": "default",
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"),
        "usage": {
            "input_tokens": result.total_tokens,
            "input_tokens_details": {
                "cached_tokens": result.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": result.total_tokens + output_tokens,
        },
        "user": None,
    }


def error_body(error: FakeApiError) -> dict[str, Any]:
    """The documented error shape ("Error codes")."""
    kind = error.type or ERROR_TYPE_BY_STATUS.get(error.status, "server_error")
    code = error.code
    if code is None and error.status == 429:
        code = "rate_limit_exceeded"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}
