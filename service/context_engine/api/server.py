"""The server shell: grpc.aio with health checking and reflection, graceful shutdown.

SIGTERM flips health to NOT_SERVING first (so load balancers stop sending), then drains
(api/drain.py: calls that still arrive are served for a while, then refused UNAVAILABLE
until none is running or queued), then closes the listener and gives anything still
running what is left of the grace period.

Health: the overall status ("") is liveness: SERVING while the process serves. The
ContextEngine service's status is readiness: it follows a `SELECT 1` against PostgreSQL
every readiness interval, on a connection of its own (`serve`), so a replica that cannot
reach the database stops taking traffic without being restarted, and one whose calls hold
every connection of its pool does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..config import Settings
from ..core import memo_budget
from ..core.envelope import new_plan_secret
from ..core.framing import DEFAULT_POLICY_TEXT, DEFAULT_POLICY_VERSION
from ..core.spec import PlatformPolicySpec
from ..models import ModelCatalog
from ..store import apply_migrations, connect_pool
from ..store.db import StoreUnavailableError
from ..store.migrate import MigrationError, pending_migrations
from ..telemetry import Telemetry
from .collector import tune_collector
from .drain import Drain
from .engine import Engine
from .interceptors import (
    UNAUTHENTICATED_SERVICES,
    AuthInterceptor,
    BearerTokens,
    ClientCertificates,
    Layer,
    Layered,
    RpcObserver,
    SizeLimitInterceptor,
)
from .registration import add_servicer
from .servicer import ContextEngineServicer
from .token_file import TokenFile

__all__ = [
    "RunningServer",
    "StartupError",
    "build_engine",
    "build_server",
    "serve",
    "server_options",
]

_log = logging.getLogger("context_engine.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ContextEngine"].full_name


def build_engine(
    pool: asyncpg.Pool,
    catalog: ModelCatalog | None = None,
    settings: Settings | None = None,
) -> Engine:
    """The engine over `pool`; the catalog and output limits come from `settings` (the
    operator's model registry file and tiktoken directory) unless a catalog is given."""
    settings = settings or Settings()
    catalog = catalog or ModelCatalog.load(settings.models_file, settings.tiktoken_dir)
    return Engine(
        pool,
        model_facts=catalog.facts,
        token_counter=catalog.counter,
        tokenizer_of=catalog.tokenizer,
        cache_breakpoints_of=catalog.cache_breakpoints,
        image_tokens_of=catalog.image_tokens,
        inline_maximum_bytes=settings.inline_maximum_bytes,
        cache_bytes=settings.replica_cache_bytes,
        default_policy=PlatformPolicySpec(version=DEFAULT_POLICY_VERSION, text=DEFAULT_POLICY_TEXT),
        clock=lambda: datetime.now(UTC),
        new_id=lambda: str(uuid.uuid4()),
        new_secret=lambda: new_plan_secret(os.urandom(32)),
    )


class StartupError(Exception):
    """The server cannot start (database unreachable, schema behind); the message says why."""


class _Health(health.aio.HealthServicer):  # type: ignore[misc]
    """grpc's health service, whose Watch ends once shutdown has begun and NOT_SERVING has
    been sent: an open Watch never ended, and held every stop for its whole grace (an
    audit). The same loop as grpc's own, over its state; shutdown wakes every watcher, of
    a service it does not know too (grpc's wakes only the known: a review)."""

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        for condition in list(self._server_watchers.values()):
            async with condition:
                condition.notify_all()

    async def Watch(self, request: Any, context: Any) -> None:
        condition = self._server_watchers[request.service]
        self._watcher_count_by_service[request.service] += 1
        last = None
        try:
            async with condition:
                while True:
                    unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                    status = self._server_status.get(request.service, unknown)
                    if status != last:
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                    if self._gracefully_shutting_down:
                        return
                    await condition.wait()
        finally:
            self._watcher_count_by_service[request.service] -= 1
            if self._watcher_count_by_service[request.service] == 0:
                del self._server_watchers[request.service]
                del self._watcher_count_by_service[request.service]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: Any
    engine: Engine
    telemetry: Telemetry | None = None
    readiness: asyncio.Task[None] | None = None
    drain: Drain | None = None

    async def stop(self, grace: float, linger: float = 0.0) -> None:
        """NOT_SERVING, drain (at most `linger` s of serving late arrivals), then stop the
        listener; all within `grace` s. `stop(0)` stops at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self.health.enter_graceful_shutdown()
        if self.drain is not None:
            await self.drain.drain(linger, grace)
        await self.server.stop(max(deadline - loop.time(), 0.0))
        if self.readiness is not None:
            self.readiness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.readiness


# Ready means writable: a standby (a multi-host DSN after a failover) answers SELECT 1, and
# every write then failed (an audit).
_WRITABLE = "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'"


async def _not_ready(pool: asyncpg.Pool, timeout: float) -> str | None:
    """Why PostgreSQL cannot take this replica's calls now ("read-only", or the failure's
    type: TimeoutError, ConnectionRefusedError...), or None when it can. The type only:
    an exception's text may carry the DSN."""
    conn = None
    why: str | None = "read-only"
    try:
        async with asyncio.timeout(timeout):
            conn = await pool.acquire()
            if await conn.fetchval(_WRITABLE):
                why = None
    except Exception as exc:  # any failure means "not ready"
        why = type(exc).__name__
    finally:
        if conn is not None:
            if why is not None:
                # Dropped: a query cut off by the timeout, released as it is, waited for
                # asyncpg's cancel request, up to its command timeout, while health still
                # said SERVING (an audit); and a connection to a read-only server, kept,
                # never let the probe see the primary again (a review).
                conn.terminate()
            await pool.release(conn)
    return why


