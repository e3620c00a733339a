"""Lifecycle: a real `context-engine serve` process, its configuration, readiness, shutdown,
deadlines and migrations.

- SIGTERM: health goes NOT_SERVING while an in-flight call (held on a session row lock)
  is still running; the call then finishes; the process exits 0. Under load (sixteen
  callers building in a closed loop that ignore health, four appends held on locks),
  every call a handler had started finishes OK, each caller is refused exactly once,
  UNAVAILABLE with reason SHUTTING_DOWN by the drain (never CANCELLED: nothing was queued
  in the transport when the listener closed), and every acknowledged Build's record is
  in the log.
- Configuration from a file and the environment is validated at start: a bad value exits
  2 with a message naming the setting.
- Readiness follows PostgreSQL reachability (a database of the test's own is closed to
  connections and reopened; the shared server is never stopped).
- A PostgreSQL that stops answering (a loopback relay that hangs, `HangingLink`): a
  readiness check cut off mid-query turns NOT_SERVING at once, and closing the pools is
  bounded.
- A call whose deadline passes while it waits on PostgreSQL fails DEADLINE_EXCEEDED, its
  query is cancelled server-side, and it writes nothing.
- `migrate` is a separate step: `serve` with migrate_on_start=false refuses a database
  whose schema is behind, and starts once `migrate` has run.
- Start-up failures are one line and exit 1, never a traceback: PostgreSQL unreachable or
  refusing (no such database, no such role; the password never printed) for `serve` and
  `migrate`, an embedded PostgreSQL that cannot start, a listen address in use.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from context_engine import cli
from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine.api import server as server_module
from context_engine.api.server import SERVICE_NAME, build_engine, build_server
from context_engine.config import ConfigError, load_settings, unknown_variables
from context_engine.store import connect_pool

from .helpers import (
    TENANT,
    HangingLink,
    admin_execute,
    assistant,
    create_database,
    details,
    drop_database,
    dsn_on_test_server,
    new_id,
    open_session,
    spec,
    start_run,
    wait_for,
)

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def _env(**settings: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_ENGINE_")}
    env.pop("DATABASE_URL", None)
    env.update({f"CONTEXT_ENGINE_{k.upper()}": str(v) for k, v in settings.items()})
    return env


async def _cli(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "context_engine.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _listening_port(proc: asyncio.subprocess.Process) -> int:
    """The port from the "listening on HOST:PORT" line `serve` prints when it is up."""
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert b"listening on" in line, line
    return int(line.decode().rsplit(":", 1)[1])


async def _log_records(proc: asyncio.subprocess.Process) -> list[dict[str, Any]]:
    """The JSON log records `proc` wrote to stderr, once it has exited (killed if not)."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    assert proc.stderr is not None
    lines = (await proc.stderr.read()).decode().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


async def _lock_session(dsn: str, session_id: str) -> asyncpg.Connection:
    """Hold the session's row lock in an open transaction, as a concurrent writer would."""
    conn = await asyncpg.connect(dsn)
    await conn.execute("BEGIN")
    await conn.execute(
        "SELECT 1 FROM sessions WHERE tenant_id = $1 AND session_id = $2 FOR UPDATE",
        TENANT,
        UUID(session_id),
    )
    return conn


async def _lock_waiters(conn: asyncpg.Connection) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
    )


def _append(session_id: str, run_id: str, version: int) -> pb.AppendItemsRequest:
    return pb.AppendItemsRequest(
        tenant_id=TENANT,
        session_id=session_id,
        run_id=run_id,
        expected_checkpoint_version=version,
        items=[assistant("done")],
    )


@pytest.fixture
async def own_database() -> AsyncIterator[str]:
    dsn = await create_database()
    yield dsn
    await drop_database(dsn)


# --- shutdown ----------------------------------------------------------------------


async def _serve_for_shutdown(dsn: str) -> asyncio.subprocess.Process:
    """`serve` on a free port with a long grace period, logging JSON lines to stderr."""
    return await _cli(
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        dsn,
        env=_env(shutdown_grace_seconds=60, log_format="json"),
    )


async def test_sigterm_goes_not_serving_and_in_flight_call_finishes(own_database: str) -> None:
    proc = await _serve_for_shutdown(own_database)
    try:
        port = await _listening_port(proc)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            session_id, _ = await open_session(stub)
            run = (await start_run(stub, session_id, "hello")).run
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            )
            assert (await watch.read()).status == SERVING

            locker = await _lock_session(own_database, session_id)
            in_flight = asyncio.ensure_future(stub.AppendItems(_append(session_id, run.run_id, 1)))
            await wait_for(lambda: _lock_waiters(locker), what="the call to wait on the lock")

            proc.send_signal(signal.SIGTERM)
            assert (await watch.read()).status == NOT_SERVING
            watch.cancel()
            assert not in_flight.done()

            await locker.execute("ROLLBACK")
            await locker.close()
            response = await in_flight
            assert response.checkpoint_version == 2
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        records = await _log_records(proc)
    assert any(r["msg"].startswith("shutting down") for r in records)
    appended = [r for r in records if r.get("method") == "AppendItems"]
    assert appended and appended[-1]["code"] == "OK"


async def test_sigterm_under_load_drains_every_call_in_flight(own_database: str) -> None:
    proc = await _serve_for_shutdown(own_database)
    assert proc.stderr is not None
    log = asyncio.ensure_future(proc.stderr.read())  # drained as it comes: a full pipe blocks
    acknowledged: list[tuple[str, int]] = []  # (session, request_sequence) of OK Builds
    refused: dict[str, int] = {}
    try:
        port = await _listening_port(proc)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            held = []
            for n in range(4):
                session_id, _ = await open_session(stub)
                held.append((session_id, (await start_run(stub, session_id, f"held {n}")).run))
            builds = []
            for n in range(2):
                session_id, _ = await open_session(stub)
                run = (await start_run(stub, session_id, f"load {n}")).run
                builds.append(
                    pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run.run_id)
                )

            locker = await asyncpg.connect(own_database)
            await locker.execute("BEGIN")
            await locker.execute(
                "SELECT 1 FROM sessions WHERE tenant_id = $1 AND session_id = ANY($2::uuid[])"
                " FOR UPDATE",
                TENANT,
                [UUID(s) for s, _ in held],
            )
            in_flight = [
                asyncio.ensure_future(stub.AppendItems(_append(s, run.run_id, 1)))
                for s, run in held
            ]
            # Counted from outside the locking transaction: inside it, PostgreSQL keeps the
            # first pg_stat_activity snapshot for the transaction's lifetime.
            watcher = await asyncpg.connect(own_database)
            try:
                await wait_for(
                    lambda: _at_least(_lock_waiters(watcher), len(held)),
                    what="the held appends to wait on their locks",
                )
            finally:
                await watcher.close()
            stopping = asyncio.Event()
            begun_after_stop = 0  # Builds sent after SIGTERM that were served

            async def builder(n: int) -> None:
                request = builds[n % len(builds)]
                nonlocal begun_after_stop
                while True:
                    after_stop = stopping.is_set()
                    try:
                        response = await stub.Build(request, timeout=30)
                    except grpc.aio.AioRpcError as exc:
                        refused[exc.code().name] = refused.get(exc.code().name, 0) + 1
                        if stopping.is_set():
                            return
                        raise
                    acknowledged.append((request.session_id, response.request_sequence))
                    begun_after_stop += after_stop

            load = [asyncio.ensure_future(builder(n)) for n in range(16)]
            await wait_for(lambda: _truthy(len(acknowledged) >= 50), what="the load to get going")
            stopping.set()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            assert not any(call.done() for call in in_flight)

            await locker.execute("ROLLBACK")
            await locker.close()
            responses = await asyncio.gather(*in_flight)
            assert [r.checkpoint_version for r in responses] == [2] * len(held)
            await asyncio.wait_for(asyncio.gather(*load), 60)
            # Served while lingering: callers that ignore health still got answers, more
            # than the calls they had under way when the signal came.
            assert begun_after_stop > 2 * len(load), begun_after_stop
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    # Each caller stops at its first refusal, so the drain sees them all go quiet before
    # the listener closes: every refusal is the drain's, none a transport CANCELLED.
    assert refused == {"UNAVAILABLE": len(load)}, refused
    lines = (await asyncio.wait_for(log, 60)).decode().splitlines()
    served = [json.loads(line) for line in lines if line.strip()]
    built = [r for r in served if r.get("method") == "Build"]
    ok = [r for r in built if r["code"] == "OK"]
    drained = [r for r in built if r["code"] != "OK"]
    assert len(ok) >= len(acknowledged)
    assert [(r["code"], r.get("reason")) for r in drained] == [
        ("UNAVAILABLE", "SHUTTING_DOWN")
    ] * len(load)
    conn = await asyncpg.connect(own_database)
    try:
        logged = {
            (str(r["session_id"]), r["sequence"])
            for r in await conn.fetch(
                "SELECT session_id, sequence FROM session_events"
                " WHERE type = 'model.request.started'"
            )
        }
        versions = await conn.fetch(
            "SELECT max(version) AS v FROM run_checkpoints WHERE run_id = ANY($1::uuid[])"
            " GROUP BY run_id",
            [UUID(run.run_id) for _, run in held],
        )
    finally:
        await conn.close()
    assert acknowledged and set(acknowledged) <= logged
    assert sorted(r["v"] for r in versions) == [2] * len(held)


