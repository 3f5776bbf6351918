"""The emulator's deterministic tokenizer, chat template and token generator.

Owns: text <-> token ids, the chat template, and the choice of the next token. Pure: no
I/O, no asyncio, no clock, no global random state.

Must not: depend on the position of a token or on the prompt as a whole. The next token is
a function of (key, every context token so far) through a rolling hash, so that resending
`prompt + partial output` at temperature 0 continues with exactly the rest of the
uninterrupted output. The gateway's mid-stream migration relies on that, for completions
and for chat (see `render_chat`).

The tokenizer round-trips for generated text: generated tokens are whitespace-prefixed
pseudo-words or single punctuation characters, each of which is one pre-token piece, so
`tokenize(detokenize(ids)) == ids` and a split between prompt and output is always a token
boundary. Arbitrary prompt text falls back to chunks of up to three UTF-8 bytes (about
three characters per token, near a real BPE's ratio).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Id layout. Specials first, then the generated vocabulary, then byte chunks. Byte chunk
# ids encode their bytes (1, 2 or 3 of them), so every byte string has a token spelling.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID = 0
IM_START_ID = 1
IM_END_ID = 2
WORD_BASE = 16
CHUNK_BASE = 100_000
_CHUNK1 = CHUNK_BASE
_CHUNK2 = _CHUNK1 + 256
_CHUNK3 = _CHUNK2 + 65_536
MAX_TOKEN_ID = _CHUNK3 + 16_777_216 - 1

_MASK64 = (1 << 64) - 1
_HASH_MUL = 0x100000001B3  # FNV-64 prime: cheap, and mixes well enough with the finaliser
_HASH_SEED = 0xCBF29CE484222325


def _build_words() -> tuple[str, ...]:
    """A fixed pseudo-word vocabulary (lowercase ASCII letters, no duplicates)."""
    onsets = ("b", "c", "d", "f", "g", "l", "m", "n", "p", "r", "s", "t", "v", "z", "st", "tr")
    vowels = ("a", "e", "i", "o", "u", "ai", "ea", "io")
    codas = ("", "n", "r", "s", "l", "m", "nd", "rt")
    words: list[str] = ["the", "of", "and", "to", "in", "is", "that", "for", "with", "as"]
    seen = set(words)
    for onset in onsets:
        for vowel in vowels:
            for coda in codas:
                w = onset + vowel + coda
                if w not in seen:
                    seen.add(w)
                    words.append(w)
    return tuple(words)


WORDS: tuple[str, ...] = _build_words()
PUNCT: tuple[str, ...] = (",", ".")
_WORD_PIECES: tuple[str, ...] = tuple(" " + w for w in WORDS)

# piece text -> id for the named vocabulary (specials + generated words)
_PIECE_TO_ID: dict[str, int] = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
for _i, _p in enumerate(_WORD_PIECES):
    _PIECE_TO_ID[_p] = WORD_BASE + _i
_WORD_IDS: tuple[int, ...] = tuple(WORD_BASE + i for i in range(len(WORDS)))
WORD_IDS = _WORD_IDS
_COMMA_ID = _CHUNK1 + ord(",")
_PERIOD_ID = _CHUNK1 + ord(".")

_PRETOKEN = re.compile(r"<\|[a-z_]+\|>| ?[A-Za-z]+| ?[0-9]{1,3}|.", re.DOTALL)


def _chunk_id(chunk: bytes) -> int:
    n = len(chunk)
    value = int.from_bytes(chunk, "big")
    if n == 1:
        return _CHUNK1 + value
    if n == 2:
        return _CHUNK2 + value
    return _CHUNK3 + value


def tokenize(text: str) -> list[int]:
    ids: list[int] = []
    append = ids.append
    for piece in _PRETOKEN.findall(text):
        known = _PIECE_TO_ID.get(piece)
        if known is not None:
            append(known)
            continue
        data = piece.encode("utf-8")
        for start in range(0, len(data), 3):
            append(_chunk_id(data[start : start + 3]))
    return ids


def token_bytes(token_id: int) -> bytes:
    """The bytes a token stands for; specials render as their literal text."""
    if token_id < 0 or token_id > MAX_TOKEN_ID:
        raise ValueError(f"token id {token_id} is out of vocabulary")
    if token_id < len(SPECIAL_TOKENS):
        return SPECIAL_TOKENS[token_id].encode()
    if WORD_BASE <= token_id < WORD_BASE + len(WORDS):
        return _WORD_PIECES[token_id - WORD_BASE].encode()
    if token_id >= _CHUNK3:
        return (token_id - _CHUNK3).to_bytes(3, "big")
    if token_id >= _CHUNK2:
        return (token_id - _CHUNK2).to_bytes(2, "big")
    if token_id >= _CHUNK1:
        return bytes((token_id - _CHUNK1,))
    raise ValueError(f"token id {token_id} is out of vocabulary")


def detokenize(ids: Sequence[int], skip_special: bool = False) -> str:
    parts = [token_bytes(t) for t in ids if not (skip_special and 0 <= t < len(SPECIAL_TOKENS))]
    return b"".join(parts).decode("utf-8", errors="replace")


def is_valid_token(token_id: int) -> bool:
    return (
        0 <= token_id < len(SPECIAL_TOKENS)
        or WORD_BASE <= token_id < WORD_BASE + len(WORDS)
        or CHUNK_BASE <= token_id <= MAX_TOKEN_ID
    )


# Output text of each generated token, for the stream writer.
GENERATED_TEXT: dict[int, str] = {EOS_ID: ""}
GENERATED_TEXT.update({WORD_BASE + i: p for i, p in enumerate(_WORD_PIECES)})
GENERATED_TEXT[_COMMA_ID] = ","
GENERATED_TEXT[_PERIOD_ID] = "."


def token_text(token_id: int) -> str:
    """Text of one output token; special tokens render as nothing, as vLLM skips them."""
    text = GENERATED_TEXT.get(token_id)
    if text is not None:
        return text
    if 0 <= token_id < len(SPECIAL_TOKENS):
        return ""
    return token_bytes(token_id).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------- chat template


class ChatTemplateError(ValueError):
    """A chat request the template cannot render (becomes a 400)."""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    raise ChatTemplateError("message content must be a string or a list of parts")


def render_chat(
    messages: Sequence[Any],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """ChatML. `continue_final_message` leaves the last message open (no end marker), so
    `render(m + [partial], continue)` == `render(m, add_generation_prompt) + partial`."""
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    out: list[str] = []
    last = len(messages) - 1
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError("each message must be an object with a string 'role'")
        role = message["role"]
        text = _content_text(message.get("content"))
        if continue_final_message and i == last:
            out.append(f"<|im_start|>{role}\n{text}")
        else:
            out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


# -------------------------------------------------------------------------------- generator


def _mix64(x: int) -> int:
    """splitmix64 finaliser: turns a rolling hash into well-spread bits."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def hash_tokens(ids: Sequence[int], state: int = _HASH_SEED) -> int:
    """The rolling hash of a context; extend it one token at a time with `extend_hash`."""
    for t in ids:
        state = ((state ^ t) * _HASH_MUL) & _MASK64
    return state


