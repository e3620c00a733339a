"""The typed async wrapper: a client per tenant, a Session per session, a Run per turn.

    async with ContextEngineClient("127.0.0.1:50051", tenant_id="acme") as engine:
        session = await engine.open_session(spec)
        run = await session.start_run("Trains to Lyon tomorrow?")
        result = await run.tool_loop(call_model, run_tool)

Rules the wrapper keeps so a worker does not have to:

Rule 1: a Run tracks its latest checkpoint version from every write it makes, and sends it
        as expected_checkpoint_version; a lost race surfaces as `Aborted`.
Rule 2: every write that is not idempotent by nature carries an idempotency key (Rotate
        and OfferFactCandidates included), so the channel's retry policy (UNAVAILABLE
        only) may resend it safely: a resend of a write that landed replays its answer.
Rule 3: every failed RPC raises a typed `ContextEngineError` with the ErrorInfo reason and
        field violations decoded (errors.py); no grpc exception leaks out.
Rule 4: Build is pure on the server: building the same checkpoint twice returns the same
        bytes, so a worker may rebuild instead of caching requests.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from types import TracebackType
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from ._gen.context_engine.v1 import context_engine_pb2 as pb
from ._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from .errors import ContextEngineError, NeedsCompaction, ToolLoopLimit, from_rpc_error
from .items import ModelTurn, ToolCallRequest, ToolOutput, Usage, tool_result

__all__ = [
    "BuildResult",
    "ContextEngineClient",
    "Run",
    "Session",
    "Summary",
    "ToolLoopResult",
    "UsageReport",
    "channel_options",
]

SERVICE = "context_engine.v1.ContextEngine"
# Transparent retries of UNAVAILABLE only, for every method: the wrapper's keyed writes
# carry an idempotency key (Rule 2); a raw `call` of a keyed write must set one itself.
# DEADLINE_EXCEEDED is not retried: the caller's deadline is spent.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SERVICE}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

# Providers accept tool names of [A-Za-z0-9_-] only: the engine sends "web.fetch" as
# "web-fetch" (every other character becomes "-", cut to 64), and a worker maps the names a
# model answers with back through the request's own tool names (BuildResult.tool_name).
_NOT_WIRE = re.compile(r"[^A-Za-z0-9_-]")
MAX_WIRE_NAME = 64


def wire_tool_name(name: str) -> str:
    """The name a provider sees for tool `name`."""
    return _NOT_WIRE.sub("-", name)[:MAX_WIRE_NAME] or "-"


Clock = datetime | Callable[[], datetime] | None
CallModel = Callable[["BuildResult"], Awaitable[ModelTurn]]
RunTool = Callable[[ToolCallRequest], Awaitable["ToolOutput | str"]]
Summarize = Callable[[pb.PrepareCompactionResponse], Awaitable["Summary | str"]]


def _key() -> str:
    return str(uuid.uuid4())


def _timestamp(value: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(value)
    return stamp


_RETRY_BUFFER_BYTES = 16 * 1024 * 1024


def channel_options() -> list[tuple[str, Any]]:
    """The options the client opens its channel with: transparent retries of UNAVAILABLE
    (keyed writes are safe to resend) and no receive limit. For a channel of your own."""
    return [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _SERVICE_CONFIG),
        # gRPC resends a call only while its request fits the retry buffer (256 KiB per
        # call by default): a 300 kB tool result's AppendItems was never retried. Room for
        # the server's largest default request (4 MiB) and then some.
        ("grpc.per_rpc_retry_buffer_size", _RETRY_BUFFER_BYTES),
        # A Build for a long-window model can exceed gRPC's 4 MiB receive default; the
        # server bounds what it sends (twice its max_request_bytes), so accept that.
        ("grpc.max_receive_message_length", -1),
    ]


class ContextEngineClient:
    """A connection to the engine, acting for one tenant.

    Args:
        target: "host:port" of the engine (a sidecar listens on 127.0.0.1:50051).
        tenant_id: sent on every request; with authentication on it must match (or the
            server takes it from) the authenticated identity.
        token: bearer token, sent as `authorization: Bearer <token>` metadata.
        credentials: TLS (or mTLS) channel credentials; None for a plaintext channel.
        timeout: per-call deadline in seconds.
        channel: an existing grpc.aio channel to use instead of opening one. Its options
            are the caller's: open it with `channel_options()` for the client's retry policy
            (UNAVAILABLE retried) and receive limit, which a channel given here otherwise
            lacks.
    """

    def __init__(
        self,
        target: str,
        tenant_id: str,
        token: str | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = 30.0,
        channel: grpc.aio.Channel | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if not tenant_id:
            raise ValueError("tenant_id is required")
        self.tenant_id = tenant_id
        self.timeout = timeout
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        opts = [*channel_options(), *options]
        self._owns_channel = channel is None
        if channel is not None:
            self.channel = channel
        elif credentials is not None:
            self.channel = grpc.aio.secure_channel(target, credentials, options=opts)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=opts)
        self.stub = pb_grpc.ContextEngineStub(self.channel)  # type: ignore[no-untyped-call]

    async def __aenter__(self) -> ContextEngineClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_channel:
            await self.channel.close()

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """Call any RPC by name with this client's metadata, deadline and typed errors."""
        rpc = getattr(self.stub, method)
        try:
            return await rpc(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
            # The key a wrapper made for this write, for a resend that must reuse it.
            error.idempotency_key = getattr(request, "idempotency_key", "")
            raise error from exc

    # --- sessions -------------------------------------------------------------------------

    async def open_session(self, spec: pb.PlanSpec, *, session_id: str | None = None) -> Session:
        """Plan a session (epoch 1), or return an existing session's current plan.

        Raises:
            InvalidArgument: the spec is malformed (field_violations name the field).
            FailedPrecondition: the prefix does not fit (reason PREFIX_CLASS_OVER_CAP with
                metadata["class"], or PREFIX_OVER_CEILING).
        """
        sid = session_id or _key()
        response = await self.call(
            "Plan", pb.PlanRequest(tenant_id=self.tenant_id, session_id=sid, spec=spec)
        )
        return Session(
            self,
            sid,
            response.plan,
            response.created,
            response.spec_matches,
            response.unknown_tool_names,
        )

    async def session(self, session_id: str, *, epoch: int = 0) -> Session:
        """Attach to an existing session (reads its current plan, or a given epoch)."""
        response = await self.call(
            "GetPlan",
            pb.GetPlanRequest(tenant_id=self.tenant_id, session_id=session_id, epoch=epoch),
        )
        return Session(self, session_id, response.plan, False, True)

    async def report_usage(
        self,
        session_id: str,
        request_sequence: int,
        model_id: str,
        usage: Usage,
        *,
        idempotency_key: str | None = None,
    ) -> UsageReport:
        """Report a model response's actual usage for the request Build recorded."""
        response = await self.call(
            "ReportUsage",
            pb.ReportUsageRequest(
                tenant_id=self.tenant_id,
                session_id=session_id,
                request_sequence=request_sequence,
                model_id=model_id,
                input_tokens=usage.input_tokens,
                cache_read_input_tokens=usage.cache_read_input_tokens,
                cache_creation_input_tokens=usage.cache_creation_input_tokens,
                output_tokens=usage.output_tokens,
                idempotency_key=idempotency_key or f"usage:{session_id}:{request_sequence}",
            ),
        )
        return UsageReport(
            factor_ppm=response.factor_ppm,
            samples=response.samples,
            signed_error_ppm=response.signed_error_ppm,
            cached_prefix_ppm=response.cached_prefix_ppm,
            absorbed=response.absorbed,
        )

    async def get_build(self, session_id: str, request_sequence: int) -> BuildResult:
        """Rebuild a recorded request byte for byte (GetBuild), by its request_sequence."""
        response = await self.call(
            "GetBuild",
            pb.GetBuildRequest(
                tenant_id=self.tenant_id,
                session_id=session_id,
                request_sequence=request_sequence,
            ),
        )
        return BuildResult(response)

    async def erase_subject(self, person_id: str) -> pb.EraseSubjectResponse:
        """Erase a person's memories from every snapshot and recorded request of the tenant.
        Safe to resend: the answer is everything erasing them has done, as first reported."""
        response: pb.EraseSubjectResponse = await self.call(
            "EraseSubject", pb.EraseSubjectRequest(tenant_id=self.tenant_id, person_id=person_id)
        )
        return response

    async def control_tools(self) -> list[pb.ToolSpec]:
        """The engine's control tools (context.update_working_state) for a PlanSpec."""
        response = await self.call("ListControlTools", pb.ListControlToolsRequest())
        return list(response.tools)


@dataclass(frozen=True, slots=True)
class UsageReport:
    """ReportUsage's answer; ppm values are parts per million."""

    factor_ppm: int
    samples: int
    signed_error_ppm: int
    cached_prefix_ppm: int
    absorbed: bool = False  # whether the report moved the factor (another model's: no)


_PATH_STEP = re.compile(r"(\w+)\[(\d+)\]")


def _content_list(body: Any, path: str) -> tuple[list[Any], int]:
    """The list a payload path such as "messages[2].content[1]" ends in, and the index."""
    steps = [(name, int(index)) for name, index in _PATH_STEP.findall(path)]
    if not steps:
        raise ValueError(f"not a payload path: {path!r}")
    for name, index in steps[:-1]:
        body = body[name][index]
    name, index = steps[-1]
    return body[name], index


@dataclass(frozen=True, slots=True)
class BuildResult:
    """One Build: the request to send and how it was made."""

    response: pb.BuildResponse

    @property
    def provider_payload(self) -> bytes:
        """JSON bytes ready to POST to the provider named by `provider_api`; a user
        message's attachments are not in them: add them as `attachment_placements` says
        (docs/api.md)."""
        return self.response.provider_payload

    @property
    def attachment_placements(self) -> Sequence[pb.AttachmentPlacement]:
        """Per user message with attachments, in payload order: the JSON path of the part
        holding its text (insert its attachment parts just before it, last placement
        first) and, per attachment, whether to send its content or its marker. Empty when
        no message of the request has any. `payload_with_attachments` applies them."""
        return list(self.response.attachment_placements)

    def payload_with_attachments(
        self, part: Callable[[pb.AttachmentSend], Sequence[dict[str, Any]] | dict[str, Any]]
    ) -> bytes:
        """`provider_payload` with every message's attachments added where
        `attachment_placements` says. `part(send)` is the provider's content part (or
        parts) for one attachment: its content when `send.content`, its marker otherwise;
        you resolve `send.attachment.ref`. The payload is parsed, the parts inserted
        before the part each placement names, last placement first, and it is serialized
        with sorted keys and no whitespace: the same response and parts give the same bytes
        on every request, so a prompt cache keeps its prefix. The payload unchanged when
        no message has attachments."""
        placements = self.response.attachment_placements
        if not placements:
            return self.response.provider_payload
        body = json.loads(self.response.provider_payload)
        for placement in reversed(placements):
            parts: list[dict[str, Any]] = []
            for send in placement.attachments:
                made = part(send)
                parts += [made] if isinstance(made, dict) else list(made)
            holder, index = _content_list(body, placement.payload_path)
            holder[index:index] = parts
        text = json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return text.encode("utf-8")

    @property
    def provider_api(self) -> str:
        """ "anthropic.messages" or "openai.responses"."""
        return self.response.provider_api

    @property
    def prefix_sha256(self) -> str:
        return self.response.prefix_sha256

    @property
    def request_sha256(self) -> str:
        return self.response.request_sha256

    @property
    def needs_compaction(self) -> bool:
        """True when no request was built: compact, then build again."""
        return self.response.needs_compaction

    @property
    def request_sequence(self) -> int:
        """The model.request.started event; pass it to ReportUsage."""
        return self.response.request_sequence

    @property
    def checkpoint_version(self) -> int:
        return self.response.checkpoint_version

    @property
    def epoch(self) -> int:
        return self.response.epoch

    @property
    def request(self) -> pb.ModelRequest:
        """The provider-neutral request (blocks tagged with row and trust)."""
        return self.response.request

    @property
    def pressure(self) -> pb.PressureReport | None:
        return self.response.pressure if self.response.HasField("pressure") else None

    def payload(self) -> Any:
        """provider_payload decoded from JSON."""
        return json.loads(self.provider_payload)

    def tool_name(self, wire_name: str) -> str:
        """The tool name behind a name the model used ("web-fetch" -> "web.fetch"); a name
        that is already a tool's, or no tool's, comes back unchanged."""
        table: dict[str, str] = {wire_tool_name(t.name): t.name for t in self.request.tools}
        return table.get(wire_name, wire_name)


@dataclass(frozen=True, slots=True)
class Summary:
    """A compaction summary written by the worker's model call.

    `tokens` is the summary's token count; when unknown, Run.compact estimates it
    conservatively (one token per three UTF-8 bytes, rounded up).
    """

    text: str
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class ToolLoopResult:
    """How a tool loop ended: the final model turn, every build and usage report, and
    the reports that could not reach the engine (`unreported`: each step's build, usage
    and Unavailable or DeadlineExceeded error). Resend one with
    `session.report_usage(build, usage)`: its key is the build's, so a report that landed
    with only its answer lost is not counted twice."""

    final: ModelTurn
    builds: list[BuildResult] = field(default_factory=list)
    reports: list[UsageReport] = field(default_factory=list)
    unreported: list[tuple[BuildResult, Usage, ContextEngineError]] = field(default_factory=list)

    @property
    def prefix_hashes(self) -> set[str]:
        """Distinct prefix hashes seen; one per epoch when the cache holds."""
        return {b.prefix_sha256 for b in self.builds}


class Session:
    """A planned session. `plan` is the session's current plan as the last call that
    returned one found it (the `from_epoch` of the next rotate); a child run's rotated
    plan, its parent's lineage continued, is not taken as it."""

    def __init__(
        self,
        client: ContextEngineClient,
        session_id: str,
        plan: pb.ContextPlan,
        created: bool,
        spec_matches: bool,
        unknown_tool_names: Sequence[str] = (),
    ) -> None:
        self.client = client
        self.session_id = session_id
        self.plan = plan
        self.created = created
        self.spec_matches = spec_matches
        # Names the spec's agent enables or defers that no tool of it defines (typos).
        self.unknown_tool_names = tuple(unknown_tool_names)

    @property
    def tenant_id(self) -> str:
        return self.client.tenant_id

    async def start_run(
        self,
        text: str,
        *,
        run_id: str = "",
        attachments: Iterable[pb.Attachment] = (),
        admission: pb.RunAdmission | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """Start a top-level run (one turn) seeded by the user's message."""
        request = pb.StartRunRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            run_id=run_id,
            idempotency_key=idempotency_key or _key(),
            user_message=pb.UserMessage(text=text, attachments=list(attachments)),
            admission=admission,
        )
        return self._run(await self.client.call("StartRun", request))

    async def start_child_run(
        self,
        parent_run_id: str,
        instruction: str,
        *,
        run_id: str = "",
        idempotency_key: str | None = None,
    ) -> Run:
        """Start a child run seeded by its parent's instruction over an empty history. The
        instruction is the parent agent's words, not the user's: Build sends it in the user
        role at MODEL trust, inside a <delegated> envelope. `run_id`: the child's id (the
        server makes one when empty)."""
        request = pb.StartRunRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            run_id=run_id,
            idempotency_key=idempotency_key or _key(),
            child=pb.ChildSeed(parent_run_id=parent_run_id, instruction=instruction),
        )
        return self._run(await self.client.call("StartRun", request))

    def run(self, run_id: str, checkpoint_version: int) -> Run:
        """Attach to an existing run at a known checkpoint version (no RPC)."""
        return Run(self, run_id, checkpoint_version, epoch=self.plan.epoch)

    def _run(self, response: pb.StartRunResponse) -> Run:
        # A top-level run's rotated_plan is the session's current plan; a child's is its
        # parent's lineage continued, which need not be (docs/api.md, StartRun). A resend
        # replays the first answer, whose plan may since have been rotated past: never
        # step back to an older epoch.
        rotated = response.rotated_plan
        if (
            response.HasField("rotated_plan")
            and not response.run.parent_run_id
            and rotated.epoch > self.plan.epoch
        ):
            self.plan = rotated
        return Run(
            self,
            response.run.run_id,
            response.checkpoint_version,
            epoch=response.run.epoch,
            seed_event_sequence=(
                response.run.seed_event_sequence
                if response.run.HasField("seed_event_sequence")
                else None
            ),
        )

    async def refresh_plan(self, epoch: int = 0) -> pb.ContextPlan:
        """Re-read the current plan (or a given epoch)."""
        response: pb.GetPlanResponse = await self.client.call(
            "GetPlan",
            pb.GetPlanRequest(tenant_id=self.tenant_id, session_id=self.session_id, epoch=epoch),
        )
        if epoch == 0:
            self.plan = response.plan
        return response.plan

    async def rotate(
        self,
        reason: int,
        *,
        spec: pb.PlanSpec | None = None,
        detail: str = "",
        idempotency_key: str | None = None,
    ) -> pb.ContextPlan:
        """Start a new prefix epoch from the current one. A lost race raises Aborted.

        The key makes a resend of a rotation that landed answer with its plan instead of
        EPOCH_CONFLICT (the channel's own retries reuse it). To retry by hand after
        Unavailable or DeadlineExceeded, call again with the first attempt's key and the
        same reason, spec and detail: a failed rotate leaves `plan` as it was.
        """
        request = pb.RotateRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            from_epoch=self.plan.epoch,
            reason=reason,  # type: ignore[arg-type]
            spec=spec,
            detail=detail,
            idempotency_key=idempotency_key or _key(),
        )
        response = await self.client.call("Rotate", request)
        self.plan = response.plan
        if spec is not None:  # the server checks a spec sent; without one, the pinned spec's stand
            self.unknown_tool_names = tuple(response.unknown_tool_names)
        return self.plan

    async def offer_fact_candidates(
        self, *, idempotency_key: str | None = None
    ) -> pb.OfferFactCandidatesResponse:
        """Offer the session's trusted facts to memory formation (at the session's end)."""
        request = pb.OfferFactCandidatesRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            idempotency_key=idempotency_key or _key(),
        )
        response: pb.OfferFactCandidatesResponse = await self.client.call(
            "OfferFactCandidates", request
        )
        return response

    async def load_skill(
        self, name: str, body: str, *, trust: int = 0, run_id: str = ""
    ) -> pb.LoadSkillResponse:
        """Load a pinned skill's body into Region B (sticky; at most two). `trust`: the
        body's trust level (0, unspecified: the catalog entry's)."""
        request = pb.LoadSkillRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            name=name,
            body=body,
            trust=trust,  # type: ignore[arg-type]
            run_id=run_id,
        )
        response: pb.LoadSkillResponse = await self.client.call("LoadSkill", request)
        return response

    async def report_usage(
        self, build: BuildResult, usage: Usage, *, idempotency_key: str | None = None
    ) -> UsageReport:
        """Report the usage of the response to `build`'s request."""
        return await self.client.report_usage(
            self.session_id,
            build.request_sequence,
            build.request.model_id or self.plan.model_id,
            usage,
            idempotency_key=idempotency_key,
        )


