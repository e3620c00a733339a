"""`context-engine explain`: the first differing byte, its row and item, and the verdict."""

from __future__ import annotations

import codecs
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.api.convert import request_from_proto, request_to_proto
from context_engine.cli import main
from context_engine.core import assemble
from context_engine.core.request import ModelRequest
from context_engine.core.rows import ROW_TABLE, Region, Row
from context_engine.explain import explain, format_explanation, is_loopback, load_build_response
from context_engine.providers import prompt_units, render
from tests.golden.loader import load_request

from .strategies import SCENARIO_SETTINGS, SETTINGS, Scenario, scenarios

LOOP = "anthropic_scheduled_tool_loop"


def _response(request: ModelRequest, epoch: int = 1, sequence: int = 7) -> pb.BuildResponse:
    payload = render(request)
    return pb.BuildResponse(
        request=request_to_proto(request),
        prefix_sha256="ab" * 32,
        epoch=epoch,
        request_sequence=sequence,
        provider_payload=payload.body,
        provider_api=payload.api,
    )


def _edit_block(request: ModelRequest, item_id: str, text: str) -> ModelRequest:
    messages = tuple(
        replace(
            m, blocks=tuple(replace(b, text=text) if b.item_id == item_id else b for b in m.blocks)
        )
        for m in request.messages
    )
    return replace(request, messages=messages)


def _stream(request: ModelRequest) -> bytes:
    return b"".join(u.data for u in prompt_units(request))


def _first_difference(x: bytes, y: bytes) -> int:
    return next(
        (n for n, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y))
    )


def test_identical_builds_share_everything() -> None:
    request = load_request(LOOP)
    e = explain(_response(request), _response(request))
    assert e.identical and not e.defect and e.offset == len(_stream(request))


def test_a_changed_date_is_region_b_and_expected() -> None:
    a = load_request(LOOP)
    runtime = next(b for m in a.messages for b in m.blocks if b.row is Row.RUNTIME_METADATA)
    b = _edit_block(a, runtime.item_id, runtime.text.replace("2026-03-14", "2026-03-15"))
    e = explain(_response(a), _response(b))
    assert (e.row, e.item_id, e.region, e.defect) == (
        Row.RUNTIME_METADATA,
        runtime.item_id,
        Region.BODY,
        False,
    )
    assert e.offset == _first_difference(_stream(a), _stream(b))
    assert "expected" in e.verdict
    text = format_explanation(e, _response(a), _response(b))
    assert "row 14" in text and "Region B" in text


def test_a_changed_prefix_within_an_epoch_is_a_defect() -> None:
    a = load_request(LOOP)
    persona = next(n for n, blk in enumerate(a.system) if blk.row is Row.PERSONA)
    system = list(a.system)
    system[persona] = replace(system[persona], text=system[persona].text + " (edited)")
    b = replace(a, system=tuple(system))
    e = explain(_response(a), _response(b))
    assert e.region is Region.PREFIX and e.row is Row.PERSONA and e.defect
    assert e.path == f"system[{persona}]"
    assert "DEFECT" in e.verdict
    rotated = explain(_response(a, epoch=1), _response(b, epoch=2))
    assert rotated.region is Region.PREFIX and not rotated.defect
    assert "rotation" in rotated.verdict
    # Epochs are numbered per session: two sessions' epoch 1 are two plans (an audit:
    # called a DEFECT, exit 1).
    other = replace(b, session_key="session-" + "0" * 32)
    apart = explain(_response(a), _response(other))
    assert apart.region is Region.PREFIX and not apart.defect
    assert "two sessions" in apart.verdict
    assert any("two sessions" in note for note in apart.notes)


@pytest.mark.parametrize("golden", [LOOP, "openai_tool_loop"])
def test_a_prefix_unit_one_side_gained_is_a_defect_in_either_order(golden: str) -> None:
    """B's plan has one more system block (a memory line, a tool) within the same epoch:
    at the first difference B's unit is in its prefix and A's is its first body unit.
    The verdict was taken from A's side alone, so A-then-B read "Region B: expected" and
    exited 0, and only B-then-A named the DEFECT (an audit)."""
    a = load_request(golden)
    extra = replace(a.system[-1], item_id="memory:extra", text="The user prefers trains.")
    b = replace(a, system=(*a.system, extra))
    for first, second in ((a, b), (b, a)):
        e = explain(_response(first), _response(second))
        assert e.region is Region.PREFIX and e.defect and "DEFECT" in e.verdict, e.verdict
        assert ROW_TABLE[e.row].region is Region.PREFIX


def test_a_prompt_that_only_grows_differs_nowhere() -> None:
    b = load_request(LOOP)
    last = b.messages[-1]
    a = replace(b, messages=(*b.messages[:-1], replace(last, blocks=last.blocks[:1])))
    e = explain(_response(a), _response(b))
    assert e.extends and not e.identical and not e.defect
    assert e.offset == len(_stream(a))


