"""Server interceptors: observe every RPC, authenticate the caller, bound request size.

Rules:
1. Order, outermost first: the OpenTelemetry span -> `RpcObserver` (log line, metrics)
   -> the shutdown drain (api/drain.py) -> `SizeLimitInterceptor` -> `AuthInterceptor`
   -> the servicer (api/server.py). So a rejected call still has a span, a log line and a
   status code; during a shutdown every call is refused alike, before its credentials
   are looked at; and a request is measured as it arrived, before authentication fills
   in its tenant_id (docs/security.md).
2. With auth on, the tenant is the authenticated identity's. A request's tenant_id must
   be empty (it is then filled in) or equal; anything else is PERMISSION_DENIED. No
   credentials -> UNAUTHENTICATED. The health service needs no credentials: probes carry
   none, and it reveals nothing.
3. Secrets are compared in constant time: every configured token is compared (as a
   SHA-256 digest, so lengths match) on every call, whichever matches.
4. Deadlines: grpc.aio cancels a call's task when its deadline passes, and the
   cancellation reaches the awaited PostgreSQL query (asyncpg cancels it server-side);
   an open transaction rolls back, so a call that runs out of time writes nothing (save a
   Build whose shared record round trip was already sent: store/batches.py Rule 3). The
   observer reports such a call as DEADLINE_EXCEEDED, and so a call cancelled within a
   tolerance of its deadline: the client's copy of the deadline fires first (its cancel is
   what reaches the handler, with time still left on the server's copy); a call cancelled
   well before its deadline is CANCELLED (`_cancelled_code`).
5. Nothing here logs, raises or annotates with request content: only ids, hashes, sizes,
   codes and error reasons (telemetry.RPC_FIELDS).
6. One interceptor for all of them (`Layered`): each wraps a method's handler (`wrap`),
   and the layers' wrapping is done once per method, on its first call, not once per call
   (grpc awaits every interceptor of the chain on every call, and each would rebuild its
   wrapper and the method handler around it). Each class is an interceptor on its own too.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from .. import telemetry
from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..config import CERT_IDENTITY_TYPES
from ..telemetry import RPC_FIELDS, RpcState, Telemetry
from .errors import DETAILS_KEY, DOMAIN, error_info

__all__ = [
    "UNAUTHENTICATED_SERVICES",
    "AuthInterceptor",
    "BearerTokens",
    "ClientCertificates",
    "Layer",
    "Layered",
    "RpcObserver",
    "SizeLimitInterceptor",
    "abort_with",
    "wrap_unless",
]

UNAUTHENTICATED_SERVICES = frozenset({"grpc.health.v1.Health"})

Behavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _service_of(method: str) -> str:
    return method.lstrip("/").partition("/")[0]


def _wrap(
    handler: grpc.RpcMethodHandler | None,
    unary: Callable[[Behavior], Behavior],
    stream: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> grpc.RpcMethodHandler | None:
    """Wrap a handler's behavior: unary-unary methods with `unary`, streaming ones with
    `stream` (left as they are when it is None). The ContextEngine service is unary-unary
    throughout; the streams are health Watch and reflection."""
    if handler is None:
        return None
    builders = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, unary),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, stream),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, stream),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, stream),
    )
    for attr, build, wrap in builders:
        behavior = getattr(handler, attr)
        if behavior is not None:
            if wrap is None:
                return handler
            return build(
                wrap(behavior),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def wrap_unless(
    skip: frozenset[str],
    method: str,
    handler: grpc.RpcMethodHandler | None,
    unary: Callable[[Behavior], Behavior],
) -> grpc.RpcMethodHandler | None:
    """`handler`, its unary behavior wrapped with `unary` unless `method` belongs to a
    service in `skip`."""
    if _service_of(method) in skip:
        return handler
    return _wrap(handler, unary)


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class Layer(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """An interceptor that only wraps the handler it intercepts (rule 6): `wrap(method,
    handler)` says how; as an interceptor of its own it wraps on every call."""

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler | None
    ) -> grpc.RpcMethodHandler | None:
        raise NotImplementedError

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        return self.wrap(details.method, await continuation(details))


class Layered(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """`layers` (outermost first) as one interceptor: a method's handler is wrapped by
    every layer on its first call, and that wrapped handler serves every later call (the
    servicer's handlers are registered once, before the server starts)."""

    def __init__(self, layers: Iterable[Layer]) -> None:
        self._layers = tuple(layers)[::-1]  # the innermost wraps first
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = self._handlers.get(details.method)
        if handler is None:
            handler = await continuation(details)
            if handler is None:
                return None  # no such method: grpc answers UNIMPLEMENTED
            for layer in self._layers:
                handler = layer.wrap(details.method, handler)
            self._handlers[details.method] = handler
        return handler


async def abort_with(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    reason: str = "",
    metadata: Mapping[str, str] | None = None,
    field: str = "",
) -> None:
    """Abort with google.rpc details, like api/errors.py does for servicer errors: an
    ErrorInfo with `reason`, and a BadRequest naming `field` when one is at fault."""
    details = []
    if reason:
        holder = any_pb2.Any()
        holder.Pack(
            error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata or {})
        )
        details.append(holder)
    if field:
        holder = any_pb2.Any()
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        holder.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        details.append(holder)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=details)
    await context.abort(
        code, message, trailing_metadata=((DETAILS_KEY, status.SerializeToString()),)
    )


