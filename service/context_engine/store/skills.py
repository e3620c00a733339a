"""Skill bodies loaded into a session, in load order (row 11). Insert-only: sticky."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from ..core.skills import LoadedSkill
from ..core.trust import TrustLevel

__all__ = ["insert_loaded", "read_loaded"]


async def read_loaded(conn: Any, tenant_id: str, session_id: UUID) -> list[LoadedSkill]:
    """The session's loaded skills, in load order."""
    rows = await conn.fetch(
        "SELECT name, version, body, trust, tokens FROM loaded_skills"
        " WHERE tenant_id = $1 AND session_id = $2 ORDER BY position",
        tenant_id,
        session_id,
    )
    return [
        LoadedSkill(
            name=r["name"],
            version=r["version"],
            body=r["body"],
            trust=TrustLevel(r["trust"]),
            tokens=int(r["tokens"]),
        )
        for r in rows
    ]


async def insert_loaded(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    position: int,
    skill: LoadedSkill,
    run_id: UUID | None,
    sequence: int,
) -> None:
    """Record a load. Call with the session locked (position is the session's next)."""
    await conn.execute(
        "INSERT INTO loaded_skills (tenant_id, session_id, position, name, version, trust,"
        " body, tokens, run_id, sequence) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        tenant_id,
        session_id,
        position,
        skill.name,
        skill.version,
        int(skill.trust),
        skill.body,
        skill.tokens,
        run_id,
        sequence,
    )
