"""store/db.py: which PostgreSQL errors of a statement mean the database cannot serve now
(STORE_UNAVAILABLE, which clients retry) rather than the statement's own fault."""

from __future__ import annotations

import asyncpg
import pytest

from context_engine.store.db import StoreUnavailableError, _unavailable


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.AdminShutdownError("terminating connection"),  # 57P01
        asyncpg.exceptions.ReadOnlySQLTransactionError("read-only"),  # 25006, a standby
        # 53200: PostgreSQL's shared lock table full (many transactions holding many
        # people fences at once: an audit), or out of memory. It was INTERNAL.
        asyncpg.exceptions.OutOfMemoryError("out of shared memory"),
        asyncpg.exceptions.DiskFullError("could not extend file"),  # 53100
    ],
)
def test_the_database_unable_to_serve_is_unavailable(error: asyncpg.PostgresError) -> None:
    assert isinstance(_unavailable(error, True), StoreUnavailableError)


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.UniqueViolationError("duplicate key"),
        asyncpg.exceptions.DataError("invalid input"),
    ],
)
def test_a_statements_own_error_is_raised_as_it_is(error: asyncpg.PostgresError) -> None:
    assert _unavailable(error, True) is None
