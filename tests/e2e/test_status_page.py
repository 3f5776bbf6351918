"""The status page in a real headless Chromium, against real sims and a real gateway.

The browser is driven over the Chrome DevTools Protocol (a websocket, spoken with
aiohttp), so the test needs no driver package and downloads nothing.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from seawall.auth import hash_key
from seawall.loadgen import run_load
from tests.support.fleet import MODEL, running, set_fault, start_gateway, start_sim
from tests.support.procs import Proc, free_port, require_binary, spawn

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

ADMIN_TOKEN = "sk-sw-admin-token-for-status-page-000000000000000"


class Page:
    """One browser tab over CDP: navigate, evaluate JavaScript, take a screenshot."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, timeout_s: float = 10.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        async with asyncio.timeout(timeout_s):
            while True:  # events arrive in between; skip them
                msg = json.loads((await self.ws.receive()).data)
                if msg.get("id") == msg_id:
                    if "error" in msg:
                        raise AssertionError(f"{method}: {msg['error']}")
                    result: dict[str, Any] = msg["result"]
                    return result

    async def js(self, expression: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Poll a JavaScript expression until truthy; bounded by `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            value = await self.js(expression)
            if value:
                return value
            if loop.time() > deadline:
                shown = await self.js("document.body.innerText")
                raise AssertionError(f"page: no {what} after {timeout_s}s; it shows:\n{shown}")
            await asyncio.sleep(0.1)

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", 10, f"{url} loaded")

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))


@asynccontextmanager
async def chromium(profile: Path, log_dir: Path) -> AsyncIterator[Page]:
    binary = require_binary("chromium")
    port = free_port()
    proc: Proc = spawn(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1400,900",
            f"--user-data-dir={profile}",
            f"--remote-debugging-port={port}",
            "about:blank",
        ],
        log_dir / "chromium.log",
        port=port,
    )
    with running(proc):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            targets: list[dict[str, Any]] = []
            for _ in range(300):  # bounded: about 30 s for the browser (a loaded machine)
                try:
                    async with session.get(f"{proc.url}/json") as r:
                        targets = [t for t in await r.json() if t.get("type") == "page"]
                    if targets:
                        break
                except aiohttp.ClientError:
                    pass
                assert proc.alive(), proc.log()[-2000:]
                await asyncio.sleep(0.1)
            assert targets, f"chromium opened no page:\n{proc.log()[-2000:]}"
            async with session.ws_connect(targets[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                yield page


def admin_gateway(artifacts: Path, sims: list[Proc]) -> tuple[Proc, str]:
    port = free_port()
    cfg = {
        "admin": {"enabled": True, "port": port, "token_hash": hash_key(ADMIN_TOKEN)},
        "timeouts": {"ttft_s": 2.0, "itl_s": 2.0},
        "fleet": {
            "liveness_interval_s": 0.25,
            "scrape_interval_s": 0.25,
            "deep_probe_interval_s": 0.5,
            "deep_probe_idle_interval_s": 0.5,
            "deep_probe_timeout_s": 0.5,
            "watchdog_window_s": 1.0,
        },
    }
    return start_gateway(artifacts, sims, cfg), f"http://127.0.0.1:{port}"


def cell(replica: str, field: str) -> str:
    return (
        f'document.querySelector(\'tr[data-replica="{replica}"] '
        f'td[data-field="{field}"]\')?.textContent'
    )


async def test_status_page_shows_the_fleet_and_follows_a_dead_engine_live(
    artifacts: Path, tmp_path: Path
) -> None:
    a, b = start_sim(artifacts, name="a"), start_sim(artifacts, name="b")
    gw, admin = admin_gateway(artifacts, [a, b])
    with running(gw, a, b):
        # A little steady traffic, so the charts and the in-flight column have data.
        load = asyncio.create_task(
            run_load(gw.url, MODEL, concurrency=2, duration_s=12, max_requests=400, grace_s=3)
        )
        async with chromium(tmp_path / "profile", artifacts) as page:
            await page.goto(f"{admin}/status#token={ADMIN_TOKEN}")
            # The token left the address bar and lives in the tab's session storage.
            assert await page.js("location.hash") == ""
            assert await page.js("sessionStorage.getItem('seawall.admin.token')") == ADMIN_TOKEN
            await page.wait_for(
                f"{cell('r0', 'state')} === 'ready' && {cell('r1', 'state')} === 'ready'",
                10,
                "both replicas ready on the page",
            )
            assert await page.js(cell("r0", "routable")) == "yes"
            assert await page.js(cell("r1", "node")) == "node-1"
            # Issue 17: each replica's admission controller, its level, blocks and cause.
            adm = await page.js(cell("r0", "admission"))
            assert re.fullmatch(r"\d\.\d\d · \d+/\d+ blocks · [a-z_]+", adm or ""), adm
            await page.js("window.notReloaded = true")

            # The engine dies (its /health answers 503; the process lingers 30 s).
            set_fault(a, {"kind": "engine_dead", "grace_s": 30})
            await page.wait_for(
                f"{cell('r0', 'routable')} === 'no' && {cell('r0', 'state')} !== 'ready'",
                5,
                "r0 shown out of routing",
            )
            assert await page.js(
                "[...document.querySelectorAll('#events li[data-replica=\"r0\"]')]"
                ".some(li => li.dataset.to !== 'ready')"
            ), "the state change is listed under recent state changes"

            assert await page.js("window.notReloaded") is True  # live, not a reload
            assert await page.js(cell("r1", "routable")) == "yes"
            assert await page.js(cell("r0", "reason")) not in ("", "-", None)
            await page.wait_for(
                "Number(document.querySelector('[data-chart=\"requests_per_s\"]')"
                ".dataset.points) >= 2 && "
                "document.querySelector('[data-chart=\"requests_per_s\"] svg path') !== null",
                8,
                "the requests/s chart drawn",
            )
            await page.screenshot(artifacts / "status.png")

            # Without a token the page asks for one; a wrong one is refused, visibly.
            await page.js("sessionStorage.clear()")
            await page.goto(f"{admin}/status")
            assert await page.js("document.getElementById('login').hidden") is False
            await page.js(
                "document.getElementById('token').value = 'wrong';"
                "document.getElementById('login').requestSubmit()"
            )
            await page.wait_for(
                "document.getElementById('login-error').textContent.includes('refused')",
                5,
                "the wrong token refused",
            )
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)


def test_status_page_loads_nothing_from_outside_the_admin_port() -> None:
    # The admin port is often reachable only from a bastion: a CDN script or font
    # would leave the page blank exactly when it is needed.
    from seawall.gateway.admin import STATIC

    html = (STATIC / "status.html").read_text()
    outside = set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"')]*", html))
    assert outside <= {"http://www.w3.org/2000/svg"}, outside
    assert not re.search(r"<(?:script|link|img)[^>]+(?:src|href)=", html)


async def test_status_page_shows_pools_and_a_failover_live(artifacts: Path, tmp_path: Path) -> None:
    """With two pools the page lists them, where the model is served, and each move."""
    east, west = start_sim(artifacts, name="east"), start_sim(artifacts, name="west")
    port = free_port()
    cfg = {
        "admin": {"enabled": True, "port": port, "token_hash": hash_key(ADMIN_TOKEN)},
        "pools": {"east": {"priority": 0}, "west": {"priority": 1, "mode": "passive"}},
        "failover": {"after_s": 0.5},
        "replicas": [
            {"id": "e0", "url": east.url, "model": MODEL, "pool": "east"},
            {"id": "w0", "url": west.url, "model": MODEL, "pool": "west"},
        ],
        "fleet": {"liveness_interval_s": 0.25, "scrape_interval_s": 0.25},
    }
    gw = start_gateway(artifacts, [], cfg)
    with running(gw, east, west):
        async with chromium(tmp_path / "profile", artifacts) as page:
            await page.goto(f"http://127.0.0.1:{port}/status#token={ADMIN_TOKEN}")
            east_row = "document.querySelector('#pools [data-pool=\"east\"]')?.textContent"
            west_row = "document.querySelector('#pools [data-pool=\"west\"]')?.textContent"
            await page.wait_for(
                f"({east_row} || '').includes('serving {MODEL}')", 10, "east shown serving"
            )
            assert "passive" in await page.js(west_row)
            await page.js("window.notReloaded = true")
            east.popen.kill()
            await page.wait_for(
                f"({west_row} || '').includes('serving {MODEL}')", 10, "west shown serving"
            )
            await page.wait_for(
                "document.querySelector('#pools [data-pool-event=\"failover\"]') !== null",
                5,
                "the failover listed",
            )
            assert await page.js("window.notReloaded") is True
            await page.screenshot(artifacts / "status-pools.png")
