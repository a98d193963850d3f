"""The operator process: probes, leader election, and kopf while this replica leads.

Every replica serves ``/healthz`` from its start; a standby waits for the Lease (``k8s/leader.py``) and
runs nothing of kopf, so it neither watches nor writes. Once it leads, kopf runs with every handler; the
Lease is renewed in a thread of its own (:class:`ElectionThread`) and a watchdog thread ends the process
when a renewal deadline passes (the container restarts as a standby). On SIGTERM a leader stops kopf
(kopf finishes the handlers in flight), then releases the Lease so a standby takes over at its next look
instead of waiting for it to expire.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any

import kopf
from aiohttp import web

from kvfleet_operator.handlers import kopf_handlers
from kvfleet_operator.k8s.client import Credentials, KubeClient
from kvfleet_operator.k8s.leader import LeaderElector, LeaseTimings, user_agent

log = logging.getLogger("kvfleet.operator")


@dataclass(frozen=True)
class LeaderElection:
    """Where the Lease is and how long it lasts (``RunOptions.election`` ``None``: one replica, no Lease)."""

    namespace: str
    name: str
    timings: LeaseTimings


@dataclass(frozen=True)
class RunOptions:
    identity: str
    namespaces: Collection[str]
    probe_host: str
    probe_port: int
    election: LeaderElection | None


async def _serve_probes(
    host: str, port: int, healthy: Callable[[], dict[str, object] | None]
) -> web.AppRunner:
    """``GET /healthz``: 200 with this replica's role while ``healthy()`` says so, else 503. Served by the
    event loop every handler runs on, so a stuck loop fails the liveness probe."""

    async def healthz(_request: web.Request) -> web.Response:
        state = healthy()
        return web.Response(status=200 if state is not None else 503, text=json.dumps(state or {}))

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def _run_kopf(options: RunOptions, ready: asyncio.Event) -> None:
    await kopf.operator(
        standalone=True,  # no kopf peering: the Lease decides who runs
        clusterwide=not options.namespaces,
        namespaces=list(options.namespaces),
        ready_flag=ready,
        # The reconcile lists Tenants across exactly these namespaces (dedicated GPU group ownership).
        memo=kopf.Memo(
            {
                kopf_handlers.MEMO_WATCH_NAMESPACES: tuple(options.namespaces),
                kopf_handlers.MEMO_IDENTITY: options.identity,
            }
        ),
    )


class ElectionThread:
    """Leader election in its own thread, with its own event loop and HTTP client.

    The Lease must not compete with the work for kopf's event loop: with a thousand tenants reconciling on
    a busy machine, a renewal queued behind them can miss the renew deadline, and the watchdog would end a
    healthy leader. On its own loop a renewal waits only for the API server (and the GIL's switch
    interval). A stuck kopf loop is the liveness probe's business (``/healthz`` is served by that loop).
    """

    def __init__(self, election: LeaderElection, identity: str) -> None:
        self.election, self.identity = election, identity
        self.elector: LeaderElector | None = None
        self.leading = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        #: The thread's loop and its stop event, once it runs (``stop`` sets the event from outside).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to step down (release the Lease if held) and end; returns at once."""
        with self._lock:
            self._stop.set()
            if self._loop is not None and self._stopped is not None:
                self._loop.call_soon_threadsafe(self._stopped.set)

    async def join(self) -> None:
        await asyncio.to_thread(self._thread.join)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _until_stopped(self) -> None:
        with self._lock:
            self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
            if self._stop.is_set():
                self._stopped.set()
        await self._stopped.wait()

    async def _main(self) -> None:
        election = self.election
        async with KubeClient(Credentials.discover(), user_agent=user_agent(self.identity)) as client:
            elector = self.elector = LeaderElector(
                client, election.namespace, election.name, self.identity, election.timings
            )
            if not await _first(elector.acquire(), self._until_stopped()):
                await elector.release()  # stopped while acquiring: step down if it had just won
                return
            elector.start_watchdog()
            self.leading.set()
            await _first(elector.keep(), self._until_stopped())
            await elector.release()


async def _first(work: Coroutine[Any, Any, None], stopped: Coroutine[Any, Any, None]) -> bool:
    """Run ``work`` until it ends (True) or ``stopped`` ends first (False); the other is cancelled."""
    work_task, stop_task = asyncio.create_task(work), asyncio.create_task(stopped)
    done, pending = await asyncio.wait({work_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if work_task in done:
        work_task.result()  # re-raise what ended it
        return True
    return False


async def run(options: RunOptions) -> int:
    """Run until SIGTERM/SIGINT (0) or kopf's end; a lost Lease ends the process from the watchdog."""
    kopf_ready = asyncio.Event()
    thread: ElectionThread | None = None

    def health() -> dict[str, object] | None:
        if thread is not None and not thread.leading.is_set():
            return {"role": "standby", "identity": options.identity}
        if not kopf_ready.is_set():
            return None  # leading, kopf still starting
        return {"role": "leader", "identity": options.identity}

    probes = await _serve_probes(options.probe_host, options.probe_port, health)
    try:
        if options.election is None:
            await _run_kopf(options, kopf_ready)
            return 0
        thread = ElectionThread(options.election, options.identity)
        thread.start()
        try:
            if not await _wait_for_lease(thread):
                return 0
            await _run_kopf(options, kopf_ready)  # kopf handles SIGTERM/SIGINT itself from here
            return 0
        finally:
            thread.stop()  # kopf is stopped: nothing of this replica writes any more; release
            await thread.join()
    finally:
        await probes.cleanup()


async def _wait_for_lease(thread: ElectionThread) -> bool:
    """Stand by until this replica leads (True), or a signal, or the election's end, comes first (False)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        while not thread.leading.is_set():
            if stop.is_set():
                log.info("stopped while standing by")
                return False
            if not thread.alive:
                raise RuntimeError("leader election ended without leading (see its log)")
            await asyncio.sleep(0.1)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)  # kopf installs its own once it runs
    return not stop.is_set()
