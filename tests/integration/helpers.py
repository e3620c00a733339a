"""Request builders and status-detail readers shared by integration tests."""

from __future__ import annotations

import json
import uuid
from typing import Any

import grpc
from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from google.rpc import error_details_pb2, status_pb2

TENANT = "tenant-a"


def new_id() -> str:
    return str(uuid.uuid4())


def tool(
    name: str, *, scopes: tuple[str, ...] = (), description: str = "", **kw: Any
) -> pb.ToolSpec:
    schema = kw.pop(
        "schema",
        {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    )
    return pb.ToolSpec(
        name=name,
        description=description or f"The {name} tool.",
        input_schema_json=json.dumps(schema),
        required_scopes=list(scopes),
        side_effect=kw.pop("side_effect", pb.SIDE_EFFECT_NONE),
        **kw,
    )


def spec(**kw: Any) -> pb.PlanSpec:
    out = pb.PlanSpec(
        model_id=kw.pop("model_id", "claude-sonnet-4-5"),
        agent=pb.AgentSpec(
            agent_id="helper", version="3", instructions="Help the user plan trips."
        ),
        principal=pb.Principal(
            principal_id="p1", scopes=["calendar.read", "web.read"], scope_label="owner"
        ),
        tools=[
            tool("web.fetch", scopes=("web.read",), side_effect=pb.SIDE_EFFECT_NETWORK_READ),
            tool("calendar.list", scopes=("calendar.read",)),
            tool("clock.now"),
        ],
        environment=pb.SessionEnvironment(surface="chat", time_zone="Europe/Berlin"),
    )
    for key, value in kw.items():
        getattr(out, key).CopyFrom(value) if hasattr(value, "CopyFrom") else setattr(
            out, key, value
        )
    return out


def user(text: str, item_id: str = "") -> pb.ConversationItem:
    return pb.ConversationItem(item_id=item_id, user_message=pb.UserMessage(text=text))


def assistant(text: str) -> pb.ConversationItem:
    return pb.ConversationItem(assistant_message=pb.AssistantMessage(text=text))


def call(
    call_id: str, name: str = "web.fetch", args: dict[str, Any] | None = None
) -> pb.ConversationItem:
    return pb.ConversationItem(
        tool_call=pb.ToolCall(
            call_id=call_id, tool_name=name, arguments_json=json.dumps(args or {"q": "x"})
        )
    )


def result(
    call_id: str,
    content: str,
    trust: int = pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
    name: str = "web.fetch",
) -> pb.ConversationItem:
    return pb.ConversationItem(
        tool_result=pb.ToolResult(call_id=call_id, tool_name=name, content=content, trust=trust)
    )


def details(error: grpc.aio.AioRpcError) -> tuple[str, list[str], dict[str, str]]:
    """(ErrorInfo.reason, BadRequest field paths, ErrorInfo.metadata) from a status."""
    raw = dict(error.trailing_metadata() or ()).get("grpc-status-details-bin")
    assert raw, "status carries no structured details"
    status = status_pb2.Status.FromString(raw)
    reason, fields, metadata = "", [], {}
    for any_detail in status.details:
        info = error_details_pb2.ErrorInfo()
        bad = error_details_pb2.BadRequest()
        if any_detail.Unpack(info):
            reason, metadata = info.reason, dict(info.metadata)
        elif any_detail.Unpack(bad):
            fields = [v.field for v in bad.field_violations]
    return reason, fields, metadata


async def open_session(stub: Any, **spec_kw: Any) -> tuple[str, pb.ContextPlan]:
    session_id = new_id()
    response = await stub.Plan(
        pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec(**spec_kw))
    )
    return session_id, response.plan


async def start_run(stub: Any, session_id: str, text: str) -> pb.StartRunResponse:
    return await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT, session_id=session_id, user_message=pb.UserMessage(text=text)
        )
    )
