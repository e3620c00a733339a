"""Shared test harness.

- Outbound network is blocked for the whole run: only loopback and Unix sockets connect.
- Integration tests get a fresh PostgreSQL database of their own (created on the server at
  TEST_DATABASE_URL, default the local 127.0.0.1:5432), migrated, dropped at the end.
- When TEST_DATABASE_URL is not set and nothing accepts connections at the default, a run
  that needs a database starts an embedded PostgreSQL (pgserver, a dev dependency; what
  `make run` uses) once, in a temporary directory, points TEST_DATABASE_URL at it (so
  helpers, subprocesses and modules reading the variable agree) and stops it at the end:
  `make test` on a fresh machine needs no database of its own. A TEST_DATABASE_URL that
  is set but does not answer stops the run with one message, never a silent fallback.
- `grpc_server` is a real grpc.aio server on port 0 over that database.
- Hypothesis runs under the "context-engine" profile, loaded here before any test module
  is imported: no per-example deadline. Hypothesis' default (200 ms) is a timing assertion,
  and on a loaded host a slow example fails a test that checks nothing about speed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import sys
import tempfile
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import pytest
from hypothesis import settings

# Loaded before collection imports the test modules, so settings objects they build at
# import time (`settings(max_examples=...)`) inherit it too.
settings.register_profile("context-engine", deadline=None)
settings.load_profile("context-engine")

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
_VARIABLE = "TEST_DATABASE_URL"
_embedded: dict[str, Any] = {}  # "server", "dir" of the embedded fallback while it runs


def base_dsn() -> str:
    """The test server's maintenance database (read when used: the fallback sets it)."""
    return os.environ.get(_VARIABLE, DEFAULT_DSN)


def _needs_database(item: pytest.Item) -> bool:
    return (
        item.get_closest_marker("integration") is not None
        or "database_dsn" in getattr(item, "fixturenames", ())
        or Path(__file__).parent / "integration" in Path(item.path).parents
    )


def _accepts_connections(dsn: str) -> bool:
    parts = urlsplit(dsn)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5432), 1):
            return True
    except OSError:
        return False


def _answers(dsn: str) -> str:
    """Empty when PostgreSQL at `dsn` takes a connection, else why not."""
    import asyncpg

    async def probe() -> None:
        conn = await asyncpg.connect(dsn, timeout=5)
        await conn.close()

    loop = asyncio.new_event_loop()  # its own loop: pytest-asyncio's are not touched
    try:
        loop.run_until_complete(probe())
    except Exception as exc:  # any failure: report it, whatever its kind
        return f"{type(exc).__name__}: {exc}"
    finally:
        loop.close()
    return ""


def _start_embedded() -> str:
    """Start pgserver in a temporary directory; its DSN in the one-host URL form the tests
    edit (`.../DATABASE`), the socket directory percent-encoded as the host."""
    directory = tempfile.mkdtemp(prefix="ce-test-pg-")
    with warnings.catch_warnings():  # platformdirs warns about XDG_RUNTIME_DIR at import
        warnings.simplefilter("ignore")
        import pgserver

        server = pgserver.get_server(directory, cleanup_mode="stop")
    _embedded.update(server=server, dir=directory)
    uri = urlsplit(server.get_uri())
    host = dict(parse_qsl(uri.query)).get("host") or uri.netloc.rpartition("@")[2]
    return f"postgresql://postgres@{quote(host, safe='')}{uri.path}"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Settle the test server once the run's tests are known (no database, no start)."""
    if session.config.option.collectonly or not any(map(_needs_database, session.items)):
        return
    if _VARIABLE in os.environ:
        why = _answers(os.environ[_VARIABLE])
        if why:
            message = f"{_VARIABLE} is set but PostgreSQL does not answer there: {why}"
            pytest.exit(message, pytest.ExitCode.USAGE_ERROR)
        return
    if _accepts_connections(DEFAULT_DSN):
        why = _answers(DEFAULT_DSN)
        if not why:
            return
        # Something listens there but refuses us (a stock pg_hba.conf asks for a password):
        # say so once and use an embedded server, as when nothing listens.
        sys.stderr.write(f"PostgreSQL at {DEFAULT_DSN} refused the tests ({why}); ")
        sys.stderr.write("starting an embedded one\n")
    os.environ[_VARIABLE] = _start_embedded()


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _embedded:
        return
    os.environ.pop(_VARIABLE, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _embedded["server"].cleanup()  # pg_ctl stop
    shutil.rmtree(_embedded["dir"], ignore_errors=True)
    _embedded.clear()


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _allowed(sock: socket.socket, address: Any) -> bool:
    if sock.family == getattr(socket, "AF_UNIX", None):
        return True
    host = address[0] if isinstance(address, tuple) else address
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _guarded_connect(self: socket.socket, address: Any) -> Any:
    if not _allowed(self, address):
        raise ConnectionRefusedError(f"tests may not reach the network: {address!r}")
    return _real_connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> Any:
    if not _allowed(self, address):
        raise ConnectionRefusedError(f"tests may not reach the network: {address!r}")
    return _real_connect_ex(self, address)


@pytest.fixture(scope="session", autouse=True)
def _block_network() -> Iterator[None]:
    socket.socket.connect = _guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign]
    yield
    socket.socket.connect = _real_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _real_connect_ex  # type: ignore[method-assign]


def _dsn_for(database: str) -> str:
    base, _, _ = base_dsn().rpartition("/")
    return f"{base}/{database}"


@pytest.fixture(scope="session")
async def database_dsn() -> AsyncIterator[str]:
    """A fresh, migrated database for this test session."""
    import asyncpg

    from context_engine.store import apply_migrations

    name = f"ce_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(base_dsn())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = _dsn_for(name)
    conn = await asyncpg.connect(dsn)
    try:
        await apply_migrations(conn)
    finally:
        await conn.close()
    yield dsn
    admin = await asyncpg.connect(base_dsn())
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(scope="session")
async def pool(database_dsn: str) -> AsyncIterator[Any]:
    from context_engine.store import connect_pool

    pool = await connect_pool(database_dsn, min_size=1, max_size=8)
    yield pool
    await pool.close()


@pytest.fixture(scope="session")
async def grpc_server(pool: Any) -> AsyncIterator[Any]:
    """A real grpc.aio server on 127.0.0.1:0 over the test database."""
    from context_engine.api.server import build_engine, build_server

    running = await build_server(build_engine(pool), "127.0.0.1:0")
    yield running
    await running.stop(0)


@pytest.fixture(scope="session")
async def stub(grpc_server: Any) -> AsyncIterator[Any]:
    import grpc

    from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    yield pb_grpc.ContextEngineStub(channel)
    await channel.close()
