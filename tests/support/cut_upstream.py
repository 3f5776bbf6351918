"""An OpenAI-compatible upstream whose streams end their HTTP response cleanly, before
`data: [DONE]`: a test double, because no engine here does that on purpose. A proxy or
load balancer between the gateway and the engine that gives up on a stream does (it
ends the chunked body it was relaying), as does any upstream that delimits its body by
closing the connection and then dies. The gateway must call such a stream dropped, not
served.

`/health` and `/v1/models` answer as vLLM's do; a non-streaming completion (the deep
probe) answers whole; a streamed one sends `tokens` chunks and ends."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from tests.support.served import ServedDouble


class CutUpstream(ServedDouble):
    name = "cut-upstream"

    def __init__(self, model: str, tokens: int = 3) -> None:
        super().__init__()
        self.model = model
        self.tokens = tokens

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    def _chunk(self, text: str) -> dict[str, object]:
        return {
            "id": "cmpl-cut",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
        }

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            whole = self._chunk(" ok")
            whole["choices"][0]["finish_reason"] = "length"  # type: ignore[index]
            whole["usage"] = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            return web.json_response(whole)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = [
            f"data: {json.dumps(self._chunk(f' t{i}'))}\n\n".encode() for i in range(self.tokens)
        ]
        for event in events[:-1]:
            await resp.write(event)
            await asyncio.sleep(0.01)
        # The last token and the body's end in one write (one read at the gateway), and
        # no [DONE].
        await resp.write_eof(events[-1])
        return resp
