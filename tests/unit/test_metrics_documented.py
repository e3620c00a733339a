"""docs/operations.md's metrics table lists exactly the instruments telemetry.METRICS
makes, each with its kind and unit (telemetry.py rule 3)."""

from __future__ import annotations

import re
from pathlib import Path

from context_engine.telemetry import METRICS

_DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
_ROW = re.compile(r"^\| `(context_engine\.[a-z_.]+)`[^|]*\| (\w+) \| ([^|]+) \|", re.MULTILINE)
# The table's kind for each METRICS kind: an observed gauge is a gauge to its reader.
_KIND = {"counter": "counter", "histogram": "histogram", "gauge": "gauge", "observed": "gauge"}


def test_the_metrics_table_lists_every_instrument_with_its_kind() -> None:
    documented = {name: kind for name, kind, _unit in _ROW.findall(_DOC.read_text())}
    assert documented == {name: _KIND[metric.kind] for name, metric in METRICS.items()}
