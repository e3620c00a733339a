"""Plans per (session, epoch): written once, rewritten in place only by an erasure's
redaction, which bumps the session's plans_revision (store/snapshots.py).

Lineages (migrations/0009_plan_lineages.sql; core/epochs.py, Rule 2). Every plan belongs
to a lineage, named by the epoch where it began (`lineage`; NULL stands for the plan's own
epoch). A plan that begins its lineage either forks or merges:
- a fork is an admission's rotation for the admitted run's own change (a reason in
  `epochs.ADMISSION_REASONS`): only the run admitted on it follows it;
- a merge is any other plan that begins a lineage (epoch 1, and a plan rebuilt from a spec
  the caller sent: Rotate with `spec`, Plan after an erasure): every run pinned to an
  earlier epoch follows it, from its next Build.
Every other rotation (from the pinned spec) continues each live lineage: a new epoch per
lineage, rebuilt from that lineage's latest plan, the lineages in order. So a run's lineage
is the latest merge after the epoch it pinned, or else that epoch's lineage, and it builds
on the latest plan of its lineage (store/runs.py, read_run_head). A live lineage is one a
run is on, or the current plan's. The session's current epoch is always its highest: a
fork or merge takes the next epoch, and continuations end with the current lineage, the
most recently begun.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from ..core.epochs import ADMISSION_REASONS
from ..core.errors import NotFoundError
from ..core.plan import ContextPlan
from ..core.spec import PlanSpec
from . import snapshots

__all__ = [
    "ADMISSION_REASON_NAMES",
    "RUN_LINEAGE",
    "StoredPlan",
    "insert_plan",
    "live_lineage_heads",
    "read_plan",
    "set_current_epoch",
]

# The lineage a run builds on, for a run row `r` (tenant_id, session_id, epoch); $3 is the
# admission reasons' names (a plan with one of them that begins a lineage is a fork, not a
# merge). The latest merge after the run's pinned epoch, or else that epoch's lineage.
RUN_LINEAGE = (
    "coalesce((SELECT max(m.epoch) FROM context_plans m"
    " WHERE m.tenant_id = r.tenant_id AND m.session_id = r.session_id AND m.epoch > r.epoch"
    " AND coalesce(m.lineage, m.epoch) = m.epoch AND m.reason <> ALL($3::text[])),"
    " (SELECT coalesce(o.lineage, o.epoch) FROM context_plans o"
    " WHERE o.tenant_id = r.tenant_id AND o.session_id = r.session_id AND o.epoch = r.epoch))"
)


# Rotations decided at a new run's admission: a plan with one of them that begins a lineage
# is a fork (only its run follows it). Only admission decides these (core/epochs.py; Rotate
# refuses them).
ADMISSION_REASON_NAMES = tuple(sorted(r.name for r in ADMISSION_REASONS))


@dataclass(frozen=True, slots=True)
class StoredPlan:
    plan: ContextPlan
    spec: PlanSpec
    secret: bytes
    # The session's plans_revision when the plan was read (erasure bumps it on a rewrite).
    revision: int = 0
    # When the plan was stored (PostgreSQL's clock); ContextPlan.created_at.
    created_at: datetime | None = None
    # The epoch its lineage began at (see above).
    lineage: int = 1


async def insert_plan(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    plan: ContextPlan,
    spec: PlanSpec,
    secret: bytes,
    lineage: int,
) -> datetime:
    """Store a plan in `lineage` (its own epoch: it begins one); returns its created_at."""
    created_at: datetime = await conn.fetchval(
        "INSERT INTO context_plans"
        " (tenant_id, session_id, epoch, reason, prefix_sha256, plan, spec, secret, lineage)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING created_at",
        tenant_id,
        session_id,
        plan.epoch,
        plan.reason.name,
        plan.prefix_sha256,
        plan.model_dump(mode="json"),
        spec.model_dump(mode="json"),
        secret,
        lineage,
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
        "SELECT s.current_epoch, s.plans_revision, p.plan, p.spec, p.secret, p.created_at,"
        " coalesce(p.lineage, p.epoch) AS lineage"
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
    return _stored(row, int(row["plans_revision"]))


async def live_lineage_heads(
    conn: Any, tenant_id: str, session_id: UUID, revision: int
) -> list[StoredPlan]:
    """The latest plan of every live lineage (one a run is on, or the current plan's), in
    lineage order: the current plan's lineage, the most recently begun, last. Call with
    the session locked; `revision` is its plans_revision, read under the lock."""
    rows = await conn.fetch(
        "WITH pinned AS (SELECT DISTINCT tenant_id, session_id, epoch FROM runs"
        "  WHERE tenant_id = $1 AND session_id = $2),"
        " live AS (SELECT " + RUN_LINEAGE + " AS lineage FROM pinned r"
        "  UNION SELECT coalesce(p.lineage, p.epoch) FROM sessions s JOIN context_plans p"
        "  ON p.tenant_id = s.tenant_id AND p.session_id = s.session_id"
        "  AND p.epoch = s.current_epoch WHERE s.tenant_id = $1 AND s.session_id = $2)"
        " SELECT DISTINCT ON (l.lineage) l.lineage, p.plan, p.spec, p.secret, p.created_at"
        " FROM live l JOIN context_plans p ON p.tenant_id = $1 AND p.session_id = $2"
        " AND coalesce(p.lineage, p.epoch) = l.lineage"
        " ORDER BY l.lineage, p.epoch DESC",
        tenant_id,
        session_id,
        list(ADMISSION_REASON_NAMES),
    )
    return [_stored(r, revision) for r in rows]


def _stored(row: Any, revision: int) -> StoredPlan:
    return StoredPlan(
        plan=ContextPlan.model_validate(row["plan"]),
        spec=PlanSpec.model_validate(row["spec"]),
        secret=bytes(row["secret"]),
        revision=revision,
        created_at=row["created_at"],
        lineage=int(row["lineage"]),
    )
