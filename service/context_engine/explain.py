"""``context-engine explain``: why did a request miss the provider cache?

Takes two Build responses — two files (a serialized BuildResponse, binary or JSON), or two
request sequences of one session that a running server rebuilds through GetBuild — and
names the first byte in which their prompts differ, the row and item that byte belongs
to, and what it means:

Rule 1: the prompts are compared as their provider caches them: the neutral request of
each response is rendered unit by unit in cache order (providers.prompt_units: Anthropic
tools -> system -> message blocks; OpenAI instructions -> tools -> input items) and the
units' bytes are concatenated. The first differing byte is an offset in that stream, and
the unit holding it names its payload path, row and item.
Rule 2 (verdict): a difference in Region A (rows 1-8) within one epoch is a defect — the
prefix must be byte-stable for the life of an epoch. Across an epoch rotation it is the
rotation's known cost. A difference in Region B (rows 9-15) is expected: the body is
rebuilt on every request. When B's prompt merely extends A's, nothing differs: B can
reuse everything A cached.
Rule 3: a response whose provider_payload is not what its request renders to is reported
(the response came from another builder version), and the comparison still uses the
rendered units. A payload with fewer cache markers than the provider allows is what its
request renders to: the model registry's budget (max_cache_breakpoints), which explain does
not read, dropped them.
Rule 4 (the channel): with --session, GetBuild is called over TLS when --ca-file,
--cert-file/--key-file (mTLS) or --tls is given, and in plaintext otherwise. A bearer
token (--token) is refused over plaintext unless the target is loopback (a sidecar; every
address of an ipv4:/ipv6: list): it would cross the network in clear.
Exit status: 1 for a Region A defect, 2 for unusable input (one line naming why: a file
that is no BuildResponse, a GetBuild error as `CODE: details [REASON metadata]`, a token
refused over plaintext, a build this version cannot render), 0 otherwise. Two builds of
different sessions are two plans: their Region A differing is no defect.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import ipaddress
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from ._gen.context_engine.v1 import context_engine_pb2 as pb
from .api.convert import request_from_proto
from .api.errors import error_info
from .core.errors import EngineError, PreconditionError
from .core.request import ModelRequest
from .core.rows import ROW_TABLE, Region, Row
from .providers import PromptUnit, anthropic, prompt_units, render

__all__ = [
    "Explanation",
    "add_arguments",
    "explain",
    "fetch_builds",
    "format_explanation",
    "load_build_response",
    "run",
]

_SNIPPET = 40

# What a Region B difference in each row usually means (Rule 2).
_ROW_HINTS: dict[Row, str] = {
    Row.COMPACTED_SUMMARY: "a compaction replaced the summary: the history window re-caches",
    Row.CONVERSATION: (
        "history changed: a history cut, tool-result truncation, compaction or a new turn"
    ),
    Row.SKILL_BODIES: "a skill was loaded",
    Row.WORKING_STATE: "the working state changed",
    Row.RECALL: "in-turn recall, corrections or knowledge changed (recomputed every step)",
    Row.RUNTIME_METADATA: (
        "the runtime metadata row differs: the date, scope or surface changed, or the row"
        " moved (it goes with the newest user input)"
    ),
    Row.USER_INPUT: "the trailing user input differs",
}


@dataclass(frozen=True, slots=True)
class Explanation:
    identical: bool  # the two prompts are byte-identical
    extends: bool  # B's prompt starts with all of A's (nothing of A's differs)
    offset: int  # first differing byte in the cache-order prompt (shared bytes before it)
    path: str = ""  # payload path of the unit holding it (A's, else B's)
    row: Row | None = None
    item_id: str = ""
    unit_offset: int = 0  # the byte within that unit
    region: Region | None = None
    defect: bool = False
    verdict: str = ""
    snippet_a: str = ""
    snippet_b: str = ""
    notes: tuple[str, ...] = field(default=())


def _renders_to(request: ModelRequest, payload: bytes) -> bool:
    """Whether `request` renders to `payload` under some cache-marker budget (Rule 3), as
    this assembler renders it or as an older one whose record GetBuild serves rendered
    as it was sent (core/build_record.py Rule 8: @10 and older named no call ids in the
    no-tools text form, and @1 sent failed results without their line)."""
    budgets = (None, *range(anthropic.MAX_BREAKPOINTS - 1, -1, -1))
    forms: tuple[dict[str, bool], ...] = (
        {},
        {"text_call_ids": False},
        {"text_call_ids": False, "failed_result_line": False},
    )
    return any(
        render(request, budget, **form).body == payload for form in forms for budget in budgets
    )


def explain(a: pb.BuildResponse, b: pb.BuildResponse) -> Explanation:
    """Compare two Build responses (Rules 1-3).

    Raises:
        ValueError: a response carries no request (it reported needs_compaction).
    """
    for label, response in (("A", a), ("B", b)):
        if not response.HasField("request") or not response.request.model_id:
            raise ValueError(f"build {label} carries no request (needs_compaction?)")
    request_a, request_b = request_from_proto(a.request), request_from_proto(b.request)
    notes = [
        f"{label}: provider_payload is not what its request renders to (another builder"
        " version?); comparing the rendered prompt"
        for label, response, request in (("A", a, request_a), ("B", b, request_b))
        if response.provider_payload and not _renders_to(request, response.provider_payload)
    ]
    if request_a.session_key != request_b.session_key:
        notes.append(
            "the builds are of two sessions: their prefixes are two plans', no defect is"
            " judged between them"
        )
    if request_a.provider != request_b.provider or request_a.model_id != request_b.model_id:
        notes.append(
            f"provider/model changed ({request_a.provider}/{request_a.model_id} -> "
            f"{request_b.provider}/{request_b.model_id}): no cache entry can be shared"
        )
    units_a, units_b = prompt_units(request_a), prompt_units(request_b)
    offset = 0
    for n in range(min(len(units_a), len(units_b))):
        ua, ub = units_a[n], units_b[n]
        if ua.data != ub.data:
            at = _common_prefix(ua.data, ub.data)
            return _difference(a, b, ua, ub, offset + at, at, notes)
        offset += len(ua.data)
    if len(units_a) == len(units_b):
        return Explanation(
            identical=True,
            extends=True,
            offset=offset,
            verdict="identical prompts: everything A cached, B reads",
            notes=tuple(notes),
        )
    if len(units_a) < len(units_b):
        return Explanation(
            identical=False,
            extends=True,
            offset=offset,
            path=units_b[len(units_a)].path,
            verdict=(
                f"B repeats all {offset} bytes of A's prompt and appends to it: no byte of A"
                " differs, so B can read whatever A cached"
            ),
            notes=tuple(notes),
        )
    gone = units_a[len(units_b)]
    return _difference(a, b, gone, None, offset, 0, notes)


def _common_prefix(x: bytes, y: bytes) -> int:
    n = 0
    for cx, cy in zip(x, y, strict=False):
        if cx != cy:
            break
        n += 1
    return n


def _snippet(unit: PromptUnit | None, at: int) -> str:
    if unit is None:
        return "(nothing: the prompt ends here)"
    window = unit.data[max(0, at - _SNIPPET) : at + _SNIPPET]
    return window.decode("utf-8", errors="replace")


def _difference(
    a: pb.BuildResponse,
    b: pb.BuildResponse,
    ua: PromptUnit,
    ub: PromptUnit | None,
    offset: int,
    at: int,
    notes: list[str],
) -> Explanation:
    # Where either side is still in its prefix, the prefix differs: a unit B gained there
    # (a tool, a memory line) meets A's first body unit at the same place, which read as
    # an expected Region B change in one order and a DEFECT in the other (an audit).
    named = ua
    if ub is not None and ub.region is Region.PREFIX and ua.region is not Region.PREFIX:
        named = ub
    region = named.region
    if region is Region.PREFIX:
        # Epochs are numbered per session: two sessions' epoch 1 are different plans.
        same_session = a.request.session_key == b.request.session_key
        same_epoch = same_session and a.epoch == b.epoch
        defect = same_epoch
        if same_epoch:
            verdict = (
                f"Region A (row {int(named.row)}, {ROW_TABLE[named.row].content}) differs within"
                f" epoch {a.epoch}: a DEFECT — the prefix must be byte-stable for the life of"
                " an epoch"
            )
        elif same_session:
            verdict = (
                f"Region A changed with an epoch rotation ({a.epoch} -> {b.epoch}): expected,"
                " the known cost of re-caching the prefix once"
            )
        else:
            verdict = (
                f"Region A (row {int(named.row)}, {ROW_TABLE[named.row].content}) differs between"
                " two sessions' plans: expected, each session's prefix is its own"
            )
        if same_epoch and a.prefix_sha256 != b.prefix_sha256:
            notes.append("prefix_sha256 differs within one epoch")
    elif ub is not None and (ub.row, ub.item_id) != (ua.row, ua.item_id):
        # B has another unit where A has this one: B's is what is new or moved there (a
        # skill body loaded before the working state, an exchange before the fresh rows),
        # and A's row's hint blamed what had not changed (an audit).
        defect = False
        verdict = (
            f"Region B: A has row {int(ua.row)} ({ROW_TABLE[ua.row].content}) where B has row"
            f" {int(ub.row)} ({ROW_TABLE[ub.row].content}): expected — the body is rebuilt on"
            f" every request; B's differs there: {_ROW_HINTS.get(ub.row, '')}"
        )
    else:
        defect = False
        hint = _ROW_HINTS.get(named.row, "")
        verdict = (
            f"Region B (row {int(named.row)}, {ROW_TABLE[named.row].content}): expected — the body"
            f" is rebuilt on every request; {hint}"
        )
    return Explanation(
        identical=False,
        extends=False,
        offset=offset,
        path=named.path,
        row=named.row,
        item_id=named.item_id,
        unit_offset=at,
        region=region,
        defect=defect,
        verdict=verdict,
        snippet_a=_snippet(ua, at),
        snippet_b=_snippet(ub, at),
        notes=tuple(notes),
    )


def format_explanation(
    e: Explanation, a: pb.BuildResponse, b: pb.BuildResponse, labels: Sequence[str] = ("A", "B")
) -> str:
    def side(label: str, r: pb.BuildResponse) -> str:
        return (
            f"{label}: request {r.request_sequence or '-'}, epoch {r.epoch}, prefix"
            f" {r.prefix_sha256[:12] or '-'}, {r.provider_api or 'no payload'}"
        )

    lines = [side(labels[0], a), side(labels[1], b)]
    if e.identical or e.extends:
        lines.append(e.verdict)
    else:
        where = f"{e.path} (byte {e.unit_offset} of that unit)"
        row = f"row {int(e.row)} {ROW_TABLE[e.row].content}" if e.row is not None else "-"
        region = "A" if e.region is Region.PREFIX else "B"
        lines += [
            f"first difference: byte {e.offset} of the prompt in cache order",
            f"  at {where}",
            f"  {row} (Region {region}), item {e.item_id or '(platform text)'}",
            f"  {labels[0]}: {e.snippet_a!r}",
            f"  {labels[1]}: {e.snippet_b!r}",
            f"verdict: {e.verdict}",
        ]
    lines += [f"note: {n}" for n in e.notes]
    return "\n".join(lines)


# --- input --------------------------------------------------------------------------------


def load_build_response(path: Path) -> pb.BuildResponse:
    """A BuildResponse from a file: JSON (protobuf JSON mapping) or binary.

    Raises:
        OSError: the file cannot be read.
        ValueError: it holds no BuildResponse (its message is one line naming the file).
    """
    data = path.read_bytes()
    # A byte-order mark before JSON, as PowerShell's `Out-File -Encoding utf8` writes it (an
    # audit: read as binary and refused as corrupt). No binary message starts with one: its
    # first byte, 0xEF, would be a field of wire type 7, which does not exist.
    data = data.removeprefix(codecs.BOM_UTF8)
    response = pb.BuildResponse()
    try:
        if data.lstrip()[:1] == b"{":
            json_format.Parse(data.decode("utf-8"), response)
        else:
            response.ParseFromString(data)
    except (DecodeError, json_format.ParseError, UnicodeDecodeError) as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"{path} is not a BuildResponse (binary or JSON): {why}") from None
    if not data.strip():  # an empty message parses: it is no BuildResponse anyone saved
        raise ValueError(f"{path} is empty, not a BuildResponse")
    return response


def is_loopback(target: str) -> bool:
    """Whether a gRPC target names this host: a loopback address (an IPv4-mapped one too,
    ::ffff:127.0.0.1), localhost, or a Unix socket. A name that resolves elsewhere, or any
    other address, is not. The ipv4: and ipv6: schemes take a comma-separated list, which
    grpc falls through: every address must be loopback (an audit: only the first was
    checked)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            addresses = target.removeprefix(scheme).split(",")
            return all(_one_loopback(address) for address in addresses)
    for scheme in ("dns:///", "dns:"):
        target = target.removeprefix(scheme)
    return _one_loopback(target)


