"""core/build_record.py: what a request's record keeps of its inputs, and how an erasure
takes a person's recall lines out of it (Rule 4)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from context_engine.core.assemble import StepContext
from context_engine.core.build_record import (
    ASSEMBLER_KEY,
    ASSEMBLER_VERSION,
    IMAGE_KEY,
    INPUTS_KEY,
    LEGACY_ASSEMBLER_VERSION,
    PEOPLE_KEY,
    REDACTED_KEY,
    SHOWN_FIELDS,
    assembler_of,
    delegated_messages,
    failed_result_line,
    fixed_texts,
    image_tokens_of,
    inputs_from_record,
    inputs_to_record,
    named_writers,
    recalled_people,
    redact_record,
    shown_items,
    text_call_ids,
)
from context_engine.core.estimator import IMAGE_TOKENS
from context_engine.core.items import CorrectionLineItem, KnowledgePassageItem, RecallLineItem

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
STEP = StepContext(
    recall=(
        RecallLineItem(item_id="memory:r1", text="Ana is allergic to nuts.", person_ids=("ana",)),
        RecallLineItem(item_id="memory:r2", text="Bo and Ana met.", person_ids=("bo", "ana")),
        RecallLineItem(item_id="memory:r3", text="The office is in Lyon."),
    ),
    corrections=(CorrectionLineItem(item_id="memory:c1", text="Bo moved.", person_ids=("bo",)),),
)


def _record() -> dict[str, object]:
    # Through JSON, as the store hands it back.
    payload = {INPUTS_KEY: inputs_to_record(NOW, STEP), PEOPLE_KEY: recalled_people(STEP)}
    return json.loads(json.dumps(payload))


def test_the_record_keeps_the_people_and_reads_back_the_same_step() -> None:
    record = _record()
    assert record[PEOPLE_KEY] == ["ana", "bo"]
    assert inputs_from_record(record) == (NOW, STEP)


def test_redacting_a_person_removes_exactly_their_lines() -> None:
    redacted, removed = redact_record(_record(), "ana")
    assert removed == 2
    assert redacted[REDACTED_KEY] is True and redacted[PEOPLE_KEY] == ["bo"]
    _, step = inputs_from_record(redacted)
    assert [line.item_id for line in step.recall] == ["memory:r3"]
    assert [line.item_id for line in step.corrections] == ["memory:c1"]
    assert "allergic" not in json.dumps(redacted)


def test_a_line_removed_for_one_person_leaves_the_other_indexed_until_their_erasure() -> None:
    """A line naming two people, removed by the first one's erasure: the record stays
    indexed under the other, who was sent in it too, and their erasure takes them out of
    the index with no line to remove, so a resend finds nothing (an audit: kept in the
    index, they were found and counted at every erasure; a review: taken out with the
    line, their erasure never learned the run that sent their memory)."""
    step = StepContext(
        recall=(RecallLineItem(item_id="memory:r1", text="Ana met Bo.", person_ids=("ana", "bo")),)
    )
    record = json.loads(
        json.dumps({INPUTS_KEY: inputs_to_record(NOW, step), PEOPLE_KEY: recalled_people(step)})
    )
    redacted, removed = redact_record(record, "ana")
    assert (removed, redacted[PEOPLE_KEY]) == (1, ["bo"])
    unindexed, removed = redact_record(redacted, "bo")
    assert (removed, unindexed[PEOPLE_KEY]) == (0, [])
    assert {**unindexed, PEOPLE_KEY: ["bo"]} == redacted


def test_a_person_no_line_names_changes_nothing() -> None:
    record = _record()
    assert redact_record(record, "cy") == (record, 0)
    assert REDACTED_KEY not in record


def test_the_recorded_step_lines_read_back_one_at_a_time() -> None:
    """Compaction reads the lines recorded Builds showed the model (Rule 6) line by line,
    as the store hands them back deduplicated: every tuple field of the step, each line as
    the item it was."""
    passage = KnowledgePassageItem(item_id="knowledge:k1", text="Refunds take 30 days.")
    step = StepContext(recall=STEP.recall, corrections=STEP.corrections, knowledge=(passage,))
    recorded = json.loads(json.dumps(inputs_to_record(NOW, step)))["step"]
    assert set(SHOWN_FIELDS) == {"recall", "corrections", "knowledge"}
    lines = [(name, line) for name in SHOWN_FIELDS for line in recorded[name]]
    assert set(shown_items([*lines, ("retired_field", {"x": 1})])) == {
        *step.recall,
        *step.corrections,
        passage,
    }


def test_a_record_without_an_assembler_is_read_as_the_legacy_one() -> None:
    """Rule 8: records written before the assembler was versioned name none; they were
    built by context-assembler@1, which sent failed results without the failed-result line
    and costed images at the flat figure, and GetBuild rebuilds them so. A current record
    names its assembler and its image figure."""
    legacy = _record()
    assert assembler_of(legacy) == LEGACY_ASSEMBLER_VERSION == "context-assembler@1"
    assert failed_result_line(legacy) is False
    assert image_tokens_of(legacy) == IMAGE_TOKENS
    current = {**legacy, ASSEMBLER_KEY: ASSEMBLER_VERSION, IMAGE_KEY: 2_500}
    assert assembler_of(current) == ASSEMBLER_VERSION != LEGACY_ASSEMBLER_VERSION
    assert failed_result_line(current) is True
    assert image_tokens_of(current) == 2_500


def test_only_a_record_of_context_assembler_3_on_read_a_childs_messages_as_its_parents() -> None:
    """Rule 8: @2 and @1 sent a child run's user messages (its instruction) as the user's
    words, <user> at USER trust; GetBuild renders their records so. From @3 on they are
    the parent agent's (core/seeding.py, Rule 4)."""
    legacy = _record()
    assert delegated_messages(legacy) is False
    assert delegated_messages({**legacy, ASSEMBLER_KEY: "context-assembler@2"}) is False
    assert ASSEMBLER_VERSION == "context-assembler@29"
    assert delegated_messages({**legacy, ASSEMBLER_KEY: ASSEMBLER_VERSION}) is True


def test_only_a_record_of_context_assembler_11_on_named_call_ids_in_the_text_form() -> None:
    """Rule 8: @10 and older sent Anthropic's no-tools text form naming no call ids;
    GetBuild renders their records so."""
    legacy = _record()
    assert text_call_ids(legacy) is False
    assert text_call_ids({**legacy, ASSEMBLER_KEY: "context-assembler@10"}) is False
    assert text_call_ids({**legacy, ASSEMBLER_KEY: ASSEMBLER_VERSION}) is True


def test_only_a_record_of_context_assembler_13_on_counted_the_renderers_fixed_texts() -> None:
    """Rule 9: @12 and older estimated no failed result's line and no request framing;
    GetBuild counts their records so, and their figures match."""
    legacy = _record()
    assert fixed_texts(legacy) is False
    assert fixed_texts({**legacy, ASSEMBLER_KEY: "context-assembler@12"}) is False
    assert fixed_texts({**legacy, ASSEMBLER_KEY: ASSEMBLER_VERSION}) is True


def test_only_a_record_of_context_assembler_12_on_named_the_working_states_writers() -> None:
    """Rule 8: @11 and older rendered the working-state block naming no fact's writer;
    GetBuild renders their records so."""
    legacy = _record()
    assert named_writers(legacy) is False
    assert named_writers({**legacy, ASSEMBLER_KEY: "context-assembler@11"}) is False
    assert named_writers({**legacy, ASSEMBLER_KEY: ASSEMBLER_VERSION}) is True
