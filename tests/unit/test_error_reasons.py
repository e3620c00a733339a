"""Every ErrorInfo reason the service can send is in the proto's ErrorReason enum and in
docs/api.md's table of reasons, and the enum names nothing the table does not explain.

Reasons are found in the source: string constants passed as `reason=` and as the reason
argument of the interceptors' `abort_with`, the module-level constants they are named by,
and the `reason` class attributes error types default to (core/errors.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "service" / "context_engine"
_REASON_ARG = 3  # abort_with(context, code, message, reason, ...)


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "STRING" assignments."""
    out = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def _reasons_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = _constants(tree)

    def value(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return names.get(node.id)
        return None

    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            found.update(v for v in map(value, _class_reasons(node)) if v)
        if not isinstance(node, ast.Call):
            continue
        candidates = [kw.value for kw in node.keywords if kw.arg == "reason"]
        callee = node.func
        if (
            isinstance(callee, ast.Name)
            and callee.id == "abort_with"
            and len(node.args) > _REASON_ARG
        ):
            candidates.append(node.args[_REASON_ARG])
        found.update(v for v in map(value, candidates) if v)
    return found


def _class_reasons(cls: ast.ClassDef) -> list[ast.expr]:
    """The values a class body assigns to `reason` (an error type's default)."""
    out: list[ast.expr] = []
    for node in cls.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        value = getattr(node, "value", None)
        named = any(isinstance(t, ast.Name) and t.id == "reason" for t in targets)
        if named and value is not None:
            out.append(value)
    return out


def _service_reasons() -> set[str]:
    paths = (p for p in SERVICE.rglob("*.py") if "_gen" not in p.parts)
    return set().union(*map(_reasons_in, paths))


def _enum_reasons() -> set[str]:
    return {
        name.removeprefix("ERROR_REASON_")
        for name in pb.ErrorReason.DESCRIPTOR.values_by_name
        if name != "ERROR_REASON_UNSPECIFIED"
    }


def _documented_reasons() -> set[str]:
    text = (ROOT / "docs" / "api.md").read_text()
    table = text[text.index("Reasons:") : text.index("## RPCs")]
    return set(re.findall(r"^\| `([A-Z_]+)` \|", table, flags=re.MULTILINE))


def test_the_scan_finds_the_reasons_it_should() -> None:
    found = _service_reasons()
    # One of each way a reason is written: a keyword constant, abort_with's argument, a
    # name, a class default.
    assert {"INVALID_FIELD", "REQUEST_TOO_LARGE", "SHUTTING_DOWN", "BUDGET_EXCEEDED"} <= found
    assert len(found) >= 20


def test_every_reason_sent_is_in_the_enum() -> None:
    assert _service_reasons() - _enum_reasons() == set()


def test_every_enum_reason_is_documented() -> None:
    assert _enum_reasons() - _documented_reasons() == set()
    assert _documented_reasons() - _enum_reasons() == set()


# The status each error type maps to (api/errors.py) and the default reason it carries.
_STATUS_OF_ERROR = {
    "RequestError": "INVALID_ARGUMENT",
    "InvalidFieldError": "INVALID_ARGUMENT",
    "CapacityError": "INVALID_ARGUMENT",  # core/plan.py (the shell re-raises it as_state)
    "NotFoundError": "NOT_FOUND",
    "PreconditionError": "FAILED_PRECONDITION",
    "BudgetExceededError": "FAILED_PRECONDITION",
    "ConflictError": "ABORTED",
}
_DEFAULT_REASON = {
    "NotFoundError": "SESSION_NOT_FOUND",
    "BudgetExceededError": "BUDGET_EXCEEDED",
}
_STATUSES = "INVALID_ARGUMENT|NOT_FOUND|FAILED_PRECONDITION|ABORTED|RESOURCE_EXHAUSTED|UNAVAILABLE"


def _raised_pairs(path: Path) -> set[tuple[str, str, str]]:
    """(status, reason, where) of every error constructed directly by type name."""
    tree = ast.parse(path.read_text())
    names = _constants(tree)
    out = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        kind = node.func.id
        if kind not in _STATUS_OF_ERROR:
            continue
        given = [kw.value for kw in node.keywords if kw.arg == "reason"]
        if given and isinstance(given[0], ast.Constant):
            reason = given[0].value
        elif given and isinstance(given[0], ast.Name) and given[0].id in names:
            reason = names[given[0].id]
        elif given:
            continue  # a reason passed through (re-raised); its origin is checked there
        else:
            reason = _DEFAULT_REASON.get(kind, "INVALID_FIELD")
        out.add((_STATUS_OF_ERROR[kind], reason, f"{path.name}:{node.lineno}"))
    return out


def _documented_statuses() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "api.md").read_text()
    table = text[text.index("Reasons:") : text.index("## RPCs")]
    rows = re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", table, flags=re.MULTILINE)
    return {reason: set(re.findall(_STATUSES, cell)) for reason, cell in rows}


def test_each_reason_is_sent_with_a_status_its_row_names() -> None:
    """A reason sent under a status docs/api.md does not give it misleads every client
    that branches on the status (the clients pick their error class by it)."""
    documented = _documented_statuses()
    paths = [p for p in SERVICE.rglob("*.py") if "_gen" not in p.parts]
    pairs = set().union(*map(_raised_pairs, paths))
    assert len(pairs) >= 30  # the scan sees the raises
    wrong = sorted(
        f"{where}: {reason} as {status}"
        for status, reason, where in pairs
        if status not in documented.get(reason, set())
    )
    assert wrong == []


def test_a_refusal_quoting_a_long_value_stays_within_what_clients_accept() -> None:
    """A refusal's message and metadata can quote what the caller sent. One quoting a
    13,000-character browser profile id made trailing metadata of 39 kB, which gRPC
    clients refuse past 16 kB: the caller got a bare RESOURCE_EXHAUSTED, its details
    lost (the fuzz test). Message and metadata values are bounded in UTF-8 bytes."""
    from context_engine.api.errors import MAX_MESSAGE_BYTES, MAX_METADATA_BYTES, status_for
    from context_engine.core.errors import PreconditionError

    long = "é" * 20_000
    _, status = status_for(
        PreconditionError(
            f"profile {long!r} is not served", field="x", reason="RUN_STATE", metadata={"p": long}
        )
    )
    assert len(status.SerializeToString()) < 8_192
    assert len(status.message.encode()) <= MAX_MESSAGE_BYTES and status.message.endswith("…")
    from google.rpc import error_details_pb2

    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert len(info.metadata["p"].encode()) <= MAX_METADATA_BYTES
    short = status_for(PreconditionError("short", reason="RUN_STATE"))[1]
    assert short.message == "short"
