"""What parse_json_object accepts reads back from PostgreSQL's jsonb as the same canonical
bytes, once the store reads it as parsed (core/canonical.py as_parsed): a spec is stored as
jsonb (store/plans.py) and hashed again whenever its plan is rebuilt, and jsonb gave a
double of 1e21 or more back as an integer past 2**53, which canonical JSON refuses, so
every rebuild of such a plan failed INTERNAL (an audit)."""

from __future__ import annotations

import json
import random
from typing import Any

import grpc
import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.core.canonical import as_parsed, canonical_bytes, parse_json_object

from .helpers import TENANT, new_id, spec


def _numbers() -> list[str]:
    """Doubles across every magnitude, both signs, with random mantissas, and the edges."""
    rng = random.Random(8)
    found = ["9007199254740991", "1e21", "-1e21", "1.7976931348623157e308", "5e-324", "-0.0"]
    for exponent in range(-300, 301, 7):
        for _ in range(3):
            value = rng.uniform(1, 10) * 10.0**exponent * rng.choice((1, -1))
            found += [repr(value), f"{value:.17g}"]
    return found


async def test_every_accepted_number_reads_back_from_jsonb_as_the_same_bytes(pool: Any) -> None:
    documents = [f'{{"n": {number}}}' for number in _numbers()]
    accepted = []
    for document in documents:
        try:
            accepted.append(parse_json_object(document))
        except ValueError:
            continue
    assert len(accepted) > len(documents) * 3 // 4  # most of the range is accepted
    back = await pool.fetch(
        "SELECT (t::jsonb) AS value FROM unnest($1::text[]) WITH ORDINALITY AS u(t, n) ORDER BY n",
        [json.dumps(value) for value in accepted],
    )
    for value, row in zip(accepted, back, strict=True):
        assert canonical_bytes(as_parsed(row["value"])) == canonical_bytes(value), value


async def test_a_plan_whose_spec_holds_a_huge_double_is_rebuilt(stub: Any) -> None:
    """Rotate without spec rebuilds the plan from the stored spec: it failed INTERNAL."""
    planned = spec()
    planned.tools[0].input_schema_json = json.dumps(
        {
            "type": "object",
            "properties": {
                "n": {"type": "number", "maximum": 1e21, "minimum": -1.7976931348623157e308}
            },
        }
    )
    session_id = new_id()
    plan = (
        await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=session_id, spec=planned))
    ).plan
    rotated = await stub.Rotate(
        pb.RotateRequest(
            tenant_id=TENANT,
            session_id=session_id,
            from_epoch=plan.epoch,
            reason=pb.PLAN_REASON_BUILDER_UPGRADED,
        )
    )
    assert rotated.plan.epoch == plan.epoch + 1
    assert rotated.plan.tool_schema_sha256 == plan.tool_schema_sha256
    with pytest.raises(grpc.aio.AioRpcError):  # a real integer past 2**53 stays refused
        bad = spec()
        bad.tools[0].input_schema_json = '{"type": "object", "maximum": 10000000000000000000001}'
        await stub.Plan(pb.PlanRequest(tenant_id=TENANT, session_id=new_id(), spec=bad))
