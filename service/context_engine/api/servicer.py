"""The ContextEngine gRPC servicer: convert, call the engine, convert back.

Every method is wrapped by `grpc_errors`, the one place errors become statuses.
"""

from __future__ import annotations

from uuid import UUID

import grpc

from .. import telemetry
from .._gen.context_engine.v1 import context_engine_pb2 as pb
from .._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from ..core.enums import PlanReason
from ..core.epochs import ADMISSION_REASONS
from ..core.errors import InvalidFieldError
from ..core.roster import unknown_tool_names
from . import convert, wire
from .engine import BuildResult, ChildSeed, Engine
from .errors import grpc_errors
from .request_hash import request_sha256
from .rpc_builds import BuildsRpcs
from .rpc_compaction import CompactionRpcs
from .rpc_skills import SkillsRpcs
from .rpc_usage import UsageRpcs
from .rpc_working_state import WorkingStateRpcs

__all__ = ["ContextEngineServicer"]


class ContextEngineServicer(
    BuildsRpcs,
    UsageRpcs,
    SkillsRpcs,
    WorkingStateRpcs,
    CompactionRpcs,
    pb_grpc.ContextEngineServicer,
):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @grpc_errors
    async def Plan(
        self, request: pb.PlanRequest, context: grpc.aio.ServicerContext
    ) -> pb.PlanResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        if not request.HasField("spec"):
            raise InvalidFieldError("spec is required", field="spec")
        spec = convert.plan_spec_from_proto(request.spec, self.engine.default_policy)
        stored, created, matches = await self.engine.plan(tenant, session_id, spec)
        self.engine.forget_heads(tenant, session_id)
        return pb.PlanResponse(
            plan=convert.plan_to_proto(stored.plan, stored.created_at),
            created=created,
            spec_matches=matches,
            unknown_tool_names=unknown_tool_names(spec),
        )

    @grpc_errors
    async def GetPlan(
        self, request: pb.GetPlanRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPlanResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        if request.epoch < 0:
            raise InvalidFieldError("epoch must not be negative", field="epoch")
        stored = await self.engine.get_plan(tenant, session_id, request.epoch)
        return pb.GetPlanResponse(plan=convert.plan_to_proto(stored.plan, stored.created_at))

    @grpc_errors
    async def Rotate(
        self, request: pb.RotateRequest, context: grpc.aio.ServicerContext
    ) -> pb.RotateResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        if request.from_epoch < 1:
            raise InvalidFieldError(
                "from_epoch must be the current epoch (>= 1)", field="from_epoch"
            )
        reason = convert.plan_reason_from_proto(request.reason, "reason")
        if reason in ADMISSION_REASONS:
            # Only a run's admission decides these: a plan with such a reason begins a
            # lineage only its own run follows (store/plans.py), so an operator's rotation
            # with one would never reach the runs already active.
            raise InvalidFieldError(
                f"{reason.name} is decided at a run's admission (StartRun.admission), not"
                " by Rotate; name the change (for example OPERATOR_REVOCATION)",
                field="reason",
            )
        if reason is PlanReason.PREFIX_HASH_CANONICALIZED and request.HasField("spec"):
            # Refused before any state is read: found later, it was answered EPOCH_CONFLICT
            # or PERSON_ERASED, which a client may retry (an audit).
            raise InvalidFieldError(
                "prefix_hash_canonicalized copies the pinned plan; it takes no spec",
                field="spec",
            )
        spec = (
            convert.plan_spec_from_proto(request.spec, self.engine.default_policy)
            if request.HasField("spec")
            else None
        )
        rotated, replayed = await self.engine.rotate(
            tenant,
            session_id,
            request.from_epoch,
            reason,
            spec,
            request.detail,
            convert.require_id(request.idempotency_key, "idempotency_key", required=False),
            request_sha256(request, {"session_id": session_id}),
        )
        # Counted here, not derived from the response: one epoch however many plan lineages
        # (a rotation without spec continues the others when next used, and the call that
        # does counts each: store/plans.py); a replay answers with the plan the first call
        # made but rotated nothing.
        self.engine.forget_heads(tenant, session_id)
        if replayed:
            telemetry.record_replay("rotation")
        else:
            telemetry.record_rotation(rotated.plan.reason.name.lower())
        return pb.RotateResponse(
            plan=convert.plan_to_proto(rotated.plan, rotated.created_at),
            unknown_tool_names=unknown_tool_names(spec) if spec is not None else (),
        )

    @grpc_errors
    async def StartRun(
        self, request: pb.StartRunRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartRunResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        asked_run_id = convert.parse_uuid(request.run_id, "run_id", required=False)
        run_id = asked_run_id or UUID(self.engine.new_id())
        parent: UUID | None = None
        seed_kind = request.WhichOneof("seed")
        seed: object
        if seed_kind == "user_message":
            seed = convert.user_message_from_proto(
                request.user_message,
                convert.require_id(request.seed_item_id, "seed_item_id", required=False)
                or self.engine.new_id(),
                "user_message",
            )
        elif seed_kind == "child":
            parent = convert.require_uuid(request.child.parent_run_id, "child.parent_run_id")
            if not request.child.instruction:
                raise InvalidFieldError("child.instruction is required", field="child.instruction")
            seed = ChildSeed(parent, request.child.instruction)
            if request.HasField("admission"):
                # A child works for its parent and builds on its parent's epoch: it is not
                # admitted, so it can never be granted what its parent was not.
                raise InvalidFieldError(
                    "a child run inherits its parent's authority; admission is for a top-level run",
                    field="admission",
                )
            if request.seed_item_id:
                # The instruction's item id is derived from the run (engine.start_run), so
                # the id asked for would be dropped without a word.
                raise InvalidFieldError(
                    "a child run's instruction takes an id derived from its run;"
                    " seed_item_id is for a top-level run's user message",
                    field="seed_item_id",
                )
        else:
            # Named by a field a caller sets (the oneof's name, "seed", is none: an audit).
            raise InvalidFieldError(
                "one of user_message or child is required", field="user_message"
            )
        admission = (
            convert.admission_from_proto(request.admission)
            if request.HasField("admission")
            else None
        )
        started = await self.engine.start_run(
            tenant,
            session_id,
            run_id,
            seed,
            convert.require_id(request.idempotency_key, "idempotency_key", required=False),
            request_sha256(
                request,
                {"session_id": session_id, "run_id": asked_run_id, "child.parent_run_id": parent},
            ),
            admission,
        )
        # Counted here, not derived from the response: a replay answers with the first
        # call's response (rotated_plan included) but started and rotated nothing. Counted
        # before anything else is awaited: a call cancelled after its commit (its deadline
        # passing in the plan's read below) was counted by neither it nor its retry, which
        # replays (an audit).
        if started.replayed:
            telemetry.record_replay("run")
        else:
            telemetry.record_run_started()
            for reason in started.rotations:
                telemetry.record_rotation(reason.name.lower())
        # A rotation at the admission, or a child pinning its parent's lineage, moves other
        # runs' heads: the session's next Builds here read them.
        self.engine.forget_heads(tenant, session_id)
        run = pb.Run(
            run_id=str(started.run_id),
            session_id=str(started.session_id),
            parent_run_id=str(started.parent_run_id or ""),
            epoch=started.epoch,
        )
        if started.seed_event_sequence is not None:
            run.seed_event_sequence = started.seed_event_sequence
        response = pb.StartRunResponse(run=run, checkpoint_version=started.checkpoint_version)
        if started.rotated_epoch is not None:  # admission rotated: the plan the run pins
            rotated = await self.engine.get_plan(tenant, session_id, started.rotated_epoch)
            response.rotated_plan.CopyFrom(convert.plan_to_proto(rotated.plan, rotated.created_at))
        return response

    @grpc_errors
    async def AppendItems(
        self, request: pb.AppendItemsRequest, context: grpc.aio.ServicerContext
    ) -> pb.AppendItemsResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        run_id = convert.require_uuid(request.run_id, "run_id")
        convert.require_expected_version(request.expected_checkpoint_version)
        new_ids = [self.engine.new_id() for _ in request.items]
        items = convert.items_from_proto(request.items, new_ids)
        result = await self.engine.append_items(
            tenant,
            session_id,
            run_id,
            request.expected_checkpoint_version,
            items,
            convert.require_id(request.idempotency_key, "idempotency_key", required=False),
            request_sha256(request, {"session_id": session_id, "run_id": run_id}),
        )
        return pb.AppendItemsResponse(**result)

    @grpc_errors
    async def Build(
        self, request: pb.BuildRequest, context: grpc.aio.ServicerContext
    ) -> wire.EncodedBuildResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        run_id = convert.require_uuid(request.run_id, "run_id")
        if request.checkpoint_version < 0:
            raise InvalidFieldError(
                "checkpoint_version must not be negative", field="checkpoint_version"
            )
        now = convert.timestamp_to_datetime(request.now, "now") if request.HasField("now") else None
        step = convert.step_from_proto(request.step)
        result = await self.engine.build(
            tenant, session_id, run_id, request.checkpoint_version, now, step
        )
        if result.assembled.estimated_input_tokens > 0:
            # Recorded here, from the model id at hand: the observer would otherwise read it
            # from the response's request, which travels encoded (api/wire.py).
            assembled = result.assembled
            telemetry.record_build(
                result.plan.model_id,
                assembled.estimated_input_tokens,
                assembled.input_budget_tokens,
                [b.name for b in assembled.request.cache_breakpoints] if assembled.request else [],
            )
        return self.build_response(result)

    def build_response(self, result: BuildResult) -> wire.EncodedBuildResponse:
        """The BuildResponse of an engine build; Build and GetBuild both answer with it.
        The request travels as bytes composed from memoized pieces (api/wire.py)."""
        plan = result.plan
        assembled = result.assembled
        response = pb.BuildResponse(
            prefix_sha256=plan.prefix_sha256,
            prefix_tokens=plan.prefix_tokens,
            epoch=plan.epoch,
            checkpoint_version=result.checkpoint_version,
            request_sha256=assembled.request_sha256,
            request_sequence=result.request_sequence,
            needs_compaction=assembled.needs_compaction,
            estimated_input_tokens=assembled.estimated_input_tokens,
            input_budget_tokens=assembled.input_budget_tokens,
        )
        # The pressure report is present whenever a yield ran (and never otherwise).
        if assembled.pressure is not None and assembled.pressure.yielded:
            response.pressure.CopyFrom(convert.pressure_to_proto(assembled.pressure))
        if result.rendered is not None:
            response.provider_api = result.rendered.api
        if result.attachment_paths:
            response.attachment_placements.extend(
                convert.placements_to_proto(assembled.attachments, result.attachment_paths)
            )
        # No request when the body needs compaction: the worker compacts and builds again.
        request = assembled.request
        return wire.EncodedBuildResponse(
            response,
            wire.request_pieces(request) if request is not None else None,
            budget=assembled.budget,
            payload=result.rendered.body if result.rendered is not None else b"",
        )
