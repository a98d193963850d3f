"""The gateway's process-level settings, each declared once: its field, default, flag, parser and help.

``GatewaySettings`` is what the gateway runs with; per-tenant limits come from the tenant table instead.
A field made with ``setting`` is also a ``kvfleet gateway`` flag: ``gateway/cli.py`` generates the parser
from these declarations (``add_flags``) and builds the settings back from the parsed flags
(``from_flags``), so a new setting is one field here. The operator renders the flags it sets
(``build/gateway.py``); a test parses them with this parser.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvfleet_runtime.config import parse_media_hosts, url_has_credentials, without_credentials

MIB = 1024 * 1024
#: The key of a field's ``Flag`` in its metadata.
_FLAG = "kvfleet_flag"


# -- parsers of flag values -----------------------------------------------------------------------------
def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {value!r}")
    return int(value)


def non_negative_int(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"wants an integer of 0 or more, got {value!r}")
    return int(value)


def host_list(value: str) -> frozenset[str]:
    """``--allowed-media-domains``: comma-separated host names (``config.parse_media_hosts``)."""
    try:
        return frozenset(parse_media_hosts(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def replica_count(value: str) -> int:
    """``--replicas``: a count, or empty (an unset environment variable) for 1."""
    return positive_int(value) if value else 1


def shared_store_url(value: str) -> str | None:
    """``--shared-store``: a redis://, rediss:// or unix:// URL, or empty (an unset variable) for none."""
    if not value:
        return None
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise argparse.ArgumentTypeError(
            "wants a redis://host:port, rediss://host:port (TLS) or unix:///path URL, "
            f"got {without_credentials(value)!r}"
        )
    if url_has_credentials(value):
        raise argparse.ArgumentTypeError(
            "carries credentials: give the password in $KVFLEET_SHARED_STORE_PASSWORD instead (a flag is "
            "visible to every process on the node)"
        )
    return value


def tcp_port(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"wants a TCP port (1-65535), got {value!r}")
    return int(value)


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants seconds, got {value!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"wants seconds above 0, got {value!r}")
    return seconds


