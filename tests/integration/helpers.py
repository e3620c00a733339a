"""Request builders and status-detail readers shared by integration tests."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any
from uuid import UUID

import grpc
from google.rpc import error_details_pb2, status_pb2

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb

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


def spec_with_skill(
    trust: int, name: str = "vendor", description: str = "Vendor help."
) -> pb.PlanSpec:
    """spec() with one skill in its catalog at `trust` (version "1")."""
    out = spec()
    out.skills.append(
        pb.SkillCatalogEntry(name=name, description=description, version="1", trust=trust)
    )
    return out


async def plan_with_skill(stub: Any, session_id: str, trust: int) -> pb.ContextPlan:
    """A new session's plan, spec_with_skill(trust)."""
    planned = pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=spec_with_skill(trust))
    return (await stub.Plan(planned)).plan


async def lower_skill(stub: Any, session_id: str, from_epoch: int) -> pb.RotateResponse:
    """An operator's Rotate lowering plan_with_skill's entry to EXTERNAL_UNTRUSTED."""
    return await stub.Rotate(
        pb.RotateRequest(
            tenant_id=TENANT,
            session_id=session_id,
            from_epoch=from_epoch,
            reason=pb.PLAN_REASON_OPERATOR_REVOCATION,
            spec=spec_with_skill(pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED),
        )
    )


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


def compaction_result(
    prepared: pb.PrepareCompactionResponse, summary: str, tokens_after: int = 8
) -> pb.CompactionResult:
    """The result a worker commits for `prepared`: its summary and what it echoes back."""
    return pb.CompactionResult(
        summary=summary,
        source_event_ids=prepared.source_event_ids,
        elided=prepared.elided,
        replaced_through_sequence=prepared.replaced_through_sequence,
        depth=prepared.depth,
        tokens_before=prepared.tokens_before,
        tokens_after=tokens_after,
        compactor_version="test-compactor@1",
        prompt_version=prepared.prompt_version,
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


async def open_session(
    stub: Any, *, tenant: str = TENANT, **spec_kw: Any
) -> tuple[str, pb.ContextPlan]:
    session_id = new_id()
    response = await stub.Plan(
        pb.PlanRequest(tenant_id=tenant, session_id=session_id, spec=spec(**spec_kw))
    )
    return session_id, response.plan


async def start_run(
    stub: Any, session_id: str, text: str, *, tenant: str = TENANT
) -> pb.StartRunResponse:
    return await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=tenant, session_id=session_id, user_message=pb.UserMessage(text=text)
        )
    )


async def append_items(
    stub: Any,
    session_id: str,
    run_id: str,
    version: int,
    *items: pb.ConversationItem,
    tenant: str = TENANT,
) -> pb.AppendItemsResponse:
    """AppendItems on a run at checkpoint `version`."""
    return await stub.AppendItems(
        pb.AppendItemsRequest(
            tenant_id=tenant,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=version,
            items=list(items),
        )
    )


def build_request(session_id: str, run_id: str, version: int = 0) -> pb.BuildRequest:
    """A Build of the run at checkpoint `version` (0: the latest), at a fixed instant."""
    request = pb.BuildRequest(
        tenant_id=TENANT, session_id=session_id, run_id=run_id, checkpoint_version=version
    )
    request.now.FromSeconds(1_790_000_000)
    return request


async def start_child(
    stub: Any, session_id: str, parent_run_id: str, instruction: str
) -> pb.StartRunResponse:
    return await stub.StartRun(
        pb.StartRunRequest(
            tenant_id=TENANT,
            session_id=session_id,
            child=pb.ChildSeed(parent_run_id=parent_run_id, instruction=instruction),
        )
    )


