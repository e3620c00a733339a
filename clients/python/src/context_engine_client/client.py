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

import asyncio
import contextlib
import hashlib
import ipaddress
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
import grpc.experimental
import rfc8785
from google.protobuf.timestamp_pb2 import Timestamp

from ._gen.context_engine.v1 import context_engine_pb2 as pb
from ._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from .errors import (
    ClientError,
    ContextEngineError,
    DeadlineExceeded,
    NeedsCompaction,
    ToolLoopLimit,
    from_rpc_error,
)
from .items import (
    MAX_ID_CHARS,
    ModelTurn,
    ToolCallRequest,
    ToolOutput,
    Usage,
    _item_id_problem,
    _reasoning_problem,
    arguments_problem,
    tool_result,
)

__all__ = [
    "BuildResult",
    "ContextEngineClient",
    "Run",
    "Session",
    "Summary",
    "ToolLoopResult",
    "UnreportedUsage",
    "UsageReport",
    "channel_options",
    "is_loopback",
]

SERVICE = "context_engine.v1.ContextEngine"
# Transparent retries of UNAVAILABLE only, for every method but Build: the wrapper's keyed
# writes carry an idempotency key (Rule 2); a raw `call` of a keyed write must set one
# itself. A Build whose answer was lost may have been recorded, and a resend records
# another request, which no usage is reported for (Run.build says so, and the tool loops
# do not build again after UNAVAILABLE): Build's own entry, which a method's name makes
# the one that applies, has no retry policy (grpc still resends a call that never left
# the client). DEADLINE_EXCEEDED is not retried: the caller's deadline is spent.
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
            },
            {"name": [{"service": SERVICE, "method": "Build"}]},
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


def _result_item(call: ToolCallRequest, output: ToolOutput | str) -> pb.ConversationItem:
    """The logged result of `call`, from what run_tool returned for it."""
    out = ToolOutput(output) if isinstance(output, str) else output
    return tool_result(
        call.call_id,
        call.name,
        out.content,
        trust=out.trust,
        source=out.source,
        is_error=out.is_error,
        artifact_ref=out.artifact_ref,
        context_content=out.context_content,
    )


def _run_call_ids(built: BuildResult, run_id: str) -> set[str]:
    """The call ids the run has used that its build shows (the engine refuses a call id
    used before in the run; one a compaction took out of the request is not seen here)."""
    return {
        block.tool_call.call_id if kind == "tool_call" else block.tool_result.call_id
        for message in built.request.messages
        for block in message.blocks
        if (kind := block.WhichOneof("kind")) in ("tool_call", "tool_result")
        and block.run_id == run_id
    }


def _unloggable(turn: ModelTurn, used: set[str]) -> str:
    """Why the engine would refuse to log the model's turn whatever its tools return
    (AppendItems' INVALID_FIELD), or "": a call whose call_id is empty, longer than
    MAX_ID_CHARS, repeated in the turn or already used in the run (`used`), or that names
    no tool; a reasoning item the engine cannot replay. The results of a turn with one
    could never be logged: its tools are not run."""
    ids: set[str] = set()
    for n, call in enumerate(turn.tool_calls):
        at = f"tool call {n} ({call.name!r})"
        shown = call.call_id if len(call.call_id) <= 40 else call.call_id[:40] + "…"
        if not call.call_id:
            return f"{at} has no call_id"
        if len(call.call_id) > MAX_ID_CHARS:
            return f"{at} has a call_id longer than {MAX_ID_CHARS} characters"
        if call.call_id in ids:
            return f"{at} has the call_id {shown!r} of another call of the turn"
        if call.call_id in used:
            return f"{at} has the call_id {shown!r} of an earlier call of the run"
        if not call.name:
            return f"tool call {n} names no tool"
        ids.add(call.call_id)
    for n, (provider, opaque) in enumerate(turn.reasoning):
        problem = _reasoning_problem(provider, opaque)
        if problem:
            return f"reasoning item {n} {problem}"
    return ""


def _without_bad_item_ids(turn: ModelTurn) -> ModelTurn:
    """`turn` without the provider item ids the engine would refuse (over MAX_ID_CHARS,
    whitespace, a control character), the text's and each call's. They only pair a
    replayed reasoning item with the item after it, and the engine logs an item without
    one (it then replays no reasoning before it); sent, the step's append was refused after
    its tools had run (an audit). The model cannot correct them (the provider makes them)."""
    calls = [
        replace(c, provider_item_id="") if _item_id_problem(c.provider_item_id) else c
        for c in turn.tool_calls
    ]
    text_item_id = "" if _item_id_problem(turn.text_item_id) else turn.text_item_id
    return replace(turn, tool_calls=calls, text_item_id=text_item_id)


_UNKNOWN_TASK = re.compile(r"items\[(\d+)\]\.tool_call\.task_id")


def _unknown_task(error: ContextEngineError, request: pb.AppendItemsRequest) -> int | None:
    """The index of the item whose task_id the engine refused (a task the run's working
    state does not hold), or None for any other error."""
    found = _UNKNOWN_TASK.fullmatch(error.field or "")
    if error.reason != "INVALID_FIELD" or found is None:
        return None
    index = int(found.group(1))
    if index >= len(request.items) or not request.items[index].tool_call.task_id:
        return None
    return index


def _carry(error: BaseException, **attributes: Any) -> None:
    """Set what a tool loop error carries on `error` (not on one that takes no attributes);
    a `pending_request` of None is not set."""
    for name, value in attributes.items():
        if name == "pending_request" and value is None:
            continue
        with contextlib.suppress(AttributeError):
            setattr(error, name, value)


def _not_applied(error: ContextEngineError) -> str:
    """A refused control call's result for the model: the reason, the field at fault where
    the message does not say it (which entry of a list: an audit found "no such constraint"
    with no hint which of four), and the message. The TypeScript client writes the same."""
    where = f" at {error.field}" if error.field and error.field not in error.message else ""
    return f"Not applied ({error.reason}{where}): {error.message}"


def _moved_on(error: ContextEngineError, request: pb.AppendItemsRequest | None) -> bool:
    """A CHECKPOINT_VERSION_CONFLICT naming a later version than `request` expected."""
    latest = error.metadata.get("latest_version", "")
    return (
        request is not None
        and error.reason == "CHECKPOINT_VERSION_CONFLICT"
        and latest.isdigit()
        and int(latest) > request.expected_checkpoint_version
    )


def _timestamp(value: datetime) -> Timestamp:
    """A datetime as a Timestamp; a naive one is this host's local time, as Python reads
    it (`datetime.now()`), not UTC: protobuf's FromDatetime would read it as UTC, and the
    date and time the model is shown would be off by the host's offset (an audit)."""
    if value.tzinfo is None:
        value = value.astimezone()
    stamp = Timestamp()
    stamp.FromDatetime(value)
    return stamp


_RETRY_BUFFER_BYTES = 16 * 1024 * 1024

# What an HTTP/2 header value (gRPC metadata) may hold.
_HEADER_VALUE = re.compile(r"[\x20-\x7e]+")


def is_loopback(target: str) -> bool:
    """Whether a gRPC target names this host: a loopback address (an IPv4-mapped one
    too, ::ffff:127.0.0.1), localhost, or a Unix socket; for an ipv4:/ipv6: list, every
    address. A name is not (it may resolve elsewhere). The TypeScript and Go clients apply
    the same rule, and so does the engine's `context-engine explain`
    (tests/e2e/test_python_client.py holds the client and explain to one table)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            return all(_one_loopback(a) for a in target.removeprefix(scheme).split(","))
    for scheme in ("dns:///", "dns:"):
        target = target.removeprefix(scheme)
    return _one_loopback(target)


def _one_loopback(target: str) -> bool:
    host = target.rpartition(":")[0] if target.count(":") == 1 else target
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    # ipaddress finds ::ffff:127.0.0.1 loopback from Python 3.13 only (gh-117566); Node's
    # BlockList and Go's net.IP always did, and the client's rule was the odd one out.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _insecure(credentials: grpc.ChannelCredentials) -> bool:
    """Whether `credentials` are grpc.experimental.insecure_channel_credentials(): grpc.aio
    opens a plaintext channel with them, which sent a token in clear to any target (an
    audit). grpc's own secure_channel tells them apart by the same object."""
    insecure = grpc.experimental.insecure_channel_credentials()
    # Not a composite of them with call credentials: grpc sends no call on such a channel
    # (UNAUTHENTICATED, "does not have a sufficient security level"), the token neither.
    return getattr(credentials, "_credentials", None) is insecure._credentials


# A tool loop step's append, resent by the loop itself while the engine cannot be reached:
# the channel's own retries cover UNAVAILABLE only, never DEADLINE_EXCEEDED. Attempts, not
# resends: the first send and 2 resends. A resend after DEADLINE_EXCEEDED gets twice the
# deadline the attempt before it had (docs/api.md: retry with a longer deadline).
_APPEND_ATTEMPTS = 3
# Refusals of a Build that recorded nothing: the tool loop builds once more (_build_step).
_BUILD_AGAIN = frozenset({"SESSION_BUSY", "EPOCH_CONFLICT", "SHUTTING_DOWN"})
# The engine's control tools (ListControlTools), whose calls tool_loop relays itself.
CONTROL_TOOL_NAMES = frozenset({"context.update_working_state"})
# Refusals of a control call's arguments the model can act on: relayed to it as the call's
# error result (apply_control_call), not raised.
_MODEL_CORRECTS = frozenset({"INVALID_FIELD", "CONSTRAINT_PROTECTED", "WORKING_STATE_CAP"})
_STATE_MOVED = (
    "Not applied: the run moved on while you decided (another write landed first). The"
    " next request shows the run as it is now; call again if the update still applies."
)
_APPEND_BACKOFF_S = 0.2


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
        # A Build for a long-window model can exceed gRPC's 4 MiB receive default, and the
        # server does not cap what it sends (a write's answer can outgrow its request:
        # docs/operations.md, Request size), so accept any size.
        ("grpc.max_receive_message_length", -1),
    ]


