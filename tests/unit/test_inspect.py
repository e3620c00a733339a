"""`context-engine inspect`: the budget bar and the payload shapes it reads (pure parts)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from context_engine.inspect import (
    Epoch,
    RequestLine,
    SessionView,
    bar_cells,
    budget_of,
    classes_of,
    render,
)

classes = st.lists(
    st.tuples(
        st.sampled_from(["prefix", "history", "tool_results", "recall"]), st.integers(0, 10**6)
    ),
    max_size=8,
    unique_by=lambda part: part[0],  # a request records each class once
)


@settings(max_examples=300, deadline=None)
@given(classes, st.integers(0, 2 * 10**6), st.integers(1, 120))
def test_bar_fits_its_width_and_scales_with_the_budget(
    parts: list[tuple[str, int]], budget: int, width: int
) -> None:
    cells = bar_cells(parts, budget, width)
    assert cells == bar_cells(parts, budget, width)  # deterministic
    used = sum(n for _, n in cells)
    assert all(n > 0 for _, n in cells)
    total = sum(t for _, t in parts)
    scale = max(budget, total)
    if not total:
        assert cells == []
        return
    # Filled: the request's share of the budget, rounded (at least one cell), never more
    # than the width; each class within one cell of its exact share, none without tokens.
    assert used == max(1, round(total * width / scale)) <= width
    shares = {name: t * width / scale for name, t in parts}
    for name, n in cells:
        assert shares[name] > 0 and abs(n - shares[name]) < 1


def test_bar_over_budget_fills_the_bar_and_half_budget_fills_half() -> None:
    assert bar_cells([("prefix", 300), ("history", 900)], 1200, 40) == [
        ("prefix", 10),
        ("history", 30),
    ]
    assert sum(n for _, n in bar_cells([("prefix", 250), ("history", 250)], 1000, 40)) == 20
    assert bar_cells([], 1000, 40) == []
    # Over budget, or without one, the bar is full and keeps the proportions.
    assert bar_cells([("prefix", 300), ("history", 900)], 600, 40) == [
        ("prefix", 10),
        ("history", 30),
    ]
    assert sum(n for _, n in bar_cells([("a", 1), ("b", 3)], 0, 40)) == 40


def test_payload_shapes() -> None:
    assert classes_of({"prefix_tokens": 1200}) == (("prefix", 1200),)
    assert classes_of({"prefix_tokens": 1200, "body_estimated_tokens": 30}) == (
        ("prefix", 1200),
        ("body", 30),
    )
    recorded = {
        "prefix_tokens": 1200,
        "class_tokens": [
            {"class_name": "tool_definitions", "tokens": 900},
            {"class_name": "history", "tokens": 40},
        ],
    }
    assert classes_of(recorded) == (("tool_definitions", 900), ("history", 40))
    assert budget_of({"input_budget_tokens": 190_000, "estimated_input_tokens": 3_000}) == (
        190_000,
        3_000,
    )
    assert budget_of({}) == (0, 0)


def _view(second_hash: str) -> SessionView:
    h1 = "a" * 64
    return SessionView(
        tenant_id="tenant-a",
        session_id="00000000-0000-0000-0000-000000000001",
        current_epoch=1,
        created_at="2026-03-01T12:00:00+00:00",
        epochs=(
            Epoch(1, "session_opened", h1, 1200, "claude-sonnet-4-5", 3, "2026-03-01T12:00:00"),
        ),
        requests=(
            RequestLine(5, "r" * 36, 1, h1, (("prefix", 1200), ("history", 300)), 10_000, 1500, ""),
            RequestLine(
                9, "r" * 36, 1, second_hash, (("prefix", 1200),), 0, 0, "fits:drop_knowledge"
            ),
        ),
        events=((7, "context.budget.pressure", "fits=True steps=drop_knowledge"),),
        runs=1,
    )


def test_render_shows_epochs_requests_bars_and_flags_a_changed_hash() -> None:
    console = Console(record=True, width=160, color_system=None)
    render(_view("a" * 64), console)
    text = console.export_text()
    assert "one prefix hash per epoch" in text
    assert "session_opened" in text and "1,500/10,000 (15%)" in text
    assert "context.budget.pressure" in text and "fits:drop_knowledge" in text

    console = Console(record=True, width=160, color_system=None)
    render(_view("b" * 64), console)
    assert "stability defect" in console.export_text()


@pytest.mark.parametrize("width", [80, 100, 120])
def test_at_a_terminals_width_every_column_shows_whole(width: int) -> None:
    """The bar is sized to what the console leaves (`inspect --width` sizes the console):
    it was 40 cells whatever the width, so at 80 columns (the width when piped) the seq,
    run and epoch columns were squeezed to nothing and the pressure steps cut (an audit).
    The legend names the classes some request has tokens in."""
    console = Console(record=True, width=width, color_system=None)
    render(_view("a" * 64), console)
    lines = console.export_text().splitlines()
    assert all(len(line) <= width for line in lines)
    rows = [line for line in lines if "rrrrrrrr" in line]
    assert [row[:30] for row in rows] == [f"│ {n}   │ rrrrrrrr │ 1     │ aaa" for n in (5, 9)]
    assert all("█" in row for row in rows)  # the bar on the row's first line, whole
    # What wraps, the figures and the pressure steps, wraps whole: each column's pieces,
    # read down the table, give them back.
    table = lines[lines.index(next(line for line in lines if line.startswith("│ 5"))) :]
    table = table[: next(n for n, line in enumerate(table) if line.startswith("└"))]
    columns = ["".join(line.split("│")[n].strip() for line in table) for n in (5, 6)]
    assert "1,500/10,000(15%)" in columns[0].replace(" ", "")
    assert columns[1] == "fits:drop_knowledge"
    legend = next(line for line in lines if line.startswith("classes:"))
    assert "prefix" in legend and "history" in legend


def test_no_width_crops_a_table() -> None:
    """From 30 columns to 130, with and without pressure steps and with no request at all,
    every line fits and every table keeps its right border: the columns before the bar
    keep their width only where the bar and the pressure header fit beside them (kept
    below that, they cropped the table at 40-62 columns, and at 40-83 with no request:
    a review)."""
    view = _view("a" * 64)
    quiet = replace(view, requests=tuple(replace(r, pressure="") for r in view.requests))
    empty = replace(view, requests=())
    for shown in (view, quiet, empty):
        for width in range(30, 131):
            console = Console(record=True, width=width, color_system=None, file=io.StringIO())
            render(shown, console)
            lines = console.export_text().splitlines()
            assert all(len(line) <= width for line in lines), width
            table = [line for line in lines if line[:1] in "┏┃┡│└"]
            assert all(line.rstrip()[-1] in "┓┃┩│┘" for line in table), (width, lines)
    console = Console(record=True, width=80, color_system=None, file=io.StringIO())
    render(empty, console)
    assert "Requests: none recorded" in console.export_text()


def test_every_class_a_record_names_has_a_colour_of_its_own() -> None:
    """The table named "runtime" and "user_input" where records say "runtime_metadata" and
    "user_message", and had no "corrections": those took fallback colours, which shift
    with the order classes first appear in."""
    from context_engine.core.caps import CLASS_CAPS
    from context_engine.core.pressure import BODY_CLASSES
    from context_engine.inspect import _COLOURS, _FALLBACK

    named = set(CLASS_CAPS) | {name for name, _ in BODY_CLASSES}
    assert named <= set(_COLOURS), sorted(named - set(_COLOURS))
    # Nor does a named class share a colour the unknown ones take.
    assert not {_COLOURS[n] for n in named} & set(_FALLBACK)
