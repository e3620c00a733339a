"""Apply numbered SQL migrations in order, once, under an advisory lock.

Two replicas starting together both call this; the lock makes one apply and the other
find nothing left to do.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import asyncpg

__all__ = ["apply_migrations", "migration_files", "pending_migrations"]

_LOCK_KEY = 0x636F6E74657874  # "context" as an int: one advisory lock for migrations


def migration_files() -> list[tuple[str, str]]:
    """(version, sql) pairs in order, from the packaged migrations directory."""
    root = resources.files("context_engine") / "_migrations"
    files = sorted((p for p in root.iterdir() if p.name.endswith(".sql")), key=lambda p: p.name)
    return [(Path(p.name).stem, p.read_text(encoding="utf-8")) for p in files]


async def pending_migrations(conn: asyncpg.Connection) -> list[str]:
    """Versions not yet applied (all of them on an empty database); changes nothing."""
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    done = (
        {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        if exists
        else set()
    )
    return [version for version, _ in migration_files() if version not in done]


async def apply_migrations(conn: asyncpg.Connection) -> list[str]:
    """Apply pending migrations; returns the versions applied by this call."""
    applied: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, sql in migration_files():
            if version in done:
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
            applied.append(version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    return applied
