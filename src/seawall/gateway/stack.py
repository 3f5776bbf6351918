"""The admission stack: the steps every request passes before a replica is chosen, in
order, each with the reason for its place. Written once, here, as code.

A step refuses by raising `ApiError`; a request that passes every step goes on to the
dispatcher (choose, attempt, retry, hedge: `dispatch.py`) and then the relay.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from seawall.errors import ApiError, clip, unavailable
from seawall.gateway.context import RequestCtx
from seawall.gateway.fleet_admission import FleetAdmission
from seawall.gateway.frontdoor import safe_request_id
from seawall.gateway.replicas import ReplicaSet
from seawall.gateway.tenancy import Tenancy
from seawall.protocol.openai import parse
from seawall.protocol.tokens import PROMPT_TOO_LARGE, check_prompt_bytes


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    run: Callable[[web.Request, RequestCtx], Awaitable[None]]
    why: str


def admission_stack(
    *,
    draining: Callable[[], bool],
    drain_retry_after_s: float,
    tenancy: Tenancy,
    max_body_bytes: int,
    replicas: ReplicaSet,
    fleet: FleetAdmission,
) -> tuple[Step, ...]:
    async def refuse_while_draining(request: web.Request, ctx: RequestCtx) -> None:
        if draining():
            raise unavailable(
                "The gateway is draining; retry on another instance.",
                retry_after_s=drain_retry_after_s,
                code="draining",
            )

    async def authenticate(request: web.Request, ctx: RequestCtx) -> None:
        tenancy.authenticate(request.headers, ctx)

    async def read_body(request: web.Request, ctx: RequestCtx) -> None:
        try:
            raw = await _read(request, max_body_bytes, tenancy.body_bound(ctx))
        except ApiError as e:
            if e.code == PROMPT_TOO_LARGE:
                await tenancy.refused(ctx)  # charged to the request rate, as every size refusal
            raise
        req = ctx.req = parse(ctx.route, raw, request.headers.get("Content-Type"))
        body_id = req.obj.get("request_id")
        if "X-Request-Id" not in request.headers and isinstance(body_id, str):
            # vLLM names a response after the body's request_id unless an X-Request-Id
            # header says otherwise; the gateway's own id, sent as that header, would.
            ctx.request_id = safe_request_id(body_id) or ctx.request_id
            if ctx.span is not None:  # the request's span was opened under the old id
                ctx.span.span.set_attribute("seawall.request_id", ctx.request_id)

    async def known_model(request: web.Request, ctx: RequestCtx) -> None:
        req = ctx.req
        assert req is not None
        if not req.model:
            # vLLM serves its one model when a request names none; so does a gateway
            # whose fleet serves one (the body goes on unchanged).
            models = replicas.models()
            if len(models) != 1:
                raise ApiError(
                    400,
                    "`model` is required: this gateway serves "
                    f"{', '.join(models) or 'no model yet'}.",
                    param="model",
                )
            req.model = models[0]
        model = req.model
        if not replicas.serves(model):
            raise ApiError(
                404,
                f"The model `{clip(model)}` does not exist. Valid models: "
                f"{', '.join(replicas.models()) or '(none yet)'}.",
                param="model",
                code="model_not_found",
            )
        ctx.model_known = True

    async def tier_limits(request: web.Request, ctx: RequestCtx) -> None:
        await tenancy.tier_limits(ctx)

    async def rates(request: web.Request, ctx: RequestCtx) -> None:
        await tenancy.rates(ctx)

    async def fleet_admission(request: web.Request, ctx: RequestCtx) -> None:
        await fleet.admit(ctx)

    return (
        Step(
            "draining",
            refuse_while_draining,
            "a gateway that is going away starts no new work, and says so before it reads anything",
        ),
        Step(
            "auth",
            authenticate,
            "who is asking decides every limit below; from the headers alone, so a "
            "caller without a valid key learns nothing (no model list, no body errors) "
            "and costs no body read",
        ),
        Step(
            "body",
            read_body,
            "read and parse only for a known caller, bounded by limits.max_body_bytes and "
            "the tier's byte bound (refused from Content-Length, unread, when over it); "
            "bad input is refused before anything is spent upstream",
        ),
        Step(
            "model",
            known_model,
            "a model the fleet does not serve can never succeed; a request naming none "
            "goes to the fleet's only model, as vLLM serves its own",
        ),
        Step(
            "tier_limits",
            tier_limits,
            "prompt, max_tokens and structured-output schema limits: a request that can "
            "never be served is refused before it takes a concurrency slot or a token budget "
            "(it is still charged to the request rate, so a flood of them is not free); the "
            "route's count rule (protocol/routes.py) says what its prompt costs",
        ),
        Step(
            "rates",
            rates,
            "tenant rates and concurrency, charged only for requests that passed the "
            "limits above, so a refused oversized request does not eat the tenant's budget",
        ),
        Step(
            "fleet",
            fleet_admission,
            "fleet saturation last, because it may queue: a request that would be "
            "refused anyway must not wait in the queue first",
        ),
    )


async def _read(request: web.Request, max_body_bytes: int, prompt_bound: int | None) -> bytes:
    """The body, refused (413) as soon as it is known to pass a bound: from Content-Length
    before a byte is read, or as a chunked body arrives; never joined or parsed past it.
    What the client still sends, aiohttp reads and drops after the answer (its lingering
    close), so a client that sends the whole body anyway still reads its 413."""
    limit = max_body_bytes if prompt_bound is None else min(max_body_bytes, prompt_bound)

    def over(size: int) -> ApiError:
        if size > max_body_bytes:
            return ApiError(413, f"Request body is {size} bytes; the limit is {max_body_bytes}.")
        refusal = check_prompt_bytes(size, prompt_bound)
        assert refusal is not None  # under max_body_bytes, so over the prompt bound
        return refusal

    declared = request.content_length
    if declared is not None and declared > limit:
        raise over(declared)
    content = request.content
    if content.is_eof():
        # The whole body came with the headers (most requests): no read to wait for.
        raw = content.read_nowait()
        if len(raw) > limit:
            raise over(len(raw))
        return raw
    chunks: list[bytes] = []
    size = 0
    async for chunk in content.iter_any():
        size += len(chunk)
        if size > limit:
            raise over(size)
        chunks.append(chunk)
    return b"".join(chunks)
