"""Read a golden case's neutral request (ModelRequest.canonical() JSON) back into a
ModelRequest. The inverse of canonical(): every field canonical() writes is read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from context_engine.core.request import (
    Block,
    CacheBreakpoint,
    Message,
    ModelRequest,
    ToolDefinition,
)
from context_engine.core.rows import Row
from context_engine.core.trust import TrustLevel

__all__ = ["CASES", "HERE", "load_request", "request_from_canonical"]

HERE = Path(__file__).parent
CASES: dict[str, dict[str, str]] = json.loads((HERE / "cases.json").read_text())


def _block(d: dict[str, Any]) -> Block:
    return Block(
        row=Row(d["row"]),
        trust=TrustLevel[d["trust"]],
        kind=d["kind"],
        item_id=d["item_id"],
        source_sequence=d["source_sequence"],
        text=d.get("text", ""),
        call_id=d.get("call_id", ""),
        tool_name=d.get("tool_name", ""),
        arguments_json=d.get("arguments_json", ""),
        is_error=d.get("is_error", False),
        artifact_ref=d.get("artifact_ref", ""),
        provider=d.get("provider", ""),
        opaque=d.get("opaque", ""),
        run_id=d.get("run_id", ""),
        provider_item_id=d.get("provider_item_id", ""),
    )


def request_from_canonical(d: dict[str, Any]) -> ModelRequest:
    return ModelRequest(
        provider=d["provider"],
        model_id=d["model_id"],
        system=tuple(_block(b) for b in d["system"]),
        tools=tuple(
            ToolDefinition(t["name"], t["description"], t["input_schema_json"]) for t in d["tools"]
        ),
        messages=tuple(
            Message(m["role"], tuple(_block(b) for b in m["blocks"])) for m in d["messages"]
        ),
        max_output_tokens=d["max_output_tokens"],
        session_key=d["session_key"],
        cache_breakpoints=tuple(
            CacheBreakpoint(
                c["name"],
                c["through_item"],
                c["ttl"],
                c["priority"],
                c["through_input_item"],
                c.get("through_sequence", 0),
            )
            for c in d["cache_breakpoints"]
        ),
    )


def load_request(case: str) -> ModelRequest:
    return request_from_canonical(json.loads((HERE / f"{case}.request.json").read_text()))