async def test_the_drain_lingers_then_refuses_and_ends_while_callers_keep_calling(
    pool: Any,
) -> None:
    """Callers that never pause (as a retry policy with no backoff would) are served while
    the drain lingers, then refused UNAVAILABLE with reason SHUTTING_DOWN, and do not hold
    the drain open: the server stops long before its 60 s grace period would end."""
    running = await build_server(build_engine(pool), "127.0.0.1:0")
    outcomes: list[tuple[str, str]] = []  # (code, reason) of calls made after stop began
    stopping: asyncio.Task[None] | None = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            session_id, _ = await open_session(stub)
            request = pb.GetPlanRequest(tenant_id=TENANT, session_id=session_id)
            served_before = 0

            async def caller() -> None:
                nonlocal served_before
                while stopping is None or not stopping.done():
                    begun = stopping is not None
                    try:
                        await stub.GetPlan(request, timeout=10)
                        code, reason = "OK", ""
                    except grpc.aio.AioRpcError as exc:
                        code, reason = exc.code().name, _reason(exc)
                    if begun:
                        outcomes.append((code, reason))
                    else:
                        served_before += 1

            callers = [asyncio.ensure_future(caller()) for _ in range(4)]
            await wait_for(lambda: _truthy(served_before >= 8), what="the callers to get going")
            # Two seconds of linger: more than eight calls need be served in it, which a
            # loaded host failed to do in half a second (a test run beside another).
            stopping = asyncio.ensure_future(running.stop(60, linger=2.0))
            await asyncio.wait_for(asyncio.shield(stopping), 20)
            await asyncio.wait_for(asyncio.gather(*callers), 20)
    finally:
        if stopping is None:
            await running.stop(0)
    # Served while lingering: more calls than the callers could have had under way when
    # the stop began (without the linger they are refused at once).
    assert outcomes.count(("OK", "")) > 2 * len(callers), outcomes
    assert ("UNAVAILABLE", "SHUTTING_DOWN") in outcomes  # then refused
    # Afterwards the listener is gone (UNAVAILABLE without details); a call caught in the
    # instant it closed is CANCELLED by grpc core. Nothing else.
    codes = {code for code, _ in outcomes}
    assert codes <= {"OK", "UNAVAILABLE", "CANCELLED"}, sorted(set(outcomes))


def _reason(error: grpc.aio.AioRpcError) -> str:
    """ErrorInfo.reason, or "" for a status without details (grpc's own)."""
    raw = dict(error.trailing_metadata() or ()).get("grpc-status-details-bin")
    return details(error)[0] if raw else ""


async def _at_least(count: Any, minimum: int) -> bool:
    return int(await count) >= minimum


async def _truthy(value: bool) -> bool:
    return value


# --- configuration -----------------------------------------------------------------


# TLS files that pass the configuration's check (a PEM block): written by the test.
_TLS = {"tls_cert_file": "@pem", "tls_key_file": "@pem", "tls_client_ca_file": "@pem"}


@pytest.mark.parametrize(
    ("file_settings", "env_settings", "named"),
    [
        ({}, {"pool_min_size": "0"}, "CONTEXT_ENGINE_POOL_MIN_SIZE"),
        # A check across settings names where each came from (an audit).
        (
            {"pool_min_size": 5},
            {"pool_max_size": "3"},
            "pool_max_size from CONTEXT_ENGINE_POOL_MAX_SIZE",
        ),
        ({"max_request_bytes": "lots"}, {}, "max_request_bytes"),
        ({"listne": "127.0.0.1:1"}, {}, "listne"),
        ({"auth": "bearer"}, {}, "auth_tokens"),
        ({}, {"log_level": "chatty"}, "CONTEXT_ENGINE_LOG_LEVEL"),
        ({"tls_cert_file": "/nonexistent/cert.pem"}, {}, "tls_cert_file"),
        ({}, {"metrics_listen": "9464"}, "CONTEXT_ENGINE_METRICS_LISTEN"),
        # Its own metrics endpoint took the port after the migrations (an audit).
        ({"listen": "127.0.0.1:7071", "metrics_listen": "127.0.0.1:7071"}, {}, "must differ"),
        ({}, {"gc_thresholds": "often"}, "CONTEXT_ENGINE_GC_THRESHOLDS"),
        ({"gc_thresholds": [700, -1, 10]}, {}, "gc_thresholds"),
        ({"gc_thresholds": [700, 10]}, {}, "gc_thresholds"),
        ({}, {"gc_thresholds": "2147483648,10,10"}, "CONTEXT_ENGINE_GC_THRESHOLDS"),
        ({}, {"shutdown_grace_seconds": "inf"}, "CONTEXT_ENGINE_SHUTDOWN_GRACE_SECONDS"),
        ({"readiness_interval_seconds": "NaN"}, {}, "readiness_interval_seconds"),
        ({"tls_cert_file": "@not-pem", "tls_key_file": "@not-pem"}, {}, "holds no PEM block"),
        # Credentials for an auth mode that is off: ignored, every call went unauthenticated.
        ({"auth_tokens": {"t0ken": "acme"}}, {}, 'need auth "bearer"'),
        ({"tls_client_tenants": {"cn:w": "acme"}}, {}, 'needs auth "mtls"'),
        # Client certificates required and their identity ignored: any holder, any tenant.
        (_TLS, {}, 'tls_client_ca_file needs auth "mtls"'),
        # An empty identity or tenant: a certificate without a CN would map.
        ({**_TLS, "auth": "mtls", "tls_client_tenants": {"": "acme"}}, {}, "tls_client_tenants"),
        ({**_TLS, "auth": "mtls", "tls_client_tenants": {"cn:w": ""}}, {}, "tls_client_tenants"),
        ({**_TLS, "auth": "mtls", "tls_client_tenants": {"cn:": "acme"}}, {}, "identity type"),
        # An untyped key: a CN spelling a SPIFFE ID mapped like the URI (an audit).
        (
            {**_TLS, "auth": "mtls", "tls_client_tenants": {"spiffe://x.example/w": "acme"}},
            {},
            "no key names an identity type",
        ),
    ],
)
def test_bad_configuration_exits_2_naming_the_setting(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    file_settings: dict[str, Any],
    env_settings: dict[str, str],
    named: str,
) -> None:
    config = tmp_path / "config.json"
    not_pem = tmp_path / "not.pem"  # a file that exists but is no certificate
    not_pem.write_text("certificate goes here")
    pem = tmp_path / "some.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    placed = {"@not-pem": str(not_pem), "@pem": str(pem)}
    settings = {
        k: placed[v] if isinstance(v, str) and v in placed else v for k, v in file_settings.items()
    }
    config.write_text(json.dumps(settings))
    for key in list(os.environ):
        if key.startswith("CONTEXT_ENGINE_"):
            monkeypatch.delenv(key)
    for key, value in _env(config=config, **env_settings).items():
        if key.startswith("CONTEXT_ENGINE_"):
            monkeypatch.setenv(key, value)
    code = cli.main(["serve", "--database-url", "postgresql://127.0.0.1:1/never"])
    assert code == 2
    message = capsys.readouterr().err
    assert message.startswith("context-engine: invalid configuration")
    assert named in message


def test_a_check_across_settings_names_its_settings_not_words_of_their_values() -> None:
    """Where each setting a cross-setting error names came from, and only those: "listen"
    inside a path named no setting (a review)."""
    from context_engine.config import _problem

    error = {"loc": (), "msg": "Value error, tls_cert_file: no such file: /srv/listen.pem"}
    source = {"tls_cert_file": "--tls-cert-file", "listen": "--listen"}
    assert _problem(error, source).endswith("(tls_cert_file from --tls-cert-file)")


