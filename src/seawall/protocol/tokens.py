"""Prompt token counting: how many prompt tokens a request will cost, before it is sent.

Owns the `TokenCounter` seam and its two implementations: `HFTokenizerCounter` (the
model's own `tokenizer.json`, loaded from a local file with the `tokenizers` library:
exact for text, close for chat) and `EstimateCounter` (no tokenizer file: a documented
over-estimate). Also owns the walk over the OpenAI request shapes (`prompt` of a
completion, `messages` of a chat completion).

Must not: download anything, do I/O after construction, or read the clock. The count is
an up-front estimate for limits; the engine's reported `usage.prompt_tokens` is the truth,
and the limits backend reconciles with it when the request ends.

Every field that can reach the engine's prompt is counted, or the request is refused with
a 400 naming it (issue 11, item 6: a text part whose `text` was a list was skipped, and
3,816 prompt tokens passed a 200-token tier limit): text parts of every kind, media parts
(a documented per-item charge), embeddings (by their size), every other message field and
unknown part types (as their JSON text), `tools`, `functions`, `documents`, a client's
`chat_template` and its kwargs, token-id prompts, and every prompt of a batch, with
`suffix`. `count_request` also says how many sequences a request will produce (prompts
x `n`), since a batch of 200 prompts returned 200 choices while admission counted one.
The other routes the gateway passes through are counted by their own rule
(`protocol/routes.py` `Count`): the Responses API's `instructions` + `input` items, the
Messages API's `system` + `messages`, pooling inputs, every scored (query, document)
pair, a fixed charge per uploaded audio file, and nothing for the tokenizer routes.

Cost (issue 11, item 5): a 3.8 MB prompt took ~0.3 s to count on the event loop. Two
defences live here: `max_prompt_bytes`, a byte bound derived from a tier's token limit
that refuses before anything is counted, and `count_request_async`, which counts bodies
above `INLINE_COUNT_MAX_BYTES` in a worker thread. (The estimator is pure Python regex
work and holds the GIL, but the interpreter hands the GIL back every few milliseconds,
so the event loop keeps running between slices instead of stalling for the whole count;
the `tokenizers` library releases the GIL while it encodes.)

Chat counts are approximate even with the real tokenizer: the chat template (role markers,
system prompt defaults, tool schemas) is model-specific Jinja that we do not render. Each
message is charged its text plus a fixed per-message overhead, and the reply a fixed
priming overhead, as OpenAI's own cookbook does for its models.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import orjson

from seawall.errors import ApiError, bad_request
from seawall.protocol.openai import ParsedRequest
from seawall.protocol.routes import Count
from seawall.values import frozen


class TokenCounter(Protocol):
    """Counts tokens of plain text, and knows the fixed overheads the engine adds."""

    # Special tokens the engine adds once to a completion prompt (e.g. BOS).
    prompt_overhead_tokens: int
    # Template tokens around each chat message (role markers, separators).
    message_overhead_tokens: int
    # Template tokens that prime the assistant's reply, once per chat request.
    reply_overhead_tokens: int

    def count_text(self, text: str) -> int:
        """Tokens of `text` alone, without special tokens."""
        ...


class HFTokenizerCounter:
    """Counts with the model's `tokenizer.json` (Hugging Face `tokenizers`, local file)."""

    def __init__(
        self,
        path_to_tokenizer_json: str | Path,
        message_overhead_tokens: int = 4,
        reply_overhead_tokens: int = 3,
    ) -> None:
        # Imported here so that a gateway without a tokenizer file never loads the library.
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path_to_tokenizer_json))
        # What the tokenizer's post-processor adds to any input: BOS for Llama-style
        # models, nothing for GPT-style ones. vLLM adds these to completion prompts.
        self.prompt_overhead_tokens: int = len(
            self._tokenizer.encode("", add_special_tokens=True).ids
        )
        # ChatML: `<|im_start|>` role `\n` ... `<|im_end|>` `\n` is 4 tokens besides the
        # role; `<|im_start|>assistant\n` primes the reply in 3. Most templates are close.
        self.message_overhead_tokens = message_overhead_tokens
        self.reply_overhead_tokens = reply_overhead_tokens

    def count_text(self, text: str) -> int:
        if not text:
            return 0
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