def test_where_b_has_another_unit_both_rows_and_bs_cause_are_named() -> None:
    """Where B holds another unit than A at the first differing byte (a skill body loaded
    before the working state; an exchange appended before the fresh rows), A's row's hint
    blamed what had not changed: "the working state changed" for a skill load (an audit).
    Both rows are named, with B's cause."""
    a = load_request(LOOP)
    last = a.messages[-1]
    recall = next(b for b in last.blocks if b.row is Row.RECALL)
    b = replace(
        a,
        messages=(
            *a.messages[:-1],
            replace(last, blocks=tuple(x for x in last.blocks if x is not recall)),
        ),
    )
    e = explain(_response(a), _response(b))
    assert (e.row, e.region, e.defect) == (Row.RECALL, Region.BODY, False)
    assert "A has row 13" in e.verdict and "where B has row 14" in e.verdict
    assert "the runtime metadata row differs" in e.verdict
    assert "recall, corrections or knowledge changed" not in e.verdict


def test_a_shrunk_history_names_what_was_dropped() -> None:
    a = load_request(LOOP)
    b = replace(a, messages=a.messages[1:])
    e = explain(_response(a), _response(b))
    assert e.region is Region.BODY and e.row is Row.COMPACTED_SUMMARY


def test_an_openai_instructions_change_names_its_system_block() -> None:
    a = load_request("openai_tool_loop")
    system = list(a.system)
    system[-1] = replace(system[-1], text=system[-1].text + "!")
    b = replace(a, system=tuple(system))
    e = explain(_response(a), _response(b))
    assert e.path == f"instructions[{len(system) - 1}]"
    assert e.row is system[-1].row and e.defect


def test_a_payload_from_another_builder_is_noted() -> None:
    request = load_request(LOOP)
    stale = _response(request)
    stale.provider_payload = b"{}"
    e = explain(stale, _response(request))
    assert e.identical and any("another builder" in n for n in e.notes)


def test_a_payload_under_a_smaller_breakpoint_budget_is_not_noted() -> None:
    """A model whose registry budget (max_cache_breakpoints) is below the provider's sends
    fewer markers; explain does not read the registry, and must not call that payload
    another builder's."""
    request = load_request(LOOP)
    small = _response(request)
    small.provider_payload = render(request, 1).body
    assert small.provider_payload != render(request).body
    e = explain(small, _response(request))
    assert e.identical and e.notes == ()


def test_a_payload_getbuild_serves_as_an_older_assembler_sent_it_is_not_noted() -> None:
    """GetBuild of a context-assembler@10 record renders Anthropic's no-tools text form
    naming no call ids, as it was sent: that payload is the request's, not another
    builder's."""
    request = replace(load_request(LOOP), tools=())
    older = _response(request)
    older.provider_payload = render(request, text_call_ids=False).body
    assert older.provider_payload != render(request).body
    e = explain(older, _response(request))
    assert e.identical and e.notes == ()


@SCENARIO_SETTINGS
@given(scenarios(), st.sampled_from(["anthropic", "openai"]))
def test_the_request_survives_the_proto_seam(sc: Scenario, provider: str) -> None:
    assembled = assemble(sc.inputs())
    assert assembled.request is not None
    request = replace(assembled.request, provider=provider)
    assert request_from_proto(request_to_proto(request)) == request


@SETTINGS
@given(st.data())
def test_explain_finds_the_block_any_single_edit_lands_in(data: st.DataObject) -> None:
    case = data.draw(st.sampled_from([LOOP, "openai_tool_loop", "anthropic_first_request"]))
    a = load_request(case)
    texts = [
        b for m in a.messages for b in m.blocks if b.kind in ("text", "tool_result") and b.item_id
    ]
    target = data.draw(st.sampled_from(texts))
    at = data.draw(st.integers(0, len(target.text)))
    b = _edit_block(a, target.item_id, target.text[:at] + "\u2603" + target.text[at:])
    e = explain(_response(a), _response(b))
    assert e.item_id == target.item_id and e.row is target.row and not e.defect
    assert e.offset == _first_difference(_stream(a), _stream(b))