def test_a_bad_sampling_ratio_is_a_configuration_error_before_the_database(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """OTEL_TRACES_SAMPLER_ARG was checked after the database was reached and migrated, and
    failed as a start-up error (exit 1; an audit). It is configuration: exit 2, first."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "2")
    # Without a trace exporter the sampler variables are not read (a review: an unknown
    # sampler stopped a server that exports no spans): the database is reached, exit 1.
    assert cli.main(["serve", "--database-url", "postgresql://127.0.0.1:1/never"]) == 1
    capsys.readouterr()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    code = cli.main(["serve", "--database-url", "postgresql://127.0.0.1:1/never"])
    assert code == 2
    assert "OTEL_TRACES_SAMPLER_ARG='2' is not a ratio from 0 to 1" in capsys.readouterr().err


def test_an_otlp_protocol_other_than_grpc_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The exporters speak OTLP over gRPC only: http/protobuf was ignored without a word,
    and nothing reached a collector listening for it (an audit)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    code = cli.main(["serve", "--database-url", "postgresql://127.0.0.1:1/never"])
    assert code == 2
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='http/protobuf'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://postgres@127.0.0.1:notaport/x", "Port could not be cast"),
        ("postgresql://postgres@127.0.0.1:99999/x", "Port out of range"),
        ("postgresql://postgres@[::1/x", "Invalid IPv6 URL"),
        ("mysql://root@127.0.0.1/x", "must be a postgresql:// URL"),
        ("garbage", "must be a postgresql:// URL"),
    ],
)
def test_a_malformed_database_url_is_a_configuration_error(url: str, says: str) -> None:
    """An audit: asyncpg's parse of these raised from inside the connect (a traceback,
    exit 1); each is now named as the setting it is, exit 2."""
    with pytest.raises(ConfigError) as refused:
        load_settings({"database_url": url}, environ={})
    assert "database_url (--database-url)" in str(refused.value)
    assert says in str(refused.value)
    # Named as the variable (or file) the value came from: a typo in DATABASE_URL was
    # reported as CONTEXT_ENGINE_DATABASE_URL, which the user never set (an audit).
    for environ, named in (
        ({"DATABASE_URL": url}, "DATABASE_URL"),
        ({"CONTEXT_ENGINE_DATABASE_URL": url}, "CONTEXT_ENGINE_DATABASE_URL"),
    ):
        with pytest.raises(ConfigError) as refused:
            load_settings(environ=environ)
        assert f"database_url ({named}): " in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://postgres@127.0.0.1:5432/x",
        "postgres://u:p@db/x?sslmode=require",
        "postgresql://u@h1:5432,h2:5433/x",  # several hosts: asyncpg's to read
        "postgresql:///x?host=/var/run/postgresql",
    ],
)
def test_a_well_formed_database_url_is_taken_as_given(url: str) -> None:
    assert load_settings({"database_url": url}, environ={}).database_url == url


def test_an_empty_database_url_variable_does_not_hide_database_url() -> None:
    """An empty CONTEXT_ENGINE_DATABASE_URL hid DATABASE_URL, and the server started on
    the embedded database instead (an audit)."""
    url = "postgresql://u@db:5432/x"
    env = {"CONTEXT_ENGINE_DATABASE_URL": "", "DATABASE_URL": url}
    assert load_settings(environ=env).database_url == url


def test_an_empty_database_url_variable_does_not_hide_the_config_files(tmp_path: Path) -> None:
    """An empty CONTEXT_ENGINE_DATABASE_URL sets nothing (docs/operations.md): it hid the
    config file's database_url, and `migrate` applied the migrations to a new embedded
    database instead (an audit). Another setting's empty value is a value: an empty
    CONTEXT_ENGINE_METRICS_LISTEN turns the file's metrics listener off."""
    url = "postgresql://u@db:5432/from-file"
    config = tmp_path / "ce.json"
    config.write_text(json.dumps({"database_url": url, "metrics_listen": "127.0.0.1:9464"}))
    env = {
        "CONTEXT_ENGINE_CONFIG": str(config),
        "CONTEXT_ENGINE_DATABASE_URL": "",
        "CONTEXT_ENGINE_METRICS_LISTEN": "",
    }
    settings = load_settings(environ=env)
    assert (settings.database_url, settings.metrics_listen) == (url, "")


def test_a_variable_that_names_no_setting_is_reported() -> None:
    """A misspelt CONTEXT_ENGINE_* variable was silently ignored (an audit:
    ..._MIGRATE_ON_STARTUP=false migrated on start); serve logs each such name."""
    env = {
        "CONTEXT_ENGINE_MIGRATE_ON_STARTUP": "false",
        "CONTEXT_ENGINE_POOL_MAX_SIZE": "4",
        "CONTEXT_ENGINE_CONFIG": "/etc/ce.json",
        "CONTEXT_ENGINE_TARGET": "127.0.0.1:50051",
        "DATABASE_URL": "postgresql://db/x",
    }
    assert unknown_variables(env) == ["CONTEXT_ENGINE_MIGRATE_ON_STARTUP"]


async def test_bad_configuration_stops_the_real_process(tmp_path: Path) -> None:
    proc = await _cli(
        "serve",
        "--database-url",
        "postgresql://127.0.0.1:1/never",
        env=_env(pool_min_size=5, pool_max_size=2),
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert "pool_min_size (5) must not exceed pool_max_size (2)" in stderr.decode()


def test_an_unknown_key_in_the_config_file_is_named_with_the_file(tmp_path: Path) -> None:
    """A key of the config file that names no setting was reported without the file it
    came from, as every other problem names its source (a review)."""
    config = tmp_path / "config.json"
    config.write_text('{"bogus": 1}', encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={"CONTEXT_ENGINE_CONFIG": str(config)})
    assert f"bogus (CONTEXT_ENGINE_CONFIG={config}): " in str(caught.value)


@pytest.mark.parametrize("content", ["[1]", "null", "42"])
def test_a_config_file_that_is_not_an_object_exits_2_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str,
) -> None:
    """The file is "an object of setting -> value"; valid JSON of another shape was a
    TypeError traceback from dict.update instead of the documented exit 2."""
    config = tmp_path / "config.json"
    config.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"CONTEXT_ENGINE_CONFIG.*expected a JSON object"):
        load_settings(environ={"CONTEXT_ENGINE_CONFIG": str(config)})
    for key in list(os.environ):
        if key.startswith("CONTEXT_ENGINE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("CONTEXT_ENGINE_CONFIG", str(config))
    assert cli.main(["serve", "--database-url", "postgresql://127.0.0.1:1/never"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("context-engine: CONTEXT_ENGINE_CONFIG=")


def test_settings_merge_file_then_environment_then_arguments(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:7000", "pool_max_size": 4}))
    environ = {
        "CONTEXT_ENGINE_CONFIG": str(config),
        "CONTEXT_ENGINE_POOL_MAX_SIZE": "6",
        "CONTEXT_ENGINE_MIGRATE_ON_START": "false",
    }
    settings = load_settings({"listen": "127.0.0.1:7001"}, environ=environ)
    assert (settings.listen, settings.pool_max_size, settings.migrate_on_start) == (
        "127.0.0.1:7001",
        6,
        False,
    )
    with pytest.raises(ConfigError, match="CONTEXT_ENGINE_CONFIG"):
        load_settings(environ={"CONTEXT_ENGINE_CONFIG": str(tmp_path / "missing.json")})


def test_collector_thresholds_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    assert load_settings(environ={}).gc_thresholds == (10_000, 10, 10)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"gc_thresholds": [5000, 20, 30]}))
    from_file = load_settings(environ={"CONTEXT_ENGINE_CONFIG": str(config)})
    assert from_file.gc_thresholds == (5000, 20, 30)
    for text in ("700, 10, 10", "[700,10,10]"):
        environ = {"CONTEXT_ENGINE_GC_THRESHOLDS": text}
        assert load_settings(environ=environ).gc_thresholds == (700, 10, 10)
    # Two or four numbers say what is wanted (an audit: two said "Field required").
    for text in ("700,10", "[1,2,3,4]", "a,b,c"):
        with pytest.raises(ConfigError, match="must be three whole numbers, as 10000,10,10"):
            load_settings(environ={"CONTEXT_ENGINE_GC_THRESHOLDS": text})
    config.write_text(json.dumps({"gc_thresholds": [5000, 20]}))
    with pytest.raises(ConfigError, match="must be three whole numbers"):
        load_settings(environ={"CONTEXT_ENGINE_CONFIG": str(config)})


async def test_serve_applies_the_collector_thresholds_and_freezes_start_up(
    own_database: str,
) -> None:
    """Also: a SIGTERM sent the moment the listening line is read drains and exits 0 (the
    line used to be printed before the signal handlers were installed: exit -15)."""
    proc = await _cli(
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        own_database,
        env=_env(gc_thresholds="12345,6,7", log_format="json"),
    )
    try:
        await _listening_port(proc)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        records = await _log_records(proc)
    (said,) = [r["msg"] for r in records if r["msg"].startswith("collector")]
    thresholds, _, frozen = said.partition("), ")
    assert thresholds == "collector thresholds (12345, 6, 7"
    assert int(frozen.split()[0]) > 10_000  # the modules, classes and schemas start-up made


def test_a_models_file_or_tiktoken_dir_the_server_cannot_use_is_a_configuration_error(
    tmp_path: Path,
) -> None:
    # Found at load time, not after the database connect (where it was a traceback).
    broken = tmp_path / "models.json"
    broken.write_text("{not json")
    cases = {
        "CONTEXT_ENGINE_MODELS_FILE": (str(tmp_path / "missing.json"), "cannot read"),
        "CONTEXT_ENGINE_TIKTOKEN_DIR": (str(tmp_path / "nowhere"), "no such directory"),
    }
    for variable, (value, says) in cases.items():
        with pytest.raises(ConfigError, match=says):
            load_settings(environ={variable: value})
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_settings(environ={"CONTEXT_ENGINE_MODELS_FILE": str(broken)})
    # Not UTF-8: named as the file it is, not a bare codec error (an operator audit).
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"models": "caf\xe9"}')
    with pytest.raises(ConfigError, match=f"models_file.*{latin} is not UTF-8 JSON"):
        load_settings(environ={"CONTEXT_ENGINE_MODELS_FILE": str(latin)})


