"""The test harness itself (tests/conftest.py): where integration tests get PostgreSQL.

`make test` is one of the two commands a fresh machine needs, so a run that finds no
TEST_DATABASE_URL and nothing listening at the default address starts an embedded
PostgreSQL (pgserver) for the session and stops it at the end; a TEST_DATABASE_URL that
is set but unreachable stops the run with one message instead of falling back.

Each test runs a tiny pytest of its own in a subprocess, whose conftest loads the real
harness with the default address moved to a closed port (nothing listens on port 1).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import pkgutil
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from hypothesis import settings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLOSED = "postgresql://postgres@127.0.0.1:1/postgres"

_CONFTEST = """
import tests.conftest as harness

harness.DEFAULT_DSN = {default!r}  # a fresh machine: no PostgreSQL at the default address
pytest_plugins = ["tests.conftest"]
"""

_INI = """[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = session
asyncio_default_test_loop_scope = session
"""

_TEST = """
import os
from pathlib import Path

import asyncpg

from tests.integration.helpers import create_database, drop_database


async def test_a_database(database_dsn):
    Path(os.environ["CE_HARNESS_OUT"]).write_text(os.environ["TEST_DATABASE_URL"])
    conn = await asyncpg.connect(database_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM schema_migrations") > 0
    finally:
        await conn.close()
    own = await create_database()  # the lifecycle tests' own databases, on the same server
    await drop_database(own)
"""


async def _inner_pytest(tmp_path: Path, default: str = CLOSED, **env: str) -> tuple[int, str]:
    (tmp_path / "conftest.py").write_text(_CONFTEST.format(default=default), encoding="utf-8")
    (tmp_path / "pytest.ini").write_text(_INI, encoding="utf-8")
    (tmp_path / "test_inner.py").write_text(_TEST, encoding="utf-8")
    base = {
        k: v
        for k, v in os.environ.items()
        if k != "TEST_DATABASE_URL" and not k.startswith("CONTEXT_ENGINE_")
    }
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "service")])
    base["CE_HARNESS_OUT"] = str(tmp_path / "url.txt")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "test_inner.py",
        cwd=tmp_path,
        env={**base, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    return int(proc.returncode or 0), out.decode("utf-8", "replace")


async def test_no_postgresql_and_no_test_database_url_starts_an_embedded_one(
    tmp_path: Path,
) -> None:
    """The README's `make test` on a machine without PostgreSQL: every integration test
    errored on the connect; now the session gets an embedded server, stopped at the end."""
    code, out = await _inner_pytest(tmp_path)
    assert code == 0, out
    used = (tmp_path / "url.txt").read_text(encoding="utf-8")
    assert used != CLOSED
    socket_dir = Path(unquote(urlsplit(used).netloc.rpartition("@")[2]))
    assert socket_dir.is_absolute(), used  # pgserver listens on a Unix socket only
    assert not list(socket_dir.glob(".s.PGSQL.*")), "the embedded server is still running"


async def test_a_server_that_refuses_the_default_role_is_passed_over_for_an_embedded_one(
    tmp_path: Path,
) -> None:
    """Something listens at the default address but will not take the tests (a stock
    pg_hba.conf asks for a password): the integration tests all errored on the connect;
    now the run says why, once, and uses an embedded server as on a machine without
    PostgreSQL. The listener here takes each connection and closes it at once."""

    async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    listener = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    refusing = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        code, out = await _inner_pytest(tmp_path, default=refusing)
    finally:
        listener.close()
        await listener.wait_closed()
    assert code == 0, out
    assert f"PostgreSQL at {refusing} refused the tests" in out, out
    used = (tmp_path / "url.txt").read_text(encoding="utf-8")
    assert urlsplit(used).port is None, used  # the embedded server's Unix socket


async def test_an_unreachable_test_database_url_stops_the_run_without_falling_back(
    tmp_path: Path,
) -> None:
    """Set explicitly, the address is what the developer meant: no silent substitute."""
    code, out = await _inner_pytest(tmp_path, TEST_DATABASE_URL=CLOSED)
    assert code != 0
    assert "TEST_DATABASE_URL is set but PostgreSQL does not answer there" in out, out
    assert not (tmp_path / "url.txt").exists(), "no test ran"


def test_hypothesis_runs_without_a_per_example_deadline() -> None:
    """Hypothesis' default deadline (200 ms an example) is a timing assertion: on a loaded
    host twelve property tests failed on time alone. The harness loads a profile without
    one, and every property test, with or without settings of its own, inherits it."""
    assert settings.default.deadline is None
    timed = []
    for folder in ("unit", "integration"):
        for module in pkgutil.iter_modules([str(ROOT / "tests" / folder)]):
            if not module.name.startswith("test_"):
                continue
            loaded = importlib.import_module(f"tests.{folder}.{module.name}")
            for name, test in vars(loaded).items():
                if not hasattr(test, "hypothesis"):
                    continue
                own = getattr(test, "_hypothesis_internal_use_settings", settings.default)
                if own.deadline is not None:
                    timed.append(f"{module.name}.{name}: {own.deadline}")
    assert not timed, timed
