"""vLLM 0.33's request models and validation errors, for the emulator's routes.

Owns: the pydantic models the sim validates request bodies with (each field typed as vLLM
0.33 types it, so pydantic reports the same errors in the same order), vLLM's `mode="before"`
model validators that the sim's parameters depend on (their order is vLLM's), and the
rendering of a validation failure exactly as vLLM's `validation_exception_handler` writes it
(`"N validation errors:\\n  {...}"`, `type "Bad Request"`, `param "body.max_tokens"`). The
truth these are checked against is `tests/data/vllm/captured.json` (tools/vllm/capture.py).

Must not: read the request stream, tokenize, or schedule; the server does. Fields the sim
never acts on are still declared when a wrong type there is a 400 in vLLM; `messages` items
and `response_format` are kept loose (vLLM's unions of message types are not mirrored), so a
malformed message gets a different 400 text than vLLM's.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from seawall.errors import ApiError

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 128  # envs.VLLM_MAX_STOP_STRINGS
MAX_COMPLETION_PROMPTS = 512  # envs.VLLM_MAX_COMPLETION_PROMPTS


def vllm_error(message: str, parameter: str | None = None, value: object = None) -> ApiError:
    """`VLLMValidationError` as `create_error_response` renders it: the message with a
    `(parameter=…, value=…)` suffix, `BadRequestError`, param = the parameter."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return ApiError(400, text, param=parameter, type="BadRequestError", code=400)


def value_error(message: str) -> ApiError:
    """A plain `ValueError` from vLLM's engine side: BadRequestError, param null."""
    return ApiError(400, message, param=None, type="BadRequestError", code=400)


# ------------------------------------------------------------------ rendering pydantic errors

_BRACKETED = re.compile(r"[\[\]{}()]")
_INTERNAL_MARKERS = frozenset(
    (
        "function-wrap", "function-after", "function-before", "function-plain",
        "json-or-python", "lax-or-strict", "chain", "default", "nullable", "tagged-union",
        "union", "call", "arguments", "is-instance", "is-subclass", "callable", "str", "int",
        "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
        "complex", "none", "nonetype",
    )
)  # fmt: skip
_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


def _clean_loc(loc: tuple[Any, ...]) -> str:
    parts = [
        str(p)
        for p in loc
        if not (_BRACKETED.search(str(p)) or str(p).lower() in _INTERNAL_MARKERS)
    ]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _summarize(value: object) -> object:
    if isinstance(value, str):
        if len(value) > _MAX_ERROR_INPUT_CHARS:
            return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
        return value
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except Exception:
        return f"<{type(value).__name__}>"
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _format(err: dict[str, Any]) -> str:
    err = dict(err)
    if "input" in err:
        err["input"] = _summarize(err["input"])
    loc = err.get("loc")
    if isinstance(loc, tuple | list):
        err["loc"] = _clean_loc(tuple(loc))
    text = str(err)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def request_validation_error(errors: list[Any]) -> ApiError:
    """vLLM's `validation_exception_handler` for FastAPI's `RequestValidationError`."""
    param: str | None = None
    if errors and isinstance(errors[0], dict) and errors[0].get("loc"):
        param = _clean_loc(tuple(errors[0]["loc"]))
    if errors:
        count = len(errors)
        label = "error" if count == 1 else "errors"
        reported = errors[:_MAX_REPORTED_ERRORS]
        message = f"{count} validation {label}:\n"
        message += "".join(f"  {_format(e) if isinstance(e, dict) else e}\n" for e in reported)
        if count > len(reported):
            message += f"  ...and {count - len(reported)} more {label}\n"
        message = message.rstrip()
    else:
        message = "Validation error"
    return ApiError(400, message, param=param, type="Bad Request", code=400)


UNSUPPORTED_MEDIA_TYPE = request_validation_error(
    ["Unsupported Media Type: Only 'application/json' is allowed"]
)


