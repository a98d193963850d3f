"""``kvfleet engine ...``: build the tiny model, sync LMCache quotas, launch one engine pod's processes."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server

from kvfleet_runtime.config import (
    ENGINE_PORT,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    KeyFile,
    TenantTable,
    parse_media_hosts,
)
from kvfleet_runtime.config_watch import RuntimeConfigWatcher
from kvfleet_runtime.engine import launcher, model_info_cache, model_source, restore_bench, shared_tier
from kvfleet_runtime.engine import lmcache_sync as ls
from kvfleet_runtime.engine.tinymodel import build_tiny_model

#: Each of vLLM's and LMCache's log files in a pod (``/tmp``, an ``emptyDir``) stops at this size and moves
#: to ``.1``: at most twice this per process on the pod's disk. Their output also goes to the pod's log.
ENGINE_LOG_MAX_BYTES = 16 * 1024 * 1024


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("engine", help="vLLM + LMCache: tiny model, LMCache quota sync, launcher.")
    sub = parser.add_subparsers(dest="engine_command", metavar="ENGINE_COMMAND", required=True)

    tiny = sub.add_parser(
        "build-tiny-model", help="Build the tiny Llama for tests and the demo (idempotent)."
    )
    tiny.add_argument(
        "--dest", type=Path, default=None, help="Model folder (default: $KVFLEET_CACHE/models/tiny-llama)."
    )
    tiny.set_defaults(func=_build_tiny_model)

    prime = sub.add_parser(
        "prime-vllm-cache",
        help="Have vLLM inspect the usual model classes once for this install, not once per engine start.",
    )
    prime.set_defaults(func=_prime_vllm_cache)

    sync = sub.add_parser("lmcache-sync", help="Keep LMCache per-salt quotas in sync with the tenant table.")
    _add_config_args(sync)
    sync.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help="LMCache HTTP base URL (repeatable; default: the pool's lmcache_endpoints).",
    )
    sync.add_argument("--interval", type=float, default=2.0, help="Seconds between sync cycles.")
    sync.add_argument(
        "--metrics-port", type=int, default=None, help="Serve the kvfleet_lmcache_* metrics on this port."
    )
    sync.add_argument("--metrics-host", default="0.0.0.0", help="Address for the metrics server.")  # noqa: S104 - in-pod sidecar
    sync.add_argument("--once", action="store_true", help="Run one cycle and exit (exit 1 if it failed).")
    sync.set_defaults(func=_lmcache_sync)

    shared = sub.add_parser(
        "shared-tier", help="Serve a pool's shared KV tier (LMCache's resp L2 adapter), per-salt quotas."
    )
    shared_tier.add_arguments(shared)
    shared.set_defaults(func=shared_tier.run)

    bench = sub.add_parser(
        "bench-restore", help="Time TTFT with KV from nowhere, vLLM's cache, LMCache CPU and LMCache NVMe."
    )
    bench.add_argument(
        "--model", default=None, help="Model folder (default: the tiny model, built if needed)."
    )
    bench.add_argument("--rounds", type=int, default=5)
    bench.add_argument("--words", type=int, default=700, help="Prompt length in words (~2 tokens each).")
    bench.add_argument("--json-out", type=Path, default=None, help="Write the raw samples here.")
    bench.set_defaults(func=_bench_restore)

    fetch = sub.add_parser(
        "fetch-model",
        help="Download the pool's Hugging Face model once into the model cache (the engine pod's init "
        "container); HF_TOKEN and HF_ENDPOINT come from the environment.",
    )
    _add_config_args(fetch)
    fetch.add_argument("--model-cache", type=Path, required=True, help="The model-cache volume.")
    fetch.set_defaults(func=_fetch_model)

    launch = sub.add_parser(
        "launch", help="Start LMCache (if the pool has LMCache settings), vLLM and the quota sync."
    )
    _add_config_args(launch)
    launch.add_argument(
        "--model", default=None, help="Model folder or name for vLLM (default: the pool's engine.model)."
    )
    launch.add_argument(
        "--model-cache",
        type=Path,
        default=None,
        help="Load the Hugging Face model (--model or the pool's) at the pool's revision from this cache, "
        "where `fetch-model` put it (vLLM then runs offline); without it the model goes to vLLM as it is.",
    )
    launch.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address vLLM's OpenAI server binds (0.0.0.0 in a pod, for the gateway). LMCache, the sync's "
        "metrics and the plugin's debug endpoint bind 127.0.0.1 whatever this says.",
    )
    launch.add_argument(
        "--port", type=int, default=None, help=f"vLLM OpenAI port (default: the pool's, {ENGINE_PORT})."
    )
    launch.add_argument(
        "--lmcache-port",
        type=int,
        default=None,
        help=f"LMCache ZMQ port, where vLLM connects (default: the pool's, {LMCACHE_PORT}).",
    )
    launch.add_argument(
        "--lmcache-http-port",
        type=int,
        default=None,
        help=f"LMCache HTTP API port (default: the pool's, {LMCACHE_HTTP_PORT}).",
    )
    launch.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="Port where vLLM publishes its KV events for the gateways' precise routing (ZMQ, every "
        "interface; default: the pool's, none unless set).",
    )
    launch.add_argument(
        "--nvme-dir",
        default=None,
        help="Folder for LMCache's NVMe (L2) tier (default: the pool's nvme_path).",
    )
    build = launch.add_mutually_exclusive_group()
    build.add_argument(
        "--cpu-kv-gib",
        type=int,
        default=None,
        help="vLLM's CPU build (the default, with 1): VLLM_CPU_KVCACHE_SPACE in whole GiB.",
    )
    build.add_argument(
        "--gpu",
        action="store_true",
        help="vLLM's GPU build: no VLLM_CPU_KVCACHE_SPACE, and block sizes that are no multiple of 32.",
    )
    launch.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Loopback port for the sync's kvfleet_lmcache_* metrics (re-exported on the plugin's port).",
    )
    launch.add_argument("--startup-timeout", type=float, default=900.0)
    launch.add_argument(
        "--allowed-media-domains",
        type=_media_hosts,
        default=(),
        help="Comma-separated hosts whose http(s) media URLs vLLM may fetch (exact names; the gateway's "
        "list). By default none: vLLM fetches no URL but data: ones, and never follows a redirect.",
    )
    launch.add_argument(
        "--plugin-metrics-port",
        type=int,
        default=None,
        help="Port of the pod's metrics: the plugin's per-tenant KV series with vLLM's, LMCache's and the "
        "sync's (default: the pool's plugin_metrics_port).",
    )
    launch.add_argument(
        "--no-plugin",
        action="store_true",
        help="Run vLLM's stock block pool and LMCache's stock L1 LRU (for comparisons).",
    )
    launch.add_argument(
        "--state-dir", type=Path, default=None, help="Logs and vLLM caches (default: a temp dir)."
    )
    launch.add_argument("vllm_args", nargs=argparse.REMAINDER, help="Extra vLLM arguments after '--'.")
    launch.set_defaults(func=_launch)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, required=True, help="Tenant table (tenants.json).")
    p.add_argument("--keys", type=Path, required=True, help="Key file (keys.json) with the salt key.")
    p.add_argument("--pool", default=None, help="Pool this engine serves (default: all pools).")


def _build_tiny_model(args: argparse.Namespace) -> int:
    print(build_tiny_model(args.dest))
    return 0


def _prime_vllm_cache(args: argparse.Namespace) -> int:
    inspected = model_info_cache.prime()
    print(f"vLLM model classes inspected: {', '.join(inspected) or 'none (already primed)'}")
    return 0


def _pool_engine(table: TenantTable, pool: str | None) -> tuple[str, str | None]:
    """The pool's model and revision (the first pool's when ``pool`` is None)."""
    entry = table.pools[pool or next(iter(table.pools))]
    if entry.engine is None:
        raise ValueError(f"pool {entry.name!r} has no engine settings: nothing to fetch")
    return entry.engine.model, entry.engine.revision


def _fetch_model(args: argparse.Namespace) -> int:
    repo, revision = _pool_engine(TenantTable.load(args.config), args.pool)
    try:
        fetched = model_source.fetch_model(repo, revision, args.model_cache)
    except model_source.ModelFetchError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"{fetched.repo}@{fetched.revision} is commit {fetched.commit} in {fetched.path}", flush=True)
    return 0


def _bench_restore(args: argparse.Namespace) -> int:
    model = args.model or str(build_tiny_model())
    print(restore_bench.main_bench(model, args.rounds, args.words, args.json_out))
    return 0


def _lmcache_sync(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watcher = RuntimeConfigWatcher(args.config, args.keys)
    if watcher.poll() is None:  # the first poll loads (a rejected file is logged with the reason)
        print(f"cannot load {args.config} / {args.keys}", file=sys.stderr)
        return 2
    metrics = ls.LMCacheSyncMetrics()
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    if args.once:
        return asyncio.run(_sync_once(watcher, args.pool, args.endpoint, metrics))
    asyncio.run(_run_until_signal(watcher, args.pool, args.endpoint, args.interval, metrics))
    return 0


async def _sync_once(watcher: Any, pool: str | None, endpoints: list[str], metrics: Any) -> int:
    config = watcher.current
    desired = ls.compute_salt_quotas(config.table, config.keys, pool)
    failed = 0
    for url in endpoints or ls.endpoints_for(config.table, pool):
        state = ls.EndpointState(ls.LMCacheClient(url))
        try:
            plan = await ls.apply_lmcache_sync(state, desired, metrics)
            print(f"{url}: put={dict(plan.put)} delete={list(plan.delete)} clear_l1={plan.clear_l1}")
        except Exception as exc:  # noqa: BLE001 - report every endpoint, then fail
            print(f"{url}: {exc}", file=sys.stderr)
            failed += 1
        finally:
            await state.client.close()
    return 1 if failed else 0


async def _run_until_signal(
    watcher: Any, pool: str | None, endpoints: list[str], interval: float, metrics: Any
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await ls.run_lmcache_sync(
        watcher, pool=pool, endpoints=endpoints, interval_s=interval, metrics=metrics, stop=stop
    )


def _media_hosts(value: str) -> tuple[str, ...]:
    try:
        return parse_media_hosts(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    # Until the sync loop installs its own handler: unwind through ``finally`` so the children stop too.
    raise SystemExit(128 + signum)


def resolve_launch(args: argparse.Namespace, table: TenantTable) -> tuple[str, launcher.EngineReplica]:
    """The pool and the replica ``kvfleet engine launch`` starts for its flags and ``table``: all the
    command reads of the table (``_launch`` starts what this returns, nothing else)."""
    pool = args.pool or next(iter(table.pools))
    plugin_env = (
        {}
        if args.no_plugin
        else launcher.build_plugin_env(args.config, args.keys, pool, args.plugin_metrics_port)
    )
    site = launcher.ReplicaSite(
        host=args.host, env=plugin_env, allowed_media_domains=args.allowed_media_domains
    )
    if args.gpu:
        site = dataclasses.replace(site, cpu_kv_cache_gib=None)
    elif args.cpu_kv_gib is not None:
        site = dataclasses.replace(site, cpu_kv_cache_gib=args.cpu_kv_gib)
    model = args.model
    if args.model_cache is not None:
        # The hub was read by fetch-model; vLLM loads the fetched folder (and may not reach the hub).
        repo, revision = _pool_engine(table, pool)
        model = str(model_source.require_fetched(args.model_cache, args.model or repo, revision).path)
    replica = launcher.resolve_replica(
        table,
        pool,
        site,
        model=model,
        vllm_port=args.port,
        lmcache_port=args.lmcache_port,
        lmcache_http_port=args.lmcache_http_port,
        nvme_dir=args.nvme_dir,
        kv_events_port=args.kv_events_port,
        extra_vllm_args=[a for a in args.vllm_args if a != "--"],
        model_limit_of=launcher.read_model_max_len,
    )
    if not args.no_plugin:
        # One metrics port for the pod: the plugin's re-exports vLLM's, LMCache's and the sync's series.
        upstreams = launcher.build_metrics_upstreams(replica, args.metrics_port)
        replica = launcher.with_metrics_upstreams(replica, upstreams)
    return pool, replica


def _launch(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    table = TenantTable.load(args.config)
    KeyFile.load(args.keys)  # fail before starting anything when the key file is unreadable or invalid
    pool, replica = resolve_launch(args, table)
    lmc, lmcache_url = replica.engine.lmcache, replica.lmcache_url
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="kvfleet-engine-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    procs: list[launcher.EngineProcess] = []
    lmcache: launcher.EngineProcess | None = None
    try:
        if lmc is not None and lmcache_url is not None:
            if lmc.shared_host is not None:
                # LMCache's resp connector never reconnects: start it once the shared tier is up.
                launcher.wait_for_tcp(lmc.shared_host, lmc.shared_port, args.startup_timeout)
            # The same tenant environment turns on LMCache's per-tenant L1 governance.
            lmcache = launcher.EngineProcess(
                "lmcache",
                launcher.build_lmcache_args(lmc),  # loopback only: nothing outside the pod dials it
                {**os.environ, **replica.site.env},
                state_dir / "lmcache.log",
                echo=sys.stdout,
                max_log_bytes=ENGINE_LOG_MAX_BYTES,
            )
            procs.append(lmcache)
        env = launcher.build_vllm_env(replica, os.environ, state_dir)
        # vLLM starts beside LMCache, not after it: it first spends half a minute importing, and its
        # LMCache connector waits for the server (ZMQ queues until it binds; lmcache.mp.mq_timeout, 300 s).
        vllm = launcher.EngineProcess(
            "vllm",
            launcher.build_vllm_args(replica),
            env,
            state_dir / "vllm.log",
            echo=sys.stdout,
            max_log_bytes=ENGINE_LOG_MAX_BYTES,
        )
        procs.append(vllm)
        if lmcache is not None:
            lmcache.wait_ready(f"{lmcache_url}/healthcheck", args.startup_timeout)
        waited = vllm.wait_ready(f"{replica.vllm_url}/health", args.startup_timeout)
        print(f"vLLM ready on {replica.vllm_url} after {waited:.0f}s (logs in {state_dir})", flush=True)
        if lmcache is None or lmcache_url is None:
            vllm.proc.wait()
            return int(vllm.proc.returncode or 0)
        watcher = RuntimeConfigWatcher(args.config, args.keys)
        metrics = ls.LMCacheSyncMetrics()
        if args.metrics_port is not None:
            # Loopback: Prometheus reads these through the plugin's metrics port.
            start_http_server(args.metrics_port, addr=launcher.LMCACHE_HOST, registry=metrics.registry)
        asyncio.run(_run_until_signal(watcher, pool, [lmcache_url], 2.0, metrics))
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()
        launcher.remove_stale_lmcache_shm()
