"""The emulator's HTTP shell: vLLM 0.33's OpenAI-compatible routes, bodies and errors.

Owns: the aiohttp application, the order in which a request is read, validated
(`protocol`) and checked (`openai`) as vLLM's serving layer does, the response bodies and
SSE streams of `/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/tokenize` and
`/detokenize` (keys as vLLM dumps them; tests/data/vllm/ holds vLLM's own answers),
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
from seawall.sim import openai as oa
from seawall.sim import protocol as p
from seawall.sim import textgen
from seawall.sim.engine import Engine, Stream, wait_any
from seawall.sim.metrics import TEXT_CONTENT_TYPE, SimMetrics
from seawall.sim.scheduler import (
    Scheduler,
    SchedulerConfig,
    SimRequest,
    StepCosts,
)

VLLM_VERSION = oa.VLLM_VERSION
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
    grammar_per_node_s: float = 0.000002

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
        # what vLLM hashes into its fingerprint: the serving configuration
        self.fingerprint = oa.system_fingerprint(
            f"{config.model}|{config.max_model_len}|{config.kv_blocks}|{config.block_size}|"
            f"{config.max_num_seqs}|{config.max_num_batched_tokens}|{config.seed}"
        )
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
        r.add_post("/v1/responses", self.responses)
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
        req = p.validate_tokenize(await self._body(request))
        self._check_model(req.model)
        if isinstance(req, p.TokenizeChatRequest):
            text = self._render_chat(
                req.messages, req.add_generation_prompt, req.continue_final_message
            )
        else:
            text = req.prompt
        # vLLM's /tokenize has no context-length limit: it counts whatever it is given
        ids = textgen.tokenize(text)
        return _json(
            {
                "count": len(ids),
                "max_model_len": self.config.max_model_len,
                "tokens": ids,
                "token_strs": [textgen.token_bytes(t).decode("utf-8", errors="replace")
                               for t in ids] if req.return_token_strs else None,
            }
        )  # fmt: skip

    async def detokenize(self, request: web.Request) -> web.Response:
        req = p.validate(p.DetokenizeRequest, await self._body(request))
        self._check_model(req.model)
        # vLLM's tokenizer decodes an id outside the vocabulary as nothing (a 200)
        known = [t for t in req.tokens if textgen.is_valid_token(t)]
        return _json({"prompt": textgen.detokenize(known)})

    # ------------------------------------------------------------------ faults and state

    async def post_fault(self, request: web.Request) -> web.Response:
        # the sim's own route: any content type, a JSON object
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise ApiError(400, "Invalid JSON body", type="Bad Request") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object", type="Bad Request")
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

    async def _body(self, request: web.Request) -> Any:
        """The JSON body as vLLM's FastAPI routes read it (content type checked)."""
        raw = await request.read()
        return p.parse_json_body(raw, request.headers.get("Content-Type"))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.config.model}.",
                param="model",
                type="NotFoundError",
            )

    def _render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final: bool
    ) -> str:
        try:
            return textgen.render_chat(messages, add_generation_prompt, continue_final)
        except textgen.ChatTemplateError as e:
            raise p.value_error(str(e)) from None

    def _new_gen(
        self,
        prompts: list[oa.Prompt],
        *,
        sampling: oa.Sampling,
        stream: bool | None,
        stream_options: p.StreamOptions | None,
        seed: int | None,
        ignore_eos: bool,
        stop: str | list[str] | None,
        stop_token_ids: list[int] | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        echo: bool,
        echo_only: bool,
        return_token_ids: bool,
        grammar_cost_s: float,
        request_id: str,
    ) -> oa.Gen:
        # SamplingParams are built (and verified) per prompt, then the input processor
        # checks the logprobs limits and the prompt's tokens: vLLM's order
        for prompt in prompts:
            oa.check_sampling(sampling, prompt.max_tokens)
        oa.check_logprobs_limits(logprobs, prompt_logprobs)
        for prompt in prompts:
            oa.check_engine_prompt(prompt.ids)
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        include_usage = bool(stream_options and stream_options.include_usage)
        temperature = sampling.temperature
        return oa.Gen(
            prompts=prompts,
            n=sampling.n,
            stream=bool(stream),
            include_usage=include_usage,
            continuous_usage=include_usage
            and bool(stream_options and stream_options.continuous_usage_stats),
            temperature=1.0 if temperature is None else temperature,
            seed=seed,
            ignore_eos=ignore_eos,
            stop=tuple(s for s in stops if s),
            stop_token_ids=frozenset(stop_token_ids or ()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            echo=echo,
            echo_only=echo_only,
            return_token_ids=return_token_ids,
            grammar_cost_s=grammar_cost_s,
            request_id=request_id,
        )

    @staticmethod
    def _sampling(req: p.CompletionRequest | p.ChatCompletionRequest, n: int) -> oa.Sampling:
        return oa.Sampling(
            n=n,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            min_tokens=req.min_tokens,
        )

    def _keys(self, gen: oa.Gen) -> list[int]:
        seed = gen.seed
        if gen.temperature > 0 and seed is None:
            seed = self._rng.getrandbits(63)  # unseeded sampling varies, as on a GPU
        # each choice samples with its own seed (seed + i), as vLLM's ParentRequest does
        return [
            textgen.sampling_key(
                self.config.seed, gen.temperature, None if seed is None else seed + i
            )
            for i in range(gen.n)
        ]

    @staticmethod
    def _base_request_id(request: web.Request, body_id: str | None) -> str:
        """vLLM's `_base_request_id`: the X-Request-Id header, else the body's
        `request_id` (whose default is a fresh `random_uuid()`, 16 hex digits)."""
        header = request.headers.get("X-Request-Id")
        if header is not None:
            return header
        return body_id if body_id is not None else oa.random_uuid()

    # ------------------------------------------------------------------ generation routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival_s = clock.monotonic()
        req = p.validate(p.CompletionRequest, await self._body(request))
        self._check_model(req.model)
        if req.suffix is not None:
            raise ApiError(
                400,
                "suffix is only supported for models with FIM completion rendering",
                param="suffix",
                type="BadRequestError",
            )
        if req.prompt == []:
            raise p.vllm_error("You must pass at least one prompt", "prompt")
        limit = self.config.max_model_len
        oa.check_max_tokens_param("max_tokens", req.max_tokens, limit)
        raw = req.prompt
        texts: list[str | None]
        if isinstance(raw, str):
            texts = [raw]
        elif raw and isinstance(raw[0], str):
            texts = [str(x) for x in raw]
        elif raw and isinstance(raw[0], list):
            texts = [None] * len(raw)
        else:
            texts = [None]
        prompts: list[oa.Prompt] = []
        echo_only = bool(req.echo) and req.max_tokens == 0
        for i, text in enumerate(texts):
            if text is not None:
                ids = oa.tokenize_checked(text, limit)
            else:
                ids = list(raw[i] if raw and isinstance(raw[0], list) else raw or [])  # type: ignore[arg-type]
                oa.check_prompt_len(ids, limit)
            max_tokens = oa.engine_max_tokens(limit, req.max_tokens, len(ids))
            shown = "" if text is None or req.return_token_ids else text
            prompts.append(oa.Prompt(ids, shown, 1 if echo_only else max_tokens))
        gen = self._new_gen(
            prompts,
            sampling=self._sampling(req, req.n),
            stream=req.stream,
            stream_options=req.stream_options,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            logprobs=req.logprobs,
            # echo asks for the prompt's logprobs too, as many as for the output
            prompt_logprobs=req.prompt_logprobs
            if req.prompt_logprobs is not None or not req.echo
            else req.logprobs,
            echo=bool(req.echo),
            echo_only=echo_only,
            return_token_ids=bool(req.return_token_ids),
            grammar_cost_s=oa.grammar_cost(
                req.response_format, req.structured_outputs, self.config.grammar_per_node_s
            ),
            request_id="cmpl-" + self._base_request_id(request, req.request_id),
        )
        return await self._generate(request, gen, arrival_s, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival_s = clock.monotonic()
        req = p.validate(p.ChatCompletionRequest, await self._body(request))
        self._check_model(req.model)
        oa.check_tools(req.tool_choice if req.tools else None)
        limit = self.config.max_model_len
        requested: int | None
        if req.max_completion_tokens is not None:
            requested, name = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, name = req.max_tokens, "max_tokens"
        oa.check_max_tokens_param(name, requested, limit)
        if not req.messages:
            raise p.value_error(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        text = self._render_chat(
            req.messages, req.add_generation_prompt, req.continue_final_message
        )
        ids = oa.tokenize_checked(text, limit)
        # chat's default is the rest of the context (completions' is 16)
        max_tokens = oa.engine_max_tokens(limit, requested, len(ids))
        top = req.top_logprobs if req.logprobs else None
        gen = self._new_gen(
            [oa.Prompt(ids, text, max_tokens)],
            sampling=self._sampling(req, 1 if req.n is None else req.n),
            stream=req.stream,
            stream_options=req.stream_options,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            logprobs=top,
            prompt_logprobs=req.prompt_logprobs
            if req.prompt_logprobs is not None or not req.echo
            else req.top_logprobs,
            echo=False,
            echo_only=False,
            return_token_ids=bool(req.return_token_ids),
            grammar_cost_s=oa.grammar_cost(
                req.response_format, req.structured_outputs, self.config.grammar_per_node_s
            ),
            request_id="chatcmpl-" + self._base_request_id(request, req.request_id),
        )
        return await self._generate(request, gen, arrival_s, "chat")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        arrival_s = clock.monotonic()
        req = p.validate(p.ResponsesRequest, await self._body(request))
        self._check_model(req.model)
        messages: list[dict[str, Any]] = []
        if req.instructions is not None:
            messages.append({"role": "system", "content": req.instructions})
        if isinstance(req.input, str):
            messages.append({"role": "user", "content": req.input})
        else:
            for item in req.input:
                content = item.get("content")
                if isinstance(content, list):  # input_text / output_text parts
                    content = "".join(
                        str(c.get("text", "")) for c in content if isinstance(c, dict)
                    )
                messages.append({"role": item.get("role", "user"), "content": content})
        text = self._render_chat(messages, True, False)
        limit = self.config.max_model_len
        oa.check_max_tokens_param("max_output_tokens", req.max_output_tokens, limit)
        ids = oa.tokenize_checked(text, limit)
        max_tokens = oa.engine_max_tokens(limit, req.max_output_tokens, len(ids))
        gen = self._new_gen(
            [oa.Prompt(ids, text, max_tokens)],
            sampling=oa.Sampling(temperature=req.temperature, top_p=req.top_p),
            stream=req.stream,
            stream_options=None,
            seed=None,
            ignore_eos=False,
            stop=None,
            stop_token_ids=None,
            logprobs=None,
            prompt_logprobs=None,
            echo=False,
            echo_only=False,
            return_token_ids=False,
            grammar_cost_s=0.0,
            request_id=req.request_id or f"resp_{oa.random_uuid()}",
        )
        gen.extra = {"request": req, "max_output_tokens": max_tokens}
        return await self._generate(request, gen, arrival_s, "responses")

    async def _generate(
        self, request: web.Request, gen: oa.Gen, arrival_s: float, kind: str
    ) -> web.StreamResponse:
        # n > 1 fans out into one sequence per choice, as vLLM's ParentRequest does;
        # choice index = prompt index * n + i, as vLLM numbers a batch
        streams: list[Stream] = []
        keys = self._keys(gen)
        self.in_flight += 1
        try:
            for prompt in gen.prompts:
                for i, key in enumerate(keys):
                    sim_request = SimRequest(
                        # the engine's own id: clients may reuse X-Request-Id, engines may not
                        request_id=self.engine.new_request_id("req"),
                        prompt_ids=prompt.ids,
                        max_tokens=prompt.max_tokens,
                        key=key,
                        ignore_eos=gen.ignore_eos,
                        stop_token_ids=gen.stop_token_ids,
                        grammar_cost_s=gen.grammar_cost_s,
                    )
                    streams.append(
                        self.engine.submit(
                            sim_request,
                            arrival_s,
                            gen.stop,
                            streaming=gen.stream,
                            params_n=gen.n if i == 0 else None,
                        )
                    )
            orca = self._orca_header(request)
            if gen.stream:
                if kind == "responses":
                    return await self._stream_responses(request, streams[0], gen)
                return await self._stream(request, streams, gen, kind == "chat", orca)
            for stream in streams:
                while not stream.done:
                    await stream.next_tokens()
                if stream.error is not None:
                    return _error_response(stream.error)
            if kind == "responses":
                return _json(self._responses_body(streams[0], gen, "final"))
            body = (
                self._chat_body(streams, gen) if kind == "chat" else self._cmpl_body(streams, gen)
            )
            response = _json(body)
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

    @staticmethod
    def _output(stream: Stream) -> tuple[str, str | None]:
        """Final text and finish_reason; a stop string ends the text before itself."""
        ids = stream.request.output_ids
        if isinstance(stream.stop_reason, int):
            ids = ids[:-1]  # a stop token counts as output but is not in the text
        text = textgen.detokenize(ids, skip_special=True)
        if stream.stop_text_len is not None:
            text = text[: stream.stop_text_len]
        reason = stream.finish.value if stream.finish is not None else None
        return text, reason

    def _prompt_of(self, gen: oa.Gen, index: int) -> oa.Prompt:
        return gen.prompts[index // gen.n]

    @staticmethod
    def _prompt_tokens(streams: list[Stream]) -> int:
        # a prompt counts once however many choices it has
        return sum(s.num_prompt_tokens for s in streams if s.params_n is not None)

    def _cmpl_body(self, streams: list[Stream], gen: oa.Gen) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for index, stream in enumerate(streams):
            prompt = self._prompt_of(gen, index)
            out_ids = list(stream.request.output_ids)
            text, reason = self._output(stream)
            tokens = out_ids
            if gen.echo:
                text = prompt.text if gen.echo_only else prompt.text + text
                tokens = prompt.ids if gen.echo_only else prompt.ids + out_ids
            logprobs = None
            if gen.logprobs is not None:
                logprobs = oa.completion_logprobs(tokens, gen.logprobs, 0, prompt_first=gen.echo)
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": stream.stop_reason,
                    "token_ids": out_ids if gen.return_token_ids else None,
                    "prompt_logprobs": None
                    if gen.prompt_logprobs is None
                    else oa.prompt_logprobs(prompt.ids, gen.prompt_logprobs),
                    "prompt_token_ids": prompt.ids if gen.return_token_ids else None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            )
        prompt_tokens = self._prompt_tokens(streams)
        return {
            "id": gen.request_id,
            "object": "text_completion",
            "created": int(clock.wall()),
            "model": self.config.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": oa.usage(prompt_tokens, sum(s.num_output_tokens for s in streams)),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _chat_body(self, streams: list[Stream], gen: oa.Gen) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for index, stream in enumerate(streams):
            out_ids = list(stream.request.output_ids)
            text, reason = self._output(stream)
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
                    "logprobs": None
                    if gen.logprobs is None
                    else oa.chat_logprobs(out_ids, gen.logprobs),
                    "finish_reason": reason,
                    "stop_reason": stream.stop_reason,
                    "token_ids": out_ids if gen.return_token_ids else None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            )
        prompt = gen.prompts[0]
        prompt_tokens = self._prompt_tokens(streams)
        return {
            "id": gen.request_id,
            "object": "chat.completion",
            "created": int(clock.wall()),
            "model": self.config.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": oa.usage(prompt_tokens, sum(s.num_output_tokens for s in streams)),
            "prompt_logprobs": None
            if gen.prompt_logprobs is None
            else oa.prompt_logprobs(prompt.ids, gen.prompt_logprobs),
            "prompt_token_ids": prompt.ids if gen.return_token_ids else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _responses_body(self, stream: Stream, gen: oa.Gen, phase: str) -> dict[str, Any]:
        """`ResponsesResponse.model_dump()`; phase "created" is the stream's opening copy
        (no output, no usage), "final" the finished response."""
        req: p.ResponsesRequest = gen.extra["request"]
        output: list[dict[str, Any]] = []
        usage: dict[str, Any] | None = None
        status = "in_progress"
        incomplete = None
        if phase == "final":
            text, reason = self._output(stream)
            status = "incomplete" if reason == "length" else "completed"
            if reason == "length":
                incomplete = {"reason": "max_output_tokens"}
            output = [self._responses_message(gen, text, status)]
            prompt_tokens = stream.num_prompt_tokens
            completion = stream.num_output_tokens
            usage = {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                         "input_tokens_per_turn": [],
                                         "cached_tokens_per_turn": []},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                          "output_tokens_per_turn": [],
                                          "tool_output_tokens_per_turn": []},
                "total_tokens": prompt_tokens + completion,
            }  # fmt: skip
        return {
            "id": gen.request_id,
            "created_at": gen.extra.setdefault("created_at", int(clock.wall())),
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "metadata": req.metadata,
            "model": self.config.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "tool_choice": req.tool_choice,
            "tools": req.tools,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "background": False,
            "max_output_tokens": gen.extra["max_output_tokens"],
            "max_tool_calls": None,
            "previous_response_id": req.previous_response_id,
            "prompt": None,
            "prompt_cache_options": None,
            "prompt_cache_key": None,
            "prompt_cache_retention": None,
            "reasoning": req.reasoning,
            "safety_identifier": None,
            "service_tier": req.service_tier,
            "status": status,
            "text": req.text,
            "top_logprobs": None,
            "truncation": req.truncation,
            "usage": usage,
            "user": req.user,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    @staticmethod
    def _responses_message(gen: oa.Gen, text: str, status: str) -> dict[str, Any]:
        item_id = gen.extra.setdefault("item_id", f"msg_{oa.random_uuid()}")
        return {
            "id": item_id,
            "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
            "role": "assistant",
            "status": status,
            "type": "message",
            "phase": None,
        }

    # ------------------------------------------------------------------ streams

    async def _stream(
        self,
        request: web.Request,
        streams: list[Stream],
        gen: oa.Gen,
        chat: bool,
        orca: str | None = None,
    ) -> web.StreamResponse:
        """vLLM's stream generators: one chunk per engine output of a choice (held-back
        stop-string text makes it an empty one), chat's role chunks for every choice on the
        first output, the usage chunk (if asked) and `[DONE]`."""
        headers = SSE_HEADERS if orca is None else {**SSE_HEADERS, "endpoint-load-metrics": orca}
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        head = {
            "id": gen.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(clock.wall()),
            "model": self.config.model,
        }
        n = len(streams)
        sent_chars = [0] * n
        num_tokens = [0] * n
        first_out = [True] * n
        done = [False] * n
        text_offsets = [0] * n
        role_sent = not chat
        hold = max((len(x) for x in gen.stop), default=1) - 1
        dumps = orjson.dumps
        while not all(done):
            await wait_any([s for s, d in zip(streams, done, strict=True) if not d])
            out: list[bytes] = []
            for i, stream in enumerate(streams):
                if done[i]:
                    continue
                tokens = stream.pending
                stream.pending = []
                finish = stream.finish
                error = stream.error if finish is not None else None
                failed = error is not None
                if failed:
                    # what it produced before failing is sent, then vLLM's error event
                    finish = None
                if not tokens and finish is None and not failed:
                    continue
                if not role_sent and (tokens or finish is not None):
                    role_sent = True
                    for j in range(n):
                        chunk: dict[str, Any] = {
                            **head,
                            "choices": [
                                {
                                    "index": j,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                        if gen.continuous_usage:
                            chunk["usage"] = {
                                **oa.usage(streams[j].num_prompt_tokens, 0, full=False),
                                "completion_tokens_details": None,
                            }
                        chunk["prompt_token_ids"] = (
                            gen.prompts[0].ids if gen.return_token_ids else None
                        )
                        chunk["prompt_text"] = None
                        out.append(b"data: " + dumps(chunk) + b"\n\n")
                # the text these tokens add, less what may start a stop string
                if gen.stop:
                    text = stream.text
                    if stream.stop_text_len is not None:
                        text = text[: stream.stop_text_len]
                    elif finish is None:
                        text = text[: max(sent_chars[i], len(text) - hold)]
                    delta = text[sent_chars[i] :]
                    sent_chars[i] = len(text)
                else:
                    shown = tokens
                    if finish is not None and isinstance(stream.stop_reason, int):
                        shown = tokens[:-1]  # the stop token: counted, not detokenized
                    delta = "".join(textgen.token_text(t) for t in shown)
                num_tokens[i] += len(tokens)
                prompt = self._prompt_of(gen, i)
                echo_now = gen.echo and first_out[i]
                choice: dict[str, Any] = {"index": i}
                if chat:
                    choice["delta"] = {"content": delta}
                    choice["logprobs"] = (
                        None if gen.logprobs is None else oa.chat_logprobs(tokens, gen.logprobs)
                    )
                else:
                    lp_tokens = tokens
                    if echo_now:
                        delta = prompt.text if gen.echo_only else prompt.text + delta
                        lp_tokens = prompt.ids if gen.echo_only else prompt.ids + tokens
                    choice["text"] = delta
                    logprobs = None
                    if gen.logprobs is not None:
                        logprobs = oa.completion_logprobs(
                            lp_tokens, gen.logprobs, text_offsets[i], prompt_first=echo_now
                        )
                        if logprobs["tokens"]:
                            text_offsets[i] = logprobs["text_offset"][-1] + len(
                                logprobs["tokens"][-1]
                            )
                    choice["logprobs"] = logprobs
                choice["finish_reason"] = None if finish is None else finish.value
                if not chat or finish is not None:
                    choice["stop_reason"] = None if finish is None else stream.stop_reason
                if not chat:
                    choice["prompt_token_ids"] = (
                        prompt.ids if first_out[i] and (gen.echo or gen.return_token_ids) else None
                    )
                choice["token_ids"] = list(tokens) if gen.return_token_ids else None
                if not chat or finish is not None:
                    choice["weight_versions"] = None
                first_out[i] = False
                chunk = {**head, "choices": [choice]}
                if gen.continuous_usage:
                    chunk["usage"] = oa.usage(stream.num_prompt_tokens, num_tokens[i], full=False)
                    if chat:
                        chunk["usage"]["completion_tokens_details"] = None
                if finish is not None and not gen.include_usage:
                    # on the terminal chunk only when no usage chunk follows
                    chunk["system_fingerprint"] = self.fingerprint
                chunk["kv_transfer_params"] = None
                if tokens or finish is not None:
                    out.append(b"data: " + dumps(chunk) + b"\n\n")
                if error is not None:
                    await response.write(b"".join(out) + _sse_error(error))
                    return response
                if finish is not None:
                    done[i] = True
            if out:
                await response.write(b"".join(out))
        tail = b""
        if gen.include_usage:
            usage_chunk: dict[str, Any] = {
                **head,
                "choices": [],
                "usage": oa.usage(
                    self._prompt_tokens(streams),
                    sum(s.num_output_tokens for s in streams),
                    full=False,
                ),
                "system_fingerprint": self.fingerprint,
            }
            tail = b"data: " + dumps(usage_chunk) + b"\n\n"
        await response.write(tail + _DONE)
        await response.write_eof()
        return response

    async def _stream_responses(
        self, request: web.Request, stream: Stream, gen: oa.Gen
    ) -> web.StreamResponse:
        """vLLM's Responses event stream (`event:` lines, no `[DONE]`)."""
        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await response.prepare(request)
        seq = 0

        def event(kind: str, body: dict[str, Any]) -> bytes:
            nonlocal seq
            data = {**body, "sequence_number": seq, "type": kind}
            seq += 1
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

        opening = self._responses_body(stream, gen, "created")
        item = self._responses_message(gen, "", "in_progress")
        item_id = item["id"]
        await response.write(
            event("response.created", {"response": opening})
            + event("response.in_progress", {"response": opening})
        )
        started = False
        sent_text = ""
        while True:
            tokens = await stream.next_tokens()
            finish = stream.finish
            if stream.error is not None and finish is not None:
                await response.write(_sse_error(stream.error))
                return response
            out = b""
            if not started and (tokens or finish is not None):
                started = True
                out += event(
                    "response.output_item.added",
                    {"item": {**item, "content": []}, "output_index": 0},
                )
                out += event("response.content_part.added", {
                    "content_index": 0, "item_id": item_id, "output_index": 0,
                    "part": {"annotations": [], "text": "", "type": "output_text",
                             "logprobs": []}})  # fmt: skip
            for token in tokens:
                piece = textgen.token_text(token)
                if not piece:
                    continue
                sent_text += piece
                out += event("response.output_text.delta", {
                    "content_index": 0, "delta": piece, "item_id": item_id,
                    "logprobs": [], "output_index": 0})  # fmt: skip
            if finish is None:
                if out:
                    await response.write(out)
                continue
            final = self._responses_body(stream, gen, "final")
            message = final["output"][0]
            text = message["content"][0]["text"]
            part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
            out += event("response.output_text.done", {
                "content_index": 0, "item_id": item_id, "logprobs": [], "output_index": 0,
                "text": text})  # fmt: skip
            out += event("response.content_part.done",
                         {"content_index": 0, "item_id": item_id, "output_index": 0,
                          "part": part})  # fmt: skip
            out += event("response.output_item.done", {"item": message, "output_index": 0})
            kind = (
                "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            )
            out += event(kind, {"response": final})
            await response.write(out)
            await response.write_eof()
            return response

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