@pytest.mark.parametrize("form", ["json", "json-bom", "binary"])
def test_the_command_reads_files_and_exits_1_on_a_defect(
    tmp_path: Path, form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a = load_request(LOOP)
    system = list(a.system)
    system[0] = replace(system[0], text="A different policy.")
    b = replace(a, system=tuple(system))
    paths = []
    for name, response in (("a", _response(a)), ("b", _response(b))):
        path = tmp_path / f"{name}.{form}"
        if form == "json":
            path.write_text(json_format.MessageToJson(response))
        elif form == "json-bom":  # PowerShell's `Out-File -Encoding utf8` (an audit)
            path.write_bytes(codecs.BOM_UTF8 + json_format.MessageToJson(response).encode())
        else:
            path.write_bytes(response.SerializeToString())
        assert load_build_response(path) == response
        paths.append(str(path))
    assert main(["explain", *paths]) == 1
    out = capsys.readouterr().out
    assert "DEFECT" in out and "system[0]" in out
    assert main(["explain", paths[0], paths[0]]) == 0
    assert main(["explain", paths[0], str(tmp_path / "nope")]) == 2


@pytest.mark.parametrize("data", [b"\xff\xff\xff\xff", b'{"epoch": "x"}', b"{\xff", b"", b" \n"])
def test_a_file_that_is_no_build_response_is_one_line_and_exit_2(
    tmp_path: Path, data: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(data)
    assert main(["explain", str(path), str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"context-engine explain: {path} is "), line
    assert "not a BuildResponse" in line, line


@pytest.mark.parametrize("sequence", ["x", "0", "²", "-3"])
def test_a_sequence_that_is_not_one_is_a_usage_error(
    sequence: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator audit: a sequence that was not a number failed as a bare int() error
    (and a review: "²" passed isdigit() and then failed int() in a traceback)."""
    session = ["--session", "00000000-0000-0000-0000-000000000001", "--tenant", "t"]
    with pytest.raises(SystemExit) as exited:
        main(["explain", "1", sequence, *session])
    assert exited.value.code == 2
    assert f"{sequence!r} is not a request sequence" in capsys.readouterr().err


def test_the_servers_options_with_two_files_are_named_as_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They mean nothing with two files and were ignored without a word (an operator
    audit); said on stderr, not refused, so a script that always passes them still runs."""
    path = tmp_path / "a.json"
    path.write_text(json_format.MessageToJson(_response(load_request(LOOP))))
    argv = ["explain", str(path), str(path), "--target", "localhost:1", "--tenant", "t"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "--tenant, --target ignored: two files are read as given" in err


def test_session_needs_a_tenant_and_a_token_needs_tls_off_loopback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    session = "00000000-0000-0000-0000-000000000001"
    with pytest.raises(SystemExit) as exited:
        main(["explain", "1", "2", "--session", session])
    assert exited.value.code == 2
    assert "--tenant is required with --session" in capsys.readouterr().err
    # Refused before any connection: the token would cross the network in clear.
    argv = ["explain", "1", "2", "--session", session, "--tenant", "t", "--token", "s" * 32]
    assert main([*argv, "--target", "192.0.2.1:50051"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--token would cross the network in clear to 192.0.2.1:50051" in line
    assert "s" * 32 not in line
    # A token read from a file with its line ending: refused before any call, never
    # printed (an audit: grpc's traceback, exit 1).
    with pytest.raises(SystemExit) as exited:
        main([*argv[:-1], "s" * 32 + "\r"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--token holds a character an authorization header cannot carry" in err
    assert "s" * 32 not in err
    # A client certificate without its key (or the reverse) is no mTLS.
    assert main([*argv, "--cert-file", "c.pem"]) == 2
    assert "--cert-file and --key-file go together" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("localhost:50051", True),
        ("[::1]:50051", True),
        ("dns:///localhost:50051", True),
        ("unix:/run/ce.sock", True),
        ("127.0.0.2:1", True),
        ("10.0.0.5:50051", False),
        ("engine.internal:50051", False),
        ("[2001:db8::1]:50051", False),
        ("localhost.evil.example:50051", False),
        # grpc falls through an address list: every address must be loopback (an audit:
        # only the first was checked, and the token went in clear to the second).
        ("ipv6:[::1]:50051", True),
        ("ipv4:127.0.0.1:1,127.0.0.2:50051", True),
        ("ipv6:[::1]:1,[2001:db8::1]:50051", False),
        ("ipv4:127.0.0.1:1,192.0.2.1:50051", False),
    ],
)
def test_which_targets_are_loopback(target: str, loopback: bool) -> None:
    assert is_loopback(target) is loopback


def test_a_build_without_a_request_cannot_be_explained() -> None:
    with pytest.raises(ValueError, match="needs_compaction"):
        explain(pb.BuildResponse(needs_compaction=True), _response(load_request(LOOP)))


def test_a_build_no_renderer_renders_is_unusable_input_not_a_defect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A saved build naming a provider this version has no renderer for: exit 2 and one
    line (an audit: a traceback and exit 1, the status of a Region A defect)."""
    good = _response(load_request(LOOP))
    bad = pb.BuildResponse()
    bad.CopyFrom(good)
    bad.request.provider = 99  # an enum value this version does not know
    paths = []
    for name, response in (("a.pb", good), ("b.pb", bad)):
        (tmp_path / name).write_bytes(response.SerializeToString())
        paths.append(str(tmp_path / name))
    assert main(["explain", *paths]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "a build cannot be rendered" in line