def extend_hash(state: int, token_id: int) -> int:
    return ((state ^ token_id) * _HASH_MUL) & _MASK64


def sampling_key(server_seed: int, temperature: float, request_seed: int | None) -> int:
    """The key that, with the context, decides every token.

    Greedy (temperature 0) ignores the request seed, as vLLM does; sampling with a seed is
    deterministic in that seed. The caller supplies a random `request_seed` when sampling
    without one, so that unseeded sampling varies between requests as on a real engine.
    """
    if temperature <= 0.0:
        return _mix64(server_seed & _MASK64)
    return _mix64((server_seed * 0x9E3779B97F4A7C15 + (request_seed or 0) + 1) & _MASK64)


@dataclass(frozen=True, slots=True)
class GenConfig:
    """How often a generator ends a sentence or the sequence; per 65,536."""

    eos_per_65536: int = 200  # ~1 in 330 tokens: long outputs usually hit max_tokens first
    comma_per_65536: int = 4096
    period_per_65536: int = 3000


DEFAULT_GEN = GenConfig()
_NUM_WORDS = len(_WORD_IDS)


def next_token(key: int, context_hash: int, cfg: GenConfig = DEFAULT_GEN) -> int:
    """The next token after a context; O(1)."""
    bits = _mix64(context_hash ^ key)
    roll = bits & 0xFFFF
    if roll < cfg.eos_per_65536:
        return EOS_ID
    roll -= cfg.eos_per_65536
    if roll < cfg.comma_per_65536:
        return _COMMA_ID
    roll -= cfg.comma_per_65536
    if roll < cfg.period_per_65536:
        return _PERIOD_ID
    return _WORD_IDS[(bits >> 16) % _NUM_WORDS]
