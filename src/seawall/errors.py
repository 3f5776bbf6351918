"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every error Seawall returns to a client, and every error the emulator returns, is built
here so that the shape, the status and the `type` string stay consistent. The `type`
strings follow vLLM 0.33 (`BadRequestError`, `NotFoundError`, ...), which is also what
the OpenAI SDK maps to its exception classes by status code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

# Status -> `type` string, as vLLM 0.33 renders them.
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeout",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGateway",
    503: "ServiceUnavailableError",
    504: "GatewayTimeout",
}


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    """An error that becomes one HTTP response (or one SSE error event)."""

    status: int
    message: str
    param: str | None = None
    code: str | int | None = None
    type: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None  # an upstream error body relayed as the engine wrote it
    content_type: str = "application/json"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type or ERROR_TYPES.get(self.status, "InternalServerError"),
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def json_bytes(self) -> bytes:
        return self.raw if self.raw is not None else orjson.dumps(self.body())

    def sse_event(self) -> bytes:
        """The mid-stream error event, followed by `[DONE]`, as vLLM sends it."""
        return b"data: " + self.json_bytes() + b"\n\ndata: [DONE]\n\n"


def clip(client_text: str, limit: int = 100) -> str:
    """A client's string as it may appear in an error message or a log field: cut to
    `limit` characters, so that what a client sends can never make an answer or a log
    line large."""
    if len(client_text) <= limit:
        return client_text
    return client_text[:limit] + f"... ({len(client_text)} characters)"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def rate_limited(message: str, retry_after_s: float, code: str | None = None) -> ApiError:
    return ApiError(
        429, message, code=code, headers={"Retry-After": str(retry_after_header(retry_after_s))}
    )


def unavailable(
    message: str, retry_after_s: float | None = None, code: str | None = None
) -> ApiError:
    headers = (
        {} if retry_after_s is None else {"Retry-After": str(retry_after_header(retry_after_s))}
    )
    return ApiError(503, message, code=code, headers=headers)


def retry_after_header(seconds: float) -> int:
    """Retry-After is whole seconds (RFC 9110); round up so a client never comes back early."""
    whole = int(seconds)
    return max(1, whole if whole == seconds else whole + 1)
