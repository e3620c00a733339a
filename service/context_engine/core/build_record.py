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
"""

from __future__ import annotations

import typing
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from .assemble import StepContext
from .errors import PreconditionError

__all__ = ["INPUTS_KEY", "inputs_from_record", "inputs_to_record"]

INPUTS_KEY = "build_inputs"


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
                raise PreconditionError(f"step.{name} cannot be read back", field="step")
            values[name] = tuple(item_type.model_validate(v) for v in value)
        else:
            values[name] = value
    return datetime.fromisoformat(record["now"]), StepContext(**values)