class ContextEngineClient:
    """A connection to the engine, acting for one tenant.

    Args:
        target: "host:port" of the engine (a sidecar listens on 127.0.0.1:50051).
        tenant_id: sent on every request; with authentication on it must match the
            authenticated identity, or be "" (with `token` or `credentials`) for the server
            to take the identity's.
        token: bearer token, sent as `authorization: Bearer <token>` metadata. Over a
            plaintext channel (no `credentials`, or
            `grpc.experimental.insecure_channel_credentials()`) only to a loopback target
            (a sidecar), as `context-engine explain` allows, unless `allow_insecure_token`.
        credentials: TLS (or mTLS) channel credentials; None for a plaintext channel.
        timeout: per-call deadline in seconds (None: no deadline); every method takes a
            `timeout=` of its own for one call (None or 0 there: this one).
        channel: an existing grpc.aio channel to use instead of opening one. Its options
            are the caller's: open it with `channel_options()` for the client's retry policy
            (UNAVAILABLE retried) and receive limit, which a channel given here otherwise
            lacks. Whether it is TLS is yours to know: a token is not checked against it.
        options: channel options for the channel the client opens, over the client's own
            (`channel_options()`) where they name the same option.
        allow_insecure_token: send `token` in clear to a target that is not loopback (a
            network you trust, or a mesh that encrypts it).

    The channel the client opens is opened on the event loop of its first call (or of
    `async with`), so a client may be made outside the loop that uses it.

    Raises:
        ValueError: `channel` together with `options` or `credentials`, which configure
            only a channel the client opens: given, they would be silently ignored; a
            `channel` that is not a grpc.aio one; an empty `tenant_id` without credentials;
            a token that is no header value (a line ending, say), or one that would cross
            the network in clear.
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
        allow_insecure_token: bool = False,
    ) -> None:
        if not tenant_id and not (token or credentials is not None or channel is not None):
            # Without credentials the server has no identity to take the tenant from.
            raise ValueError("tenant_id is required without token or credentials")
        if channel is not None and (options or credentials is not None):
            raise ValueError(
                "options= and credentials= apply only to a channel the client opens: open "
                "yours with them (and channel_options()) instead"
            )
        if channel is not None and not isinstance(channel, grpc.aio.Channel):
            # A sync channel's calls block the event loop and raise grpc's own errors.
            raise ValueError("channel= must be a grpc.aio channel")
        if token is not None and not _HEADER_VALUE.fullmatch(token):
            # Refused here: grpc raised its own batch error at the first call (Rule 3).
            raise ValueError("token is not a header value (printable ASCII, no line ending)")
        plaintext = (credentials is None or _insecure(credentials)) and channel is None
        if token and plaintext and not allow_insecure_token and not is_loopback(target):
            raise ValueError(
                f"token= would cross the network in clear to {target}: give credentials="
                " (TLS), use a loopback target, or pass allow_insecure_token=True"
            )
        if timeout is not None and not timeout >= 0:
            raise ValueError("timeout must be None or 0 (no deadline), or more")
        self.tenant_id = tenant_id
        # 0 is no deadline, as the TypeScript client's timeoutMs 0 (a review: sent to grpc,
        # it was a deadline already past, and every call failed DEADLINE_EXCEEDED).
        self.timeout = timeout or None
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        # The caller's options win: grpc takes an option's first value, and the client's
        # came first (an audit: a caller's receive limit and retry switch were ignored).
        merged = dict(channel_options())
        merged.update(options)
        self._open: Callable[[], grpc.aio.Channel] = lambda: (
            grpc.aio.secure_channel(target, credentials, options=list(merged.items()))
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=list(merged.items()))
        )
        self._owns_channel = channel is None
        self._channel = channel
        self._stub: Any = None
        self._closed = False

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel, opened on first use: a grpc.aio channel belongs to the event loop
        it was opened on, and one opened where the client was made, outside `asyncio.run`,
        failed its first call there ("attached to a different loop")."""
        if self._channel is None:
            if self._closed:  # not opened again behind the caller's back (Rule 3)
                raise ClientError("the client is closed")
            self._channel = self._open()
        return self._channel

    @property
    def stub(self) -> Any:
        if self._stub is None:
            self._stub = pb_grpc.ContextEngineStub(self.channel)  # type: ignore[no-untyped-call]
        return self._stub

    @stub.setter
    def stub(self, value: Any) -> None:
        self._stub = value

    async def __aenter__(self) -> ContextEngineClient:
        self.channel  # noqa: B018  # opened on this loop
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        if self._owns_channel and self._channel is not None:
            await self._channel.close()

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """Call any RPC by name with this client's metadata, deadline and typed errors.
        `timeout`: this call's deadline in seconds (None or 0: the client's)."""
        if timeout is not None and not timeout >= 0:
            # grpc took a negative deadline as one already past: DEADLINE_EXCEEDED for a
            # call never sent, which the tool loop resent as if the engine were slow.
            raise ValueError(f"{method}: timeout must be None or 0 (the client's), or more")
        rpc = getattr(self.stub, method)
        deadline = timeout or self.timeout
        try:
            return await rpc(request, timeout=deadline, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
            # The key a wrapper made for this write, for a resend that must reuse it.
            error.idempotency_key = getattr(request, "idempotency_key", "")
            raise error from exc
        except grpc.aio.UsageError as exc:  # a closed channel: ours too (Rule 3)
            raise ClientError(f"{method}: {exc}") from exc

    # --- sessions -------------------------------------------------------------------------

    async def open_session(
        self, spec: pb.PlanSpec, *, session_id: str | None = None, timeout: float | None = None
    ) -> Session:
        """Plan a session (epoch 1), or return an existing session's current plan.

        Raises:
            InvalidArgument: the spec is malformed (field_violations name the field).
            FailedPrecondition: the prefix does not fit (reason PREFIX_CLASS_OVER_CAP with
                metadata["class"], or PREFIX_OVER_CEILING).
        """
        sid = session_id or _key()
        try:
            response = await self.call(
                "Plan",
                pb.PlanRequest(tenant_id=self.tenant_id, session_id=sid, spec=spec),
                timeout=timeout,
            )
        except ContextEngineError as exc:
            # Plan is made safe to resend by its session id, not a key: a timed-out Plan may
            # have landed, and open_session(spec, session_id=exc.session_id) finds it
            # where a new id would open a second session.
            exc.session_id = sid
            raise
        return Session(
            self,
            sid,
            response.plan,
            response.created,
            response.spec_matches,
            response.unknown_tool_names,
        )

    async def session(
        self, session_id: str, *, epoch: int = 0, timeout: float | None = None
    ) -> Session:
        """Attach to an existing session. Its `plan` is the current plan, whatever `epoch`
        says: it is the next rotate's `from_epoch`, and an older epoch's made that rotate
        fail EPOCH_CONFLICT. With `epoch`, that epoch's plan is read too, as
        `requested_plan` (a second GetPlan)."""
        session = Session(self, session_id, pb.ContextPlan(), False, True)
        await session.refresh_plan(timeout=timeout)
        session.requested_plan = (
            await session.refresh_plan(epoch, timeout=timeout) if epoch else session.plan
        )
        return session

    async def report_usage(
        self,
        session_id: str,
        request_sequence: int,
        model_id: str,
        usage: Usage,
        *,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> UsageReport:
        """Report a model response's actual usage for the request Build recorded.
        `model_id` is the model that answered (the provider response's `model`)."""
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
            timeout=timeout,
        )
        return UsageReport(
            factor_ppm=response.factor_ppm,
            samples=response.samples,
            signed_error_ppm=response.signed_error_ppm,
            cached_prefix_ppm=response.cached_prefix_ppm,
            absorbed=response.absorbed,
            reuse_ppm=response.reuse_ppm if response.HasField("reuse_ppm") else None,
        )

    async def get_build(
        self, session_id: str, request_sequence: int, *, timeout: float | None = None
    ) -> BuildResult:
        """Rebuild a recorded request byte for byte (GetBuild), by its request_sequence."""
        response = await self.call(
            "GetBuild",
            pb.GetBuildRequest(
                tenant_id=self.tenant_id,
                session_id=session_id,
                request_sequence=request_sequence,
            ),
            timeout=timeout,
        )
        return BuildResult(response)

    async def erase_subject(
        self, person_id: str, *, timeout: float | None = None
    ) -> pb.EraseSubjectResponse:
        """Erase a person's memories from every snapshot and recorded request of the tenant.
        Safe to resend: the answer is everything erasing them has done, as first reported."""
        response: pb.EraseSubjectResponse = await self.call(
            "EraseSubject",
            pb.EraseSubjectRequest(tenant_id=self.tenant_id, person_id=person_id),
            timeout=timeout,
        )
        return response

    async def control_tools(self, *, timeout: float | None = None) -> list[pb.ToolSpec]:
        """The engine's control tools (context.update_working_state) for a PlanSpec."""
        response = await self.call(
            "ListControlTools", pb.ListControlToolsRequest(), timeout=timeout
        )
        return list(response.tools)


@dataclass(frozen=True, slots=True)
class UsageReport:
    """ReportUsage's answer; ppm values are parts per million."""

    factor_ppm: int
    samples: int
    signed_error_ppm: int
    cached_prefix_ppm: int
    # Whether the report moved the factor: not another model's, nor one another tokenizer
    # counted, nor one with a zero count.
    absorbed: bool = False
    # Cache reads over the preceding request's full input (history reuse); None when
    # unmeasured: no preceding request, or it was not reported first.
    reuse_ppm: int | None = None


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
        canonically (RFC 8785, as the engine serialized it): what precedes the first
        insertion keeps its bytes, so a prompt cache keeps its prefix. The payload unchanged when
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
        # RFC 8785, as the engine wrote the payload: json.dumps writes some numbers
        # otherwise (1e-05 for 0.00001), which changed the cached tool definitions' bytes
        # whenever a request carried attachments (an audit).
        return bytes(rfc8785.dumps(body))

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

    def offers(self, name: str) -> bool:
        """Whether the request defines the tool `name` (not the wire name) for the model."""
        return any(t.name == name for t in self.request.tools)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # Pickled as the response's bytes: the generated message classes' __module__
        # names no importable module, so pickling the message itself fails.
        return _build_result, (self.response.SerializeToString(),)


def _build_result(response: bytes) -> BuildResult:
    return BuildResult(pb.BuildResponse.FromString(response))


@dataclass(frozen=True, slots=True)
class Summary:
    """A compaction summary written by the worker's model call.

    `tokens` is the summary's token count; when unknown, Run.compact estimates it
    conservatively (one token per three UTF-8 bytes, rounded up).
    """

    text: str
    tokens: int = 0


class UnreportedUsage(tuple[BuildResult, Usage, BaseException]):
    """A usage report that failed: (build, usage, error), and `model`, the model that
    answered ("" for the planned one). The error is the engine's (a ContextEngineError:
    `.retryable` says whether a resend can succeed) or the report's own (a Usage the
    request cannot carry: a resend fails again). A tuple still, so `for build, usage,
    error in result.unreported` reads it as before; resend it with
    `session.report_usage(build, usage, model=entry.model)`, the model included: the
    report's key is the build's, and the same key with another model is refused
    (IDEMPOTENCY_KEY_REUSED) if the first attempt landed."""

    model: str

    def __new__(
        cls, build: BuildResult, usage: Usage, error: BaseException, model: str = ""
    ) -> UnreportedUsage:
        entry = super().__new__(cls, (build, usage, error))
        entry.model = model
        return entry

    def __getnewargs__(self) -> tuple[BuildResult, Usage, BaseException, str]:
        # copy and pickle call __new__ with these: a tuple's own (its items as one tuple)
        # left this __new__ without usage and error (TypeError).
        return (*self, self.model)


@dataclass(frozen=True, slots=True)
class ToolLoopResult:
    """How a tool loop ended: the final model turn, every build and usage report, and
    the reports that failed (`unreported`: each step's build, usage and the error, with
    the model that answered; the error's `.retryable` says whether a resend can succeed;
    an error that is not a ContextEngineError, a Usage the request cannot carry, will
    fail again). Resend one
    with `session.report_usage(build, usage, model=entry.model)`: its key is the build's,
    so a report that landed with only its answer lost is not counted twice."""

    final: ModelTurn
    builds: list[BuildResult] = field(default_factory=list)
    reports: list[UsageReport] = field(default_factory=list)
    unreported: list[UnreportedUsage] = field(default_factory=list)

    @property
    def prefix_hashes(self) -> set[str]:
        """Distinct prefix hashes seen; one per epoch when the cache holds."""
        return {b.prefix_sha256 for b in self.builds}


class Session:
    """A planned session. `plan` is the session's current plan as the last call that
    returned one found it (the `from_epoch` of the next rotate); a child run's rotated
    plan, its parent's lineage continued, is not taken as it, nor is an older epoch's plan
    read with `refresh_plan(epoch)`. `requested_plan` is the plan of the epoch
    `client.session(id, epoch=N)` asked for (the plan first read otherwise)."""

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
        self.requested_plan = plan
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
        timeout: float | None = None,
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
        return self._run(await self.client.call("StartRun", request, timeout=timeout))

    async def start_child_run(
        self,
        parent_run_id: str,
        instruction: str,
        *,
        run_id: str = "",
        idempotency_key: str | None = None,
        timeout: float | None = None,
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
        return self._run(await self.client.call("StartRun", request, timeout=timeout))

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

    async def refresh_plan(self, epoch: int = 0, *, timeout: float | None = None) -> pb.ContextPlan:
        """Re-read the current plan, which becomes `plan`; or read a given epoch's, which
        leaves `plan` as it is."""
        response: pb.GetPlanResponse = await self.client.call(
            "GetPlan",
            pb.GetPlanRequest(tenant_id=self.tenant_id, session_id=self.session_id, epoch=epoch),
            timeout=timeout,
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
        timeout: float | None = None,
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
        response = await self.client.call("Rotate", request, timeout=timeout)
        self.plan = response.plan
        if spec is not None:  # the server checks a spec sent; without one, the pinned spec's stand
            self.unknown_tool_names = tuple(response.unknown_tool_names)
        return self.plan

    async def offer_fact_candidates(
        self, *, idempotency_key: str | None = None, timeout: float | None = None
    ) -> pb.OfferFactCandidatesResponse:
        """Offer the session's trusted facts to memory formation (at the session's end)."""
        request = pb.OfferFactCandidatesRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            idempotency_key=idempotency_key or _key(),
        )
        response: pb.OfferFactCandidatesResponse = await self.client.call(
            "OfferFactCandidates", request, timeout=timeout
        )
        return response

    async def load_skill(
        self,
        name: str,
        body: str,
        *,
        trust: int = 0,
        run_id: str = "",
        timeout: float | None = None,
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
        response: pb.LoadSkillResponse = await self.client.call(
            "LoadSkill", request, timeout=timeout
        )
        return response

    async def report_usage(
        self,
        build: BuildResult,
        usage: Usage,
        *,
        model: str = "",
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> UsageReport:
        """Report the usage of the response to `build`'s request. `model`: the model that
        answered, the provider response's `model` (ModelTurn.model); "" for the one the
        request was built for. The engine records a report of another model but learns
        nothing from it, so naming the planned model for it would skew the estimator."""
        return await self.client.report_usage(
            self.session_id,
            build.request_sequence,
            model or build.request.model_id or self.plan.model_id,
            usage,
            idempotency_key=idempotency_key,
            timeout=timeout,
        )


class Run:
    """One turn. Tracks the latest checkpoint version it wrote (Rule 1) and the epoch its
    latest build was made against (`epoch`: StartRun's, then each Build's)."""

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
        timeout: float | None = None,
    ) -> pb.AppendItemsResponse:
        """Append items (or lists of items) in order; returns their sequences and ids.

        Raises:
            Aborted: another writer moved the checkpoint (CHECKPOINT_VERSION_CONFLICT), or
                the session stayed busy with another write (SESSION_BUSY, `.retryable`:
                nothing was written; resend `err.idempotency_key`'s request unchanged).
            InvalidArgument: e.g. ORPHANED_TOOL_ITEM, with the item's field path.
        """
        flat: list[pb.ConversationItem] = []
        for entry in items:
            flat += [entry] if isinstance(entry, pb.ConversationItem) else list(entry)
        return await self.resend_append(
            self._append_request(flat, idempotency_key), timeout=timeout
        )

    def _append_request(
        self, items: Sequence[pb.ConversationItem], idempotency_key: str | None
    ) -> pb.AppendItemsRequest:
        return pb.AppendItemsRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            run_id=self.run_id,
            expected_checkpoint_version=self.checkpoint_version,
            idempotency_key=idempotency_key or _key(),
            items=list(items),
        )

    async def _build_step(
        self, clock: datetime | None, step: pb.StepContext | None, timeout: float | None
    ) -> BuildResult:
        """A tool loop's Build of the run's latest checkpoint, built again once after a
        refusal that recorded nothing (_BUILD_AGAIN): ABORTED EPOCH_CONFLICT (an erasure
        invalidated the plan meanwhile: docs/api.md says build again), SESSION_BUSY, or
        UNAVAILABLE SHUTTING_DOWN (a draining replica refused it before its handler ran;
        the channel does not resend a Build). Each ended the loop though nothing was lost
        (an audit; the Go example builds again). Not after any other UNAVAILABLE or
        DEADLINE_EXCEEDED: that Build may have been
        recorded, and another would leave it a request no usage is reported for, first of
        its epoch in the record while the one sent is not (a review)."""
        try:
            return await self.build(clock, step, checkpoint_version=0, timeout=timeout)
        except ContextEngineError as exc:
            if exc.reason not in _BUILD_AGAIN:
                raise
            await asyncio.sleep(_APPEND_BACKOFF_S)
        return await self.build(clock, step, checkpoint_version=0, timeout=timeout)

    async def resend_append(
        self, request: pb.AppendItemsRequest, *, timeout: float | None = None
    ) -> pb.AppendItemsResponse:
        """Send an AppendItemsRequest as it is, such as a tool loop error's
        `pending_request`: its key makes a resend of an append that landed answer with the
        first result instead of writing it twice. Tracks the new checkpoint version."""
        response: pb.AppendItemsResponse = await self.client.call(
            "AppendItems", request, timeout=timeout
        )
        # A resend of an append that landed long ago answers with its first (older)
        # version: never move back past what this run has seen since.
        self.checkpoint_version = max(self.checkpoint_version, response.checkpoint_version)
        return response

    async def _append_step(
        self, items: Sequence[pb.ConversationItem], *, final: bool, timeout: float | None
    ) -> None:
        """A tool loop step's one append, sent up to `_APPEND_ATTEMPTS` times as it is
        (same key, same bytes) while it fails for want of the engine (or finds the session
        busy: SESSION_BUSY, nothing written), with twice the
        deadline after a DeadlineExceeded: the step's tools have run, and losing their
        results would make the caller run them again. Whatever error ends it (retryable or
        not: an expired token, a proxy's INTERNAL, a cancellation), it carries the request
        (`pending_request`) for the caller to resend."""
        request = self._append_request(items, None)
        try:
            await self._send_step(request, timeout or self.client.timeout, rebase=not final)
        except BaseException as exc:
            # Any exception, not only ours: a cancelled task's CancelledError too.
            with contextlib.suppress(AttributeError):
                exc.pending_request = request  # type: ignore[attr-defined]
            raise

    async def _send_step(
        self, request: pb.AppendItemsRequest, deadline: float | None, *, rebase: bool
    ) -> None:
        """`rebase`: a step whose tools ran goes after a write that landed first; a final
        answer does not (the tool loop asks the model again)."""
        rebased = not rebase
        attempt = 0
        while True:
            try:
                await self.resend_append(request, timeout=deadline)
                return
            except ContextEngineError as exc:
                task = _unknown_task(exc, request)
                if task is not None:
                    # A call's task_id names no task of the run's working state (which no
                    # RPC reads, and a control call of the step may change): refused, the
                    # step's results were lost after its tools ran (an audit). Nothing was
                    # written; the call is logged without it, under the same key, and no
                    # task moves (none could). Not an attempt: each call's goes once.
                    request.items[task].tool_call.task_id = ""
                    continue
                attempt += 1
                if not rebased and _moved_on(exc, request) and attempt < _APPEND_ATTEMPTS:
                    rebased = True
                    # Another write landed first (the user's next message, say): the step
                    # goes after it, under the same key. Raised, its tools' results were
                    # lost to a request that could never be resent as it was (an audit).
                    request.expected_checkpoint_version = int(exc.metadata["latest_version"])
                    continue
                # Refused for what it says (a resend fails again), or the last attempt.
                if not exc.retryable or attempt == _APPEND_ATTEMPTS:
                    raise
                if isinstance(exc, DeadlineExceeded) and deadline:
                    deadline *= 2  # it may have been too short for this append
            await asyncio.sleep(_APPEND_BACKOFF_S * 2 ** (attempt - 1))

    async def build(
        self,
        now: datetime | None = None,
        step: pb.StepContext | None = None,
        *,
        checkpoint_version: int | None = None,
        timeout: float | None = None,
    ) -> BuildResult:
        """Assemble the next model request from this run's latest known checkpoint.

        `now` is the clock row 14 renders (the server's clock when None); `step` carries
        in-turn recall, corrections and knowledge passages. `epoch` becomes the build's:
        a rotation reaches a run at its next build.
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
        built = BuildResult(await self.client.call("Build", request, timeout=timeout))
        self.epoch = built.epoch or self.epoch
        return built

    async def report_usage(
        self,
        build: BuildResult,
        usage: Usage,
        *,
        model: str = "",
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> UsageReport:
        """Session.report_usage: `model` is the model that answered ("" for the planned)."""
        return await self.session.report_usage(
            build, usage, model=model, idempotency_key=idempotency_key, timeout=timeout
        )

    async def update_working_state(
        self,
        update: pb.WorkingStateUpdate,
        *,
        writer: int = pb.WRITER_MODEL,
        idempotency_key: str | None = None,
        timeout: float | None = None,
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
            "UpdateWorkingState", request, timeout=timeout
        )
        # A resend under the same key replays its first answer: never move back past a
        # version this run has seen since (as resend_append).
        self.checkpoint_version = max(self.checkpoint_version, response.checkpoint_version)
        return response

    async def apply_control_call(
        self, call: ToolCallRequest, *, timeout: float | None = None
    ) -> ToolOutput:
        """The model's context.update_working_state call, relayed as it came
        (UpdateWorkingState's `tool_arguments_json`, as the model's write) under a key of
        the run and call id, so a resend replays its first answer. -> the call's result
        for the model: that the state changed (the next request shows it), or, where the
        engine refuses the arguments (INVALID_FIELD, CONSTRAINT_PROTECTED,
        WORKING_STATE_CAP), the refusal as an error result the model can act on. Either is
        logged as untrusted content, in an envelope: it is no source a fact can rest on as
        trusted, and a refusal quotes the model's own words (a review: labelled trusted, the
        engine's reply was cited to make a claim Established). Refused because another
        write landed first (CHECKPOINT_VERSION_CONFLICT), it is not sent again after that
        write, which the model decided without: the result says so, and the step's append
        goes after that write as usual. Any other error raises. `tool_loop` calls it for a
        control tool's call where the build defines the tool."""
        key = "control-" + hashlib.sha256(f"{self.run_id}\0{call.call_id}".encode()).hexdigest()
        request = pb.UpdateWorkingStateRequest(
            tenant_id=self.tenant_id,
            session_id=self.session_id,
            run_id=self.run_id,
            expected_checkpoint_version=self.checkpoint_version,
            writer=pb.WRITER_MODEL,
            tool_arguments_json=call.arguments_json(),
            idempotency_key=key[:64],
        )
        source = f"engine:{call.name}"
        try:
            response: pb.UpdateWorkingStateResponse = await self.client.call(
                "UpdateWorkingState", request, timeout=timeout
            )
        except ContextEngineError as exc:
            if exc.reason == "CHECKPOINT_VERSION_CONFLICT":
                # Another write landed first (the user's next message, say): the model
                # decided without it, so it is told, not overruled by a resend (a review).
                return ToolOutput(_STATE_MOVED, is_error=True, source=source)
            if exc.reason not in _MODEL_CORRECTS:
                raise
            return ToolOutput(_not_applied(exc), is_error=True, source=source)
        self.checkpoint_version = max(self.checkpoint_version, response.checkpoint_version)
        return ToolOutput("Working state updated; the next request shows it.", source=source)

    async def compact(
        self,
        summarize: Summarize,
        *,
        compactor_version: str = "context-engine-client@0.1.0",
        idempotency_key: str | None = None,
        through_sequence: int = 0,
        timeout: float | None = None,
    ) -> int:
        """PrepareCompaction -> the worker's summarizer -> CommitCompaction.

        `through_sequence`: the last event to compact (0: the engine chooses the cut).
        `timeout`: each of the two calls' deadline.

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
            timeout=timeout,
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
            timeout=timeout,
        )
        self.checkpoint_version = max(self.checkpoint_version, response.checkpoint_version)
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
        timeout: float | None = None,
    ) -> ToolLoopResult:
        """Build -> model -> tools -> append, until the model answers without tool calls.

        Each step: build from the run's latest checkpoint (compacting first when the body
        does not fit and `summarize` is given), call the model with the build, map its tool
        calls' wire names back to tool names, run the requested tools in order (the engine's
        control tools, CONTROL_TOOL_NAMES, through apply_control_call: `run_tool` never
        sees them), append the
        model's items and the tool results in one write (so the log never holds a call
        without its result), then report the model's usage, under the model that answered
        (`ModelTurn.model`). `now` may be a datetime or a clock; `timeout` is each RPC's
        deadline.

        The append is sent up to 3 times (the first send and 2 resends) as it is (same key,
        same bytes) while it fails Unavailable or DeadlineExceeded, each resend after a
        DeadlineExceeded with twice the deadline the attempt before it had: a resend of one
        that landed answers with its first result. Any error that ends the append (one
        still failing after the resends, or one never resent: Unauthenticated, Internal, a
        cancellation...) is raised with the request as `pending_request`, the model's turn
        as `turn` and whether it was the final answer as `final`: resend it
        (`resend_append`, once the cause is gone). Then, for a step with tool calls, call
        tool_loop again; for the final answer (`final`), stop: `turn` is the answer, and
        another tool_loop would ask the model again and append a second one. The loop
        builds from the latest checkpoint, not the one this object last saw, so once the
        step's append is in the log (landed with its answer lost, or resent), calling
        tool_loop again shows the model the results it has and runs none of that step's
        tools again. A tool that raises ends the loop before the append: the step's tools
        that ran are then not logged.

        Before any tool of a step runs, the model's turn is checked for what the engine
        would refuse to log whatever the tools return. A call whose arguments it cannot log
        (`arguments_problem`) is logged with {} and answered with an error result the model
        can correct, not run. A provider item id it refuses (the text's `text_item_id` or a
        call's `provider_item_id` over 200 characters, or holding whitespace or a control
        character) is logged as none: it only pairs replayed reasoning, and the model
        cannot correct it. A turn that cannot be logged at all raises ClientError, with no
        tool run and the turn as `turn` (its usage reported): a call whose `call_id` is
        empty, over 200 characters, repeated in the turn, or used by an earlier call of the
        run the build shows, or that names no tool, or a reasoning item the engine cannot
        replay. Give each call an id unique within the run (rewrite the provider's in
        `call_model` if it repeats them across steps); calling tool_loop again asks the
        model again. A call's `task_id` the engine refuses (no task of the run's working
        state has it, which only the append can tell) is dropped and the step sent again
        under the same key: its results are logged, and no task moves.

        Usage is reported after the append, and a report that fails, for any reason, is
        kept in the result (`unreported`, with the error: its `retryable` says whether a
        resend can succeed) rather than raised: the step's items are in the log, and raising
        after the final answer was appended lost that answer to the caller, whose second
        tool_loop asked the model again and appended a second answer. A step that ends in an
        error (its append failed, a tool raised) still reports the model's usage, or keeps
        it in `unreported`: unsent, with the step's error, when the engine was unreachable
        or the step was cancelled. Any exception that ends the loop carries what it kept so
        far, `unreported` and `builds`, as attributes. Cancelled while it reports a step's
        usage, the loop keeps that usage unsent in `unreported` (with the cancellation) and
        the cancellation carries the step's `turn` and `final`, and, after a failed append,
        its `pending_request`.

        An append refused CHECKPOINT_VERSION_CONFLICT because another write landed first
        (the user's next message appended to the run, say) is resent once under the same
        key at the version the error names: the step goes after that write, and its tools'
        results are not lost. A final answer is not: it answered a log that has moved on,
        and appended after that write it left the write (the user's next message) without
        an answer. Nothing of it is written; its usage is reported, and the loop builds and
        asks the model again (a step of `max_steps`).

        Raises:
            NeedsCompaction: the body does not fit, and no `summarize` was given or the
                run was compacted twice already in this call (the engine caps summary
                depth at 2; escalate to a child run).
            ToolLoopLimit: `max_steps` model turns without a final answer.
            ClientError: the model's turn cannot be logged (above); no tool ran, `turn`
                holds it.
            ContextEngineError: the step's append failed; `pending_request` holds it, as
                above (any other exception from the append carries it too).
        """
        builds: list[BuildResult] = []
        reports: list[UsageReport] = []
        unreported: list[UnreportedUsage] = []
        try:
            return await self._loop(
                call_model,
                run_tool,
                now=now,
                step=step,
                summarize=summarize,
                max_steps=max_steps,
                report_usage=report_usage,
                timeout=timeout,
                kept=(builds, reports, unreported),
            )
        except BaseException as exc:
            # What the loop kept, for the caller to resend (reports) or inspect: raised
            # without it, a failed report of an earlier step was lost (an audit).
            with contextlib.suppress(AttributeError):
                exc.unreported = unreported  # type: ignore[attr-defined]
                exc.builds = builds  # type: ignore[attr-defined]
            raise

    async def _loop(
        self,
        call_model: CallModel,
        run_tool: RunTool,
        *,
        now: Clock,
        step: pb.StepContext | None,
        summarize: Summarize | None,
        max_steps: int,
        report_usage: bool,
        timeout: float | None,
        kept: tuple[list[BuildResult], list[UsageReport], list[UnreportedUsage]],
    ) -> ToolLoopResult:
        builds, reports, unreported = kept
        compactions = 0
        steps = 0
        while steps < max_steps:
            clock = now() if callable(now) else now
            built = await self._build_step(clock, step, timeout)
            self.checkpoint_version = built.response.checkpoint_version or self.checkpoint_version
            if built.needs_compaction:
                # The server caps summary depth at 2; a third attempt would fail there.
                if summarize is None or compactions >= 2:
                    raise NeedsCompaction(built)
                await self.compact(summarize, timeout=timeout)
                compactions += 1
                continue
            builds.append(built)
            steps += 1
            turn = await call_model(built)
            # Tool calls arrive under the provider's wire names; log and run the real ones.
            calls = [replace(c, name=built.tool_name(c.name)) for c in turn.tool_calls]
            # Arguments the engine cannot log (cut off, not an object, a 64-bit integer)
            # would fail the step's append after its tools ran, and a retry would run them
            # again (a review): such a call is logged with none and answered, not run.
            problems = [arguments_problem(c.arguments) for c in calls]
            calls = [
                replace(c, arguments={}) if p else c for c, p in zip(calls, problems, strict=True)
            ]
            turn = _without_bad_item_ids(replace(turn, tool_calls=calls))
            final = not turn.tool_calls
            try:
                # A turn the engine would refuse to log whatever its tools return (a call id
                # it cannot take, a reasoning item it cannot replay) ran its tools, then
                # failed its append for good: the results were lost, and the next tool_loop
                # ran the tools again (an audit). Nothing runs; the error carries the turn.
                unloggable = _unloggable(turn, _run_call_ids(built, self.run_id))
                if unloggable:
                    raise ClientError(
                        f"the model's turn cannot be logged: {unloggable}; no tool was run"
                    )
                items = turn.items()
                for call, problem in zip(turn.tool_calls, problems, strict=True):
                    output: ToolOutput | str
                    # The engine's own tools are the engine's to run (apply_control_call),
                    # where the build offered them: a call of a tool the model was not
                    # given is its run_tool's to refuse (a review: an injected objective
                    # was applied).
                    if problem:
                        output = ToolOutput(
                            f"Not run: the call's arguments {problem}; call it again with a"
                            " JSON object.",
                            is_error=True,
                        )
                    elif call.name in CONTROL_TOOL_NAMES and built.offers(call.name):
                        output = await self.apply_control_call(call, timeout=timeout)
                    else:
                        output = await run_tool(call)
                    items.append(_result_item(call, output))
                if items:
                    await self._append_step(items, final=final, timeout=timeout)
            except BaseException as exc:
                pending = getattr(exc, "pending_request", None)
                if final and isinstance(exc, ContextEngineError) and _moved_on(exc, pending):
                    # The answer was to a log another write has since moved on (the user's
                    # next message, say): appended after it, that message went unanswered
                    # (an audit). Nothing of the step is written; the model is asked again.
                    await self._report(built, turn, None, report_usage, timeout, kept)
                    continue
                # The model's tokens were spent, whatever ended the step (a tool raising,
                # a cancellation): its usage is reported, or kept (an audit: it was lost).
                try:
                    await self._report(built, turn, exc, report_usage, timeout, kept)
                except BaseException as cancelled:
                    # Cancelled while reporting (the usage is kept unsent): the cancellation
                    # ends the loop, and carries what the step's error did (an audit: the
                    # failed append's request was lost with it).
                    _carry(cancelled, pending_request=pending, turn=turn, final=final)
                    raise
                _carry(exc, turn=turn, final=final)
                raise
            try:
                await self._report(built, turn, None, report_usage, timeout, kept)
            except BaseException as cancelled:
                # Cancelled while reporting a step that landed: the usage is kept unsent,
                # and the cancellation carries the step's turn (a final answer in the log).
                _carry(cancelled, turn=turn, final=final)
                raise
            if final:
                return ToolLoopResult(turn, builds, reports, unreported)
        raise ToolLoopLimit(max_steps)

    async def _report(
        self,
        built: BuildResult,
        turn: ModelTurn,
        failed: BaseException | None,
        report_usage: bool,
        timeout: float | None,
        kept: tuple[list[BuildResult], list[UsageReport], list[UnreportedUsage]],
    ) -> None:
        """Report the step's usage; a report that fails is kept, never raised: the step
        may be in the log, and raising after the final answer was appended lost that
        answer (an audit: a refused report did so; a review: so did a Usage protobuf
        cannot carry). After a step that `failed` with the engine unreachable, or was
        cancelled, it is kept unsent, with that error. Cancelled while it reports, it is
        kept unsent with the cancellation, which is raised (an audit: the usage was lost)."""
        _, reports, unreported = kept
        if not report_usage or turn.usage is None:
            return
        if isinstance(failed, asyncio.CancelledError | KeyboardInterrupt) or (
            isinstance(failed, ContextEngineError) and failed.retryable
        ):
            unreported.append(UnreportedUsage(built, turn.usage, failed, turn.model))
            return
        try:
            reports.append(
                await self.report_usage(built, turn.usage, model=turn.model, timeout=timeout)
            )
        except BaseException as exc:
            unreported.append(UnreportedUsage(built, turn.usage, exc, turn.model))
            if not isinstance(exc, Exception):  # a cancellation goes on, its usage kept
                raise
