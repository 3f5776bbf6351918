"""Mid-stream migration: continue a stream on another replica after its replica died.

Retry is only safe before the first token; after it, the client holds part of the
answer. Migration makes the rest of the answer come from another replica instead of
failing the stream: the prompt is re-sent with the text already delivered appended
(for chat, as a partial assistant message that the engine continues, vLLM's
`continue_final_message: true` with `add_generation_prompt: false`), `max_tokens`
reduced by what was already produced, and the continuation is relayed on the same
client stream with the original id and `created`, and one combined `usage`.

At temperature 0 an engine's continuation of its own partial output is the rest of the
output it would have produced, so the client receives the same text as an uninterrupted
run (tested against `seawall sim`). At higher temperatures the text differs from what
would have been, but stays a coherent continuation.

Pure: builds request bodies and rewrites events; the proxy does the I/O.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson

from seawall.protocol.openai import ParsedRequest


def continuation_body(
    req: ParsedRequest, delivered_text: str, delivered_tokens: int
) -> bytes | None:
    """The request that continues `req` after `delivered_text`; None when nothing is left."""
    obj: dict[str, Any] = copy.deepcopy(req.obj)
    field = req.max_tokens_field()
    max_tokens = obj.get(field)
    if isinstance(max_tokens, int):
        remaining = max_tokens - delivered_tokens
        if remaining < 1:
            return None
        obj[field] = remaining
    if req.route == "chat":
        messages = list(obj["messages"])
        last = messages[-1] if messages else None
        if (
            isinstance(last, dict)
            and last.get("role") == "assistant"
            and obj.get("continue_final_message")
        ):
            # Already a continuation request from the client: extend its partial message.
            messages[-1] = {**last, "content": str(last.get("content") or "") + delivered_text}
        else:
            messages.append({"role": "assistant", "content": delivered_text})
        obj["messages"] = messages
        obj["continue_final_message"] = True
        obj["add_generation_prompt"] = False
    else:
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            return None  # token-id or batched prompts: no text to append to
        obj["prompt"] = prompt + delivered_text
    # The continuation must report usage so the client gets one combined usage.
    opts = obj.get("stream_options")
    obj["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return orjson.dumps(obj)


def combined_usage(continuation: dict[str, Any], delivered_tokens: int) -> dict[str, Any]:
    """Usage as if one replica had served the whole request.

    The continuation's prompt included the delivered tokens; move them back to the
    completion side.
    """
    prompt = int(continuation.get("prompt_tokens", 0)) - delivered_tokens
    completion = int(continuation.get("completion_tokens", 0)) + delivered_tokens
    return {
        **continuation,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
