"""The session-open memory snapshot (row 8): what pins, and what erasure removes.

Rule 1: the snapshot pins at plan time, at most 40 items and 1,500 tokens, first-fit in the
memory block's order; it yields only at an epoch boundary, never per request.
Rule 2: a plan's snapshot is nonempty when row 8 renders at least one item; only then does a
run bind to it (context.snapshot.used) before its first request leaves.
Rule 3: erasure of a person redacts every persisted snapshot that holds their items: the
items leave the pinned spec, their row 8 blocks leave the plan and its recorded document,
and the plan is marked invalidated, so the next plan or run admission rotates with
snapshot_invalidated and recalls from what remains. The plan keeps its historical
prefix_sha256: it names the bytes that were sent, which is what a bound run needs to know.
Rule 4: a snapshot a caller sends (Plan, Rotate) that names an erased person is refused: the
recall predates the erasure or ignored it, and persisting it would bring the memories back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .canonical import canonical_bytes, sha256_hex
from .caps import CLASS_CAPS
from .roster import fit_in_order
from .rows import Row
from .spec import MemoryItemSpec, PlanSpec

if TYPE_CHECKING:  # plan.py pins snapshots with this module; the import goes one way
    from .plan import ContextPlan

__all__ = [
    "erased_from_prefix",
    "first_naming",
    "memory_item_id",
    "named_people",
    "nonempty",
    "pin_snapshot",
    "redact_person",
]

_SNAPSHOT = CLASS_CAPS["memory_snapshot"]


def memory_item_id(item_id: str) -> str:
    """The id a snapshot item renders under (its envelope nonce input)."""
    return f"memory:{item_id}"


def pin_snapshot(
    items: Sequence[MemoryItemSpec], measure: Callable[[MemoryItemSpec], int]
) -> tuple[tuple[MemoryItemSpec, ...], tuple[MemoryItemSpec, ...]]:
    """Rule 1: (pinned items, items left out)."""
    return fit_in_order(
        items, cap_items=_SNAPSHOT.cap_items, cap_tokens=_SNAPSHOT.cap_tokens, measure=measure
    )


def named_people(spec: PlanSpec) -> list[str]:
    """Everyone the snapshot's items name, sorted, once each."""
    return sorted({p for m in spec.snapshot.items for p in m.person_ids})


def first_naming(spec: PlanSpec, people: Sequence[str]) -> int | None:
    """Rule 4: the index of the first snapshot item naming any of `people`, or None."""
    named = set(people)
    return next(
        (n for n, m in enumerate(spec.snapshot.items) if named.intersection(m.person_ids)),
        None,
    )


def nonempty(plan: ContextPlan) -> bool:
    """Rule 2."""
    return any(b.row is Row.MEMORY_SNAPSHOT for b in plan.system)


def erased_from_prefix(plan: ContextPlan) -> bool:
    """Whether an erasure took a rendered block out of the plan's prefix (Rule 3): its
    document no longer hashes to the prefix_sha256 it keeps. An erasure whose memories the
    snapshot's cap had skipped invalidates the plan but leaves the bytes sent unchanged."""
    return plan.invalidated and sha256_hex(plan.prefix_document.encode()) != plan.prefix_sha256


def redact_person(
    plan: ContextPlan, spec: PlanSpec, person_id: str
) -> tuple[ContextPlan, PlanSpec, int]:
    """Rule 3: (redacted plan, redacted spec, items removed). Removes nothing when the
    person has no item in this snapshot (and then does not invalidate either)."""
    held = {m.item_id for m in spec.snapshot.items if person_id in m.person_ids}
    if not held:
        return plan, spec, 0
    kept = tuple(m for m in spec.snapshot.items if m.item_id not in held)
    snapshot = spec.snapshot.model_copy(update={"items": kept})
    rendered = {memory_item_id(i) for i in held}
    document: dict[str, Any] = json.loads(plan.prefix_document)
    document["system"] = [b for b in document.get("system", []) if b.get("item_id") not in rendered]
    redacted = plan.model_copy(
        update={
            "system": tuple(b for b in plan.system if b.item_id not in rendered),
            "prefix_document": canonical_bytes(document).decode("utf-8"),
            # An id the snapshot skipped for room names the person's item too.
            "skipped_memory_ids": tuple(i for i in plan.skipped_memory_ids if i not in held),
            "invalidated": True,
        }
    )
    return redacted, spec.model_copy(update={"snapshot": snapshot}), len(held)
