"""`make demo` (service/context_engine/demo.py) against the real server: it says the prefix
held only when every request carried one prefix hash, and a server that is not there is
one line, not a traceback."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from context_engine import demo

pytestmark = pytest.mark.integration


async def test_the_demo_holds_one_prefix_hash_through_midnight(
    grpc_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    hashes = await demo.run_demo(f"127.0.0.1:{grpc_server.port}")
    assert len(hashes) == 1
    assert demo.verdict(hashes) == 0
    out = capsys.readouterr().out
    shown = {line.split("prefix_sha256=")[1][:16] for line in out.splitlines() if "step" in line}
    assert shown == {next(iter(hashes))[:16]}, out
    assert "00:" in out and out.rstrip().endswith("the cache holds."), out


def test_a_prefix_that_moved_is_said_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.verdict({"a" * 64, "b" * 64}) == 1
    assert "2 prefix hashes" in capsys.readouterr().out


def test_no_server_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["demo", "--target", "127.0.0.1:1"])
    assert demo.main() == 2
    captured = capsys.readouterr()
    out = captured.err.strip()  # on stderr, as every failure line (an operator audit)
    assert captured.out == ""
    assert out.startswith("demo: UNAVAILABLE: ") and "\n" not in out, out
    assert out.endswith("(is `make run` serving 127.0.0.1:1?)"), out
