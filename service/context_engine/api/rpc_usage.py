"""gRPC methods for usage; composed into ContextEngineServicer."""

from __future__ import annotations

from typing import TYPE_CHECKING
from uuid import UUID

import grpc

from .. import telemetry
from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.errors import InvalidFieldError
from . import convert
from . import usage as usage_api
from .errors import grpc_errors
from .request_hash import request_sha256

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["UNREGISTERED", "UsageRpcs"]

# The usage metrics' `model` label for a reported model the registry lacks.
UNREGISTERED = "unregistered"

_COUNTS = (
    "input_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
    "output_tokens",
)


class UsageRpcs:
    """Expects `engine` from ContextEngineServicer."""

    engine: Engine

    @grpc_errors
    async def ReportUsage(
        self, request: pb.ReportUsageRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportUsageResponse:
        convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        report = _report_from_proto(request, session_id)
        async with self.engine.gates.held(request.tenant_id, session_id):
            outcome = await usage_api.report_usage(
                self.engine.pool,
                request.tenant_id,
                session_id,
                report,
                self.engine.tokenizer_of,
            )
        # Recorded here: only the handler knows whether the request was the first of its
        # epoch, whose cached share the prefix-cache metric leaves out (api/usage.py, Rule 5),
        # and whether it replayed an earlier report's answer, which recorded no new usage.
        if outcome.replayed:
            telemetry.record_replay("usage")
        else:
            telemetry.record_usage(
                # A model the registry lacks (a router's or a fine-tune's name the worker
                # passed on) is one label, not a new series per name.
                outcome.model_id if self.engine.serves(outcome.model_id) else UNREGISTERED,
                outcome.signed_error_ppm,
                outcome.cached_prefix_ppm,
                first_of_epoch=outcome.first_of_epoch,
                reuse_ppm=outcome.reuse_ppm,
                measures_estimate=outcome.measures_estimate,
            )
        return pb.ReportUsageResponse(
            factor_ppm=outcome.factor_ppm,
            samples=outcome.samples,
            signed_error_ppm=outcome.signed_error_ppm,
            cached_prefix_ppm=outcome.cached_prefix_ppm,
            absorbed=outcome.absorbed,
            reuse_ppm=outcome.reuse_ppm,
        )


def _report_from_proto(request: pb.ReportUsageRequest, session_id: UUID) -> usage_api.UsageReport:
    """Validate before anything is read or written."""
    if request.request_sequence < 1:
        raise InvalidFieldError(
            "request_sequence must be a BuildResponse.request_sequence (>= 1)",
            field="request_sequence",
        )
    convert.require_id(request.model_id, "model_id")  # indexed with the reports
    for name in _COUNTS:
        if getattr(request, name) < 0:
            raise InvalidFieldError(f"{name} must not be negative", field=name)
    report = usage_api.UsageReport(
        request_sequence=request.request_sequence,
        model_id=request.model_id,
        input_tokens=request.input_tokens,
        cache_read_input_tokens=request.cache_read_input_tokens,
        cache_creation_input_tokens=request.cache_creation_input_tokens,
        output_tokens=request.output_tokens,
        idempotency_key=convert.require_id(
            request.idempotency_key, "idempotency_key", required=False
        ),
        request_sha256=request_sha256(request, {"session_id": session_id}),
    )
    if report.actual_input_tokens == 0:
        raise InvalidFieldError(
            "the report reads no input tokens (input, cache read and cache creation are 0)",
            field="input_tokens",
        )
    return report
