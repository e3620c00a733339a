"""Prefix epochs: the pure decisions that start one at a run's admission, and the one
rotation that rebuilds nothing.

Rule 1: a new run's admission, before the run pins its tools, is the only point where
authority refreshes. A retried StartRun returns its first answer and re-admits nothing, so
runs with pinned tools, pending calls or parked approvals never refresh authority.
Rule 2: one admission rotates once, for the first reason that applies in
`REASON_PRIORITY`, and the rebuild carries every change found (the remaining snapshot, the
current builder, and the run's own changes of Rules 3 and 4). The run's own changes are
its alone: its scopes enter the rebuilt spec only when they were newly granted
(run_authority_changed), its browser profile only when it changed (browser_profile_changed).
Every other reason rebuilds from the pinned spec, so a rotation that reaches every active
run (builder_upgraded, snapshot_invalidated: not in `ADMISSION_REASONS`) never carries one
run's scope reduction or grant into the others' prompts. An admission rotation begins a
plan lineage only the admitted run follows; a rotation that reaches every run continues
each run's lineage from that lineage's own pinned spec (the current lineage at once, every
other when next used; store/plans.py), so it never hands one run the authority another
run's admission granted either. So a builder upgrade admitted with a grant is one
run_authority_changed rotation (the runs already active keep their plan, as for any
admission); one admitted with a mere reduction is a builder_upgraded rotation of every
lineage from its pinned authority. The one exception to "once" is an erasure: its
snapshot_invalidated rotation reaches every run, so it rebuilds the current lineage from
its pinned authority (every other invalidated lineage at its next use), and the run's own
change is then decided again on the rebuilt current plan: a second, admission rotation
(the same epochs a Build after the erasure and then the admission would give).
Rule 3: newly granted scopes (a SHA-256 not in plan.authority_scope_hashes) rotate with
run_authority_changed where they take effect: where the run's scopes admit a tool of the
pinned spec that the pinned scopes do not (`admitted_by_grant`), and a plan under them
advertises a tool one under the pinned scopes does not (the roster's later rules can
still leave it out: skill.load without a catalog, tool.call with nothing deferred, a tool
past the definition cap that nothing indexes; an audit found each rotating for nothing).
A scope no tool needs (an OAuth "openid", "email") changes no byte of the prefix:
rotating for it re-cached Region A under a new secret, alternating admissions rotated at
every run, and the rebuild under the run's scopes refused a run that asked for the pinned
browser profile (an audit). Scope reduction alone keeps the prefix, because revocation
is enforced at call time. A legacy plan without hashes rebuilds once. A session kind that
pins no tools has no advertisement for authority to change.
Rule 4: a changed selected browser profile rotates with browser_profile_changed, even with
unchanged scopes; not for a session kind that pins no tools, whose prefix no profile
changes (an audit: an operational session rotated at every profile change).
Rule 5: an invalidated snapshot (erasure) rotates with snapshot_invalidated.
Rule 6: a plan recorded by another builder version stays current when the current builder
reproduces its bytes; otherwise it rotates once with builder_upgraded.
Rule 7: a plan whose recorded document hashes to its prefix_sha256 but is not canonical
(scopes in a hash-seed order, before ADR-0134) is copied as a new epoch with canonical
hashes and reason prefix_hash_canonicalized: the same bytes reach the provider under the
same secret, nothing is rebuilt under a parked run, nothing is re-cached.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .canonical import canonical_bytes, sha256_hex
from .enums import PlanReason, SessionKind
from .errors import InvalidFieldError
from .framing import BUILDER_VERSION
from .plan import ContextPlan
from .roster import PinnedTool, advertisable, scope_hashes
from .spec import PlanSpec, Principal, SessionEnvironment

__all__ = [
    "ADMISSION_REASONS",
    "REASON_PRIORITY",
    "Admission",
    "Advertised",
    "Decision",
    "admit_run",
    "admitted_by_grant",
    "canonical_document",
    "canonicalized_copy",
    "copyable",
    "is_canonical",
    "newly_granted",
    "rendered_identity",
    "weighed_scopes",
    "with_scopes",
]

# Rule 2: which reason names an admission's single rotation when several apply.
REASON_PRIORITY: tuple[PlanReason, ...] = (
    PlanReason.SNAPSHOT_INVALIDATED,
    PlanReason.RUN_AUTHORITY_CHANGED,
    PlanReason.BROWSER_PROFILE_CHANGED,
    PlanReason.BUILDER_UPGRADED,
    PlanReason.PREFIX_HASH_CANONICALIZED,
)

# Rotations that only a run's admission decides: each begins a plan lineage only the
# admitted run follows, and the runs already active keep theirs (store/plans.py). Rotate
# refuses them: an operator's rotation names another reason and reaches every run.
ADMISSION_REASONS: frozenset[PlanReason] = frozenset(
    {PlanReason.RUN_AUTHORITY_CHANGED, PlanReason.BROWSER_PROFILE_CHANGED}
)


@dataclass(frozen=True, slots=True)
class Admission:
    """A new run's authority, as StartRun states it. None: the run states nothing."""

    scopes: tuple[str, ...] | None = None
    browser_profile_id: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """What admission does to the session's plan: one rotation. After a
    snapshot_invalidated rotation the caller decides again on the rebuilt plan (Rule 2)."""

    reasons: tuple[PlanReason, ...] = ()  # every reason found, in priority order
    spec: PlanSpec | None = None  # the spec a rebuild uses; None for a copy or no rotation

    @property
    def reason(self) -> PlanReason | None:
        return self.reasons[0] if self.reasons else None

    @property
    def copy(self) -> bool:
        return self.reason is PlanReason.PREFIX_HASH_CANONICALIZED

    @property
    def detail(self) -> str:
        return ",".join(r.name.lower() for r in self.reasons)


