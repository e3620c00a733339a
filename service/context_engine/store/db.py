"""Connection pool, JSON codecs and the mapping of "PostgreSQL is away" to one error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit
from uuid import UUID

import asyncpg
from pydantic_core import to_json

from .. import telemetry
from ..core.errors import ConflictError, EngineError

__all__ = [
    "LOCK_WAIT_SECONDS",
    "HeldConnection",
    "SessionBusyError",
    "StoreReadError",
    "StoreUnavailableError",
    "connect",
    "connect_pool",
    "decode_jsonb",
    "encode_json",
    "encode_jsonb",
    "lock_wait_ms",
    "lock_wait_setting",
    "read_refusal",
    "snapshot",
    "transaction",
]

# Errors that mean the database is unreachable or restarting, not that a query was wrong.
_UNAVAILABLE = (
    OSError,
    ConnectionError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.AdminShutdownError,
    asyncpg.InterfaceError,
    asyncpg.ConnectionDoesNotExistError,
    # A statement (a COMMIT, the pool's reset on release) that meets the protocol left
    # mid-operation by a connection PostgreSQL dropped while shutting down; seen by
    # `python -m bench.load --faults`, and never raised on a healthy connection.
    asyncpg.InternalClientError,
)


class StoreUnavailableError(EngineError):
    """PostgreSQL cannot be reached; the caller should retry with backoff (UNAVAILABLE)."""


# How long a write waits for a lock (PostgreSQL's lock_timeout, set for each write's
# transaction first, and by Build's waiting record: `lock_wait_setting`), below the pool's
# 10 s command timeout: a wait for a session another write holds ends as SESSION_BUSY,
# told apart from a database that stopped answering. It was the command timeout, reported
# as STORE_UNAVAILABLE (an audit: PostgreSQL was up). Not a connection setting: PgBouncer,
# which docs/scaling.md recommends, refuses a startup parameter it does not know.
LOCK_WAIT_SECONDS = 8.0


# For this transaction only (is_local): the pooled connection keeps no setting.
_LOCK_WAIT = "SELECT set_config('lock_timeout', $1, true)"


def lock_wait_setting() -> str:
    """LOCK_WAIT_SECONDS as lock_timeout's value, for `set_config('lock_timeout', $n,
    true)` in the statement that waits (read at each call: a test may shorten it)."""
    return f"{lock_wait_ms()}ms"


def lock_wait_ms() -> int:
    """LOCK_WAIT_SECONDS in milliseconds: the budget of a statement that waits for several
    locks in turn (migrations/0022), all of them within it."""
    return int(LOCK_WAIT_SECONDS * 1000)


class SessionBusyError(ConflictError):
    """Another write held the session (or a lock it needed) past LOCK_WAIT_SECONDS;
    nothing was written: retry with backoff, with the same idempotency key (ABORTED)."""

    reason = "SESSION_BUSY"

    def __init__(self, session_id: UUID | None = None, waited: float | None = None) -> None:
        # The lock PostgreSQL gave up on is a session's row, or one a write needed beside
        # it; which one, and for how long it was waited, only the gate knows.
        which = f"session {session_id}" if session_id is not None else "the session"
        after = f" for {waited:g} s" if waited is not None else ""
        super().__init__(
            f"{which} stayed busy with another write{after}; nothing was written: retry with"
            " backoff (a keyed write under the idempotency key it was sent with)",
            metadata={"waited_seconds": f"{waited:g}"} if waited is not None else None,
        )


class StoreReadError(Exception):
    """An operator tool's read (inspect) failed after connecting; one line naming why."""


def encode_json(value: Any) -> str:
    """A json or jsonb parameter's text: compact, UTF-8 as is (no \\u escapes), keys in
    the order given; the same text as json.JSONEncoder(ensure_ascii=False,
    separators=(",", ":")) gives for the values the store writes (dicts, lists, strings,
    integers, booleans, None: tests/unit/test_store_json.py), in about a third of the time
    (pydantic's Rust serializer: a Build's record, 1.5 kB, 14 -> 4 us). A float that is
    not a number stays NaN or Infinity, which PostgreSQL refuses, as before."""
    return to_json(value, inf_nan_mode="constants").decode("utf-8")


# The version byte that starts jsonb's binary form (the only version PostgreSQL has).
_JSONB_VERSION = b"\x01"


def encode_jsonb(value: Any) -> bytes:
    """A jsonb parameter in PostgreSQL's binary form: the version byte, then encode_json's
    text as UTF-8. Binary rather than text because of arrays: a Build record batch sends
    its payloads as jsonb[] (store/records.py), and in text form asyncpg writes an array
    literal, quoting and escaping every character of every element (about 12 us per
    1.6 kB payload here, against under 3 us in binary form, where each element is only
    length-prefixed)."""
    return _JSONB_VERSION + to_json(value, inf_nan_mode="constants")


def decode_jsonb(data: bytes) -> Any:
    """A jsonb value read in binary form: the version byte, then the JSON text."""
    if data[:1] != _JSONB_VERSION:
        raise ValueError(f"jsonb binary format version {data[:1]!r} is not 1")
    return json.loads(data[1:])


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("json", encoder=encode_json, decoder=json.loads, schema="pg_catalog")
    await conn.set_type_codec(
        "jsonb",
        encoder=encode_jsonb,
        decoder=decode_jsonb,
        schema="pg_catalog",
        format="binary",
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset on release, deliberately empty.

    asyncpg's default resets every released connection with one more round trip
    (pg_advisory_unlock_all, CLOSE ALL, UNLISTEN *, RESET ALL). This service leaves no
    session state to reset: it issues no SET, LISTEN or cursor outside a transaction, and
    takes advisory locks only for a transaction (store/migrate.py, the people fences). asyncpg still
    rolls back a transaction left open before calling this. So every Build saves two round
    trips (its read and its write each release a connection)."""


async def connect_pool(
    dsn: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    command_timeout: float = 10.0,
    connect_timeout: float = 5.0,
) -> asyncpg.Pool:
    """Open a pool. Raises StoreUnavailableError when the database cannot be reached or
    refuses the connection; its message is one line that names why (see _refusal)."""
    try:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            command_timeout=command_timeout,
            timeout=connect_timeout,
            init=_init_connection,
            reset=_keep_session,
        )
    except (*_UNAVAILABLE, asyncpg.PostgresError) as exc:
        refused = _refusal(dsn, exc)
        if refused is None:
            raise
        raise refused from exc
    assert pool is not None
    return pool


async def connect(dsn: str, *, timeout: float = 5.0) -> asyncpg.Connection:
    """One connection (the CLI's inspect); failures as in connect_pool."""
    try:
        return await asyncpg.connect(dsn, timeout=timeout)
    except (*_UNAVAILABLE, asyncpg.PostgresError) as exc:
        refused = _refusal(dsn, exc)
        if refused is None:
            raise
        raise refused from exc


# SQLSTATE classes PostgreSQL refuses a new connection with: 08 connection exception,
# 28 invalid authorization (no such role, wrong password), 3D invalid catalog name (no
# such database), 53 insufficient resources (too many connections), 57 operator
# intervention (starting up, shutting down), and 42 for a startup setting the server does
# not know (asyncpg sends a URL parameter it does not read itself, libpq's
# `connect_timeout=5` say, as a setting: 'unrecognized configuration parameter', an audit
# found it a traceback) or a database the role may not connect to.
_REFUSED_CLASSES = ("08", "28", "3D", "42", "53", "57")


def _refusal(dsn: str, exc: BaseException) -> StoreUnavailableError | None:
    """StoreUnavailableError for a failed connect, one line naming the server, the
    database and why; None for an error that is no connection refusal."""
    if isinstance(exc, asyncpg.PostgresError):
        if str(getattr(exc, "sqlstate", "") or "")[:2] not in _REFUSED_CLASSES:
            return None
        # The server's own words ('database "x" does not exist', 'role "x" does not
        # exist', 'password authentication failed for user "x"'); they never carry the
        # password.
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    elif isinstance(exc, TimeoutError):
        why = "no answer in time"
    elif isinstance(exc, OSError) and exc.errno:
        # "Connection refused"; the address is named below. A name lookup's error
        # (socket.gaierror) has a negative code, which os.strerror reads as "Unknown error
        # -2": its own words say it.
        why = os.strerror(exc.errno) if exc.errno > 0 else exc.strerror or str(exc)
    else:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return StoreUnavailableError(f"cannot connect to PostgreSQL at {_where(dsn)}: {why}")


def read_refusal(dsn: str, exc: BaseException) -> StoreReadError | None:
    """StoreReadError for a read that failed on an open connection (an operator tool's:
    inspect), one line naming the database, why and what to do; None for an error that is
    neither PostgreSQL's refusal nor a lost connection."""
    where = _where(dsn)
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(
        exc,
        asyncpg.UndefinedTableError | asyncpg.UndefinedColumnError | asyncpg.UndefinedFunctionError,
    ):
        return StoreReadError(
            f"schema not migrated at {where} ({first}): run `context-engine migrate`"
        )
    if isinstance(exc, asyncpg.InsufficientPrivilegeError):
        return StoreReadError(
            f"the database user may not read the context-engine tables at {where}: {first}"
        )
    if isinstance(exc, asyncpg.PostgresError):
        return StoreReadError(
            f"PostgreSQL at {where} refused the read (SQLSTATE {exc.sqlstate}): {first}"
        )
    if isinstance(exc, _UNAVAILABLE):
        return StoreReadError(f"lost the connection to PostgreSQL at {where}: {first}")
    return None


def _where(dsn: str) -> str:
    """HOST[:PORT]/DATABASE of a DSN, without the user and password."""
    parts = urlsplit(dsn)
    host = unquote(parts.netloc.rpartition("@")[2]) or "localhost"
    query = dict(parse_qsl(parts.query))
    if "host" in query:  # a Unix socket directory given as ?host=/path
        host = query["host"]
    return f"{host}{parts.path}"


# SQLSTATE classes that mean the database is away, whatever the statement: 08 connection
# exception, 57 operator intervention (admin or crash shutdown, cannot connect now). And
# 25006, a write refused by a read-only server: a standby a multi-host DSN reached after a
# failover is no database this replica can write to (it was INTERNAL: an audit). And 53,
# insufficient resources (disk full, out of memory, PostgreSQL's shared lock table full:
# many transactions holding many people fences at once, an audit), which a retry later can
# get past, where INTERNAL told the caller not to retry.
_AWAY_CLASSES = ("08", "53", "57")
_AWAY_STATES = ("25006",)


def _database_away(exc: asyncpg.PostgresError) -> bool:
    state = str(getattr(exc, "sqlstate", "") or "")
    return state[:2] in _AWAY_CLASSES or state in _AWAY_STATES


def _unavailable(exc: BaseException, handed_out: bool) -> StoreUnavailableError | None:
    """The StoreUnavailableError a failure means, or None for a statement's own error (an
    error of a connection already handed out, PostgreSQL being there), raised as it is."""
    if (
        isinstance(exc, asyncpg.PostgresError)
        and not isinstance(exc, _UNAVAILABLE)  # e.g. TooManyConnectionsError: always away
        and handed_out
        and not _database_away(exc)
    ):
        return None
    # Else unreachable, or refused while connecting (database dropped or closed to
    # connections, credentials revoked): for this replica PostgreSQL is away, not the
    # request wrong.
    return StoreUnavailableError(f"PostgreSQL unavailable: {type(exc).__name__}")


@asynccontextmanager
async def acquire(pool: asyncpg.Pool, timeout: float = 5.0) -> AsyncIterator[Any]:
    """A pooled connection; unreachable-database failures become StoreUnavailableError."""
    handed_out = False
    try:
        # asyncio.timeout rather than acquire(timeout=): on Python 3.11 asyncpg's timeout
        # wraps the wait in a new Task, twice per Build.
        asked = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                conn = await pool.acquire()
        finally:
            # A wait that timed out too: they are what a pool run dry is made of, and the
            # histogram held only the waits that ended in a connection (an audit).
            telemetry.record_pool_wait(time.perf_counter() - asked)
        try:
            handed_out = True
            yield conn
        except asyncpg.PostgresError as exc:
            if getattr(exc, "sqlstate", "") in _AWAY_STATES:
                # A read-only server: the connection is dropped, so the pool reconnects
                # and a multi-host DSN can find the primary (reused, it stayed on the
                # standby: a review).
                conn.terminate()
            raise
        finally:
            await pool.release(conn)
    except asyncpg.LockNotAvailableError:
        raise SessionBusyError() from None
    except (*_UNAVAILABLE, asyncpg.PostgresError) as exc:
        unavailable = _unavailable(exc, handed_out)
        if unavailable is None:
            raise
        raise unavailable from exc


def _exhausted(pool: asyncpg.Pool) -> bool:
    """Whether every connection the pool may open is open and in use."""
    idle, size, most = pool.get_idle_size(), pool.get_size(), pool.get_max_size()
    return bool(idle == 0 and size >= most)


def _open(conn: Any) -> bool:
    """Whether a pooled connection still serves: asyncpg hands one closed underneath (by
    PostgreSQL, or terminated) back to the pool itself, after which it refuses even
    is_closed()."""
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


class HeldConnection:
    """A pooled connection kept across round trips that are made one at a time (a
    Batcher's: store/batches.py, Rule 4) and handed back when they stop.

    A pooled connection's acquire and release cost about as much client CPU as a trivial
    statement's round trip (asyncpg's release shields a new Task, re-arms a timer and runs
    the reset; measured here: about 120 us for acquire, `SELECT 1` and release, against
    about 70 us for the statement on a connection already held). Under load Build's record
    batcher sends one round trip after another; holding the connection between them saves
    that per round trip. It is not kept from anyone: after a round trip that finds every
    connection of the pool out (others may be waiting for one), it goes back at once, as
    it would have without holding. On any failure it goes back too (the pool discards a
    broken one) and the next use acquires afresh; failures map as acquire's do.
    """

    def __init__(self, pool: asyncpg.Pool, timeout: float = 5.0) -> None:
        self._pool = pool
        self._timeout = timeout
        self._conn: Any = None

    @asynccontextmanager
    async def use(self) -> AsyncIterator[Any]:
        """The held connection, acquired first if none is held (or the one held was
        closed, as by a PostgreSQL restart, while no round trip used it)."""
        handed_out = False
        try:
            if self._conn is not None and not _open(self._conn):
                await self.release()
            if self._conn is None:
                asked = time.perf_counter()
                try:
                    async with asyncio.timeout(self._timeout):
                        self._conn = await self._pool.acquire()
                finally:  # as acquire() does: a wait that timed out counts
                    telemetry.record_pool_wait(time.perf_counter() - asked)
            handed_out = True
            try:
                yield self._conn
            except BaseException:
                await self.release()
                raise
            if _exhausted(self._pool):
                await self.release()
        except asyncpg.LockNotAvailableError:
            raise SessionBusyError() from None
        except (*_UNAVAILABLE, asyncpg.PostgresError) as exc:
            unavailable = _unavailable(exc, handed_out)
            if unavailable is None:
                raise
            raise unavailable from exc

    async def release(self) -> None:
        """Hand the connection back to the pool, if one is held (a no-op for one asyncpg
        handed back itself, closed underneath). It is let go before the first await, so a
        use that starts meanwhile acquires its own. A connection that fails to go back
        (its reset met a dropped connection) is terminated by asyncpg, which frees its
        place in the pool; nothing waits on the release, so that is not raised."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(*_UNAVAILABLE, asyncpg.PostgresError):
                await self._pool.release(conn)


@asynccontextmanager
async def transaction(pool: asyncpg.Pool, timeout: float = 5.0) -> AsyncIterator[Any]:
    """A connection inside a transaction: all of a write lands, or none of it. Any lock
    it waits for (a session's row, a person's fence, a tenant's correction) it waits for
    at most LOCK_WAIT_SECONDS (SESSION_BUSY), set first: one round trip per write."""
    async with acquire(pool, timeout) as conn:
        try:
            async with conn.transaction():
                await conn.execute(_LOCK_WAIT, lock_wait_setting())
                yield conn
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"PostgreSQL unavailable: {type(exc).__name__}") from exc


@asynccontextmanager
async def snapshot(pool: asyncpg.Pool, timeout: float = 5.0) -> AsyncIterator[Any]:
    """A connection inside a read-only REPEATABLE READ transaction: every read it makes sees
    one committed state, without a lock (CommitCompaction's unlocked pass, which reads a
    dozen tables and compares what moved once it holds the lock)."""
    async with acquire(pool, timeout) as conn:
        try:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                yield conn
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"PostgreSQL unavailable: {type(exc).__name__}") from exc