def sync_interval(value: str) -> float:
    """``--shared-store-sync``: seconds, more than 0 and at most 0.25."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants seconds, got {value!r}") from None
    if not 0 < seconds <= 0.25:
        raise argparse.ArgumentTypeError(f"wants seconds above 0 and at most 0.25, got {value!r}")
    return seconds


def vtc_or_fifo(value: str) -> bool:
    """``--fair-queuing``: ``vtc`` (True) or ``fifo`` (False)."""
    if value not in ("vtc", "fifo"):
        raise argparse.ArgumentTypeError(f"wants vtc or fifo, got {value!r}")
    return value == "vtc"


@dataclass(frozen=True)
class Flag:
    """How a setting is given on the command line."""

    name: str
    help: str
    parse: Callable[[str], Any]
    #: An environment variable that gives the default when set (its value goes through ``parse``).
    env: str | None = None
    metavar: str | None = None


def setting(default: Any, flag: str, help: str, parse: Callable[[str], Any], **extra: Any) -> Any:
    """A settings field that is also the command-line flag ``flag``; ``MISSING``: a required flag."""
    meta = {_FLAG: Flag(flag, help, parse, **extra)}
    if default is MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class GatewaySettings:
    """Process-level knobs (the CLI flags); per-tenant limits come from the tenant table."""

    config_path: Path = setting(MISSING, "--config", "tenant table (tenants.json)", Path)
    keys_path: Path = setting(MISSING, "--keys", "key file (keys.json: key hashes, salt key)", Path)
    reload_interval_s: float = setting(1.0, "--reload-interval", "seconds between config polls", float)
    health_interval_s: float = setting(
        2.0, "--health-interval", "seconds between replica health checks", float
    )
    health_timeout_s: float = setting(1.0, "--health-timeout", "seconds a replica's /health may take", float)
    #: Time from a request's first byte (a new connection: from accept) to the end of its headers.
    header_timeout_s: float = setting(
        10.0, "--header-timeout", "seconds to receive a request's headers (else 408)", float
    )
    idle_timeout_s: float = setting(
        60.0, "--idle-timeout", "seconds a keep-alive connection may sit between requests", float
    )
    max_connections: int = setting(
        4096,
        "--max-connections",
        "open client connections; one more is answered 503 and closed at once",
        positive_int,
    )
    #: ``None``: a quarter of ``max_connections`` (``per_source_connections``).
    max_connections_per_source: int | None = setting(
        None,
        "--max-connections-per-source",
        "open client connections from one source address; one more gets 503, so one host cannot hold "
        "the whole bound (default: a quarter of --max-connections; 0: no bound). Behind a proxy or load "
        "balancer that hides client addresses every client shares one address: raise it or set 0 there",
        non_negative_int,
    )
    max_body_bytes: int = setting(4 * MIB, "--max-body-bytes", "larger bodies get 413", int)
    body_timeout_s: float = setting(10.0, "--body-timeout", "seconds to receive a body (else 408)", float)
    #: Bodies are reserved before they are read (``admission.BodyBudget``).
    tenant_body_bytes: int = setting(
        16 * MIB,
        "--tenant-body-bytes",
        "request bodies one tenant may have in memory at once (more: 429)",
        int,
    )
    total_body_bytes: int = setting(
        128 * MIB,
        "--total-body-bytes",
        "request bodies the process may have in memory at once (more: 503)",
        int,
    )
    inline_parse_bytes: int = setting(
        16 * 1024,
        "--inline-parse-bytes",
        "bodies up to this size are parsed on the event loop; larger ones in a worker process",
        int,
    )
    parse_workers: int = setting(
        2,
        "--parse-workers",
        "processes that parse bodies larger than --inline-parse-bytes (0: all on the event loop)",
        int,
    )
    replicas: int = setting(
        1,
        "--replicas",
        "gateway replicas sharing each tenant's rate limits; this one enforces 1/N of them "
        "(default: $KVFLEET_GATEWAY_REPLICAS, else 1)",
        replica_count,
        env="KVFLEET_GATEWAY_REPLICAS",
    )
    #: ``gateway.shared_store``; the password comes from ``$KVFLEET_SHARED_STORE_PASSWORD``, never a flag.
    shared_store_url: str | None = setting(
        None,
        "--shared-store",
        "Redis or Valkey URL (redis://host:port, rediss:// for TLS) through which the gateway replicas "
        "split each tenant's rate limits by where its traffic lands instead of 1/N each; the password "
        "comes from $KVFLEET_SHARED_STORE_PASSWORD. Unreachable: each replica falls back to 1/N within "
        "a second (default: $KVFLEET_SHARED_STORE, else none)",
        shared_store_url,
        env="KVFLEET_SHARED_STORE",
    )
    shared_store_ca: str | None = setting(
        None,
        "--shared-store-ca",
        "CA bundle that verifies a rediss:// store's certificate (default: the system's CAs)",
        str,
    )
    shared_store_sync_s: float = setting(
        0.2,
        "--shared-store-sync",
        "seconds between two syncs with the shared store (at most 0.25: the fallback comes within a second)",
        sync_interval,
    )
    max_queue: int = setting(64, "--max-queue", "per-tenant admission queue length", int)
    max_queue_wait_s: float = setting(10.0, "--queue-timeout", "seconds a request may wait queued", float)
    #: 256 is vLLM's default ``--max-num-seqs``: what an engine could not run at once anyway
    #: (``admission.EngineQueue`` holds the rest and releases them in fair order).
    engine_in_flight_per_replica: int = setting(
        256,
        "--engine-in-flight-per-replica",
        "requests each engine replica is given at once; more wait at the gateway in fair order "
        "(0: no limit, nothing held)",
        int,
    )
    fair_queuing: bool = setting(
        True,
        "--fair-queuing",
        "order of held requests within an SLA tier: vtc (token-weighted fair) or fifo",
        vtc_or_fifo,
        metavar="{vtc,fifo}",
    )
    #: The fair-queuing cost of an input and an output token (``fairness.TokenCost``).
    fair_input_weight: float = setting(
        1.0, "--fair-input-weight", "fair-queuing cost of an input token", float
    )
    fair_output_weight: float = setting(
        2.0, "--fair-output-weight", "fair-queuing cost of an output token", float
    )
    affinity_prefix_chars: int = setting(
        512, "--affinity-prefix-chars", "prompt chars in the affinity key", int
    )
    load_factor: float = setting(1.25, "--load-factor", "bounded-load factor (> 1)", float)
    #: ``gateway.kv_events``: precise routing (``kv_index``); ``None``: affinity only.
    kv_events_port: int | None = setting(
        None,
        "--kv-events-port",
        "port of the engines' KV events (vLLM's --kv-events-config, ZMQ): with it each request goes to "
        "the replica holding the longest cached prefix of its tenant's blocks within the load bound, by "
        "affinity where none holds any (default: affinity only)",
        tcp_port,
    )
    kv_index_ttl_s: float = setting(
        3600.0,
        "--kv-index-ttl",
        "seconds a block stays in the routing index without being stored again (a safety net for a "
        "removal event that was lost)",
        positive_seconds,
    )
    tokenize_timeout_s: float = setting(
        0.5,
        "--tokenize-timeout",
        "seconds precise routing waits for the engine to tokenize a request before routing it by affinity",
        positive_seconds,
    )
    default_max_tokens: int = setting(
        256,
        "--default-max-tokens",
        "max_tokens injected into a request that sends none when the tenant table gives no bound "
        "(no KV burst cap, tokens per minute or context length)",
        positive_int,
    )
    #: Exact, lower-case host names (``rewrite.check_media_urls``); the engines get the same list.
    allowed_media_domains: frozenset[str] = setting(
        frozenset(),
        "--allowed-media-domains",
        "comma-separated hosts whose http(s) URLs image_url/audio_url/video_url parts may carry (exact "
        "names); by default only data: URLs: the engine would fetch any other URL from inside the cluster",
        host_list,
    )
    connect_timeout_s: float = setting(2.0, "--connect-timeout", "seconds to connect to a replica", float)
    #: A buffered answer's headers come with its last token.
    upstream_read_timeout_s: float = setting(
        600.0,
        "--upstream-timeout",
        "seconds the engine may send nothing (before a buffered answer, or between two reads of a "
        "stream); then 504, or an error event in a stream already started",
        float,
    )
    #: Connections to the engines, all replicas together (no flag: the engines' own bound is lower).
    upstream_connections: int = 4096
    drain_timeout_s: float = setting(
        60.0,
        "--drain-timeout",
        "on SIGTERM: seconds in-flight requests may take to finish before they are cut",
        float,
    )


def per_source_connections(settings: GatewaySettings) -> int:
    """The bound on connections from one source address (0: none): the setting, else a quarter of the
    whole bound, so at least four hosts are needed to fill it."""
    if settings.max_connections_per_source is not None:
        return settings.max_connections_per_source
    return max(1, settings.max_connections // 4)


def default_text(value: object) -> str | None:
    """A setting's default as a user would type it (``--help``, docs/gateway-flags.md); ``None`` when its
    text says what the default is."""
    if isinstance(value, frozenset):
        return ",".join(sorted(value)) or "none"
    if isinstance(value, bool):
        return "vtc" if value else "fifo"  # the one bool setting, --fair-queuing
    if isinstance(value, float):
        return f"{value:g}"
    return None if value is None else str(value)


def flags() -> dict[str, Flag]:
    """Field name -> its flag, for every setting that has one, in declaration order."""
    return {f.name: f.metadata[_FLAG] for f in fields(GatewaySettings) if _FLAG in f.metadata}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (``dest``: the field's name); defaults from the fields (or their ``env``)."""
    for f in fields(GatewaySettings):
        flag: Flag | None = f.metadata.get(_FLAG)
        if flag is None:
            continue
        shown = None if f.default is MISSING else default_text(f.default)
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "type": flag.parse,
            "help": flag.help + (f" (default: {shown})" if shown is not None else ""),
            "metavar": flag.metavar or flag.name.removeprefix("--").upper().replace("-", "_"),
        }
        if f.default is MISSING:
            kwargs["required"] = True
        elif flag.env is not None and flag.env in os.environ:
            kwargs["default"] = flag.parse(os.environ[flag.env])
        else:
            kwargs["default"] = f.default
        parser.add_argument(flag.name, **kwargs)


def from_flags(args: argparse.Namespace) -> GatewaySettings:
    """The settings ``add_flags``' parser read."""
    return GatewaySettings(**{name: getattr(args, name) for name in flags()})
