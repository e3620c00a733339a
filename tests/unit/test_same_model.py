"""ReportUsage's model check (api/usage.py same_model): the provider's response.model
counts as the planned model when it names a dated snapshot of it, and only then."""

from __future__ import annotations

import pytest

from context_engine.api.usage import same_model


@pytest.mark.parametrize(
    ("reported", "planned"),
    [
        ("gpt-4o", "gpt-4o"),
        ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
        ("gpt-4o-2024-08-06", "gpt-4o"),
        # OpenAI's month-and-day snapshots (an audit: these models never learned a factor).
        ("gpt-4-0613", "gpt-4"),
        ("gpt-3.5-turbo-0125", "gpt-3.5-turbo"),
    ],
)
def test_a_dated_snapshot_is_the_planned_model(reported: str, planned: str) -> None:
    assert same_model(reported, planned)


@pytest.mark.parametrize(
    ("reported", "planned"),
    [
        ("gpt-4o-mini", "gpt-4o"),  # another model
        ("gpt-4-32k-0613", "gpt-4"),  # another model's snapshot
        ("gpt-4-1106-preview", "gpt-4"),
        ("gpt-4-1399", "gpt-4"),  # not a month and day
        ("gpt-4-0632", "gpt-4"),
        ("gpt-4o-v2", "gpt-4o"),
        ("gpt-4", "gpt-4o"),
    ],
)
def test_anything_else_is_another_model(reported: str, planned: str) -> None:
    assert not same_model(reported, planned)
