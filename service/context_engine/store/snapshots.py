"""Snapshot bindings and erasure: which runs used which plan snapshot, and which persisted
snapshots hold whose memories. Call every writer with the session locked: the session row
lock is the fence between a run binding to a snapshot and an erasure redacting it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

from ..core.plan import ContextPlan
from ..core.spec import PlanSpec

__all__ = [
    "bound_runs",
    "forget_person",
    "plans_holding",
    "read_plan_row",
    "record_people",
    "write_redacted_plan",
]


async def record_people(
    conn: Any, tenant_id: str, session_id: UUID, epoch: int, spec: PlanSpec
) -> None:
    """Index the people whose memories the plan's persisted snapshot holds."""
    people = sorted({p for m in spec.snapshot.items for p in m.person_ids})
    if not people:
        return
    await conn.executemany(
        "INSERT INTO snapshot_people (tenant_id, person_id, session_id, epoch)"
        " VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
        [(tenant_id, p, session_id, epoch) for p in people],
    )


async def plans_holding(
    conn: Any, tenant_id: str, person_id: str, session_id: UUID | None = None
) -> dict[UUID, list[int]]:
    """Session -> epochs whose persisted snapshot holds the person's memories (of one
    session when `session_id` is given)."""
    rows = await conn.fetch(
        "SELECT session_id, epoch FROM snapshot_people WHERE tenant_id = $1 AND person_id = $2"
        " AND ($3::uuid IS NULL OR session_id = $3) ORDER BY session_id, epoch",
        tenant_id,
        person_id,
        session_id,
    )
    out: dict[UUID, list[int]] = {}
    for r in rows:
        out.setdefault(r["session_id"], []).append(int(r["epoch"]))
    return out


async def read_plan_row(
    conn: Any, tenant_id: str, session_id: UUID, epoch: int
) -> tuple[ContextPlan, PlanSpec]:
    row = await conn.fetchrow(
        "SELECT plan, spec FROM context_plans"
        " WHERE tenant_id = $1 AND session_id = $2 AND epoch = $3",
        tenant_id,
        session_id,
        epoch,
    )
    return ContextPlan.model_validate(row["plan"]), PlanSpec.model_validate(row["spec"])


async def write_redacted_plan(
    conn: Any, tenant_id: str, session_id: UUID, plan: ContextPlan, spec: PlanSpec
) -> None:
    """Replace a plan's persisted snapshot with its redacted form (erasure only), and bump
    the session's plans_revision so every replica's kept copy is read again."""
    await conn.execute(
        "WITH rewritten AS (UPDATE context_plans SET plan = $4, spec = $5"
        " WHERE tenant_id = $1 AND session_id = $2 AND epoch = $3 RETURNING 1)"
        " UPDATE sessions SET plans_revision = plans_revision + 1"
        " WHERE tenant_id = $1 AND session_id = $2 AND EXISTS (SELECT 1 FROM rewritten)",
        tenant_id,
        session_id,
        plan.epoch,
        plan.model_dump(mode="json"),
        spec.model_dump(mode="json"),
    )


async def forget_person(
    conn: Any, tenant_id: str, person_id: str, session_id: UUID, epochs: Sequence[int]
) -> None:
    await conn.execute(
        "DELETE FROM snapshot_people WHERE tenant_id = $1 AND person_id = $2"
        " AND session_id = $3 AND epoch = ANY($4::bigint[])",
        tenant_id,
        person_id,
        session_id,
        list(epochs),
    )


async def bound_runs(
    conn: Any, tenant_id: str, session_id: UUID, epochs: Sequence[int]
) -> list[UUID]:
    """Runs bound (context.snapshot.used) to the snapshot of any of these epochs."""
    rows = await conn.fetch(
        "SELECT DISTINCT run_id FROM snapshot_usages WHERE tenant_id = $1 AND session_id = $2"
        " AND epoch = ANY($3::bigint[]) ORDER BY run_id",
        tenant_id,
        session_id,
        list(epochs),
    )
    return [r["run_id"] for r in rows]
