"""gRPC methods for working state; composed into ContextEngineServicer."""

from __future__ import annotations

__all__ = ["WorkingStateRpcs"]


class WorkingStateRpcs:
    """Methods not defined here answer UNIMPLEMENTED (the generated base)."""
