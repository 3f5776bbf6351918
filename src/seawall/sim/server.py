"""The emulator's HTTP shell: vLLM 0.33's OpenAI-compatible routes, bodies and errors.

Owns: the aiohttp application, request validation with vLLM's error texts, response and
SSE chunk shapes (pre-built byte templates, so a token costs a dict lookup and a join),
client-disconnect aborts, `/sim/*` fault and state routes, `/dcgm/metrics`, and the
process lifecycle (late bind for load time, SIGTERM abort or drain, crash, watchdog exit).

Must not: schedule or sample (that is `scheduler` and `textgen`) or step the engine (that
is `engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from seawall import clock
from seawall.errors import ApiError, bad_request
from seawall.sim import faults as fl
from seawall.sim import textgen
from seawall.sim.engine import Engine, Stream
from seawall.sim.metrics import TEXT_CONTENT_TYPE, SimMetrics
from seawall.sim.scheduler import (
    Scheduler,
    SchedulerConfig,
    SimRequest,
    StepCosts,
)

VLLM_VERSION = "0.33.0"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim-model"
    max_model_len: int = 4096
    kv_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    seed: int = 0
    enable_faults: bool = False
    faults: tuple[fl.Fault, ...] = ()
    load_time_s: float = 0.0
    shutdown_timeout_s: float = 0.0
    costs: StepCosts = field(default_factory=StepCosts)
    compat: bool = False
    enable_server_load_tracking: bool = False
    dcgm_gpus: int = 1
    enable_prefix_caching: bool = True
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            num_blocks=self.kv_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            costs=self.costs,
        )


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error_response(error: ApiError) -> web.Response:
    response = web.Response(
        body=error.json_bytes(), status=error.status, content_type="application/json"
    )
    for name, value in error.headers.items():
        response.headers[name] = value
    return response


def _sse_error(error: ApiError) -> bytes:
    # vLLM serialises mid-stream errors with json.dumps (not compact), then [DONE]
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n" + _DONE


def _validation(message: str, param: str, value: object) -> ApiError:
    return ApiError(400, f"{message} (parameter={param}, value={value})", param=param)


@dataclass(slots=True)
class _Parsed:
    # (prompt ids, clamped max_tokens) per prompt: completions accept a batch
    prompts: list[tuple[list[int], int]]
    requested_max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    keys: list[int]  # one per choice (n)
    ignore_eos: bool
    stop: tuple[str, ...]


class SimServer:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.metrics = SimMetrics(
            config.model,
            config.max_model_len,
            config.block_size,
            config.kv_blocks,
            compat=config.compat,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler_config())
        self.engine = Engine(
            self.scheduler,
            self.metrics,
            config.seed,
            on_crash=self._crash,
            on_engine_dead=self._engine_dead,
            max_num_queued_reqs=config.max_num_queued_reqs,
            max_num_queued_tokens=config.max_num_queued_tokens,
        )
        self.created = int(clock.wall())
        self.in_flight = 0
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self.hostname = socket.gethostname()
        self._rng = random.Random(config.seed ^ 0x5EA)
        self._tasks: set[asyncio.Task[None]] = set()
        self._token_json: dict[int, bytes] = {}
        self.app = self._build_app()

    # ------------------------------------------------------------------ app

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_middleware], client_max_size=64 << 20)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_post("/ping", self.health)
        r.add_get("/version", self.version)
        r.add_get("/load", self.load)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics_route)
        r.add_get("/metrics/{path:.*}", self.metrics_negotiated_route)
        r.add_get("/dcgm/metrics", self.dcgm_metrics)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        if self.config.enable_faults:
            r.add_post("/sim/fault", self.post_fault)
            r.add_get("/sim/state", self.get_state)
        return app

    @web.middleware
    async def _errors_middleware(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as error:
            return _error_response(error)
        except web.HTTPNotFound:
            return _json({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed:
            return _json({"detail": "Method Not Allowed"}, status=405)

    # ------------------------------------------------------------------ simple routes

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.dead else 200)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VLLM_VERSION})

    async def load(self, request: web.Request) -> web.Response:
        load = self.in_flight if self.config.enable_server_load_tracking else 0
        return _json({"server_load": load})

    async def models(self, request: web.Request) -> web.Response:
        c = self.config
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": c.model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "vllm",
                        "root": c.model,
                        "parent": None,
                        "max_model_len": c.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{secrets.token_hex(8)}",
                                "object": "model_permission",
                                "created": self.created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def metrics_route(self, request: web.Request) -> web.Response:
        """As vLLM 0.33's `/metrics`: text whatever Accept says (see sim/metrics.py)."""
        response = web.Response(body=self.metrics.render())
        response.headers["Content-Type"] = TEXT_CONTENT_TYPE
        return response

    async def metrics_negotiated_route(self, request: web.Request) -> web.Response:
        """As vLLM 0.33's `/metrics/`: prometheus_client's own content negotiation."""
        body, headers = self.metrics.render_negotiated(
            request.headers.get("Accept", ""), request.headers.get("Accept-Encoding", "")
        )
        return web.Response(body=body, headers=headers)

    async def dcgm_metrics(self, request: web.Request) -> web.Response:
        """dcgm-exporter's shape: one series per GPU, labelled like the real exporter."""
        faults = self.engine.faults
        busy = bool(self.scheduler.running) and faults.hang is None
        per_gpu = []
        for gpu in range(self.config.dcgm_gpus):
            labels = (
                f'gpu="{gpu}",UUID="GPU-5ea0a11{gpu:x}-0000-4000-8000-'
                f'{self.config.port:012x}",pci_bus_id="00000000:{gpu + 16:02X}:00.0",'
                f'device="nvidia{gpu}",modelName="NVIDIA A100-SXM4-80GB",'
                f'Hostname="{self.hostname}"'
            )
            values = faults.dcgm_values(gpu)
            if values["DCGM_FI_DEV_GPU_UTIL"] == 0 and busy:
                values["DCGM_FI_DEV_GPU_UTIL"] = 100.0
            per_gpu.append((labels, values))
        lines: list[str] = []
        for name, (kind, help_text, _) in fl.DCGM_FIELDS.items():
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, values in per_gpu:
                value = values[name]
                shown = str(int(value)) if value == int(value) else repr(value)
                lines.append(f"{name}{{{labels}}} {shown}")
        response = web.Response(body=("\n".join(lines) + "\n").encode())
        response.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return response

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if "messages" in body:
            ids = textgen.tokenize(self._render_chat(body))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("'prompt' must be a string", param="prompt")
            ids = textgen.tokenize(prompt)
        return _json(
            {
                "count": len(ids),
                "max_model_len": self.config.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise bad_request("'tokens' must be a list of integers", param="tokens")
        self._check_ids(tokens)
        return _json({"prompt": textgen.detokenize(tokens)})

    # ------------------------------------------------------------------ faults and state

    async def post_fault(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            fault = fl.parse_fault(body)
        except fl.FaultError as e:
            raise bad_request(str(e)) from None
        if isinstance(fault, fl.LoadTime):
            raise bad_request("load_time applies at start only: pass --load-time or --fault")
        if isinstance(fault, fl.Dcgm) and fault.gpu >= self.config.dcgm_gpus:
            raise bad_request(
                f"gpu {fault.gpu} does not exist (--dcgm-gpus {self.config.dcgm_gpus})"
            )
        self.engine.apply_fault(fault)
        return _json({"applied": body.get("kind"), "state": self.engine.snapshot()})

    async def get_state(self, request: web.Request) -> web.Response:
        return _json(self.engine.snapshot())

    def _crash(self) -> None:
        # like a killed process: no flush, no goodbye; the kernel closes every socket
        sys.stderr.write("seawall sim: crash fault, exiting now\n")
        sys.stderr.flush()
        os._exit(1)

    def _engine_dead(self, grace_s: float) -> None:
        loop = asyncio.get_running_loop()

        def watchdog_exit() -> None:
            if self.engine.dead:
                self.exit_code = 1
                self.stopping.set()

        loop.call_later(grace_s, watchdog_exit)

    # ------------------------------------------------------------------ parsing

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise ApiError(400, "Invalid JSON body", type="Bad Request") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object", type="Bad Request")
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.config.model}.",
                param="model",
            )

    def _check_ids(self, ids: list[int]) -> None:
        for t in ids:
            if not textgen.is_valid_token(t):
                raise bad_request(f"Token id {t} is out of vocabulary", param="prompt")

    def _render_chat(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list", param="messages")
        continue_final = bool(body.get("continue_final_message", False))
        add_generation_prompt = bool(body.get("add_generation_prompt", True))
        try:
            return textgen.render_chat(messages, add_generation_prompt, continue_final)
        except textgen.ChatTemplateError as e:
            raise bad_request(str(e)) from None

    def _parse_common(
        self,
        body: dict[str, Any],
        prompts: list[list[int]],
        max_tokens_field: str,
        default_max_tokens: int | None,
    ) -> _Parsed:
        limit = self.config.max_model_len
        n = body.get("n")
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise bad_request(f"n must be at least 1, got {n}.", param="n")
        for prompt_ids in prompts:
            prompt_len = len(prompt_ids)
            if prompt_len > limit:
                raise _validation(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt contains {prompt_len} input tokens, which exceeds this limit even "
                    "without any output tokens. Please reduce the length of the input prompt.",
                    "input_tokens",
                    prompt_len,
                )
        requested = body.get(max_tokens_field)
        if requested is None and max_tokens_field == "max_completion_tokens":
            requested = body.get("max_tokens")
            max_tokens_field = "max_tokens"
        if requested is None:
            requested = default_max_tokens
        if requested is not None:
            if isinstance(requested, bool) or not isinstance(requested, int):
                raise bad_request(f"'{max_tokens_field}' must be an integer", max_tokens_field)
            if requested > limit:
                raise _validation(
                    f"{max_tokens_field}={requested} cannot be greater than "
                    f"max_model_len={limit}. Please request fewer output tokens.",
                    max_tokens_field,
                    requested,
                )
        # vLLM's get_max_tokens: clamp silently to what the context leaves
        clamped: list[tuple[list[int], int]] = []
        for prompt_ids in prompts:
            room = limit - len(prompt_ids)
            max_tokens = room if requested is None else min(requested, room)
            if max_tokens < 1:
                raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
            clamped.append((prompt_ids, max_tokens))
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            raise bad_request("'temperature' must be a number", param="temperature")
        if temperature < 0:
            raise bad_request(
                f"temperature must be non-negative, got {temperature}.", param="temperature"
            )
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise bad_request("'seed' must be an integer", param="seed")
        if temperature > 0 and seed is None:
            seed = self._rng.getrandbits(63)  # unseeded sampling varies, as on a GPU
        stop_raw = body.get("stop")
        if stop_raw is None:
            stop: tuple[str, ...] = ()
        elif isinstance(stop_raw, str):
            stop = (stop_raw,) if stop_raw else ()
        elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
            stop = tuple(s for s in stop_raw if s)
        else:
            raise bad_request("'stop' must be a string or a list of strings", param="stop")
        stream_options = body.get("stream_options") or {}
        include_usage = bool(
            isinstance(stream_options, dict) and stream_options.get("include_usage")
        )
        return _Parsed(
            prompts=clamped,
            continuous_usage=include_usage
            and bool(
                isinstance(stream_options, dict) and stream_options.get("continuous_usage_stats")
            ),
            requested_max_tokens=requested,
            stream=bool(body.get("stream", False)),
            include_usage=include_usage,
            # each choice samples with its own seed (seed + i), as vLLM's ParentRequest does
            keys=[
                textgen.sampling_key(
                    self.config.seed, float(temperature), None if seed is None else seed + i
                )
                for i in range(n)
            ],
            ignore_eos=bool(body.get("ignore_eos", False)),
            stop=stop,
        )

    def _completion_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        """A string, token ids, or a batch of either (one choice group per prompt)."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [textgen.tokenize(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return [self._checked_ids(prompt)]
            if all(isinstance(p, str) for p in prompt):
                return [textgen.tokenize(p) for p in prompt]
            if all(
                isinstance(p, list)
                and p
                and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                for p in prompt
            ):
                return [self._checked_ids(p) for p in prompt]
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list of either",
            param="prompt",
        )

    def _checked_ids(self, ids: list[int]) -> list[int]:
        self._check_ids(ids)
        return list(ids)

    # ------------------------------------------------------------------ generation routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival_s = clock.monotonic()
        body = await self._body(request)
        self._check_model(body)
        parsed = self._parse_common(body, self._completion_prompts(body), "max_tokens", 16)
        request_id = "cmpl-" + self._base_request_id(request, body)
        return await self._generate(request, parsed, request_id, arrival_s, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival_s = clock.monotonic()
        body = await self._body(request)
        self._check_model(body)
        prompt_ids = textgen.tokenize(self._render_chat(body))
        parsed = self._parse_common(body, [prompt_ids], "max_completion_tokens", None)
        request_id = "chatcmpl-" + self._base_request_id(request, body)
        return await self._generate(request, parsed, request_id, arrival_s, chat=True)

    @staticmethod
    def _base_request_id(request: web.Request, body: dict[str, Any]) -> str:
        """vLLM's `_base_request_id`: the X-Request-Id header, else the body's
        `request_id`, else a random one."""
        header = request.headers.get("X-Request-Id")
        if header is not None:
            return header
        from_body = body.get("request_id")
        return from_body if isinstance(from_body, str) and from_body else secrets.token_hex(16)

    async def _generate(
        self,
        request: web.Request,
        parsed: _Parsed,
        request_id: str,
        arrival_s: float,
        chat: bool,
    ) -> web.StreamResponse:
        # n > 1 fans out into one sequence per choice, as vLLM's ParentRequest does
        streams: list[Stream] = []
        self.in_flight += 1
        try:
            # choice index = prompt index * n + i, as vLLM numbers a batch
            for prompt_ids, max_tokens in parsed.prompts:
                for i, key in enumerate(parsed.keys):
                    sim_request = SimRequest(
                        # the engine's own id: clients may reuse X-Request-Id, engines may not
                        request_id=self.engine.new_request_id("req"),
                        prompt_ids=prompt_ids,
                        max_tokens=max_tokens,
                        key=key,
                        ignore_eos=parsed.ignore_eos,
                    )
                    streams.append(
                        self.engine.submit(
                            sim_request,
                            arrival_s,
                            parsed.stop,
                            streaming=parsed.stream,
                            params_n=len(parsed.keys) if i == 0 else None,
                        )
                    )
            orca = self._orca_header(request)
            if parsed.stream:
                return await self._stream(request, streams, parsed, request_id, chat, orca)
            response = await self._complete(streams, request_id, chat)
            if orca is not None:
                response.headers["endpoint-load-metrics"] = self._orca_header(request) or ""
            return response
        finally:
            self.in_flight -= 1
            # a cancelled handler (client gone) or a failed write lands here unfinished
            for stream in streams:
                self.engine.abort(stream)

    def _orca_header(self, request: web.Request) -> str | None:
        """vLLM's ORCA load report (`serve/utils/orca_metrics.py`), TEXT format only."""
        if request.headers.get("endpoint-load-metrics-format", "").upper() != "TEXT":
            return None
        s = self.scheduler
        return (
            f"TEXT named_metrics.kv_cache_usage_perc={s.kv_usage()}, "
            f"named_metrics.num_requests_waiting={float(len(s.waiting))}"
        )

    # ------------------------------------------------------------------ bodies

    def _output(self, stream: Stream) -> tuple[str, str | None]:
        """Final text and finish_reason; a stop string ends the text before itself."""
        text = textgen.detokenize(stream.request.output_ids, skip_special=True)
        if stream.stop_text_len is not None:
            text = text[: stream.stop_text_len]
        reason = stream.finish.value if stream.finish is not None else None
        return text, reason

    @staticmethod
    def _usage(streams: list[Stream]) -> dict[str, int]:
        # a prompt counts once however many choices it has
        prompt = sum(s.num_prompt_tokens for s in streams if s.params_n is not None)
        completion = sum(s.num_output_tokens for s in streams)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }

    async def _complete(self, streams: list[Stream], request_id: str, chat: bool) -> web.Response:
        for stream in streams:
            while not stream.done:
                await stream.next_tokens()
            if stream.error is not None:
                return _error_response(stream.error)
        usage: dict[str, Any] = {**self._usage(streams), "prompt_tokens_details": None}
        created = int(clock.wall())
        choices: list[dict[str, Any]] = []
        for index, stream in enumerate(streams):
            text, reason = self._output(stream)
            if chat:
                choices.append(
                    {
                        "index": index,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": None,
                        "finish_reason": reason,
                        "stop_reason": stream.stop_reason,
                        "token_ids": None,
                        "routed_experts": None,
                        "weight_versions": None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": reason,
                        "stop_reason": stream.stop_reason,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                        "weight_versions": None,
                    }
                )
        if chat:
            return _json(
                {
                    "id": request_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": self.config.model,
                    "choices": choices,
                    "service_tier": None,
                    "system_fingerprint": None,
                    "usage": {**usage, "completion_tokens_details": None},
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "prompt_text": None,
                    "kv_transfer_params": None,
                    "ec_transfer_params": None,
                    "metrics": None,
                }
            )
        return _json(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.config.model,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "kv_transfer_params": None,
            }
        )

    def _text_json(self, token: int) -> bytes:
        cached = self._token_json.get(token)
        if cached is None:
            cached = orjson.dumps(textgen.token_text(token))
            if len(self._token_json) < 1_000_000:
                self._token_json[token] = cached
        return cached

    async def _stream(
        self,
        request: web.Request,
        streams: list[Stream],
        parsed: _Parsed,
        request_id: str,
        chat: bool,
        orca: str | None = None,
    ) -> web.StreamResponse:
        prefix = (
            b'data: {"id":' + orjson.dumps(request_id) + b',"object":"'
            + (b"chat.completion.chunk" if chat else b"text_completion")
            + b'","created":' + str(int(clock.wall())).encode()
            + b',"model":' + orjson.dumps(self.config.model) + b","
        )  # fmt: skip
        headers = SSE_HEADERS if orca is None else {**SSE_HEADERS, "endpoint-load-metrics": orca}
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        if len(streams) == 1:
            error = await self._pump(response, streams[0], 0, prefix, parsed, chat)
        else:
            pumps = [
                asyncio.ensure_future(self._pump(response, s, i, prefix, parsed, chat))
                for i, s in enumerate(streams)
            ]
            try:
                errors = await asyncio.gather(*pumps)
            finally:
                for pump in pumps:
                    pump.cancel()
            error = next((e for e in errors if e is not None), None)
        if error is not None:
            await response.write(_sse_error(error))
            return response
        tail = b""
        if parsed.include_usage:
            tail = prefix + b'"choices":[],"usage":' + orjson.dumps(self._usage(streams)) + b"}\n\n"
        await response.write(tail + _DONE)
        await response.write_eof()
        return response

    async def _pump(
        self,
        response: web.StreamResponse,
        stream: Stream,
        index: int,
        prefix: bytes,
        parsed: _Parsed,
        chat: bool,
    ) -> ApiError | None:
        """Write one choice's chunks up to and including its final chunk; the error that
        ended it, if one did (the caller writes the error event)."""
        head = prefix + b'"choices":[{"index":' + str(index).encode() + b","
        if chat:
            open_text = b'"delta":{"content":'
            mid_text = b'},"logprobs":null,"finish_reason":'
            tail_open = b',"token_ids":null}],"kv_transfer_params":null}\n\n'
            tail_final = (
                b',"stop_reason":%s,"token_ids":null,"weight_versions":null}],'
                b'"kv_transfer_params":null}\n\n'
            )
        else:
            open_text = b'"text":'
            mid_text = b',"logprobs":null,"finish_reason":'
            tail_open = (
                b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null,'
                b'"weight_versions":null}],"kv_transfer_params":null}\n\n'
            )
            tail_final = (
                b',"stop_reason":%s,"prompt_token_ids":null,"token_ids":null,'
                b'"weight_versions":null}],"kv_transfer_params":null}\n\n'
            )
        # vLLM sends the role chunk with the first engine output, not before: a client
        # timing its first chunk measures the real time to first token
        role_chunk = (
            head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
            b'"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n'
            if chat
            else b""
        )
        text_json = self._text_json
        slow_path = bool(parsed.stop)
        continuous = parsed.continuous_usage
        hold_chars = max((len(x) for x in parsed.stop), default=1) - 1
        sent_chars = 0
        while True:
            tokens = await stream.next_tokens()
            finish = stream.finish
            out = role_chunk
            role_chunk = b""
            if stream.error is not None and finish is not None:
                if tokens and not slow_path:
                    piece = self._join_tokens(tokens, text_json)
                    out += head + open_text + piece + mid_text + b"null" + tail_open
                if out:
                    await response.write(out)
                return stream.error
            if slow_path:
                text = stream.text
                if stream.stop_text_len is not None:
                    text = text[: stream.stop_text_len]
                elif finish is None:
                    # hold back what may be the start of a stop string, as vLLM does
                    text = text[: max(sent_chars, len(text) - hold_chars)]
                piece = orjson.dumps(text[sent_chars:])
                sent_chars = len(text)
            elif tokens:
                piece = self._join_tokens(tokens, text_json)
            else:
                piece = b'""'
            if finish is None:
                if piece != b'""':
                    out += head + open_text + piece + mid_text + b"null" + tail_open
                if out:
                    await response.write(self._with_usage(out, stream) if continuous else out)
                continue
            stop_reason = orjson.dumps(stream.stop_reason)
            out += (
                head + open_text + piece + mid_text + b'"' + finish.value.encode() + b'"'
                + tail_final % stop_reason
            )  # fmt: skip
            await response.write(self._with_usage(out, stream) if continuous else out)
            return None

    def _with_usage(self, chunks: bytes, stream: Stream) -> bytes:
        """`stream_options.continuous_usage_stats`: usage so far in every content chunk."""
        usage = self._usage([stream])
        return chunks.replace(
            b'}],"kv_transfer_params"',
            b'}],"usage":' + orjson.dumps(usage) + b',"kv_transfer_params"',
        )

    @staticmethod
    def _join_tokens(tokens: list[int], text_json: Callable[[int], bytes]) -> bytes:
        if len(tokens) == 1:
            return text_json(tokens[0])
        return orjson.dumps("".join(textgen.token_text(t) for t in tokens))

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> int:
        """Run until SIGTERM/SIGINT (or the engine-dead watchdog); returns the exit code."""
        c = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        for fault in c.faults:
            self.engine.apply_fault(fault)
        if c.load_time_s > 0:
            # vLLM binds its port only once the model is loaded: connections are refused
            print(f"seawall sim: loading model for {c.load_time_s:g}s", flush=True)
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=c.load_time_s)
                return 0
            except TimeoutError:
                pass
        self.engine.start()
        runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
        )
        await runner.setup()
        site = web.TCPSite(runner, c.host, c.port, reuse_address=True, backlog=4096)
        await site.start()
        server: Any = site._server  # the port bound (the one asked for, or any with 0)
        port = int(server.sockets[0].getsockname()[1])
        print(
            f"seawall sim: serving {c.model} on http://{c.host}:{port} "
            f"(kv_blocks={c.kv_blocks}, block_size={c.block_size}, "
            f"max_model_len={c.max_model_len})",
            flush=True,
        )
        await self.stopping.wait()
        print("seawall sim: shutting down", flush=True)
        await self.engine.shutdown(c.shutdown_timeout_s)
        # give streams a moment to write their last chunk, then close everything
        for _ in range(100):
            if self.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        await self.engine.stop()
        with contextlib.suppress(Exception):
            await runner.cleanup()
        return self.exit_code
