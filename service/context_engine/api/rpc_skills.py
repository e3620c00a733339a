"""gRPC methods for skills; composed into ContextEngineServicer."""

from __future__ import annotations

__all__ = ["SkillsRpcs"]


class SkillsRpcs:
    """Methods not defined here answer UNIMPLEMENTED (the generated base)."""
