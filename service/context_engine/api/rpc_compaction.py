"""gRPC methods for compaction; composed into ContextEngineServicer.

PrepareCompaction and CommitCompaction, with the proto <-> core conversion for their
messages, validating first: a malformed request names its field and writes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from .. import telemetry
from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.compaction import CompactionResult, ElidedSpan
from ..core.errors import InvalidFieldError
from ..core.trust import TrustLevel
from . import compaction as compaction_api
from . import convert
from .errors import grpc_errors
from .request_hash import request_sha256

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["CompactionRpcs", "result_from_proto", "span_to_proto"]


def span_to_proto(span: ElidedSpan) -> pb.ElidedSpan:
    return pb.ElidedSpan(
        item_id=span.item_id,
        trust=pb.TrustLevel.ValueType(span.trust),
        byte_length=span.byte_length,
        artifact_ref=span.artifact_ref,
        event_id=span.event_id,
    )


def _span_from_proto(span: pb.ElidedSpan, field: str) -> ElidedSpan:
    # Only the item id is compared with what was prepared; the engine stores its own spans.
    if not span.item_id:
        raise InvalidFieldError(f"{field}.item_id is required", field=f"{field}.item_id")
    try:
        trust = TrustLevel(span.trust)
    except ValueError:
        trust = TrustLevel.EXTERNAL_UNTRUSTED
    return ElidedSpan(
        item_id=span.item_id,
        kind="",
        trust=trust,
        byte_length=max(span.byte_length, 0),
        artifact_ref=span.artifact_ref,
        event_id=max(span.event_id, 0),
    )


def result_from_proto(result: pb.CompactionResult, field: str = "result") -> CompactionResult:
    for name in ("replaced_through_sequence", "depth", "tokens_before", "tokens_after"):
        if getattr(result, name) < 0:
            raise InvalidFieldError(f"{field}.{name} must not be negative", field=f"{field}.{name}")
    return CompactionResult(
        summary=result.summary,
        source_event_ids=tuple(result.source_event_ids),
        elided=tuple(
            _span_from_proto(s, f"{field}.elided[{n}]") for n, s in enumerate(result.elided)
        ),
        replaced_through_sequence=result.replaced_through_sequence,
        depth=result.depth,
        tokens_before=result.tokens_before,
        tokens_after=result.tokens_after,
        # Free text a worker chooses, copied into every later checkpoint of the run: bounded
        # as an identifier (an audit stored a 3 MB one in each).
        compactor_version=convert.require_id(
            result.compactor_version, f"{field}.compactor_version", required=False
        ),
        prompt_version=convert.require_id(
            result.prompt_version, f"{field}.prompt_version", required=False
        ),
    )


class CompactionRpcs:
    """Expects `engine` from ContextEngineServicer."""

    engine: Engine

    @grpc_errors
    async def PrepareCompaction(
        self, request: pb.PrepareCompactionRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrepareCompactionResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        run_id = convert.require_uuid(request.run_id, "run_id")
        for name in ("checkpoint_version", "through_sequence"):
            if getattr(request, name) < 0:
                raise InvalidFieldError(f"{name} must not be negative", field=name)
        prepared = await compaction_api.prepare_compaction(
            self.engine,
            tenant,
            session_id,
            run_id,
            request.checkpoint_version,
            request.through_sequence,
        )
        return pb.PrepareCompactionResponse(
            prompt=prepared.prompt,
            prompt_version=prepared.prompt_version,
            summarizer_input=prepared.summarizer_input,
            elided=[span_to_proto(s) for s in prepared.elided],
            retained_constraints=list(prepared.retained_constraints),
            open_questions=list(prepared.open_questions),
            source_event_ids=list(prepared.source_event_ids),
            replaced_through_sequence=prepared.replaced_through_sequence,
            depth=prepared.depth,
            tokens_before=prepared.tokens_before,
            checkpoint_version=prepared.checkpoint_version,
        )

    @grpc_errors
    async def CommitCompaction(
        self, request: pb.CommitCompactionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitCompactionResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        run_id = convert.require_uuid(request.run_id, "run_id")
        if request.expected_checkpoint_version < 1:
            raise InvalidFieldError(
                "expected_checkpoint_version must be the version PrepareCompaction returned",
                field="expected_checkpoint_version",
            )
        if not request.HasField("result"):
            raise InvalidFieldError("result is required", field="result")
        result = result_from_proto(request.result)
        committed = await compaction_api.commit_compaction(
            self.engine,
            tenant,
            session_id,
            run_id,
            request.expected_checkpoint_version,
            result,
            convert.require_id(request.idempotency_key, "idempotency_key", required=False),
            request_sha256(request, {"session_id": session_id, "run_id": run_id}),
        )
        # Recorded here, not derived from the response: a retry answers with the first
        # call's response but commits nothing, and the depth is the committed summary's
        # (the request may leave result.depth 0).
        if committed.replayed:
            telemetry.record_replay("compaction")
        else:
            telemetry.record_compaction(committed.depth)
        return pb.CommitCompactionResponse(**committed.response)
