"""The attachment budget is the request's (ADR-0120, core/body_estimate.py Rule 4).

The adapter sends markers instead of content past ATTACHMENT_TOKEN_BUDGET, wherever in
the request the content lies, so the body estimate counts every reference's label and at
most that budget of content over all of the request's messages, not per message. Over
generated sessions whose carried and current user messages carry images, PDFs and text
files (at the flat image figure and at gpt-4o-mini's 48,200):

- the body estimate is exactly the blocks' text, the placed references' labels and
  min(budget, their content), measured here from the request without the engine's costs;
- the history kept is the largest suffix whose request, so measured, fits the body: one
  more carried message would not;
- assembly that walks the whole history decides what the windowed one decides (the walk's
  least cost of a message leaves its content out: newer messages may take the budget).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

from hypothesis import example, given
from hypothesis import strategies as st

from context_engine.core import BudgetExceededError, BuildInputs, Checkpoint, assemble
from context_engine.core.body_estimate import attached_content, block_tokens
from context_engine.core.estimator import (
    ATTACHMENT_BLOCK_TOKENS,
    ATTACHMENT_TOKEN_BUDGET,
    IMAGE_TOKENS,
    PDF_PAGE_TOKENS,
    apply_factor,
)
from context_engine.core.items import AssistantMessage, Attachment, ConversationItem, UserMessage
from context_engine.core.request import ModelRequest

from .strategies import small_plan
from .test_budget import GATE, NOW, SECRET, assert_the_window_decides_as_the_whole_history, count

MINI_IMAGE_TOKENS = 48_200  # gpt-4o-mini's registry figure


@dataclass
class Session:
    carried: list[ConversationItem]
    run: list[ConversationItem]
    body_room: int
    image_tokens: int


_ATTACHMENT = st.one_of(
    st.builds(lambda n: Attachment(kind="image", ref=f"photo{n}.png"), st.integers(0, 99)),
    st.builds(
        lambda n, pages: Attachment(kind="pdf", ref=f"doc{n}.pdf", pages=pages),
        st.integers(0, 99),
        st.sampled_from([1, 3, 12]),
    ),
    st.builds(
        lambda n, size: Attachment(kind="text_file", ref=f"notes{n}.txt", text_length=size),
        st.integers(0, 99),
        st.sampled_from([40, 5_000, 30_000, 70_000]),
    ),
)


@st.composite
def sessions(draw: st.DrawFn) -> Session:
    """Conversations of user and assistant messages only (nothing yields but history), the
    user messages with zero to three attachments each."""
    sequence = 0

    def message(kind: str, run_id: str, n: int) -> ConversationItem:
        nonlocal sequence
        sequence += 1
        text = "lorem ipsum " * draw(st.integers(1, 60))
        if kind == "a":
            return AssistantMessage(item_id=f"a{n}", text=text, sequence=sequence, run_id=run_id)
        attachments = tuple(draw(st.lists(_ATTACHMENT, max_size=3)))
        return UserMessage(
            item_id=f"{kind}{n}",
            text=text,
            attachments=attachments,
            sequence=sequence,
            run_id=run_id,
        )

    carried: list[ConversationItem] = []
    for n in range(draw(st.integers(0, 12))):
        carried += [message("u", f"r{n}", n), message("a", f"r{n}", n)]
    run = [message("c", "current", 0)]
    if draw(st.booleans()):  # supplemental input, unanswered: it stays last
        run.append(message("c", "current", 1))
    return Session(
        carried=carried,
        run=run,
        body_room=draw(st.integers(2_000, 150_000)),
        image_tokens=draw(st.sampled_from([IMAGE_TOKENS, MINI_IMAGE_TOKENS])),
    )


def _inputs(session: Session) -> BuildInputs:
    window = 400_000
    probe = small_plan(window, 0, 1_000, secret=SECRET, count=count)
    cap = probe.prefix_tokens + 1_000 + session.body_room
    return BuildInputs(
        tenant_id="t",
        plan=small_plan(window, cap, 1_000, secret=SECRET, count=count),
        secret=SECRET,
        checkpoint=Checkpoint(run_id="current", version=1, items=tuple(session.run)),
        carried=tuple(session.carried),
        now=NOW,
        count_tokens=count,
        image_tokens=session.image_tokens,
    )


def _measured(request: ModelRequest, items: dict[str, ConversationItem], image_tokens: int) -> int:
    """The body of `request` as the adapter's request-wide budget bounds it: every block's
    text, every placed reference's label, and at most the budget of content in all."""
    blocks = [b for m in request.messages for b in m.blocks]
    text = sum(block_tokens(b, AssistantMessage(text=""), count, 1_000_000) for b in blocks)
    placed = [items[b.item_id] for b in blocks if b.item_id in items]
    labels = sum(
        count(a.ref) + ATTACHMENT_BLOCK_TOKENS
        for i in placed
        if isinstance(i, UserMessage)
        for a in i.attachments
    )
    content = sum(attached_content(i, image_tokens) for i in placed)
    return text + labels + min(content, ATTACHMENT_TOKEN_BUDGET)


