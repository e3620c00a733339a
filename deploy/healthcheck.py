#!/usr/bin/env python3
"""gRPC health probe for the context engine: exit 0 when SERVING, 1 otherwise.

    healthcheck.py [TARGET] [--service NAME] [--timeout SECONDS] [--tls-ca FILE
                   [--tls-cert FILE --tls-key FILE] [--tls-server-name NAME]]

TARGET defaults to 127.0.0.1:50051. The overall status (service "", the default) is
liveness: SERVING while the process serves. `--service context_engine.v1.ContextEngine` is
readiness: SERVING only while PostgreSQL answers. The image's HEALTHCHECK runs it; in
Kubernetes the built-in `grpc:` probe does the same job, except on a TLS listener, which
that probe cannot speak: there an exec probe runs this script with --tls-ca (and, for
mTLS, a client certificate). It needs only grpcio and grpcio-health-checking, which the
service installs; it sends no credentials (the health service needs none).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


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
    parser.add_argument("target", nargs="?", default="127.0.0.1:50051")
    parser.add_argument("--service", default="", help='"" (liveness) or a service name')
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--tls-ca", default="", help="CA bundle (PEM): connect with TLS")
    parser.add_argument("--tls-cert", default="", help="client certificate (PEM), for mTLS")
    parser.add_argument("--tls-key", default="", help="client key (PEM), for mTLS")
    parser.add_argument("--tls-server-name", default="", help="expected server name")
    args = parser.parse_args(argv)
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
