"""The TypeScript client (clients/typescript) drives a short session against the real server.

Runs `node --test clients/typescript/test/` with the in-process server's address in
CONTEXT_ENGINE_TARGET (sessions through the client, answers lost on the way back and
resent by the channel, and a consumer project type-checked under NodeNext), then the
example worker (examples/worker.ts) end to end, its model calls going to the caching fake
provider (Anthropic Messages API) on loopback: one turn, and one on a request body small
enough that the tool loop compacts with the example's summarizer.

The package is built first (`npm run build`: proto-loader-gen-types from the committed
proto copy, then tsc), so a stale build can never pass; when node_modules is missing it is
installed with `npm ci` (normally `make install` did that). Node.js and npm are required:
without them this test fails, it does not skip.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from context_engine.fake_provider import FakeProvider

pytestmark = pytest.mark.integration

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "typescript"
# Generous bounds so a hung process fails the test instead of hanging the suite.
INSTALL_TIMEOUT_S = 600
RUN_TIMEOUT_S = 300
# The body the compaction test leaves a request: one step of the tool loop fits, a few do not.
BODY_TOKENS = 900


async def _run(*argv: str, env: dict[str, str] | None = None, timeout: float) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=PACKAGE,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"{' '.join(argv)} did not finish within {timeout}s") from None
    return int(process.returncode or 0), out.decode("utf-8", "replace")


def _require(tool: str) -> str:
    path = shutil.which(tool)
    assert path, (
        f"{tool} is not installed: the TypeScript client test needs Node.js >= 18 and npm "
        "(Debian: apt-get install nodejs npm)"
    )
    return path


@pytest.fixture(scope="module")
async def node() -> str:
    """Node.js, with the package installed (if needed) and freshly built."""
    node, npm = _require("node"), _require("npm")
    if not (PACKAGE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        code, out = await _run(npm, "ci", "--no-audit", "--no-fund", timeout=INSTALL_TIMEOUT_S)
        assert code == 0, f"npm ci failed in {PACKAGE}:\n{out}"
    code, out = await _run(npm, "run", "build", timeout=RUN_TIMEOUT_S)
    assert code == 0, f"npm run build failed:\n{out}"
    return node


async def test_node_client_drives_a_session(grpc_server: Any, node: str) -> None:
    code, out = await _run(
        node,
        "--test",
        "test/",
        env={"CONTEXT_ENGINE_TARGET": f"127.0.0.1:{grpc_server.port}"},
        timeout=RUN_TIMEOUT_S,
    )
    assert code == 0, f"node --test failed:\n{out}"
    assert "# fail 0" in out and "# cancelled 0" in out, out
    passed = [line for line in out.splitlines() if line.startswith("# pass ")]
    assert passed and int(passed[0].split()[-1]) >= 3, out


async def test_example_worker_runs_a_tool_loop(grpc_server: Any, node: str) -> None:
    """examples/worker.ts: Build -> POST provider_payload -> tool -> append -> answer."""
    with FakeProvider() as fake:
        fake.script.push_tool_call("web.fetch", {"url": "https://trains.example"})
        fake.script.push_text("Take the 08:04 TGV.")
        code, out = await _run(
            node,
            "dist/examples/worker.js",
            "Trains from Paris to Lyon tomorrow?",
            env={
                "CONTEXT_ENGINE_TARGET": f"127.0.0.1:{grpc_server.port}",
                "CONTEXT_ENGINE_TENANT": "node-example",
                "ANTHROPIC_BASE_URL": fake.base_url,
                "ANTHROPIC_API_KEY": "test",
            },
            timeout=RUN_TIMEOUT_S,
        )
        sent = [r for r in fake.requests if r.status == 200]
    assert code == 0, out
    assert 'tool web.fetch {"url":"https://trains.example"}' in out, out
    assert "answer: Take the 08:04 TGV." in out, out
    assert "distinct prefix hashes: 1" in out, out
    assert len(sent) == 2, "one provider call per step: the tool call, then the answer"


async def test_example_worker_compacts_when_the_history_outgrows_the_body(
    grpc_server: Any, node: str
) -> None:
    """The example's summarizer: a run whose own steps outgrow a small request body is
    compacted by the tool loop (PrepareCompaction, the example's model call, then
    CommitCompaction) and goes on to an answer. The example had no summarizer, so such a
    run failed with NeedsCompactionError (an audit)."""
    env = {
        "CONTEXT_ENGINE_TARGET": f"127.0.0.1:{grpc_server.port}",
        "CONTEXT_ENGINE_TENANT": "node-example",
        "ANTHROPIC_API_KEY": "test",
    }
    with FakeProvider() as fake:
        fake.script.push_text("Take the 08:04 TGV.")
        code, out = await _run(
            node,
            "dist/examples/worker.js",
            "Trains?",
            env={**env, "ANTHROPIC_BASE_URL": fake.base_url},
            timeout=RUN_TIMEOUT_S,
        )
    assert code == 0, out
    prefix = int(out.split(", prefix ")[1].split(" tokens")[0])
    with FakeProvider() as fake:
        # Every reply both says something and calls the tool, so whichever of them the
        # summarizer's call takes is a summary, and the loop goes on until the last.
        for n in range(6):
            fake.script.push(
                {
                    "text": f"Checking timetable page {n}.",
                    "tool_calls": [{"name": "web.fetch", "arguments": {"url": f"https://t/{n}"}}],
                }
            )
        fake.script.push_text("Take the 08:04 TGV.")
        code, out = await _run(
            node,
            "dist/examples/worker.js",
            "Trains from Paris to Lyon tomorrow?",
            env={
                **env,
                "ANTHROPIC_BASE_URL": fake.base_url,
                "POLICY_CAP_TOKENS": str(prefix + 1024 + BODY_TOKENS),
            },
            timeout=RUN_TIMEOUT_S,
        )
        summarized = [r for r in fake.requests if r.status == 200 and "tools" not in r.request]
    assert code == 0, out
    assert "compacting through event" in out, out
    assert "answer: " in out, out
    assert len(summarized) >= 1, "the summary came from a model call of the example's"
