"""Apply numbered SQL migrations in order, once, under an advisory lock.

Two replicas starting together both call this; the lock makes one apply and the other
find nothing left to do. The lock is taken in each migration's own transaction
(`pg_advisory_xact_lock`), and whether the migration is applied is read under it: a lock
held across transactions on the session would, through PgBouncer's transaction pooling,
be taken on one server connection and released on another (the release failing, the lock
left on a pooled connection for the next release's migrator to wait on). Neither the wait
for the lock nor a migration is cut off by the pool's command timeout (store/db.py, 10 s,
meant for requests): a migration that rewrites a large table takes what it takes, and the
second migrator waits for the first. A migration that fails is rolled back and reported as
MigrationError, naming it.

Each applied migration keeps the SHA-256 of its file (`schema_migrations.sha256`). A file
changed after a database applied it would leave that database on a schema this version
does not expect, silently (0007 was rewritten an hour after it landed: a database migrated
in between kept `erased_people.person_id`, and every erasure failed INTERNAL). So a
migration whose applied file differs from the packaged one is a MigrationError naming it,
for `migrate` and for `serve` alike; a version applied before the sums were kept takes the
packaged file's sum the first time `migrate` runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path

import asyncpg

__all__ = ["MigrationError", "apply_migrations", "migration_files", "pending_migrations"]

_LOCK_KEY = 0x636F6E74657874  # "context" as an int: one advisory lock for migrations
# asyncpg's per-statement timeout for the lock wait and each migration (None would take the
# connection's command timeout): a week, i.e. none an operator would meet.
_NO_TIMEOUT = 7 * 24 * 3600.0
_CREATE = (
    "CREATE TABLE schema_migrations ("
    " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now(), sha256 text)"
)
_ADD_SUM = "ALTER TABLE schema_migrations ADD COLUMN sha256 text"
# Read committed, whatever the database's default: each transaction reads what the other
# migrator committed while it waited for the lock (under repeatable read its snapshot is
# taken before the wait, and a migration applied meanwhile was applied again: a review).
_ISOLATION = "read_committed"


class MigrationError(Exception):
    """A migration failed; it was rolled back, and the ones before it stay applied. Or the
    applied migrations cannot be read, or one was applied from another file."""


def migration_files() -> list[tuple[str, str]]:
    """(version, sql) pairs in order, from the packaged migrations directory."""
    root = resources.files("context_engine") / "_migrations"
    files = sorted((p for p in root.iterdir() if p.name.endswith(".sql")), key=lambda p: p.name)
    return [(Path(p.name).stem, p.read_text(encoding="utf-8")) for p in files]


def _sum(sql: str) -> str:
    return hashlib.sha256(sql.encode("utf-8")).hexdigest()


def _check_unchanged(applied: Mapping[str, str | None], files: Sequence[tuple[str, str]]) -> None:
    """Raise MigrationError for the first applied migration whose kept sum is not its
    file's (a sum not kept yet is not compared)."""
    for version, sql in files:
        kept = applied.get(version)
        if kept is not None and kept != _sum(sql):
            raise MigrationError(
                f"migration {version} was applied from another file than this version's"
                f" (sha256 {kept[:12]}…, packaged {_sum(sql)[:12]}…): the database's schema"
                " may not be the one this version expects; a migration is never edited"
                " once released, so find which release changed it"
            )


async def _has_sum(conn: asyncpg.Connection) -> bool:
    """Whether schema_migrations (the table the search path finds, as every statement
    here names it) has its sha256 column. Read from the catalog, which needs no privilege
    on the table (a review: information_schema in current_schema() alone disagreed with
    the table found where the search path's first schema lacks it)."""
    return bool(
        await conn.fetchval(
            "SELECT EXISTS (SELECT FROM pg_attribute"
            " WHERE attrelid = to_regclass('schema_migrations') AND attname = 'sha256'"
            " AND NOT attisdropped)"
        )
    )


async def _applied(conn: asyncpg.Connection) -> dict[str, str | None]:
    """Applied version -> its kept sum (None before sums were kept, or without the column)."""
    column = "sha256" if await _has_sum(conn) else "NULL::text AS sha256"
    rows = await conn.fetch(f"SELECT version, {column} FROM schema_migrations")
    return {r["version"]: r["sha256"] for r in rows}


async def pending_migrations(conn: asyncpg.Connection) -> list[str]:
    """Versions not yet applied (all of them on an empty database); changes nothing.

    Raises:
        MigrationError: the applied migrations cannot be read (a role without the grant),
            or one was applied from another file than the packaged one.
    """
    try:
        exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
        applied = await _applied(conn) if exists else {}
    except asyncpg.PostgresError as exc:  # a runtime role that may not read it, say
        raise MigrationError(
            f"cannot read the applied migrations ({type(exc).__name__}: {exc})"
        ) from exc
    files = migration_files()
    _check_unchanged(applied, files)
    return [version for version, _ in files if version not in applied]


async def apply_migrations(
    conn: asyncpg.Connection, files: Sequence[tuple[str, str]] | None = None
) -> list[str]:
    """Apply pending migrations (`files`: the packaged ones when None); returns the
    versions applied by this call.

    Raises:
        MigrationError: a migration failed (PostgreSQL refused it); it was rolled back. Or
            the applied migrations cannot be read, or one was applied from another file.
    """
    files = migration_files() if files is None else files
    try:
        async with conn.transaction(isolation=_ISOLATION):
            await _lock(conn)
            # Only what is missing: DDL on a table is its owner's, even when it would change
            # nothing (a role that may apply migrations but does not own the table).
            if not await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL"):
                await conn.execute(_CREATE)
            elif not await _has_sum(conn):
                await conn.execute(_ADD_SUM)
            applied = await _applied(conn)
            _check_unchanged(applied, files)
            missing = [(v, _sum(sql)) for v, sql in files if v in applied and applied[v] is None]
            if missing:
                await conn.executemany(
                    "UPDATE schema_migrations SET sha256 = $2"
                    " WHERE version = $1 AND sha256 IS NULL",
                    missing,
                )
    except asyncpg.PostgresError as exc:  # a role that may not create or change it, say
        raise MigrationError(
            f"cannot prepare the record of applied migrations ({type(exc).__name__}: {exc})"
        ) from exc
    done: list[str] = []
    for version, sql in files:
        if version in applied:
            continue
        try:
            async with conn.transaction(isolation=_ISOLATION):
                await _lock(conn)
                # Read under the lock: another migrator may have applied it meanwhile.
                if await conn.fetchval(
                    "SELECT true FROM schema_migrations WHERE version = $1", version
                ):
                    continue
                await conn.execute(sql, timeout=_NO_TIMEOUT)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, sha256) VALUES ($1, $2)",
                    version,
                    _sum(sql),
                )
        except asyncpg.PostgresError as exc:
            raise MigrationError(
                f"migration {version} failed and was rolled back ({type(exc).__name__}: {exc})"
            ) from exc
        done.append(version)
    return done


async def _lock(conn: asyncpg.Connection) -> None:
    """The migrations' lock, until this transaction ends."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY, timeout=_NO_TIMEOUT)