def test_auth_token_values_never_appear_in_configuration_errors() -> None:
    secret = "s3cr3t-" + "q" * 20
    environ = {
        "CONTEXT_ENGINE_AUTH": "bearer",
        "CONTEXT_ENGINE_AUTH_TOKENS": json.dumps({secret: ""}),
    }
    with pytest.raises(ConfigError) as info:
        load_settings(environ=environ)
    assert secret not in str(info.value)
    bearer = {"CONTEXT_ENGINE_AUTH": "bearer"}
    assert secret not in repr(
        load_settings(environ={**bearer, "CONTEXT_ENGINE_AUTH_TOKENS": json.dumps({secret: "t"})})
    )
    with pytest.raises(ConfigError) as ignored:  # tokens without auth=bearer are refused
        load_settings(environ={"CONTEXT_ENGINE_AUTH_TOKENS": json.dumps({secret: "t"})})
    assert secret not in str(ignored.value)


# --- migrations --------------------------------------------------------------------


async def test_serve_follows_the_bearer_token_file(own_database: str, tmp_path: Path) -> None:
    """`serve` takes a changed auth_tokens_file without a restart (api/token_file.py):
    a removed token is refused, a new one accepted, by the same process."""
    old, new = "old-token-" + "o" * 24, "new-token-" + "n" * 24
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({old: "acme"}))
    proc = await _cli(
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        own_database,
        env=_env(auth="bearer", auth_tokens_file=tokens, auth_tokens_reload_seconds=0.05),
    )
    try:
        port = await _listening_port(proc)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ContextEngineStub(channel)

            async def accepted(token: str) -> bool:
                try:
                    await stub.GetPlan(
                        pb.GetPlanRequest(session_id=new_id()),
                        metadata=(("authorization", f"Bearer {token}"),),
                    )
                except grpc.aio.AioRpcError as exc:
                    return exc.code() != grpc.StatusCode.UNAUTHENTICATED
                return True

            assert await accepted(old) and not await accepted(new)
            staged = tmp_path / "tokens.new"
            staged.write_text(json.dumps({new: "acme"}))
            staged.replace(tokens)

            async def rotated() -> bool:
                return await accepted(new) and not await accepted(old)

            await wait_for(rotated, what="the new token file to be taken")
            assert proc.returncode is None  # the same process
    finally:
        records = await _log_records(proc)
    assert any(r["msg"] == "auth_tokens_file reloaded: 1 tokens" for r in records), records


async def test_migrate_is_a_separate_step() -> None:
    dsn = await create_database(migrate=False)
    try:
        proc = await _cli(
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            dsn,
            env=_env(migrate_on_start="false"),
        )
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 1
        assert "context-engine migrate" in stderr.decode()

        proc = await _cli("migrate", "--database-url", dsn, env=_env())
        stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0 and b"applied: 0001" in stdout

        proc = await _cli(
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            dsn,
            env=_env(migrate_on_start="false"),
        )
        try:
            port = await _listening_port(proc)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert reply.status == SERVING
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 60) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        await drop_database(dsn)


# --- start-up failures: one line, exit 1 -------------------------------------------

UNREACHABLE = "postgresql://postgres@127.0.0.1:1/postgres"  # nothing listens on port 1


async def _fails_in_one_line(*args: str, **settings: Any) -> tuple[int, str]:
    """Run the CLI to its exit (with `settings` as CONTEXT_ENGINE_* variables); (exit
    code, its last stderr line), which must be the engine's own one-line reason after no
    traceback."""
    env = _env(log_format="text", **settings)
    # As root, in CI and in containers: platformdirs warned at import, before the line.
    env.pop("XDG_RUNTIME_DIR", None)
    proc = await _cli(*args, env=env)
    try:
        _, raw = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    stderr = raw.decode("utf-8", "replace")
    assert "Traceback" not in stderr, stderr
    assert "Warning" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("context-engine"), stderr
    return int(proc.returncode or 0), last


@pytest.mark.parametrize(
    ("user", "database", "says"),
    [
        ("", "ce_no_such_database", 'database "ce_no_such_database" does not exist'),
        ("ce_no_such_role", "postgres", '"ce_no_such_role"'),  # no such role / bad password
    ],
)
async def test_serve_refused_by_postgresql_exits_1_saying_why(
    user: str, database: str, says: str
) -> None:
    """A typo in the database name or user is refused by the server with SQLSTATE 3D000 or
    28xxx, which the connect did not map to "unavailable": it was an asyncpg traceback.
    The line names the server and database but never the password in the URL."""
    password = "pw-" + "z" * 12
    dsn = dsn_on_test_server(database, user=user, password=password if user else "")
    code, line = await _fails_in_one_line("serve", "--listen", "127.0.0.1:0", "--database-url", dsn)
    assert code == 1
    assert line.startswith("context-engine: cannot connect to PostgreSQL at "), line
    assert says in line and f"/{database}:" in line, line
    assert password not in line


@pytest.mark.parametrize("command", [("serve", "--listen", "127.0.0.1:0"), ("migrate",)])
async def test_a_url_parameter_the_server_does_not_know_exits_1_in_one_line(
    command: tuple[str, ...],
) -> None:
    """asyncpg sends a URL parameter it does not read itself (libpq's `connect_timeout`)
    to the server as a setting, which PostgreSQL refuses with SQLSTATE 42704: serve,
    migrate and inspect ended in a traceback (an audit)."""
    dsn = dsn_on_test_server("postgres") + "?connect_timeout=5"
    code, line = await _fails_in_one_line(*command, "--database-url", dsn)
    assert code == 1
    assert "cannot connect to PostgreSQL at " in line, line
    assert 'unrecognized configuration parameter "connect_timeout"' in line, line


async def test_migrate_unreachable_or_refused_exits_1_in_one_line() -> None:
    """`context-engine migrate` is the Kubernetes Job's command: a wrong URL must say so
    in its log, not end in a traceback."""
    code, line = await _fails_in_one_line("migrate", "--database-url", UNREACHABLE)
    assert code == 1
    assert line == (
        "context-engine migrate: cannot connect to PostgreSQL at 127.0.0.1:1/postgres:"
        " Connection refused"
    )
    missing = dsn_on_test_server("ce_no_such_database")
    code, line = await _fails_in_one_line("migrate", "--database-url", missing)
    assert code == 1 and 'database "ce_no_such_database" does not exist' in line, line