def _at_the_framings_edge() -> Session:
    """A history whose oldest message fits the body only if the framing is left out."""
    pdf = (Attachment(kind="pdf", ref="doc0.pdf", pages=12),)

    def turn(n: int, attachments: tuple[Attachment, ...] = ()) -> list[ConversationItem]:
        return [
            UserMessage(
                item_id=f"u{n}",
                sequence=2 * n + 1,
                run_id=f"r{n}",
                text="lorem ipsum ",
                attachments=attachments,
            ),
            AssistantMessage(
                item_id=f"a{n}", sequence=2 * n + 2, run_id=f"r{n}", text="lorem ipsum "
            ),
        ]

    current = UserMessage(
        item_id="c0", sequence=7, run_id="current", text="lorem ipsum ", attachments=pdf
    )
    return Session([*turn(0), *turn(1), *turn(2, pdf)], [current], 67_546, 1_600)


@GATE
@given(sessions())
@example(_at_the_framings_edge())
def test_the_body_counts_the_request_wide_attachment_budget_and_keeps_the_largest_suffix(
    session: Session,
) -> None:
    inputs = _inputs(session)
    # The body as Build divides it: less the request's framing, which no class holds
    # (context-assembler@13). Allocated without it, the body was larger than Build's by the
    # framing's tokens, and a history whose next message fit that larger body exactly
    # failed this test although Build had no room for it (a CI run).
    budget = importlib.import_module("context_engine.core.assemble")._budget(inputs)
    assert budget.framing_tokens > 0
    try:
        built = assemble(inputs)
    except BudgetExceededError:
        return  # the current messages alone are over the body
    if built.needs_compaction:
        return  # history at its floor does not fit beside them
    request = built.request
    assert request is not None
    items = {i.item_id: i for i in (*session.carried, *session.run)}
    body = _measured(request, items, session.image_tokens)
    assert body == built.body_estimated_tokens <= budget.body_tokens
    # The suffix kept is the largest that fits: with the next older message, the request
    # (measured the same way: its content shares the one budget) would be over the body.
    pressure = built.pressure
    assert pressure is not None and pressure.steps == ()
    cut = pressure.history_cut_index
    if cut == 0:
        return  # every carried message is in
    older = session.carried[cut - 1]
    placed = [items[b.item_id] for m in request.messages for b in m.blocks if b.item_id in items]
    content = sum(attached_content(i, session.image_tokens) for i in placed)
    more = attached_content(older, session.image_tokens)
    labels = sum(
        count(a.ref) + ATTACHMENT_BLOCK_TOKENS
        for a in (older.attachments if isinstance(older, UserMessage) else ())
    )
    text = block_tokens(_block_of(older), AssistantMessage(text=""), count, 1_000_000)
    shared = min(content + more, ATTACHMENT_TOKEN_BUDGET) - min(content, ATTACHMENT_TOKEN_BUDGET)
    assert body + text + labels + shared > budget.body_tokens


