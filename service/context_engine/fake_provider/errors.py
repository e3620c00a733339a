"""The one error type the API modules raise; each provider renders it in its own shape.

Anthropic ("Errors" in the API docs): HTTP status plus
``{"type": "error", "error": {"type": ..., "message": ...}, "request_id": "req_..."}``.
OpenAI ("Error codes" in the API docs): HTTP status plus
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
"""

from __future__ import annotations

__all__ = ["FakeApiError"]


class FakeApiError(Exception):
    """The request is wrong (4xx) or a scripted failure; rendered by the provider module.

    ``type`` is the provider's error type; when None the provider derives it from
    ``status``. ``param`` and ``code`` are OpenAI-only and ignored by Anthropic.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