async def _follow_readiness(
    pool: asyncpg.Pool, health_servicer: Any, tel: Telemetry, interval: float, timeout: float
) -> None:
    """Keep the service's health status equal to PostgreSQL reachability."""
    ready = True
    # Health starts SERVING (`ready`): the gauge says so from the start, not only after
    # the first interval.
    tel.set_gauge("context_engine.store.ready", 1.0)
    while True:
        await asyncio.sleep(interval)
        why = await _not_ready(pool, timeout)
        now_ready = why is None
        tel.set_gauge("context_engine.store.ready", 1.0 if now_ready else 0.0)
        if now_ready != ready:
            ready = now_ready
            # Why, by type: a timeout, a refused connection and a standby read alike (an
            # audit).
            _log.warning(
                "readiness: PostgreSQL %s", "reachable" if ready else f"unreachable ({why})"
            )
            serving = health_pb2.HealthCheckResponse
            status = serving.SERVING if ready else serving.NOT_SERVING
            await health_servicer.set(SERVICE_NAME, status)


async def build_server(
    engine: Engine,
    listen: str,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_message_bytes: int = 16 * 1024 * 1024,
    telemetry: Telemetry | None = None,
    auth: BearerTokens | ClientCertificates | None = None,
    credentials: grpc.ServerCredentials | None = None,
    readiness_interval: float = 5.0,
    readiness_timeout: float = 2.0,
    readiness_pool: asyncpg.Pool | None = None,
) -> RunningServer:
    """Create, bind and start a server. Port 0 binds a free port (returned).

    Interceptors, outermost first: OpenTelemetry span (only when tracing can record),
    RpcObserver, the shutdown drain, the request size limit (`max_message_bytes`), auth
    (when `auth` is given), then `interceptors`.
    `credentials` makes the listener TLS (mTLS when they require client certificates).
    `readiness_pool`: where readiness takes its connection (the engine's pool when None).
    A pool of its own keeps a busy request pool, every connection held by calls queued on
    a lock, from reading as PostgreSQL being away and every replica from turning
    NOT_SERVING together under load.
    """
    from opentelemetry.instrumentation.grpc import aio_server_interceptor
    from opentelemetry.instrumentation.grpc.filters import negate, service_name

    tel = telemetry or Telemetry()
    tel.observe_pool(engine.pool)
    drain = Drain()
    # The span interceptor only where a span can be recorded (Telemetry.traces); otherwise
    # the observer reads the caller's traceparent for the log line itself.
    spans = (
        [
            aio_server_interceptor(  # type: ignore[no-untyped-call]  # unannotated in otel
                tracer_provider=tel.tracer_provider,
                filter_=negate(service_name(*UNAUTHENTICATED_SERVICES)),
            )
        ]
        if tel.traces
        else []
    )
    # The span interceptor runs per call (it opens the span); the rest wrap each method's
    # handler once, as one interceptor (api/interceptors.py, rule 6).
    # The size limit before auth, which fills an empty tenant_id in: after it, the limit
    # measured bytes the caller never sent and refused a request just under it (an audit).
    layers: list[Layer] = [
        RpcObserver(tel),
        drain,
        SizeLimitInterceptor(max_message_bytes),
        *([AuthInterceptor(auth)] if auth is not None else []),
    ]
    chain: list[grpc.aio.ServerInterceptor] = [*spans, Layered(layers), *interceptors]
    # The transport accepts up to twice the limit so an oversize request reaches the size
    # interceptor and fails with structured details rather than a bare transport error.
    # Responses are not capped: a write commits before its answer is sent, and an answer
    # over a cap (AppendItems' sequences and ids for 14,000 small items, a plan of 20,000
    # scopes: an audit) failed RESOURCE_EXHAUSTED after the commit, a write reported as
    # refused. What a response holds is bounded by the request, the input caps (a plan's
    # scopes: convert.MAX_SCOPES) and what the session holds (PrepareCompaction's input is
    # the run's history), all of it built in memory before a cap could refuse it anyway.
    transport_limit = min(2 * max_message_bytes, 2**31 - 1)
    server = grpc.aio.server(
        interceptors=chain,
        options=[
            ("grpc.max_receive_message_length", transport_limit),
            ("grpc.max_send_message_length", -1),
            # grpc sets SO_REUSEPORT by default, so a second server on a taken port (another
            # replica, a stale process) bound it too and took a share of its connections
            # silently. Off, the bind fails and `serve` says the address is in use.
            ("grpc.so_reuseport", 0),
        ],
    )
    add_servicer(ContextEngineServicer(engine), server)
    health_servicer = _Health()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        if credentials is not None:
            port = server.add_secure_port(listen, credentials)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:  # grpcio's "Failed to bind to address ..."
        port = 0
    if port == 0:
        why = "the address is in use or not available"
        if credentials is not None:  # grpc refuses a certificate it cannot load the same way
            why += (
                ", or the TLS files were refused (the certificate and key not a matching PEM"
                " pair, or tls_client_ca_file no CA certificate)"
            )
        raise OSError(f"cannot listen on {listen}: {why}")
    await server.start()
    for name in (SERVICE_NAME, ""):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    readiness = asyncio.create_task(
        _follow_readiness(
            readiness_pool or engine.pool,
            health_servicer,
            tel,
            readiness_interval,
            readiness_timeout,
        ),
        name="context-engine-readiness",
    )
    return RunningServer(server, port, health_servicer, engine, tel, readiness, drain)


