"""Shared test harness.

- Outbound network is blocked for the whole run: only loopback and Unix sockets connect.
- Integration tests get a fresh PostgreSQL database of their own (created on the server at
  TEST_DATABASE_URL, default the local 127.0.0.1:5432), migrated, dropped at the end.
- `grpc_server` is a real grpc.aio server on port 0 over that database.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

BASE_DSN = os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

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
    base, _, _ = BASE_DSN.rpartition("/")
    return f"{base}/{database}"


@pytest.fixture(scope="session")
async def database_dsn() -> AsyncIterator[str]:
    """A fresh, migrated database for this test session."""
    import asyncpg

    from context_engine.store import apply_migrations

    name = f"ce_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(BASE_DSN)
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
    admin = await asyncpg.connect(BASE_DSN)
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
