"""The append-only session event log."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from uuid import UUID

from pydantic import TypeAdapter

from ..core.errors import NotFoundError
from ..core.items import ConversationItem
from ..core.log_tail import FloorFacts, Logged

__all__ = [
    "EVENT_TYPE_OF_ITEM",
    "NewEvent",
    "Redaction",
    "Shown",
    "append_events",
    "item_payload",
    "read_carried_items",
    "read_carried_results",
    "read_events",
    "read_floor_facts",
    "read_history_page",
    "read_items_at",
    "read_logged_call_ids",
    "read_runs_shown",
    "read_shown",
    "redaction_of",
    "run_saw_erased",
]

# The log's event type for each loggable conversation item kind. Reasoning items are
# absent on purpose: they are never logged (ADR-0007).
EVENT_TYPE_OF_ITEM: dict[str, str] = {
    "user_message": "user.message.created",
    "assistant_message": "assistant.message.created",
    "tool_call": "tool.call.created",
    "tool_result": "tool.result.created",
}

_ITEMS: TypeAdapter[ConversationItem] = TypeAdapter(ConversationItem)


@dataclass(frozen=True, slots=True)
class NewEvent:
    type: str
    payload: dict[str, Any]
    run_id: UUID | None = None
    item_id: str | None = None
    in_history: bool = False


def item_payload(item: ConversationItem) -> dict[str, Any]:
    """An item as stored: everything but where it sits in the log (sequence, run)."""
    return item.model_dump(mode="json", exclude={"sequence", "run_id"})


async def append_events(
    conn: Any, tenant_id: str, session_id: UUID, events: Sequence[NewEvent]
) -> list[int]:
    """Append events in order; returns their sequences. Call with the session locked.

    One round trip: the session's sequence counter moves and the events land in the same
    statement (the lock taken before makes the counter ours)."""
    if not events:
        return []
    rows = await conn.fetch(
        _APPEND,
        tenant_id,
        session_id,
        len(events),
        [e.type for e in events],
        [e.run_id for e in events],
        [e.item_id for e in events],
        [e.in_history for e in events],
        [e.payload for e in events],
    )
    if len(rows) != len(events):
        raise NotFoundError(
            f"session {session_id} not found", field="session_id", reason="SESSION_NOT_FOUND"
        )
    first = min(r["sequence"] for r in rows)
    return list(range(first, first + len(events)))


# Sequences continue the session's counter: the n-th event (from 1) gets last + n. Rows go
# in in sequence order: the trigger of migrations/0012_history_pairs.sql pairs a result with
# its call, and counts, over the rows before it, those of this statement included.
_APPEND = (
    "WITH allocated AS ("
    " UPDATE sessions SET last_sequence = last_sequence + $3"
    " WHERE tenant_id = $1 AND session_id = $2 RETURNING last_sequence - $3 AS last)"
    " INSERT INTO session_events"
    " (tenant_id, session_id, sequence, type, run_id, item_id, in_history, payload)"
    " SELECT $1, $2, allocated.last + e.n, e.type, e.run_id, e.item_id, e.in_history, e.payload"
    " FROM allocated,"
    " unnest($4::text[], $5::uuid[], $6::text[], $7::boolean[], $8::jsonb[])"
    " WITH ORDINALITY AS e(type, run_id, item_id, in_history, payload, n)"
    " ORDER BY e.n"
    " RETURNING sequence"
)


async def read_carried_items(
    conn: Any, tenant_id: str, session_id: UUID, below_sequence: int, above_sequence: int = 0
) -> list[ConversationItem]:
    """Conversation items of top-level runs with above < sequence < below, oldest first."""
    rows = await conn.fetch(
        "SELECT sequence, run_id, payload FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND in_history"
        " AND sequence < $3 AND sequence > $4 ORDER BY sequence",
        tenant_id,
        session_id,
        below_sequence,
        above_sequence,
    )
    return [_item(r) for r in rows]


async def read_carried_results(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    below_sequence: int,
    trust_levels: Sequence[int],
    limit: int,
    max_chars: int,
    *,
    except_tool: str | None = None,
    own_run: UUID | None = None,
    others_below: int | None = None,
) -> list[ConversationItem]:
    """The newest tool results of top-level runs below `below_sequence` (a run's seed cut:
    what it carries) whose trust is one of `trust_levels`, and not of `except_tool`,
    newest first: at most `limit` of them, and no more once `max_chars` characters of
    content (and excerpt) are read, the one crossing it included. With `others_below`,
    those at or above it only of `own_run` (a run reading past its seed cut reads its own
    results there, not another run's it was never shown). The by-type index, walked
    backward."""
    rows = await conn.fetch(
        "SELECT sequence, run_id, payload FROM ("
        "  SELECT sequence, run_id, payload, sum(length(payload->>'content')"
        "    + coalesce(length(payload->>'context_content'), 0))"
        "    OVER (ORDER BY sequence DESC) AS read FROM ("
        "      SELECT sequence, run_id, payload FROM session_events"
        "      WHERE tenant_id = $1 AND session_id = $2 AND type = 'tool.result.created'"
        "      AND in_history AND sequence < $3"
        "      AND (payload->>'trust')::int = ANY($4::int[])"
        "      AND payload->>'tool_name' IS DISTINCT FROM $7"
        "      AND (sequence < $8 OR run_id = $9)"
        "      ORDER BY sequence DESC LIMIT $5) newest"
        ") counted"
        " WHERE read - length(payload->>'content')"
        "   - coalesce(length(payload->>'context_content'), 0) < $6"
        " ORDER BY sequence DESC",
        tenant_id,
        session_id,
        below_sequence,
        list(trust_levels),
        limit,
        max_chars,
        except_tool,
        below_sequence if others_below is None else others_below,
        own_run,
    )
    return [_item(r) for r in rows]


async def read_items_at(
    conn: Any, tenant_id: str, session_id: UUID, sequences: Sequence[int]
) -> list[ConversationItem]:
    """The conversation items logged at `sequences` (of any run), oldest first; a sequence
    holding no conversation item is omitted."""
    if not sequences:
        return []
    rows = await conn.fetch(
        "SELECT sequence, run_id, payload FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND sequence = ANY($3::bigint[])"
        " AND type = ANY($4::text[]) ORDER BY sequence",
        tenant_id,
        session_id,
        sorted(set(sequences)),
        list(EVENT_TYPE_OF_ITEM.values()),
    )
    return [_item(r) for r in rows]


def _item(row: Any) -> ConversationItem:
    """A conversation event's item, placed where it sits in the log (sequence, run)."""
    return _ITEMS.validate_python(
        {**row["payload"], "sequence": row["sequence"], "run_id": str(row["run_id"] or "")}
    )


async def read_history_page(
    conn: Any, tenant_id: str, session_id: UUID, below: int, above: int, limit: int
) -> list[Logged]:
    """The newest `limit` conversation events of top-level runs with above < sequence <
    below, returned oldest first, each with what the log recorded with it (core/log_tail.py).
    Fewer than `limit`: that is all of them. The history index, walked backward."""
    rows = await conn.fetch(
        "SELECT sequence, run_id, payload, answers, carried_through FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND in_history"
        " AND sequence < $3 AND sequence > $4 ORDER BY sequence DESC LIMIT $5",
        tenant_id,
        session_id,
        below,
        above,
        limit,
    )
    return [Logged(_item(r), r["answers"], r["carried_through"]) for r in reversed(rows)]


async def read_floor_facts(
    conn: Any, tenant_id: str, session_id: UUID, floor: int, below: int
) -> FloorFacts:
    """The running count at a summary floor, and the results with floor < sequence < below
    whose call lies at or below it (core/log_tail.py, Rule 2): an index probe, and a count
    over the index of the results between the floor and `below`."""
    row = await conn.fetchrow(
        "SELECT coalesce((SELECT carried_through FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND in_history AND sequence <= $3"
        " ORDER BY sequence DESC LIMIT 1), 0) AS weight,"
        " (SELECT count(*) FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND answers IS NOT NULL"
        " AND sequence > $3 AND sequence < $4 AND answers <= $3) AS straddling",
        tenant_id,
        session_id,
        floor,
        below,
    )
    return FloorFacts(weight=int(row["weight"]), straddling=int(row["straddling"]))


async def read_events(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    *,
    types: Sequence[str] | None = None,
    after_sequence: int = 0,
    limit: int = 1000,
) -> list[dict[str, Any]]:
    """Raw events for inspection (inspect, explain), oldest first."""
    rows = await conn.fetch(
        "SELECT sequence, type, run_id, item_id, payload, created_at FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND sequence > $3"
        " AND ($4::text[] IS NULL OR type = ANY($4)) ORDER BY sequence LIMIT $5",
        tenant_id,
        session_id,
        after_sequence,
        list(types) if types is not None else None,
        limit,
    )
    return [dict(r) for r in rows]


class Redaction(NamedTuple):
    """What an erasure has redacted of a recorded request, as the database holds it now
    (redaction_of)."""

    record: bool  # its recall lines (the record's)
    plan: bool  # the snapshot of the plan it was built on
    revision: int  # the session's plans_revision: an erasure's rewrite of a plan bumps it


async def redaction_of(
    conn: Any, tenant_id: str, session_id: UUID, sequence: int, epoch: int
) -> Redaction:
    """What an erasure has redacted of the request recorded at `sequence`, built on plan
    `epoch`. GetBuild asks before and after its rebuild: an erasure committing while it
    rebuilt from what it had read before would otherwise be served."""
    row = await conn.fetchrow(
        "SELECT (SELECT coalesce((payload ->> 'redacted')::boolean, false) FROM session_events"
        "        WHERE tenant_id = $1 AND session_id = $2 AND sequence = $3) AS record,"
        "       (SELECT invalidated FROM context_plans"
        "        WHERE tenant_id = $1 AND session_id = $2 AND epoch = $4) AS plan,"
        "       (SELECT plans_revision FROM sessions"
        "        WHERE tenant_id = $1 AND session_id = $2) AS revision",
        tenant_id,
        session_id,
        sequence,
        epoch,
    )
    return Redaction(bool(row["record"]), bool(row["plan"]), int(row["revision"] or 0))


class Shown(NamedTuple):
    """What the session's recorded requests showed the models over a range (read_shown)."""

    lines: list[tuple[str, dict[str, Any]]]  # (step field, line as recorded), distinct
    epochs: list[int]  # the plan epochs they were built on, distinct, in order


async def read_shown(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    *,
    inputs_key: str,
    fields: Sequence[str],
    from_sequence: int,
    in_view: Sequence[str],
) -> Shown:
    """The distinct step lines, as (step field, line as recorded), and the plan epochs,
    that the session's model.request.started events recorded (lines under `inputs_key`)
    over the range that showed the models what the items above `from_sequence` may quote
    (`_REQUESTS_FROM`; `in_view`: the run ids of those items, "" for an item logged
    without one), in a stable order. One round trip reading each request's payload once:
    the lines and the epochs were two queries, each decompressing every payload of the
    range, twice per compaction and the second time under the session lock (a triage).
    An index probe per run in view bounds the range, and a line recorded by many requests
    comes back once."""
    rows = await conn.fetch(
        _SHOWN,
        tenant_id,
        session_id,
        from_sequence,
        *_runs(in_view),
        list(fields),
        inputs_key,
    )
    return _as_shown(rows)


async def read_runs_shown(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    run_ids: Sequence[UUID],
    *,
    inputs_key: str,
    fields: Sequence[str],
) -> Shown:
    """read_shown of the requests of the runs named alone: what their models were shown
    (UpdateWorkingState holds a fact to the run's own and the recent runs' it carries).
    Other runs' requests are not read (an audit: from the run's seed on, every request of
    the session since was decompressed, under the session lock)."""
    rows = await conn.fetch(
        _RUN_SHOWN, tenant_id, session_id, list(run_ids), list(fields), inputs_key
    )
    return _as_shown(rows)


async def recent_requesting_runs(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    *,
    below: int,
    limit: int,
) -> list[UUID]:
    """The runs that recorded requests below sequence `below`, newest first, at most
    `limit`: those whose step lines a run's carried history may quote, or may have quoted
    before a compaction summarized it (api/working_state.py). Read by the type index,
    requests only."""
    rows = await conn.fetch(
        "SELECT run_id FROM session_events WHERE tenant_id = $1 AND session_id = $2"
        f" AND type = {_REQUEST} AND sequence < $3 AND run_id IS NOT NULL"
        " GROUP BY run_id ORDER BY max(sequence) DESC LIMIT $4",
        tenant_id,
        session_id,
        below,
        limit,
    )
    return [r["run_id"] for r in rows]


async def run_saw_erased(
    conn: Any, tenant_id: str, session_id: UUID, run_ids: Sequence[UUID], epochs: Sequence[int]
) -> bool:
    """Whether an erasure has since taken something out of what the model of `run_ids` (a
    run and the earlier runs whose step lines a fact is compared with) was shown: a recall
    line of one of their requests (a redacted record), or a snapshot memory a plan
    `epochs` names rendered. What it took is no longer there to compare a working-state
    fact with (api/working_state.py; the earlier runs' too: an audit found a line an
    erasure took out of run 1's record restated in run 2 as the user's). An erasure
    rewrites an invalidated plan's document
    but keeps its hash (core/snapshot.py redact_person): the two disagree only where a
    rendered memory was taken out, not where the erased one was skipped for room (a
    review: every fact of such a run was held at MEMORY for a memory it never saw)."""
    return bool(
        await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM session_events"
            f"  WHERE tenant_id = $1 AND session_id = $2 AND type = {_REQUEST}"
            "   AND run_id = ANY($3::uuid[]) AND coalesce((payload ->> 'redacted')::boolean,"
            "   false))"
            " OR EXISTS (SELECT 1 FROM context_plans"
            "  WHERE tenant_id = $1 AND session_id = $2 AND epoch = ANY($4::bigint[])"
            "   AND invalidated AND encode(sha256(convert_to(plan ->> 'prefix_document',"
            "   'UTF8')), 'hex') IS DISTINCT FROM plan ->> 'prefix_sha256')",
            tenant_id,
            session_id,
            list(run_ids),
            list(epochs),
        )
    )