async def heads_agree(pool: Any, session_id: str, tenant: str = TENANT) -> int:
    """Assert that migrations/0013's run_head_state and run_latest_version read, for every
    run of the session, what store/runs.py's head read reads (a kept head is confirmed by
    the one and was read by the other). -> how many runs were compared."""
    from context_engine.store import runs

    run_ids = await pool.fetch(
        "SELECT run_id FROM runs WHERE tenant_id = $1 AND session_id = $2",
        tenant,
        UUID(session_id),
    )
    for (run_id,) in run_ids:
        head = await runs.read_run_head(pool, tenant, UUID(session_id), run_id)
        confirmed = await pool.fetchrow(
            "SELECT run_head_state($1, $2, $3), run_latest_version($1, $3)",
            tenant,
            UUID(session_id),
            run_id,
        )
        assert tuple(confirmed) == (head.state, head.latest_version), f"run {run_id}"
    return len(run_ids)


# --- databases of a test's own, and waiting for a condition (lifecycle tests) ----------


def base_dsn() -> str:
    """The test server's maintenance database: TEST_DATABASE_URL, which tests/conftest.py
    sets to the embedded PostgreSQL when it falls back to one."""
    import os

    return os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def dsn_on_test_server(database: str, *, user: str = "", password: str = "") -> str:
    """A DSN for `database` on the test server, as `user` (default: the base DSN's)."""
    from urllib.parse import urlsplit

    parts = urlsplit(base_dsn())
    login, _, host = parts.netloc.rpartition("@")
    if user:
        login = f"{user}:{password}" if password else user
    return f"{parts.scheme}://{login}@{host}/{database}"


async def create_database(*, migrate: bool = True) -> str:
    """A fresh database on the test server (TEST_DATABASE_URL); returns its DSN."""
    import os

    import asyncpg

    from context_engine.store import apply_migrations

    base = base_dsn()
    name = f"ce_own_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(base)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = f"{base.rpartition('/')[0]}/{name}"
    if migrate:
        conn = await asyncpg.connect(dsn)
        try:
            await apply_migrations(conn)
        finally:
            await conn.close()
    return dsn


async def admin_execute(sql: str) -> None:
    """Run one statement on the test server's maintenance database."""
    import asyncpg

    admin = await asyncpg.connect(base_dsn())
    try:
        await admin.execute(sql)
    finally:
        await admin.close()


async def drop_database(dsn: str) -> None:
    await admin_execute(f'DROP DATABASE IF EXISTS "{dsn.rpartition("/")[2]}" WITH (FORCE)')


