"""Neutral ModelRequest -> Anthropic Messages API request body (``POST /v1/messages``).

Rule 1 (order): the body holds ``tools``, ``system`` and ``messages``; Anthropic processes
and caches them in that order, so prompt units (for explain) follow it too.
Rule 2 (bytes): the body is RFC 8785 JSON (sorted keys, no whitespace, UTF-8): the same
request renders the same bytes in every process. Tool schemas and call arguments are
re-parsed from their canonical JSON; reasoning blocks from their opaque JSON.
Rule 3 (text): text is copied verbatim, envelopes included. A whitespace-only text block is
not sent (the API rejects it); a tool result with empty content omits ``content``.
Rule 4 (turns): consecutive same-role messages merge into one turn; in a user turn the
``tool_result`` blocks lead (the API requires results first); a conversation that starts
with the assistant (a history cut that kept an assistant turn first) is preceded by the
fixed user turn ``HISTORY_CUT_PLACEHOLDER``, the same on every request.
Rule 5 (reasoning): a reasoning block from Anthropic (``thinking``/``redacted_thinking``)
is replayed verbatim from its opaque JSON, never rendered into text; one from another
provider cannot be replayed here and is not sent.
Rule 6 (markers): request.cache_breakpoints become ``cache_control`` on the block each
closes — after_tools on the last tool, after_system on the last system block, a history
marker on its through_item's block (or the nearest sendable block before it). At most
``MAX_BREAKPOINTS``, taken in priority order, so the run marker drops first; two markers on
one block are one. In processing order no one-hour marker follows a shorter one: a later
marker's TTL is lowered to the shortest before it. ``"5m"`` is sent as the API default
(no ``ttl`` key).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.canonical import canonical_bytes
from ..core.errors import EngineError
from ..core.request import Block, CacheBreakpoint, ModelRequest
from ..core.rows import Row
from .layout import PromptUnit, RenderedPayload
from .names import check_wire_names, wire_tool_name

__all__ = ["API", "HISTORY_CUT_PLACEHOLDER", "MAX_BREAKPOINTS", "prompt_units", "render"]

API = "anthropic.messages"
MAX_BREAKPOINTS = 4
HISTORY_CUT_PLACEHOLDER = "(The conversation continues from earlier turns not shown here.)"
_TTL_RANK = {"5m": 0, "1h": 1}
_PROVIDER = "anthropic"


@dataclass(slots=True)
class _Unit:
    obj: dict[str, Any]
    row: Row
    item_id: str
    kind: str  # "tool" | "system" | "text" | "tool_use" | "tool_result" | "reasoning"

    @property
    def cacheable(self) -> bool:
        return self.kind != "reasoning"  # thinking blocks cannot carry cache_control


@dataclass(slots=True)
class _Layout:
    tools: list[_Unit]
    system: list[_Unit]
    turns: list[tuple[str, list[_Unit]]]
    # For each neutral message block, in order: the unit it rendered to, or the last unit
    # rendered before it when it rendered none (Rule 6: a marker never moves later).
    anchors: list[tuple[str, _Unit | None]]

    def ordered(self) -> list[tuple[str, str, _Unit]]:
        """(path, role, unit) in processing order; role is "" outside messages."""
        out = [(f"tools[{n}]", "", u) for n, u in enumerate(self.tools)]
        out += [(f"system[{n}]", "", u) for n, u in enumerate(self.system)]
        for t, (role, units) in enumerate(self.turns):
            out += [(f"messages[{t}].content[{n}]", role, u) for n, u in enumerate(units)]
        return out


def render(request: ModelRequest, max_breakpoints: int = MAX_BREAKPOINTS) -> RenderedPayload:
    """The Messages API body for `request`; `max_breakpoints` models a smaller budget.

    Raises:
        PreconditionError: two tool names share a wire name.
        EngineError: a reasoning item's opaque payload is not a JSON object.
    """
    layout = _layout(request)
    _place_markers(layout, request.cache_breakpoints, max_breakpoints)
    body: dict[str, Any] = {
        "model": request.model_id,
        "max_tokens": request.max_output_tokens,
        "messages": [
            {"role": role, "content": [u.obj for u in units]} for role, units in layout.turns
        ],
    }
    if layout.system:
        body["system"] = [u.obj for u in layout.system]
    if layout.tools:
        body["tools"] = [u.obj for u in layout.tools]
    return RenderedPayload(API, canonical_bytes(body))


def prompt_units(request: ModelRequest) -> tuple[PromptUnit, ...]:
    """The prompt as Anthropic caches it, unit by unit, markers excluded."""
    layout = _layout(request)
    return tuple(
        PromptUnit(
            path,
            unit.row,
            unit.item_id,
            canonical_bytes({"role": role, "block": unit.obj} if role else unit.obj),
        )
        for path, role, unit in layout.ordered()
    )


# --- layout ----------------------------------------------------------------------------


def _layout(request: ModelRequest) -> _Layout:
    check_wire_names(
        [t.name for t in request.tools]
        + [b.tool_name for m in request.messages for b in m.blocks if b.kind == "tool_call"]
    )
    tools = [
        _Unit(
            _tool(t.name, t.description, t.input_schema_json),
            Row.TOOL_DEFINITIONS,
            f"tool:{t.name}",
            "tool",
        )
        for t in request.tools
    ]
    system = [
        _Unit({"type": "text", "text": b.text}, b.row, b.item_id, "system")
        for b in request.system
        if b.text.strip()
    ]
    turns: list[tuple[str, list[_Unit]]] = []
    anchors: list[tuple[str, _Unit | None]] = []
    last: _Unit | None = None
    for message in request.messages:
        units: list[_Unit] = []
        for block in message.blocks:
            unit = _block(block)
            if unit is not None:
                units.append(unit)
                if unit.cacheable:
                    last = unit
            anchors.append((block.item_id, unit if unit is not None and unit.cacheable else last))
        if not units:
            continue
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(units)
        else:
            turns.append((message.role, units))
    if turns and turns[0][0] == "assistant":
        placeholder = {"type": "text", "text": HISTORY_CUT_PLACEHOLDER}
        turns.insert(0, ("user", [_Unit(placeholder, Row.CONVERSATION, "", "text")]))
    turns = [(role, _results_first(units) if role == "user" else units) for role, units in turns]
    return _Layout(tools, system, turns, anchors)


def _tool(name: str, description: str, schema_json: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": wire_tool_name(name), "input_schema": json.loads(schema_json)}
    if description:
        out["description"] = description
    return out


def _block(block: Block) -> _Unit | None:
    """One neutral block's content block (Rules 3, 5); None when it sends nothing."""
    match block.kind:
        case "text":
            if not block.text.strip():
                return None
            obj: dict[str, Any] = {"type": "text", "text": block.text}
        case "tool_call":
            obj = {
                "type": "tool_use",
                "id": block.call_id,
                "name": wire_tool_name(block.tool_name),
                "input": json.loads(block.arguments_json or "{}"),
            }
        case "tool_result":
            obj = {"type": "tool_result", "tool_use_id": block.call_id}
            if block.text:
                obj["content"] = block.text
            if block.is_error:
                obj["is_error"] = True
        case "reasoning":
            if block.provider != _PROVIDER:
                return None
            obj = _opaque(block)
        case _:
            raise EngineError(f"no Anthropic rendering for block kind {block.kind!r}")
    kind = {"tool_call": "tool_use"}.get(block.kind, block.kind)
    return _Unit(obj, block.row, block.item_id, kind)