# An optional space then ASCII letters: one "word" piece, as byte-level BPE pre-tokenizers
# (GPT-2, Llama 3, Qwen) and the emulator split text.
_ASCII_WORD = re.compile(r" ?[A-Za-z]+")
_CEIL_THIRDS = tuple((n + 2) // 3 for n in range(256))  # a word piece of n bytes costs this


class EstimateCounter:
    """A conservative estimate when no tokenizer file is configured.

    The rule, per piece of text:
    - a word (optional leading space + ASCII letters) costs ceil(bytes / 3). Real BPE
      vocabularies spell common English words, space included, in one token and average
      about 4 characters per token, so this over-counts ordinary prose by roughly half;
    - every other ASCII character (digit, punctuation, whitespace other than a word's
      leading space) costs 1. Real tokenizers often merge these (`":`, `\\n\\n`, runs of
      indentation, 3-digit groups) but never split them, so 1 each is an upper bound,
      and it is what keeps JSON, code and numbers from being under-counted by a pure
      bytes-per-token rule (Llama splits every digit into its own token);
    - every non-ASCII character costs its UTF-8 length minus one: 1 for accented Latin,
      Greek, Cyrillic (2 bytes), 2 for CJK (3 bytes; real vocabularies take 1-2), 3 for
      emoji (4 bytes). A rare character that a tokenizer spells byte by byte can cost
      one more than this.

    Over-counting is the safe side: the estimate is charged against a tenant's
    tokens-per-minute up front and the difference is refunded when the engine reports
    real usage, whereas an under-count would let a burst through before reconciliation.
    """

    def __init__(
        self,
        prompt_overhead_tokens: int = 1,
        message_overhead_tokens: int = 8,
        reply_overhead_tokens: int = 4,
    ) -> None:
        self.prompt_overhead_tokens = prompt_overhead_tokens
        # Twice ChatML's 4, to cover templates with longer role markers.
        self.message_overhead_tokens = message_overhead_tokens
        self.reply_overhead_tokens = reply_overhead_tokens

    def count_text(self, text: str) -> int:
        if not text:
            return 0
        # Counted without a per-character Python loop: only the word pieces are visited,
        # each by a table lookup of its length.
        lengths = list(map(len, _ASCII_WORD.findall(text)))
        try:
            word_tokens = sum(map(_CEIL_THIRDS.__getitem__, lengths))
        except IndexError:  # a word longer than the table
            word_tokens = sum((n + 2) // 3 for n in lengths)
        word_chars = sum(lengths)
        if text.isascii():
            return word_tokens + len(text) - word_chars
        ascii_chars = len(text.encode("ascii", "ignore"))
        non_ascii_chars = len(text) - ascii_chars
        non_ascii_bytes = len(text.encode("utf-8", "surrogatepass")) - ascii_chars
        return word_tokens + (ascii_chars - word_chars) + (non_ascii_bytes - non_ascii_chars)


# ------------------------------------------------------------------- charges and bounds

# Prompt tokens charged per media item, whose real cost only the engine's encoder knows
# (it depends on resolution, duration and the model). Generous for fixed-size encoders
# (LLaVA 576-2,880 per image, Whisper-style audio 750-1,500 per 30 s); dynamic-resolution
# models can exceed them for very large items, and reconciliation with the engine's
# usage corrects the rates afterwards.
MEDIA_TOKENS: dict[str, int] = {"image": 2048, "audio": 1500, "video": 8192, "file": 8192}
# Embeddings are one row per prompt token; no served LLM has rows narrower than 512
# values of 2 bytes, so the decoded size / 1,024 bounds the rows from above.
EMBED_BYTES_PER_TOKEN_FLOOR = 1024
# The byte bound: a tier admitting L prompt tokens refuses bodies over L x this + the
# allowance below, before counting. 10 covers every way a token can be spelt in JSON
# that the estimator counts as one: 4 bytes of prose, a `\uXXXX` escape (6), an 8-digit
# token id with its `, ` separator (10). A real tokenizer's rare long tokens (a run of
# 16 spaces) could exceed it: a tier can set its own bound.
PROMPT_BYTES_PER_TOKEN_CEILING = 10
# Room in the body for everything that is not prompt: model, sampling parameters, stop
# strings, a response_format schema, logit_bias.
NON_PROMPT_ALLOWANCE_BYTES = 64 * 1024
# Bodies up to this size are counted on the event loop (well under a millisecond);
# larger ones in a worker thread.
INLINE_COUNT_MAX_BYTES = 32 * 1024

_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "image_pil": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "audio": "audio",
    "video_url": "video",
    "video": "video",
    "file": "file",
    "input_file": "file",
}
_EMBED_PARTS = frozenset({"image_embeds", "audio_embeds", "video_embeds", "prompt_embeds"})
# Chat request fields a chat template may render into the prompt (vLLM 0.33).
_CHAT_PROMPT_FIELDS = ("tools", "functions", "documents", "chat_template_kwargs")


def max_prompt_bytes(
    max_prompt_tokens: int | None,
    bytes_per_token: int = PROMPT_BYTES_PER_TOKEN_CEILING,
    allowance_bytes: int = NON_PROMPT_ALLOWANCE_BYTES,
) -> int | None:
    """The largest body a tier with `max_prompt_tokens` can need (None: no bound)."""
    if max_prompt_tokens is None:
        return None
    return max_prompt_tokens * bytes_per_token + allowance_bytes


PROMPT_TOO_LARGE = "prompt_too_large"  # the code of a body over its tier's byte bound


def check_prompt_bytes(body_bytes: int, limit_bytes: int | None) -> ApiError | None:
    """A 413 for a body over the tier's byte bound, decided before any counting."""
    if limit_bytes is None or body_bytes <= limit_bytes:
        return None
    return ApiError(
        413,
        f"The request body is {body_bytes} bytes; this tier's prompt limit allows at most "
        f"{limit_bytes} bytes.",
        code=PROMPT_TOO_LARGE,
    )


# -------------------------------------------------------------------------- the count


@frozen
class PromptCount:
    """What a request will cost the engine, before it is sent."""

    per_prompt: tuple[int, ...]  # prompt tokens of each prompt (chat: one)
    n: int  # choices per prompt

    @property
    def prompt_tokens(self) -> int:
        """Across the batch: what the engine reports as `usage.prompt_tokens`."""
        return sum(self.per_prompt)

    @property
    def num_prompts(self) -> int:
        return len(self.per_prompt)

    @property
    def sequences(self) -> int:
        """Sequences the engine will run, each needing KV and a batch slot."""
        return len(self.per_prompt) * self.n

    @property
    def largest_prompt_tokens(self) -> int:
        return max(self.per_prompt, default=0)

    def max_completion_tokens(self, max_tokens: int) -> int:
        """The most completion tokens the request can produce (each sequence's max)."""
        return self.sequences * max_tokens

    def kv_tokens(self, max_tokens: int, max_model_len: int | None = None) -> int:
        """KV tokens the request may grow to: each of its sequences holds its prompt and
        up to `max_tokens` (vLLM clamps each to `max_model_len`). Counts a prompt once
        per choice, as without prefix caching; an upper bound with it."""
        total = 0
        for prompt in self.per_prompt:
            need = prompt + max_tokens
            if max_model_len is not None and max_model_len > 0:
                need = min(need, max_model_len)
            total += need * self.n
        return total


def _json_text(value: Any, param: str) -> str:
    """A structured field as the JSON text a template's `tojson` would render."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        raise bad_request(f"`{param}` is nested too deeply or is not JSON.", param) from None


def _embed_tokens(value: Any, param: str) -> int:
    """Rows in base64-encoded embeddings (a string, or strings inside `value`)."""
    text = value if isinstance(value, str) else _json_text(value, param)
    decoded_bytes = len(text) * 3 // 4
    return max(1, math.ceil(decoded_bytes / EMBED_BYTES_PER_TOKEN_FLOOR))


def _part_tokens(part: Any, counter: TokenCounter) -> int:
    if isinstance(part, str):
        return counter.count_text(part)
    if not isinstance(part, Mapping):
        raise bad_request("Each content part must be an object or a string.", "messages")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise bad_request("Each content part needs a string `type`.", "messages")
    if kind in _TEXT_PARTS:
        field = _TEXT_PARTS[kind]
        text = part.get(field)
        if not isinstance(text, str):
            raise bad_request(f"A `{kind}` content part's `{field}` must be a string.", "messages")
        return counter.count_text(text)
    if kind in _MEDIA_PARTS:
        return MEDIA_TOKENS[_MEDIA_PARTS[kind]]
    if kind in _EMBED_PARTS:
        payload = {k: v for k, v in part.items() if k != "type"}
        return _embed_tokens(payload, "messages")
    # A part type this gateway does not know: whatever it holds may be rendered.
    return counter.count_text(_json_text(part, "messages"))


def _content_tokens(content: Any, counter: TokenCounter) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return counter.count_text(content)
    if isinstance(content, list):
        return sum(_part_tokens(part, counter) for part in content)
    raise bad_request("Message content must be a string or a list of parts.", "messages")


def count_chat_prompt(
    messages: Sequence[Mapping[str, Any]],
    counter: TokenCounter,
    request: Mapping[str, Any] | None = None,
) -> int:
    """Prompt tokens of a `/v1/chat/completions` request (an estimate: see the module
    doc). `request` adds the request-level fields a template renders (tools...)."""
    if not isinstance(messages, list | tuple):
        raise bad_request("messages must be a list", "messages")
    total = counter.reply_overhead_tokens
    for message in messages:
        if not isinstance(message, Mapping):
            raise bad_request("each message must be an object", "messages")
        total += counter.message_overhead_tokens
        for key, value in message.items():
            if key == "content":
                total += _content_tokens(value, counter)
            elif isinstance(value, str):
                total += counter.count_text(value)  # role, name, tool_call_id, reasoning...
            elif value is not None:
                total += counter.count_text(_json_text(value, "messages"))  # tool_calls...
    if request is not None:
        for field in _CHAT_PROMPT_FIELDS:
            value = request.get(field)
            if value is not None:
                total += counter.count_text(_json_text(value, field))
        template = request.get("chat_template")
        if template is not None:
            if not isinstance(template, str):
                raise bad_request("`chat_template` must be a string.", "chat_template")
            total += counter.count_text(template)
    return total


def _is_token_id(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool) and item >= 0


def completion_prompt_tokens(
    prompt: Any, counter: TokenCounter, suffix: str | None = None
) -> tuple[int, ...]:
    """Prompt tokens of each prompt of a `/v1/completions` request, in the shapes vLLM
    accepts (a string, token ids, or a list of either); 400 for any other shape.

    Token-id prompts count exactly (the engine adds nothing to ids). Text prompts get the
    tokenizer's special tokens once each, as vLLM adds them. `suffix` joins every prompt.
    """
    extra = counter.count_text(suffix) if suffix else 0
    invalid = bad_request(
        "`prompt` must be a string, a list of token ids, or a list of strings or of "
        "token-id lists.",
        "prompt",
    )
    if isinstance(prompt, str):
        return (counter.prompt_overhead_tokens + counter.count_text(prompt) + extra,)
    if not isinstance(prompt, list):
        raise invalid
    if not prompt or all(_is_token_id(t) for t in prompt):
        return (len(prompt) + extra,)
    if all(isinstance(p, str) for p in prompt):
        return tuple(counter.prompt_overhead_tokens + counter.count_text(p) + extra for p in prompt)
    if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
        return tuple(len(p) + extra for p in prompt)
    raise invalid


def count_completion_prompt(
    prompt: str | list[str] | list[int] | list[list[int]], counter: TokenCounter
) -> int:
    """Prompt tokens of a `/v1/completions` request, summed over a batch of prompts."""
    return sum(completion_prompt_tokens(prompt, counter))


def count_request(req: ParsedRequest, counter: TokenCounter) -> PromptCount:
    """Everything `ParsedRequest` will cost in prompt tokens and sequences (400 for a
    shape that would reach the engine uncounted), by its route's rule
    (`protocol.routes.Count`)."""
    obj = req.obj
    rule = req.spec.count
    if rule is Count.chat:
        return PromptCount((count_chat_prompt(obj["messages"], counter, obj),), req.n)
    if rule is Count.completion:
        return _count_completion(req, counter)
    if rule is Count.responses:
        return PromptCount((count_responses_prompt(obj, counter),), 1)
    if rule is Count.messages:
        return PromptCount((count_messages_prompt(obj, counter),), 1)
    if rule is Count.pooling:
        return PromptCount(pooling_input_tokens(obj, counter), 1)
    if rule is Count.score:
        return PromptCount(score_pair_tokens(obj, counter), 1)
    if rule is Count.audio:
        prompt = obj.get("prompt")
        text = counter.count_text(prompt) if isinstance(prompt, str) else 0
        return PromptCount((req.uploads * MEDIA_TOKENS["audio"] + text,), 1)
    return PromptCount((0,), 1)  # Count.none: the tokenizer only, no forward pass


def _count_completion(req: ParsedRequest, counter: TokenCounter) -> PromptCount:
    obj = req.obj
    suffix = obj.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad_request("`suffix` must be a string.", "suffix")
    per_prompt: tuple[int, ...] = ()
    if obj.get("prompt") is not None:
        per_prompt = completion_prompt_tokens(obj["prompt"], counter, suffix)
    embeds = obj.get("prompt_embeds")
    if embeds is not None:
        if isinstance(embeds, str):
            per_prompt += (_embed_tokens(embeds, "prompt_embeds"),)
        elif isinstance(embeds, list) and all(isinstance(e, str) for e in embeds):
            per_prompt += tuple(_embed_tokens(e, "prompt_embeds") for e in embeds)
        else:
            raise bad_request(
                "`prompt_embeds` must be a base64 string or a list of them.", "prompt_embeds"
            )
    if not per_prompt:
        raise bad_request("`prompt` is required.", "prompt")
    return PromptCount(per_prompt, req.n)


# The passed-through routes. A field that is absent counts nothing (the engine refuses
# what it needs and lacks); a field of a shape that could reach the prompt uncounted is
# refused with a 400 naming it.


def _system_message(system: Any, param: str) -> dict[str, Any]:
    if not isinstance(system, str | list):
        raise bad_request(f"`{param}` must be a string or a list of content parts.", param)
    return {"role": "system", "content": system}


def count_responses_prompt(obj: Mapping[str, Any], counter: TokenCounter) -> int:
    """Prompt tokens of a `/v1/responses` request: `instructions` as a system message,
    `input` (a string, or items: messages with text/image parts, tool calls and their
    outputs, each counted as chat counts a message) and `tools`."""
    messages: list[Any] = []
    if obj.get("instructions") is not None:
        messages.append(_system_message(obj["instructions"], "instructions"))
    items = obj.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, Mapping):
                raise bad_request("Each `input` item must be an object.", "input")
            messages.append(item)
    elif items is not None:
        raise bad_request("`input` must be a string or a list of items.", "input")
    return count_chat_prompt(messages, counter, obj)


def count_messages_prompt(obj: Mapping[str, Any], counter: TokenCounter) -> int:
    """Prompt tokens of an Anthropic `/v1/messages` request: `system`, `messages` (text,
    image, tool_use and tool_result blocks) and `tools`."""
    messages: list[Any] = []
    if obj.get("system") is not None:
        messages.append(_system_message(obj["system"], "system"))
    given = obj.get("messages")
    if given is not None:
        if not isinstance(given, list):
            raise bad_request("`messages` must be a list.", "messages")
        messages.extend(given)
    return count_chat_prompt(messages, counter, obj)


def pooling_input_tokens(obj: Mapping[str, Any], counter: TokenCounter) -> tuple[int, ...]:
    """Prompt tokens of each input of an embeddings or pooling request: `input` in the
    completion prompt's shapes (text, token ids, a batch of either) or as chat messages
    (one conversation, or a batch of them), or `messages`."""
    if obj.get("messages") is not None:
        return (count_chat_prompt(obj["messages"], counter),)
    given = obj.get("input")
    if given is None:
        return (0,)
    if isinstance(given, list) and given and all(isinstance(m, Mapping) for m in given):
        return (count_chat_prompt(given, counter),)
    if (
        isinstance(given, list)
        and given
        and all(isinstance(c, list) and c and all(isinstance(m, Mapping) for m in c) for c in given)
    ):
        return tuple(count_chat_prompt(c, counter) for c in given)
    try:
        return completion_prompt_tokens(given, counter)
    except ApiError:
        raise bad_request(
            "`input` must be text, token ids, a list of either, or chat messages.", "input"
        ) from None


def _score_items(value: Any, counter: TokenCounter, param: str) -> list[int]:
    """Tokens of each item of one side of a scoring request (a text or a multimodal
    object, or a list of them)."""
    items = value if isinstance(value, list) else [value]
    out: list[int] = []
    for item in items:
        if isinstance(item, str):
            out.append(counter.prompt_overhead_tokens + counter.count_text(item))
        elif isinstance(item, Mapping) and isinstance(item.get("content"), list):
            out.append(_content_tokens(item["content"], counter))
        elif item is not None:
            out.append(counter.count_text(_json_text(item, param)))
    return out


# The two sides of each scoring request shape vLLM 0.33 accepts (pooling/scoring).
_SCORE_SIDES = (
    ("query", "documents"),
    ("queries", "documents"),
    ("queries", "items"),
    ("text_1", "text_2"),
    ("data_1", "data_2"),
)


def score_pair_tokens(obj: Mapping[str, Any], counter: TokenCounter) -> tuple[int, ...]:
    """Prompt tokens of every (query, document) pair the engine will score: one query
    against N documents is N pairs, N queries against N documents are N pairs."""
    for left, right in _SCORE_SIDES:
        if obj.get(left) is None and obj.get(right) is None:
            continue
        queries = _score_items(obj.get(left), counter, left)
        documents = _score_items(obj.get(right), counter, right)
        if len(queries) == 1:
            return tuple(queries[0] + d for d in documents) or (queries[0],)
        if len(queries) == len(documents):
            return tuple(q + d for q, d in zip(queries, documents, strict=True))
        return tuple(q + d for q in queries for d in documents) or tuple(queries)
    return (0,)


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _default_executor() -> ThreadPoolExecutor:
    """One worker for large counts: they queue behind each other (the tenant sending
    them waits), never in front of the event loop."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seawall-count")
        return _executor


async def count_request_async(
    req: ParsedRequest,
    counter: TokenCounter,
    *,
    inline_max_bytes: int = INLINE_COUNT_MAX_BYTES,
    executor: Executor | None = None,
) -> PromptCount:
    """`count_request`, off the event loop for bodies over `inline_max_bytes`."""
    if len(req.raw) <= inline_max_bytes:
        return count_request(req, counter)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor or _default_executor(), count_request, req, counter)