def _one_loopback(target: str) -> bool:
    host = target.rpartition(":")[0] if target.count(":") == 1 else target
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    # ipaddress finds ::ffff:127.0.0.1 loopback from Python 3.13 only (gh-117566); the
    # clients always take it as loopback, and explain refused what they allow.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def channel_credentials(
    ca_file: str = "", cert_file: str = "", key_file: str = "", *, tls: bool = False
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files (None: plaintext, when none is given and not `tls`):
    `ca_file` the roots the server's certificate must chain to (default: the system's),
    `cert_file` and `key_file` this client's certificate for mTLS, both or neither.

    Raises:
        OSError: a file cannot be read.
        ValueError: only one of `cert_file` and `key_file`.
    """
    if bool(cert_file) != bool(key_file):
        raise ValueError("--cert-file and --key-file go together (mTLS)")
    if not (tls or ca_file or cert_file):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes() if ca_file else None,
        private_key=Path(key_file).read_bytes() if key_file else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file else None,
    )


def rpc_error_line(exc: grpc.aio.AioRpcError) -> str:
    """One line for a failed call: `CODE: details`, then the ErrorInfo reason and its
    metadata (recorded_assembler_version, assembler_version, ...) when the status has one."""
    line = f"{exc.code().name}: {' '.join((exc.details() or '').split())}"
    reason, metadata = error_info(exc.trailing_metadata())
    if reason:
        line += f" [{reason}{''.join(f' {k}={v}' for k, v in sorted(metadata.items()))}]"
    return line


async def fetch_builds(
    target: str,
    tenant_id: str,
    session_id: str,
    sequences: Sequence[int],
    *,
    token: str = "",
    credentials: grpc.ChannelCredentials | None = None,
) -> list[pb.BuildResponse]:
    """Rebuild recorded requests through GetBuild on a running server, over TLS with
    `credentials` (channel_credentials) and in plaintext without.

    Raises:
        ValueError: a token for a plaintext channel to a target that is not loopback.
    """
    from ._gen.context_engine.v1 import context_engine_pb2_grpc as pb_grpc

    if token and credentials is None and not is_loopback(target):
        raise ValueError(
            f"--token would cross the network in clear to {target}: give --ca-file (TLS),"
            " or use a loopback target"
        )
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    # No receive limit: a Build for a long-window model can pass gRPC's 4 MiB default, and
    # the server sends it whole (an audit: explain failed RESOURCE_EXHAUSTED on such a
    # session while GetBuild served it), as the Python client allows.
    options = [("grpc.max_receive_message_length", -1)]
    channel = (
        grpc.aio.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.aio.insecure_channel(target, options=options)
    )
    async with channel:
        stub = pb_grpc.ContextEngineStub(channel)  # type: ignore[no-untyped-call]  # no .pyi for _grpc
        return [
            await stub.GetBuild(
                pb.GetBuildRequest(
                    tenant_id=tenant_id, session_id=session_id, request_sequence=sequence
                ),
                metadata=metadata,
            )
            for sequence in sequences
        ]


_DEFAULT_TARGET = "127.0.0.1:50051"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "builds",
        nargs=2,
        help="two BuildResponse files (binary or JSON), or with --session two request"
        " sequences (BuildResponse.request_sequence)",
    )
    parser.add_argument(
        "--target", default=None, help=f"server HOST:PORT (default {_DEFAULT_TARGET})"
    )
    parser.add_argument(
        "--tenant", default="", help="tenant of the session (required with --session)"
    )
    parser.add_argument("--session", default="", help="rebuild the two requests via GetBuild")
    parser.add_argument(
        "--token",
        default="",
        help="bearer token, when the server wants one (refused over plaintext unless the"
        " target is loopback)",
    )
    parser.add_argument(
        "--ca-file", default="", help="PEM roots the server's TLS certificate chains to (TLS)"
    )
    parser.add_argument("--cert-file", default="", help="PEM client certificate (mTLS)")
    parser.add_argument("--key-file", default="", help="PEM client key (mTLS)")
    parser.add_argument(
        "--tls", action="store_true", help="TLS with the system's roots (no --ca-file)"
    )


# A bearer token as a header carries it: visible ASCII, no spaces or line endings.
_HEADER_TOKEN = re.compile(r"[\x21-\x7e]*")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot say alone (exits 2 via parser.error): --session needs --tenant
    and two request sequences. The server's options mean nothing with two files: said on
    stderr (an operator audit: they were ignored without a word), not refused, so a script
    that always passes them keeps working."""
    if args.session:
        if not args.tenant:
            parser.error("--tenant is required with --session")
        if not _HEADER_TOKEN.fullmatch(args.token):
            # A token read from a file kept its line ending; grpc failed the call with a
            # traceback (an audit). The token itself is never printed.
            parser.error(
                "--token holds a character an authorization header cannot carry"
                " (a line ending read from a file?)"
            )
        for build in args.builds:
            try:
                sequence = int(build)
            except ValueError:
                sequence = 0
            if sequence < 1:
                parser.error(f"with --session, {build!r} is not a request sequence")
        return
    given = [
        flag
        for flag, value in (
            ("--tenant", args.tenant),
            ("--token", args.token),
            ("--ca-file", args.ca_file),
            ("--cert-file", args.cert_file),
            ("--key-file", args.key_file),
            ("--tls", args.tls),
            ("--target", args.target is not None),
        )
        if value
    ]
    if given:
        print(
            f"context-engine explain: {', '.join(given)} ignored: two files are read as given"
            " (the server's options are for --session)",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    try:
        if args.session:
            sequences = [int(s) for s in args.builds]
            credentials = channel_credentials(
                args.ca_file, args.cert_file, args.key_file, tls=args.tls
            )
            a, b = asyncio.run(
                fetch_builds(
                    args.target or _DEFAULT_TARGET,
                    args.tenant,
                    args.session,
                    sequences,
                    token=args.token,
                    credentials=credentials,
                )
            )
        else:
            a, b = (load_build_response(Path(p)) for p in args.builds)
        explanation = explain(a, b)
    except (OSError, ValueError) as exc:
        print(f"context-engine explain: {exc}", file=sys.stderr)
        return 2
    except (EngineError, PreconditionError) as exc:
        # A build this version cannot render (a provider it has no renderer for, a
        # malformed reasoning payload, two tools sharing a wire name): unusable input,
        # not a Region A defect, which exit 1 would say (an audit: a traceback, exit 1).
        print(f"context-engine explain: a build cannot be rendered: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        print(f"context-engine explain: GetBuild failed: {rpc_error_line(exc)}", file=sys.stderr)
        return 2
    print(format_explanation(explanation, a, b))
    return 1 if explanation.defect else 0