def _as_shown(rows: Sequence[Any]) -> Shown:
    lines = [(r["field"], r["line"]) for r in rows if r["field"] is not None]
    return Shown(lines, [r["epoch"] for r in rows if r["field"] is None])


async def read_logged_call_ids(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    call_ids: Sequence[str],
    *,
    in_history: bool,
) -> set[str]:
    """Which of `call_ids` the run's logged tool calls already use: AppendItems' check for
    a run whose compaction took calls out of its checkpoint. An index probe per id for a
    run in history (migrations/0012 session_events_tool_keys); for a child run, the
    session's tool calls by type (0001 session_events_by_type), not its whole log (an
    audit: a sequential scan under the session lock)."""
    rows = await conn.fetch(
        "SELECT DISTINCT payload ->> 'call_id' AS call_id FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2 AND run_id = $3"
        " AND type = 'tool.call.created'"  # EVENT_TYPE_OF_ITEM['tool_call']
        " AND payload ->> 'call_id' = ANY($4::text[]) AND payload ->> 'kind' = 'tool_call'"
        + (
            " AND in_history AND payload ->> 'kind' IN ('tool_call', 'tool_result')"
            if in_history
            else ""
        ),
        tenant_id,
        session_id,
        run_id,
        list(call_ids),
    )
    return {r["call_id"] for r in rows}