async def wait_for(condition: Any, *, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll an async predicate until it holds; fail (not hang) after `timeout` seconds."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# --- working state and compaction (issue 6) -----------------------------------------------

_ENVELOPE_HEADER = re.compile(
    r'<(?P<tag>untrusted|memory|user|delegated) source="[^"]*" id="[^"]*"(?: truncated="true")?'
    r' nonce="(?P<nonce>[0-9a-f]{16}|[0-9]{20})">\n'
)


def outside_envelopes(text: str) -> str:
    """The text with every well-formed envelope (header through its own closing marker)
    removed: what a model reads as not enveloped."""
    out, at = [], 0
    while (m := _ENVELOPE_HEADER.search(text, at)) is not None:
        close = f"\n</{m['tag']}:{m['nonce']}>"
        end = text.find(close, m.end())
        assert end >= 0, "an envelope never closes"
        out.append(text[at : m.start()])
        at = end + len(close)
    out.append(text[at:])
    return "".join(out)


def block_texts(response: Any) -> list[tuple[int, int, str]]:
    """(row, source_sequence, rendered text) of every Region B block of a BuildResponse."""
    out = []
    for message in response.request.messages:
        for b in message.blocks:
            kind = b.WhichOneof("kind")
            text = (
                b.tool_result.content
                if kind == "tool_result"
                else b.tool_call.arguments_json
                if kind == "tool_call"
                else b.text
            )
            out.append((b.row, b.source_sequence, text))
    return out


async def update_state(
    stub: Any,
    session_id: str,
    run_id: str,
    version: int,
    writer: int = pb.WRITER_MODEL,
    **fields: Any,
) -> pb.UpdateWorkingStateResponse:
    return await stub.UpdateWorkingState(
        pb.UpdateWorkingStateRequest(
            tenant_id=TENANT,
            session_id=session_id,
            run_id=run_id,
            expected_checkpoint_version=version,
            writer=writer,
            update=pb.WorkingStateUpdate(**fields),
        )
    )


async def replica(pool: Any, overlay: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """A replica over `pool` whose registry is the packaged one overlaid by `overlay`, with
    no tiktoken rank files: every model is counted by the heuristic (as on a replica whose
    rank file is missing). -> (stub, channel, running server); the caller closes the
    channel and stops the server."""
    from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
    from context_engine.api.server import build_engine, build_server
    from context_engine.core.model_registry import ModelRegistry
    from context_engine.model_registry_loader import read_packaged_models
    from context_engine.models import ModelCatalog

    overlays = [overlay] if overlay is not None else []
    catalog = ModelCatalog(ModelRegistry.from_mappings(read_packaged_models(), *overlays))
    running = await build_server(build_engine(pool, catalog=catalog), "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    return pb_grpc.ContextEngineStub(channel), channel, running


async def replica_with_model(pool: Any, model_id: str, **facts: Any) -> tuple[Any, Any, Any]:
    """A replica (`replica`) whose registry overlay adds the Anthropic model `model_id`
    (a 200,000-token window, four cache markers) with `facts` changed, e.g.
    `context_window=8_500` or `max_cache_breakpoints=2`."""
    model = {
        "provider": "anthropic",
        "family": "claude-sonnet-4",
        "context_window": 200_000,
        "max_cache_breakpoints": 4,
        "default_output_reserve": 8192,
        "min_cacheable_tokens": 1024,
        "tokenizer": "heuristic",
    }
    return await replica(pool, {"models": {model_id: {**model, **facts}}})


# --- a PostgreSQL that stops answering (lifecycle tests) -------------------------------


class HangingLink:
    """A loopback TCP relay to the test server that can stop relaying, as a network
    partition or a hung PostgreSQL does: connections stay open and bytes go unanswered.
    The test server itself is shared and never touched. `dsn(database)` reaches
    `database` through the relay; `hang()` stops every byte both ways for good and holds
    new connections unanswered; `closed_by_client` counts connections whose client end
    was closed."""

    def __init__(self) -> None:
        import asyncio

        self._flowing = asyncio.Event()
        self._flowing.set()
        self._tasks: set[Any] = set()
        self._server: Any = None
        self.closed_by_client = 0

    async def __aenter__(self) -> HangingLink:
        import asyncio

        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: Any) -> None:
        import asyncio

        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def dsn(self, database: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(base_dsn())
        login = parts.netloc.rpartition("@")[0]
        port = self._server.sockets[0].getsockname()[1]
        return f"{parts.scheme}://{login}@127.0.0.1:{port}/{database}"

    def hang(self) -> None:
        self._flowing.clear()

    async def _relay(self, reader: Any, writer: Any) -> None:
        import asyncio
        from urllib.parse import urlsplit

        task = asyncio.current_task()
        self._tasks.add(task)
        upstream_writer = None
        try:
            await self._flowing.wait()
            target = urlsplit(base_dsn())
            upstream_reader, upstream_writer = await asyncio.open_connection(
                target.hostname, target.port or 5432
            )
            to_server = asyncio.ensure_future(self._pump(reader, upstream_writer))
            to_client = asyncio.ensure_future(self._pump(upstream_reader, writer))
            done, pending = await asyncio.wait(
                {to_server, to_client}, return_when=asyncio.FIRST_COMPLETED
            )
            if to_server in done:  # the client's end reached EOF: it closed the connection
                self.closed_by_client += 1
            for other in pending:
                other.cancel()
        finally:
            for end in (writer, upstream_writer):
                if end is not None:
                    end.close()
            self._tasks.discard(task)

    async def _pump(self, reader: Any, writer: Any) -> None:
        # Reading goes on while hung, so an end's close is still seen; what is read then
        # is dropped (a hung link never flows again).
        while data := await reader.read(65536):
            if self._flowing.is_set():
                writer.write(data)
                await writer.drain()
