"""Apply numbered SQL migrations in order, once, under an advisory lock.

Two replicas starting together both call this; the lock makes one apply and the other
find nothing left to do. Neither the wait for the lock nor a migration is cut off by the
pool's command timeout (store/db.py, 10 s, meant for requests): a migration that rewrites
a large table takes what it takes, and the second migrator waits for the first. A
migration that fails is rolled back and reported as MigrationError, naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import asyncpg

__all__ = ["MigrationError", "apply_migrations", "migration_files", "pending_migrations"]

_LOCK_KEY = 0x636F6E74657874  # "context" as an int: one advisory lock for migrations
# asyncpg's per-statement timeout for the lock wait and each migration (None would take the
# connection's command timeout): a week, i.e. none an operator would meet.
_NO_TIMEOUT = 7 * 24 * 3600.0


class MigrationError(Exception):
    """A migration failed; it was rolled back, and the ones before it stay applied."""


def migration_files() -> list[tuple[str, str]]:
    """(version, sql) pairs in order, from the packaged migrations directory."""
    root = resources.files("context_engine") / "_migrations"
    files = sorted((p for p in root.iterdir() if p.name.endswith(".sql")), key=lambda p: p.name)
    return [(Path(p.name).stem, p.read_text(encoding="utf-8")) for p in files]


async def pending_migrations(conn: asyncpg.Connection) -> list[str]:
    """Versions not yet applied (all of them on an empty database); changes nothing.

    Raises:
        MigrationError: the applied migrations cannot be read (a role without the grant).
    """
    try:
        exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
        rows = await conn.fetch("SELECT version FROM schema_migrations") if exists else []
    except asyncpg.PostgresError as exc:  # a runtime role that may not read it, say
        raise MigrationError(
            f"cannot read the applied migrations ({type(exc).__name__}: {exc})"
        ) from exc
    done = {r["version"] for r in rows}
    return [version for version, _ in migration_files() if version not in done]


async def apply_migrations(
    conn: asyncpg.Connection, files: Sequence[tuple[str, str]] | None = None
) -> list[str]:
    """Apply pending migrations (`files`: the packaged ones when None); returns the
    versions applied by this call.

    Raises:
        MigrationError: a migration failed (PostgreSQL refused it); it was rolled back.
    """
    applied: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY, timeout=_NO_TIMEOUT)
    try:
        try:
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            rows = await conn.fetch("SELECT version FROM schema_migrations")
        except asyncpg.PostgresError as exc:  # a role that may not create it, say
            raise MigrationError(
                f"cannot read the applied migrations ({type(exc).__name__}: {exc})"
            ) from exc
        done = {r["version"] for r in rows}
        for version, sql in migration_files() if files is None else files:
            if version in done:
                continue
            try:
                async with conn.transaction():
                    await conn.execute(sql, timeout=_NO_TIMEOUT)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version) VALUES ($1)", version
                    )
            except asyncpg.PostgresError as exc:
                raise MigrationError(
                    f"migration {version} failed and was rolled back ({type(exc).__name__}: {exc})"
                ) from exc
            applied.append(version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    return applied
