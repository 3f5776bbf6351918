"""The route table: every engine route the gateway passes through, written once.

Per route (one row per client path): the path it is sent to upstream (the same path;
vLLM 0.33 serves each of them under that name), how its body is read and where its model
is named, whether and how it streams (its SSE dialect, `protocol/sse.py`), how its
prompt is counted for tier limits and token rates (`Count`, `protocol/tokens.py`), which
field bounds its output, whether it reserves KV cache at admission, and whether a
broken stream may migrate to another replica.

Why each rule:
- Generative routes (completions, chat, responses, messages) hold KV cache for their
  prompt and every token they may produce, so their prompt + output bound is reserved
  against the replica's cache (`admission.kv_reserve_max`), and their output field gets
  the tier's `max_tokens` default and ceiling.
- Only completions and chat may migrate: a continuation re-sends the prompt with the
  text delivered so far appended (`gateway/migrate.py`), which needs the engine's own
  continuation semantics (`continue_final_message`) and a per-chunk token count that
  only the OpenAI chunk dialect carries.
- Pooling routes (embeddings, pooling, score, rerank) run one forward pass over their
  inputs and hold no KV afterwards: their inputs are counted as prompt tokens (what the
  engine computes and what `prompt_tokens_per_min` is about), nothing is reserved.
- `/tokenize`, `/detokenize` and `/v1/messages/count_tokens` run the tokenizer only (no
  forward pass): they count against the tier's request rate and its body byte bound but
  are charged no prompt tokens; a client checking whether its prompt fits must not spend
  its token budget doing so.
- Audio (multipart/form-data) cannot be measured without decoding it: each uploaded file
  is charged a fixed `MEDIA_TOKENS["audio"]` (Whisper's 1,500 encoder frames per 30 s
  window) plus the `prompt` field's text, as chat's media parts are; the body is bounded
  by `limits.max_body_bytes`, not by the tier's prompt byte bound, which is for text.

Model: a JSON body's `model` field, or the multipart form's `model` field. vLLM makes it
optional everywhere but Anthropic's Messages API; when a request leaves it out, the
gateway routes it to the fleet's only model (400 if it serves several).

Sans-I/O data: imports only the standard library and `protocol/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from seawall.protocol.sse import Dialect

Route = Literal[
    "completions",
    "chat",
    "responses",
    "messages",
    "messages_count_tokens",
    "embeddings",
    "pooling",
    "score",
    "v1_score",
    "rerank",
    "v1_rerank",
    "v2_rerank",
    "tokenize",
    "detokenize",
    "audio_transcriptions",
    "audio_translations",
]


class Count(StrEnum):
    """How a route's prompt is counted (`protocol.tokens.count_request`)."""

    completion = "completion"  # `prompt` (text, ids, batches) + `suffix`, x `n`
    chat = "chat"  # `messages` + tools, per message overhead
    responses = "responses"  # `instructions` + `input` items + tools
    messages = "messages"  # Anthropic: `system` + `messages` + tools
    pooling = "pooling"  # `input` (completion shapes or chat messages) or `messages`
    score = "score"  # every (query, document) pair the engine scores
    audio = "audio"  # per uploaded file + the `prompt` field
    none = "none"  # tokenizer only: no prompt tokens charged


@dataclass(frozen=True, slots=True)
class RouteSpec:
    name: Route  # the metric label and access-log field
    path: str  # the client's path, and the path sent upstream
    count: Count
    prompt_param: str  # the field a prompt-limit error names
    body: Literal["json", "multipart"] = "json"
    model_required: bool = False  # else: the fleet's only model when absent
    dialect: Dialect | None = None  # how it streams when asked (`stream: true`); None: never
    max_tokens_fields: tuple[str, ...] = ()  # output bound, preferred first; (): no output
    reserves_kv: bool = False
    migratable: bool = False
    # The engine honours `stream_options.include_usage`: the gateway may ask for the usage
    # chunk it needs (token-rate reconciliation) and strip it again.
    stream_options: bool = False

    @property
    def generates(self) -> bool:
        """Produces output tokens bounded by a max-tokens field (tier limits apply)."""
        return bool(self.max_tokens_fields)


def _pooling(name: Route, path: str) -> RouteSpec:
    return RouteSpec(name, path, Count.pooling, "input")


def _scoring(name: Route, path: str) -> RouteSpec:
    return RouteSpec(name, path, Count.score, "documents")


def _tokenizer(name: Route, path: str, *, model_required: bool = False) -> RouteSpec:
    return RouteSpec(name, path, Count.none, "prompt", model_required=model_required)


def _audio(name: Route, path: str) -> RouteSpec:
    return RouteSpec(name, path, Count.audio, "file", body="multipart", dialect=Dialect.openai)


ROUTES: dict[Route, RouteSpec] = {
    spec.name: spec
    for spec in (
        RouteSpec(
            "completions",
            "/v1/completions",
            Count.completion,
            "prompt",
            dialect=Dialect.openai,
            max_tokens_fields=("max_tokens",),
            reserves_kv=True,
            migratable=True,
            stream_options=True,
        ),
        RouteSpec(
            "chat",
            "/v1/chat/completions",
            Count.chat,
            "messages",
            dialect=Dialect.openai,
            max_tokens_fields=("max_completion_tokens", "max_tokens"),
            reserves_kv=True,
            migratable=True,
            stream_options=True,
        ),
        RouteSpec(
            "responses",
            "/v1/responses",
            Count.responses,
            "input",
            dialect=Dialect.responses,
            max_tokens_fields=("max_output_tokens",),
            reserves_kv=True,
        ),
        RouteSpec(
            "messages",
            "/v1/messages",
            Count.messages,
            "messages",
            model_required=True,
            dialect=Dialect.anthropic,
            max_tokens_fields=("max_tokens",),
            reserves_kv=True,
        ),
        _tokenizer("messages_count_tokens", "/v1/messages/count_tokens", model_required=True),
        _pooling("embeddings", "/v1/embeddings"),
        _pooling("pooling", "/pooling"),
        _scoring("score", "/score"),
        _scoring("v1_score", "/v1/score"),
        _scoring("rerank", "/rerank"),
        _scoring("v1_rerank", "/v1/rerank"),
        _scoring("v2_rerank", "/v2/rerank"),
        _tokenizer("tokenize", "/tokenize"),
        _tokenizer("detokenize", "/detokenize"),
        _audio("audio_transcriptions", "/v1/audio/transcriptions"),
        _audio("audio_translations", "/v1/audio/translations"),
    )
}
