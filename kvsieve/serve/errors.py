"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

__all__ = ["CLIENT_CLOSED_REQUEST", "DRAIN_RETRY_AFTER", "APIError", "draining", "error_body", "quoted"]


class APIError(Exception):
    """A request the server refuses or cannot answer; ``message`` names the bad value and what is allowed."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def quoted(value: object, limit: int = 60) -> str:
    """A client's value as it is quoted in an error: ``repr`` of its first ``limit`` characters (and how long it
    was), so a megabyte sent in a field never becomes a megabyte answered."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(text) if isinstance(value, str) else text
    return f"{text[:limit]!r}... ({len(text)} characters)"


# nginx's "client closed request": counted for a client that left before its answer, never sent (no one reads it)
CLIENT_CLOSED_REQUEST = 499

DRAIN_RETRY_AFTER = 10  # seconds a client refused while the server shuts down is told to wait


def draining(message: str = "the server is shutting down") -> APIError:
    return APIError(503, f"{message}; retry after {DRAIN_RETRY_AFTER} s", code="draining", kind="server_error",
                    headers={"Retry-After": str(DRAIN_RETRY_AFTER)})
