"""The build inputs a model.request.started event records, so GetBuild can rebuild the
same bytes (Build is pure: the plan epoch, the checkpoint version, the log below the run's
seed, the clock and the step context decide it).

Rule 1: the event records the clock as the UTC instant Build read (ISO 8601, microseconds)
and the step context field by field; the epoch and checkpoint version are recorded beside
them by the engine. The zone conversion is not recorded: it follows from the plan.
Rule 2: the step context serializes generically over its dataclass fields — a tuple of
items as their JSON dumps, anything else as its JSON value — so a field added to
StepContext is recorded without touching this module, as long as it is one of those.
Rule 3: reading a record that lacks its inputs (written before this module) is an error
the caller reports; it never guesses.
Rule 4: the people the step's recall and correction lines are about are recorded beside
the inputs (PEOPLE_KEY), where an erasure finds them; redacting a person removes their
lines from the recorded inputs and marks the record redacted (REDACTED_KEY), which GetBuild
then refuses to rebuild.
Rule 5: the cache-marker budget the payload was rendered with (the model registry's
max_cache_breakpoints then) is recorded beside the inputs (BUDGET_KEY), so a rebuild sends
the same markers after an overlay changes the model's budget. A record without it was
rendered under the provider's own limit.
Rule 6: the step's lines (its tuple fields, `SHOWN_FIELDS`: knowledge passages, recall and
correction lines) read back one at a time as well (`shown_items`), so compaction can hold
the model's answers and a summary to what the recorded Builds showed the model
(core/compaction.py, Rule 3) without reading each request whole.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from .assemble import StepContext
from .errors import PreconditionError
from .items import ContextItem

__all__ = [
    "BUDGET_KEY",
    "INPUTS_KEY",
    "PEOPLE_KEY",
    "REDACTED_KEY",
    "SHOWN_FIELDS",
    "inputs_from_record",
    "inputs_to_record",
    "recalled_people",
    "redact_record",
    "shown_items",
]

BUDGET_KEY = "max_cache_breakpoints"
INPUTS_KEY = "build_inputs"
PEOPLE_KEY = "people"
REDACTED_KEY = "redacted"
_LINES = ("recall", "corrections")  # the step fields whose lines name people


def _line_fields() -> dict[str, type[ContextItem]]:
    """Rule 6: the step fields that are tuples of items, with their item type."""
    hints = typing.get_type_hints(StepContext)
    found: dict[str, type[ContextItem]] = {}
    for f in fields(StepContext):
        item_type = (typing.get_args(hints[f.name]) or (None,))[0]
        if isinstance(item_type, type) and issubclass(item_type, ContextItem):
            found[f.name] = item_type
    return found


_SHOWN = _line_fields()
SHOWN_FIELDS = tuple(_SHOWN)


def inputs_to_record(now: datetime, step: StepContext) -> dict[str, Any]:
    """The `build_inputs` entry of a model.request.started payload (Rules 1, 2)."""
    step_json: dict[str, Any] = {}
    for f in fields(step):
        value = getattr(step, f.name)
        if isinstance(value, tuple):
            step_json[f.name] = [v.model_dump(mode="json") for v in value]
        else:
            step_json[f.name] = value
    return {"now": now.astimezone(UTC).isoformat(), "step": step_json}


def inputs_from_record(payload: dict[str, Any]) -> tuple[datetime, StepContext]:
    """(now, step) from a model.request.started payload.

    Raises:
        PreconditionError: REQUEST_NOT_FOUND when the event recorded no build inputs.
    """
    record = payload.get(INPUTS_KEY)
    if not isinstance(record, dict):
        raise PreconditionError(
            "this request was recorded without its build inputs and cannot be rebuilt",
            field="request_sequence",
            reason="REQUEST_NOT_FOUND",
        )
    hints = typing.get_type_hints(StepContext)
    values: dict[str, Any] = {}
    for name, value in record.get("step", {}).items():
        hint = hints.get(name)
        if hint is None:
            continue  # a field this build no longer has
        if isinstance(value, list):
            item_type = typing.get_args(hint)[0]
            if not (isinstance(item_type, type) and issubclass(item_type, BaseModel)):
                raise PreconditionError(
                    f"step.{name} cannot be read back",
                    field="request_sequence",
                    reason="REQUEST_NOT_FOUND",
                )
            values[name] = tuple(item_type.model_validate(v) for v in value)
        else:
            values[name] = value
    return datetime.fromisoformat(record["now"]), StepContext(**values)


def shown_items(lines: Iterable[tuple[str, dict[str, Any]]]) -> tuple[ContextItem, ...]:
    """Rule 6: the items of recorded step lines, each given as (step field, its JSON) as
    `inputs_to_record` wrote it; a field this build no longer has is skipped."""
    return tuple(_SHOWN[name].model_validate(line) for name, line in lines if name in _SHOWN)


def recalled_people(step: StepContext) -> list[str]:
    """Rule 4: everyone the step's recall and correction lines name, sorted, once each."""
    recalled = {p for line in step.recall for p in line.person_ids}
    return sorted(recalled.union(*(line.person_ids for line in step.corrections)))


def redact_record(payload: dict[str, Any], person_id: str) -> tuple[dict[str, Any], int]:
    """Rule 4: (the payload without the person's lines, how many lines were removed).
    Removes nothing, and marks nothing, when no line names the person."""
    step = dict(payload.get(INPUTS_KEY, {}).get("step", {}))
    removed = 0
    for name in _LINES:
        lines = step.get(name, [])
        kept = [line for line in lines if person_id not in line.get("person_ids", [])]
        removed += len(lines) - len(kept)
        step[name] = kept
    if not removed:
        return payload, 0
    people = [p for p in payload.get(PEOPLE_KEY, []) if p != person_id]
    inputs = {**payload[INPUTS_KEY], "step": step}
    return {**payload, INPUTS_KEY: inputs, PEOPLE_KEY: people, REDACTED_KEY: True}, removed
