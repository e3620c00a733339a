"""The core does no I/O: importing it loads no transport, database, telemetry or event
loop, and its source reads no clock, randomness, environment or files.
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

import context_engine.core

CORE = Path(context_engine.core.__file__).resolve().parent
CORE_FILES = sorted(CORE.glob("*.py"))

# Never loaded, by the core or by anything it imports.
FORBIDDEN_MODULES = (
    "grpc",
    "asyncpg",
    "opentelemetry",
    "asyncio",
    "context_engine._gen",
    "context_engine.store",
    "context_engine.api",
)
# I/O modules the core must not load itself. pydantic's plugin loader imports
# importlib.metadata -> email.utils -> socket, so these are judged against a baseline
# process that imports only the core's third-party dependencies.
IO_MODULES = (
    "socket",
    "ssl",
    "selectors",
    "select",
    "subprocess",
    "http.client",
    "urllib.request",
    "sqlite3",
)


def _loaded_modules(code: str) -> set[str]:
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.splitlines()[-1]))


def _matching(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


@pytest.fixture(scope="module")
def core_modules() -> set[str]:
    return _loaded_modules("import context_engine.core")


@pytest.fixture(scope="module")
def dependency_modules() -> set[str]:
    return _loaded_modules(
        "import hashlib, hmac, json, re, dataclasses, datetime, enum, typing\n"
        "import rfc8785, pydantic\n"
        "class _Probe(pydantic.BaseModel):\n"
        "    x: int = 0\n"
    )


def test_importing_the_core_loads_no_transport_database_telemetry_or_event_loop(
    core_modules: set[str],
) -> None:
    assert "context_engine.core" in core_modules  # the probe did import it
    assert _matching(core_modules, FORBIDDEN_MODULES) == []


@pytest.mark.parametrize("module", IO_MODULES)
def test_the_core_itself_loads_no_io_module(
    module: str, core_modules: set[str], dependency_modules: set[str]
) -> None:
    if module in core_modules:
        assert module in dependency_modules, f"context_engine.core loads {module}"


# --- static checks -----------------------------------------------------------------------

# Banned in code (comments and strings excluded: "no randomness" in a docstring is fine).
BANNED_CODE = {
    "open(": re.compile(r"\bopen\s*\("),
    "datetime.now": re.compile(r"\bdatetime\s*\.\s*(?:now|utcnow|today)\b"),
    "date.today": re.compile(r"\bdate\s*\.\s*today\b"),
    "time.time": re.compile(r"\btime\s*\.\s*(?:time|time_ns|monotonic|perf_counter)\b"),
    "random": re.compile(r"\brandom\b"),
    "os.environ": re.compile(r"\bos\s*\.\s*(?:environ|getenv)\b|\bgetenv\b"),
    "uuid4": re.compile(r"\buuid[14]\b"),
}
BANNED_IMPORTS = (
    *FORBIDDEN_MODULES,
    *IO_MODULES,
    "time",
    "random",
    "secrets",
    "uuid",
    "os",
    "io",
    "pathlib",
    "shutil",
    "tempfile",
    "urllib",
    "http",
    "threading",
    "multiprocessing",
    "concurrent",
)


# A lock is neither I/O nor a clock: the render memos are shared with the worker threads
# Plan and compaction run in, and core/memo_budget.py serializes their stores with one.
# That name only, in that file only; nothing else of threading (no thread is started).
LOCK_IMPORT = ("memo_budget.py", "threading", ("RLock",))


def _code_only(source: str) -> str:
    """The source with comments and string literals (docstrings included) removed."""
    kept = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            continue
        kept.append(token.string)
    return " ".join(kept)


def _is_the_lock(node: ast.ImportFrom, filename: str) -> bool:
    return (filename, node.module, tuple(a.name for a in node.names)) == LOCK_IMPORT


def _violations(source: str, filename: str = "") -> list[str]:
    code = _code_only(source)
    found = [name for name, pattern in BANNED_CODE.items() if pattern.search(code)]
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if _is_the_lock(node, filename):
                continue
            names = [node.module or ""] if node.level == 0 else []
            if node.level >= 2:
                parts = [node.module] if node.module else [a.name for a in node.names]
                found += [
                    f"relative import of ..{p}"
                    for p in parts
                    if p.split(".")[0] in ("_gen", "store", "api")
                ]
        elif isinstance(node, ast.AsyncFunctionDef | ast.Await | ast.AsyncFor | ast.AsyncWith):
            found.append("async")
            continue
        else:
            continue
        found += [f"import {n}" for n in names if _matching({n}, BANNED_IMPORTS)]
    return found


def test_the_scanner_sees_code_but_not_prose() -> None:
    prose = '"""No randomness, no open( calls, no datetime.now."""\n# uuid4 would be wrong\nx = 1\n'
    assert _violations(prose) == []
    assert _violations("import random\n") == ["random", "import random"]
    assert _violations("f = open('x')\n") == ["open("]
    assert _violations("from datetime import datetime\nt = datetime.now()\n") == ["datetime.now"]
    assert _violations("import time\nt = time.time()\n") == ["time.time", "import time"]
    assert _violations("import os\nk = os.environ['K']\n") == ["os.environ", "import os"]
    assert _violations("import uuid\ni = uuid.uuid4()\n") == ["uuid4", "import uuid"]
    assert _violations("import asyncio\n") == ["import asyncio"]
    assert _violations("from ..store import db\n") == ["relative import of ..store"]
    assert _violations("from .. import api\n") == ["relative import of ..api"]
    assert _violations("async def f():\n    pass\n") == ["async"]
    lock = "from threading import RLock\n"
    assert _violations(lock, "memo_budget.py") == []
    assert _violations(lock, "assemble.py") == ["import threading"]
    assert _violations("from threading import RLock, Thread\n", "memo_budget.py") == [
        "import threading"
    ]
    assert _violations("import threading\n", "memo_budget.py") == ["import threading"]


def test_core_files_are_found() -> None:
    names = {p.name for p in CORE_FILES}
    assert {"__init__.py", "assemble.py", "envelope.py", "plan.py", "seeding.py"} <= names


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_source_reads_no_clock_randomness_environment_or_files(path: Path) -> None:
    assert _violations(path.read_text(encoding="utf-8"), path.name) == []