def newly_granted(plan: ContextPlan, scopes: tuple[str, ...]) -> tuple[str, ...]:
    """Scope hashes the run holds that the plan was not built with (sorted)."""
    pinned = set(plan.authority_scope_hashes or ())
    return tuple(h for h in scope_hashes(scopes) if h not in pinned)


# The (defined, deferred) tool names a plan of the pinned spec under some scopes
# advertises, or None when no plan of it can be made now: the shell renders plans
# (api/engine.py, off the event loop), and keeps what it found.
Advertised = tuple[tuple[str, ...], tuple[str, ...]] | None


def admit_run(
    plan: ContextPlan,
    spec: PlanSpec,
    admission: Admission | None,
    *,
    builder_reproduces: Callable[[], bool],
    advertises: Callable[[tuple[str, ...]], Advertised],
) -> Decision:
    """Decide, before a new run pins its tools, whether the session's plan rotates.

    `spec` is the plan's pinned spec; `builder_reproduces` re-renders the plan with the
    current builder and says whether its bytes are the plan's (called only when the plan
    records another builder version); `advertises` says what a plan of the pinned spec
    under some scopes advertises (asked only for the two `weighed_scopes` names, Rule 3).
    """
    admission = admission or Admission()
    found: set[PlanReason] = set()
    if plan.invalidated:
        found.add(PlanReason.SNAPSHOT_INVALIDATED)
    if _authority_changed(plan, spec, admission, advertises):
        found.add(PlanReason.RUN_AUTHORITY_CHANGED)
    if (
        admission.browser_profile_id is not None
        and admission.browser_profile_id != spec.environment.browser_profile_id
        and spec.environment.kind is not SessionKind.OPERATIONAL  # Rule 4
    ):
        found.add(PlanReason.BROWSER_PROFILE_CHANGED)
    if plan.builder_version != BUILDER_VERSION and not builder_reproduces():
        found.add(PlanReason.BUILDER_UPGRADED)
    if not found and not is_canonical(plan) and copyable(plan):
        found.add(PlanReason.PREFIX_HASH_CANONICALIZED)
    reasons = tuple(r for r in REASON_PRIORITY if r in found)
    if not reasons or reasons[0] is PlanReason.PREFIX_HASH_CANONICALIZED:
        return Decision(reasons)
    if reasons[0] is PlanReason.SNAPSHOT_INVALIDATED:
        # Rule 2: every run follows this rotation, so the run's own change waits for the
        # decision on the rebuilt plan.
        reasons = tuple(r for r in reasons if r not in ADMISSION_REASONS)
    return Decision(reasons, _rebuilt_spec(spec, admission, reasons))