# --- observing -----------------------------------------------------------------------


@functools.cache
def _named(descriptor: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of `names` a message type has: looked up once per type, not per call."""
    return tuple(name for name in names if name in descriptor.fields_by_name)


_RPC_FIELD_NAMES = tuple(RPC_FIELDS)
_NESTED = ("run", "plan", "rotated_plan")


def _proto_fields(message: Any) -> dict[str, Any]:
    """The RPC_FIELDS a message carries, non-empty only."""
    return {
        name: value
        for name in _named(message.DESCRIPTOR, _RPC_FIELD_NAMES)
        if (value := getattr(message, name)) not in ("", 0)
    }


def _response_fields(response: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for nested in _named(response.DESCRIPTOR, _NESTED):
        if response.HasField(nested):
            out.update(_proto_fields(getattr(response, nested)))
    out.update(_proto_fields(response))
    return out


def _reason_name(value: int) -> str:
    return cast(str, pb.PlanReason.Name(value)).removeprefix("PLAN_REASON_").lower()


def _on_plan(request: pb.PlanRequest, response: pb.PlanResponse) -> None:
    if response.created:
        telemetry.record_session_opened(response.plan.model_id)


def _on_rotate(request: pb.RotateRequest, response: pb.RotateResponse) -> None:
    # Only for a servicer that does not record: the response cannot say whether it was an
    # idempotent replay. The service's handler always records (api/servicer.py Rotate).
    telemetry.record_rotation(_reason_name(response.plan.reason))


def _on_start_run(request: pb.StartRunRequest, response: pb.StartRunResponse) -> None:
    # Only for a servicer that does not record: the response cannot say whether it was an
    # idempotent replay, nor show an erasure's rotation before the run's own. The
    # service's handler always records (api/servicer.py StartRun).
    telemetry.record_run_started()
    if response.HasField("rotated_plan"):
        telemetry.record_rotation(_reason_name(response.rotated_plan.reason))


def _on_build(request: pb.BuildRequest, response: pb.BuildResponse) -> None:
    if response.estimated_input_tokens > 0 and "build" not in telemetry.recorded():
        telemetry.record_build(
            response.request.model_id,
            response.estimated_input_tokens,
            response.input_budget_tokens,
            [b.name for b in response.request.cache_breakpoints],
        )
    if response.HasField("pressure") and "pressure" not in telemetry.recorded():
        telemetry.record_pressure(
            response.pressure.fits, [step.step for step in response.pressure.steps]
        )


def _on_report_usage(request: Any, response: Any) -> None:
    # Only for a servicer that does not record usage itself: the response cannot say whether
    # the request was the first of its epoch, so every report feeds cached_ratio, nor whether
    # it was an idempotent replay. The service's own handler always records
    # (api/rpc_usage.py), with first_of_epoch, and records a replay as nothing.
    telemetry.record_usage(
        request.model_id,
        response.signed_error_ppm,
        response.cached_prefix_ppm,
        reuse_ppm=response.reuse_ppm if response.HasField("reuse_ppm") else None,
    )


def _on_commit_compaction(request: Any, response: Any) -> None:
    # Only for a servicer that does not record: the response cannot say whether it was an
    # idempotent replay. The service's handler always records (api/rpc_compaction.py).
    telemetry.record_compaction(request.result.depth)


# Method -> (the kind a handler may have recorded itself, what the successful response
# adds to the tracked metrics). A kind already recorded is not derived again (telemetry
# rule 4); "" means the function checks kinds itself.
_ON_RESPONSE: Mapping[str, tuple[str, Callable[[Any, Any], None]]] = {
    "Plan": ("session", _on_plan),
    "Rotate": ("rotation", _on_rotate),
    "StartRun": ("run", _on_start_run),
    "Build": ("", _on_build),
    "ReportUsage": ("usage", _on_report_usage),
    "CommitCompaction": ("compaction", _on_commit_compaction),
}


class RpcObserver(Layer):
    """Per unary RPC: make `telemetry` current, then record duration, request size, the
    tracked metrics its response implies, span fields and one log line."""

    def __init__(self, telemetry_: Telemetry, *, skip: Iterable[str] = UNAUTHENTICATED_SERVICES):
        self._telemetry = telemetry_
        self._skip = frozenset(skip)

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler | None
    ) -> grpc.RpcMethodHandler | None:
        name = method.rpartition("/")[2]
        return wrap_unless(
            self._skip, method, handler, lambda behavior: self._observe(name, behavior)
        )

    def _observe(self, method: str, behavior: Behavior) -> Behavior:
        tel = self._telemetry

        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            state = RpcState(method)
            token = telemetry.begin(tel, state)
            started = time.perf_counter()
            # As the caller sent it: auth fills an empty tenant_id in (an audit: the size
            # counted bytes the caller never sent).
            request_bytes = request.ByteSize() if hasattr(request, "ByteSize") else 0
            code, reason = grpc.StatusCode.OK, ""
            budget = context.time_remaining()  # the call's whole timeout; None: no deadline
            try:
                response = await behavior(request, context)
                if method in _ON_RESPONSE:
                    kind, on_response = _ON_RESPONSE[method]
                    if not kind or kind not in state.recorded:
                        on_response(request, response)
                if tel.traces or telemetry.logs_rpcs():  # where the fields are written
                    state.fields.update(_response_fields(response))
                return response
            except asyncio.CancelledError:
                code = _cancelled_code(budget, context.time_remaining())
                raise
            except Exception:
                code = context.code() or grpc.StatusCode.UNKNOWN
                reason, metadata = error_info(context.trailing_metadata())
                if reason == "BUDGET_EXCEEDED":
                    telemetry.record_budget_exceeded(metadata.get("class", ""))
                raise
            finally:
                if tel.traces or telemetry.logs_rpcs():
                    for name, value in _proto_fields(request).items():
                        state.fields.setdefault(name, value)
                if not tel.traces and telemetry.logs_rpcs():
                    # No server span (tracing off): the line names the caller's trace.
                    state.trace_id = telemetry.propagated_trace_id(context.invocation_metadata())
                if code is not grpc.StatusCode.OK:
                    _mark_span(code, reason)
                tel.finish_rpc(
                    state,
                    code=code.name,
                    duration_s=time.perf_counter() - started,
                    request_bytes=request_bytes,
                    reason=reason,
                )
                telemetry.end(token)

        return observed


# How much of its deadline a cancelled call may have left and still have run out of time
# (rule 4). The client's deadline fires first, and its cancel reaches the handler while the
# server's copy of the deadline, started later, still has time left: an audit found such
# calls counted CANCELLED (0.3-3.3 ms left on loopback) while the client saw
# DEADLINE_EXCEEDED. The server's copy runs late by the request headers' transit and
# queueing, less the cancel's transit (the fixed part: 50 ms, for a slow or lopsided
# network), plus grpc-timeout's rounding up: grpc core sends a timeout in a few significant
# digits (1-10 s in 10 ms steps, 10-100 s in 100 ms steps, then seconds, minutes...), under
# 1% of it (the proportional part). A call cancelled with more left was cancelled by hand.
_DEADLINE_SLACK_S = 0.05
_DEADLINE_SLACK_SHARE = 0.01


def _cancelled_code(budget: float | None, remaining: float | None) -> grpc.StatusCode:
    """A cancelled call's code, from its time remaining when it began (`budget`, None
    without a deadline) and when its cancellation reached the observer."""
    if budget is None or remaining is None:
        return grpc.StatusCode.CANCELLED
    slack = _DEADLINE_SLACK_S + _DEADLINE_SLACK_SHARE * budget
    return grpc.StatusCode.DEADLINE_EXCEEDED if remaining <= slack else grpc.StatusCode.CANCELLED


def _mark_span(code: grpc.StatusCode, reason: str) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    current = trace.get_current_span()
    if current.is_recording():
        current.set_attribute("rpc.grpc.status_code", code.value[0])
        current.set_status(Status(StatusCode.ERROR, reason or code.name))


# --- authentication ------------------------------------------------------------------


class BearerTokens:
    """`authorization: Bearer TOKEN` -> tenant, compared in constant time (rule 3)."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self.replace(tokens)

    def replace(self, tokens: Mapping[str, str]) -> None:
        """Take `tokens` from the next call on (api/token_file.py); none is refused, and
        leaves the tokens in use."""
        if not tokens:
            raise ValueError("no bearer tokens configured")
        # One assignment: a call checks against the old list or the new, never a mix.
        self._digests = [(_digest(token), tenant) for token, tenant in tokens.items()]

    def tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        presented = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, credential = value.partition(" ")
                if scheme.lower() == "bearer":
                    presented = credential.strip()
        if not presented:
            return None
        digest = _digest(presented)
        found: str | None = None
        for candidate, tenant in self._digests:
            if hmac.compare_digest(candidate, digest):
                found = tenant
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class ClientCertificates:
    """The verified client certificate's identity -> tenant.

    The TLS handshake already required a certificate chaining to the configured CA. With
    a mapping, the certificate's identities found in it (each under its type: a URI, DNS
    name or e-mail SAN, or the subject CN) name the tenant; identities mapped to two
    tenants name none. Without a mapping, the subject CN is the tenant.
    """

    def __init__(self, tenants: Mapping[str, str]) -> None:
        self._tenants = dict(tenants)

    def tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        auth = context.auth_context() or {}
        # An empty identity names no one: a certificate without a CN is reported with an
        # empty one, and was taken as tenant "" (an audit).
        if not self._tenants:
            names = [v.decode("utf-8", "replace") for v in auth.get("x509_common_name", ())]
            return names[0] if names and names[0] else None
        named = {
            self._tenants[key]
            for kind, property_name in CERT_IDENTITY_TYPES.items()
            for value in auth.get(property_name, ())
            if value and (key := f"{kind}:{value.decode('utf-8', 'replace')}") in self._tenants
        }
        # One tenant or none: a certificate naming two would act as whichever was found
        # first, an order the certificate's issuer chose.
        return named.pop() if len(named) == 1 else None


