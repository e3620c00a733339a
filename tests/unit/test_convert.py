"""Proto -> core conversion (api/convert.py): values the wire allows and the core cannot
take are invalid fields (INVALID_ARGUMENT naming them), never internal errors.

Proto3 enums are open, so a client can send any number; a Timestamp can carry nanos outside
[0, 1e9) or a date no time zone can render.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.api.convert import plan_spec_from_proto, timestamp_to_datetime
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


@pytest.mark.parametrize(
    "stamp",
    [
        Timestamp(seconds=1_790_000_000, nanos=-1),
        Timestamp(seconds=1_790_000_000, nanos=1_000_000_000),
        Timestamp(seconds=2**62),
        Timestamp(seconds=-(2**62)),
        Timestamp(seconds=253_402_300_799),  # 9999-12-31: past year 9999 east of UTC
        Timestamp(seconds=-62_135_596_800),  # 0001-01-01: before year 1 west of UTC
    ],
)
def test_a_clock_no_zone_can_render_is_an_invalid_field(stamp: Timestamp) -> None:
    with pytest.raises(InvalidFieldError) as caught:
        timestamp_to_datetime(stamp, "now")
    assert caught.value.field == "now"


def test_the_widest_accepted_clocks_render_in_every_zone() -> None:
    for day in (datetime(1, 1, 3, tzinfo=UTC), datetime(9999, 12, 29, 23, 59, tzinfo=UTC)):
        stamp = Timestamp()
        stamp.FromDatetime(day)
        instant = timestamp_to_datetime(stamp, "now")
        assert instant == day
        for zone in ("Pacific/Kiritimati", "Etc/GMT+12", "Europe/Berlin"):
            instant.astimezone(ZoneInfo(zone))  # raises OverflowError if out of range


@pytest.mark.parametrize(
    ("listed", "field"),
    [
        (
            pb.PlanSpec(model_id="m", tools=[pb.ToolSpec(name="a"), pb.ToolSpec(name="a")]),
            "spec.tools[1].name",
        ),
        (
            pb.PlanSpec(
                model_id="m",
                skills=[
                    pb.SkillCatalogEntry(name="triage", version="1"),
                    pb.SkillCatalogEntry(
                        name="triage", version="2", trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
                    ),
                ],
            ),
            "spec.skills[1].name",
        ),
    ],
    ids=["tool", "skill"],
)
def test_a_name_listed_twice_is_an_invalid_field(listed: pb.PlanSpec, field: str) -> None:
    """A skill listed twice would pin two catalog blocks under one item id, and LoadSkill
    could take its version from one entry and its trust from the other: it is refused
    like a tool listed twice, naming the second entry."""
    with pytest.raises(InvalidFieldError) as caught:
        plan_spec_from_proto(listed, POLICY)
    assert caught.value.field == field
    assert status_for(caught.value)[0] == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("trust", [pb.TRUST_LEVEL_PLATFORM, pb.TRUST_LEVEL_MODEL])
def test_a_skill_catalog_entry_at_platform_or_model_trust_is_an_invalid_field(
    trust: int,
) -> None:
    """A loaded body takes its catalog entry's trust and renders in the user role, where
    PLATFORM and MODEL render bare: LoadSkill refuses both for a body, so the entry may not
    carry them either (else a load claiming nothing inherits them)."""
    listed = pb.PlanSpec(model_id="m", skills=[pb.SkillCatalogEntry(name="triage", trust=trust)])
    with pytest.raises(InvalidFieldError) as caught:
        plan_spec_from_proto(listed, POLICY)
    assert caught.value.field == "spec.skills[0].trust"
    assert status_for(caught.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    for allowed in (pb.TRUST_LEVEL_TRUSTED_CONFIGURATION, pb.TRUST_LEVEL_MEMORY):
        listed.skills[0].trust = allowed
        (entry,) = plan_spec_from_proto(listed, POLICY).skills
        assert entry.trust == allowed