def server_options(settings: Settings) -> dict[str, Any]:
    """build_server keyword arguments from settings: limits, auth, TLS, readiness."""
    options: dict[str, Any] = {
        "max_message_bytes": settings.max_request_bytes,
        "readiness_interval": settings.readiness_interval_seconds,
        "readiness_timeout": settings.readiness_timeout_seconds,
    }
    if settings.auth == "bearer":
        options["auth"] = BearerTokens(settings.bearer_tokens())
    elif settings.auth == "mtls":
        options["auth"] = ClientCertificates(settings.tls_client_tenants)
    if settings.tls_cert_file:
        ca = Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
        options["credentials"] = grpc.ssl_server_credentials(
            [(Path(settings.tls_key_file).read_bytes(), Path(settings.tls_cert_file).read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )
    return options


async def _migrated(pool: asyncpg.Pool, migrate: bool) -> list[str]:
    """Apply the migrations (`migrate`) or list those pending; returns the pending ones."""
    async with pool.acquire() as conn:
        if not migrate:
            return await pending_migrations(conn)
        if applied := await apply_migrations(conn):
            _log.info("applied migrations %s", ", ".join(applied))
        return []


async def serve(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT: connect (or start the embedded database), migrate, serve."""
    dsn = settings.database_url
    embedded = None
    try:
        if not dsn:
            from ..embedded_db import start_embedded

            # Raises ConfigError (exit 2) where the embedded PostgreSQL is not installed.
            dsn, embedded = start_embedded(settings.data_dir)
            # Started here, or joined where another server started it on this directory.
            _log.info("using the embedded PostgreSQL in %s", settings.data_dir)
        pool = await connect_pool(
            dsn, min_size=settings.pool_min_size, max_size=settings.pool_max_size
        )
    except StoreUnavailableError as exc:
        raise StartupError(str(exc)) from None
    try:
        pending = await _migrated(pool, settings.migrate_on_start)
    except MigrationError as exc:
        await pool.close()
        raise StartupError(str(exc)) from None
    except (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError) as exc:
        # Lost or stalled mid-way (a failover, a lock held past the command timeout): one
        # line, as an unreachable database at start is (an audit: a traceback). What was
        # applied before stays; the rest is applied at the next start. Terminated: a graceful
        # close would wait on the database that stopped answering.
        pool.terminate()
        why = str(exc) or type(exc).__name__
        raise StartupError(f"lost the database while checking migrations: {why}") from None
    if pending:
        await pool.close()
        raise StartupError(
            f"the database schema is behind (pending: {', '.join(pending)});"
            " run `context-engine migrate` first"
        )
    try:
        tel = Telemetry.from_environment(settings.metrics_listen)
    except OSError as exc:
        await pool.close()
        raise StartupError(f"metrics_listen {settings.metrics_listen}: {exc.strerror}") from None
    except ValueError as exc:  # OTEL_TRACES_SAMPLER_ARG, or metrics_listen's port
        await pool.close()
        raise StartupError(str(exc)) from None
    memo_budget.set_limit(settings.render_memo_bytes)  # process-wide, like the memos
    engine, options = build_engine(pool, settings=settings), server_options(settings)
    # Readiness asks PostgreSQL on a connection of its own (build_server).
    try:
        options["readiness_pool"] = await connect_pool(dsn, min_size=1, max_size=1)
    except StoreUnavailableError as exc:
        tel.shutdown()
        await pool.close()
        raise StartupError(str(exc)) from None
    # Before serving: the collection it makes stalls no call, and no call's objects are
    # frozen with start-up's.
    frozen = tune_collector(settings.gc_thresholds)
    _log.info("collector thresholds %s, %d start-up objects frozen", gc.get_threshold(), frozen)
    try:
        running = await build_server(engine, settings.listen, telemetry=tel, **options)
    except OSError as exc:
        # Found only after the migrations, because build_server starts serving as soon as
        # it has bound; harmless, they are idempotent and every replica may apply them.
        tel.shutdown()
        await options["readiness_pool"].close()
        await pool.close()
        raise StartupError(str(exc)) from None
    _log.info(
        "context-engine serving on %s (port %d, tls %s, auth %s)",
        settings.listen,
        running.port,
        "on" if settings.tls_cert_file else "off",
        settings.auth,
    )
    if tel.metrics_port:
        host = settings.metrics_listen.rpartition(":")[0]
        _log.info("prometheus metrics on http://%s:%d/metrics", host, tel.metrics_port)
    if untyped := settings.untyped_client_identities():
        _log.warning(
            "tls_client_tenants: %d keys name no identity type and are ignored (%s);"
            " remove them once no replica older than typed keys serves",
            len(untyped),
            ", ".join(repr(k) for k in untyped[:3]),
        )
    following = _follow_token_file(settings, options.get("auth"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Said only once SIGTERM drains: a supervisor may stop the process as soon as it reads
    # this line (before, a SIGTERM that quick killed it undrained, exit -15).
    print(
        f"context-engine listening on {settings.listen.rpartition(':')[0]}:{running.port}",
        flush=True,
    )
    await stop.wait()
    if following is not None:
        following.cancel()
    _log.info("shutting down: draining for up to %.1fs", settings.shutdown_grace_seconds)
    try:
        await running.stop(settings.shutdown_grace_seconds, settings.shutdown_linger_seconds)
    finally:  # the calls' spans and metrics are flushed even if the drain fails
        tel.shutdown()
    await _close(options["readiness_pool"])
    await _close(pool)
    del embedded


def _follow_token_file(settings: Settings, auth: object) -> asyncio.Task[None] | None:
    """The task keeping bearer tokens as auth_tokens_file says (api/token_file.py), or None
    where there is no file to follow."""
    interval = settings.auth_tokens_reload_seconds
    if not isinstance(auth, BearerTokens) or not settings.auth_tokens_file or not interval:
        return None
    follower = TokenFile(settings, auth)
    return asyncio.create_task(follower.follow(interval), name="context-engine-token-file")


_CLOSE_SECONDS = 2.0


async def _close(pool: asyncpg.Pool) -> None:
    """Close `pool`, or drop its connections if PostgreSQL does not answer within
    _CLOSE_SECONDS: a close waits for each connection's goodbye, and with PostgreSQL hung
    it raised after asyncpg's command timeout, the process exiting 1 with the request pool
    never closed (an audit)."""
    try:
        async with asyncio.timeout(_CLOSE_SECONDS):
            await pool.close()
    except Exception:
        pool.terminate()