class Run:
    """One turn. Tracks the latest checkpoint version it wrote (Rule 1)."""

    def __init__(
        self,
        session: Session,
        run_id: str,
        checkpoint_version: int,
        *,
        epoch: int,
        seed_event_sequence: int | None = None,
    ) -> None:
        self.session = session
        self.run_id = run_id
        self.checkpoint_version = checkpoint_version
        self.epoch = epoch
        self.seed_event_sequence = seed_event_sequence

    @property
    def tenant_id(self) -> str:
        return self.session.tenant_id

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def client(self) -> ContextEngineClient:
        return self.session.client

    async def append(
        self,
        *items: pb.ConversationItem | Iterable[pb.ConversationItem],
        idempotency_key: str | None = None,
    ) -> pb.AppendItemsResponse:
        """Append items (or lists of items) in order; returns their sequences and ids.

        Raises:
            Aborted: another writer moved the checkpoint (CHECKPOINT_VERSION_CONFLICT).
            InvalidArgument: e.g. ORPHANED_TOOL_ITEM, with the item's field path.
        """
        flat: list[pb.ConversationItem] = []
        for entry in items:
            flat += [entry] if isinstance(entry, pb.ConversationItem) else list(entry)
        request = pb.AppendItemsRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            run_id=self.run_id,
            expected_checkpoint_version=self.checkpoint_version,
            idempotency_key=idempotency_key or _key(),
            items=flat,
        )
        response: pb.AppendItemsResponse = await self.client.call("AppendItems", request)
        self.checkpoint_version = response.checkpoint_version
        return response

    async def build(
        self,
        now: datetime | None = None,
        step: pb.StepContext | None = None,
        *,
        checkpoint_version: int | None = None,
    ) -> BuildResult:
        """Assemble the next model request from this run's latest known checkpoint.

        `now` is the clock row 14 renders (the server's clock when None); `step` carries
        in-turn recall, corrections and knowledge passages.
        """
        version = self.checkpoint_version if checkpoint_version is None else checkpoint_version
        request = pb.BuildRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            run_id=self.run_id,
            checkpoint_version=version,
            now=_timestamp(now) if now is not None else None,
            step=step,
        )
        return BuildResult(await self.client.call("Build", request))

    async def report_usage(
        self, build: BuildResult, usage: Usage, *, idempotency_key: str | None = None
    ) -> UsageReport:
        return await self.session.report_usage(build, usage, idempotency_key=idempotency_key)

    async def update_working_state(
        self,
        update: pb.WorkingStateUpdate,
        *,
        writer: int = pb.WRITER_MODEL,
        idempotency_key: str | None = None,
    ) -> pb.UpdateWorkingStateResponse:
        """Apply a typed working-state transition (the control tool's effect)."""
        request = pb.UpdateWorkingStateRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            run_id=self.run_id,
            expected_checkpoint_version=self.checkpoint_version,
            writer=writer,  # type: ignore[arg-type]
            update=update,
            idempotency_key=idempotency_key or _key(),
        )
        response: pb.UpdateWorkingStateResponse = await self.client.call(
            "UpdateWorkingState", request
        )
        self.checkpoint_version = response.checkpoint_version
        return response

    async def compact(
        self,
        summarize: Summarize,
        *,
        compactor_version: str = "context-engine-client@0.1.0",
        idempotency_key: str | None = None,
        through_sequence: int = 0,
    ) -> int:
        """PrepareCompaction -> the worker's summarizer -> CommitCompaction.

        `through_sequence`: the last event to compact (0: the engine chooses the cut).

        `summarize` gets the prepared input (trusted content only, untrusted spans already
        elided to pointers) and returns the summary, which must count fewer tokens than
        what it replaces (`prepared.tokens_before`; else InvalidArgument INVALID_FIELD
        naming `result.summary`). Returns the new checkpoint version.

        `idempotency_key` is CommitCompaction's. When the commit fails Unavailable or
        DeadlineExceeded it may still have landed: retry with the first attempt's key and
        a `summarize` that returns the same summary, from a Run at the version the first
        attempt compacted (this one: a failed commit leaves `checkpoint_version` as it
        was). A commit that landed then answers with its version.
        """
        prepared: pb.PrepareCompactionResponse = await self.client.call(
            "PrepareCompaction",
            pb.PrepareCompactionRequest(
                tenant_id=self.tenant_id,
                session_id=self.session_id,
                run_id=self.run_id,
                checkpoint_version=self.checkpoint_version,
                through_sequence=through_sequence,
            ),
        )
        written = await summarize(prepared)
        summary = written if isinstance(written, Summary) else Summary(written)
        tokens = summary.tokens or math.ceil(len(summary.text.encode("utf-8")) / 3)
        result = pb.CompactionResult(
            summary=summary.text,
            source_event_ids=list(prepared.source_event_ids),
            elided=list(prepared.elided),
            replaced_through_sequence=prepared.replaced_through_sequence,
            depth=prepared.depth,
            tokens_before=prepared.tokens_before,
            tokens_after=tokens,
            compactor_version=compactor_version,
            prompt_version=prepared.prompt_version,
        )
        response: pb.CommitCompactionResponse = await self.client.call(
            "CommitCompaction",
            pb.CommitCompactionRequest(
                tenant_id=self.tenant_id,
                session_id=self.session_id,
                run_id=self.run_id,
                expected_checkpoint_version=prepared.checkpoint_version,
                result=result,
                idempotency_key=idempotency_key or _key(),
            ),
        )
        self.checkpoint_version = response.checkpoint_version
        return self.checkpoint_version

    async def tool_loop(
        self,
        call_model: CallModel,
        run_tool: RunTool,
        *,
        now: Clock = None,
        step: pb.StepContext | None = None,
        summarize: Summarize | None = None,
        max_steps: int = 16,
        report_usage: bool = True,
    ) -> ToolLoopResult:
        """Build -> model -> tools -> append, until the model answers without tool calls.

        Each step: build from the run's latest checkpoint (compacting first when the body
        does not fit and `summarize` is given), call the model with the build, map its tool
        calls' wire names back to tool names, run the requested tools in order, append the
        model's items and the tool results in one write (so the log never holds a call
        without its result), then report the model's usage. `now` may be a datetime or a
        clock.

        Building from the latest checkpoint, not the one this object last saw: after an
        append whose answer was lost (a deadline passed while it committed), calling
        tool_loop again builds what the log holds, so the model sees the results it
        already has instead of asking for its tools again. Usage is reported after the
        append, and a report that fails for want of the engine (Unavailable,
        DeadlineExceeded) is kept in the result (`unreported`) rather than raised: the
        step's items are in the log, and raising after the final answer was appended lost
        that answer to the caller, whose second tool_loop asked the model again and appended
        a second answer. A report refused for what it says (InvalidArgument for a bad
        Usage, say) is raised: it would fail again.

        Raises:
            NeedsCompaction: the body does not fit and no `summarize` was given.
            ToolLoopLimit: `max_steps` model turns without a final answer.
        """
        builds: list[BuildResult] = []
        reports: list[UsageReport] = []
        unreported: list[tuple[BuildResult, Usage, ContextEngineError]] = []
        compactions = 0
        steps = 0
        while steps < max_steps:
            clock = now() if callable(now) else now
            built = await self.build(clock, step, checkpoint_version=0)
            self.checkpoint_version = built.response.checkpoint_version or self.checkpoint_version
            if built.needs_compaction:
                # The server caps summary depth at 2; a third attempt would fail there.
                if summarize is None or compactions >= 2:
                    raise NeedsCompaction(built)
                await self.compact(summarize)
                compactions += 1
                continue
            builds.append(built)
            steps += 1
            turn = await call_model(built)
            # Tool calls arrive under the provider's wire names; log and run the real ones.
            calls = [replace(c, name=built.tool_name(c.name)) for c in turn.tool_calls]
            turn = replace(turn, tool_calls=calls)
            items = turn.items()
            for call in turn.tool_calls:
                output = await run_tool(call)
                out = ToolOutput(output) if isinstance(output, str) else output
                items.append(
                    tool_result(
                        call.call_id,
                        call.name,
                        out.content,
                        trust=out.trust,
                        source=out.source,
                        is_error=out.is_error,
                        artifact_ref=out.artifact_ref,
                    )
                )
            if items:
                await self.append(items)
            if report_usage and turn.usage is not None:
                try:
                    reports.append(await self.report_usage(built, turn.usage))
                except ContextEngineError as exc:
                    if not exc.retryable:  # refused for what it says: it would fail again
                        raise
                    unreported.append((built, turn.usage, exc))
            if not turn.tool_calls:
                return ToolLoopResult(turn, builds, reports, unreported)
        raise ToolLoopLimit(max_steps)
