"""Sessions: creation and the per-session write lock (store/events.py moves the sequence
counter as it appends)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from ..core.errors import NotFoundError

__all__ = [
    "ensure_session",
    "lock_session",
    "lock_session_plans",
    "session_exists",
    "session_mark",
]


async def ensure_session(conn: Any, tenant_id: str, session_id: UUID) -> None:
    await conn.execute(
        "INSERT INTO sessions (tenant_id, session_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        tenant_id,
        session_id,
    )


async def session_exists(conn: Any, tenant_id: str, session_id: UUID) -> bool:
    """Whether the tenant has the session (a read that takes no lock)."""
    found = await conn.fetchval(
        "SELECT true FROM sessions WHERE tenant_id = $1 AND session_id = $2", tenant_id, session_id
    )
    return bool(found)


async def session_mark(
    conn: Any, tenant_id: str, session_id: UUID, run_id: UUID
) -> tuple[int, int, int]:
    """(last_sequence, plans_revision, the run's latest checkpoint version), read without a
    lock: what a write to the session moves. A logged write appends an event; an erasure
    appends one per session it redacts, and its rewrite of plans moves the revision; an
    AppendItems of reasoning items alone logs nothing but writes the run a checkpoint.

    Raises:
        NotFoundError: no such session for this tenant.
    """
    row = await _session_row(
        conn,
        tenant_id,
        session_id,
        "last_sequence, plans_revision, (SELECT max(version) FROM run_checkpoints"
        " WHERE tenant_id = $1 AND run_id = $3) AS run_version",
        "",
        run_id,
    )
    return int(row["last_sequence"]), int(row["plans_revision"]), int(row["run_version"] or 0)


async def lock_session(conn: Any, tenant_id: str, session_id: UUID) -> int:
    """Lock the session row for this transaction; returns its current epoch.

    Every write to a session takes this lock first, so a session's writes serialize and
    its sequence has no gaps or races.

    Raises:
        NotFoundError: no such session for this tenant.
    """
    epoch, _ = await lock_session_plans(conn, tenant_id, session_id)
    return epoch


async def lock_session_plans(conn: Any, tenant_id: str, session_id: UUID) -> tuple[int, int]:
    """lock_session, also returning the session's plans_revision: (epoch, revision).

    Under the lock the pair is the committed one, and stays so until the transaction ends
    (an erasure rewrites plans only with the session locked).

    Raises:
        NotFoundError: no such session for this tenant.
    """
    # Waited for at most store/db.py LOCK_WAIT_SECONDS (transaction() bounds every lock
    # wait of the write): a wait past it is SESSION_BUSY.
    row = await _session_row(
        conn, tenant_id, session_id, "current_epoch, plans_revision", " FOR UPDATE"
    )
    return int(row["current_epoch"]), int(row["plans_revision"])


async def _session_row(
    conn: Any, tenant_id: str, session_id: UUID, columns: str, locking: str = "", *more: Any
) -> Any:
    """The session's row (`columns`, `locking` the row or not; `more` parameters from $3
    on); NotFoundError if none."""
    row = await conn.fetchrow(
        f"SELECT {columns} FROM sessions WHERE tenant_id = $1 AND session_id = $2{locking}",
        tenant_id,
        session_id,
        *more,
    )
    if row is None:
        raise NotFoundError(
            f"session {session_id} not found", field="session_id", reason="SESSION_NOT_FOUND"
        )
    return row
