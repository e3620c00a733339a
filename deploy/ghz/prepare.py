"""Prepare a server for the ghz configs in this directory, and write runnable copies.

    .venv/bin/python deploy/ghz/prepare.py --target 127.0.0.1:50051 [--token TOKEN]
    ghz --config deploy/ghz/run/build.json
    ghz --config deploy/ghz/run/append_items.json

Build and AppendItems act on existing sessions and runs, so every request number ghz will
send (0..total) gets its own session and run first: for Build, a run with a representative
history (--history tool call/result pairs); for AppendItems, a fresh run at checkpoint
version 1, because AppendItems is optimistic and each request carries the version it
expects. Each invocation draws a fresh id prefix, so a second load run writes to new runs
instead of replaying idempotency keys, and writes the configs with those ids to --out.
Run from the repository root (the configs name proto/ relative to it). With bearer auth on,
--token (or CONTEXT_ENGINE_TOKEN) is sent on every call; its tenant must be the configs'
`ghz`. The token is never written to the configs: ghz takes it with --metadata.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python" / "src"))

from context_engine_client import (  # noqa: E402
    ContextEngineClient,
    Session,
    pb,
    tool,
    tool_call,
    tool_result,
)

CONFIGS = ("build.json", "append_items.json")
PLACEHOLDER = "5e55a000"
TEMPLATE = re.compile(r"\{\{printf `%012d` \.RequestNumber\}\}")
SCHEMA = {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}
PAGE = "Paris Gare de Lyon -> Lyon Part-Dieu: " + ", ".join(
    f"{h:02d}:04 TGV {6601 + 2 * h}" for h in range(6, 20)
)


def spec() -> pb.PlanSpec:
    """A representative plan: an agent, a principal, a few tools, a time zone."""
    return pb.PlanSpec(
        model_id="claude-sonnet-4-5",
        agent=pb.AgentSpec(
            agent_id="trips",
            version="1",
            instructions="You help people plan train trips. Be brief and cite timetables.",
        ),
        principal=pb.Principal(principal_id="ghz", scopes=["web.read"], scope_label="owner"),
        tools=[
            tool(name, f"The {name} tool.", SCHEMA, required_scopes=["web.read"])
            for name in ("web.fetch", "web.search", "calendar.list", "maps.route")
        ],
        environment=pb.SessionEnvironment(surface="chat", time_zone="Europe/Paris"),
    )


def render(value: str, number: int) -> str:
    """What ghz renders for request `number` (only the templates the configs use)."""
    value = TEMPLATE.sub(f"{number:012d}", value)
    return value.replace("{{.RequestNumber}}", str(number))


def with_prefix(config: dict[str, Any], prefix: str) -> dict[str, Any]:
    return json.loads(json.dumps(config).replace(PLACEHOLDER, prefix))


async def _prepare_one(
    client: ContextEngineClient, data: dict[str, Any], number: int, history: int
) -> None:
    session: Session = await client.open_session(
        spec(), session_id=render(data["session_id"], number)
    )
    run = await session.start_run(
        "Trains from Paris to Lyon tomorrow, with a bicycle?",
        run_id=render(data["run_id"], number),
        idempotency_key=f"ghz-start-{render(data['run_id'], number)}",
    )
    for step in range(history if "expected_checkpoint_version" not in data else 0):
        await run.append(
            tool_call(f"h{step}", "web.fetch", {"url": f"https://trains.example/{step}"}),
            tool_result(f"h{step}", "web.fetch", PAGE),
        )


async def _bounded(limit: asyncio.Semaphore, work: Any) -> None:
    async with limit:
        await work


async def prepare(
    target: str,
    out: Path,
    *,
    total: int | None = None,
    history: int = 6,
    concurrency: int = 16,
    token: str | None = None,
) -> dict[str, Path]:
    """Create the sessions and runs; write runnable configs to `out`; return their paths.
    `token`: a bearer token for a server with auth on (None: no credentials)."""
    out.mkdir(parents=True, exist_ok=True)
    prefix = secrets.token_hex(4)
    written: dict[str, Path] = {}
    limit = asyncio.Semaphore(concurrency)
    for name in CONFIGS:
        config = with_prefix(json.loads((HERE / name).read_text(encoding="utf-8")), prefix)
        config["host"] = target
        if total is not None:
            config["total"] = total
        data = config["data"]
        async with ContextEngineClient(target, data["tenant_id"], token) as client:
            await asyncio.gather(
                *(
                    _bounded(limit, _prepare_one(client, data, n, history))
                    for n in range(config["total"] + 1)
                )
            )
        path = out / name
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        written[name] = path
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--out", type=Path, default=HERE / "run")
    parser.add_argument("--total", type=int, default=None, help="override the configs' total")
    parser.add_argument("--history", type=int, default=6, help="tool pairs per Build run")
    parser.add_argument(
        "--token",
        # Unset or empty: no token (an empty one is no header value, and was refused).
        default=os.environ.get("CONTEXT_ENGINE_TOKEN") or None,
        help="bearer token of tenant ghz, when auth is on (default: $CONTEXT_ENGINE_TOKEN)",
    )
    args = parser.parse_args()
    written = asyncio.run(
        prepare(args.target, args.out, total=args.total, history=args.history, token=args.token)
    )
    for path in written.values():
        shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
        print(f"ghz --config {shown}")


if __name__ == "__main__":
    main()
