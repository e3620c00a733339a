#!/usr/bin/env python3
"""gRPC health probe for the context engine: exit 0 when SERVING, 1 otherwise.

    healthcheck.py [TARGET] [--service NAME] [--timeout SECONDS] [--tls-ca FILE
                   [--tls-cert FILE --tls-key FILE] [--tls-server-name NAME]]

TARGET defaults to where this container's engine listens: CONTEXT_ENGINE_LISTEN (the
image sets 0.0.0.0:50051), a wildcard host probed on loopback; 127.0.0.1:50051 without it.
(Only the variable is read, not a CONTEXT_ENGINE_CONFIG file: give TARGET if the listen
address comes from one.) The overall status (service "", the default) is
liveness: SERVING while the process serves. `--service context_engine.v1.ContextEngine` is
readiness: SERVING only while PostgreSQL answers. The image's HEALTHCHECK runs it; in
Kubernetes the built-in `grpc:` probe does the same job, except on a TLS listener, which
that probe cannot speak: there an exec probe runs this script with --tls-ca, and
--tls-server-name when the server's certificate does not carry the target's host (often
127.0.0.1); with a client CA on the listener (mTLS), --tls-cert and --tls-key too, as the
handshake asks for a client certificate. It needs only grpcio and grpcio-health-checking,
which the service installs; it sends no token (the health service needs none).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def default_target(environ: Mapping[str, str] = os.environ) -> str:
    """HOST:PORT of CONTEXT_ENGINE_LISTEN, a wildcard host replaced by loopback."""
    host, _, port = (environ.get("CONTEXT_ENGINE_LISTEN") or "127.0.0.1:50051").rpartition(":")
    if host in {"", "0.0.0.0", "::", "[::]"}:
        host = "127.0.0.1"  # grpc binds [::] dual-stack, so IPv4 loopback reaches it too
    return f"{host}:{port}"


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.tls_ca:
        return grpc.insecure_channel(args.target)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(args.tls_ca).read_bytes(),
        private_key=Path(args.tls_key).read_bytes() if args.tls_key else None,
        certificate_chain=Path(args.tls_cert).read_bytes() if args.tls_cert else None,
    )
    options = (
        [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    )
    return grpc.secure_channel(args.target, credentials, options=options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", nargs="?", default=default_target())
    parser.add_argument("--service", default="", help='"" (liveness) or a service name')
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--tls-ca", default="", help="CA bundle (PEM): connect with TLS")
    parser.add_argument("--tls-cert", default="", help="client certificate (PEM), for mTLS")
    parser.add_argument("--tls-key", default="", help="client key (PEM), for mTLS")
    parser.add_argument("--tls-server-name", default="", help="expected server name")
    args = parser.parse_args(argv)
    if not args.tls_ca and os.environ.get("CONTEXT_ENGINE_TLS_CERT_FILE"):
        # A plaintext probe of a TLS listener fails as UNAVAILABLE, which reads as the
        # engine being down: say what is missing instead (the image's HEALTHCHECK must be
        # overridden with the CA for a TLS listener: docs/operations.md, Health).
        print(
            "unhealthy: the listener uses TLS (CONTEXT_ENGINE_TLS_CERT_FILE is set);"
            " probe it with --tls-ca (and --tls-cert/--tls-key for mTLS)",
            file=sys.stderr,
        )
        return 1
    with _channel(args) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(status)
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
