"""providers/ is pure like the core: same scanner, same forbidden modules."""

from __future__ import annotations

from pathlib import Path

import pytest

import context_engine.providers

from .test_core_purity import FORBIDDEN_MODULES, _loaded_modules, _matching, _violations

PROVIDER_FILES = sorted(Path(context_engine.providers.__file__).resolve().parent.glob("*.py"))


def test_importing_the_providers_loads_no_transport_database_telemetry_or_event_loop() -> None:
    modules = _loaded_modules("import context_engine.providers")
    assert "context_engine.providers" in modules
    assert _matching(modules, FORBIDDEN_MODULES) == []


def test_provider_files_are_found() -> None:
    names = {p.name for p in PROVIDER_FILES}
    assert {"__init__.py", "anthropic.py", "openai.py", "usage.py"} <= names


@pytest.mark.parametrize("path", PROVIDER_FILES, ids=lambda p: p.name)
def test_provider_source_reads_no_clock_randomness_environment_or_files(path: Path) -> None:
    assert _violations(path.read_text(encoding="utf-8")) == []