def _opaque(block: Block) -> dict[str, Any]:
    try:
        value = json.loads(block.opaque)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise EngineError(f"reasoning item {block.item_id!r} is not a JSON object")
    return value


def _results_first(units: list[_Unit]) -> list[_Unit]:
    results = [u for u in units if u.kind == "tool_result"]
    return results + [u for u in units if u.kind != "tool_result"]


# --- markers ---------------------------------------------------------------------------


def _place_markers(layout: _Layout, breakpoints: Sequence[CacheBreakpoint], budget: int) -> None:
    """Attach cache_control to the blocks the markers close (Rule 6)."""
    ordered = [u for _, _, u in layout.ordered()]
    position = {id(u): n for n, u in enumerate(ordered)}
    chosen: dict[int, str] = {}
    for bp in sorted(breakpoints, key=lambda b: (b.priority, b.name)):
        if len(chosen) >= budget:
            break
        unit = _target(layout, bp)
        if unit is None or id(unit) not in position:
            continue
        chosen.setdefault(position[id(unit)], bp.ttl if bp.ttl in _TTL_RANK else "5m")
    shortest = max(_TTL_RANK.values())
    for index in sorted(chosen):
        shortest = min(shortest, _TTL_RANK[chosen[index]])
        control: dict[str, str] = {"type": "ephemeral"}
        if shortest == _TTL_RANK["1h"]:
            control["ttl"] = "1h"
        ordered[index].obj["cache_control"] = control


def _target(layout: _Layout, bp: CacheBreakpoint) -> _Unit | None:
    if bp.name == "after_tools":
        return layout.tools[-1] if layout.tools else None
    if bp.name == "after_system":
        if layout.system:
            return layout.system[-1]
        return layout.tools[-1] if layout.tools else None
    for item_id, unit in layout.anchors:
        if item_id and item_id == bp.through_item:
            return unit  # the first block of that id: a duplicate id never moves it later
    return None
