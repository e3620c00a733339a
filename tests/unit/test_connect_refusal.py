"""store/db.py: a connection PostgreSQL's side never took is named in one line, with the
operating system's own words for why."""

from __future__ import annotations

import errno
import socket

from context_engine.store.db import _refusal

DSN = "postgresql://user:secret@db.example.invalid:5432/ctx"


def test_a_name_that_does_not_resolve_says_so() -> None:
    """A lookup's error carries a negative code, which os.strerror reads as "Unknown error
    -2": the message said that for a mistyped host."""
    lookup = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    refused = _refusal(DSN, lookup)
    assert refused is not None
    assert str(refused).endswith(": Name or service not known"), str(refused)
    assert "secret" not in str(refused) and "Unknown error" not in str(refused)


def test_a_refused_connection_names_the_address_and_why() -> None:
    refused = _refusal(DSN, ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"))
    assert refused is not None
    assert str(refused) == (
        "cannot connect to PostgreSQL at db.example.invalid:5432/ctx: Connection refused"
    )
