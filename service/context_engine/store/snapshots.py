"""Snapshot bindings and erasure: which runs used which plan snapshot, and which persisted
snapshots hold whose memories. Call every writer with the session locked: the session row
lock is the fence between a run binding to a snapshot and an erasure redacting it.

The people fence is the other one, between persisting a snapshot and erasing a person
named in it: a transaction persisting a caller's snapshot holds each named person's
advisory lock shared (fence_people), an erasure holds it exclusively (fence_erasure), and
both take it before any session lock, so the order is the same everywhere and cannot
deadlock. Either the erasure waits for the snapshot to commit and then finds it, or the
snapshot's transaction waits for the erasure and then finds the person erased.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from ..core.canonical import as_parsed
from ..core.plan import ContextPlan
from ..core.snapshot import named_people
from ..core.spec import PlanSpec
from .db import lock_wait_ms

__all__ = [
    "bound_runs",
    "erased_among",
    "fence_erasure",
    "fence_people",
    "forget_person",
    "plans_holding",
    "read_plan_row",
    "record_people",
    "requests_naming",
    "rewrite_request",
    "sessions_naming",
    "write_redacted_plan",
]


# One advisory lock per (tenant, person), in its own key space: hashtextextended spreads
# them over 64 bits; two people sharing a key only ever wait for each other. A snapshot
# names at most MAX_PEOPLE_NAMED people (api/convert.py), so one Plan holds at most that
# many entries of PostgreSQL's shared lock table.
_PERSON_LOCK = "hashtextextended('erasure' || chr(31) || $1 || chr(31) || {person}, 0)"


def _erased_key(person_id: str) -> str:
    """How erased_people names a person: a hash, so the record of an erasure does not
    keep the erased person's id."""
    return hashlib.sha256(person_id.encode("utf-8")).hexdigest()


async def fence_people(conn: Any, tenant_id: str, people: Sequence[str]) -> list[str]:
    """Hold the named people's fence until the transaction ends; -> those already erased.

    The locks are taken in key order, all within LOCK_WAIT_SECONDS (migrations/0022: one
    wait each, several people being erased one after another outlasted the statement's
    timeout, STORE_UNAVAILABLE where SESSION_BUSY was meant). Two statements on purpose:
    the check must read a snapshot taken after the locks are granted, so an erasure that
    committed while this waited is seen."""
    if not people:
        return []
    named = sorted(set(people))
    await conn.execute(
        "SELECT lock_shared_before(array(SELECT DISTINCT "
        + _PERSON_LOCK.format(person="p")
        + " AS k FROM unnest($2::text[]) AS p ORDER BY k),"
        " clock_timestamp() + $3 * interval '1 millisecond')",
        tenant_id,
        named,
        lock_wait_ms(),
    )
    return await erased_among(conn, tenant_id, named)


async def erased_among(conn: Any, tenant_id: str, people: Sequence[str]) -> list[str]:
    """Those of `people` erased from the tenant, sorted; no fence taken (an erasure is
    final, so one seen erased stays so: what a refusal names)."""
    if not people:
        return []
    by_key = {_erased_key(p): p for p in set(people)}
    rows = await conn.fetch(
        "SELECT person_sha256 FROM erased_people WHERE tenant_id = $1"
        " AND person_sha256 = ANY($2::text[])",
        tenant_id,
        list(by_key),
    )
    return sorted(by_key[r["person_sha256"]] for r in rows)


async def fence_erasure(conn: Any, tenant_id: str, person_id: str) -> dict[str, Any] | None:
    """Hold the person's fence exclusively until the transaction ends, and record them as
    erased: snapshots persisted before are committed (and found), later ones refused.
    Returns what erasing them has done before (None the first time, or for an erasure
    made before outcomes were kept: migrations/0015_erasure_outcome.sql)."""
    await conn.execute(
        "SELECT pg_advisory_xact_lock(" + _PERSON_LOCK.format(person="$2") + ")",
        tenant_id,
        person_id,
    )
    # A resend writes nothing: the first erasure's row and time stay as they were, and its
    # outcome is read (the fence held above keeps any other erasure of the person out).
    earlier: dict[str, Any] | None = await conn.fetchval(
        "WITH added AS (INSERT INTO erased_people (tenant_id, person_sha256) VALUES ($1, $2)"
        " ON CONFLICT (tenant_id, person_sha256) DO NOTHING RETURNING outcome)"
        " SELECT outcome FROM added UNION ALL SELECT outcome FROM erased_people"
        " WHERE tenant_id = $1 AND person_sha256 = $2 AND NOT EXISTS (SELECT FROM added)",
        tenant_id,
        _erased_key(person_id),
    )
    return earlier


async def record_erasure_outcome(
    conn: Any, tenant_id: str, person_id: str, outcome: dict[str, Any]
) -> None:
    """Keep what erasing the person has done so far (fence_erasure returns it next time)."""
    await conn.execute(
        "UPDATE erased_people SET outcome = $3 WHERE tenant_id = $1 AND person_sha256 = $2"
        " AND outcome IS DISTINCT FROM $3",  # an erasure that found nothing new writes nothing
        tenant_id,
        _erased_key(person_id),
        outcome,
    )


async def record_people(
    conn: Any, tenant_id: str, session_id: UUID, epoch: int, spec: PlanSpec
) -> None:
    """Index the people whose memories the plan's persisted snapshot holds."""
    people = named_people(spec)
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
    spec = PlanSpec.model_validate(as_parsed(row["spec"]))  # jsonb's numerics as parsed
    return ContextPlan.model_validate(row["plan"]), spec


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


async def requests_naming(
    conn: Any, tenant_id: str, person_id: str, session_id: UUID | None = None
) -> dict[UUID, list[tuple[int, UUID, dict[str, Any]]]]:
    """Session -> (sequence, run id, payload) of the recorded requests whose people index
    names the person (core/build_record.py, Rule 4; of one session when given)."""
    rows = await conn.fetch(
        "SELECT session_id, sequence, run_id, payload FROM session_events"
        " WHERE tenant_id = $1 AND type = 'model.request.started'"
        " AND payload -> 'people' ? $2 AND ($3::uuid IS NULL OR session_id = $3)"
        " ORDER BY session_id, sequence",
        tenant_id,
        person_id,
        session_id,
    )
    out: dict[UUID, list[tuple[int, UUID, dict[str, Any]]]] = {}
    for r in rows:
        found = (int(r["sequence"]), r["run_id"], r["payload"])
        out.setdefault(r["session_id"], []).append(found)
    return out


async def sessions_naming(conn: Any, tenant_id: str, person_id: str) -> list[UUID]:
    """The sessions with a recorded request whose recall or correction lines name the
    person: requests_naming's keys without reading a payload (an erasure's first pass,
    under the person's exclusive fence, read every such payload for their session ids)."""
    rows = await conn.fetch(
        "SELECT DISTINCT session_id FROM session_events"
        " WHERE tenant_id = $1 AND type = 'model.request.started' AND payload -> 'people' ? $2",
        tenant_id,
        person_id,
    )
    return [r["session_id"] for r in rows]


async def rewrite_request(
    conn: Any, tenant_id: str, session_id: UUID, sequence: int, payload: dict[str, Any]
) -> None:
    """Replace a recorded request's payload with its redacted form (erasure only: the one
    in-place change to the log)."""
    await conn.execute(
        "UPDATE session_events SET payload = $4"
        " WHERE tenant_id = $1 AND session_id = $2 AND sequence = $3"
        " AND type = 'model.request.started'",
        tenant_id,
        session_id,
        sequence,
        payload,
    )
