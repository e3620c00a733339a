"""The server shell: grpc.aio with health checking and reflection, graceful shutdown.

SIGTERM flips health to NOT_SERVING first (so load balancers stop sending), then gives
in-flight RPCs the grace period to finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from .._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from ..config import Settings
from ..core.framing import DEFAULT_POLICY_TEXT, DEFAULT_POLICY_VERSION
from ..core.spec import PlatformPolicySpec
from ..models import ModelCatalog
from ..store import apply_migrations, connect_pool
from .engine import Engine
from .servicer import ContextEngineServicer

__all__ = ["RunningServer", "build_engine", "build_server", "serve"]

_log = logging.getLogger("context_engine.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ContextEngine"].full_name


def build_engine(pool: asyncpg.Pool, catalog: ModelCatalog | None = None) -> Engine:
    catalog = catalog or ModelCatalog.builtin()
    return Engine(
        pool,
        model_facts=catalog.facts,
        token_counter=catalog.counter,
        default_policy=PlatformPolicySpec(version=DEFAULT_POLICY_VERSION, text=DEFAULT_POLICY_TEXT),
        clock=lambda: datetime.now(UTC),
        new_id=lambda: str(uuid.uuid4()),
        new_secret=lambda: os.urandom(32),
    )


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: Any
    engine: Engine

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def build_server(
    engine: Engine,
    listen: str,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_message_bytes: int = 16 * 1024 * 1024,
) -> RunningServer:
    """Create, bind and start a server. Port 0 binds a free port (returned)."""
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
    pb_grpc.add_ContextEngineServicer_to_server(ContextEngineServicer(engine), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot bind {listen}")
    await server.start()
    for name in (SERVICE_NAME, ""):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, port, health_servicer, engine)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT: connect (or start the embedded database), migrate, serve."""
    dsn = settings.database_url
    embedded = None
    if not dsn:
        from ..embedded_db import start_embedded

        dsn, embedded = start_embedded(settings.data_dir)
        _log.info("started embedded PostgreSQL in %s", settings.data_dir)
    pool = await connect_pool(dsn, min_size=settings.pool_min_size, max_size=settings.pool_max_size)
    async with pool.acquire() as conn:
        applied = await apply_migrations(conn)
    if applied:
        _log.info("applied migrations %s", ", ".join(applied))
    running = await build_server(build_engine(pool), settings.listen)
    _log.info("context-engine serving on %s (port %d)", settings.listen, running.port)
    print(
        f"context-engine listening on {settings.listen.rpartition(':')[0]}:{running.port}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    _log.info("shutting down: draining for up to %.1fs", settings.shutdown_grace_seconds)
    await running.stop(settings.shutdown_grace_seconds)
    await pool.close()
    del embedded
