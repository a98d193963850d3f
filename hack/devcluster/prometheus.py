"""Start a real Prometheus (Debian's package) with a given scrape config on a free loopback port.

:func:`build_scrape_config` is the pure part (a config dict); :func:`start_prometheus` writes it, checks it
with ``promtool check config``, starts ``prometheus`` in its own process group with its TSDB in a
temporary folder and waits for ``/-/ready``. :meth:`PrometheusServer.query` runs an instant PromQL query
through the HTTP API.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import binaries
from .processes import ManagedProcess, find_free_port, start_process, wait_until


def build_scrape_config(
    targets: Mapping[str, Sequence[str]], *, interval: str = "1s", extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A Prometheus config scraping ``{job: ["host:port", ...]}`` every ``interval``."""
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(hosts)}]} for job, hosts in targets.items()
        ],
    }
    config.update(extra or {})
    return config


@dataclass
class PrometheusServer:
    """A running Prometheus: its base URL and process; :meth:`stop` kills it and removes its folder."""

    url: str
    port: int
    workdir: Path
    process: ManagedProcess

    def query(self, promql: str, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The ``data.result`` of an instant query (raises on a non-success answer)."""
        qs = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=timeout) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        return list(body["data"]["result"])

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_prometheus(
    config: Mapping[str, Any] | str,
    *,
    workdir: Path | None = None,
    rule_files: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    binary_names: tuple[str, str] = ("prometheus", "promtool"),
) -> PrometheusServer:
    """Start Prometheus with ``config`` (a dict or YAML text) on 127.0.0.1:<free port>.

    ``rule_files`` maps file names to YAML text written next to the config (refer to them by name in
    ``rule_files:`` of the config). Raises ``FileNotFoundError`` when prometheus/promtool are missing and
    ``subprocess.CalledProcessError`` when ``promtool check config`` rejects the config. ``binary_names``:
    the (prometheus, promtool) pair to run, e.g. the node tier's build with Kubernetes service discovery.
    """
    prometheus = binaries.require_binary(binary_names[0])
    promtool = binaries.require_binary(binary_names[1])
    root = workdir or Path(tempfile.mkdtemp(prefix="kvfleet-prometheus-"))
    text = config if isinstance(config, str) else yaml.safe_dump(dict(config), sort_keys=False)
    config_path = root / "prometheus.yml"
    config_path.write_text(text)
    for name, body in (rule_files or {}).items():
        (root / name).write_text(body)
    try:
        subprocess.run(
            [str(promtool), "check", "config", str(config_path)], check=True, capture_output=True, cwd=root
        )
        port = find_free_port()
        proc = start_process(
            "prometheus",
            [
                str(prometheus),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            root / "logs",
        )
        server = PrometheusServer(url=f"http://127.0.0.1:{port}", port=port, workdir=root, process=proc)
        try:
            wait_until(server.ready, timeout=timeout, what="prometheus /-/ready", watch=[proc])
        except BaseException:
            server.stop()
            raise
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return server
