"""`context-engine inspect SESSION`: a session's epochs and requests at a glance.

Reads PostgreSQL directly (an operator's tool, not an API): the session's plans, its
`model.request.started` events and its `context.*` events, and prints

- the epochs, each with its reason and prefix hash;
- one line per request: sequence, run, epoch, prefix hash (red when it is not its
  epoch's plan hash: the stability defect the spec names), and a bar of tokens by class
  against the request's input budget, with the pressure steps its own Build ran;
- the other context events (rotations, compactions, budget pressure and overflow; the
  pressure of a Build that needed compaction, which recorded no request, is listed here).

Rules:
1. No message content is printed: only ids, hashes, reasons, class names and numbers from
   the allow-list `_SAFE_KEYS`; payload text is never read into the output.
2. Payload shapes vary by builder version, so every field is optional: what is present is
   rendered, what is absent is omitted. `classes_of` and `budget_of` are the one place
   that knows the shapes.
3. The bar is a pure function of (classes, budget, width): `bar_cells`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

__all__ = [
    "Epoch",
    "RequestLine",
    "SessionView",
    "bar_cells",
    "budget_of",
    "classes_of",
    "load_session",
    "render",
    "run_inspect",
]

BAR_WIDTH = 40
# Class -> colour: every class a record names (core/caps.py, core/pressure.py BODY_CLASSES),
# and the coarse "prefix" and "body" of records before class_tokens. Unknown
# classes take the fallback colours in order of first appearance.
_COLOURS: Mapping[str, str] = {
    "prefix": "blue",
    "platform_policy": "blue",
    "framing": "blue",
    "agent_instructions": "bright_blue",
    "persona": "bright_blue",
    "tool_definitions": "cyan",
    "deferred_tool_index": "cyan",
    "skill_catalog": "bright_cyan",
    "memory_snapshot": "magenta",
    "history": "green",
    "body": "green",
    "skill_bodies": "bright_green",
    "working_state": "bright_yellow",
    "recall": "bright_magenta",
    "knowledge": "purple",
    "tool_results": "dark_orange",
    "corrections": "pink1",
    "runtime_metadata": "grey70",
    "user_message": "white",
}
_FALLBACK = ("red3", "orange3", "gold3", "chartreuse3", "turquoise2", "orchid")
# Payload keys that may be printed (rule 1): ids, reasons, hashes, classes and numbers.
_SAFE_KEYS = (
    "epoch",
    "from_epoch",
    "lineage",
    "sweep",
    "reason",
    "depth",
    "fits",
    "needs_compaction",
    "class",
    "class_name",
    "step",
    "steps",
    "tokens_before",
    "tokens_after",
    "body_tokens_before",
    "body_tokens_after",
    "body_budget_tokens",
    "model_id",
    "replaced_through_sequence",
    "skill",
    "name",
)


@dataclass(frozen=True, slots=True)
class Epoch:
    epoch: int
    reason: str
    prefix_sha256: str
    prefix_tokens: int
    model_id: str
    tools: int
    created_at: str


@dataclass(frozen=True, slots=True)
class RequestLine:
    sequence: int
    run_id: str
    epoch: int
    prefix_sha256: str
    classes: tuple[tuple[str, int], ...]
    budget_tokens: int
    estimated_tokens: int
    pressure: str


@dataclass(frozen=True, slots=True)
class SessionView:
    tenant_id: str
    session_id: str
    current_epoch: int
    created_at: str
    epochs: tuple[Epoch, ...]
    requests: tuple[RequestLine, ...]
    events: tuple[tuple[int, str, str], ...]  # (sequence, type, safe summary)
    runs: int = 0
    counts: dict[str, int] = field(default_factory=dict)


# --- payload shapes (rule 2) ---------------------------------------------------------


def classes_of(payload: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    """Tokens by class from a model.request.started payload, in the order given.

    The engine records "class_tokens" ([{class_name, tokens}], prefix exact, body
    estimated; from context-assembler@13 they sum to the estimate less the request's
    framing, which belongs to no class); a request recorded before it did shows the exact
    prefix and the estimated body as the classes "prefix" and "body".
    """
    recorded = payload.get("class_tokens")
    if isinstance(recorded, list) and recorded:
        return tuple(
            (str(entry.get("class_name") or "?"), _int(entry.get("tokens")))
            for entry in recorded
            if isinstance(entry, Mapping)
        )
    coarse = (
        ("prefix", _int(payload.get("prefix_tokens"))),
        ("body", _int(payload.get("body_estimated_tokens"))),
    )
    return tuple((name, tokens) for name, tokens in coarse if tokens)


def budget_of(payload: Mapping[str, Any]) -> tuple[int, int]:
    """(input budget, estimated input tokens) from a payload; 0 where absent."""
    budget = _int(payload.get("input_budget_tokens") or payload.get("budget_tokens"))
    estimated = _int(payload.get("estimated_input_tokens") or payload.get("input_tokens"))
    return budget, estimated


def _pressure_of(payload: Mapping[str, Any]) -> str:
    pressure = payload.get("pressure")
    parts = []
    if isinstance(pressure, Mapping):
        steps = [
            str(s.get("step", "?")) if isinstance(s, Mapping) else str(s)
            for s in pressure.get("steps") or ()
        ]
        parts.append(("fits" if pressure.get("fits", True) else "OVER") + ":" + ",".join(steps))
    if payload.get("needs_compaction"):
        parts.append("needs_compaction")
    return " ".join(p.rstrip(":") for p in parts)


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _safe_summary(payload: Mapping[str, Any]) -> str:
    parts = []
    for key in _SAFE_KEYS:
        value = payload.get(key)
        if value in (None, "", [], {}):
            continue
        if key == "steps" and isinstance(value, list):
            value = ",".join(
                str(s.get("step", "?")) if isinstance(s, Mapping) else str(s) for s in value
            )
        elif isinstance(value, Mapping | list):
            continue
        parts.append(f"{key}={value}")
    prefix = payload.get("prefix_sha256")
    if isinstance(prefix, str) and prefix:
        parts.append(f"prefix={prefix[:12]}")
    return " ".join(parts)


# --- the bar (rule 3) ----------------------------------------------------------------


def bar_cells(
    classes: Sequence[tuple[str, int]], budget: int, width: int = BAR_WIDTH
) -> list[tuple[str, int]]:
    """Cells per class for a bar of `width` cells that represents `budget` tokens.

    The filled length is the request's share of the budget, round(total / budget * width)
    and at least one cell when it has tokens; largest-remainder rounding shares it among
    the classes, so a class far smaller than a cell may get none. (Each class with tokens
    had a cell of its own: 708 tokens of a 191,808 budget filled 6 cells of 40, a bar 15%
    full beside "0%", an audit.) Over budget (or with no budget recorded) the bar is full
    and shows the classes' proportions; the caller prints the percentage beside it.
    """
    total = sum(max(t, 0) for _, t in classes)
    scale = max(budget, total)
    if scale <= 0 or width <= 0 or total <= 0:
        return []
    target = max(round(total * width / scale), 1)
    exact = [max(t, 0) * width / scale for _, t in classes]
    cells = [int(x) for x in exact]
    used = sum(cells)  # at most the exact total, so at most target
    for i in sorted(range(len(exact)), key=lambda i: (-(exact[i] % 1), i)):
        if used >= target:
            break
        cells[i] += 1
        used += 1
    return [(name, n) for (name, _), n in zip(classes, cells, strict=True) if n > 0]


def _colours(names: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    spare = iter(_FALLBACK * 8)
    for name in names:
        if name not in out:
            out[name] = _COLOURS.get(name) or next(spare, "white")
    return out


def _bar(line: RequestLine, colours: Mapping[str, str], width: int, largest: int) -> Text:
    """The request's bar; without a recorded budget, scaled to the session's largest."""
    budget = line.budget_tokens
    text = Text()
    cells = bar_cells(line.classes, budget or largest, width)
    for name, n in cells:
        text.append("█" * n, style=colours[name])
    used = sum(n for _, n in cells)
    text.append("·" * max(width - used, 0), style="grey30")
    total = sum(t for _, t in line.classes)
    shown = max(total, line.estimated_tokens)
    if budget:
        pct = shown * 100 / budget
        style = "bold red" if pct > 100 else ("yellow" if pct >= 90 else "")
        text.append(f" {shown:,}/{budget:,} ({pct:.0f}%)", style=style)
    elif shown:
        text.append(f" {shown:,} (no budget recorded; scaled to the largest)", style="grey50")
    return text


# --- rendering -----------------------------------------------------------------------

_MIN_BAR = 8  # cells: narrower, a bar says nothing
_PRESSURE_ROOM = 20  # what the pressure column is given before it wraps
_TABLE_FRAME = 19  # a six-column table's rules (7) and cell padding (2 per column)


_FIXED = tuple(enumerate(("seq", "run", "epoch", "prefix")))  # the columns before the bar


def _bar_width(
    console_width: int,
    fixed: int,
    rows: Sequence[tuple[str, str, str, Text, RequestLine, Text]],
    colours: Mapping[str, str],
    largest: int,
) -> int:
    """The bar's cells: what the console leaves beside the other columns (`fixed` wide
    before it, the pressure column up to _PRESSURE_ROOM, the bar's own figures after it),
    between _MIN_BAR and BAR_WIDTH."""
    others = _TABLE_FRAME + fixed
    figures = max((len(_bar(row[4], colours, 0, largest)) for row in rows), default=0)
    pressure = min(max([len("pressure"), *(len(row[5]) for row in rows)]), _PRESSURE_ROOM)
    return max(_MIN_BAR, min(BAR_WIDTH, console_width - others - figures - pressure))


def render(view: SessionView, console: Console, width: int | None = None) -> None:
    """Print the session: header, epochs, requests with bars, context events. The bars are
    `width` cells, or (None) as many as the console leaves beside the other columns, up to
    BAR_WIDTH (`inspect --width` sizes the console)."""
    plan_hash = {e.epoch: e.prefix_sha256 for e in view.epochs}
    hashes_per_epoch: dict[int, set[str]] = {}
    for r in view.requests:
        hashes_per_epoch.setdefault(r.epoch, set()).add(r.prefix_sha256)
    defects = sorted(
        epoch
        for epoch, hashes in hashes_per_epoch.items()
        if len(hashes) > 1 or (epoch in plan_hash and hashes != {plan_hash[epoch]})
    )
    header = Text.assemble(
        ("session ", "bold"),
        view.session_id,
        ("  tenant ", "bold"),
        view.tenant_id,
        ("  epoch ", "bold"),
        str(view.current_epoch),
        ("  runs ", "bold"),
        str(view.runs),
        ("  requests ", "bold"),
        str(len(view.requests)),
        ("  created ", "bold"),
        view.created_at,
    )
    verdict = (
        Text(f"prefix hash changed within epoch(s) {defects}: a stability defect", "bold red")
        if defects
        else Text(
            f"one prefix hash per epoch ({len(view.epochs)} epoch(s))",
            "green" if len(view.epochs) <= 1 else "yellow",
        )
    )
    console.print(Panel(Group(header, verdict), title="context-engine inspect", expand=False))

    epochs = Table(title="Plans (epochs)", title_justify="left")
    for column in ("epoch", "reason", "prefix_sha256", "prefix tokens", "model", "tools", "at"):
        epochs.add_column(column, justify="right" if "tokens" in column else "left")
    for e in view.epochs:
        epochs.add_row(
            str(e.epoch),
            e.reason,
            e.prefix_sha256[:16],
            f"{e.prefix_tokens:,}",
            e.model_id,
            str(e.tools),
            e.created_at,
        )
    console.print(epochs)

    # The legend's classes: those with tokens in some request (a class recorded at 0 has
    # no cell anywhere).
    colours = _colours(name for r in view.requests for name, t in r.classes if t > 0)
    largest = max((sum(t for _, t in r.classes) for r in view.requests), default=0)
    rows = [
        (
            str(r.sequence),
            r.run_id[:8],
            str(r.epoch),
            Text(
                r.prefix_sha256[:12],
                style=""
                if plan_hash.get(r.epoch, r.prefix_sha256) == r.prefix_sha256
                else "bold red",
            ),
            r,
            Text(r.pressure, style="yellow" if r.pressure else ""),
        )
        for r in view.requests
    ]
    if not rows:
        console.print(Text("Requests: none recorded"))
    # The columns before the bar keep their width where the bar and the pressure header
    # still fit beside them (at 80 columns the seq, run and epoch columns were squeezed to
    # nothing, an audit); narrower, they give way, as kept they cropped the table.
    fixed = [max([len(name), *(len(str(row[n])) for row in rows)]) for n, name in _FIXED]
    keep = console.width >= _TABLE_FRAME + sum(fixed) + _MIN_BAR + len("pressure")
    if width is None:
        width = _bar_width(console.width, sum(fixed), rows, colours, largest)
    requests = Table(
        title="Requests (tokens by class against the input budget)", title_justify="left"
    )
    for (_, name), least in zip(_FIXED, fixed, strict=True):
        requests.add_column(name, no_wrap=keep, min_width=least if keep else None)
    # The bar never breaks; the figures after it wrap where the console is too narrow.
    # Narrower still, every column gives way as rich sees fit (cut short with an ellipsis).
    requests.add_column("budget", min_width=width if keep else None)
    requests.add_column("pressure", overflow="fold" if keep else "ellipsis")
    for seq, run, epoch, prefix, r, pressure in rows:
        requests.add_row(seq, run, epoch, prefix, _bar(r, colours, width, largest), pressure)
    if rows:
        console.print(requests)
    if colours:
        legend = Text("classes: ")
        for name, colour in colours.items():
            legend.append("█ ", style=colour)
            legend.append(name + "  ")
        console.print(legend)

    if view.events:
        events = Table(title="Context events", title_justify="left")
        for column in ("seq", "type", "detail"):
            events.add_column(column)
        for sequence, kind, summary in view.events:
            events.add_row(str(sequence), kind, summary)
        console.print(events)


# --- loading -------------------------------------------------------------------------


def _json(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, dict) else {}


async def load_session(conn: Any, session_id: UUID, tenant_id: str | None) -> SessionView:
    """Read one session. Raises LookupError when it is missing or ambiguous across tenants."""
    rows = await conn.fetch(
        "SELECT tenant_id, current_epoch, created_at FROM sessions"
        " WHERE session_id = $1 AND ($2::text IS NULL OR tenant_id = $2) ORDER BY tenant_id",
        session_id,
        tenant_id,
    )
    if not rows:
        raise LookupError(f"session {session_id} not found")
    if len(rows) > 1:
        tenants = ", ".join(r["tenant_id"] for r in rows)
        raise LookupError(
            f"session {session_id} exists for several tenants ({tenants}): pass --tenant"
        )
    session = rows[0]
    tenant = session["tenant_id"]
    plans = await conn.fetch(
        "SELECT epoch, reason, prefix_sha256, plan, created_at FROM context_plans"
        " WHERE tenant_id = $1 AND session_id = $2 ORDER BY epoch",
        tenant,
        session_id,
    )
    events = await conn.fetch(
        "SELECT sequence, type, run_id, payload FROM session_events"
        " WHERE tenant_id = $1 AND session_id = $2"
        " AND (type = 'model.request.started' OR type LIKE 'context.%')"
        " ORDER BY sequence",
        tenant,
        session_id,
    )
    runs = await conn.fetchval(
        "SELECT count(*) FROM runs WHERE tenant_id = $1 AND session_id = $2", tenant, session_id
    )
    epochs = []
    for row in plans:
        plan = _json(row["plan"])
        epochs.append(
            Epoch(
                epoch=row["epoch"],
                reason=str(row["reason"]).lower(),
                prefix_sha256=row["prefix_sha256"],
                prefix_tokens=_int(plan.get("prefix_tokens")),
                model_id=str(plan.get("model_id", "")),
                tools=len(plan.get("tool_names") or ()),
                created_at=row["created_at"].isoformat(timespec="seconds"),
            )
        )
    requests: list[RequestLine] = []
    others: list[tuple[int, str, str]] = []
    counts: dict[str, int] = {}
    # A Build's context.budget.pressure event precedes the request it shaped, in the same
    # write (migrations/0005_record_request.sql): the next sequence, or the one after a
    # context.snapshot.used of the same run. A Build that needs compaction records the
    # pressure and no request: that pressure shaped no request, and is listed with the events.
    # The sequence a pressured Build's request would take -> (its run, the pressure).
    shaping: dict[int, tuple[str, str]] = {}
    for row in events:
        payload = _json(row["payload"])
        counts[row["type"]] = counts.get(row["type"], 0) + 1
        run = str(row["run_id"] or payload.get("run_id", ""))
        sequence = row["sequence"]
        if row["type"] == "context.budget.pressure" and not payload.get("needs_compaction"):
            # A needs-compaction Build's pressure is never paired: the run's next Build,
            # fitting without a yield, records its request at the next sequence (an audit:
            # it showed the other Build's OVER:compact).
            shaping[sequence + 1] = (run, _pressure_of({"pressure": payload, **payload}))
        elif row["type"] == "context.snapshot.used" and shaping.get(sequence, ("",))[0] == run:
            shaping[sequence + 1] = shaping.pop(sequence)
        if row["type"] == "model.request.started":
            shaped_run, shaped = shaping.pop(sequence, (run, ""))
            budget, estimated = budget_of(payload)
            requests.append(
                RequestLine(
                    sequence=sequence,
                    run_id=run,
                    epoch=_int(payload.get("epoch")),
                    prefix_sha256=str(payload.get("prefix_sha256", "")),
                    classes=classes_of(payload),
                    budget_tokens=budget,
                    estimated_tokens=estimated,
                    pressure=_pressure_of(payload) or (shaped if shaped_run == run else ""),
                )
            )
        elif row["type"] != "context.plan.created":
            others.append((row["sequence"], row["type"], _safe_summary(payload)))
    return SessionView(
        tenant_id=tenant,
        session_id=str(session_id),
        current_epoch=session["current_epoch"],
        created_at=session["created_at"].isoformat(timespec="seconds"),
        epochs=tuple(epochs),
        requests=tuple(requests),
        events=tuple(others),
        runs=int(runs or 0),
        counts=counts,
    )


async def run_inspect(
    dsn: str, session: str, tenant_id: str | None, console: Console, width: int | None = None
) -> None:
    """Connect, load and print one session. Raises LookupError / ValueError for bad input,
    StoreUnavailableError when the database cannot be reached, StoreReadError when it
    refuses the read (no schema, no privilege) or drops the connection."""
    from .store.db import connect, read_refusal

    session_id = UUID(session)
    conn = await connect(dsn)  # StoreUnavailableError: one line naming why
    try:
        view = await load_session(conn, session_id, tenant_id)
    except Exception as exc:
        refused = read_refusal(dsn, exc)
        if refused is None:
            raise
        raise refused from exc
    finally:
        await conn.close()
    render(view, console, width)
