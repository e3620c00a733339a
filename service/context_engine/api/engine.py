"""The orchestrator: load (store) -> assemble (core) -> record (store), per RPC.

Takes and returns core values; the servicer does the proto conversion around it. The
clock, ids and secrets are injected so tests can pin them; in production they are the
process clock, uuid4 and os.urandom, and this module is the only place that calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import asyncpg

from ..core.assemble import Assembled, BuildInputs, StepContext, assemble
from ..core.checkpoint import Checkpoint
from ..core.enums import PlanReason
from ..core.errors import ConflictError, InvalidFieldError, PreconditionError
from ..core.items import ConversationItem, UserMessage
from ..core.plan import ContextPlan, ModelFacts, make_plan
from ..core.seeding import carried_history, seed_cut
from ..core.spec import PlanSpec
from ..core.validate import validate_append
from ..store import events, idempotency, plans, runs, sessions
from ..store.db import acquire, transaction
from ..store.events import EVENT_TYPE_OF_ITEM, NewEvent, item_payload

__all__ = ["BuildResult", "ChildSeed", "Engine", "RunStarted"]

TokenCounter = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class ChildSeed:
    parent_run_id: UUID
    instruction: str


@dataclass(frozen=True, slots=True)
class RunStarted:
    run_id: UUID
    session_id: UUID
    parent_run_id: UUID | None
    seed_event_sequence: int | None
    epoch: int
    checkpoint_version: int

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": str(self.run_id),
            "session_id": str(self.session_id),
            "parent_run_id": str(self.parent_run_id) if self.parent_run_id else None,
            "seed_event_sequence": self.seed_event_sequence,
            "epoch": self.epoch,
            "checkpoint_version": self.checkpoint_version,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunStarted:
        return cls(
            run_id=UUID(d["run_id"]),
            session_id=UUID(d["session_id"]),
            parent_run_id=UUID(d["parent_run_id"]) if d["parent_run_id"] else None,
            seed_event_sequence=d["seed_event_sequence"],
            epoch=d["epoch"],
            checkpoint_version=d["checkpoint_version"],
        )


@dataclass(frozen=True, slots=True)
class BuildResult:
    assembled: Assembled
    plan: ContextPlan
    checkpoint_version: int
    request_sequence: int


class Engine:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        model_facts: Callable[[str], ModelFacts],
        token_counter: Callable[[str], TokenCounter],
        default_policy: Any,
        clock: Callable[[], datetime],
        new_id: Callable[[], str],
        new_secret: Callable[[], bytes],
    ) -> None:
        self.pool = pool
        self._model_facts = model_facts
        self._token_counter = token_counter
        self.default_policy = default_policy
        self._clock = clock
        self._new_id = new_id
        self._new_secret = new_secret
        # Plans are immutable per (tenant, session, epoch), so a replica may keep them.
        self._plans: dict[tuple[str, UUID, int], plans.StoredPlan] = {}

    def new_id(self) -> str:
        return self._new_id()

    def now(self) -> datetime:
        return self._clock()

    # --- plans ------------------------------------------------------------------------

    def _make_plan(
        self, spec: PlanSpec, session_id: UUID, epoch: int, reason: PlanReason, secret: bytes
    ) -> ContextPlan:
        _zone(spec.environment.time_zone)
        facts = self._model_facts(spec.model_id)
        return make_plan(
            spec,
            session_id=str(session_id),
            epoch=epoch,
            reason=reason,
            secret=secret,
            model=facts,
            count_tokens=self._token_counter(spec.model_id),
        )

    async def plan(
        self, tenant: str, session_id: UUID, spec: PlanSpec
    ) -> tuple[ContextPlan, bool, bool]:
        """Open the session's plan, or return the current one. -> (plan, created, matches)."""
        secret = self._new_secret()
        candidate = self._make_plan(spec, session_id, 1, PlanReason.SESSION_OPENED, secret)
        async with transaction(self.pool) as conn:
            await sessions.ensure_session(conn, tenant, session_id)
            epoch = await sessions.lock_session(conn, tenant, session_id)
            if epoch > 0:
                current = await plans.read_plan(conn, tenant, session_id)
                return current.plan, False, current.plan.spec_sha256 == candidate.spec_sha256
            await plans.insert_plan(conn, tenant, session_id, candidate, spec, secret)
            await plans.set_current_epoch(conn, tenant, session_id, 1)
            await events.append_events(
                conn, tenant, session_id, [_plan_event("context.plan.created", candidate, {})]
            )
        return candidate, True, True

    async def get_plan(self, tenant: str, session_id: UUID, epoch: int = 0) -> plans.StoredPlan:
        if epoch:
            cached = self._plans.get((tenant, session_id, epoch))
            if cached is not None:
                return cached
        async with acquire(self.pool) as conn:
            stored = await plans.read_plan(conn, tenant, session_id, epoch)
        self._plans[(tenant, session_id, stored.plan.epoch)] = stored
        return stored

    async def rotate(
        self,
        tenant: str,
        session_id: UUID,
        from_epoch: int,
        reason: PlanReason,
        spec: PlanSpec | None,
        detail: str,
    ) -> ContextPlan:
        async with transaction(self.pool) as conn:
            epoch = await sessions.lock_session(conn, tenant, session_id)
            if epoch == 0:
                raise PreconditionError(
                    f"session {session_id} has no plan to rotate; call Plan first",
                    field="session_id",
                    reason="PLAN_NOT_FOUND",
                )
            if from_epoch != epoch:
                raise ConflictError(
                    f"from_epoch {from_epoch} is not the current epoch {epoch}",
                    field="from_epoch",
                    reason="EPOCH_CONFLICT",
                    metadata={"current_epoch": str(epoch)},
                )
            current = await plans.read_plan(conn, tenant, session_id)
            new_spec = spec or current.spec
            secret = self._new_secret()
            plan = self._make_plan(new_spec, session_id, epoch + 1, reason, secret)
            await plans.insert_plan(conn, tenant, session_id, plan, new_spec, secret)
            await plans.set_current_epoch(conn, tenant, session_id, plan.epoch)
            extra = {
                "from_epoch": epoch,
                "from_prefix_sha256": current.plan.prefix_sha256,
                "detail": detail,
            }
            await events.append_events(
                conn, tenant, session_id, [_plan_event("context.epoch.rotated", plan, extra)]
            )
        return plan

    # --- runs -------------------------------------------------------------------------

    async def start_run(
        self,
        tenant: str,
        session_id: UUID,
        run_id: UUID,
        seed: UserMessage | ChildSeed,
        idempotency_key: str,
        request_sha256: str,
    ) -> RunStarted:
        async with transaction(self.pool) as conn:
            epoch = await sessions.lock_session(conn, tenant, session_id)
            stored = await idempotency.recall_response(
                conn, tenant, session_id, idempotency_key, "StartRun", request_sha256
            )
            if stored is not None:
                return RunStarted.from_json(stored)
            if epoch == 0:
                raise PreconditionError(
                    f"session {session_id} has no plan; call Plan first",
                    field="session_id",
                    reason="PLAN_NOT_FOUND",
                )
            if isinstance(seed, UserMessage):
                # The seeding event and the run row share this transaction, so the run's
                # seed_event_sequence can never point at an event that did not land.
                (seq,) = await events.append_events(
                    conn,
                    tenant,
                    session_id,
                    [_item_event(seed, run_id, in_history=True)],
                )
                first = replace_item(seed, sequence=seq, run_id=str(run_id))
                run = runs.RunRow(run_id, session_id, None, seq, epoch)
            else:
                await runs.read_run(conn, tenant, session_id, seed.parent_run_id)
                first = UserMessage(
                    item_id=f"instruction:{run_id}", text=seed.instruction, run_id=str(run_id)
                )
                run = runs.RunRow(run_id, session_id, seed.parent_run_id, None, epoch)
                await events.append_events(
                    conn,
                    tenant,
                    session_id,
                    [
                        NewEvent(
                            "run.child.started",
                            {"parent_run_id": str(seed.parent_run_id)},
                            run_id=run_id,
                        )
                    ],
                )
            await runs.insert_run(conn, tenant, run)
            await runs.insert_checkpoint(
                conn, tenant, Checkpoint(run_id=str(run_id), version=1, items=(first,))
            )
            result = RunStarted(
                run_id, session_id, run.parent_run_id, run.seed_event_sequence, epoch, 1
            )
            await idempotency.remember_response(
                conn,
                tenant,
                session_id,
                idempotency_key,
                "StartRun",
                request_sha256,
                result.to_json(),
            )
        return result

    async def append_items(
        self,
        tenant: str,
        session_id: UUID,
        run_id: UUID,
        expected_version: int,
        new_items: list[ConversationItem],
        idempotency_key: str,
        request_sha256: str,
    ) -> dict[str, Any]:
        async with transaction(self.pool) as conn:
            await sessions.lock_session(conn, tenant, session_id)
            stored = await idempotency.recall_response(
                conn, tenant, session_id, idempotency_key, "AppendItems", request_sha256
            )
            if stored is not None:
                return stored
            run = await runs.read_run(conn, tenant, session_id, run_id)
            checkpoint = await runs.read_checkpoint(conn, tenant, run_id)
            if expected_version != checkpoint.version:
                raise ConflictError(
                    f"expected_checkpoint_version {expected_version} is not the latest"
                    f" ({checkpoint.version})",
                    field="expected_checkpoint_version",
                    reason="CHECKPOINT_VERSION_CONFLICT",
                    metadata={"latest_version": str(checkpoint.version)},
                )
            validate_append(checkpoint.items, new_items)
            in_history = run.parent_run_id is None
            loggable = [i for i in new_items if i.kind in EVENT_TYPE_OF_ITEM]
            sequences = await events.append_events(
                conn,
                tenant,
                session_id,
                [_item_event(i, run_id, in_history=in_history) for i in loggable],
            )
            by_id = dict(zip((i.item_id for i in loggable), sequences, strict=True))
            placed = tuple(
                replace_item(i, sequence=by_id.get(i.item_id, 0), run_id=str(run_id))
                for i in new_items
            )
            new_checkpoint = checkpoint.model_copy(
                update={"version": checkpoint.version + 1, "items": checkpoint.items + placed}
            )
            await runs.insert_checkpoint(conn, tenant, new_checkpoint)
            result = {
                "checkpoint_version": new_checkpoint.version,
                "sequences": [i.sequence for i in placed],
                "item_ids": [i.item_id for i in placed],
            }
            await idempotency.remember_response(
                conn, tenant, session_id, idempotency_key, "AppendItems", request_sha256, result
            )
        return result

    # --- build ------------------------------------------------------------------------

    async def build(
        self,
        tenant: str,
        session_id: UUID,
        run_id: UUID,
        checkpoint_version: int,
        now: datetime | None,
        step: StepContext,
    ) -> BuildResult:
        stored = await self.get_plan(tenant, session_id)
        async with acquire(self.pool) as conn:
            run = await runs.read_run(conn, tenant, session_id, run_id)
            checkpoint = await runs.read_checkpoint(conn, tenant, run_id, checkpoint_version)
            logged = await events.read_carried_items(
                conn,
                tenant,
                session_id,
                below_sequence=seed_cut(run.seed_event_sequence),
                above_sequence=checkpoint.replaced_through_sequence,
            )
        plan = stored.plan
        clock = (now or self._clock()).astimezone(_zone(plan.time_zone))
        assembled = assemble(
            BuildInputs(
                tenant_id=tenant,
                plan=plan,
                secret=stored.secret,
                checkpoint=checkpoint,
                carried=carried_history(logged),
                now=clock,
                step=step,
            )
        )
        payload = {
            "run_id": str(run_id),
            "epoch": plan.epoch,
            "prefix_sha256": plan.prefix_sha256,
            "prefix_tokens": plan.prefix_tokens,
            "request_sha256": assembled.request_sha256,
            "checkpoint_version": checkpoint.version,
        }
        async with transaction(self.pool) as conn:
            await sessions.lock_session(conn, tenant, session_id)
            (seq,) = await events.append_events(
                conn,
                tenant,
                session_id,
                [NewEvent("model.request.started", payload, run_id=run_id)],
            )
        return BuildResult(assembled, plan, checkpoint.version, seq)


def replace_item(item: ConversationItem, **changes: Any) -> Any:
    return item.model_copy(update=changes)


def _item_event(item: ConversationItem, run_id: UUID, *, in_history: bool) -> NewEvent:
    return NewEvent(
        type=EVENT_TYPE_OF_ITEM[item.kind],
        payload=item_payload(item),
        run_id=run_id,
        item_id=item.item_id,
        in_history=in_history,
    )


def _plan_event(kind: str, plan: ContextPlan, extra: dict[str, Any]) -> NewEvent:
    return NewEvent(
        kind,
        {
            "epoch": plan.epoch,
            "reason": plan.reason.name.lower(),
            "prefix_sha256": plan.prefix_sha256,
            "prefix_tokens": plan.prefix_tokens,
            "model_id": plan.model_id,
            "builder_version": plan.builder_version,
            "tool_names": list(plan.tool_names),
            "deferred_tool_names": list(plan.deferred_tool_names),
            "skipped_tool_names": list(plan.skipped_tool_names),
            **extra,
        },
    )


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidFieldError(
            f"unknown time zone {name!r}", field="spec.environment.time_zone"
        ) from None
