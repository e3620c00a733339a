"""gRPC methods for recorded builds (GetBuild); composed into ContextEngineServicer.

GetBuild rebuilds the request a model.request.started event recorded, from the inputs the
event holds (epoch, run, checkpoint version, clock, step context) and the log, without
recording it again. Build is pure, so the rebuild is the recorded request: the method
checks that against the recorded request_sha256 and fails loudly rather than answer with
bytes the provider never saw. A request built on a plan an erasure has since redacted no
longer rebuilds, nor does one whose recall lines an erasure removed from its record: both
are refused with REQUEST_REDACTED, never answered from a kept copy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any
from uuid import UUID

import grpc

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.build_record import BUDGET_KEY, REDACTED_KEY, inputs_from_record
from ..core.errors import EngineError, InvalidFieldError, NotFoundError, PreconditionError
from ..store import events
from ..store.db import acquire
from . import convert
from .errors import grpc_errors
from .wire import EncodedBuildResponse

if TYPE_CHECKING:
    from .engine import BuildResult, Engine

__all__ = ["REQUEST_EVENT", "BuildsRpcs"]

REQUEST_EVENT = "model.request.started"


class BuildsRpcs:
    """Expects `engine` and `build_response` from ContextEngineServicer."""

    engine: Engine

    def build_response(self, result: BuildResult) -> EncodedBuildResponse:
        raise NotImplementedError  # ContextEngineServicer defines it

    @grpc_errors
    async def GetBuild(
        self, request: pb.GetBuildRequest, context: grpc.aio.ServicerContext
    ) -> EncodedBuildResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        if request.request_sequence < 1:
            raise InvalidFieldError(
                "request_sequence must be a BuildResponse.request_sequence (>= 1)",
                field="request_sequence",
            )
        payload = await _recorded_request(self.engine, tenant, session_id, request.request_sequence)
        if payload.get(REDACTED_KEY):
            raise _redacted(request.request_sequence, "its recall lines")
        now, step = inputs_from_record(payload)
        result = await self.engine.build(
            tenant,
            session_id,
            UUID(payload["run_id"]),
            int(payload["checkpoint_version"]),
            now,
            step,
            epoch=int(payload["epoch"]),
            record=False,
            # Skills are sticky and append-only: the first N loaded are the ones it saw.
            skills_loaded=payload.get("skills_loaded"),
            # The markers it was sent with, whatever the registry says now.
            breakpoint_budget=payload.get(BUDGET_KEY),
        )
        if result.assembled.request_sha256 != payload.get("request_sha256"):
            if result.plan.invalidated:
                # An erasure redacted the plan's snapshot since: the recorded bytes held the
                # erased memories, and they are not served again (core/snapshot.py).
                raise _redacted(request.request_sequence, f"epoch {result.plan.epoch}'s snapshot")
            raise EngineError(
                f"request {request.request_sequence} does not rebuild to its recorded bytes"
            )
        return self.build_response(replace(result, request_sequence=request.request_sequence))


def _redacted(sequence: int, what: str) -> PreconditionError:
    return PreconditionError(
        f"request {sequence} held memories an erasure has since redacted from {what};"
        " its recorded bytes are no longer served",
        field="request_sequence",
        reason="REQUEST_REDACTED",
    )


async def _recorded_request(
    engine: Engine, tenant: str, session_id: UUID, sequence: int
) -> dict[str, Any]:
    """The payload of the model.request.started event at `sequence`.

    Raises:
        NotFoundError: REQUEST_NOT_FOUND — no such event in this tenant's session.
    """
    async with acquire(engine.pool) as conn:
        rows = await events.read_events(
            conn, tenant, session_id, types=[REQUEST_EVENT], after_sequence=sequence - 1, limit=1
        )
    if not rows or rows[0]["sequence"] != sequence:
        raise NotFoundError(
            f"no {REQUEST_EVENT} event at sequence {sequence} in this session",
            field="request_sequence",
            reason="REQUEST_NOT_FOUND",
        )
    payload: dict[str, Any] = rows[0]["payload"]
    return payload