def _authority_changed(
    plan: ContextPlan,
    spec: PlanSpec,
    admission: Admission,
    advertises: Callable[[tuple[str, ...]], Advertised],
) -> bool:
    if spec.environment.kind is SessionKind.OPERATIONAL:
        return False  # its kind pins an empty set whatever the scopes (Rule 3)
    if plan.authority_scope_hashes is None:
        return True  # a legacy plan rebuilds once, at the next unpinned run
    weighed = weighed_scopes(plan, spec, admission)
    if weighed is None:
        return False
    # Compared with the pinned spec's roster as the builder resolves it now, not the
    # plan's names: a builder change is BUILDER_UPGRADED's to decide. A grant whose plan
    # cannot be made rotates, so that its rotation's refusal says why.
    pinned, run = weighed
    after = advertises(run)
    return after is None or _adds(after, advertises(pinned))


def _adds(after: Advertised, before: Advertised) -> bool:
    """Whether `after` advertises a tool `before` does not, or defines one `before` only
    indexes. Not what it leaves out: the run's reduction, which alone keeps the prefix
    (a review: runs alternating with and without a reduction rotated each time)."""
    if before is None:
        return True
    assert after is not None
    defined, deferred = set(before[0]), set(before[1])
    return not (set(after[0]) <= defined and set(after[1]) <= defined | deferred)


