"""Log reads for working state and compaction: the working-state events a carry folds,
fact evidence and elided spans by sequence, fact evidence by item id, and the session's
next sequence."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from ..core.working_state import SOURCE_TRUST_OF_EVENT, LoggedUpdate, WorkingStateUpdate, Writer

__all__ = [
    "WORKING_STATE_UPDATED",
    "latest_top_level_run",
    "next_sequence",
    "read_carried_user_texts",
    "read_events_at",
    "read_evidence_at",
    "read_working_state_updates",
    "resolve_item_ids",
    "unseen_by_run",
]

WORKING_STATE_UPDATED = "context.working_state.updated"


async def read_working_state_updates(
    conn: Any, tenant_id: str, session_id: UUID, below_sequence: int, above_sequence: int = 0
) -> list[LoggedUpdate]:
    """Working-state events of the session's top-level runs strictly between two
    sequences, oldest first. A child run's working state is its own and never carries."""
    rows = await conn.fetch(
        "SELECT e.sequence, e.run_id, e.payload FROM session_events e"
        " JOIN runs r ON r.tenant_id = e.tenant_id AND r.run_id = e.run_id"
        " WHERE e.tenant_id = $1 AND e.session_id = $2 AND e.type = $3 AND e.sequence < $4"
        " AND e.sequence > $5 AND r.parent_run_id IS NULL ORDER BY e.sequence",
        tenant_id,
        session_id,
        WORKING_STATE_UPDATED,
        below_sequence,
        above_sequence,
    )
    return [
        LoggedUpdate(
            sequence=r["sequence"],
            run_id=str(r["run_id"]),
            writer=Writer[r["payload"]["writer"].upper()],
            update=WorkingStateUpdate.model_validate(r["payload"]["update"]),
        )
        for r in rows
    ]


async def read_events_at(
    conn: Any, tenant_id: str, session_id: UUID, sequences: list[int]
) -> dict[int, tuple[str, dict[str, Any]]]:
    """(type, payload) of the session's events at the given sequences; absent ones omitted."""
    if not sequences:
        return {}
    rows = await conn.fetch(
        "SELECT sequence, type, payload FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND sequence = ANY($3::bigint[])",
        tenant_id,
        session_id,
        sorted(set(sequences)),
    )
    return {r["sequence"]: (r["type"], r["payload"]) for r in rows}


async def read_evidence_at(
    conn: Any, tenant_id: str, session_id: UUID, sequences: list[int]
) -> dict[int, tuple[str, dict[str, Any], bool]]:
    """(type, payload, in the session's conversation) of the events at the given sequences;
    absent ones omitted. A child run's events are in the log but not the conversation."""
    if not sequences:
        return {}
    rows = await conn.fetch(
        "SELECT sequence, type, payload, in_history FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND sequence = ANY($3::bigint[])",
        tenant_id,
        session_id,
        sorted(set(sequences)),
    )
    return {r["sequence"]: (r["type"], r["payload"], r["in_history"]) for r in rows}


# Every item of an id the run may have been shown: its own, and the conversation below its
# seed (what it carries; a child run, with no seed, carries none). An id is unique only
# within its run, so several runs may hold it (a worker numbering each run's items alike),
# and the model cannot tell which it meant: each is evidence, so the least trusted decides
# (a review: the run's own user message "3" took the citation of an earlier run's page "3",
# and the page's paraphrase was USER, Established, offered to formation). One of each kind
# of evidence (type, conversation or not, trust), the newest: the fact's trust is the same,
# and a worker numbering alike adds one per kind, not one per run.
_ITEMS_BY_ID = (
    "SELECT DISTINCT ON (item_id, type, in_history, payload ->> 'trust') item_id, sequence"
    " FROM session_events"
    " WHERE tenant_id = $1 AND session_id = $2 AND item_id = ANY($3::text[])"
    " AND type = ANY($6::text[]) AND (run_id = $4 OR (in_history AND sequence < $5))"
    " ORDER BY item_id, type, in_history, payload ->> 'trust', sequence DESC"
)


async def resolve_item_ids(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    seed_event_sequence: int | None,
    item_ids: list[str],
) -> dict[str, list[int]]:
    """item id -> the sequences of the conversation events of that id the run may have
    been shown (its own, and those below its seed), the newest of each kind of evidence,
    in session order. Ids naming none are omitted. An index range per id
    (migrations/0025)."""
    if not item_ids:
        return {}
    rows = await conn.fetch(
        _ITEMS_BY_ID,
        tenant_id,
        session_id,
        sorted(set(item_ids)),
        run_id,
        seed_event_sequence or 0,
        sorted(SOURCE_TRUST_OF_EVENT),
    )
    found: dict[str, list[int]] = {}
    for row in rows:
        found.setdefault(row["item_id"], []).append(int(row["sequence"]))
    return {item_id: sorted(sequences) for item_id, sequences in found.items()}


async def read_carried_user_texts(
    conn: Any, tenant_id: str, session_id: UUID, below_sequence: int, limit: int
) -> list[str]:
    """The texts of the newest `limit` user messages of the session's conversation below
    `below_sequence` (a run's seed cut: what it carries), newest first."""
    rows = await conn.fetch(
        "SELECT payload ->> 'text' AS text FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND type = 'user.message.created'"
        " AND in_history AND sequence < $3 ORDER BY sequence DESC LIMIT $4",
        tenant_id,
        session_id,
        below_sequence,
        limit,
    )
    return [r["text"] or "" for r in rows]


async def unseen_by_run(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    seed_event_sequence: int | None,
    sequences: list[int],
) -> set[int]:
    """Those of `sequences` that are events of the session the run was not shown: neither
    its own nor the conversation below its seed (resolve_item_ids' view, for evidence
    named by sequence)."""
    if not sequences:
        return set()
    rows = await conn.fetch(
        "SELECT sequence FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND sequence = ANY($3::bigint[])"
        " AND run_id IS DISTINCT FROM $4 AND NOT (in_history AND sequence < $5)",
        tenant_id,
        session_id,
        sorted(set(sequences)),
        run_id,
        seed_event_sequence or 0,
    )
    return {int(r["sequence"]) for r in rows}


async def next_sequence(conn: Any, tenant_id: str, session_id: UUID) -> int:
    """The sequence the session's next event will get. Call with the session locked."""
    last = await conn.fetchval(
        "SELECT last_sequence FROM sessions WHERE tenant_id = $1 AND session_id = $2",
        tenant_id,
        session_id,
    )
    return int(last) + 1


async def latest_top_level_run(conn: Any, tenant_id: str, session_id: UUID) -> UUID | None:
    """The session's most recently seeded top-level run, if any."""
    value = await conn.fetchval(
        "SELECT run_id FROM runs WHERE tenant_id = $1 AND session_id = $2"
        " AND parent_run_id IS NULL ORDER BY seed_event_sequence DESC NULLS LAST LIMIT 1",
        tenant_id,
        session_id,
    )
    return value if value is None else UUID(str(value))