def _runs(in_view: Sequence[str]) -> tuple[list[UUID], bool]:
    """$4 and $5 of _REQUESTS_FROM: the runs in view, and whether an item has none."""
    return sorted({UUID(r) for r in in_view if r}), any(not r for r in in_view)


# The requests that showed the model what the items above $3 may quote: from the earliest,
# over the runs in view ($4), of each run's latest request at or below $3 (it produced that
# run's first items above $3; a run with none there made them after requests above $3).
# The session's latest, whichever run made it, bounded the range before: a child run's
# request recorded after its parent's hid the parent's from a later compaction. An item
# logged without a run ($5) could follow any run's request: then the session's latest
# bounds it too. With neither, the requests above $3. The type is written out, not a
# parameter, so a generic plan can use the partial index each run's probe needs
# (migrations/0017).
_REQUEST = "'model.request.started'"
_REQUESTS_FROM = (
    f" WHERE s.tenant_id = $1 AND s.session_id = $2 AND s.type = {_REQUEST}"
    " AND s.sequence >= coalesce(least("
    "(SELECT min(l.latest) FROM unnest($4::uuid[]) AS r(run_id) CROSS JOIN LATERAL"
    " (SELECT max(sequence) AS latest FROM session_events WHERE tenant_id = $1"
    f" AND session_id = $2 AND type = {_REQUEST} AND run_id = r.run_id"
    " AND sequence <= $3) AS l),"
    " CASE WHEN $5::boolean THEN (SELECT max(sequence) FROM session_events"
    f" WHERE tenant_id = $1 AND session_id = $2 AND type = {_REQUEST} AND sequence <= $3)"
    " END), $3 + 1)"
)


