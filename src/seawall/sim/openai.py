"""vLLM 0.33's OpenAI-compatible request handling and bodies, for the emulator.

Owns: turning a validated request (`protocol`) into the prompts, limits and sampling
options vLLM would derive (its order of checks and its error texts: context length,
`max_tokens`, `n`, temperature, logprobs limits, tools and `suffix` under default flags),
the structured-output constraint and its grammar cost, and every response body and
stream chunk of `/v1/completions`, `/v1/chat/completions` and `/v1/responses` with the
keys vLLM's `model_dump()` (non-stream) or `model_dump_json(exclude_unset=True)` (stream)
writes. Logprob values are synthetic; their shapes and which keys carry them are vLLM's.

Must not: speak HTTP, schedule or step the engine (that is `server`, `scheduler` and
`engine`). The facts behind each shape are in `tests/data/vllm/captured.json`.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from seawall.errors import ApiError
from seawall.sim import protocol as p
from seawall.sim import textgen
from seawall.sim.scheduler import grammar_step_cost_s, schema_shape

VLLM_VERSION = "0.33.0"
MAX_LOGPROBS = 20  # ModelConfig.max_logprobs default
# vLLM bounds text before tokenizing: max_model_len * the longest vocabulary string
MAX_CHARS_PER_TOKEN = max(
    len(s) for s in (*textgen.SPECIAL_TOKENS, *(" " + w for w in textgen.WORDS))
)
VOCAB_SIZE = textgen.MAX_TOKEN_ID + 1


def random_uuid() -> str:
    """vLLM's `random_uuid()`: 16 hex digits."""
    return secrets.token_hex(8)


def system_fingerprint(config_key: str) -> str:
    """vLLM's default (`--fingerprint-mode full`, tp/pp/dp 1): `vllm-<version>-<hash8>`,
    the hash being the first 8 hex digits of the config's hash."""
    return f"vllm-{VLLM_VERSION}-{hashlib.sha256(config_key.encode()).hexdigest()[:8]}"


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    text: str  # as vLLM would echo it ("" for a token-id prompt: it has no text)
    max_tokens: int  # what the engine is asked for (echo with max_tokens 0 asks for 1)


@dataclass(slots=True)
class Gen:
    """One generation request as vLLM's serving layer has derived it."""

    prompts: list[Prompt]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    temperature: float
    seed: int | None
    ignore_eos: bool
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    logprobs: int | None  # top entries per sampled token (None: no logprobs)
    prompt_logprobs: int | None
    echo: bool
    echo_only: bool  # echo with max_tokens 0: the prompt alone is the text
    return_token_ids: bool
    grammar_cost_s: float
    request_id: str
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ checks, in vLLM's order


def check_max_tokens_param(name: str, value: int | None, max_model_len: int) -> None:
    """`TokenizeParams.__post_init__`: asked-for output longer than the whole context."""
    if value is not None and value > max_model_len:
        raise p.vllm_error(
            f"{name}={value} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            name,
            value,
        )


def tokenize_checked(text: str, max_model_len: int) -> list[int]:
    """The renderer's checks around tokenizing prompt text: a character bound first, then
    the token count (the tokenizer stops at max_model_len + 1, hence "at least")."""
    max_chars = max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > max_chars:
        raise p.vllm_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {len(text)} characters (more than {max_chars} characters, which "
            f"is the upper bound for {max_model_len} input tokens). Please reduce the length "
            "of the input prompt.",
            "input_text",
            len(text),
        )
    ids = textgen.tokenize(text)
    check_prompt_len(ids[: max_model_len + 1], max_model_len)
    return ids


def check_prompt_len(ids: list[int], max_model_len: int) -> None:
    count = len(ids)
    if count > max_model_len:
        qualifier = "at least " if count == max_model_len + 1 else ""
        raise p.vllm_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {qualifier}{count} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            count,
        )


def check_engine_prompt(ids: list[int]) -> None:
    """The input processor's checks, after the sampling parameters': a prompt must have a
    token, and every id must be in the vocabulary (vLLM names the largest)."""
    if not ids:
        raise p.value_error("The decoder prompt cannot be empty")
    check_token_ids(ids)


