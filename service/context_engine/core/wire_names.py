"""Tool names as providers see them. In core because the body estimate counts the name a
request sends (core/body_estimate.py Rule 6); providers/names.py holds the rest (Rule 2:
the names of a request must map one to one, and a worker maps a wire name back).

Rule 1: both APIs restrict tool names to ``[A-Za-z0-9_-]`` (Anthropic up to 128
characters, OpenAI up to 64), while our names use dots ("web.fetch"). The wire name is the
tool name with every character outside that set replaced by "-", cut to ``MAX_WIRE_NAME``
characters ("web.fetch" -> "web-fetch"). It reads naturally to the model and is the same
in every request of a session.
"""

from __future__ import annotations

import re

__all__ = ["MAX_WIRE_NAME", "wire_tool_name"]

MAX_WIRE_NAME = 64  # the stricter of the two providers (OpenAI)
_NOT_WIRE = re.compile(r"[^A-Za-z0-9_-]")


def wire_tool_name(name: str) -> str:
    """The name a provider sees for tool `name` (Rule 1)."""
    return _NOT_WIRE.sub("-", name)[:MAX_WIRE_NAME] or "-"
