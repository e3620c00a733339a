"""Plans per (session, epoch): written once, rewritten in place only by an erasure's
redaction, which bumps the session's plans_revision (store/snapshots.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from ..core.errors import NotFoundError
from ..core.plan import ContextPlan
from ..core.spec import PlanSpec
from . import snapshots

__all__ = ["StoredPlan", "insert_plan", "read_plan", "set_current_epoch"]


@dataclass(frozen=True, slots=True)
class StoredPlan:
    plan: ContextPlan
    spec: PlanSpec
    secret: bytes
    # The session's plans_revision when the plan was read (erasure bumps it on a rewrite).
    revision: int = 0
    # When the plan was stored (PostgreSQL's clock); ContextPlan.created_at.
    created_at: datetime | None = None


async def insert_plan(
    conn: Any, tenant_id: str, session_id: UUID, plan: ContextPlan, spec: PlanSpec, secret: bytes
) -> datetime:
    """Store a plan; returns its created_at."""
    created_at: datetime = await conn.fetchval(
        "INSERT INTO context_plans"
        " (tenant_id, session_id, epoch, reason, prefix_sha256, plan, spec, secret)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING created_at",
        tenant_id,
        session_id,
        plan.epoch,
        plan.reason.name,
        plan.prefix_sha256,
        plan.model_dump(mode="json"),
        spec.model_dump(mode="json"),
        secret,
    )
    # Erasure's index of whose memories this snapshot holds, written with the plan.
    await snapshots.record_people(conn, tenant_id, session_id, plan.epoch, spec)
    return created_at


async def set_current_epoch(conn: Any, tenant_id: str, session_id: UUID, epoch: int) -> None:
    await conn.execute(
        "UPDATE sessions SET current_epoch = $3 WHERE tenant_id = $1 AND session_id = $2",
        tenant_id,
        session_id,
        epoch,
    )


async def read_plan(conn: Any, tenant_id: str, session_id: UUID, epoch: int = 0) -> StoredPlan:
    """The plan of `epoch`, or the current one when epoch is 0.

    Raises:
        NotFoundError: unknown session (SESSION_NOT_FOUND) or no such plan (PLAN_NOT_FOUND).
    """
    row = await conn.fetchrow(
        "SELECT s.current_epoch, s.plans_revision, p.plan, p.spec, p.secret, p.created_at"
        " FROM sessions s"
        " LEFT JOIN context_plans p ON p.tenant_id = s.tenant_id"
        " AND p.session_id = s.session_id"
        " AND p.epoch = CASE WHEN $3::bigint = 0 THEN s.current_epoch ELSE $3::bigint END"
        " WHERE s.tenant_id = $1 AND s.session_id = $2",
        tenant_id,
        session_id,
        epoch,
    )
    if row is None:
        raise NotFoundError(
            f"session {session_id} not found", field="session_id", reason="SESSION_NOT_FOUND"
        )
    if row["plan"] is None:
        what = f"epoch {epoch}" if epoch else "a plan yet"
        raise NotFoundError(
            f"session {session_id} has no {what}",
            field="epoch" if epoch else "session_id",
            reason="PLAN_NOT_FOUND",
        )
    return StoredPlan(
        plan=ContextPlan.model_validate(row["plan"]),
        spec=PlanSpec.model_validate(row["spec"]),
        secret=bytes(row["secret"]),
        revision=int(row["plans_revision"]),
        created_at=row["created_at"],
    )