# Each request of the range read once: its payload decompressed into a value of its own
# (`|| '{}'`, materialized: reading a stored payload's two fields decompressed it twice, a
# review measured), then its epoch and its step lines of the fields asked for; epochs
# first (part 0, no field), then lines (part 1, no epoch).
def _shown_of(requests: str, fields: str, inputs_key: str) -> str:
    """_SHOWN over the requests `requests` selects (a WHERE clause on session_events s),
    the step fields and the inputs key given as the parameters named."""
    return (
        "WITH p AS MATERIALIZED (SELECT s.payload || '{}'::jsonb AS payload FROM session_events s"
        + requests
        + " OFFSET 0),"
        f" r AS (SELECT (p.payload ->> 'epoch')::bigint AS epoch,"
        f" p.payload -> {inputs_key}::text -> 'step' AS step FROM p)"
        " SELECT DISTINCT 0 AS part, NULL::text AS field, NULL::jsonb AS line, r.epoch FROM r"
        " UNION ALL"
        " SELECT DISTINCT 1, f.field, e.line, NULL::bigint FROM r"
        f" CROSS JOIN unnest({fields}::text[]) AS f(field)"
        " CROSS JOIN LATERAL jsonb_array_elements(coalesce(r.step -> f.field, '[]'::jsonb))"
        " AS e(line)"
        " ORDER BY 1, 2, 3, 4"
    )


_SHOWN = _shown_of(_REQUESTS_FROM, "$6", "$7")
# The requests of the runs named alone, by the per-run index (migrations/0017).
_RUN_SHOWN = _shown_of(
    f" WHERE s.tenant_id = $1 AND s.session_id = $2 AND s.type = {_REQUEST}"
    " AND s.run_id = ANY($3::uuid[])",
    "$4",
    "$5",
)
