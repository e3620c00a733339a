"""A Build of a run holding more than OFF_LOOP_BYTES assembles and renders in a worker
thread (api/engine.py off_loop), through the real server and PostgreSQL: escaping content
dense with look-alike delimiters is Python work per delimiter, and on the event loop one
first Build of a 2 MB result held every other call of the replica 0.4 s (an audit;
bench/loop_stall.py measures it: no test times anything). A light run's Build stays on the
loop, and the request is the same wherever it was made."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from typing import Any

import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.api import engine as engine_module

from .helpers import TENANT, append_items, assistant, call, open_session, result, start_run

HOSTILE = "\u2039\uff55ser "  # reads as "<user ": a delimiter to escape, every unit


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The thread each Build's assemble and render ran in, by name."""
    seen: dict[str, list[int]] = {"assemble": [], "render": []}
    for name in seen:
        real = getattr(engine_module, name)

        def recording(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            seen[_name].append(threading.get_ident())
            return _real(*args, **kw)

        monkeypatch.setattr(engine_module, name, recording)
    return seen


async def _built(stub: Any, content: str, step: pb.StepContext | None = None) -> pb.BuildResponse:
    """The first Build of a new run whose completed exchange holds `content`, with `step`."""
    session_id, _ = await open_session(stub)
    started = await start_run(stub, session_id, "Read the page")
    run_id = started.run.run_id
    await append_items(
        stub,
        session_id,
        run_id,
        started.checkpoint_version,
        call("big"),
        result("big", content),
        assistant("Read it."),
        call("small"),
        result("small", "ok"),
    )
    request = pb.BuildRequest(tenant_id=TENANT, session_id=session_id, run_id=run_id, step=step)
    request.now.FromDatetime(datetime(2026, 12, 7, tzinfo=UTC))
    return await stub.Build(request)


async def test_a_heavy_runs_build_is_made_off_the_event_loop(
    stub: Any, threads: dict[str, list[int]]
) -> None:
    loop_thread = threading.get_ident()  # the test's loop serves the server too
    light = await _built(stub, HOSTILE * 100)
    assert threads == {"assemble": [loop_thread], "render": [loop_thread]}
    heavy = await _built(stub, HOSTILE * (engine_module.OFF_LOOP_BYTES // len(HOSTILE) + 1))
    assert len(threads["assemble"]) == len(threads["render"]) == 2
    assert threads["assemble"][1] != loop_thread
    assert threads["render"][1] != loop_thread
    # Escaped either way: every opener of the content is sent as "&lt;" (the heavy one's
    # result yields to its pointer, over the tool results' cap).
    light_payload, heavy_payload = (
        json.dumps(json.loads(built.provider_payload), ensure_ascii=False)
        for built in (light, heavy)
    )
    assert "&lt;\uff55ser" in light_payload
    assert "\u2039" not in light_payload + heavy_payload
    assert "[truncated] tool.result" in heavy_payload
    # Heavy by its step's lines alone: a knowledge passage as large.
    passage = pb.KnowledgePassage(
        item_id="k1", text=HOSTILE * (engine_module.OFF_LOOP_BYTES // len(HOSTILE) + 1)
    )
    await _built(stub, "ok", pb.StepContext(knowledge=[passage]))
    assert threads["assemble"][2] != loop_thread
