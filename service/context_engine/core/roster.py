"""Which tools a plan advertises, resolved once at session open and pinned.

Rule 1: hidden tools (model_visible=false) go first, before anything else looks at them.
Rule 2: authorization and session environment filter next: a tool whose required scopes
are not all granted, or whose session binding is not selected, is absent.
Rule 3: an operational session's typed tasks send no tools to a model: it pins none.
Rule 4: the defined set renders sorted by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from .enums import SessionKind
from .spec import PlanSpec, ToolSpec

__all__ = ["Roster", "resolve_roster"]


@dataclass(frozen=True, slots=True)
class Roster:
    defined: tuple[ToolSpec, ...]  # advertised by definition, sorted by name
    deferred: tuple[ToolSpec, ...]  # advertised by index entry, in index order
    skipped: tuple[str, ...]  # fit neither; recorded on the plan event


def resolve_roster(spec: PlanSpec) -> Roster:
    if spec.environment.kind is SessionKind.OPERATIONAL:
        return Roster((), (), ())
    granted = set(spec.principal.scopes)
    bound = set(spec.environment.bound_capabilities)
    candidates = [
        tool
        for tool in spec.tools
        if tool.model_visible
        and granted.issuperset(tool.required_scopes)
        and (not tool.session_binding or tool.session_binding in bound)
    ]
    return Roster(tuple(sorted(candidates, key=lambda t: t.name)), (), ())
