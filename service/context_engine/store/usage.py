"""Estimator corrections and usage reports (migrations/0002_usage.sql).

Every query is tenant-scoped: one tenant's reports never move another tenant's factor.
A report's read-modify-write of a correction holds lock_correction: reports of different
sessions are not ordered by the session lock, and a row lock cannot guard a correction that
has no row yet. Lock order: the session lock first, then this one; nothing that holds it
takes a session lock, so the order is the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from ..core.errors import InvalidFieldError
from ..core.estimator import Correction
from .idempotency import same_request

__all__ = [
    "ReportContext",
    "StoredCorrection",
    "insert_report",
    "lock_correction",
    "read_correction",
    "read_report_context",
    "session_model",
    "write_correction",
]


@dataclass(frozen=True, slots=True)
class StoredCorrection:
    correction: Correction
    tokenizer: str  # what the factor was learned for


async def lock_correction(conn: Any, tenant_id: str, model_id: str) -> None:
    """Hold the (tenant, model) correction's lock until the transaction ends, whether or not
    its row exists yet. A read after this (its own statement, so its snapshot is taken once
    the lock is granted) sees every report that held it before."""
    # Its own key space, 64 bits (hashtextextended): two corrections sharing a key only
    # wait for each other.
    await conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('usage' || chr(31) || $1"
        " || chr(31) || $2, 0))",
        tenant_id,
        model_id,
    )


async def read_correction(conn: Any, tenant_id: str, model_id: str) -> StoredCorrection | None:
    row = await conn.fetchrow(
        "SELECT factor_ppm, observed_ppm, samples, tokenizer FROM estimator_corrections"
        " WHERE tenant_id = $1 AND model_id = $2",
        tenant_id,
        model_id,
    )
    if row is None:
        return None
    return StoredCorrection(
        Correction(
            model_id=model_id,
            factor_ppm=row["factor_ppm"],
            samples=row["samples"],
            observed_ppm=row["observed_ppm"],
        ),
        row["tokenizer"],
    )


async def write_correction(
    conn: Any, tenant_id: str, correction: Correction, tokenizer: str
) -> None:
    await conn.execute(
        "INSERT INTO estimator_corrections"
        " (tenant_id, model_id, factor_ppm, observed_ppm, samples, tokenizer, updated_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, now())"
        " ON CONFLICT (tenant_id, model_id) DO UPDATE SET factor_ppm = EXCLUDED.factor_ppm,"
        " observed_ppm = EXCLUDED.observed_ppm, samples = EXCLUDED.samples,"
        " tokenizer = EXCLUDED.tokenizer, updated_at = now()",
        tenant_id,
        correction.model_id,
        correction.factor_ppm,
        correction.observed_ppm,
        correction.samples,
        tokenizer,
    )


async def session_model(conn: Any, tenant_id: str, session_id: UUID) -> str | None:
    """The model of the session's current plan (None before the first plan)."""
    value = await conn.fetchval(
        "SELECT p.plan->>'model_id' FROM sessions s JOIN context_plans p"
        " ON p.tenant_id = s.tenant_id AND p.session_id = s.session_id"
        " AND p.epoch = s.current_epoch WHERE s.tenant_id = $1 AND s.session_id = $2",
        tenant_id,
        session_id,
    )
    return str(value) if value is not None else None


@dataclass(frozen=True)
class ReportContext:
    """What a usage report reads under the session lock, in one round trip
    (read_report_context)."""

    # The stored response of this key's report, if any, with its reuse_ppm column.
    earlier: dict[str, Any] | None
    recorded: dict[str, Any] | None  # the model.request.started payload at the sequence
    # Whether a model.request.started before it was built on its epoch. Runs on different
    # epochs interleave (a run keeps its plan across another run's admission), so not only
    # the previous request is looked at: every request since the event that opened the
    # epoch, on session_events_by_type, stopping at the first on it.
    warm: bool
    # Whether a report of this request, under another key, was absorbed already: one
    # response is one sample (api/usage.py).
    learned: bool = False
    # Whether any report of this request, under another key, was made already (absorbed
    # or not): the estimator's metrics take a request's first report only.
    reported: bool = False
    # The full input (actual_input_tokens) the preceding request was reported to read:
    # the run's request before this one or, for a run's first, the session's; its first
    # report. None when there is none, or it is not reported yet (api/usage.py, Rule 6).
    preceding_input: int | None = None