def parse_json_body(raw: bytes, content_type: str | None) -> Any:
    """The body as FastAPI reads it for a JSON route guarded by vLLM's
    `validate_json_request`: JSON is parsed when the content type says JSON or is absent,
    a decode error is a `json_invalid` validation error, then the media type must be
    `application/json`."""
    media = (content_type or "").lower().split(";", 1)[0].strip()
    is_json = content_type is None or media.endswith("/json") or media.endswith("+json")
    body: Any = None
    if raw and is_json:
        try:
            import orjson

            body = orjson.loads(raw)
        except ValueError:
            try:  # FastAPI uses the stdlib parser: it also reads NaN/Infinity
                body = json.loads(raw)
            except json.JSONDecodeError as e:
                raise request_validation_error(
                    [
                        {
                            "type": "json_invalid",
                            "loc": ("body", e.pos),
                            "msg": "JSON decode error",
                            "input": {},
                            "ctx": {"error": e.msg},
                        }
                    ]
                ) from None
    if media != "application/json":
        raise UNSUPPORTED_MEDIA_TYPE
    return body


# ------------------------------------------------------------------ models


class _Base(BaseModel):
    # OpenAI's API allows extra fields; vLLM ignores them (guided_* included, since 0.33)
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        # vLLM's `__log_extra_fields__` is a wrap validator; its presence alone changes
        # pydantic's error for a non-object body (`model_attributes_type`), so keep one
        return handler(data)


StopParam = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None
TopLogprobsParam = Annotated[
    int, BeforeValidator(lambda v: 0 if v is None else v, json_schema_input_type=int | None)
]


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _check_stream_options(data: Any) -> Any:
    if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
        raise vllm_error("Stream options can only be defined when `stream=True`.", "stream_options")
    return data


