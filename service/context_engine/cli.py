"""`context-engine serve | migrate | inspect | explain | fake-provider`.

Exit codes: 0 done; 1 the database cannot be reached or refuses the connection (one line
naming the server, the database and why), a listen address that cannot be bound, a
schema behind with migrate_on_start off, or inspect's session not found or its read
refused (no schema, no privilege; one line); 2 a
configuration error (one line naming the setting), including no database configured
where the embedded PostgreSQL is not installed."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Settings

# The settings module (pydantic) is imported in main(), once the signals that end a start
# are held (_HELD): imported here, a Ctrl-C in its import was a traceback (an audit).

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    from .api.server import StartupError, serve
    from .config import ConfigError, load_settings, unknown_variables
    from .telemetry import (
        configure_logging,
        otel_environment_problem,
        sampler_from,
        traces_exported,
    )

    settings = load_settings(
        {"listen": args.listen, "database_url": args.database_url, "data_dir": args.data_dir}
    )
    try:  # a configuration error too, found before the database is touched (exit 2)
        if traces_exported(os.environ):  # else the sampler variables are not read
            sampler_from(os.environ)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if problem := otel_environment_problem(os.environ, metrics_listen=settings.metrics_listen):
        raise ConfigError(problem)
    configure_logging(settings.log_level, settings.log_format)
    for name in unknown_variables():
        logging.getLogger("context_engine.server").warning(
            "%s names no setting and is ignored (docs/operations.md, Configuration)", name
        )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    # Until serve's own handlers are in (after the database, the migrations and the port),
    # SIGTERM ends the process by an exception, so the embedded database's exit hooks run:
    # killed outright, it left that PostgreSQL running for good (an audit).
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        # Held since main() began: one that came meanwhile is taken here, on the clean path.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
        asyncio.run(serve(settings))
    except StartupError as exc:
        logging.getLogger("context_engine.server").error("cannot start: %s", exc)
        print(f"context-engine: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before serve's handlers were in: no traceback
        print("context-engine: interrupted while starting", file=sys.stderr)
        return 130
    except _Terminated as exc:
        print("context-engine: terminated while starting", file=sys.stderr)
        return int(exc.code or 0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


class _Terminated(SystemExit):
    """SIGTERM while starting (a SystemExit: what catches Exception lets it through)."""


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM while starting: exit as the signal's conventional status, 128 + 15. While
    the embedded database starts it is held back until that is done (embedded_db.py)."""
    raise _Terminated(128 + signum)


def _session_id(text: str) -> str:
    """A session id argument: a UUID, named before anything starts (usage, exit 2)."""
    try:
        uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a session id (a UUID)") from None
    return text


