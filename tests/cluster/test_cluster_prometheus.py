"""Prometheus (Debian's package) scrapes a local /metrics endpoint and answers PromQL over HTTP."""

from __future__ import annotations

from collections.abc import Callable

from cluster_helpers import wait_for
from devcluster import PrometheusServer, build_scrape_config
from prometheus_client import CollectorRegistry, Counter, start_http_server

from factories import free_port


def test_prometheus_scrapes_a_local_endpoint_and_answers_promql(
    prometheus: Callable[..., PrometheusServer],
) -> None:
    registry = CollectorRegistry()
    probes = Counter("kvfleet_smoke_probes", "Probes answered.", ["tenant"], registry=registry)
    probes.labels(tenant="acme").inc(3)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        prom = prometheus(build_scrape_config({"smoke": [f"127.0.0.1:{port}"]}, interval="1s"))

        def scraped() -> list[dict[str, object]]:
            return prom.query('kvfleet_smoke_probes_total{job="smoke",tenant="acme"}')

        result = wait_for(scraped, timeout=60, what="the counter in Prometheus")
        assert result[0]["value"][1] == "3"  # type: ignore[index]
        up = prom.query('up{job="smoke"}')
        assert [r["value"][1] for r in up] == ["1"]
        probes.labels(tenant="acme").inc(2)
        wait_for(lambda: scraped()[0]["value"][1] == "5", timeout=30, what="the new value scraped")  # type: ignore[index]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
