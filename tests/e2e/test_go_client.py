"""The Go client (clients/go): stubs current, vetted, and the example worker runs.

The Go toolchain, protoc with its Go plugins and the Go libraries come from Debian's
packages (`make install` installs them as root); the module proxy is not needed. Without
them this test fails with the install command, it does not skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import filecmp
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

GO = Path(__file__).resolve().parents[2] / "clients" / "go"
DEBIAN_PACKAGES = (
    "golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev "
    "golang-google-genproto-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev"
)
TIMEOUT_S = 600  # bounds a hung toolchain; not a performance assertion


async def _run(*argv: str | Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    # A session of its own, so a timeout kills the whole group: the shell scripts' go vet,
    # go build and compiler children too, not only the script.
    process = await asyncio.create_subprocess_exec(
        *map(str, argv),
        cwd=GO,
        env=None if env is None else {**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):  # the group ended meanwhile
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise AssertionError(f"{argv} did not finish within {TIMEOUT_S}s") from None
    return int(process.returncode or 0), out.decode("utf-8", "replace")


def _require_toolchain() -> None:
    missing = [
        tool
        for tool in ("go", "gofmt", "protoc", "protoc-gen-go", "protoc-gen-go-grpc")
        if shutil.which(tool) is None
    ]
    if not Path("/usr/share/gocode/src/google.golang.org/grpc").is_dir():
        missing.append("/usr/share/gocode (Debian's Go libraries)")
    assert not missing, (
        f"the Go client check needs {', '.join(missing)}: run `make install` as root, or "
        f"apt-get install {DEBIAN_PACKAGES}"
    )


async def test_go_stubs_are_current(tmp_path: Path) -> None:
    _require_toolchain()
    code, out = await _run(GO / "generate.sh", tmp_path)
    assert code == 0, out
    fresh, committed = tmp_path / "contextenginev1", GO / "contextenginev1"
    cmp = filecmp.dircmp(fresh, committed)
    stale = cmp.left_only + cmp.right_only + cmp.diff_files
    assert not stale, f"Go stubs are stale; run `make proto`: {stale}"


async def test_go_example_vets_builds_and_runs(grpc_server: Any, tmp_path: Path) -> None:
    _require_toolchain()
    binary = tmp_path / "worker"
    code, out = await _run(GO / "check.sh", binary)
    assert code == 0, f"go vet / build failed:\n{out}"

    # Retries on, as the README runs it (grpc-go 1.33 ignores a retry policy without
    # GRPC_GO_RETRY=on): the example's service config is parsed, and Dial refuses a bad one.
    code, out = await _run(
        binary,
        "-target",
        f"127.0.0.1:{grpc_server.port}",
        "-tenant",
        "go",
        env={"GRPC_GO_RETRY": "on"},
    )
    assert code == 0, f"the example worker failed:\n{out}"
    assert "tool call web-fetch -> web.fetch" in out, out
    assert "reported usage for request " in out, out
    assert "rejected: ORPHANED_TOOL_ITEM at items[0].tool_result.call_id" in out, out
    assert "rotated once to epoch 2; rejected: EPOCH_CONFLICT, current_epoch 2" in out, out
    # A step's append that met a later write went after it (it failed the run, an audit).
    assert "a step after a write that landed first: appended at version 4 (built at 2)" in out
    assert out.rstrip().endswith("ok: one prefix hash, identical rebuilds"), out


# The body the compaction run leaves a request: one step fits, several do not.
BODY_TOKENS = 900


async def test_go_example_compacts_when_the_history_outgrows_the_body(
    grpc_server: Any, tmp_path: Path
) -> None:
    """A run whose steps outgrow a small request body is compacted by the example
    (PrepareCompaction, its summarizer, CommitCompaction) and goes on: it had stopped with
    "needs compaction" where the Python and TypeScript clients compact (an audit)."""
    _require_toolchain()
    binary = tmp_path / "worker"
    code, out = await _run(GO / "check.sh", binary)
    assert code == 0, out
    target = ("-target", f"127.0.0.1:{grpc_server.port}", "-tenant", "go-compaction")
    code, out = await _run(binary, *target)
    assert code == 0, out
    prefix = int(out.split(" tokens)")[0].rsplit("(", 1)[1])
    cap = str(prefix + 1024 + BODY_TOKENS)
    code, out = await _run(binary, *target, "-steps", "5", "-policy-cap", cap)
    assert code == 0, f"the example worker failed:\n{out}"
    assert "compacting through event" in out, out
    assert out.count("reported usage for request ") == 6, out  # and the late step's
    assert out.rstrip().endswith("ok: one prefix hash, identical rebuilds"), out
    # Without compaction the same run cannot go on: the cap is what makes it compact.
    assert "compacting" not in (await _run(binary, *target, "-steps", "5"))[1]


async def test_go_example_sends_no_token_over_plaintext_to_another_host(tmp_path: Path) -> None:
    """A bearer token over plaintext to a remote address could be read on the way: the
    example sent it (the Python and TypeScript clients refuse). It needs -tls or -ca-file;
    loopback, a sidecar's address, stays plaintext."""
    _require_toolchain()
    binary = tmp_path / "worker"
    code, out = await _run(GO / "check.sh", binary)
    assert code == 0, out
    code, out = await _run(binary, "-target", "10.0.0.5:50051", "-token", "t", "-timeout", "1s")
    assert code != 0
    assert "a -token is not sent over plaintext to 10.0.0.5:50051: use -tls or -ca-file" in out


async def test_go_example_takes_the_loopback_targets_the_other_clients_take(
    tmp_path: Path,
) -> None:
    """The example read host:port only and refused a token to the Unix socket, dns:/// and
    ipv4: targets the Python and TypeScript clients take as loopback (a review). It
    applies their rule: the table the Python client and `context-engine explain` share."""
    from context_engine_client.client import is_loopback

    _require_toolchain()
    binary = tmp_path / "worker"
    code, out = await _run(GO / "check.sh", binary)
    assert code == 0, out
    targets = [
        "127.0.0.1:1", "127.8.9.10:1", "localhost:1", "LOCALHOST:1", "[::1]:1",
        "ipv4:127.0.0.1:1,127.0.0.2:1", "ipv4:127.0.0.1:1,10.0.0.1:1", "ipv6:[::1]:1",
        "dns:///localhost:1", "unix:/nonexistent/ce.sock", "unix-abstract:ce-none",
        "10.0.0.1:1", "engine:1", "[2001:db8::1]:1", "dns:///engine.example:443",
    ]  # fmt: skip
    refused = []
    for target in targets:
        _, out = await _run(binary, "-target", target, "-token", "t", "-timeout", "1s")
        if "is not sent over plaintext" in out:
            refused.append(target)
    assert refused == [t for t in targets if not is_loopback(t)]
    assert len(refused) == 5
