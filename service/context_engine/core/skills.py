"""Skills: the catalog pinned in Region A (row 7) and the bodies loaded into Region B (row 11).

Rule 1: the catalog pins at plan time, at most 20 entries and 1,500 tokens, first-fit in
the order given. An entry that does not fit is not in the catalog and cannot be loaded.
A name is listed once (Plan refuses a second entry); should a stored spec list it twice,
its first entry is the only candidate, as for tools.
Rule 2: a body loads only for a skill in the plan's pinned catalog (SKILL_NOT_IN_CATALOG).
Rule 3: a loaded body is sticky for the session and renders in load order. A skill is never
deselected: a body that came and went would rewrite the cached body on every step.
Rule 4: at most 2 bodies and 6,000 tokens, and no more than the plan's body holds beside
the runtime row (core/plan.py skill_room). A third load, or one past either, fails with
SKILL_LIMIT; nothing is evicted. A body's tokens are those of the largest form Build can
send it in (core/assemble.py skill_body_texts), measured by the shell once the load is
admitted otherwise (`admit_load` before, `admit_tokens` after: a body of megabytes is
not measured to be refused as a third skill or as a retry). Loading a loaded skill again
with the same body and trust changes nothing (a retry); with another body or trust it is
SKILL_ALREADY_LOADED.
Rule 5: a body never yields: Build carries every loaded body or fails.
Rule 6: a body takes its pinned catalog entry's trust (the entry its version comes from),
or the load's when that is lower (the less trusted of the two, TrustLevel's order): a
worker that knows a body came from a less trusted place is believed, one that claims more
is not. A load never claims PLATFORM or MODEL trust for a body, and a body never ends at
either: Plan refuses a catalog entry at those levels, and one a stored spec still holds
counts as EXTERNAL_UNTRUSTED (a body renders in the user role, where both render bare).
Build applies the rule again with the pinned entry of the plan it builds on: an entry a
Rotate lowered lowers the loaded body, one it took out leaves it EXTERNAL_UNTRUSTED; a
raised one raises nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from .budget import PPM
from .caps import CLASS_CAPS
from .errors import InvalidFieldError, PreconditionError
from .estimator import MESSAGE_FRAMING_TOKENS, apply_factor
from .items import SkillBodyItem
from .roster import fit_in_order
from .spec import SkillSpec
from .trust import TrustLevel

__all__ = [
    "LoadedSkill",
    "admit_load",
    "admit_tokens",
    "body_items",
    "body_text",
    "body_trust",
    "pin_catalog",
    "pinned_entry",
    "skill_cost",
    "still_fit",
]

_CATALOG = CLASS_CAPS["skill_catalog"]
_BODIES = CLASS_CAPS["skill_bodies"]

# Trust a load may not claim for a body (Rule 6).
_NEVER_BODY_TRUST = frozenset({TrustLevel.PLATFORM, TrustLevel.MODEL})


@dataclass(frozen=True, slots=True)
class LoadedSkill:
    name: str
    version: str
    body: str
    trust: TrustLevel
    tokens: int  # measured at load time with the plan's model tokenizer


def pin_catalog(
    skills: Sequence[SkillSpec], measure: Callable[[SkillSpec], int]
) -> tuple[tuple[SkillSpec, ...], tuple[SkillSpec, ...]]:
    """Rule 1: (pinned catalog, entries left out)."""
    first: dict[str, SkillSpec] = {}
    for skill in skills:
        first.setdefault(skill.name, skill)
    return fit_in_order(
        tuple(first.values()),
        cap_items=_CATALOG.cap_items,
        cap_tokens=_CATALOG.cap_tokens,
        measure=measure,
    )


def pinned_entry(
    skills: Sequence[SkillSpec], pins: Sequence[tuple[str, str]], name: str
) -> tuple[str, TrustLevel]:
    """The (version, trust) a load of `name` takes from the plan's pinned catalog (Rule 6).

    Both come from the pinned entry: the pin gives the version, and the trust is that of the
    spec entry with this name and version, never of another entry of the same name that did
    not fit the catalog. A stored plan from before Plan refused duplicate names can match
    more than one entry: the least trusted counts. No pinned entry: EXTERNAL_UNTRUSTED (and
    admit_load refuses the load as SKILL_NOT_IN_CATALOG).
    """
    version = dict(pins).get(name)
    trusts = [s.trust for s in skills if (s.name, s.version) == (name, version)]
    return version or "", max(trusts, default=TrustLevel.EXTERNAL_UNTRUSTED)


def body_text(name: str, version: str, body: str) -> str:
    """The text row 11 renders for a body (inside its envelope when its trust needs one)."""
    return f"Skill {name} ({version}) loaded:\n{body}"


def body_trust(catalog_trust: TrustLevel, requested: TrustLevel | None) -> TrustLevel:
    """Rule 6. Never PLATFORM or MODEL.

    Raises:
        InvalidFieldError: the load claims PLATFORM or MODEL trust for a body.
    """
    if requested in _NEVER_BODY_TRUST:
        raise InvalidFieldError(f"a skill body cannot carry {requested.name} trust", field="trust")
    if catalog_trust in _NEVER_BODY_TRUST:
        # Defence in depth: Plan refuses such an entry, but a stored plan's spec may predate
        # that rule. Nothing is known about where the body came from: the least trusted.
        catalog_trust = TrustLevel.EXTERNAL_UNTRUSTED
    if requested is None:
        return catalog_trust
    return max(catalog_trust, requested)  # a larger TrustLevel is less trusted


def admit_load(
    loaded: Sequence[LoadedSkill],
    catalog: Sequence[tuple[str, str]],
    skill: LoadedSkill,
    *,
    claimed: TrustLevel | None = None,
) -> bool:
    """Decide a load on all but its tokens (Rules 2-4; `admit_tokens` then checks those):
    True to load, False when the skill is already loaded as
    it is (the same body, with a trust at least as cautious as the one the load claims,
    `claimed`: a retry). The trust a load takes is its claim or the catalog entry's, the
    less trusted, and a Rotate since may have changed the entry, so a resend of the same
    load is compared on its claim, not on what the entry makes of it now (an audit: a
    resend after a Rotate lowered the entry was refused). A load claiming none is a retry
    whatever the entry says now; one claiming a less trusted label than the held one is
    refused, as it would be quietly kept more trusted than its caller said.

    Raises:
        PreconditionError: SKILL_NOT_IN_CATALOG, SKILL_LIMIT (a third skill: metadata
            names the class, the loaded skills and the limit that binds), or
            SKILL_ALREADY_LOADED when it is loaded with another body or trust (sticky:
            never replaced, and never quietly kept while the caller believes its new body
            is in force).
    """
    name = skill.name
    held = next((s for s in loaded if s.name == name), None)
    if held is not None:
        if held.body == skill.body and (claimed is None or held.trust >= claimed):
            return False  # a larger TrustLevel is less trusted
        raise PreconditionError(
            f"skill {name!r} is loaded already with another body or trust; a loaded skill"
            " is sticky for the session and never replaced",
            field="body" if held.body != skill.body else "trust",
            reason="SKILL_ALREADY_LOADED",
            metadata={"loaded_version": held.version},
        )
    if name not in {n for n, _ in catalog}:
        raise PreconditionError(
            f"skill {name!r} is not in the plan's pinned skill catalog",
            field="name",
            reason="SKILL_NOT_IN_CATALOG",
        )
    if len(loaded) >= _BODIES.cap_items:
        _refuse(
            name,
            loaded,
            f"at most {_BODIES.cap_items} skills load per session",
            field="name",
            limit="items",
        )
    return True


def skill_cost(tokens: int, factor_ppm: int) -> int:
    """What Build pays for a loaded body of `tokens` (its largest form's count) at the
    correction `factor_ppm`: scaled, with its block's framing (core/body_estimate.py)."""
    return apply_factor(tokens, factor_ppm) + MESSAGE_FRAMING_TOKENS


def admit_tokens(
    loaded: Sequence[LoadedSkill], skill: LoadedSkill, room: int, factor_ppm: int = PPM
) -> None:
    """Rule 4's tokens, for a load `admit_load` admitted: the class cap (the bodies'
    counts, `loaded` measured with the same plan's counter as `skill`), and `room`, what
    the plan's body leaves beside the runtime row at `factor_ppm` (core/plan.py
    skill_room), which the bodies' costs (skill_cost) must fit.
    A user message never yields either and is not known here: a body that fits the room
    can still leave a long one none.

    Raises:
        PreconditionError: SKILL_LIMIT naming `body` (metadata `limit` "tokens" for the
            class cap, "body" for the plan's room; `used_tokens`, `body_tokens` and
            `limit_tokens` the figures, the room's as Build costs them).
    """
    held = [s.tokens for s in loaded]
    costs = [skill_cost(t, factor_ppm) for t in (*held, skill.tokens)]
    for limit, used, needs, bound, why in (
        ("tokens", sum(held), skill.tokens, _BODIES.cap_tokens, "skill bodies are capped at"),
        (
            "body",
            sum(costs[:-1]),
            costs[-1],
            room,
            "the plan's body holds beside its runtime row and a run's seed",
        ),
    ):
        if used + needs > bound:
            _refuse(
                skill.name,
                loaded,
                f"{why} {max(bound, 0):,} tokens ({used:,} used, this body needs {needs:,})",
                field="body",
                limit=limit,
                figures={
                    "used_tokens": str(used),
                    "body_tokens": str(needs),
                    "limit_tokens": str(bound),
                },
            )


def still_fit(loaded: Sequence[LoadedSkill], room: int, factor_ppm: int) -> None:
    """Rule 4 for a plan the loaded bodies already hold their place in (a Rotate with a
    spec): `loaded`, measured again with that plan's counter, within the class cap and
    `room` (core/plan.py skill_room). A body is never evicted, so a plan that cannot carry
    them would fail every later Build of the session (an audit: a model of another
    tokenizer, or a tighter policy cap).

    Raises:
        PreconditionError: SKILL_LIMIT naming `spec`, with the figures.
    """
    counts = [s.tokens for s in loaded]
    costs = sum(skill_cost(t, factor_ppm) for t in counts)
    for limit, used, bound, why in (
        ("tokens", sum(counts), _BODIES.cap_tokens, "over the class cap of"),
        (
            "body",
            costs,
            room,
            "more than this plan's body holds beside its runtime row and a run's seed,",
        ),
    ):
        if used > bound:
            raise PreconditionError(
                f"the session's loaded skill bodies take {used:,} tokens with this plan,"
                f" {why} {max(bound, 0):,}; a loaded skill is never evicted: keep a model"
                " and capacity that carry them",
                field="spec",
                reason="SKILL_LIMIT",
                metadata={
                    "class": "skill_bodies",
                    "limit": limit,
                    "loaded": ",".join(s.name for s in loaded),
                    "used_tokens": str(used),
                    "limit_tokens": str(bound),
                },
            )


def _refuse(
    name: str,
    loaded: Sequence[LoadedSkill],
    limit_text: str,
    *,
    field: str,
    limit: str,
    figures: dict[str, str] | None = None,
) -> NoReturn:
    raise PreconditionError(
        f"cannot load skill {name!r}: {limit_text}; a loaded skill is never evicted",
        field=field,
        reason="SKILL_LIMIT",
        metadata={
            "class": "skill_bodies",
            "limit": limit,
            "loaded": ",".join(s.name for s in loaded),
            **(figures or {}),
        },
    )


def body_items(
    loaded: Sequence[LoadedSkill],
    catalog: tuple[Sequence[SkillSpec], Sequence[tuple[str, str]]] | None = None,
) -> tuple[SkillBodyItem, ...]:
    """Row 11 items, in load order (Rule 3), each at its load's trust or, given `catalog`
    (the spec's entries and the pins of the plan the request is built on), its pinned
    entry's where that is lower (Rule 6, pinned_entry): a Rotate that lowers an entry
    lowers the body loaded under it, and one that takes the entry out leaves it
    EXTERNAL_UNTRUSTED (an audit: it kept rendering bare at the trust it was loaded
    with)."""
    return tuple(
        SkillBodyItem(
            item_id=f"skill-body:{s.name}",
            name=s.name,
            version=s.version,
            body=s.body,
            trust=s.trust
            if catalog is None
            else body_trust(pinned_entry(*catalog, s.name)[1], s.trust),
        )
        for s in loaded
    )
