"""Plans per (session, epoch): written once, rewritten in place only by an erasure's
redaction, which bumps the session's plans_revision (store/snapshots.py).

Lineages (migrations/0009_plan_lineages.sql, 0010_plan_sweeps.sql; core/epochs.py,
Rule 2). Every plan belongs to a lineage, named by the epoch where it began (`lineage`;
NULL stands for the plan's own epoch). A plan that begins its lineage either forks or
merges:
- a fork is an admission's rotation for the admitted run's own change (a reason in
  `epochs.ADMISSION_REASONS`): only the run admitted on it follows it;
- a merge is any other plan that begins a lineage (epoch 1, and a Rotate with `spec`: the
  caller's spec states every run's configuration and authority): every run pinned to an
  earlier epoch follows it, from its next Build.
Every other rotation continues a lineage: a new epoch rebuilt from that lineage's latest
plan (its head). So a run's lineage is the latest merge after the epoch it pinned, or else
that epoch's lineage, and it builds on the head of its lineage (store/runs.py,
read_run_head).

A rotation every run follows but made from the pinned specs (a Rotate without spec, a
builder upgrade or canonicalization at an admission, a Plan after an erasure) is a sweep
(`sweep`): it continues the session's current lineage at once, and every other lineage is
continued lazily, from its own head, with the sweep's reason (and the sweep's snapshot,
the session's memory, which every lineage shares), the first time a run on it builds, a
child is pinned to it or a LoadSkill names a run on it, under the session lock
(api/engine.py, _catch_up). A lineage is
behind while its head is older than the session's latest sweep. Continued, it takes the
latest sweep's reason, except that a canonicalization (a copy) does not hide a rebuild:
when a rebuilding sweep (a builder upgrade, a Plan after an erasure with its fresh
snapshot, ...) is newer than the head, the lineage is rebuilt with that sweep's reason and
snapshot (whose hashes are canonical already); it is a copy only when every sweep since
its head was one (latest_sweep, `rebuilding`). An erasure needs no sweep:
it invalidates exactly the plans holding the person, and a run's Build (or an admission,
for the current plan) continues an invalidated head's lineage the same way. So a rotation
costs one epoch, not one per lineage ever forked, and a lineage no run uses again is never
rebuilt.

The session's current plan is the head of its current lineage: a fork, a merge and a
sweep become it; a lazy continuation of another lineage does not (it takes the next epoch
all the same: epochs are allocated as the session's highest plus one, next_epoch). Every
sweep is at or below the current epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from ..core.canonical import as_parsed
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
    "latest_sweep",
    "lineage_of",
    "next_epoch",
    "read_distinct_prefixes",
    "read_plan",
    "read_tool_names",
    "set_current_epoch",
]

# Rotations decided at a new run's admission: a plan with one of them that begins a lineage
# is a fork (only its run follows it). Only admission decides these (core/epochs.py; Rotate
# refuses them).
ADMISSION_REASON_NAMES = tuple(sorted(r.name for r in ADMISSION_REASONS))

# The lineage a run builds on, for a run row `r` (tenant_id, session_id, epoch): the latest
# merge after the run's pinned epoch, or else that epoch's lineage. The admission reasons
# are inlined, as in the predicate of migrations/0010's context_plans_merges index, so the
# planner can prove the index applies (a parameter it cannot); with
# context_plans_by_lineage, a Build's head read costs the same however many plans the
# session has (tests/integration/test_plan_service.py checks the plan).
_NOT_A_FORK = "reason NOT IN (" + ", ".join(f"'{n}'" for n in ADMISSION_REASON_NAMES) + ")"
RUN_LINEAGE = (
    "coalesce((SELECT max(m.epoch) FROM context_plans m"
    " WHERE m.tenant_id = r.tenant_id AND m.session_id = r.session_id AND m.epoch > r.epoch"
    " AND coalesce(m.lineage, m.epoch) = m.epoch AND m." + _NOT_A_FORK + "),"
    " (SELECT coalesce(o.lineage, o.epoch) FROM context_plans o"
    " WHERE o.tenant_id = r.tenant_id AND o.session_id = r.session_id AND o.epoch = r.epoch))"
)


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
    *,
    sweep: bool = False,
) -> datetime:
    """Store a plan in `lineage` (its own epoch: it begins one), a `sweep` or not (see
    above); returns its created_at."""
    created_at: datetime = await conn.fetchval(
        "INSERT INTO context_plans (tenant_id, session_id, epoch, reason, prefix_sha256,"
        " plan, spec, secret, lineage, sweep)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) RETURNING created_at",
        tenant_id,
        session_id,
        plan.epoch,
        plan.reason.name,
        plan.prefix_sha256,
        plan.model_dump(mode="json"),
        spec.model_dump(mode="json"),
        secret,
        lineage,
        sweep,
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
        what = f"epoch {epoch}" if epoch else "plan yet"
        raise NotFoundError(
            f"session {session_id} has no {what}",
            field="epoch" if epoch else "session_id",
            reason="PLAN_NOT_FOUND",
        )
    return _stored(row, int(row["plans_revision"]))


async def read_distinct_prefixes(
    conn: Any, tenant_id: str, session_id: UUID, epochs: Sequence[int]
) -> list[StoredPlan]:
    """Of the plans of `epochs` (those the session has), the first of each prefix content
    (migrations/0016 `prefix_content_key`: plans of one key hold the same enveloped prefix
    entries, core/plan.py prefix_data). One round trip; the choice reads no plan, so a
    session of many epochs over few contents decodes few plans. Their `revision` is not
    read (0): they are not for a replica to keep."""
    rows = await conn.fetch(
        "SELECT p.plan, p.spec, p.secret, p.created_at, coalesce(p.lineage, p.epoch) AS lineage"
        " FROM context_plans p WHERE p.tenant_id = $1 AND p.session_id = $2 AND p.epoch IN ("
        " SELECT DISTINCT ON (prefix_content_key) epoch FROM context_plans"
        " WHERE tenant_id = $1 AND session_id = $2 AND epoch = ANY($3::bigint[])"
        " ORDER BY prefix_content_key, epoch)"
        " ORDER BY p.epoch",
        tenant_id,
        session_id,
        list(epochs),
    )
    return [_stored(row, 0) for row in rows]


async def read_tool_names(
    conn: Any, tenant_id: str, session_id: UUID, epochs: Sequence[int]
) -> frozenset[str]:
    """Every tool the plans of `epochs` offer, defined or deferred. Read from each plan, not
    one per prefix content (read_distinct_prefixes): plans of one content can differ in the
    tools a run was granted (a review: a granted tool's calls were taken for quotes). One
    round trip; each plan decoded for two lists (about 10 us for a 12 kB plan)."""
    rows = await conn.fetch(
        "SELECT DISTINCT n.name FROM context_plans p CROSS JOIN LATERAL"
        " jsonb_array_elements_text(coalesce(p.plan -> 'tool_names', '[]'::jsonb)"
        " || coalesce(p.plan -> 'deferred_tool_names', '[]'::jsonb)) AS n(name)"
        " WHERE p.tenant_id = $1 AND p.session_id = $2 AND p.epoch = ANY($3::bigint[])",
        tenant_id,
        session_id,
        list(epochs),
    )
    return frozenset(r["name"] for r in rows)


async def next_epoch(conn: Any, tenant_id: str, session_id: UUID) -> int:
    """The epoch a new plan takes: the session's highest plus one (a lazy continuation may
    be above the current epoch). Call with the session locked."""
    highest = await conn.fetchval(
        "SELECT max(epoch) FROM context_plans WHERE tenant_id = $1 AND session_id = $2",
        tenant_id,
        session_id,
    )
    return int(highest or 0) + 1


async def lineage_of(conn: Any, tenant_id: str, session_id: UUID, epoch: int) -> int:
    """The lineage of the plan of `epoch` (its own epoch for a plan stored without one)."""
    lineage = await conn.fetchval(
        "SELECT coalesce(lineage, epoch) FROM context_plans"
        " WHERE tenant_id = $1 AND session_id = $2 AND epoch = $3",
        tenant_id,
        session_id,
        epoch,
    )
    return int(lineage or epoch)


async def latest_sweep(
    conn: Any, tenant_id: str, session_id: UUID, revision: int, *, rebuilding: bool = False
) -> StoredPlan | None:
    """The session's latest sweep (see above), or None; `rebuilding`: the latest that
    rebuilds, skipping canonicalizations (copies). `revision` is the session's
    plans_revision, read under its lock."""
    row = await conn.fetchrow(
        "SELECT p.plan, p.spec, p.secret, p.created_at, coalesce(p.lineage, p.epoch) AS lineage"
        " FROM context_plans p WHERE p.tenant_id = $1 AND p.session_id = $2 AND p.sweep"
        " AND NOT ($3 AND p.reason = 'PREFIX_HASH_CANONICALIZED')"
        " ORDER BY p.epoch DESC LIMIT 1",
        tenant_id,
        session_id,
        rebuilding,
    )
    return None if row is None else _stored(row, revision)


def _stored(row: Any, revision: int) -> StoredPlan:
    return StoredPlan(
        plan=ContextPlan.model_validate(row["plan"]),
        spec=PlanSpec.model_validate(as_parsed(row["spec"])),
        secret=bytes(row["secret"]),
        revision=revision,
        created_at=row["created_at"],
        lineage=int(row["lineage"]),
    )
