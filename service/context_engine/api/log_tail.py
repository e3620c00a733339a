"""Reading a run's carried history newest first, a page at a time (core/log_tail.py).

A Build reads the newest page of the run's carried range (floor < sequence < below) with
the run's head, then, once the plan says how far back a fitting request can reach
(core/assemble.py, carried_reaches), pages further back until the window is covered:
one page for a window the first page holds, a few more, each larger, for a wide one. The
events older than that are never read; how many items they carry comes from what the log
recorded with the events read (and, for a run with a summary, one more query). A replica
that has read the range for an earlier run reads only the events since, when they fit in
a page; when they do not (it has not served the session for a while), it reads the newest
page afresh instead, so no Build reads more than the window plus a page.
"""

from __future__ import annotations

from typing import Any, NamedTuple
from uuid import UUID

from ..core.log_tail import Logged, LogTail
from ..store import events

__all__ = ["FIRST_PAGE", "GROWTH", "Read", "read_newest", "read_older"]

# Events in the first page: a 16,000-token window reaches about 160 carried items (a
# 50-turn session's log is 200 events), and a page costs its events' parse.
FIRST_PAGE = 256
# Each further page is this many times the one before, so a window n pages wide takes
# about log(n) round trips.
GROWTH = 4


class Read(NamedTuple):
    tail: LogTail
    rows: list[Logged]  # the events read for it
    extended: bool  # the tail is the known one extended (else read afresh)


async def read_newest(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    floor: int,
    below: int,
    known: LogTail | None,
    page: int,
) -> Read:
    """The tail of the run's carried range, from its newest `page` events (Build reads
    FIRST_PAGE). `known`: a tail of the same session and floor whose `below` is at most
    this one's, which the events since extend when they fit in the page."""
    above = floor if known is None else max(floor, known.below - 1)
    rows = (
        await events.read_history_page(conn, tenant_id, session_id, below, above, page)
        if below > above + 1
        else []
    )
    if known is not None and len(rows) < page:
        return Read(known.extended(rows, below), rows, extended=True)
    complete = len(rows) < page
    facts = (
        None
        if complete or floor == 0
        else await events.read_floor_facts(conn, tenant_id, session_id, floor, below)
    )
    return Read(LogTail.read(floor, below, rows, complete=complete, facts=facts), rows, False)


async def read_older(conn: Any, tenant_id: str, session_id: UUID, tail: LogTail, page: int) -> Read:
    """`tail` with up to `page` more of the events before it read (it is incomplete)."""
    rows = await events.read_history_page(conn, tenant_id, session_id, tail.start, tail.floor, page)
    return Read(tail.prepended(rows, complete=len(rows) < page), rows, extended=False)
