"""The gRPC shell: servicers, proto <-> core conversion, error mapping, the server."""

from .server import build_server, serve

__all__ = ["build_server", "serve"]
