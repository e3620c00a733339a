"""gRPC methods for usage; composed into ContextEngineServicer."""

from __future__ import annotations

__all__ = ["UsageRpcs"]


class UsageRpcs:
    """Methods not defined here answer UNIMPLEMENTED (the generated base)."""