@GATE
@given(sessions())
def test_each_message_is_told_to_send_its_share_of_the_budget_and_no_more(
    session: Session,
) -> None:
    """What BuildResponse.attachment_placements carries (core/attachment_sends.py): one
    entry per placed user message with attachments, in request order, naming its text
    block. The shares are the budget divided newest first, in all min(budget, content):
    what the estimate counted (the test above measures the estimate so), so the content
    sent, at most each share, is at most what the estimate counted. An attachment sent as
    its marker did not fit what was left of its message's share."""
    inputs = _inputs(session)
    try:
        built = assemble(inputs)
    except BudgetExceededError:
        return
    request = built.request
    if request is None:
        assert built.attachments == ()
        return
    items = {(i.item_id, i.sequence): i for i in (*session.carried, *session.run)}
    attached = [
        (n, k, items[b.item_id, b.source_sequence])
        for n, m in enumerate(request.messages)
        for k, b in enumerate(m.blocks)
        if isinstance(items.get((b.item_id, b.source_sequence)), UserMessage)
        and items[b.item_id, b.source_sequence].attachments  # type: ignore[union-attr]
    ]
    sends = built.attachments
    assert [(s.message_index, s.block_index) for s in sends] == [(n, k) for n, k, _ in attached]
    room = ATTACHMENT_TOKEN_BUDGET
    for placed, (_, _, item) in reversed(list(zip(sends, attached, strict=True))):
        assert isinstance(item, UserMessage)
        assert (placed.item_id, placed.source_sequence) == (item.item_id, item.sequence)
        assert tuple(a.attachment for a in placed.sends) == item.attachments
        # Counted: what fits the budget alone (core/body_estimate.py Rule 3).
        counted = [a.content_tokens for a in placed.sends]
        content = sum(c for c in counted if c <= ATTACHMENT_TOKEN_BUDGET)
        assert content == attached_content(item, session.image_tokens)
        assert placed.share_tokens == min(content, room)  # newest first
        room -= placed.share_tokens
        left = placed.share_tokens
        for a in placed.sends:
            assert a.content == (a.content_tokens <= left)
            left -= a.content_tokens if a.content else 0
        assert left >= 0
    total = sum(attached_content(item, session.image_tokens) for _, _, item in attached)
    assert sum(s.share_tokens for s in sends) == min(total, ATTACHMENT_TOKEN_BUDGET)


def _block_of(item: ConversationItem):  # type: ignore[no-untyped-def]
    assembly = importlib.import_module("context_engine.core.assemble")
    return assembly._rendered(assembly.Row.CONVERSATION, item, SECRET, False)


@GATE
@given(sessions())
def test_walking_every_carried_message_decides_what_the_window_decides(
    session: Session,
) -> None:
    """The walk leaves out history no fitting request reaches; a message's least cost
    there is without its attachment content, which newer messages may have taken. With
    every item costed (unbounded reach, nothing remembered), the request is the same."""
    assert_the_window_decides_as_the_whole_history(_inputs(session))


def _image_message(item_id: str, sequence: int, run_id: str) -> UserMessage:
    return UserMessage(
        item_id=item_id,
        text="What about this one?",
        attachments=(Attachment(kind="image", ref=f"{item_id}.png"),),
        sequence=sequence,
        run_id=run_id,
    )


