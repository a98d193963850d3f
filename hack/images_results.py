"""Write ``benchmarks/results/images.json``: sizes and build times of the images ``make images`` builds.

Every build by ``hack/images.sh`` appends a line to ``$KVFLEET_CACHE/images/builds.jsonl`` (image, seconds,
whether it was cached, pip's cache size before and after). This reads those lines and the sizes podman
reports and writes one results file (benchmarks/results_format.py):

* ``<image>_build_cold_s``: the first build of an image whose wheels were not downloaded yet (for the
  base: mmdebstrap from Debian's mirror plus the import);
* ``<image>_build_code_change_s``: a rebuild after kvfleet's code changed (downloads and dependency layers
  cached: only the wheel and the layers after it are built);
* ``<image>_build_dependencies_s``: dependency layers rebuilt with every download cached;
* ``images_build_noop_s``: ``make images`` with nothing to do (content tags exist), per image;
* ``<image>_size_mb``: the image's size as podman reports it;
* ``go_<group>_build_s``: with ``--build-cluster-log LOG...``, each ``<group>: done in N s`` line of
  hack/build-cluster.sh's output (the real node's kubelet/kube-proxy, CoreDNS, kube-router; the control
  plane's groups when that log is given too): the CI-relevant cold build times.

    .venv/bin/python hack/images_results.py [--results PATH] [--load-note TEXT] [--build-cluster-log LOG...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from results_format import Figure, Machine, add_results_argument, measured, write_results  # noqa: E402


def _cache() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE", str(Path.home() / ".cache" / "kvfleet")))


def _size_mb(ref: str) -> float:
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Size}}", ref],
        capture_output=True,
        text=True,
        check=True,
    )
    return round(int(out.stdout.strip()) / 1e6, 1)


def build_kind(build: dict[str, Any]) -> str:
    """``cold`` (the image's wheels were not cached: most of the cache grew during the build), ``noop``
    (content tag existed), ``code_change`` (downloads cached); a ``kind`` written into the log wins."""
    if "kind" in build:
        return str(build["kind"])
    if build["cached"]:
        return "noop"
    before, after = build.get("pip_cache_mb_before", 0), build.get("pip_cache_mb", 0)
    return "cold" if after - before > 0.5 * max(after, 1) else "code_change"


def summarize(builds: list[dict[str, Any]]) -> tuple[dict[str, Figure], dict[str, Any]]:
    """The figures of the build log (pure): the first cold build of each image, and every code-change,
    dependency and no-op build."""
    figures: dict[str, Figure] = {}
    notes = {
        "cold": "empty download cache, no layers",
        "code_change": "kvfleet's code changed: downloads and dependency layers cached",
        "dependencies": "dependency layers rebuilt, every download cached",
    }
    for image in ("base", "kvfleet", "engine"):
        for kind, note in notes.items():
            seconds = [float(b["seconds"]) for b in builds if b["image"] == image and build_kind(b) == kind]
            if kind == "cold":
                seconds = seconds[:1]
            if seconds:
                figures[f"{image}_build_{kind}_s"] = Figure.of(seconds, "s", note=note)
    noop = [float(b["seconds"]) for b in builds if build_kind(b) == "noop"]
    if noop:
        figures["images_build_noop_s"] = Figure.of(noop, "s", note="per image, content tag already built")
    return figures, {"builds": builds}


def build_cluster_figures(log_text: str) -> dict[str, Figure]:
    """``go_<group>_build_s`` for every ``<group>: done in N s`` line of hack/build-cluster.sh (pure)."""
    return {
        f"go_{m['group'].replace('-', '_')}_build_s": Figure.single(float(m["seconds"]), "s")
        for m in re.finditer(r"\] (?P<group>[\w-]+): done in (?P<seconds>\d+) s", log_text)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_argument(parser, "images")
    parser.add_argument("--load-note", default="", help="how busy the machine was while the builds ran")
    parser.add_argument(
        "--build-cluster-log", type=Path, nargs="*", default=[], help="hack/build-cluster.sh output"
    )
    args = parser.parse_args()
    log = _cache() / "images" / "builds.jsonl"
    builds = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    figures, details = summarize(builds)
    for log_path in args.build_cluster_log:
        figures.update(build_cluster_figures(log_path.read_text()))
    refs = json.loads((_cache() / "images" / "images.json").read_text())
    for image in ("base", "kvfleet", "engine"):
        if image in refs:
            figures[f"{image}_size_mb"] = Figure.single(_size_mb(refs[image]["ref"]), "MB")
            details[f"{image}_ref"] = refs[image]["ref"]
    results = measured(
        "images",
        "make images (cold, after a code change, with nothing to do), then"
        " .venv/bin/python hack/images_results.py",
        figures,
        Machine(
            cores=os.cpu_count() or 1, load=args.load_note or f"1-min load average {os.getloadavg()[0]:.1f}"
        ),
        details,
    )
    write_results(results, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