_REPORT_CONTEXT = (
    "WITH req AS (SELECT e.payload, coalesce((e.payload->>'epoch')::bigint, 0) AS epoch,"
    "  e.run_id FROM session_events e WHERE e.tenant_id = $1 AND e.session_id = $2"
    "  AND e.sequence = $3 AND e.type = 'model.request.started'),"
    # Each max() one backward index read (session_events_requests_by_run, then
    # session_events_by_type), not a join: PostgreSQL reads a max() so only without one,
    # and with `req` joined it read every earlier request of the run (a review: 9 ms at
    # 10,000, 41 ms at 50,000, under the session lock).
    " preceding AS (SELECT coalesce("
    "  (SELECT max(b.sequence) FROM session_events b WHERE b.tenant_id = $1"
    "   AND b.session_id = $2 AND b.type = 'model.request.started' AND b.sequence < $3"
    "   AND b.run_id = (SELECT req.run_id FROM req)),"
    "  (SELECT max(b.sequence) FROM session_events b WHERE b.tenant_id = $1"
    "   AND b.session_id = $2 AND b.type = 'model.request.started' AND b.sequence < $3)"
    " ) AS sequence)"
    " SELECT u.request_sha256, u.response, u.reuse_ppm, req.payload,"
    " EXISTS (SELECT 1 FROM session_events e WHERE e.tenant_id = $1"
    "  AND e.session_id = $2 AND e.type = 'model.request.started' AND e.sequence < $3"
    "  AND e.sequence > coalesce((SELECT max(o.sequence) FROM session_events o"
    "   WHERE o.tenant_id = $1 AND o.session_id = $2"
    "   AND o.type IN ('context.plan.created', 'context.epoch.rotated')"
    "   AND (o.payload->>'epoch')::bigint = req.epoch), 0)"
    "  AND (e.payload->>'epoch')::bigint = req.epoch) AS warm,"
    " EXISTS (SELECT 1 FROM usage_reports a WHERE a.tenant_id = $1 AND a.session_id = $2"
    "  AND a.request_sequence = $3 AND a.absorbed) AS learned,"
    " EXISTS (SELECT 1 FROM usage_reports a WHERE a.tenant_id = $1 AND a.session_id = $2"
    "  AND a.request_sequence = $3) AS reported,"
    " (SELECT p.actual_input_tokens FROM usage_reports p, preceding"
    "  WHERE p.tenant_id = $1 AND p.session_id = $2 AND p.request_sequence = preceding.sequence"
    "  ORDER BY p.created_at, p.idempotency_key LIMIT 1) AS preceding_input"
    " FROM (SELECT 1) AS one"
    " LEFT JOIN req ON true"
    " LEFT JOIN usage_reports u ON u.tenant_id = $1 AND u.session_id = $2"
    "  AND u.request_sequence = $3 AND u.idempotency_key = $4"
)


async def read_report_context(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    request_sequence: int,
    key: str,
    request_sha256: str,
) -> ReportContext:
    """The stored response of an earlier report with this key, the request recorded at
    `request_sequence` and whether it was warm (ReportContext), read together: a report
    made one round trip for each until 2026-12-03.

    Raises:
        InvalidFieldError: IDEMPOTENCY_KEY_REUSED when the key came with another report.
    """
    row = await conn.fetchrow(_REPORT_CONTEXT, tenant_id, session_id, request_sequence, key)
    if row["request_sha256"] is not None and not same_request(
        row["request_sha256"], request_sha256
    ):
        raise InvalidFieldError(
            "this request's usage was already reported under this idempotency key with"
            " different figures",
            field="idempotency_key",
            reason="IDEMPOTENCY_KEY_REUSED",
        )
    return ReportContext(
        earlier={**row["response"], "reuse_ppm": row["reuse_ppm"]}
        if row["request_sha256"] is not None
        else None,
        recorded=row["payload"],
        warm=bool(row["warm"]),
        learned=bool(row["learned"]),
        reported=bool(row["reported"]),
        preceding_input=row["preceding_input"],
    )


async def insert_report(conn: Any, tenant_id: str, session_id: UUID, row: dict[str, Any]) -> None:
    columns = ("tenant_id", "session_id", *row)
    placeholders = ", ".join(f"${n}" for n in range(1, len(columns) + 1))
    await conn.execute(
        f"INSERT INTO usage_reports ({', '.join(columns)}) VALUES ({placeholders})",
        tenant_id,
        session_id,
        *row.values(),
    )