def test_three_gpt_4o_mini_images_cost_one_budget_not_three() -> None:
    """gpt-4o-mini counts an image at 48,200 tokens. Two earlier turns and the new message
    each carry one: the adapter sends at most 64,000 tokens of their content, and the body
    estimate said 144,600 (each message capped on its own), so a 100,000-token body cut
    both earlier turns. Now the three share the budget and both turns are kept."""
    carried: list[ConversationItem] = []
    for n in range(2):
        carried += [
            _image_message(f"u{n}", 2 * n + 1, f"r{n}"),
            AssistantMessage(item_id=f"a{n}", text="A cat.", sequence=2 * n + 2, run_id=f"r{n}"),
        ]
    session = Session(
        carried=carried,
        run=[_image_message("c0", 5, "current")],
        body_room=100_000,
        image_tokens=MINI_IMAGE_TOKENS,
    )
    built = assemble(_inputs(session))
    assert built.request is not None and built.pressure is not None
    assert built.pressure.history_cut_index == 0  # every earlier turn is in
    placed = {b.item_id for m in built.request.messages for b in m.blocks}
    assert {"u0", "a0", "u1", "a1", "c0"} <= placed
    items = {i.item_id: i for i in (*carried, *session.run)}
    assert built.body_estimated_tokens == _measured(built.request, items, MINI_IMAGE_TOKENS)
    assert built.body_estimated_tokens < ATTACHMENT_TOKEN_BUDGET + 1_000


def test_a_pdf_past_the_budget_costs_its_label_and_leaves_older_messages_the_budget() -> None:
    """A 30-page PDF in the new message (96,000 tokens of content) never fits the budget,
    so it is sent as its marker and costs its label alone: an older message's image then
    costs its label, its block and its content. It was charged the whole budget it never
    sent, and the older image its label alone (an audit: a 21-page PDF failed every Build
    of a small window)."""
    pdf = Attachment(kind="pdf", ref="report.pdf", pages=30)
    assert 30 * PDF_PAGE_TOKENS > ATTACHMENT_TOKEN_BUDGET
    older = _image_message("u0", 1, "r0")
    session = Session(
        carried=[older, AssistantMessage(item_id="a0", text="Noted.", sequence=2, run_id="r0")],
        run=[
            UserMessage(
                item_id="c0",
                text="Summarize this.",
                attachments=(pdf,),
                sequence=3,
                run_id="current",
            )
        ],
        body_room=90_000,
        image_tokens=IMAGE_TOKENS,
    )
    inputs = _inputs(session)
    with_older = assemble(inputs)
    without = assemble(replace(inputs, carried=()))
    assert with_older.request is not None and without.request is not None
    # The older turn adds its text, its image's label and its content.
    turn_text = sum(
        block_tokens(_block_of(i), AssistantMessage(text=""), count, 1_000_000)
        for i in session.carried
    )
    label = count(older.attachments[0].ref) + ATTACHMENT_BLOCK_TOKENS
    added = with_older.body_estimated_tokens - without.body_estimated_tokens
    assert added == turn_text + label + IMAGE_TOKENS
    # And the PDF costs its label alone: sent as its marker, never its content.
    (placed,) = [p for p in without.attachments if p.item_id == "c0"]
    assert [(a.content_tokens, a.content) for a in placed.sends] == [(30 * PDF_PAGE_TOKENS, False)]
    assert without.body_estimated_tokens < ATTACHMENT_TOKEN_BUDGET


def test_an_attachments_label_is_scaled_by_the_pinned_factor() -> None:
    """core/body_estimate.py Rules 2 and 3: a label is text, scaled by the factor as the
    message's text is. It was counted raw: at a factor of 4 a label was a quarter of its
    scaled figure (an audit)."""
    label = "quarterly-revenue-breakdown-by-region-and-product-line-2026.pdf"
    plain = UserMessage(item_id="u", text="See the report.", sequence=1, run_id="r")
    attached = plain.model_copy(
        update={"attachments": (Attachment(kind="pdf", ref=label, pages=1),)}
    )
    for factor in (1_000_000, 4_000_000):
        added = block_tokens(_block_of(attached), attached, count, factor) - block_tokens(
            _block_of(plain), plain, count, factor
        )
        scaled = apply_factor(count(label), factor)
        assert added == scaled + ATTACHMENT_BLOCK_TOKENS + PDF_PAGE_TOKENS
