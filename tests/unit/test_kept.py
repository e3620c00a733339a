"""api/kept.py: what a replica keeps across requests is bounded by weight, least recently
used first, and can be forgotten by key (an erasure rewrote a session's plans)."""

from __future__ import annotations

from context_engine.api.kept import Kept


def test_the_least_recently_used_go_first_once_the_weight_is_over() -> None:
    kept = Kept(max_weight=3)
    for key in "abc":
        kept.put(key, key.upper(), 1)
    assert kept.get("a") == "A"  # now the most recent
    kept.put("d", "D", 1)
    assert [kept.get(k) for k in "abcd"] == ["A", None, "C", "D"]


def test_a_value_heavier_than_the_whole_budget_is_not_kept_and_evicts_nothing() -> None:
    kept = Kept(max_weight=3)
    kept.put("a", "A", 2)
    kept.put("big", "B", 4)
    assert kept.get("big") is None
    assert kept.get("a") == "A"


def test_replacing_a_key_counts_its_weight_once() -> None:
    kept = Kept(max_weight=3)
    kept.put("a", "A", 2)
    kept.put("a", "A2", 2)
    kept.put("b", "B", 1)
    assert (kept.get("a"), kept.get("b")) == ("A2", "B")


def test_forgetting_by_key_frees_its_weight() -> None:
    kept = Kept(max_weight=4)
    for epoch in (1, 2):
        kept.put(("t", "s1", epoch), epoch, 1)
        kept.put(("t", "s2", epoch), epoch, 1)
    kept.drop_where(lambda key: key[:2] == ("t", "s1"))  # type: ignore[index]
    assert kept.get(("t", "s1", 1)) is None and kept.get(("t", "s1", 2)) is None
    # The two freed units take two more entries without evicting s2's.
    kept.put(("t", "s3", 1), 1, 1)
    kept.put(("t", "s3", 2), 2, 1)
    assert [kept.get(("t", "s2", e)) for e in (1, 2)] == [1, 2]
