"""The assembly table: fifteen rows in a fixed, total order, each in exactly one region.

Rule 1: region is a property of the row, and every item type declares the rows it may
occupy; assembly asserts both (items.py, assemble.py).
Rule 2: if it can differ between two requests in the same session, it is in Region B.
Rule 3: rows 1-8 are rendered once per plan epoch; rows 9-15 on every Build.
The numbering matches the proto's Row enum.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .trust import TrustLevel

__all__ = ["ROWS", "ROW_TABLE", "Region", "Row", "RowSpec"]


class Region(IntEnum):
    PREFIX = 1  # Region A: frozen, cacheable, hashed.
    BODY = 2  # Region B: rebuilt per request.


class Row(IntEnum):
    PLATFORM_POLICY = 1
    FRAMING = 2
    AGENT_INSTRUCTIONS = 3
    PERSONA = 4
    TOOL_DEFINITIONS = 5
    DEFERRED_TOOL_INDEX = 6
    SKILL_CATALOG = 7
    MEMORY_SNAPSHOT = 8
    COMPACTED_SUMMARY = 9
    CONVERSATION = 10
    SKILL_BODIES = 11
    WORKING_STATE = 12
    RECALL = 13
    RUNTIME_METADATA = 14
    USER_INPUT = 15


@dataclass(frozen=True, slots=True)
class RowSpec:
    row: Row
    region: Region
    content: str
    trust: TrustLevel | None  # None: the trust is each item's own.


ROWS: tuple[RowSpec, ...] = (
    RowSpec(Row.PLATFORM_POLICY, Region.PREFIX, "platform policy", TrustLevel.PLATFORM),
    RowSpec(Row.FRAMING, Region.PREFIX, "framing", TrustLevel.PLATFORM),
    RowSpec(
        Row.AGENT_INSTRUCTIONS,
        Region.PREFIX,
        "agent instructions",
        TrustLevel.TRUSTED_CONFIGURATION,
    ),
    RowSpec(Row.PERSONA, Region.PREFIX, "persona", TrustLevel.TRUSTED_CONFIGURATION),
    RowSpec(
        Row.TOOL_DEFINITIONS,
        Region.PREFIX,
        "tool definitions",
        TrustLevel.TRUSTED_CONFIGURATION,
    ),
    RowSpec(Row.DEFERRED_TOOL_INDEX, Region.PREFIX, "deferred tool index", None),
    RowSpec(Row.SKILL_CATALOG, Region.PREFIX, "skill catalog", None),
    RowSpec(Row.MEMORY_SNAPSHOT, Region.PREFIX, "memory snapshot", TrustLevel.MEMORY),
    RowSpec(Row.COMPACTED_SUMMARY, Region.BODY, "compacted summary", TrustLevel.PLATFORM),
    RowSpec(Row.CONVERSATION, Region.BODY, "conversation", None),
    RowSpec(Row.SKILL_BODIES, Region.BODY, "skill bodies", None),
    RowSpec(Row.WORKING_STATE, Region.BODY, "working state", None),
    # Knowledge passages share row 13 with recall: the table names no row of their own,
    # and both are step context the worker retrieves per request.
    RowSpec(Row.RECALL, Region.BODY, "recall, corrections, knowledge", None),
    RowSpec(Row.RUNTIME_METADATA, Region.BODY, "runtime metadata", TrustLevel.PLATFORM),
    # The user's words (USER); in a child run, its parent agent's (DelegatedMessage, MODEL).
    RowSpec(Row.USER_INPUT, Region.BODY, "trailing user input", None),
)

ROW_TABLE: dict[Row, RowSpec] = {spec.row: spec for spec in ROWS}

assert [spec.row for spec in ROWS] == sorted(Row), "the table must list every row, in order"