async def test_a_migration_that_fails_is_rolled_back_and_named_in_one_line() -> None:
    """A migration PostgreSQL refuses (here the first, against a database that already has
    a `sessions` table of its own) ended `migrate` in an asyncpg traceback; it is one line
    naming the migration, exit 1, and nothing of it is recorded as applied."""
    dsn = await create_database(migrate=False)
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("CREATE TABLE sessions (id int)")
        finally:
            await conn.close()
        code, line = await _fails_in_one_line("migrate", "--database-url", dsn)
        assert code == 1
        assert line.startswith(
            "context-engine migrate: migration 0001_init failed and was rolled back"
            " (DuplicateTableError:"
        ), line
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == 0
        finally:
            await conn.close()
    finally:
        await drop_database(dsn)


async def test_a_role_that_may_not_migrate_is_told_so_in_one_line() -> None:
    """A role that may not create tables in the database (PostgreSQL 15 revokes CREATE on
    `public` from everyone but its owner) failed before the first migration, in a
    traceback; it is one line, exit 1."""
    dsn = await create_database(migrate=False)
    role = f"ce_reader_{new_id()[:8]}"
    await admin_execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        database = dsn.rpartition("/")[2]
        code, line = await _fails_in_one_line(
            "migrate", "--database-url", dsn_on_test_server(database, user=role)
        )
        assert code == 1
        assert line.startswith(
            "context-engine migrate: cannot prepare the record of applied migrations"
            " (InsufficientPrivilegeError:"
        ), line
    finally:
        await drop_database(dsn)
        await admin_execute(f'DROP ROLE IF EXISTS "{role}"')


async def test_serve_without_migrating_by_a_role_that_may_not_read_them_says_so() -> None:
    """The production setting (migrations by a Job, `migrate_on_start=false`) with a
    runtime role not granted `schema_migrations`: `serve` failed in a 38-line traceback
    (an audit); it is one line, exit 1."""
    dsn = await create_database(migrate=True)
    role = f"ce_runtime_{new_id()[:8]}"
    await admin_execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        database = dsn.rpartition("/")[2]
        code, line = await _fails_in_one_line(
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            dsn_on_test_server(database, user=role),
            migrate_on_start="false",
        )
        assert code == 1
        assert line.startswith(
            "context-engine: cannot read the applied migrations (InsufficientPrivilegeError:"
        ), line
    finally:
        await drop_database(dsn)
        await admin_execute(f'DROP ROLE IF EXISTS "{role}"')


async def test_migrations_wait_past_the_pools_command_timeout() -> None:
    """The pool gives every statement a command timeout (10 s, for requests); a migration
    that rewrites a large table, or a second migrator waiting for the first's lock, takes
    longer. Neither is cut off: here with a 0.3 s timeout, a migration of 1 s is applied
    while another connection held the migration lock for 1 s first."""
    from context_engine.store import apply_migrations
    from context_engine.store.migrate import _LOCK_KEY, MigrationError

    dsn = await create_database(migrate=False)
    pool = await connect_pool(dsn, min_size=1, max_size=2, command_timeout=0.3)
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        release = asyncio.get_running_loop().call_later(
            1.0, lambda: asyncio.ensure_future(holder.execute("SELECT pg_advisory_unlock_all()"))
        )
        slow = [("9001_slow", "SELECT pg_sleep(1)"), ("9002_after", "CREATE TABLE t (x int)")]
        async with pool.acquire() as conn:
            assert await apply_migrations(conn, slow) == ["9001_slow", "9002_after"]
            with pytest.raises(MigrationError, match="migration 9003_bad failed"):
                await apply_migrations(conn, [*slow, ("9003_bad", "CREATE TABLE t (x int)")])
            versions = await conn.fetch("SELECT version FROM schema_migrations ORDER BY 1")
        assert [r["version"] for r in versions] == ["9001_slow", "9002_after"]
        release.cancel()
    finally:
        await holder.close()
        await pool.close()
        await drop_database(dsn)


async def test_an_embedded_database_that_cannot_start_exits_1_in_one_line(
    tmp_path: Path,
) -> None:
    """With no database URL, a data directory the embedded PostgreSQL cannot use (here: a
    path through a regular file) is a start-up failure like an unreachable server."""
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    data_dir = str(blocker / "pgdata")
    for args in (("serve", "--listen", "127.0.0.1:0"), ("migrate",)):
        code, line = await _fails_in_one_line(*args, "--data-dir", data_dir)
        assert code == 1
        assert f"cannot start the embedded PostgreSQL in {data_dir}" in line, line
    # inspect reads a database; it makes none: without a URL or an embedded database in
    # its data directory it says so (exit 2), rather than answer from an empty new one.
    code, line = await _fails_in_one_line("inspect", new_id(), "--data-dir", data_dir)
    assert code == 2
    assert f"no embedded database in {data_dir}" in line, line
    assert not Path(data_dir).exists()


async def test_a_killed_user_of_the_embedded_database_does_not_keep_it_running(
    tmp_path: Path,
) -> None:
    """pgserver stops the embedded PostgreSQL when the last process it lists as using it
    exits. A `serve` killed outright never took itself off that list, so the server kept
    running after every later clean exit too (an audit). The dead are taken off it first."""
    data_dir = str(tmp_path / "pgdata")
    env = _env(log_format="text")
    killed = await _cli("serve", "--listen", "127.0.0.1:0", "--data-dir", data_dir, env=env)
    await _listening_port(killed)
    killed.kill()
    await killed.wait()
    assert (tmp_path / "pgdata" / "postmaster.pid").exists()  # left running, as listed
    server = await _cli("serve", "--listen", "127.0.0.1:0", "--data-dir", data_dir, env=env)
    await _listening_port(server)
    server.send_signal(signal.SIGTERM)
    await asyncio.wait_for(server.communicate(), 60)
    assert server.returncode == 0
    assert not (tmp_path / "pgdata" / "postmaster.pid").exists()


async def test_sigterm_while_the_embedded_database_is_created_leaves_it_usable(
    tmp_path: Path,
) -> None:
    """SIGTERM while initdb runs waits for the embedded database's start, then exits 143:
    taken at once, it killed initdb half way, and no later start could use the directory
    (a review). Its one user gone, the server is stopped; the next start serves from it."""
    import psutil

    data_dir = tmp_path / "pgdata"
    env = _env(log_format="text")
    first = await _cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), env=env)
    for _ in range(600):
        children = psutil.Process(first.pid).children(recursive=True)
        if any("initdb" in " ".join(c.cmdline()) for c in children if c.is_running()):
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("initdb never ran")
    first.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(first.communicate(), 120)
    assert first.returncode == 143, err.decode()
    assert err.decode().strip().splitlines()[-1] == "context-engine: terminated while starting"
    assert not (data_dir / "postmaster.pid").exists()
    second = await _cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), env=env)
    await _listening_port(second)
    second.send_signal(signal.SIGTERM)
    await asyncio.wait_for(second.communicate(), 60)
    assert second.returncode == 0


async def test_a_cut_short_list_of_the_embedded_databases_users_is_mended(tmp_path: Path) -> None:
    """pgserver's list of the server's users, cut short by a write interrupted, failed every
    later start with a JSON traceback (a review): it is read as empty and written whole."""
    data_dir = tmp_path / "pgdata"
    env = _env(log_format="text")
    server = await _cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), env=env)
    await _listening_port(server)
    server.send_signal(signal.SIGTERM)
    await asyncio.wait_for(server.communicate(), 60)
    (data_dir / ".handle_pids.json").write_text("[12", encoding="utf-8")
    again = await _cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), env=env)
    await _listening_port(again)
    again.send_signal(signal.SIGTERM)
    await asyncio.wait_for(again.communicate(), 60)
    assert again.returncode == 0
    assert not (data_dir / "postmaster.pid").exists()


async def test_sigterm_while_starting_exits_143_without_a_traceback(own_database: str) -> None:
    """Before serve's handlers are in (here: waiting for another process's migration lock),
    SIGTERM ends the process by an exception, so exit hooks run (the embedded database's
    stop among them); it killed the process outright."""
    from context_engine.store.migrate import _LOCK_KEY

    holder = await asyncpg.connect(own_database)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        env = _env(log_format="text")
        proc = await _cli(
            "serve", "--listen", "127.0.0.1:0", "--database-url", own_database, env=env
        )
        await _waiting_for_the_migration_lock(holder)
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 143, err.decode()
        assert err.decode().strip().splitlines()[-1] == "context-engine: terminated while starting"
    finally:
        await holder.close()