def check_token_ids(ids: list[int]) -> None:
    if ids and max(ids) > textgen.MAX_TOKEN_ID:
        raise p.value_error(f"Token id {max(ids)} is out of vocabulary")
    for t in ids:
        if not textgen.is_valid_token(t):  # the sim's vocabulary has gaps between ranges
            raise p.value_error(f"Token id {t} is out of vocabulary")


def engine_max_tokens(max_model_len: int, requested: int | None, prompt_len: int) -> int:
    """`get_max_tokens`: the context that is left, or less if asked."""
    room = max_model_len - prompt_len
    return room if requested is None else min(room, requested)


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling fields `SamplingParams._verify_args` checks (None: vLLM's default)."""

    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0


def check_sampling(s: Sampling, max_tokens: int) -> None:
    """`SamplingParams._verify_args`, in its order. Checks raised with a parameter get the
    `(parameter=…, value=…)` suffix and `param`; the others are bare (`param: null`)."""
    if s.n < 1:
        raise p.value_error(f"n must be at least 1, got {s.n}.")
    presence = 0.0 if s.presence_penalty is None else float(s.presence_penalty)
    if not -2.0 <= presence <= 2.0:
        raise p.value_error(f"presence_penalty must be in [-2, 2], got {presence}.")
    frequency = 0.0 if s.frequency_penalty is None else float(s.frequency_penalty)
    if not -2.0 <= frequency <= 2.0:
        raise p.value_error(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    repetition = 1.0 if s.repetition_penalty is None else float(s.repetition_penalty)
    if not math.isfinite(repetition):
        raise p.value_error(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise p.value_error(f"repetition_penalty must be greater than zero, got {repetition}.")
    temperature = 1.0 if s.temperature is None else float(s.temperature)
    if not math.isfinite(temperature):
        raise p.vllm_error(f"temperature must be a finite number, got {temperature}.",
                           "temperature", temperature)  # fmt: skip
    if temperature < 0.0:
        raise p.vllm_error(f"temperature must be non-negative, got {temperature}.",
                           "temperature", temperature)  # fmt: skip
    if temperature > 2.0:
        raise p.vllm_error(f"temperature must be in [0, 2], got {temperature}.",
                           "temperature", temperature)  # fmt: skip
    top_p = 1.0 if s.top_p is None else float(s.top_p)
    if not 0.0 < top_p <= 1.0:
        raise p.vllm_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = 0 if s.top_k is None else s.top_k
    if top_k < -1:
        raise p.value_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = 0.0 if s.min_p is None else float(s.min_p)
    if not 0.0 <= min_p <= 1.0:
        raise p.value_error(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise p.vllm_error(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )
    if s.min_tokens < 0:
        raise p.value_error(f"min_tokens must be greater than or equal to 0, got {s.min_tokens}.")


def check_logprobs_limits(logprobs: int | None, prompt_logprobs: int | None) -> None:
    """`SamplingParams.verify` against `max_logprobs` (20); -1 means the whole vocab."""
    if logprobs is not None:
        asked = VOCAB_SIZE if logprobs == -1 else logprobs
        if asked > MAX_LOGPROBS:
            raise p.vllm_error(
                f"Requested sample logprobs of {asked}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}",
                "logprobs",
                asked,
            )
    if prompt_logprobs is not None:
        asked = VOCAB_SIZE if prompt_logprobs == -1 else prompt_logprobs
        if asked > MAX_LOGPROBS:
            raise p.vllm_error(
                f"Requested prompt logprobs of {asked}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}",
                "prompt_logprobs",
                asked,
            )


def check_tools(choice: Any) -> None:
    """vLLM without `--enable-auto-tool-choice` / `--tool-call-parser` (the defaults)."""
    if choice == "auto":
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set",
            type="BadRequestError",
        )
    if choice == "required":
        raise ApiError(
            400,
            'tool_choice="required" requires --tool-call-parser to be set',
            type="BadRequestError",
        )


def grammar_cost(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    per_node_s: float,
) -> float:
    """Per-step grammar cost of a request's constraint (0 when unconstrained). vLLM 0.33
    ignores the removed `guided_*` fields, so they cost nothing here either."""
    constraint: object = None
    so = structured_outputs or {}
    if so.get("json") is not None:
        constraint = so["json"]
    elif so.get("regex") is not None or so.get("grammar") is not None:
        text = str(so.get("regex") or so.get("grammar"))
        depth = max_depth = 0
        for ch in text:  # a pattern's alternatives and groups nest like a schema's objects
            depth += ch in "([{"
            depth -= ch in ")]}"
            max_depth = max(max_depth, depth)
        return grammar_step_cost_s(len(text), max_depth + 1, per_node_s)
    elif so.get("choice") is not None:
        constraint = so["choice"]
    elif response_format is not None:
        kind = response_format.get("type")
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            constraint = spec.get("schema", spec) if isinstance(spec, dict) else spec
        elif kind == "json_object":
            constraint = {"type": "object"}
    if constraint is None:
        return 0.0
    nodes, depth = schema_shape(constraint)
    return grammar_step_cost_s(nodes, depth, per_node_s)


# ------------------------------------------------------------------ synthetic logprobs


def _alternatives(token: int, k: int) -> list[int]:
    """k other tokens with distinct texts, deterministic in the token."""
    words = textgen.WORD_IDS
    start = token % len(words)
    out: list[int] = []
    i = 0
    while len(out) < k:
        candidate = words[(start + 1 + i) % len(words)]
        if candidate != token:
            out.append(candidate)
        i += 1
    return out


def _token_str(token: int) -> str:
    return textgen.token_bytes(token).decode("utf-8", errors="replace")


SAMPLED_LOGPROB = -0.5


def _alt_logprob(j: int) -> float:
    return -1.0 - j


def completion_logprobs(
    tokens: list[int], k: int, text_offset: int, prompt_first: bool = False
) -> dict[str, Any]:
    """`CompletionLogProbs` for tokens (the sampled one plus k more per position, as vLLM
    does: `top_logprobs` has k + 1 entries). `prompt_first`: the first token is the
    prompt's first, which has no logprob."""
    offsets: list[int] = []
    token_lps: list[float | None] = []
    strs: list[str] = []
    tops: list[dict[str, float] | None] = []
    offset = text_offset
    for i, tok in enumerate(tokens):
        s = _token_str(tok)
        offsets.append(offset)
        strs.append(s)
        if prompt_first and i == 0:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(SAMPLED_LOGPROB)
            top = {s: SAMPLED_LOGPROB}
            for j, alt in enumerate(_alternatives(tok, k)):
                top.setdefault(_token_str(alt), _alt_logprob(j))
            tops.append(top)
        offset += len(s)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": strs,
            "top_logprobs": tops}  # fmt: skip


def chat_logprobs(tokens: list[int], k: int) -> dict[str, Any]:
    """`ChatCompletionLogProbs`: `top_logprobs` has exactly k entries."""
    content = []
    for tok in tokens:
        s = _token_str(tok)
        content.append(
            {
                "token": s,
                "logprob": SAMPLED_LOGPROB,
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": _alt_logprob(j), "bytes": list(t.encode())}
                    for j, t in enumerate(
                        [s] + [_token_str(a) for a in _alternatives(tok, max(0, k - 1))]
                    )
                ][:k],
            }
        )
    return {"content": content}


def prompt_logprobs(ids: list[int], k: int) -> list[dict[str, dict[str, Any]] | None]:
    """`prompt_logprobs`: None for the first token, then the token and k more."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for tok in ids[1:]:
        entry = {str(tok): {"logprob": -1.5, "rank": 1, "decoded_token": _token_str(tok)}}
        for j, alt in enumerate(_alternatives(tok, k)):
            entry[str(alt)] = {"logprob": -2.5 - j, "rank": j + 1, "decoded_token": _token_str(alt)}
        out.append(entry)
    return out


# ------------------------------------------------------------------ usage


def usage(prompt: int, completion: int, full: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if full:
        body["prompt_tokens_details"] = None
        body["completion_tokens_details"] = None
    return body
