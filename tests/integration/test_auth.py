"""Authentication, tenant isolation and request size limits through a real server.

Bearer tokens and mTLS (certificates made here with `cryptography`); the tenant comes
from the identity; a foreign session is NOT_FOUND exactly like a missing one; an
oversize request is RESOURCE_EXHAUSTED with REQUEST_TOO_LARGE and writes nothing.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import UUID

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine.api.interceptors import BearerTokens
from context_engine.api.server import build_engine, build_server, server_options
from context_engine.cli import main
from context_engine.config import load_settings

from .helpers import call, details, new_id, result, spec

pytestmark = pytest.mark.integration

TOKEN_A = "token-a-" + "a" * 32
TOKEN_B = "token-b-" + "b" * 32


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def _sessions(pool: Any, session_id: str) -> list[str]:
    rows = await pool.fetch(
        "SELECT tenant_id FROM sessions WHERE session_id = $1", UUID(session_id)
    )
    return [r["tenant_id"] for r in rows]


# --- bearer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def bearer_stub(pool: Any) -> AsyncIterator[tuple[Any, grpc.aio.Channel]]:
    running = await build_server(
        build_engine(pool),
        "127.0.0.1:0",
        auth=BearerTokens({TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"}),
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield pb_grpc.ContextEngineStub(channel), channel
    await channel.close()
    await running.stop(0)


async def test_bearer_no_or_wrong_token_is_unauthenticated(bearer_stub: Any, pool: Any) -> None:
    stub, _ = bearer_stub
    session_id = new_id()
    request = pb.PlanRequest(session_id=session_id, spec=spec())
    for metadata in ((), _bearer("not-a-token-" + "x" * 30), (("authorization", TOKEN_A),)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Plan(request, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert details(info.value)[0] == "UNAUTHENTICATED"
    assert await _sessions(pool, session_id) == []


async def test_bearer_tenant_comes_from_the_token(bearer_stub: Any, pool: Any) -> None:
    stub, _ = bearer_stub
    session_id = new_id()
    plan = await stub.Plan(
        pb.PlanRequest(session_id=session_id, spec=spec()), metadata=_bearer(TOKEN_A)
    )
    assert plan.created
    assert await _sessions(pool, session_id) == ["tenant-a"]
    # The same tenant, named explicitly, is accepted.
    got = await stub.GetPlan(
        pb.GetPlanRequest(tenant_id="tenant-a", session_id=session_id), metadata=_bearer(TOKEN_A)
    )
    assert got.plan.prefix_sha256 == plan.plan.prefix_sha256


async def test_bearer_foreign_tenant_is_denied_and_writes_nothing(
    bearer_stub: Any, pool: Any
) -> None:
    stub, _ = bearer_stub
    session_id = new_id()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Plan(
            pb.PlanRequest(tenant_id="tenant-b", session_id=session_id, spec=spec()),
            metadata=_bearer(TOKEN_A),
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert details(info.value)[:2] == ("TENANT_MISMATCH", ["tenant_id"])
    assert await _sessions(pool, session_id) == []


def _write_tokens(path: Path, tokens: Any) -> None:
    """Replace the file as a secret volume or an editor does: a new inode renamed over."""
    staged = path.with_suffix(".new")
    staged.write_text(tokens if isinstance(tokens, str) else json.dumps(tokens))
    staged.replace(path)


async def _accepted(stub: Any, token: str) -> bool:
    try:
        await stub.GetPlan(pb.GetPlanRequest(session_id=new_id()), metadata=_bearer(token))
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            return False
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc  # authenticated, no such session
    return True


async def test_bearer_tokens_follow_their_file_and_a_bad_file_changes_nothing(
    pool: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tokens were read once, at start: a token removed from auth_tokens_file stayed valid
    until the replica restarted. The file is followed now (api/token_file.py): a changed
    file replaces the tokens, and a file that cannot be used keeps the ones in use, with a
    warning that names why and never a token."""
    from context_engine.api.token_file import TokenFile

    path = tmp_path / "tokens.json"
    _write_tokens(path, {TOKEN_A: "tenant-a"})
    settings = load_settings(
        environ={"CONTEXT_ENGINE_AUTH": "bearer", "CONTEXT_ENGINE_AUTH_TOKENS_FILE": str(path)}
    )
    options = server_options(settings)  # the tokens read at start-up: TOKEN_A
    # Changed while the replica started, after that read: the follower's first stamp
    # matched the new file, which was never taken (a review). It reads after stamping.
    _write_tokens(path, {TOKEN_B: "tenant-b"})
    follower = TokenFile(settings, options["auth"])
    running = await build_server(build_engine(pool), "127.0.0.1:0", **options)
    caplog.set_level(logging.INFO, logger="context_engine.server")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            assert await _accepted(stub, TOKEN_B) and not await _accepted(stub, TOKEN_A)
            assert not follower.check()  # unchanged: not read again
            _write_tokens(path, {TOKEN_A: "tenant-a"})
            assert follower.check()
            assert await _accepted(stub, TOKEN_A) and not await _accepted(stub, TOKEN_B)
            _write_tokens(path, {TOKEN_B: "tenant-b"})
            assert follower.check()
            assert await _accepted(stub, TOKEN_B) and not await _accepted(stub, TOKEN_A)
            # A chmod alone is a change: a file made readable again is read again.
            path.chmod(0o600)
            assert follower.check()
            # Unreadable, not an object, a short token, no token at all, gone: kept.
            for bad in ("{not json", '["x"]', json.dumps({"short": "tenant-a"}), "{}", None):
                if bad is None:
                    path.unlink()
                else:
                    _write_tokens(path, bad)
                assert not follower.check(), bad
                assert await _accepted(stub, TOKEN_B), bad
            _write_tokens(path, {TOKEN_A: "tenant-a"})
            assert follower.check()
            assert await _accepted(stub, TOKEN_A) and not await _accepted(stub, TOKEN_B)
    finally:
        await running.stop(0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5, warnings
    assert not any(TOKEN_A in w or TOKEN_B in w or "short" in w for w in warnings), warnings


def test_a_changed_token_file_that_could_not_be_read_is_read_at_the_next_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed file whose read failed for a passing reason (no file descriptor left
    under load) was stamped as read: the token it removed stayed valid until the file
    changed again (an audit). The next check reads it."""
    import errno

    from context_engine.api.token_file import TokenFile

    path = tmp_path / "tokens.json"
    _write_tokens(path, {TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"})
    settings = load_settings(
        environ={"CONTEXT_ENGINE_AUTH": "bearer", "CONTEXT_ENGINE_AUTH_TOKENS_FILE": str(path)}
    )
    auth = server_options(settings)["auth"]
    follower = TokenFile(settings, auth)
    _write_tokens(path, {TOKEN_A: "tenant-a"})  # TOKEN_B revoked
    read_text = Path.read_text

    def exhausted(self: Path, *args: Any, **kwargs: Any) -> str:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(Path, "read_text", exhausted)
    assert not follower.check()
    monkeypatch.setattr(Path, "read_text", read_text)
    assert follower.check()

    class Presenting:  # what BearerTokens reads of a call
        def __init__(self, token: str) -> None:
            self.token = token

        def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
            return (("authorization", f"Bearer {self.token}"),)

    assert auth.tenant(Presenting(TOKEN_A)) == "tenant-a"
    assert auth.tenant(Presenting(TOKEN_B)) is None


def test_a_token_no_client_can_send_is_refused_naming_its_setting(tmp_path: Path) -> None:
    """A token with a line ending or an edge space (`jq --rawfile` keeps the file's line
    ending) was accepted, and never authenticated: the server strips what a client sends,
    and a header carries no line ending (an audit). And a bad token was blamed on `auth`,
    not on the setting that held it."""
    from context_engine.config import ConfigError

    path = tmp_path / "tokens.json"
    bearer = {"CONTEXT_ENGINE_AUTH": "bearer", "CONTEXT_ENGINE_AUTH_TOKENS_FILE": str(path)}
    held = "auth_tokens_file: a token holds a character a header cannot carry"
    for token in (TOKEN_A + "\n", " " + TOKEN_A, TOKEN_A + " ", TOKEN_A + "\u00e9"):
        _write_tokens(path, {token: "tenant-a"})
        with pytest.raises(ConfigError, match=held) as refused:
            load_settings(environ=bearer)
        assert "(auth_tokens_file from CONTEXT_ENGINE_AUTH_TOKENS_FILE)" in str(refused.value)
        assert TOKEN_A not in str(refused.value)
    _write_tokens(path, {"short": "tenant-a"})
    with pytest.raises(ConfigError, match="auth_tokens_file: tokens must be strings"):
        load_settings(environ=bearer)
    # Not UTF-8: named, and no byte of the file quoted (its decode error did, unnamed).
    path.write_bytes(b'{"' + TOKEN_A.encode()[:4] + b"\xe9" + b'": "tenant-a"}')
    with pytest.raises(ConfigError, match="auth_tokens_file: not UTF-8") as refused:
        load_settings(environ=bearer)
    assert "0xe9" not in str(refused.value) and "position" not in str(refused.value)
    inline = {"CONTEXT_ENGINE_AUTH": "bearer", "CONTEXT_ENGINE_AUTH_TOKENS": '{"short": "a"}'}
    with pytest.raises(ConfigError, match="auth_tokens: tokens must be strings") as refused:
        load_settings(environ=inline)
    assert "auth_tokens from CONTEXT_ENGINE_AUTH_TOKENS" in str(refused.value)


async def test_foreign_session_is_indistinguishable_from_a_missing_one(bearer_stub: Any) -> None:
    stub, _ = bearer_stub
    owned = new_id()
    await stub.Plan(pb.PlanRequest(session_id=owned, spec=spec()), metadata=_bearer(TOKEN_A))
    missing = new_id()
    errors = []
    for session_id in (owned, missing):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetPlan(pb.GetPlanRequest(session_id=session_id), metadata=_bearer(TOKEN_B))
        errors.append(info.value)
    foreign, absent = errors
    assert foreign.code() == absent.code() == grpc.StatusCode.NOT_FOUND
    assert details(foreign) == details(absent)
    assert foreign.details().replace(owned, "ID") == absent.details().replace(missing, "ID")


async def test_an_undecodable_request_with_credentials_is_invalid_argument(
    bearer_stub: Any,
) -> None:
    # Auth fills an empty tenant_id in before the handler sees the request; on the
    # placeholder a failed decode leaves, that write must not turn INVALID_ARGUMENT into
    # UNKNOWN without details.
    _, channel = bearer_stub
    raw = channel.unary_unary(
        "/context_engine.v1.ContextEngine/GetPlan",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await raw(b"\x0a\xff\xff", metadata=_bearer(TOKEN_A))  # session_id: invalid UTF-8
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(caught.value)[0] == "INVALID_FIELD"


async def test_health_needs_no_credentials_but_reflection_does(bearer_stub: Any) -> None:
    _, channel = bearer_stub
    health = health_pb2_grpc.HealthStub(channel)
    response = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    call_ = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call_:
            pass
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    call_ = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
        metadata=_bearer(TOKEN_A),
    )
    names = [s.name async for r in call_ for s in r.list_services_response.service]
    assert "context_engine.v1.ContextEngine" in names


# --- mTLS --------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: Any) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class _CA:
    def __init__(self, cn: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(_name(cn))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, cn: str, sans: list[x509.GeneralName], *, server: bool) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM); `cn` "": a subject without a common name."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn) if cn else x509.Name([]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [
                        x509.oid.ExtendedKeyUsageOID.SERVER_AUTH
                        if server
                        else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
                    ]
                ),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


WORKER_B_URI = "spiffe://agents.example/ns/prod/sa/worker-b"


@pytest.fixture(scope="module")
async def mtls(pool: Any, tmp_path_factory: Any) -> AsyncIterator[dict[str, Any]]:
    """A server configured through Settings: auth "mtls", tenants by CN or mapped SAN."""
    tmp: Path = tmp_path_factory.mktemp("mtls")
    ca, rogue = _CA("test client CA"), _CA("rogue CA")
    server_cert, server_key = ca.issue(
        "context-engine",
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        server=True,
    )
    files = {
        "tls_cert_file": server_cert,
        "tls_key_file": server_key,
        "tls_client_ca_file": ca.pem,
    }
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    config = tmp / "config.json"
    config.write_text(
        json.dumps(
            {
                "auth": "mtls",
                **{name: str(tmp / name) for name in files},
                "tls_client_tenants": {
                    f"uri:{WORKER_B_URI}": "tenant-b",
                    "cn:worker-a": "tenant-a",
                    "dns:worker-c.example": "tenant-c",
                    # An untyped key left for replicas before typed keys (a rolling
                    # upgrade): ignored, so the CN spelling it maps to nothing.
                    WORKER_B_URI: "tenant-b",
                },
            }
        )
    )
    settings = load_settings(environ={"CONTEXT_ENGINE_CONFIG": str(config)})
    running = await build_server(build_engine(pool), "127.0.0.1:0", **server_options(settings))
    clients = {
        "a": ca.issue("worker-a", [], server=False),
        "b": ca.issue(
            "worker-b-host", [x509.UniformResourceIdentifier(WORKER_B_URI)], server=False
        ),
        "c": ca.issue("", [x509.DNSName("worker-c.example")], server=False),
        "unmapped": ca.issue("someone-else", [], server=False),
        # A CN spelling tenant-b's SPIFFE ID: the mapping's keys were untyped, and it mapped.
        "cn-spelling-uri": ca.issue(WORKER_B_URI, [], server=False),
        # Identities mapped to two tenants: it acted as whichever came first.
        "two-tenants": ca.issue("worker-a", [x509.DNSName("worker-c.example")], server=False),
        "rogue": rogue.issue("worker-a", [], server=False),
    }
    channels: dict[str, grpc.aio.Channel] = {}

    def channel(who: str | None) -> Any:
        if who is None:
            creds = grpc.ssl_channel_credentials(root_certificates=ca.pem)
        else:
            cert, key = clients[who]
            creds = grpc.ssl_channel_credentials(
                root_certificates=ca.pem, private_key=key, certificate_chain=cert
            )
        chan = grpc.aio.secure_channel(f"127.0.0.1:{running.port}", creds)
        channels[who or "none"] = chan
        return pb_grpc.ContextEngineStub(chan)

    def files(who: str) -> tuple[str, str]:
        """The client's certificate and key as PEM files (for the CLI): (cert, key)."""
        cert, key = clients[who]
        (tmp / f"{who}.crt").write_bytes(cert)
        (tmp / f"{who}.key").write_bytes(key)
        return str(tmp / f"{who}.crt"), str(tmp / f"{who}.key")

    yield {
        "channel": channel,
        "files": files,
        "ca_file": str(tmp / "tls_client_ca_file"),
        "target": f"127.0.0.1:{running.port}",
    }
    for chan in channels.values():
        await chan.close()
    await running.stop(0)


async def test_mtls_tenant_from_common_name_and_mapped_san(mtls: Any, pool: Any) -> None:
    a, b = mtls["channel"]("a"), mtls["channel"]("b")
    session_a, session_b = new_id(), new_id()
    await a.Plan(pb.PlanRequest(session_id=session_a, spec=spec()))
    await b.Plan(pb.PlanRequest(tenant_id="tenant-b", session_id=session_b, spec=spec()))
    assert await _sessions(pool, session_a) == ["tenant-a"]
    assert await _sessions(pool, session_b) == ["tenant-b"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await b.GetPlan(pb.GetPlanRequest(session_id=session_a))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await a.Plan(pb.PlanRequest(tenant_id="tenant-b", session_id=new_id(), spec=spec()))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_mtls_unmapped_certificate_is_unauthenticated(mtls: Any) -> None:
    stub = mtls["channel"]("unmapped")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Plan(pb.PlanRequest(session_id=new_id(), spec=spec()))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert details(info.value)[0] == "UNAUTHENTICATED"


async def test_mtls_identities_map_by_type_and_to_one_tenant(mtls: Any, pool: Any) -> None:
    """A mapping key names its identity's type: a CN spelling a URI key does not map (the
    keys were untyped, and a requester whose CA let it choose its CN could act as the
    tenant of any SPIFFE ID). A certificate whose identities map to two tenants names
    none: it acted as whichever the certificate listed first."""
    for who in ("cn-spelling-uri", "two-tenants"):
        stub = mtls["channel"](who)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Plan(pb.PlanRequest(tenant_id="tenant-b", session_id=new_id(), spec=spec()))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, who
        assert details(info.value)[0] == "UNAUTHENTICATED"
    c = mtls["channel"]("c")
    session_c = new_id()
    await c.Plan(pb.PlanRequest(session_id=session_c, spec=spec()))
    assert await _sessions(pool, session_c) == ["tenant-c"]


async def test_mtls_without_a_mapping_a_certificate_without_a_cn_is_unauthenticated(
    pool: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without tls_client_tenants the subject CN is the tenant. A certificate without one
    was reported with an empty CN and taken as tenant "" (an audit): it passed
    authentication. It is UNAUTHENTICATED now. And a refused call's log line names the
    caller's tenant beside the one the request claims (it named only the claimed one)."""
    ca = _CA("test client CA")
    server_cert, server_key = ca.issue("context-engine", [x509.DNSName("localhost")], server=True)
    files = {"tls_cert_file": server_cert, "tls_key_file": server_key, "tls_client_ca_file": ca.pem}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    settings = load_settings(
        environ={
            "CONTEXT_ENGINE_AUTH": "mtls",
            **{f"CONTEXT_ENGINE_{name.upper()}": str(tmp_path / name) for name in files},
        }
    )
    running = await build_server(build_engine(pool), "127.0.0.1:0", **server_options(settings))
    caplog.set_level(logging.INFO, logger="context_engine.rpc")
    try:
        for cn, sans in (("", [x509.DNSName("nameless.example")]), ("worker-z", [])):
            cert, key = ca.issue(cn, sans, server=False)
            creds = grpc.ssl_channel_credentials(
                root_certificates=ca.pem, private_key=key, certificate_chain=cert
            )
            async with grpc.aio.secure_channel(
                f"127.0.0.1:{running.port}",
                creds,
                options=(("grpc.ssl_target_name_override", "localhost"),),
            ) as channel:
                stub = pb_grpc.ContextEngineStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Plan(
                        pb.PlanRequest(tenant_id="tenant-b", session_id=new_id(), spec=spec())
                    )
                if not cn:
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    continue
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert details(info.value)[0] == "TENANT_MISMATCH"
                lines = [
                    getattr(r, "fields", {})
                    for r in caplog.records
                    if r.name == "context_engine.rpc"
                    and getattr(r, "fields", {}).get("reason") == "TENANT_MISMATCH"
                ]
                assert {(f.get("tenant_id"), f.get("caller_tenant")) for f in lines} == {
                    ("tenant-b", "worker-z")
                }
                planned = await stub.Plan(pb.PlanRequest(session_id=new_id(), spec=spec()))
                assert planned.created
    finally:
        await running.stop(0)


@pytest.mark.parametrize("who", ["rogue", None])
async def test_mtls_rejects_foreign_ca_and_missing_certificate(mtls: Any, who: Any) -> None:
    stub = mtls["channel"](who)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Plan(pb.PlanRequest(session_id=new_id(), spec=spec()), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_explain_reaches_an_mtls_server_with_its_certificate_files(
    mtls: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`explain --session` calls GetBuild over TLS when given --ca-file (and mTLS with
    --cert-file/--key-file): a TLS-only server is reachable, and without a client
    certificate it answers one line, not a traceback."""
    stub = mtls["channel"]("a")
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(session_id=session_id, spec=spec()))
    started = await stub.StartRun(
        pb.StartRunRequest(session_id=session_id, user_message=pb.UserMessage(text="hi"))
    )
    built = await stub.Build(pb.BuildRequest(session_id=session_id, run_id=started.run.run_id))
    cert, key = mtls["files"]("a")
    sequence = str(built.request_sequence)
    command = [
        "explain",
        *(sequence, sequence),
        *("--session", session_id, "--tenant", "tenant-a", "--target", mtls["target"]),
        *("--ca-file", mtls["ca_file"]),
    ]
    assert await asyncio.to_thread(main, [*command, "--cert-file", cert, "--key-file", key]) == 0
    assert "identical" in capsys.readouterr().out
    assert await asyncio.to_thread(main, command) == 2  # TLS, but no client certificate
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("context-engine explain: GetBuild failed: UNAVAILABLE: "), line


# --- size limits -------------------------------------------------------------------


async def _started(stub: Any) -> tuple[str, pb.StartRunResponse]:
    """A planned session of tenant-a with a run started: (session id, StartRun's answer)."""
    session_id = new_id()
    await stub.Plan(pb.PlanRequest(tenant_id="tenant-a", session_id=session_id, spec=spec()))
    run = await stub.StartRun(
        pb.StartRunRequest(
            tenant_id="tenant-a", session_id=session_id, user_message=pb.UserMessage(text="hi")
        )
    )
    return session_id, run


async def test_a_write_whose_answer_outgrows_its_request_is_answered(pool: Any) -> None:
    """AppendItems answers each item's sequence and id: 14,000 one-letter messages (98 KB)
    get a 570 KB answer. The server capped what it sent at twice the request limit, so the
    write committed and the caller got RESOURCE_EXHAUSTED, and then ABORTED on its retry
    (an audit). Answers are not capped now."""
    limit = 256 * 1024
    running = await build_server(build_engine(pool), "127.0.0.1:0", max_message_bytes=limit)
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{running.port}", options=[("grpc.max_receive_message_length", -1)]
    )
    try:
        stub = pb_grpc.ContextEngineStub(channel)
        session_id, run = await _started(stub)
        request = pb.AppendItemsRequest(
            tenant_id="tenant-a",
            session_id=session_id,
            run_id=run.run.run_id,
            expected_checkpoint_version=1,
            items=[pb.ConversationItem(user_message=pb.UserMessage(text="u"))] * 14_000,
        )
        assert request.ByteSize() < limit
        appended = await stub.AppendItems(request)
        assert appended.ByteSize() > 2 * limit
        assert (appended.checkpoint_version, len(appended.sequences)) == (2, 14_000)
    finally:
        await channel.close()
        await running.stop(0)


async def test_the_size_limit_measures_the_request_as_sent(pool: Any) -> None:
    """Auth fills an empty tenant_id in from the token, and the size limit ran after it:
    a request of exactly the limit, as sent, was refused REQUEST_TOO_LARGE for bytes the
    caller never sent (an audit)."""
    limit = 64 * 1024
    running = await build_server(
        build_engine(pool),
        "127.0.0.1:0",
        max_message_bytes=limit,
        auth=BearerTokens({TOKEN_A: "tenant-a"}),
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        stub = pb_grpc.ContextEngineStub(channel)
        session_id = new_id()
        await stub.Plan(
            pb.PlanRequest(session_id=session_id, spec=spec()), metadata=_bearer(TOKEN_A)
        )
        started = await stub.StartRun(
            pb.StartRunRequest(session_id=session_id, user_message=pb.UserMessage(text="hi")),
            metadata=_bearer(TOKEN_A),
        )
        request = pb.AppendItemsRequest(
            session_id=session_id,
            run_id=started.run.run_id,
            expected_checkpoint_version=started.checkpoint_version,
            items=[call("c1"), result("c1", "")],
        )
        base = request.ByteSize()
        for n in range(limit - base - 16, limit - base):  # the lengths' varints grow too
            request.items[1].tool_result.content = "x" * n
            if request.ByteSize() == limit:
                break
        assert request.ByteSize() == limit
        appended = await stub.AppendItems(request, metadata=_bearer(TOKEN_A))
        assert appended.checkpoint_version == started.checkpoint_version + 1
    finally:
        await channel.close()
        await running.stop(0)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n])


async def test_oversize_request_is_resource_exhausted_and_writes_nothing(pool: Any) -> None:
    limit = 64 * 1024
    running = await build_server(build_engine(pool), "127.0.0.1:0", max_message_bytes=limit)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        stub = pb_grpc.ContextEngineStub(channel)
        session_id, run = await _started(stub)
        for size in (limit + 1, 3 * limit):  # over the limit; over the transport limit too
            request = pb.AppendItemsRequest(
                tenant_id="tenant-a",
                session_id=session_id,
                run_id=run.run.run_id,
                expected_checkpoint_version=1,
                items=[call("c1"), result("c1", "x" * size)],
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.AppendItems(request)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if size < 2 * limit:
                reason, _, metadata = details(info.value)
                assert reason == "REQUEST_TOO_LARGE"
                assert metadata["limit_bytes"] == str(limit)
                assert int(metadata["request_bytes"]) > limit
        # Bytes that do not decode (a string field of invalid UTF-8) are refused for their
        # size first, as decodable ones are; they answered INVALID_ARGUMENT (an audit).
        raw = channel.unary_unary("/context_engine.v1.ContextEngine/AppendItems")
        undecodable = b"\x0a" + _varint(limit + 10) + b"\xff" * (limit + 10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(undecodable)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reason, _, metadata = details(info.value)
        assert reason == "REQUEST_TOO_LARGE"
        assert metadata["request_bytes"] == str(len(undecodable))
        with pytest.raises(grpc.aio.AioRpcError) as info:  # under the limit: the decode
            await raw(b"\x0a\x02\xff\xff")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Nothing was written: version 1 is still the latest.
        ok = await stub.AppendItems(
            pb.AppendItemsRequest(
                tenant_id="tenant-a",
                session_id=session_id,
                run_id=run.run.run_id,
                expected_checkpoint_version=1,
                items=[call("c1"), result("c1", "small")],
            )
        )
        assert ok.checkpoint_version == 2
    finally:
        await channel.close()
        await running.stop(0)
