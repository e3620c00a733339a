"""gRPC methods for compaction; composed into ContextEngineServicer."""

from __future__ import annotations

__all__ = ["CompactionRpcs"]


class CompactionRpcs:
    """Methods not defined here answer UNIMPLEMENTED (the generated base)."""
