"""One write at a time per session on this replica, queued without a connection.

Every write to a session takes the session's row lock (store/sessions.py) inside a pooled
transaction. Writes queued on one busy session (a worker retrying in parallel, a lock an
erasure or another replica holds) each held a pooled connection while they waited, and
about pool_max_size of them took the whole pool: every other tenant's calls on the
replica failed for want of a connection (an audit). They queue here instead, before a
connection is taken, so a session's waiters hold one connection between them.

A wait here longer than the store's lock wait (store/db.py LOCK_WAIT_SECONDS) is
SESSION_BUSY (ABORTED), as a wait for the row lock itself is: the session is busy, not the
database away, and nothing was written, so a retry with the same idempotency key is safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from uuid import UUID

from ..store.db import LOCK_WAIT_SECONDS, SessionBusyError

__all__ = ["SessionGates"]


@dataclass(slots=True)
class _Gate:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holding or waiting: the gate is dropped when none is left


class SessionGates:
    """A gate per (tenant, session) with a write holding or waiting on it: as many gates
    as sessions being written at once, each dropped with its last user."""

    def __init__(self, wait_seconds: float = LOCK_WAIT_SECONDS) -> None:
        self._wait_seconds = wait_seconds
        self._gates: dict[tuple[str, UUID], _Gate] = {}

    def __len__(self) -> int:
        return len(self._gates)

    @property
    def wait_seconds(self) -> float:
        return self._wait_seconds

    def busy(self, tenant: str, session_id: UUID) -> bool:
        """Whether a call through this replica holds or waits on the session's gate."""
        return (tenant, session_id) in self._gates

    @asynccontextmanager
    async def held(self, tenant: str, session_id: UUID) -> AsyncIterator[None]:
        """Hold the session's gate for a write (take it before the write's transaction).

        Raises:
            SessionBusyError: the gate was not free within the wait.
        """
        key = (tenant, session_id)
        gate = self._gates.setdefault(key, _Gate())
        gate.users += 1
        try:
            try:
                async with asyncio.timeout(self._wait_seconds):
                    await gate.lock.acquire()
            except TimeoutError:
                raise SessionBusyError(session_id, self._wait_seconds) from None
            try:
                yield
            finally:
                gate.lock.release()
        finally:
            gate.users -= 1
            if gate.users == 0:
                del self._gates[key]