def _width(text: str) -> int:
    """A terminal width: 0 is auto (the default), a negative one is refused."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a width (0: auto)")
    return value


def _inspect(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .config import load_settings
    from .inspect import run_inspect
    from .store import StoreUnavailableError
    from .store.db import StoreReadError

    settings = load_settings({"database_url": args.database_url, "data_dir": args.data_dir})
    console = Console(width=args.width) if args.width else Console()
    try:
        dsn, _server = _database(settings, create=False)
        asyncio.run(run_inspect(dsn, args.session, args.tenant, console))
    except (LookupError, ValueError, StoreUnavailableError, StoreReadError) as exc:
        print(f"context-engine inspect: {exc}", file=sys.stderr)
        return 1
    return 0


def _migrate(args: argparse.Namespace) -> int:
    import asyncpg

    from .config import load_settings
    from .store import StoreUnavailableError, apply_migrations, connect_pool
    from .store.migrate import MigrationError

    settings = load_settings({"database_url": args.database_url, "data_dir": args.data_dir})

    async def run() -> list[str]:
        dsn, _server = _database(settings)
        pool = await connect_pool(dsn, min_size=1, max_size=1)
        try:
            async with pool.acquire() as conn:
                return await apply_migrations(conn)
        finally:
            await pool.close()

    try:
        applied = asyncio.run(run())
    except (StoreUnavailableError, MigrationError) as exc:
        print(f"context-engine migrate: {exc}", file=sys.stderr)
        return 1
    except (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError) as exc:
        # The connection was lost mid-way: what was applied before stays, the rest is not.
        print(f"context-engine migrate: the database connection was lost ({exc})", file=sys.stderr)
        return 1
    print("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))
    return 0


def _database(settings: Settings, *, create: bool = True) -> tuple[str, Any]:
    """The configured database, or the embedded one in `data_dir`, as `serve` would use
    (started, or shared with a server already running there: it stops when the last
    process using it exits). Returns (dsn, handle); keep the handle while connected.
    `create` False: an embedded database must exist already (a reader that forgot its URL
    is told so, not shown an empty database made on the spot)."""
    from .config import ConfigError

    if settings.database_url:
        return settings.database_url, None
    if not create and not Path(settings.data_dir, "PG_VERSION").exists():
        raise ConfigError(
            "no database configured (--database-url or DATABASE_URL) and no embedded"
            f" database in {settings.data_dir} (--data-dir; `serve` makes one)"
        )
    from .embedded_db import start_embedded

    return start_embedded(settings.data_dir)


def _fake_provider(args: argparse.Namespace) -> int:
    try:
        from .fake_provider.__main__ import main as fake_main
    except ModuleNotFoundError as exc:  # jsonschema: a test tool's dependency, in [dev]
        print(
            f"context-engine fake-provider: {exc.name} is not installed; the fake provider"
            " needs the dev extra: pip install 'context-engine[dev]'",
            file=sys.stderr,
        )
        return 2

    return int(fake_main(["--listen", args.listen]) or 0)


# What ends `serve` while it starts, held until its handlers are in: a Ctrl-C during the
# first second's imports printed a traceback, and once was swallowed by the import machinery
# and the server came up anyway; SIGTERM then killed it outright (an audit). Released for
# the other commands at once, and before anything is spawned, which would inherit the mask.
_HELD = {signal.SIGINT, signal.SIGTERM}


def main(argv: list[str] | None = None) -> int:
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        return _main(argv, held)
    except KeyboardInterrupt:  # a Ctrl-C held until the mask was restored
        print("context-engine: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _main(argv: list[str] | None, held: set[int | signal.Signals]) -> int:
    from .config import ConfigError

    parser = argparse.ArgumentParser(prog="context-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gRPC server")
    serve.add_argument("--listen", default=None, help="HOST:PORT (default 127.0.0.1:50051)")
    serve.add_argument("--database-url", default=None, help="PostgreSQL DSN (or DATABASE_URL)")
    serve.add_argument("--data-dir", default=None, help="embedded database directory")
    serve.set_defaults(func=_serve)

    migrate = sub.add_parser("migrate", help="apply database migrations")
    migrate.add_argument("--database-url", default=None, help="PostgreSQL DSN (or DATABASE_URL)")
    migrate.add_argument(
        "--data-dir", default=None, help="embedded database directory (without a DSN)"
    )
    migrate.set_defaults(func=_migrate)

    inspect = sub.add_parser(
        "inspect", help="print a session's epochs, prefix hashes and per-request budget bars"
    )
    inspect.add_argument("session", type=_session_id, help="session id (UUID)")
    inspect.add_argument("--tenant", default=None, help="tenant (needed if the id is shared)")
    inspect.add_argument("--database-url", default=None, help="PostgreSQL DSN (or DATABASE_URL)")
    inspect.add_argument(
        "--data-dir", default=None, help="embedded database directory (without a DSN)"
    )
    inspect.add_argument("--width", type=_width, default=0, help="terminal width (default 0: auto)")
    inspect.set_defaults(func=_inspect)

    from .explain import add_arguments as explain_arguments
    from .explain import check_arguments as explain_check
    from .explain import run as explain_run

    explain = sub.add_parser(
        "explain", help="name the first byte two builds differ in, its row, item and region"
    )
    explain_arguments(explain)
    explain.set_defaults(func=explain_run)

    fake = sub.add_parser("fake-provider", help="run the caching fake model provider")
    fake.add_argument("--listen", default="127.0.0.1:8089")
    fake.set_defaults(func=_fake_provider)

    args = parser.parse_args(argv)
    if args.command != "serve":
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if args.command == "explain":
        explain_check(explain, args)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"context-engine: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
