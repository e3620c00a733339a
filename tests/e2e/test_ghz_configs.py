"""The ghz configs in deploy/ghz are valid and their calls succeed against the real server.

ghz itself cannot be installed here (it is a Go binary outside the reachable registries),
so this test does what it would: deploy/ghz/prepare.py creates the sessions and runs and
writes runnable configs; then, for a few request numbers, each config's data is rendered
(the templates it uses), parsed with protojson into the call's request type (as ghz does;
an unknown field or enum name fails here) and sent to the method the config names.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb

pytestmark = pytest.mark.integration

GHZ = Path(__file__).resolve().parents[2] / "deploy" / "ghz"
TOTAL = 3


def _prepare_module() -> Any:
    spec = importlib.util.spec_from_file_location("ghz_prepare", GHZ / "prepare.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["ghz_prepare"] = module
    spec.loader.exec_module(module)
    return module


def _render(prepare: Any, value: Any, number: int) -> Any:
    if isinstance(value, str):
        return prepare.render(value, number)
    if isinstance(value, list):
        return [_render(prepare, v, number) for v in value]
    if isinstance(value, dict):
        return {k: _render(prepare, v, number) for k, v in value.items()}
    return value


async def test_ghz_prepare_runs_as_its_readme_says_without_a_token(
    grpc_server: Any, tmp_path: Path
) -> None:
    """deploy/ghz/README.md's first step, the script itself: with CONTEXT_ENGINE_TOKEN unset
    or empty it sends no token. Its default was "", which the client refuses as no header
    value, so the documented command failed every time without auth (an audit)."""
    target = f"127.0.0.1:{grpc_server.port}"
    for token in (None, ""):
        env = {k: v for k, v in os.environ.items() if k != "CONTEXT_ENGINE_TOKEN"}
        if token is not None:
            env["CONTEXT_ENGINE_TOKEN"] = token
        out = tmp_path / f"run-{token is None}"
        script = [str(GHZ / "prepare.py"), "--target", target, "--total", "1", "--out", str(out)]
        process = await asyncio.create_subprocess_exec(
            sys.executable, *script, env=env, stderr=asyncio.subprocess.PIPE
        )
        _, stderr = await process.communicate()
        assert process.returncode == 0, stderr.decode()
        assert {p.name for p in out.iterdir()} == {"build.json", "append_items.json"}


async def test_ghz_configs_prepare_and_call(grpc_server: Any, tmp_path: Path) -> None:
    prepare = _prepare_module()
    target = f"127.0.0.1:{grpc_server.port}"
    written = await prepare.prepare(target, tmp_path, total=TOTAL, history=2)
    assert set(written) == {"build.json", "append_items.json"}

    service = pb.DESCRIPTOR.services_by_name["ContextEngine"]
    async with grpc.aio.insecure_channel(target) as channel:
        for name, path in written.items():
            config = json.loads(path.read_text(encoding="utf-8"))
            assert config["host"] == target and config["total"] == TOTAL
            assert (GHZ.parents[1] / config["proto"]).is_file()
            package, _, method_name = config["call"].rpartition(".")
            assert package == service.full_name
            method = service.methods_by_name[method_name]
            request_type = getattr(pb, method.input_type.name)
            response_type = getattr(pb, method.output_type.name)
            call = channel.unary_unary(
                f"/{package}/{method_name}",
                request_serializer=request_type.SerializeToString,
                response_deserializer=response_type.FromString,
            )
            for number in (0, 1, TOTAL):
                data = _render(prepare, config["data"], number)
                request = json_format.ParseDict(data, request_type())
                response = await call(request, timeout=10)
                if name == "build.json":
                    assert response.prefix_sha256 and response.request_sha256
                    kinds = [
                        block.WhichOneof("kind")
                        for message in response.request.messages
                        for block in message.blocks
                    ]
                    assert kinds.count("tool_result") == 2  # the prepared history
                else:
                    assert response.checkpoint_version == 2
                    assert len(response.sequences) == len(data["items"])


async def test_ghz_prepare_sends_its_token_to_a_server_with_bearer_auth(
    pool: Any, tmp_path: Path
) -> None:
    from context_engine.api.interceptors import BearerTokens
    from context_engine.api.server import build_engine, build_server
    from context_engine_client import Unauthenticated

    token = "ghz-token-" + "g" * 32
    running = await build_server(
        build_engine(pool), "127.0.0.1:0", auth=BearerTokens({token: "ghz"})
    )
    try:
        prepare = _prepare_module()
        target = f"127.0.0.1:{running.port}"
        with pytest.raises(Unauthenticated):  # without it: refused
            await prepare.prepare(target, tmp_path / "none", total=0, history=1)
        written = await prepare.prepare(target, tmp_path, total=0, history=1, token=token)
        assert set(written) == {"build.json", "append_items.json"}
        for path in written.values():  # the token is given to ghz, never written for it
            assert token not in path.read_text(encoding="utf-8")
    finally:
        await running.stop(0)