@pytest.mark.parametrize(
    ("signum", "code", "line"),
    [
        (signal.SIGINT, 130, "context-engine: interrupted while starting"),
        (signal.SIGTERM, 143, "context-engine: terminated while starting"),
    ],
)
async def test_a_signal_during_the_first_imports_is_taken_on_the_clean_path(
    own_database: str, signum: int, code: int, line: str
) -> None:
    """A Ctrl-C or SIGTERM in `serve`'s first fraction of a second, while it imports, was
    a KeyboardInterrupt traceback or a kill by the signal, and once a Ctrl-C was swallowed
    by the import machinery and the server came up (an audit). Held until its handlers are
    in, it ends the start as one later in starting does."""
    env = _env(log_format="text")
    proc = await _cli("serve", "--listen", "127.0.0.1:0", "--database-url", own_database, env=env)
    await _holding_signals(proc.pid)  # main() has begun: its imports are under way
    proc.send_signal(signum)
    _, raw = await asyncio.wait_for(proc.communicate(), 60)
    err = raw.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == line, err


async def _holding_signals(pid: int) -> None:
    """Until the process blocks SIGINT and SIGTERM (cli.main's first act; /proc's SigBlk),
    or fail."""
    wanted = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    for _ in range(2_000):
        status = Path(f"/proc/{pid}/status").read_text()
        blocked = int(
            next(line for line in status.splitlines() if line.startswith("SigBlk:"))[7:], 16
        )
        if blocked & wanted == wanted:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the process never held SIGINT and SIGTERM")


async def test_a_connection_lost_while_migrating_exits_1_in_one_line(own_database: str) -> None:
    """A database lost while `serve` checks its migrations (a failover, a stall past the
    command timeout) is one line and exit 1, as an unreachable one at start is; it was a
    traceback (an audit)."""
    from context_engine.store.migrate import _LOCK_KEY

    holder = await asyncpg.connect(own_database)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        env = _env(log_format="text")
        env.pop("XDG_RUNTIME_DIR", None)
        proc = await _cli(
            "serve", "--listen", "127.0.0.1:0", "--database-url", own_database, env=env
        )
        waiting = await _waiting_for_the_migration_lock(holder)
        await holder.execute("SELECT pg_terminate_backend($1)", waiting)
        _, raw = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await holder.close()
    err = raw.decode()
    assert proc.returncode == 1, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("context-engine: lost the database while checking migrations"), err


async def _waiting_for_the_migration_lock(holder: asyncpg.Connection) -> int:
    """The pid of the backend that waits for the advisory lock `holder` holds."""
    for _ in range(600):
        pid = await holder.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND wait_event = 'advisory' AND datname = current_database() AND pid <> $1",
            await holder.fetchval("SELECT pg_backend_pid()"),
        )
        if pid is not None:
            return int(pid)
        await asyncio.sleep(0.1)
    raise AssertionError("serve never waited for the migration lock")


async def test_without_a_database_url_serve_inspect_and_migrate_share_the_embedded_database(
    tmp_path: Path,
) -> None:
    """The README's first command: `serve` with no database URL starts the embedded
    PostgreSQL in its data directory and serves from it; `inspect` and `migrate` given the
    same directory use that server while it runs (they did not: inspect demanded a URL the
    newcomer was never shown), and it stops when the last process using it exits."""
    data_dir = str(tmp_path / "pgdata")
    env = _env(log_format="text")
    server = await _cli("serve", "--listen", "127.0.0.1:0", "--data-dir", data_dir, env=env)
    try:
        port = await _listening_port(server)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            session_id, _ = await open_session(pb_grpc.ContextEngineStub(channel))
        for args, says in (
            (("inspect", session_id, "--width", "160"), f"session {session_id}"),
            (("migrate",), "applied: nothing (up to date)"),
        ):
            proc = await _cli(*args, "--data-dir", data_dir, env=env)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            assert says in out.decode(), out.decode()
    finally:
        server.send_signal(signal.SIGTERM)
        await asyncio.wait_for(server.wait(), 60)
    assert server.returncode == 0
    # The last process using the embedded server has exited: nothing listens for it now.
    assert not (tmp_path / "pgdata" / "postmaster.pid").exists()


async def test_serve_on_a_port_already_in_use_exits_1_naming_the_address(
    own_database: str,
) -> None:
    """grpcio's bind failure was a RuntimeError traceback after the pool had opened; now it
    is one line naming the address, and the pool is closed on the way out."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        listen = f"127.0.0.1:{busy.getsockname()[1]}"
        code, line = await _fails_in_one_line(
            "serve", "--listen", listen, "--database-url", own_database
        )
    assert code == 1
    assert (
        line == f"context-engine: cannot listen on {listen}: the address is in use or not available"
    )


async def test_a_second_serve_on_a_running_servers_address_exits_1(own_database: str) -> None:
    """grpc sets SO_REUSEPORT by default, so a second server on a running one's address
    bound it too and silently took a share of its connections (a stale process, two
    replicas given one port). It is off (api/server.py): the second exits 1, naming the
    address, and the first keeps serving."""
    first = await _cli(
        "serve", "--listen", "127.0.0.1:0", "--database-url", own_database, env=_env()
    )
    try:
        listen = f"127.0.0.1:{await _listening_port(first)}"
        code, line = await _fails_in_one_line(
            "serve", "--listen", listen, "--database-url", own_database
        )
        assert code == 1
        assert line == (
            f"context-engine: cannot listen on {listen}: the address is in use or not available"
        )
        async with grpc.aio.insecure_channel(listen) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10
            )
        assert reply.status == SERVING
    finally:
        first.send_signal(signal.SIGTERM)
        await asyncio.wait_for(first.communicate(), 60)


# --- readiness ---------------------------------------------------------------------


async def test_readiness_follows_postgresql_reachability(
    own_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="context_engine.server")
    name = own_database.rpartition("/")[2]
    pool = await connect_pool(own_database, min_size=1, max_size=2)
    running = await build_server(
        build_engine(pool), "127.0.0.1:0", readiness_interval=0.05, readiness_timeout=2
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert (await watch.read()).status == SERVING

            await admin_execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            await admin_execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE datname = '{name}' AND pid <> pg_backend_pid()"
            )
            assert (await watch.read()).status == NOT_SERVING
            # Liveness ("") is not readiness: the process stays up.
            overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert overall.status == SERVING
            stub = pb_grpc.ContextEngineStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=new_id(), spec=spec()))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()

            await admin_execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            assert (await watch.read()).status == SERVING
            watch.cancel()
    finally:
        await running.stop(0)
        await pool.close()
    # Why, by type (an audit: the line said "unreachable" whatever the cause).
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("readiness")]
    assert said[0].startswith("readiness: PostgreSQL unreachable (") and said[0].endswith(")")
    assert "unreachable ()" not in said[0] and "read-only" not in said[0]
    assert said[-1] == "readiness: PostgreSQL reachable"


async def test_a_read_only_database_is_not_ready_and_a_write_is_unavailable(
    own_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A standby (a multi-host DSN after a failover) answers SELECT 1: readiness said
    SERVING while every write failed INTERNAL (an audit). Ready now means writable, and a
    write a read-only server refuses is STORE_UNAVAILABLE, which clients retry."""
    caplog.set_level(logging.WARNING, logger="context_engine.server")
    name = own_database.rpartition("/")[2]
    pool = await connect_pool(own_database, min_size=1, max_size=2)
    probe = await connect_pool(own_database, min_size=1, max_size=1)
    running = await build_server(
        build_engine(pool),
        "127.0.0.1:0",
        readiness_interval=0.05,
        readiness_timeout=2,
        readiness_pool=probe,
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert (await asyncio.wait_for(watch.read(), 30)).status == SERVING
            await admin_execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
            await admin_execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE datname = '{name}' AND pid <> pg_backend_pid()"
            )
            assert (await asyncio.wait_for(watch.read(), 30)).status == NOT_SERVING
            assert "readiness: PostgreSQL unreachable (read-only)" in caplog.messages
            stub = pb_grpc.ContextEngineStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                for _ in range(3):  # the first may meet a connection the restart dropped
                    await stub.Plan(
                        pb.PlanRequest(tenant_id=TENANT, session_id=new_id(), spec=spec())
                    )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            # Writable again, with no connection killed for it: the probe, whose connection
            # to the read-only server is dropped, sees it (a review: kept, it never did),
            # and each connection a write found read-only is dropped, so writes come back.
            await admin_execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
            assert (await asyncio.wait_for(watch.read(), 30)).status == SERVING
            watch.cancel()
            planned = None
            for _ in range(4):  # at most one refusal per connection the pool holds (2)
                try:
                    planned = await stub.Plan(
                        pb.PlanRequest(tenant_id=TENANT, session_id=new_id(), spec=spec())
                    )
                    break
                except grpc.aio.AioRpcError as refused:
                    assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert planned is not None and planned.created
    finally:
        await running.stop(0)
        await probe.close()
        await pool.close()


