"""The embedded default database: a PostgreSQL that ships as a Python package (pgserver),
started in a data directory when no database URL is configured. For a newcomer's first
run and local use; production points DATABASE_URL at a real server."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .config import ConfigError
from .store.db import StoreUnavailableError

__all__ = ["start_embedded"]


def start_embedded(data_dir: str) -> tuple[str, Any]:
    """Start (or reuse) the embedded server; returns (dsn, handle). Keep the handle alive.

    Raises ConfigError when pgserver is not installed (the container image): no database
    is configured, a configuration error. Raises StoreUnavailableError when it is installed
    but cannot start in `data_dir`."""
    try:
        # platformdirs (through pgserver) warns at import, in two lines, when
        # XDG_RUNTIME_DIR is unset (root, CI, containers): noise before the one line a
        # failure prints, about nothing this server uses.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError:
        raise ConfigError(
            "no database configured (database_url, CONTEXT_ENGINE_DATABASE_URL or"
            " DATABASE_URL) and the embedded PostgreSQL is not installed"
            " (pip install 'context-engine[embedded]')"
        ) from None
    # pgserver logs its own steps (and initdb's whole output) at INFO: a dozen lines before
    # the service's first, on every start. Its warnings and errors still show.
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    path = Path(data_dir).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with _sigterm_deferred():
            _forget_exited_users(pgserver, path)
            server = pgserver.get_server(str(path), cleanup_mode="stop")
    except (OSError, subprocess.SubprocessError) as exc:
        raise StoreUnavailableError(
            f"cannot start the embedded PostgreSQL in {path}: {_reason(exc)}"
        ) from None
    return server.get_uri(), server


@contextlib.contextmanager
def _sigterm_deferred() -> Iterator[None]:
    """Hold SIGTERM back while pgserver creates or starts the server, then act on it. Taken
    at once, the exception it raises (cli.py) killed initdb half way, and every later start
    found a data directory it could not use (a review); the list of the server's users,
    half written, broke every later start too. Off the main thread (no handler can be set
    there) nothing is held back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    if held:  # as it would have been taken: the handler, or the default action
        if callable(previous):
            previous(signal.SIGTERM, None)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)


def _forget_exited_users(pgserver: Any, path: Path) -> None:
    """Take the processes that have exited off pgserver's list of the server's users
    (`.handle_pids.json`, under its own lock), before this one joins it. pgserver stops the
    server when the last listed process exits; one killed (SIGKILL, the OOM killer, a
    SIGTERM before the service's handlers were in) never took itself off, so the server
    was never stopped again, by any later clean exit either (an audit)."""
    import psutil  # type: ignore[import-untyped]  # pgserver's own dependency; no stubs

    listed = path / ".handle_pids.json"
    with pgserver.PostgresServer._lock:
        try:
            text = listed.read_text(encoding="utf-8")
        except FileNotFoundError:
            return  # none yet: pgserver makes it
        try:
            pids = json.loads(text)
        except ValueError:
            pids = None
        if not isinstance(pids, list):
            pids = []  # cut short (a write interrupted): pgserver failed on it at every start
        running = [p for p in pids if isinstance(p, int) and psutil.pid_exists(p)]
        if json.dumps(running) != text:
            # Whole or not at all: a write cut short is what broke every later start.
            partial = listed.with_name(listed.name + ".tmp")
            partial.write_text(json.dumps(running), encoding="utf-8")
            os.replace(partial, listed)


def _reason(exc: OSError | subprocess.SubprocessError) -> str:
    """Why the server did not start, in a line: the OS's words, or which command failed
    (initdb, pg_ctl) and where its own words are: pgserver logs a failed command's output
    and raises without it (an audit: "CalledProcessError" alone named nothing)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, subprocess.CalledProcessError):
        command = exc.cmd[0] if isinstance(exc.cmd, list | tuple) and exc.cmd else exc.cmd
        return (
            f"{Path(str(command)).name} exited with status {exc.returncode} (its output is in"
            " the pgserver error logged above)"
        )
    return type(exc).__name__
