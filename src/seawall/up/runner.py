"""The `seawall up` session: start the fleet, keep the view fresh, send the configured
traffic, and shut everything down in order on Ctrl-C, SIGTERM or the time limit.

Owns: the session's loop and its order of shutdown (traffic, then the gateway drains,
then the replicas), checking that no process is left behind, and the exit summary.

Must not: start processes itself (`fleet.py`), draw (`view.py`) or count (`figures.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from rich.console import Console
from rich.live import Live

from seawall import clock
from seawall.actuate.local import ReplicaEvent
from seawall.up.config import UpConfig
from seawall.up.figures import Crash, GatewayFigures, TrafficTally, crash_outcome
from seawall.up.fleet import LocalFleet
from seawall.up.traffic import Traffic, crash_replica
from seawall.up.view import UpSnapshot, duration, plain_line, render, summary

TICK_S = 1.0
# SIGHUP too: closing the terminal should stop the fleet as cleanly as Ctrl-C does.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Output:
    """Where snapshots go: a rich live table on a terminal, plain lines elsewhere."""

    def __init__(self, live: bool) -> None:
        self.live = live
        self._live: Live | None = None

    def __enter__(self) -> Output:
        if self.live:
            self._live = Live(console=Console(), auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.__exit__(t, e, tb)
            self._live = None

    def show(self, snap: UpSnapshot) -> None:
        if self._live is not None:
            self._live.update(render(snap), refresh=True)
        else:
            print(plain_line(snap), flush=True)

    def event(self, text: str) -> None:
        if self._live is None:  # the live view lists events itself
            print(f"event: {text}", flush=True)


# Supervisor events that change nothing a person should act on: `restart_refused` is a
# restart asked for while one is already under way (the crash backoff), which read like
# a problem in the view while the supervisor was doing exactly what was asked.
NON_EVENTS = frozenset({"restart_refused"})
# The demo's crash waits for streams in flight on a replica, this long at most; and its
# report waits for the crashed replica's requests to end, this long at most.
CRASH_WAIT_S = 5.0
CRASH_REPORT_MAX_S = 15.0


def describe(event: ReplicaEvent) -> str | None:
    """The event as a line for the view, or None for a non-event (`NON_EVENTS`)."""
    if event.kind in NON_EVENTS:
        return None
    s = event.status
    text = f"{s.replica_id} {event.kind}"
    if event.kind == "starting":
        text += f" pid={s.pid} url={s.url}"
    if event.reason:
        text += f" ({event.reason})"
    return text


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:  # gone between the two checks (or no /proc: trust kill(0))
        return not Path("/proc/self").exists()
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]  # a zombie is already dead


class Session:
    def __init__(
        self,
        config: UpConfig,
        *,
        log_dir: Path,
        seconds: float | None,
        crash_at_s: float | None = None,
        gateway_port: int | None = None,
        live: bool = False,
        title: str = "seawall up",
        admin_token: str | None = None,
    ) -> None:
        self.config = config
        self.admin_token = admin_token  # the demo's own, shown once in the status URL
        self.log_dir = log_dir
        self.seconds = seconds
        self.crash_at_s = crash_at_s
        self.title = title
        self.fleet = LocalFleet(config, log_dir, gateway_port)
        self.output = Output(live)
        self.events: deque[str] = deque(maxlen=20)
        self.tally = TrafficTally()
        self.traffic: Traffic | None = None
        self.traffic_started_at = 0.0
        self.crashed = False
        self.crash: Crash | None = None  # crashed, its outcome not yet known
        self.crash_reports: list[str] = []
        self.crash_at = 0.0
        self.started_at = clock.monotonic()
        self.stop = asyncio.Event()
        self.gateway_figures: GatewayFigures | None = None

    def _elapsed(self) -> float:
        return clock.monotonic() - self.started_at

    def note(self, text: str) -> None:
        self.events.append(f"{duration(self._elapsed())} {text}")
        self.output.event(text)

    def _on_event(self, event: ReplicaEvent) -> None:
        text = describe(event)
        if text is not None:
            self.note(text)

    def snapshot(self) -> UpSnapshot:
        gw = self.fleet.gateway
        return UpSnapshot(
            elapsed_s=self._elapsed(),
            replicas=tuple(self.fleet.replicas()),
            gateway=gw.status() if gw is not None else None,
            gateway_url=gw.url if gw is not None else "",
            gateway_note=self.fleet.gateway_note,
            gateway_figures=self.gateway_figures,
            traffic=self.tally.figures(clock.monotonic()) if self.traffic is not None else None,
            traffic_target=", ".join(self.traffic.targets) if self.traffic is not None else "",
            events=tuple(self.events),
            title=self.title,
            routing=self.fleet.routing(),
            loads=self.fleet.loads(self.gateway_figures),
            status_url=gw.status_url() if gw is not None else "",
            crashes=tuple(self.crash_reports),
            followers=tuple((f.name, f.status(), f.url) for f in self.fleet.followers),
        )

    async def _tick(self) -> None:
        """One round: start traffic once the fleet is ready, the demo crash, figures."""
        traffic = self.config.traffic
        if self.traffic is None and traffic is not None and await self.fleet.wait_ready(0):
            remaining_s = (self.seconds - self._elapsed()) if self.seconds else traffic.duration_s
            self.traffic = Traffic(
                traffic,
                self.config.fleet.model,
                self.fleet.target_urls(),
                lambda r: self.tally.add(r, clock.monotonic()),
                duration_s=max(0.1, remaining_s),
            )
            self.traffic.start()
            self.traffic_started_at = clock.monotonic()
            self.note(f"traffic started → {', '.join(self.traffic.targets)}")
        if self.crash_at_s and self.traffic is not None and not self.crashed:
            since_s = clock.monotonic() - self.traffic_started_at - self.crash_at_s
            if since_s >= 0:
                await self._demo_crash(force=since_s >= CRASH_WAIT_S)
        if self.fleet.gateway is not None:
            self.gateway_figures = await self.fleet.figures() or self.gateway_figures
        if self.crash is not None:
            self._report_crash()

    async def _demo_crash(self, force: bool) -> None:
        """Crash the replica with the most streams in flight (once one has some, or
        `force`), and keep the gateway's counts from just before, for the report."""
        gw = self.fleet.gateway
        replicas = [r for r in self.fleet.replicas() if r.state == "running"]
        if not replicas:
            return
        in_flight = {r.replica_id: gw.in_flight(r.replica_id) if gw else None for r in replicas}
        victim = max(
            replicas, key=lambda r: (in_flight[r.replica_id] or (0, 0))[::-1], default=None
        )
        if victim is None:
            return
        counts = in_flight[victim.replica_id]
        if counts is not None and counts[1] == 0 and not force:
            return  # no stream to save yet: a crash now would show nothing
        before = await self.fleet.figures() if gw is not None else None
        # Counted again after that scrape (the gateway serves it on this event loop, so
        # its streams went on meanwhile), for the "crashed ... with N in flight" line and
        # so that a crash still finds a stream to cut. The report itself counts what the
        # crash cut, after it (`crash_outcome`).
        if gw is not None:
            counts = gw.in_flight(victim.replica_id)
            if counts is not None and counts[1] == 0 and not force:
                return  # they ended meanwhile: the next round tries again
        self.crashed = True
        if not await crash_replica(victim.url):
            return
        if counts is None or before is None:
            self.note(f"demo: crashed {victim.replica_id} on purpose; watch it restart")
            return
        requests, streams = counts
        self.note(
            f"demo: crashed {victim.replica_id} on purpose with {requests} request(s) in "
            f"flight ({streams} streaming); watch it restart"
        )
        self.crash = Crash(victim.replica_id, requests, streams, before)
        self.crash_at = clock.monotonic()

    def _report_crash(self) -> None:
        """Once the crashed replica has nothing in flight, what became of its requests."""
        crash, gw = self.crash, self.fleet.gateway
        assert crash is not None and gw is not None
        left = gw.in_flight(crash.replica)
        waited_s = clock.monotonic() - self.crash_at
        if (left is not None and left[0] > 0 and waited_s < CRASH_REPORT_MAX_S) or (
            self.gateway_figures is None
        ):
            return
        text = crash_outcome(crash, self.gateway_figures).text()
        self.crash = None
        self.crash_reports.append(text)
        self.note(text)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.stop.set)
        self.fleet.subscribe(self._on_event)
        print(f"seawall up: logs in {self.log_dir}", flush=True)
        if self.fleet.gateway_note:
            print(f"seawall up: {self.fleet.gateway_note}", flush=True)
        code = 0
        started = False
        try:
            with self.output:
                try:
                    await self.fleet.start()
                    started = True
                except Exception as e:  # a busy port, a config the gateway refuses, ...
                    print(f"seawall up: could not start the fleet: {e}", file=sys.stderr)
                if started:
                    await self._loop()
            if not started:
                code = 1
            elif self.stop.is_set():
                print("seawall up: stopping (signal)", flush=True)
            elif self.config.traffic is not None and self.traffic is None:
                print(
                    f"seawall up: the fleet was not ready in time; see the logs in {self.log_dir}",
                    file=sys.stderr,
                )
                code = 1
        finally:
            code = await self._shutdown(code)
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
        return code

    async def _loop(self) -> None:
        gw = self.fleet.gateway
        if gw is not None:
            print(f"seawall up: gateway on {gw.url}", flush=True)
            if url := gw.status_url():
                token = f"#token={self.admin_token}" if self.admin_token else ""
                print(f"seawall up: status page {url}{token}", flush=True)
        role = "follower" if self.config.gateway_mode == "in-process" else "may lead"
        for f in self.fleet.followers:
            admin = f", admin API {f.admin_url()}" if f.admin_url() else ""
            print(f"seawall up: gateway {f.name} ({role}) on {f.url}{admin}", flush=True)
        while not self.stop.is_set():
            left_s = self.seconds - self._elapsed() if self.seconds else TICK_S
            if left_s <= 0:
                break
            await self._tick()
            self.output.show(self.snapshot())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), min(TICK_S, left_s))

    async def _shutdown(self, code: int) -> int:
        """Traffic stops first, then the gateway drains, then the replicas stop."""
        try:
            if self.traffic is not None:
                await self.traffic.stop()
            if self.fleet.gateway is not None:
                self.gateway_figures = await self.fleet.figures() or self.gateway_figures
            final = self.snapshot()
        finally:
            await self.fleet.close()
        pids = self.fleet.all_pids()
        left = [p for p in pids if alive(p)]
        for line in summary(final, pids, left):
            print(line, flush=True)
        return 1 if left else code


def run_session(session_factory: Callable[[], Session]) -> int:
    """Run a session on uvloop when available (as `seawall serve` does)."""

    async def main() -> int:
        return await session_factory().run()

    try:
        import uvloop

        result: int = uvloop.run(main())
        return result
    except ImportError:
        return asyncio.run(main())
