"""The embedded default database: a PostgreSQL that ships as a Python package (pgserver),
started in a data directory when no database URL is configured. For a newcomer's first
run and local use; production points DATABASE_URL at a real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["start_embedded"]


def start_embedded(data_dir: str) -> tuple[str, Any]:
    """Start (or reuse) the embedded server; returns (dsn, handle). Keep the handle alive."""
    try:
        import pgserver
    except ImportError as exc:  # pragma: no cover - depends on the install extra
        raise RuntimeError(
            "no database configured and the embedded PostgreSQL is not installed; "
            "set DATABASE_URL or install context-engine[embedded]"
        ) from exc
    path = Path(data_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(str(path), cleanup_mode="stop")
    return server.get_uri(), server
