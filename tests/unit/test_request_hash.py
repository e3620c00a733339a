"""api/request_hash.py: ids the handler parsed hash in their canonical spelling."""

from __future__ import annotations

from uuid import UUID

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.api.request_hash import request_sha256
from context_engine.store.idempotency import same_request

SESSION = UUID("8f0c2d1e-1b2a-4c3d-9e8f-0a1b2c3d4e5f")
PARENT = UUID("11111111-2222-4333-8444-555555555555")


def _child(session: str, parent: str) -> pb.StartRunRequest:
    return pb.StartRunRequest(
        tenant_id="t",
        session_id=session,
        idempotency_key="k",
        child=pb.ChildSeed(parent_run_id=parent, instruction="go"),
    )


def test_spellings_of_the_same_ids_hash_alike_and_the_request_is_left_as_sent() -> None:
    canonical = _child(str(SESSION), str(PARENT))
    respelt = _child("{" + str(SESSION).upper() + "}", "urn:uuid:" + str(PARENT))
    ids = {"session_id": SESSION, "child.parent_run_id": PARENT}
    assert request_sha256(respelt, ids) == request_sha256(canonical, ids)
    # Rule 1: canonical spelling hashes as the bare bytes did before the rule.
    bare = request_sha256(canonical)
    assert request_sha256(canonical, ids) == bare
    assert respelt.session_id.startswith("{")  # hashed from a copy
    # Another id, or other content, is another request.
    other = _child(str(SESSION), str(SESSION))
    assert request_sha256(other, {"session_id": SESSION, "child.parent_run_id": SESSION}) != bare
    worded = _child(str(SESSION), str(PARENT))
    worded.child.instruction = "stop"
    assert request_sha256(worded, ids) != bare


def test_an_id_the_caller_left_unset_is_hashed_as_sent() -> None:
    request = pb.StartRunRequest(tenant_id="t", session_id=str(SESSION))
    assert request_sha256(request, {"session_id": SESSION, "run_id": None}) == request_sha256(
        request
    )


def test_a_stored_hash_of_the_bytes_as_sent_is_the_same_request() -> None:
    """Rule 3: a key an older version stored (the hash of the bytes as sent) matches."""
    respelt = _child(str(SESSION).upper(), str(PARENT))
    ids = {"session_id": SESSION, "child.parent_run_id": PARENT}
    digest = request_sha256(respelt, ids)
    assert digest.as_sent == request_sha256(respelt) != digest
    assert same_request(digest.as_sent, digest) and same_request(str(digest), digest)
    other = request_sha256(
        _child(str(SESSION).upper(), str(SESSION)),
        {"session_id": SESSION, "child.parent_run_id": SESSION},
    )
    assert not same_request(other.as_sent, digest) and not same_request(other, digest)