async def test_a_readiness_check_cut_off_mid_query_turns_not_serving_at_once(
    own_database: str,
) -> None:
    """PostgreSQL stops answering (a partition, a hung server) while the probe's query is
    on the wire. The check's timeout cut the query off, but releasing its connection
    waited for asyncpg's cancel request, up to the pool's command timeout, while health
    still said SERVING (an audit). The cut-off connection is now dropped and NOT_SERVING
    follows the timeout. The probe's command timeout here is far past this test's bound,
    so the old wait fails it."""
    name = own_database.rpartition("/")[2]
    pool = await connect_pool(own_database, min_size=1, max_size=2)
    async with HangingLink() as link:
        probe = await connect_pool(link.dsn(name), min_size=1, max_size=1, command_timeout=600)
        running = await build_server(
            build_engine(pool),
            "127.0.0.1:0",
            readiness_interval=0.05,
            readiness_timeout=0.5,
            readiness_pool=probe,
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert (await asyncio.wait_for(watch.read(), 30)).status == SERVING
                link.hang()
                assert (await asyncio.wait_for(watch.read(), 30)).status == NOT_SERVING
                watch.cancel()

                async def dropped() -> bool:
                    return link.closed_by_client >= 1

                await wait_for(dropped, what="the probe's cut-off connection dropped")
                # Only the probe's PostgreSQL hung: the requests' pool still serves.
                stub = pb_grpc.ContextEngineStub(channel)
                planned = await stub.Plan(
                    pb.PlanRequest(tenant_id=TENANT, session_id=new_id(), spec=spec())
                )
                assert planned.created
        finally:
            await running.stop(0)
            probe.terminate()  # its PostgreSQL never answers a goodbye
            await pool.close()


async def test_closing_pools_to_a_hung_postgresql_is_bounded(own_database: str) -> None:
    """A pool's close waits for each connection's goodbye. With PostgreSQL hung, serve's
    close at SIGTERM waited up to the command timeout and then raised, exiting 1 with a
    traceback and the request pool never closed (an audit). `_close` drops what does not
    close in time. The command timeout here is far past this test's bound."""
    async with HangingLink() as link:
        pool = await connect_pool(
            link.dsn(own_database.rpartition("/")[2]),
            min_size=2,
            max_size=2,
            command_timeout=600,
        )
        try:
            async with pool.acquire() as conn:
                assert await conn.fetchval("SELECT 1") == 1
            link.hang()
            await asyncio.wait_for(server_module._close(pool), 30)
            with pytest.raises(asyncpg.InterfaceError):
                await asyncio.wait_for(pool.acquire(), 5)

            async def both_dropped() -> bool:
                return link.closed_by_client == 2

            await wait_for(both_dropped, what="both connections dropped")
        finally:
            pool.terminate()


async def test_a_health_watch_ends_when_shutdown_begins(own_database: str) -> None:
    """An open Watch never ended, so the server's stop waited out its whole grace for it
    and then cancelled it (an audit). It now ends on its own, OK, once NOT_SERVING is sent."""
    pool = await connect_pool(own_database, min_size=1, max_size=2)
    running = await build_server(build_engine(pool), "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            )
            assert (await asyncio.wait_for(watch.read(), 30)).status == SERVING
            # A service health does not know is watched too (SERVICE_UNKNOWN); its watch
            # ends as well (a review: grpc's shutdown woke only the known services').
            unknown = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="no.such.Service")
            )
            assert (await asyncio.wait_for(unknown.read(), 30)).status == SERVICE_UNKNOWN
            stopping = asyncio.ensure_future(running.stop(30))
            assert (await asyncio.wait_for(watch.read(), 30)).status == NOT_SERVING
            assert await asyncio.wait_for(watch.read(), 30) == grpc.aio.EOF
            assert await watch.code() == grpc.StatusCode.OK
            assert await asyncio.wait_for(unknown.read(), 30) == grpc.aio.EOF
            assert await unknown.code() == grpc.StatusCode.OK
            await stopping
    finally:
        await running.stop(0)
        await pool.close()


async def test_a_busy_request_pool_is_not_an_unreachable_database(own_database: str) -> None:
    """Readiness took its connection from the request pool, so calls holding every
    connection (queued on a lock, say) for longer than the readiness timeout read as
    PostgreSQL being away, and under a shared load every replica went NOT_SERVING
    together. With a pool of its own (as `serve` gives it) readiness stays SERVING; on the
    request pool it would not."""
    pool = await connect_pool(own_database, min_size=1, max_size=1)
    probe = await connect_pool(own_database, min_size=1, max_size=1)
    running = await build_server(
        build_engine(pool),
        "127.0.0.1:0",
        readiness_interval=0.05,
        readiness_timeout=0.2,
        readiness_pool=probe,
    )
    shared = await build_server(
        build_engine(pool), "127.0.0.1:0", readiness_interval=0.05, readiness_timeout=0.2
    )
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{shared.port}") as shared_channel,
        ):
            own = health_pb2_grpc.HealthStub(channel)
            other = health_pb2_grpc.HealthStub(shared_channel)
            request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            watch = other.Watch(request)
            assert (await watch.read()).status == SERVING
            async with pool.acquire():  # every request connection busy
                assert (await watch.read()).status == NOT_SERVING  # the shared pool's view
                for _ in range(5):
                    await asyncio.sleep(0.1)
                    assert (await own.Check(request)).status == SERVING
            watch.cancel()
    finally:
        await running.stop(0)
        await shared.stop(0)
        await probe.close()
        await pool.close()


# --- deadlines ---------------------------------------------------------------------


