"""Tool names on the wire.

Both APIs restrict tool names to ``[A-Za-z0-9_-]`` (Anthropic up to 128 characters, OpenAI
up to 64), while our names use dots ("web.fetch", "context.update_working_state").

Rule 1: the wire name is the tool name with every character outside ``[A-Za-z0-9_-]``
replaced by "-", cut to ``MAX_WIRE_NAME`` characters ("web.fetch" -> "web-fetch"). It
reads naturally to the model and is the same in every request of a session. Defined in
core/wire_names.py: the body estimate counts it.
Rule 2: the mapping is not reversible on its own, so a request is only renderable when its
tools' names map one to one; a worker maps a wire name back with the request's tools
(``tool_name_from_wire``, the clients' `tool_name`), the only names a model's new call can
take. Two tools that collide fail the render loudly. The history's calls render under
their wire names too, but are not held to this: a call logged under a tool's old name
("web.fetch", since renamed "web-fetch" for the worker's own reasons) shares the new one's
wire name, which failed every Build of the session until compaction took the call, with
advice to rename a tool that the rename had caused (an audit).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core.errors import PreconditionError
from ..core.memo_budget import bounded_cache
from ..core.wire_names import MAX_WIRE_NAME, wire_tool_name

__all__ = ["MAX_WIRE_NAME", "check_wire_names", "tool_name_from_wire", "wire_tool_name"]


def check_wire_names(names: Iterable[str]) -> None:
    """Raise when two distinct tool names share a wire name (Rule 2). A set of names
    found to map one to one is not checked again: a session's requests name the same
    tools on every Build.

    Raises:
        PreconditionError: naming both tools; rename one in the worker's registry.
    """
    _check_distinct(frozenset(names))


# Bounded and charged to the render memos' ledger (core/memo_budget.py); a set that
# raises is not stored.
@bounded_cache(4096)
def _check_distinct(names: frozenset[str]) -> None:
    seen: dict[str, str] = {}
    for name in sorted(names):
        wire = wire_tool_name(name)
        other = seen.setdefault(wire, name)
        if other != name:
            raise PreconditionError(
                f"tools {other!r} and {name!r} both render as {wire!r} for the provider;"
                " rename one of them",
                field="spec.tools",
                reason="TOOL_NAME_COLLISION",
                metadata={"wire_name": wire},
            )


def tool_name_from_wire(names: Iterable[str], wire: str) -> str:
    """The tool name behind `wire` among a request's tool names.

    Raises:
        KeyError: no tool of the request renders as `wire`.
    """
    table = {wire_tool_name(n): n for n in names}
    return table[wire]
