"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every error Seawall returns to a client, and every error the emulator returns, is built
here so that the shape, the status and the `type` string stay consistent. The `type`
strings follow vLLM 0.33 (`BadRequestError`, `NotFoundError`, ...), which is also what
the OpenAI SDK maps to its exception classes by status code.
"""

from __future__ import annotations

import math
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


# Codes of refusals a client's own retry cannot help with although their status says
# "later": the gateway has already retried as far as the fleet-wide budget allows.
_FINAL_CODES = frozenset({"retry_budget_exhausted"})


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

    @property
    def client_may_retry(self) -> bool:
        """Whether a client's retry can help, as the `x-should-retry` header tells the
        OpenAI SDKs (which otherwise retry every 5xx on their own, on top of the
        gateway's retries). Yes for a refusal that is about now (429: a limit or a
        saturated fleet; 503: draining, no replica yet), with Retry-After saying when.
        No for the rest: the request itself is at fault (4xx), or the gateway has
        already tried the replicas it could (502, 504, an engine's 5xx), or the
        fleet-wide retry budget is spent."""
        return self.status in (429, 503) and self.code not in _FINAL_CODES

    def response_headers(self) -> dict[str, str]:
        return {
            **self.headers,
            "Content-Type": self.content_type,
            "x-should-retry": "true" if self.client_may_retry else "false",
        }

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
    return ApiError(429, message, code=code, headers=retry_after_headers(retry_after_s))


def unavailable(
    message: str, retry_after_s: float | None = None, code: str | None = None
) -> ApiError:
    headers = {} if retry_after_s is None else retry_after_headers(retry_after_s)
    return ApiError(503, message, code=code, headers=headers)


def retry_after_headers(seconds: float) -> dict[str, str]:
    """`Retry-After` in whole seconds (RFC 9110), and `retry-after-ms`, which the OpenAI
    SDKs prefer, for waits that whole seconds would round up a long way (0.2 s -> 1 s)."""
    return {
        "Retry-After": str(retry_after_header(seconds)),
        "retry-after-ms": str(max(1, math.ceil(seconds * 1000))),
    }


def retry_after_header(seconds: float) -> int:
    """Retry-After is whole seconds (RFC 9110); round up so a client never comes back early."""
    whole = int(seconds)
    return max(1, whole if whole == seconds else whole + 1)