async def test_deadline_while_waiting_on_postgresql_writes_nothing(
    stub: Any, database_dsn: str
) -> None:
    session_id, _ = await open_session(stub)
    run = (await start_run(stub, session_id, "hello")).run
    locker = await _lock_session(database_dsn, session_id)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.AppendItems(_append(session_id, run.run_id, 1), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        # The server gave up too: its query no longer waits on the lock we still hold.
        async def nobody_waits() -> bool:
            return await _lock_waiters(locker) == 0

        await wait_for(nobody_waits, what="the server to cancel its waiting query")
    finally:
        await locker.execute("ROLLBACK")
        await locker.close()
    # Nothing was written: version 1 is still the one to append to.
    response = await stub.AppendItems(_append(session_id, run.run_id, 1))
    assert response.checkpoint_version == 2


async def test_a_migration_applied_from_another_file_stops_migrate_and_serve() -> None:
    """Each applied migration keeps its file's SHA-256: one applied from another file than
    the packaged one (edited after release) left the database on a schema this version
    does not expect, silently (an audit); `migrate` and `serve` now stop, naming it, in
    one line. A database migrated before the sums were kept takes the packaged ones."""
    from context_engine.store import apply_migrations
    from context_engine.store.migrate import MigrationError, migration_files, pending_migrations

    dsn = await create_database(migrate=True)
    conn = await asyncpg.connect(dsn)
    try:
        kept = await conn.fetchval(
            "SELECT count(*) FROM schema_migrations WHERE sha256 ~ '^[0-9a-f]{64}$'"
        )
        assert kept == len(migration_files())
        # Before the sums: the column is added and filled, nothing else changes.
        await conn.execute("ALTER TABLE schema_migrations DROP COLUMN sha256")
        assert await pending_migrations(conn) == []
        assert await apply_migrations(conn) == []
        assert (
            await conn.fetchval("SELECT count(*) FROM schema_migrations WHERE sha256 IS NULL") == 0
        )
        # A file edited after this database applied it.
        await conn.execute(
            "UPDATE schema_migrations SET sha256 = repeat('0', 64)"
            " WHERE version = '0007_erased_people'"
        )
        for check in (pending_migrations(conn), apply_migrations(conn)):
            with pytest.raises(MigrationError, match="migration 0007_erased_people was applied"):
                await check
    finally:
        await conn.close()
    try:
        code, line = await _fails_in_one_line(
            "serve", "--listen", "127.0.0.1:0", "--database-url", dsn, migrate_on_start="false"
        )
        assert code == 1
        assert line.startswith("context-engine: migration 0007_erased_people was applied"), line
    finally:
        await drop_database(dsn)


# 0007 as it first landed (0a206a5), an hour before it was rewritten to keep a hash.
_FIRST_0007 = """
CREATE TABLE erased_people (
    tenant_id  text        NOT NULL,
    person_id  text        NOT NULL,
    erased_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, person_id)
);
"""


# The first 0016 (e678ad5), as far as the schema goes: its column alone. It also restated
# record_model_request to read the column, which 0016_plan_columns restates again.
_FIRST_0016 = (
    "ALTER TABLE context_plans ADD COLUMN invalidated boolean"
    " GENERATED ALWAYS AS (coalesce((plan ->> 'invalidated')::boolean, false)) STORED"
)


async def test_a_database_on_the_first_0016_migrates_to_the_released_shape() -> None:
    """0016 was renamed after it landed: a database migrated in between recorded
    0016_plan_invalidated, and 0016_plan_columns failed there on its first column, for
    good (an audit). 0016_0_plan_invalidated_renamed drops that column first, on such a
    database only; a database on the released 0016 finds it does nothing."""
    from context_engine.store import apply_migrations
    from context_engine.store.migrate import migration_files

    files = migration_files()
    before = [(v, sql) for v, sql in files if v < "0016"]
    for first in (True, False):
        dsn = await create_database(migrate=False)
        conn = await asyncpg.connect(dsn)
        try:
            if first:
                await apply_migrations(conn, [*before, ("0016_plan_invalidated", _FIRST_0016)])
            else:  # the released 0016, before the repair existed
                released = [(v, sql) for v, sql in files if v == "0016_plan_columns"]
                await apply_migrations(conn, [*before, *released])
            applied = await apply_migrations(conn)
            assert "0016_0_plan_invalidated_renamed" in applied
            assert ("0016_plan_columns" in applied) == first
            columns = {
                r["column_name"]
                for r in await conn.fetch(
                    "SELECT column_name FROM information_schema.columns"
                    " WHERE table_name = 'context_plans'"
                )
            }
            assert {"invalidated", "prefix_content_key"} <= columns
            assert await apply_migrations(conn) == []
        finally:
            await conn.close()
            await drop_database(dsn)


async def test_a_database_on_the_first_0007_is_moved_to_the_released_shape() -> None:
    """A database migrated while 0007 kept erased people's ids failed every erasure (an
    audit): 0021 renames the column and hashes the ids, so an erasure made then is still
    the person's, and erasing them again finds it."""
    from context_engine.store import apply_migrations
    from context_engine.store.migrate import migration_files
    from context_engine.store.snapshots import fence_erasure

    dsn = await create_database(migrate=False)
    conn = await asyncpg.connect(dsn)
    try:
        files = migration_files()
        before = [(v, sql) for v, sql in files if v < "0007"]
        await apply_migrations(conn, [*before, ("0007_erased_people", _FIRST_0007)])
        # As the code of the time left it: no sums kept.
        await conn.execute("UPDATE schema_migrations SET sha256 = NULL")
        await conn.execute("INSERT INTO erased_people (tenant_id, person_id) VALUES ('t', 'ana')")
        applied = await apply_migrations(conn)
        assert "0021_erased_people_by_hash" in applied
        columns = await conn.fetch(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_name = 'erased_people' ORDER BY ordinal_position"
        )
        assert [c["column_name"] for c in columns] == [
            "tenant_id",
            "person_sha256",
            "erased_at",
            "outcome",
        ]
        async with conn.transaction():
            assert await fence_erasure(conn, "t", "ana") is None  # found: nothing inserted
        assert await conn.fetchval("SELECT count(*) FROM erased_people") == 1
    finally:
        await conn.close()
        await drop_database(dsn)
    # Both columns (a hand-made repair): the ids are hashed where no hash is, the id
    # column dropped (a review: renaming onto an existing column failed).
    dsn = await create_database(migrate=False)
    conn = await asyncpg.connect(dsn)
    try:
        await apply_migrations(conn, [*before, ("0007_erased_people", _FIRST_0007)])
        await conn.execute("UPDATE schema_migrations SET sha256 = NULL")
        await conn.execute("ALTER TABLE erased_people ADD COLUMN person_sha256 text")
        await conn.execute("INSERT INTO erased_people (tenant_id, person_id) VALUES ('t', 'ana')")
        await apply_migrations(conn)
        assert await conn.fetchval("SELECT person_sha256 FROM erased_people") == (
            hashlib.sha256(b"ana").hexdigest()
        )
        assert not await conn.fetchval(
            "SELECT count(*) FROM information_schema.columns"
            " WHERE table_name = 'erased_people' AND column_name = 'person_id'"
        )
        async with conn.transaction():  # its conflict target is the hash's key again
            assert await fence_erasure(conn, "t", "ana") is None
            assert await fence_erasure(conn, "t", "bo") is None
        assert await conn.fetchval("SELECT count(*) FROM erased_people") == 2
    finally:
        await conn.close()
        await drop_database(dsn)


async def test_a_role_that_may_migrate_but_owns_no_table_finds_nothing_to_do() -> None:
    """After the owner migrated, a role with CREATE on the schema and the rights to read
    and write its tables, but owning none, runs migrate: nothing is pending, so it must
    change no table's definition (a review: adding the sums' column on every run, even
    where it existed, needed ownership and stopped every start of such a replica)."""
    from context_engine.store import apply_migrations
    from context_engine.store.migrate import pending_migrations

    dsn = await create_database(migrate=True)
    role = f"ce_migrator_{new_id()[:8]}"
    await admin_execute(f'CREATE ROLE "{role}" LOGIN')
    owner = await asyncpg.connect(dsn)
    try:
        await owner.execute(
            f'GRANT USAGE, CREATE ON SCHEMA public TO "{role}";'
            f' GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO "{role}"'
        )
        database = dsn.rpartition("/")[2]
        runtime = await asyncpg.connect(dsn_on_test_server(database, user=role))
        try:
            assert await pending_migrations(runtime) == []
            assert await apply_migrations(runtime) == []
        finally:
            await runtime.close()
    finally:
        await owner.close()
        await drop_database(dsn)
        await admin_execute(f'DROP ROLE IF EXISTS "{role}"')


async def test_two_migrators_apply_each_migration_once_under_repeatable_read() -> None:
    """A database whose transactions default to REPEATABLE READ: each migration's
    transaction reads, under the lock, what the other migrator committed while it waited
    (a review: the snapshot taken before the wait did not, and both applied 0001)."""
    from context_engine.store import apply_migrations
    from context_engine.store.migrate import migration_files

    dsn = await create_database(migrate=False)
    database = dsn.rpartition("/")[2]
    await admin_execute(
        f"ALTER DATABASE \"{database}\" SET default_transaction_isolation = 'repeatable read'"
    )
    first, second = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        applied = await asyncio.gather(apply_migrations(first), apply_migrations(second))
        assert sorted(v for run in applied for v in run) == [v for v, _ in migration_files()]
    finally:
        await first.close()
        await second.close()
        await drop_database(dsn)


async def test_migrate_reads_the_record_the_search_path_finds() -> None:
    """With a schema first on the search path that does not hold the record (a role's own
    schema, say), migrate reads the table the path finds, and its columns there (a review:
    columns read in the first schema alone made it add the sums' column again, failing)."""
    from context_engine.store import apply_migrations
    from context_engine.store.migrate import MigrationError, pending_migrations

    dsn = await create_database(migrate=True)
    owner = await asyncpg.connect(dsn)
    try:
        await owner.execute("CREATE SCHEMA other")
    finally:
        await owner.close()
    conn = await asyncpg.connect(dsn, server_settings={"search_path": "other,public"})
    try:
        assert await pending_migrations(conn) == []
        assert await apply_migrations(conn) == []
        # The sums are read, not taken as missing: one changed is still found.
        await conn.execute("UPDATE schema_migrations SET sha256 = repeat('0', 64)")
        with pytest.raises(MigrationError, match="was applied from another file"):
            await pending_migrations(conn)
    finally:
        await conn.close()
        await drop_database(dsn)
