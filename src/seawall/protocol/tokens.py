"""Prompt token counting: how many prompt tokens a request will cost, before it is sent.

Owns the `TokenCounter` seam and its two implementations: `HFTokenizerCounter` (the
model's own `tokenizer.json`, loaded from a local file with the `tokenizers` library:
exact for text, close for chat) and `EstimateCounter` (no tokenizer file: a documented
over-estimate). Also owns the walk over the OpenAI request shapes (`prompt` of a
completion, `messages` of a chat completion).

Must not: download anything, do I/O after construction, or read the clock. The count is
an up-front estimate for limits; the engine's reported `usage.prompt_tokens` is the truth,
and the limits backend reconciles with it when the request ends.

Chat counts are approximate even with the real tokenizer: the chat template (role markers,
system prompt defaults, tool schemas) is model-specific Jinja that we do not render. Each
message is charged its text plus a fixed per-message overhead, and the reply a fixed
priming overhead, as OpenAI's own cookbook does for its models.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from seawall.errors import bad_request


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
        # Counted without a per-character Python loop: only the word pieces are visited.
        words = _ASCII_WORD.findall(text)
        word_tokens = sum((len(w) + 2) // 3 for w in words)
        word_chars = sum(map(len, words))
        ascii_chars = len(text.encode("ascii", "ignore"))
        non_ascii_chars = len(text) - ascii_chars
        non_ascii_bytes = len(text.encode("utf-8", "surrogatepass")) - ascii_chars
        return word_tokens + (ascii_chars - word_chars) + (non_ascii_bytes - non_ascii_chars)


def count_completion_prompt(
    prompt: str | list[str] | list[int] | list[list[int]], counter: TokenCounter
) -> int:
    """Prompt tokens of a `/v1/completions` request, summed over a batch of prompts.

    Token-id prompts count exactly (the engine adds nothing to ids). Text prompts get the
    tokenizer's special tokens once each, as vLLM adds them.
    """
    if isinstance(prompt, str):
        return counter.prompt_overhead_tokens + counter.count_text(prompt)
    if not isinstance(prompt, list):
        raise bad_request("prompt must be a string, a list of strings or token ids", "prompt")
    total = 0
    for item in prompt:
        if isinstance(item, str):
            total += counter.prompt_overhead_tokens + counter.count_text(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            total += 1
        elif isinstance(item, list):
            total += len(item)
        else:
            raise bad_request("prompt must be a string, a list of strings or token ids", "prompt")
    return total


def _content_text(content: Any) -> list[str]:
    """The text pieces of a message's content: a string, or a list of typed parts.

    Non-text parts (images, audio) are not counted: their token cost depends on the
    model's encoder, which only the engine knows; the reconciliation with real usage
    catches the difference.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
            elif isinstance(part, str):
                texts.append(part)
        return texts
    raise bad_request("message content must be a string or a list of parts", "messages")


def count_chat_prompt(messages: Sequence[Mapping[str, Any]], counter: TokenCounter) -> int:
    """Prompt tokens of a `/v1/chat/completions` request (an estimate: see module doc)."""
    if not isinstance(messages, list | tuple):
        raise bad_request("messages must be a list", "messages")
    total = counter.reply_overhead_tokens
    for message in messages:
        if not isinstance(message, Mapping):
            raise bad_request("each message must be an object", "messages")
        total += counter.message_overhead_tokens
        pieces = _content_text(message.get("content"))
        for field in ("role", "name", "tool_call_id"):
            value = message.get(field)
            if isinstance(value, str):
                pieces.append(value)
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, list):
            for call in tool_calls:
                function = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(function, Mapping):
                    pieces.extend(
                        v
                        for v in (function.get("name"), function.get("arguments"))
                        if isinstance(v, str)
                    )
        total += sum(counter.count_text(p) for p in pieces)
    return total
