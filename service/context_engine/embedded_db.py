"""The embedded default database: a PostgreSQL that ships as a Python package (pgserver),
started in a data directory when no database URL is configured. For a newcomer's first
run and local use; production points DATABASE_URL at a real server."""

from __future__ import annotations

import logging
import subprocess
import warnings
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
        server = pgserver.get_server(str(path), cleanup_mode="stop")
    except (OSError, subprocess.SubprocessError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise StoreUnavailableError(
            f"cannot start the embedded PostgreSQL in {path}: {why}"
        ) from None
    return server.get_uri(), server