def _check_response_format(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    rf = data.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and rf.get("json_schema") is None:
        raise vllm_error(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            "response_format",
        )
    return data


def _check_structured_outputs_count(data: Any) -> int:
    so = data.get("structured_outputs") if isinstance(data, dict) else None
    if not isinstance(so, dict):
        return 0
    return sum(so.get(k) is not None for k in ("json", "regex", "choice"))


def _check_int_fields(data: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = data.get(name)
        if value is not None and not isinstance(value, int | float):
            raise vllm_error(f"`{name}` must be an integer.", name, value)


def _check_prompt_logprobs(data: dict[str, Any]) -> None:
    prompt_logprobs = data.get("prompt_logprobs")
    if prompt_logprobs is None:
        return
    if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise vllm_error("`prompt_logprobs` are not available when `stream=True`.",
                         "prompt_logprobs")  # fmt: skip
    if prompt_logprobs < 0 and prompt_logprobs != -1:
        raise vllm_error(
            "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs",
            prompt_logprobs,
        )  # fmt: skip


def _check_generation_prompt(data: Any) -> Any:
    if (
        isinstance(data, dict)
        and data.get("continue_final_message")
        and data.get("add_generation_prompt")
    ):
        raise vllm_error(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    return data


class CompletionRequest(_Base):
    model: str | None = None
    prompt: (
        list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
        | str
        | list[str]
        | None
    ) = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: StopParam = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] = Field(default_factory=list)
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None

    # vLLM's before-validators, in vLLM's order (pydantic then runs them as vLLM's)
    @model_validator(mode="before")
    @classmethod
    def normalize_null_max_tokens(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("max_tokens") is None:
            data = {**data, "max_tokens": 16}
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_response_format(cls, data: Any) -> Any:
        return _check_response_format(data)

    @model_validator(mode="before")
    @classmethod
    def check_structured_outputs_count(cls, data: Any) -> Any:
        if _check_structured_outputs_count(data) > 1:
            raise vllm_error(
                "You can only use one kind of constraints for structured outputs ('json', "
                "'regex' or 'choice').",
                "structured_outputs",
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        _check_int_fields(data, ("prompt_logprobs", "logprobs"))
        _check_prompt_logprobs(data)
        logprobs = data.get("logprobs")
        if logprobs is not None and logprobs < 0 and logprobs != -1:
            raise vllm_error("`logprobs` must be a positive value or -1.", "logprobs", logprobs)
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        return _check_stream_options(data)

    @model_validator(mode="before")
    @classmethod
    def validate_prompt(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        prompt = data.get("prompt")
        embeds = data.get("prompt_embeds")
        if (prompt is None or prompt == "") and (embeds is None or embeds == []):
            raise vllm_error(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        if (
            isinstance(prompt, list)
            and prompt
            and not all(isinstance(p, int) for p in prompt)
            and len(prompt) > MAX_COMPLETION_PROMPTS
        ):
            raise vllm_error(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
                "VLLM_MAX_COMPLETION_PROMPTS environment variable.",
                "prompt",
            )
        return data


class ChatCompletionRequest(_Base):
    messages: list[dict[str, Any]]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobsParam = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: StopParam = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    structured_outputs: dict[str, Any] | None = None
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def validate_response_format(cls, data: Any) -> Any:
        return _check_response_format(data)

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        return _check_stream_options(data)

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        _check_int_fields(data, ("prompt_logprobs", "top_logprobs"))
        _check_prompt_logprobs(data)
        top = data.get("top_logprobs")
        if top is not None:
            if top < 0 and top != -1:
                raise vllm_error(
                    "`top_logprobs` must be a positive value or -1.", "top_logprobs", top
                )
            if (top == -1 or top > 0) and not data.get("logprobs"):
                raise vllm_error(
                    "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
                )
        return data

    @model_validator(mode="before")
    @classmethod
    def check_structured_outputs_count(cls, data: Any) -> Any:
        count = _check_structured_outputs_count(data)
        if count > 1:
            raise vllm_error(
                "You can only use one kind of constraints for structured outputs ('json', "
                "'regex' or 'choice')."
            )
        if count > 0 and data.get("tool_choice", "none") not in ("none", "auto", "required"):
            raise vllm_error(
                "You can only either use constraints for structured outputs or tools, not both."
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def check_tool_usage(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("tools") == []:
            raise vllm_error(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely.",
                "tools",
            )
        if "tool_choice" not in data and data.get("tools"):
            data["tool_choice"] = "auto"  # in place, as vLLM does (errors then show it)
        choice = data.get("tool_choice")
        if choice is None or choice == "none":
            return data
        if data.get("tools") is None:
            raise vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise vllm_error(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", '
                '"auto" or "required" are supported.',
                "tool_choice",
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        return _check_generation_prompt(data)


class ResponsesRequest(_Base):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    user: str | None = None
    service_tier: str = "auto"
    top_logprobs: int | None = 0
    truncation: str | None = "disabled"
    request_id: str | None = None
    priority: int = 0
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_tool_usage(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        choice = data.get("tool_choice", "auto")
        if not tools:
            if choice in ("auto", "none"):
                data["tool_choice"] = "none"  # in place, as vLLM does
            elif choice == "required":
                raise vllm_error(
                    "Tool choice 'required' must be specified with 'tools' parameter.",
                    "tool_choice",
                )
        return data


class TokenizeCompletionRequest(_Base):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Base):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        return _check_generation_prompt(data)


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_INT64_MAX)]]


class _TokenizeUnion(BaseModel):
    # FastAPI validates `TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest`:
    # both branches' errors are reported, completion first
    body: TokenizeCompletionRequest | TokenizeChatRequest


_M = TypeVar("_M", bound=BaseModel)


def validate(model: type[_M], body: Any) -> _M:
    """The body validated as FastAPI validates a route's body parameter."""
    try:
        return model.model_validate(body, from_attributes=True)  # as FastAPI validates
    except ValidationError as e:
        raise request_validation_error(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        ) from None


def validate_tokenize(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    try:
        return _TokenizeUnion.model_validate({"body": body}, from_attributes=True).body
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if isinstance(body, dict):
            # a union's branches each add their model name to `loc`; vLLM's cleaning drops
            # them (bracket-free names are kept, so drop them here as pydantic names them)
            names = {"TokenizeCompletionRequest", "TokenizeChatRequest"}
            errors = [
                {**err, "loc": tuple(p for p in err["loc"] if p not in names)} for err in errors
            ]
        raise request_validation_error(errors) from None
