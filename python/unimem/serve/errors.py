"""The errors a route answers with, in OpenAI's error shape.

:class:`ApiError` carries what the response says (status, message, offending parameter,
machine-readable code, extra headers); :func:`error_body` is the JSON body
``{"error": {"message", "type", "param", "code"}}`` every route returns for it.
"""

from __future__ import annotations

__all__ = ["DEFAULT_CODES", "ApiError", "error_body"]


class ApiError(Exception):
    """An error answered with an OpenAI error body: ``status`` (400, 401, 404, 503, ...),
    ``message``, the offending ``param`` and a machine-readable ``code`` (never None: without
    one, the status's default code). ``headers``: extra response headers (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or DEFAULT_CODES.get(
            status, "invalid_request" if status < 500 else "server_error"
        )
        self.type = type or _error_type(status)
        self.headers = headers


DEFAULT_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    503: "service_unavailable",
}
"""The code of an error raised without one, by status (every error body carries a code)."""


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable_error"
    return "invalid_request_error"


def error_body(err: ApiError) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``: OpenAI's error shape."""
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }
