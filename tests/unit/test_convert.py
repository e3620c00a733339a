"""Proto -> core conversion (api/convert.py): an enum number the core does not know.

Proto3 enums are open, so a client can send any number; one the core has no member for is
an invalid field (INVALID_ARGUMENT naming it), never an internal error.
"""

from __future__ import annotations

import grpc
import pytest

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.api.convert import plan_spec_from_proto
from context_engine.api.errors import status_for
from context_engine.core import InvalidFieldError
from context_engine.core.enums import SessionKind, SideEffect
from context_engine.core.spec import PlatformPolicySpec

POLICY = PlatformPolicySpec(version="v", text="p")


def _spec(side_effect: int = 0, kind: int = 0) -> pb.PlanSpec:
    return pb.PlanSpec(
        model_id="m",
        tools=[
            pb.ToolSpec(name="a", side_effect=pb.SIDE_EFFECT_NONE),
            pb.ToolSpec(name="b", side_effect=side_effect),
        ],
        environment=pb.SessionEnvironment(kind=kind),
    )


def test_known_enum_numbers_convert() -> None:
    spec = plan_spec_from_proto(
        _spec(side_effect=pb.SIDE_EFFECT_NETWORK_WRITE, kind=pb.SESSION_KIND_SCHEDULED), POLICY
    )
    assert [t.side_effect for t in spec.tools] == [SideEffect.NONE, SideEffect.NETWORK_WRITE]
    assert spec.environment.kind is SessionKind.SCHEDULED
    assert plan_spec_from_proto(_spec(), POLICY).environment.kind is SessionKind.INTERACTIVE


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (_spec(side_effect=99), "spec.tools[1].side_effect"),
        (_spec(kind=99), "spec.environment.kind"),
    ],
)
def test_an_unknown_enum_number_is_an_invalid_field(spec: pb.PlanSpec, field: str) -> None:
    with pytest.raises(InvalidFieldError) as caught:
        plan_spec_from_proto(spec, POLICY)
    assert caught.value.field == field
    assert status_for(caught.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
