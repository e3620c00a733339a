"""Bearer tokens follow `auth_tokens_file` while the server runs.

Rule 1 (rotation without restart): every `auth_tokens_reload_seconds` the file is looked
at (its inode, size, modification and change times: a Kubernetes secret volume swaps a
symlink, an editor renames over, a script writes in place, a chmod makes it readable);
when it changed, the tokens are read again with the inline `auth_tokens` and replace the
ones in use at once. A token removed from the file is refused from the next call on;
calls already past authentication finish. The file is stamped, then read, when the
follower starts: a change made while the replica started is taken.
Rule 2 (a bad file changes nothing): a file that cannot be read, is not a JSON object of
valid tokens, or leaves no token at all keeps the tokens in use, with one warning per change
of the file naming why (never a token). Emptying the file does not lock every worker out;
to revoke every token, stop the replicas.
Rule 3 (quiet when nothing changed): an unchanged file is not read again.
Rule 4 (a failed read is tried again): a changed file that could not be read (no file
descriptor left under load, a secret mid-swap) is looked at again at every check until it
is read, warned about once while it stays as it is: stamped as read, a removed token
stayed valid until the file changed again (an audit).
"""

from __future__ import annotations

import asyncio
import logging
import os

from ..config import Settings, TokenFileUnreadable
from .interceptors import BearerTokens

__all__ = ["TokenFile"]

_log = logging.getLogger("context_engine.server")

Stamp = tuple[int, int, int, int] | None
_NEVER = object()  # no read has failed


class TokenFile:
    """`tokens` (the server's BearerTokens) kept as `settings` reads them now."""

    def __init__(self, settings: Settings, tokens: BearerTokens) -> None:
        self._settings = settings
        self._tokens = tokens
        # Stamped, then read: `tokens` were read before, at start-up, and a change made
        # between that read and this stamp would otherwise never be taken (a review: a
        # token removed while the replica started stayed valid).
        self._stamp = self._stamp_now()
        self._unread: Stamp | object = _NEVER  # the file as it was when a read failed
        try:
            self._reload()
        except TokenFileUnreadable:
            self._stamp = None  # read again at the first check

    def _stamp_now(self) -> Stamp:
        try:
            st = os.stat(self._settings.auth_tokens_file)
        except OSError:
            return None  # gone for now (a secret being swapped): Rule 2 when it is read
        # ctime too: a chmod alone (a file made readable again) changes nothing else.
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def check(self) -> bool:
        """Reload the tokens if the file changed since the last check; True if they were
        replaced (Rules 1 to 4)."""
        stamp = self._stamp_now()
        if stamp == self._stamp:
            return False
        before, self._stamp = self._stamp, stamp
        try:
            if not self._reload():
                return False
        except TokenFileUnreadable:
            self._stamp = before  # Rule 4: looked at again at the next check
            return False
        _log.info("auth_tokens_file reloaded: %d tokens", self._count)
        return True

    def _reload(self) -> bool:
        """Take the tokens the settings read now; False, with a warning, if they cannot be.

        Raises:
            TokenFileUnreadable: the file could not be read (warned once per change)."""
        try:
            tokens = self._settings.bearer_tokens()
            self._tokens.replace(tokens)
        except TokenFileUnreadable as exc:
            if self._unread != self._stamp_now():
                _log.warning("auth_tokens_file not read, the tokens in use kept: %s", exc)
                self._unread = self._stamp_now()
            raise
        except ValueError as exc:  # the message names the problem, never a token
            _log.warning("auth_tokens_file not reloaded, the tokens in use kept: %s", exc)
            return False
        self._count, self._unread = len(tokens), _NEVER
        return True

    async def follow(self, interval: float) -> None:
        """check() every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.check()
            except Exception:  # a bug here must not end the following, nor the server
                _log.exception("auth_tokens_file: the check failed; trying again")