class AuthInterceptor(Layer):
    """Authenticate every call (except UNAUTHENTICATED_SERVICES) and pin its tenant."""

    def __init__(
        self,
        identify: BearerTokens | ClientCertificates,
        *,
        open_services: Iterable[str] = UNAUTHENTICATED_SERVICES,
    ) -> None:
        self._identify = identify
        self._open = frozenset(open_services)

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler | None
    ) -> grpc.RpcMethodHandler | None:
        if _service_of(method) in self._open:
            return handler
        return _wrap(handler, self._unary, self._stream)

    async def _check(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        tenant = self._identify.tenant(context)
        # The log line names who called, beside the tenant_id the request claims: on a
        # TENANT_MISMATCH it showed only the victim's (an audit).
        telemetry.annotate(caller_tenant=tenant)
        if tenant is None:
            await abort_with(
                context, grpc.StatusCode.UNAUTHENTICATED, "no valid credentials", "UNAUTHENTICATED"
            )
            return
        descriptor = getattr(request, "DESCRIPTOR", None)
        if descriptor is None or "tenant_id" not in descriptor.fields_by_name:
            return
        if not request.tenant_id:
            request.tenant_id = tenant
        elif not hmac.compare_digest(request.tenant_id.encode(), tenant.encode()):
            await abort_with(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                "tenant_id does not match the authenticated identity",
                "TENANT_MISMATCH",
                field="tenant_id",
            )

    def _unary(self, behavior: Behavior) -> Behavior:
        async def authenticated(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._check(request, context)
            return await behavior(request, context)

        return authenticated

    def _stream(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """Streaming methods: credentials only (a stream's messages carry no tenant here)."""
        if not inspect.isasyncgenfunction(behavior):

            async def checked(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                await self._check(None, context)
                return await behavior(requests, context)

            return checked

        async def authenticated(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._check(None, context)
            async for item in behavior(requests, context):
                yield item

        return authenticated


# --- limits --------------------------------------------------------------------------


class SizeLimitInterceptor(Layer):
    """A request larger than `max_bytes` fails RESOURCE_EXHAUSTED with ErrorInfo
    REQUEST_TOO_LARGE (metadata: limit_bytes, request_bytes) and changes nothing.

    The transport limit is set above `max_bytes` (api/server.py), so an oversize request
    normally reaches this check and gets the structured error; one beyond the transport
    limit gets grpc's own RESOURCE_EXHAUSTED without details.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler | None
    ) -> grpc.RpcMethodHandler | None:
        return _wrap(handler, self._unary)

    def _unary(self, behavior: Behavior) -> Behavior:
        limit = self._max

        async def limited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            # A request that failed to decode arrives as a placeholder measuring the bytes
            # received (api/registration.py): over the limit it is refused here, like any
            # other; under it, the registration answers INVALID_ARGUMENT.
            size = request.ByteSize() if hasattr(request, "ByteSize") else 0
            if size > limit:
                await abort_with(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request is {size} bytes; the limit is {limit}",
                    "REQUEST_TOO_LARGE",
                    {"limit_bytes": str(limit), "request_bytes": str(size)},
                )
            return await behavior(request, context)

        return limited
