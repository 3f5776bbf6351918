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

Counting what was delivered. The continuation may produce only `max_tokens` minus what
the client already has, and the combined usage must say what it got, so the delivered
count must be tokens, not chunks: a chunk can hold several tokens (a vLLM step with
speculative decoding) or none (llama.cpp holds back a token that ends inside a UTF-8
character; vLLM's chat stream skips such empty deltas). Each engine says it in its own
dialect when asked (docs/engines-reference.md §4.6): vLLM and SGLang put a running
`usage` on every chunk with `stream_options.continuous_usage_stats`; llama.cpp puts
`timings.predicted_n` (and the prompt as `cache_n + prompt_n`) on every chunk with
`timings_per_token`; TGI sends one chunk per token. `counting_request` asks for it,
`running_count` reads it, and what the gateway added is stripped before the client
sees it.

Pure: builds request bodies and rewrites events; the relay does the I/O.
"""

from __future__ import annotations

import copy
from typing import Any

from seawall.protocol.openai import ParsedRequest


def continuation_body(
    req: ParsedRequest, delivered_text: str, delivered_tokens: int
) -> dict[str, Any] | None:
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
    return obj


def combined_usage(
    continuation: dict[str, Any], delivered_tokens: int, prompt_tokens: int | None = None
) -> dict[str, Any]:
    """Usage as if one replica had served the whole request.

    The continuation's prompt included the delivered text; it moves back to the
    completion side. With the original prompt's count known (`prompt_tokens`, reported by
    the first replica), that count stands; without it, the continuation's prompt minus
    the delivered tokens is the estimate (re-tokenizing text can split it differently).
    """
    if prompt_tokens is None:
        prompt_tokens = int(continuation.get("prompt_tokens", 0)) - delivered_tokens
    prompt = prompt_tokens
    completion = int(continuation.get("completion_tokens", 0)) + delivered_tokens
    return {
        **continuation,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


# Engines whose chunks carry a running usage when asked (`continuous_usage_stats`).
_USAGE_DIALECT = frozenset({"vllm", "vllm_legacy", "sglang"})


def counting_request(obj: dict[str, Any], engine: str) -> tuple[dict[str, Any], frozenset[str]]:
    """`obj` asking `engine` for a running token count on every chunk, and the chunk keys
    that adds which the client did not ask for (strip them from what is relayed). An
    engine with no such dialect (TGI: one chunk per token; unknown engines) is asked
    nothing."""
    if engine in _USAGE_DIALECT:
        opts = obj.get("stream_options")
        opts = opts if isinstance(opts, dict) else {}
        if opts.get("continuous_usage_stats") and opts.get("include_usage"):
            return obj, frozenset()
        asked = {**opts, "include_usage": True, "continuous_usage_stats": True}
        return {**obj, "stream_options": asked}, frozenset({"usage"})
    if engine == "llamacpp":
        if obj.get("timings_per_token"):
            return obj, frozenset()
        return {**obj, "timings_per_token": True}, frozenset({"timings"})
    return obj, frozenset()


def running_count(chunk: dict[str, Any]) -> tuple[int | None, int | None]:
    """(completion tokens so far, prompt tokens) as a chunk reports them, or None each."""
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        prompt = usage.get("prompt_tokens")
        return usage["completion_tokens"], prompt if isinstance(prompt, int) else None
    timings = chunk.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        cached, evaluated = timings.get("cache_n"), timings.get("prompt_n")
        prompt = (
            cached + evaluated if isinstance(cached, int) and isinstance(evaluated, int) else None
        )
        return timings["predicted_n"], prompt
    return None, None