def weighed_scopes(
    plan: ContextPlan, spec: PlanSpec, admission: Admission | None
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """Rule 3: (the pinned scopes, the run's), sorted, where the admission grants a scope
    that admits a tool the roster could show: whether a plan under the run's, which the
    rotation would make, advertises a tool the one under the pinned scopes does not
    decides (_adds). Under the pinned scopes with the grant added, a tool only the run's
    reduction made room for was not weighed, and the run went without it (a review).
    None where there is no such grant to weigh (an operational session, a legacy plan:
    decided otherwise)."""
    if spec.environment.kind is SessionKind.OPERATIONAL or plan.authority_scope_hashes is None:
        return None
    if admission is None or admission.scopes is None:
        return None
    if not newly_granted(plan, admission.scopes) or not admitted_by_grant(spec, admission.scopes):
        return None
    return tuple(sorted(set(spec.principal.scopes))), tuple(sorted(set(admission.scopes)))


def admitted_by_grant(spec: PlanSpec, scopes: tuple[str, ...]) -> tuple[str, ...]:
    """Rule 3: the tools of `spec` that `scopes` admit and its pinned scopes do not, of
    those the roster could advertise at all (model-visible, bound where a binding is asked:
    core/roster.py Rule 1; a review: a hidden tool's scope rotated for nothing)."""
    run, pinned = set(scopes), set(spec.principal.scopes)
    return tuple(
        t.name
        for t in advertisable(spec)
        if run.issuperset(t.required_scopes) and not pinned.issuperset(t.required_scopes)
    )


def _rebuilt_spec(
    spec: PlanSpec, admission: Admission, reasons: tuple[PlanReason, ...]
) -> PlanSpec:
    """The pinned spec, with the admitted run's permissions applied only when they were
    newly granted and its browser profile only when it changed (Rule 2), each validated
    again (not model_copy'd) so the scopes are stored sorted."""
    if PlanReason.RUN_AUTHORITY_CHANGED in reasons and admission.scopes is not None:
        spec = with_scopes(spec, admission.scopes)
    environment = spec.environment
    if PlanReason.BROWSER_PROFILE_CHANGED in reasons and admission.browser_profile_id is not None:
        environment = SessionEnvironment.model_validate(
            {**environment.model_dump(), "browser_profile_id": admission.browser_profile_id}
        )
    return spec.model_copy(update={"environment": environment})


def with_scopes(spec: PlanSpec, scopes: tuple[str, ...]) -> PlanSpec:
    """The spec under a run's scopes, validated again (not model_copy'd) so they are stored
    sorted."""
    principal = Principal.model_validate({**spec.principal.model_dump(), "scopes": list(scopes)})
    return spec.model_copy(update={"principal": principal})


# --- builder identity -------------------------------------------------------------------


def rendered_identity(plan: ContextPlan) -> bytes:
    """What a provider receives from the plan, and what it advertises: the bytes a newer
    builder must reproduce for the plan to stay current (Rule 6)."""
    return canonical_bytes(
        {
            "system": [b.to_block().canonical() for b in plan.system],
            "tools": [
                {"name": t.name, "description": t.description, "schema": t.input_schema_json}
                for t in plan.tools
            ],
            "tool_names": list(plan.tool_names),
            "deferred_tool_names": list(plan.deferred_tool_names),
            "model_id": plan.model_id,
            "provider": plan.provider,
        }
    )


# --- canonical hashes (ADR-0134) ----------------------------------------------------------


def canonical_document(document: str) -> str:
    """The prefix document with every set-valued field sorted, as RFC 8785 text."""
    parsed: dict[str, Any] = json.loads(document)
    parsed["tool_specs"] = [_canonical_spec(s) for s in parsed.get("tool_specs", [])]
    return canonical_bytes(parsed).decode("utf-8")


def _canonical_spec(spec: Any) -> Any:
    if isinstance(spec, dict) and isinstance(spec.get("required_scopes"), list):
        return {**spec, "required_scopes": sorted(set(spec["required_scopes"]))}
    return spec


def is_canonical(plan: ContextPlan) -> bool:
    return canonical_document(plan.prefix_document) == plan.prefix_document


def copyable(plan: ContextPlan) -> bool:
    """Whether canonicalized_copy can copy `plan`: its hash is its recorded document's."""
    return sha256_hex(plan.prefix_document.encode("utf-8")) == plan.prefix_sha256


def canonicalized_copy(plan: ContextPlan, *, epoch: int) -> ContextPlan:
    """Rule 7: the same plan as a new epoch, with canonical hashes.

    Raises:
        InvalidFieldError: the plan's hash does not match its recorded document, so it is
            not a pre-ADR-0134 plan whose bytes can be kept: rotate with a rebuild reason.
    """
    if not copyable(plan):
        raise InvalidFieldError(
            "the plan's prefix_sha256 does not match its recorded document; it cannot be"
            " canonicalized without a rebuild",
            field="reason",
        )
    document = canonical_document(plan.prefix_document)
    specs: list[Any] = json.loads(document).get("tool_specs", [])
    by_name = {s["name"]: s for s in specs if isinstance(s, dict) and "name" in s}
    pinned = tuple(
        PinnedTool.model_validate(
            {
                **p.model_dump(),
                "required_scopes": sorted(set(p.required_scopes)),
                "spec_sha256": sha256_hex(canonical_bytes(by_name[p.name]))
                if p.name in by_name
                else p.spec_sha256,
            }
        )
        for p in plan.pinned_tools
    )
    return plan.model_copy(
        update={
            "epoch": epoch,
            "reason": PlanReason.PREFIX_HASH_CANONICALIZED,
            "prefix_document": document,
            "prefix_sha256": sha256_hex(document.encode("utf-8")),
            "tool_schema_sha256": sha256_hex(canonical_bytes(specs)),
            "pinned_tools": pinned,
        }
    )
