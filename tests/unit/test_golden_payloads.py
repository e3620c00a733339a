"""Golden provider payloads: committed neutral requests render to committed bytes.

A change to a renderer shows up here as a byte difference; regenerate with
``.venv/bin/python -m tests.golden.make_golden`` only when the change is intended, and
review the diff. Known departures from the neutral request are listed, with their
reasons, in tests/golden/deviations.json and checked to still hold.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from context_engine.core import canonical_bytes
from context_engine.providers import render
from tests.golden.loader import CASES, HERE, load_request


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_payload_is_byte_identical(case: str) -> None:
    rendered = render(load_request(case))
    expected = (HERE / f"{case}.payload.json").read_bytes()
    assert rendered.api == CASES[case]["api"]
    assert rendered.body == expected, f"{case}: the rendered payload changed"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_request_round_trips(case: str) -> None:
    """The committed input is a ModelRequest exactly: nothing is lost reading it back."""
    text = (HERE / f"{case}.request.json").read_bytes().rstrip(b"\n")
    assert canonical_bytes(load_request(case).canonical()) == text


def _at(value: Any, path: list[Any]) -> Any:
    for step in path:
        value = value[step]
    return value


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


DEVIATIONS = json.loads((HERE / "deviations.json").read_text())["deviations"]


@pytest.mark.parametrize("deviation", DEVIATIONS, ids=[d["what"] for d in DEVIATIONS])
def test_known_deviations_still_hold(deviation: dict[str, Any]) -> None:
    assert deviation["reason"], "every deviation states its reason"
    payload = json.loads((HERE / f"{deviation['case']}.payload.json").read_bytes())
    target = _at(payload, deviation["check"]["path"])
    if "equals" in deviation["check"]:
        assert target == deviation["check"]["equals"]
    if "absent_key" in deviation["check"]:
        assert deviation["check"]["absent_key"] not in _keys(target)
    if "starts_with" in deviation["check"]:
        assert target.startswith(deviation["check"]["starts_with"])
