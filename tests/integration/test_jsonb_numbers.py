"""What parse_json_object accepts reads back from PostgreSQL's jsonb as the same canonical
bytes: a spec is stored as jsonb (store/plans.py) and hashed again whenever its plan is
rebuilt, so a number jsonb returns otherwise would make every rebuild fail (an audit:
`"maximum": 1e21` came back as an integer past 2**53, which canonical JSON refuses)."""

from __future__ import annotations

import json
import random

from context_engine.core.canonical import canonical_bytes, parse_json_object


def _numbers() -> list[str]:
    """Doubles across every magnitude, both signs, with random mantissas, and the edges."""
    rng = random.Random(8)
    found = ["9007199254740991", "9007199254740991.0", "9007199254740992.0", "1e21", "-0.0"]
    for exponent in range(-40, 41):
        for _ in range(4):
            value = rng.uniform(1, 10) * 10.0**exponent * rng.choice((1, -1))
            found += [repr(value), f"{value:.17g}"]
    return found


async def test_every_accepted_number_reads_back_from_jsonb_as_the_same_bytes(pool: object) -> None:
    documents = [f'{{"n": {number}}}' for number in _numbers()]
    accepted = []
    for document in documents:
        try:
            accepted.append(parse_json_object(document))
        except ValueError:
            continue
    assert len(accepted) > len(documents) // 2  # most of the range is accepted
    texts = [json.dumps(value) for value in accepted]
    back = await pool.fetch(  # type: ignore[attr-defined]
        "SELECT (t::jsonb)::text AS text FROM unnest($1::text[]) WITH ORDINALITY AS u(t, n)"
        " ORDER BY n",
        texts,
    )
    for value, row in zip(accepted, back, strict=True):
        assert canonical_bytes(json.loads(row["text"])) == canonical_bytes(value), value
