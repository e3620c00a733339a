"""gRPC methods for skills and erasure; composed into ContextEngineServicer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.errors import InvalidFieldError
from ..core.trust import TrustLevel
from . import convert
from . import skills as skills_api
from .errors import grpc_errors

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["SkillsRpcs"]


class SkillsRpcs:
    """Expects `engine` from ContextEngineServicer."""

    engine: Engine

    @grpc_errors
    async def LoadSkill(
        self, request: pb.LoadSkillRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadSkillResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        # An identifier the store indexes: bounded like every other (docs/api.md).
        name = convert.require_id(request.name, "name")
        if not request.body.strip():
            # Blank, it took one of the session's two slots for good, to send nothing (an
            # audit).
            raise InvalidFieldError("body is required (and not blank)", field="body")
        trust: TrustLevel | None = None
        if request.trust:
            try:
                trust = TrustLevel(request.trust)
            except ValueError:
                raise InvalidFieldError("trust is not a TrustLevel", field="trust") from None
        run_id = convert.parse_uuid(request.run_id, "run_id", required=False)
        loaded, newly = await skills_api.load_skill(
            self.engine, tenant, session_id, name, request.body, trust, run_id
        )
        self.engine.forget_heads(tenant, session_id)
        return pb.LoadSkillResponse(loaded=loaded, newly_loaded=newly)

    @grpc_errors
    async def EraseSubject(
        self, request: pb.EraseSubjectRequest, context: grpc.aio.ServicerContext
    ) -> pb.EraseSubjectResponse:
        tenant = convert.require_tenant(request)
        person_id = convert.require_id(request.person_id, "person_id")
        erasure = await skills_api.erase_subject(self.engine, tenant, person_id)
        return pb.EraseSubjectResponse(
            invalidated_session_ids=[str(s) for s in erasure.invalidated_session_ids],
            bound_run_ids=[str(r) for r in erasure.bound_run_ids],
            redacted_items=erasure.redacted_items,
            redacted_requests=erasure.redacted_requests,
            redacted_request_run_ids=[str(r) for r in erasure.redacted_request_run_ids],
        )
