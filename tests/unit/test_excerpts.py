"""Legacy tool results: deterministic head/tail excerpts over output.inline_maximum_bytes,
in the request only (never the checkpoint or the event), keeping trust, the first artifact
reference and a reference to the original event; a persisted context_content wins."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from context_engine.core import BuildInputs, Checkpoint, TrustLevel, assemble
from context_engine.core.excerpts import excerpt_of
from context_engine.core.items import AssistantMessage, ToolCall, ToolResult, UserMessage

from .test_budget import SECRET, _plan, count

GATE = settings(max_examples=200, deadline=None)


def _result(content: str, **kw: object) -> ToolResult:
    fields: dict[str, object] = {
        "item_id": "tr1",
        "call_id": "c1",
        "tool_name": "web.fetch",
        "content": content,
        "trust": TrustLevel.EXTERNAL_UNTRUSTED,
        "artifact_ref": "a/9d02",
        "sequence": 17,
        "run_id": "r0",
    }
    fields.update(kw)
    return ToolResult.model_validate(fields)


def _fetch(item_id: str, call_id: str, sequence: int, run_id: str) -> ToolCall:
    return ToolCall(
        item_id=item_id,
        call_id=call_id,
        tool_name="web.fetch",
        arguments_json="{}",
        sequence=sequence,
        run_id=run_id,
    )


@GATE
@given(
    text=st.text(st.characters(codec="utf-8"), min_size=0, max_size=3_000),
    limit=st.integers(200, 2_500),
    context=st.booleans(),
)
def test_an_excerpt_is_a_deterministic_head_and_tail_within_the_limit(
    text: str, limit: int, context: bool
) -> None:
    result = _result("canonical " + text, context_content=text if context else "")
    source = result.context_content or result.content
    excerpt = excerpt_of(result, limit)
    if len(source.encode("utf-8")) <= limit:
        assert excerpt is None  # rendered as is (its context_content, if any)
        return
    assert excerpt is not None
    assert excerpt == excerpt_of(result, limit)
    assert len(excerpt.content.encode("utf-8")) <= limit
    body = excerpt.content
    marker = next(line for line in body.split("\n") if line.startswith("[excerpt: "))
    head, tail = body[: body.index(marker) - 1], body[body.index(marker) + len(marker) + 1 :]
    assert source.startswith(head) and source.endswith(tail)
    assert f"{len(source.encode('utf-8')):,} bytes in all" in marker
    assert "event 17" in marker and "artifact:a/9d02" in marker
    # Everything but the content is kept; the alternate field is cleared.
    assert excerpt.context_content == ""
    for name in (
        "item_id",
        "call_id",
        "tool_name",
        "trust",
        "artifact_ref",
        "sequence",
        "is_error",
    ):
        assert getattr(excerpt, name) == getattr(result, name)


def test_carried_results_are_excerpted_in_the_request_only() -> None:
    big = "HEAD" + "x" * 40_000 + "TAIL"
    carried = (
        UserMessage(item_id="u1", text="fetch it", sequence=1, run_id="r0"),
        _fetch("c1", "k1", 2, "r0"),
        _result(big, call_id="k1", sequence=3, context_content=""),
        _fetch("c2", "k2", 4, "r0"),
        _result(
            big, item_id="tr2", call_id="k2", sequence=5, context_content="the pipeline's excerpt"
        ),
        AssistantMessage(item_id="a1", text="done", sequence=6, run_id="r0"),
    )
    # The active run's own result is not legacy: it is not excerpted.
    run = (
        UserMessage(item_id="u2", text="again", sequence=7, run_id="r1"),
        _fetch("c3", "k3", 8, "r1"),
        _result(big, item_id="tr3", call_id="k3", sequence=9, run_id="r1"),
    )
    checkpoint = Checkpoint(run_id="r1", version=3, items=run)
    inputs = BuildInputs(
        tenant_id="t",
        plan=_plan(200_000, 0, 4_000),
        secret=SECRET,
        checkpoint=checkpoint,
        carried=carried,
        now=datetime(2026, 1, 1, tzinfo=UTC),
        count_tokens=count,
        inline_maximum_bytes=4_096,
    )
    built = assemble(inputs)
    assert built.request is not None and built.pressure is not None
    blocks = {b.item_id: b for m in built.request.messages for b in m.blocks}
    excerpted = blocks["tr1"].text
    assert "HEAD" in excerpted and "TAIL" in excerpted and "x" * 5_000 not in excerpted
    assert "event 3, artifact:a/9d02" in excerpted and 'truncated="true"' in excerpted
    assert blocks["tr1"].trust is TrustLevel.EXTERNAL_UNTRUSTED
    assert blocks["tr1"].artifact_ref == "a/9d02"
    assert "the pipeline's excerpt" in blocks["tr2"].text  # context_content preferred
    assert big in blocks["tr3"].text
    assert built.pressure.legacy_tool_excerpts == ("tr1",)
    # The inputs (checkpoint and logged items) are untouched.
    assert carried[2].content == big and checkpoint.items[2].content == big
    assert assemble(inputs).request_sha256 == built.request_sha256


def test_an_excerpted_result_truncated_to_a_pointer_reports_the_results_own_size() -> None:
    """The pointer names the byte count of what exists (the spec's "typed pointer with the
    byte count and reference"), not of the excerpt the request would have shown: a 40,008
    byte result excerpted to 12,000 bytes, then truncated for the tool-result cap."""
    big = "HEAD" + "x" * 40_000 + "TAIL"
    carried = (
        UserMessage(item_id="u1", text="fetch it", sequence=1, run_id="r0"),
        _fetch("c1", "k1", 2, "r0"),
        _result(big, call_id="k1", sequence=3, context_content=""),
        AssistantMessage(item_id="a1", text="done", sequence=4, run_id="r0"),
    )
    inputs = BuildInputs(
        tenant_id="t",
        plan=_plan(14_000, 0, 4_000),
        secret=SECRET,
        checkpoint=Checkpoint(
            run_id="r1",
            version=3,
            items=(UserMessage(item_id="u2", text="again", sequence=5, run_id="r1"),),
        ),
        carried=carried,
        now=datetime(2026, 1, 1, tzinfo=UTC),
        count_tokens=count,
        inline_maximum_bytes=12_000,
    )
    built = assemble(inputs)
    assert built.request is not None and built.pressure is not None
    assert built.pressure.legacy_tool_excerpts == ("tr1",)
    blocks = {b.item_id: b for m in built.request.messages for b in m.blocks}
    assert "[truncated] tool.result tr1 web.fetch (external_untrusted, 40,008 bytes)" in (
        blocks["tr1"].text
    )
    assert "tr1" in next(
        s.item_ids for s in built.pressure.steps if s.step == "truncate_tool_results"
    )
