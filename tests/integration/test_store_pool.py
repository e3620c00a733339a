"""The pool's edges against a real PostgreSQL: what an unreachable database looks like to
a caller (store/db.py), and what a released connection carries to its next user."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from context_engine.store.db import HeldConnection, StoreUnavailableError, acquire, connect_pool


@pytest.mark.parametrize(
    "raised",
    [
        asyncpg.InternalClientError("protocol left mid-operation"),
        asyncpg.ConnectionDoesNotExistError("connection was closed"),
        ConnectionResetError("reset by peer"),
    ],
    ids=["internal-client-error", "connection-gone", "reset"],
)
async def test_a_dropped_connection_is_unavailable_not_internal(
    database_dsn: str, raised: Exception
) -> None:
    """What asyncpg raises on a connection PostgreSQL dropped mid-statement (seen at COMMIT
    and at release under `bench.load --faults`) reaches the caller as StoreUnavailableError,
    which the servicer answers UNAVAILABLE; a query's own error is left as it is."""
    pool = await connect_pool(database_dsn, min_size=1, max_size=1)
    try:
        with pytest.raises(StoreUnavailableError):
            async with acquire(pool):
                raise raised
        with pytest.raises(asyncpg.UndefinedTableError):
            async with acquire(pool) as conn:
                await conn.fetchval("SELECT 1 FROM no_such_table")
        async with acquire(pool) as conn:  # the pool still serves
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await pool.close()


async def test_a_transaction_left_open_does_not_reach_the_next_user(database_dsn: str) -> None:
    """The pool skips asyncpg's reset query on release (the service keeps no session
    state); asyncpg still rolls back a transaction left open, so the next user of the one
    connection starts clean and nothing the abandoned transaction wrote is visible."""
    pool = await connect_pool(database_dsn, min_size=1, max_size=1)
    try:
        async with acquire(pool) as conn:
            await conn.execute("CREATE TABLE IF NOT EXISTS pool_probe (n int)")
        async with acquire(pool) as conn:
            await conn.execute("BEGIN")
            await conn.execute("INSERT INTO pool_probe VALUES (1)")
        async with acquire(pool) as conn:
            assert not conn.is_in_transaction()
            assert await conn.fetchval("SELECT count(*) FROM pool_probe") == 0
            await conn.execute("DROP TABLE pool_probe")
    finally:
        await pool.close()


async def test_jsonb_values_and_arrays_round_trip_in_binary_form(database_dsn: str) -> None:
    """jsonb parameters and results travel in binary form (store/db.py encode_jsonb), as
    a Build record batch sends its payloads (a jsonb[] array: store/records.py): what
    PostgreSQL stores is the value sent, quotes, backslashes, control characters and
    non-ASCII text included, and a null element stays SQL NULL."""
    value = {"text": 'a "quoted" \\ back\nslash é 𝄞 \u2028', "n": [1, -2, 3.5, True, None]}
    pool = await connect_pool(database_dsn, min_size=1, max_size=1)
    try:
        async with acquire(pool) as conn:
            assert await conn.fetchval("SELECT $1::jsonb", value) == value
            assert await conn.fetchval("SELECT $1::jsonb ->> 'text'", value) == value["text"]
            array = await conn.fetchval("SELECT $1::jsonb[]", [value, None, {"k": []}])
            assert array == [value, None, {"k": []}]
            assert await conn.fetchval("SELECT ($1::jsonb[])[2] IS NULL", [value, None])
            assert await conn.fetchval("SELECT $1::json", value) == value  # json stays text
    finally:
        await pool.close()


async def test_a_held_connection_serves_round_trips_until_released_or_failed(
    database_dsn: str,
) -> None:
    """HeldConnection (Build's record batcher): consecutive uses get the one connection,
    kept out of the pool between them, unless a use finds every connection of the pool
    out (others may wait for one); any failure hands it back at once, a statement's own
    error raised as it is and a dropped connection as StoreUnavailableError; one closed
    while held is replaced on the next use; release() hands it back, so the pool closes."""
    pool = await connect_pool(database_dsn, min_size=2, max_size=2)
    held = HeldConnection(pool)

    def out() -> int:  # connections open and handed out (the pool may reopen a closed one)
        return pool.get_size() - pool.get_idle_size()

    try:
        assert pool.get_idle_size() == 2
        async with held.use() as first:
            backend = await first.fetchval("SELECT pg_backend_pid()")
        async with held.use() as second:
            assert await second.fetchval("SELECT pg_backend_pid()") == backend
        assert out() == 1  # held between round trips
        async with acquire(pool) as other:  # the pool's last connection is out
            async with held.use() as conn:
                await conn.fetchval("SELECT 1")
            assert out() == 1  # so the held one went back after its use: only `other` is out
            await other.fetchval("SELECT 1")
        async with held.use() as conn:
            await conn.fetchval("SELECT 1")
        assert out() == 1
        with pytest.raises(asyncpg.UndefinedTableError):
            async with held.use() as conn:
                await conn.fetchval("SELECT 1 FROM no_such_table")
        assert out() == 0  # a failure handed it back
        async with held.use() as conn:
            conn.terminate()  # as PostgreSQL dropping it between round trips
        async with held.use() as conn:
            assert await conn.fetchval("SELECT 1") == 1
        with pytest.raises(StoreUnavailableError):
            async with held.use():
                raise asyncpg.ConnectionDoesNotExistError("connection was closed")
        assert out() == 0
        async with held.use() as conn:
            await conn.fetchval("SELECT 1")
        assert out() == 1
        await held.release()
        assert out() == 0
    finally:
        await asyncio.wait_for(pool.close(), 10)  # nothing left out of the pool
