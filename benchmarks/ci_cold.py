"""The CI run on a cold machine: ``.ci/run`` on a fresh clone with every cache the project fills empty,
timed per phase, into ``benchmarks/results/ci_cold.json``.

``run`` clones HEAD into ``WORKDIR/repo`` and runs ``.ci/run`` there with ``CI=true`` and these caches
pointed at empty folders under ``WORKDIR``: ``$KVFLEET_CACHE`` (binaries, stamps, the node's containerd
store, pip downloads of the images, the tiny model), Go's module and build caches (``GOMODCACHE``,
``GOCACHE``), pip's cache (``PIP_CACHE_DIR``) and ``XDG_CACHE_HOME`` (vLLM's and torch's caches). Each line
of output is written to ``WORKDIR/log`` behind the time it was printed (``HH:MM:SS``); ``parse`` reads such
a log. podman's image store is a new one under ``WORKDIR`` too (``CONTAINERS_STORAGE_CONF``), so every image
is built from nothing; ``--warm-images`` keeps root's own store (images built before are found by their
content tags). What stays warm: the machine's own tools (Go, Python) and the Debian packages the
provisioning steps install with apt when missing (podman, containerd, prometheus, ...). Disk: about 45 GB
under ``WORKDIR`` at the fullest, 30 GB at the end (15 GB less with ``--warm-images``). With ``--warm``
(a provisioned machine), the clone's ``.venv`` is the copy the machine kept for a checkout at that place
(``hack/venv-cache.sh``) when it has one: give the same WORKDIR each time.

    .venv/bin/python benchmarks/ci_cold.py run WORKDIR [--warm-images] [--results PATH]  # about 1 hour
    .venv/bin/python benchmarks/ci_cold.py run WORKDIR --warm   # a provisioned machine: ci_warm.json
    .venv/bin/python benchmarks/ci_cold.py parse LOG [--results PATH]     # the figures of a logged run
    .venv/bin/python benchmarks/ci_cold.py parse LOG --command "CI=true .ci/run"  # a log made another way
    .venv/bin/python benchmarks/ci_cold.py run WORKDIR --demo  # `make demo` instead: demo_cold.json
    .venv/bin/python benchmarks/ci_cold.py run WORKDIR --in-place  # empties this machine's own caches first

With ``--demo`` the command is a newcomer's ``make demo`` on the same empty caches (results
``demo_cold``): besides the provisioning figures, ``until_report_s`` (first line to the line
``kvfleet demo report``) and ``lines_until_report`` (what a newcomer reads before it: one screen).

Figures: ``total_s`` (first line to last); ``bootstrap_s``, ``provision_s`` (every provisioning step, the
lanes side by side), ``lint_s`` (ruff, mypy, import contracts) and ``tests_s`` (pytest), each from the
``==> `` lines ``hack/test.sh`` prints; one ``provision_<step>_s`` per ``hack/provision.d`` step (from its
``<== STEP: done in N s`` line; the steps of the lanes overlap); ``go_<group>_build_s`` for every
``<group>: done in N s`` line of ``hack/build-cluster.sh`` (in the log, or in the steps' own logs that
hack/provision.sh keeps); ``limit_s`` (90 minutes); with ``run``, ``disk_peak_gb`` and ``disk_end_gb``: the
free space the run took on WORKDIR's filesystem at its fullest and at its end (``DiskWatch``).
Details: pytest's summary line and the exit status.

Two log formats: in the older one lint ran after provisioning, from its ``==> ruff`` line to ``==> pytest``,
and the four phases add up to the total. In today's (``hack/provision.sh``) lint is a lane of its own beside
the provisioning steps (``==> hack/lint.sh`` ... ``<== hack/lint.sh: done in N s``): ``lint_s`` is that
lane's own time, inside ``provision_s`` (which lasts from the first step to ``==> pytest``, every lane
ended), and bootstrap, provision and tests add up to the total.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import JsonValue
from results_format import (
    REPO,
    Figure,
    Machine,
    add_results_argument,
    default_path,
    measured,
    name_of,
    write_results,
)

NAME = "ci_cold"
#: ``run --demo``: ``make demo`` on a fresh machine.
DEMO_NAME = "demo_cold"
#: The line ``make demo`` prints before its report (hack/demo.py).
DEMO_REPORT = "kvfleet demo report"
#: The same run on a provisioned machine (``run --warm``).
WARM_NAME = "ci_warm"
LIMIT_S = 90 * 60
_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) (.*)$")
_GO_DONE = re.compile(r"\[build-cluster[^]]*\] ([a-z0-9-]+): done in (\d+) s")
_PYTEST_SUMMARY = re.compile(r"=+ (.*\d+ (passed|failed).* in [\d.]+s.*) =+")
#: hack/test.sh's phase lines after the provisioning steps (bootstrap starts at the log's first line).
_PHASES = (("lint", "==> ruff"), ("tests", "==> pytest"))
#: A step's start: ``==> STEP`` alone, or followed by what it does (hack/provision.sh).
#: Searched, not matched: a line may follow pytest's progress dots on the same output line.
_STEP = re.compile(r"(?:^|[.FEsx])==> hack/provision\.d/\d+-([a-z0-9-]+)\.sh(?: .*)?$")
_STEP_END = re.compile(
    r"<== hack/provision\.d/\d+-([a-z0-9-]+)\.sh: (?:done in|failed \(exit \d+\) after) (\d+) s$"
)
#: The end of the lint lane beside provisioning (hack/test.sh: hack/provision.sh --also hack/lint.sh).
_LINT_LANE_END = re.compile(r"<== hack/lint\.sh: (?:done in|failed \(exit \d+\) after) (\d+) s$")


@dataclass(frozen=True)
class ColdRun:
    """What a log says: seconds per phase (in log order; they add up to the total), per provisioning
    step, per Go build group, pytest's summary, and the lint lane's own time when lint ran beside
    provisioning (then no phase of its own)."""

    total_s: int
    phases: dict[str, int]
    steps: dict[str, int]
    go_builds: dict[str, int]
    pytest_summary: str
    lint_lane_s: int | None = None
    #: ``make demo``'s log: seconds from the first line to the report's, and the lines printed before it.
    until_report_s: int | None = None
    lines_until_report: int | None = None


def parse_log(lines: Sequence[str]) -> ColdRun:
    """The phases of a time-stamped ``.ci/run`` log (pure). A phase lasts from its ``==> `` line to the
    next phase's; the last one to the last line. Bootstrap lasts from the first line to the first
    provisioning step, provisioning from there to the next phase (lint, or pytest when lint ran as a lane
    beside it). A step lasts what its ``<== `` line says; in a log of the sequential ``hack/test.sh`` (no
    such lines), from its ``==> `` line to the next one."""
    stamped: list[tuple[int, str]] = []
    offset = previous = 0
    for line in lines:
        match = _LINE.match(line.rstrip("\n"))
        if match is None:
            continue
        h, m, s, text = match.groups()
        seconds = int(h) * 3600 + int(m) * 60 + int(s)
        if seconds + offset < previous:  # past midnight
            offset += 86400
        previous = seconds + offset
        stamped.append((previous, text))
    if not stamped:
        raise ValueError("no time-stamped line (expected 'HH:MM:SS text' lines written by 'run')")
    starts: list[tuple[str, int]] = [("bootstrap", stamped[0][0])]
    step_starts: list[tuple[str, int]] = []
    ended: dict[str, int] = {}
    go_builds: dict[str, int] = {}
    summary = ""
    lint_lane: int | None = None
    report: tuple[int, int] | None = None  # (seconds, lines before it)
    for index, (at, text) in enumerate(stamped):
        if report is None and text.rstrip() == DEMO_REPORT:
            report = (at - stamped[0][0], index)
        step = _STEP.search(text.strip())
        if step is not None:
            if not step_starts:
                starts.append(("provision", at))
            step_starts.append((step.group(1), at))
        step_end = _STEP_END.search(text.strip())
        if step_end is not None:
            ended[step_end.group(1)] = int(step_end.group(2))
        lint_end = _LINT_LANE_END.search(text.strip())
        if lint_end is not None:
            lint_lane = int(lint_end.group(1))
        starts.extend((phase, at) for phase, marker in _PHASES if text.strip() == marker)
        done = _GO_DONE.search(text)
        if done is not None:
            go_builds[done.group(1)] = int(done.group(2))
        found = _PYTEST_SUMMARY.search(text)
        if found is not None:
            summary = found.group(1)
    end = stamped[-1][0]
    phases = {
        name: (starts[i + 1][1] if i + 1 < len(starts) else end) - at for i, (name, at) in enumerate(starts)
    }
    after = next((at for name, at in starts if name in ("lint", "tests")), end)
    steps = {
        name: ended[name]
        if name in ended
        else (step_starts[i + 1][1] if i + 1 < len(step_starts) else after) - at
        for i, (name, at) in enumerate(step_starts)
    }
    return ColdRun(
        end - stamped[0][0],
        phases,
        steps,
        go_builds,
        summary,
        lint_lane,
        until_report_s=report[0] if report else None,
        lines_until_report=report[1] if report else None,
    )


def go_builds_in_step_logs(folder: Path) -> dict[str, int]:
    """``hack/build-cluster.sh``'s own timings (``GROUP: done in N s``) in the provisioning steps' logs,
    which hack/provision.sh keeps in ``folder`` (``$KVFLEET_CACHE/logs/provision``), one per step."""
    found: dict[str, int] = {}
    for path in sorted(folder.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            done = _GO_DONE.search(line)
            if done is not None:
                found[done.group(1)] = int(done.group(2))
    return found


def figures_of(run: ColdRun) -> dict[str, Figure]:
    figures = {"total_s": Figure.single(run.total_s, "s", note="first line of the command's output to last")}
    for phase, seconds in run.phases.items():
        figures[f"{phase}_s"] = Figure.single(seconds, "s")
    if run.lint_lane_s is not None:
        figures["lint_s"] = Figure.single(
            run.lint_lane_s, "s", note="the lint lane's own time, beside provisioning (inside provision_s)"
        )
    for step, seconds in run.steps.items():
        figures[f"provision_{step.replace('-', '_')}_s"] = Figure.single(seconds, "s", note="the step alone")
    for group, seconds in run.go_builds.items():
        figures[f"go_{group.replace('-', '_')}_build_s"] = Figure.single(
            seconds, "s", note="hack/build-cluster.sh's own timing"
        )
    if run.until_report_s is not None and run.lines_until_report is not None:
        figures["until_report_s"] = Figure.single(
            run.until_report_s, "s", note=f"first line to {DEMO_REPORT!r}"
        )
        figures["lines_until_report"] = Figure.single(
            run.lines_until_report, "lines", note="printed before it"
        )
    else:
        figures["limit_s"] = Figure.single(LIMIT_S, "s", note="CI's limit: 90 minutes")
    return figures


def _cold_env(workdir: Path, warm_images: bool) -> dict[str, str]:
    caches = workdir / "cache"
    env = dict(os.environ)
    if not warm_images:
        store = workdir / "containers"
        conf = store / "storage.conf"
        store.mkdir(parents=True, exist_ok=True)
        conf.write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{store / "storage"}"\nrunroot = "{store / "run"}"\n'
        )
        env["CONTAINERS_STORAGE_CONF"] = str(conf)
    env.update(
        CI="true",
        KVFLEET_CACHE=str(caches / "kvfleet"),
        XDG_CACHE_HOME=str(caches),
        GOPATH=str(workdir / "go"),
        GOMODCACHE=str(workdir / "go" / "pkg" / "mod"),
        GOCACHE=str(caches / "go-build"),
        PIP_CACHE_DIR=str(caches / "pip"),
    )
    env.pop("KVFLEET_ALLOW_MISSING", None)
    return env


def _machine_caches() -> list[Path]:
    """The folders the project fills on this machine, at their own places (what ``--in-place`` empties):
    ``$KVFLEET_CACHE``, Go's module and build caches, pip's cache, vLLM's, torch's and Hugging Face's."""
    home_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    found = [Path(os.environ.get("KVFLEET_CACHE", home_cache / "kvfleet"))]
    for var in ("GOMODCACHE", "GOCACHE"):
        done = subprocess.run(["go", "env", var], capture_output=True, text=True, check=False)
        if done.returncode == 0 and done.stdout.strip():
            found.append(Path(done.stdout.strip()))
    found += [home_cache / name for name in ("pip", "vllm", "torch", "huggingface")]
    return found


def empty_machine_caches() -> list[str]:
    """Make this machine a fresh one for the project (``--in-place``): delete every cache it fills and
    podman's image store (``podman system reset``); the Debian packages and the tools stay. What was
    deleted, for the log. Destructive: for a machine that exists to be measured."""
    deleted: list[str] = []
    for path in _machine_caches():
        if path.exists():
            subprocess.run(["chmod", "-R", "u+w", str(path)], check=False)  # Go's module cache is read-only
            subprocess.run(["rm", "-rf", str(path)], check=True)
            deleted.append(str(path))
    if shutil.which("podman") is None:  # a machine the project never provisioned: no store to empty
        return deleted
    reset = subprocess.run(["podman", "system", "reset", "--force"], capture_output=True, check=False)
    if reset.returncode == 0:
        deleted.append("podman's image store")
    return deleted


def _warm_env() -> dict[str, str]:
    """The machine's own caches (a provisioned machine): only CI=true and no opt-out."""
    env = dict(os.environ, CI="true")
    env.pop("KVFLEET_ALLOW_MISSING", None)
    return env


class DiskWatch:
    """The free space of one filesystem, read every ``every`` seconds while a run goes on: how much of it
    the run took at its fullest (``peak_bytes``) and at its end (``end_bytes``). On a disk shared with
    other work, what that work wrote in the meantime counts too."""

    def __init__(self, path: Path, every: float = 5.0, free: Callable[[], int] | None = None) -> None:
        self.every = every
        self.free = free or (lambda: shutil.disk_usage(path).free)
        self.start_free = self.lowest_free = self.end_free = self.free()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            self.lowest_free = min(self.lowest_free, self.free())

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.end_free = self.free()
        self.lowest_free = min(self.lowest_free, self.end_free)

    @property
    def peak_bytes(self) -> int:
        return self.start_free - self.lowest_free

    @property
    def end_bytes(self) -> int:
        return self.start_free - self.end_free


def disk_figures(watch: DiskWatch) -> dict[str, Figure]:
    """``disk_peak_gb`` and ``disk_end_gb`` of a watched run (GB = 10^9 bytes)."""
    note = "free space taken on the run's filesystem (other work on a shared disk counts too)"
    return {
        "disk_peak_gb": Figure.single(round(watch.peak_bytes / 1e9, 1), "GB", note=f"at its fullest: {note}"),
        "disk_end_gb": Figure.single(round(watch.end_bytes / 1e9, 1), "GB", note=f"at its end: {note}"),
    }


def run_cold(
    workdir: Path,
    warm_images: bool = False,
    warm: bool = False,
    demo: bool = False,
    in_place: bool = False,
) -> tuple[Path, int, Path, DiskWatch]:
    """Clone HEAD into ``workdir/repo``, run ``.ci/run`` (with ``demo``: ``make demo``) there on empty
    caches under ``workdir`` (with ``warm``: on the machine's own caches, as on a provisioned machine; with
    ``in_place``: on the machine's own caches emptied first, which leaves the machine provisioned again and
    needs no room for a second copy); the log, the exit status, the folder of the steps' own logs and the
    run's ``DiskWatch`` (from after the caches were emptied)."""
    if workdir.exists() and any(workdir.iterdir()):
        raise SystemExit(f"{workdir} is not empty: give a new folder (every cache under it must start empty)")
    workdir.mkdir(parents=True, exist_ok=True)
    repo = workdir / "repo"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(repo)], check=True)
    log = workdir / "log"
    if in_place:
        print("emptied:", ", ".join(empty_machine_caches()) or "nothing", flush=True)
    env = _warm_env() if warm or in_place else _cold_env(workdir, warm_images)
    if not warm and not in_place:
        Path(env["XDG_CACHE_HOME"]).mkdir(parents=True, exist_ok=True)
    watch = DiskWatch(workdir)
    argv = ["make", "demo"] if demo else [".ci/run"]
    with log.open("w") as out, watch:
        # The run's first line, before the command prints any: the clock starts with the command.
        out.write(f"{time.strftime('%H:%M:%S')} $ {' '.join(argv)}\n")
        proc = subprocess.Popen(
            argv,
            cwd=repo,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(f"{time.strftime('%H:%M:%S')} {line}")
            out.flush()
        status = proc.wait()
    home_cache = Path(env.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    step_logs = Path(env.get("KVFLEET_CACHE", home_cache / "kvfleet")) / "logs" / "provision"
    return log, status, step_logs, watch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run .ci/run on a fresh clone with empty caches under WORKDIR")
    run_p.add_argument("workdir", type=Path)
    run_p.add_argument(
        "--warm-images", action="store_true", help="keep podman's own image store (default: a new, empty one)"
    )
    run_p.add_argument(
        "--warm",
        action="store_true",
        help=f"a provisioned machine: keep every cache (only the clone and its .venv are new); results named "
        f"{WARM_NAME} (benchmarks/results/{WARM_NAME}.json)",
    )
    run_p.add_argument(
        "--demo",
        action="store_true",
        help=f"run `make demo` instead of .ci/run; results named {DEMO_NAME} "
        f"(benchmarks/results/{DEMO_NAME}.json)",
    )
    run_p.add_argument(
        "--in-place",
        action="store_true",
        help="empty this machine's own caches and podman's store first and run on them (a fresh machine "
        "without room for a second copy of the caches; the machine ends provisioned again). Destructive",
    )
    parse_p = sub.add_parser("parse", help="the figures of a log written by 'run'")
    parse_p.add_argument("log", type=Path)
    parse_p.add_argument("--exit-status", type=int, default=None, help="the run's exit status, if known")
    parse_p.add_argument(
        "--step-logs",
        type=Path,
        default=None,
        help="that run's provisioning step logs ($KVFLEET_CACHE/logs/provision): the Go timings",
    )
    parse_p.add_argument(
        "--command",
        dest="command_run",
        default=None,
        help="the command that produced LOG, for the results file (default: this script's run), e.g. "
        "`CI=true .ci/run` on a fresh machine with its output time-stamped",
    )
    for p in (run_p, parse_p):
        add_results_argument(p, NAME)
        p.add_argument("--load-note", default="", help="how busy the machine was (written to the file)")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    warm = args.command == "run" and args.warm
    demo = args.command == "run" and args.demo
    if warm and args.results == default_path(NAME):
        args.results = default_path(WARM_NAME)
    if demo and args.results == default_path(NAME):
        args.results = default_path(DEMO_NAME)
    step_logs: Path | None = None
    disk: DiskWatch | None = None
    if args.command == "run":
        log, status, step_logs, disk = run_cold(args.workdir, args.warm_images, warm, demo, args.in_place)
    else:
        log, status, step_logs = args.log, args.exit_status, args.step_logs
    run = parse_log(log.read_text().splitlines())
    if step_logs is not None:  # today's hack/provision.sh keeps the Go timings in the steps' logs
        run = replace(run, go_builds={**run.go_builds, **go_builds_in_step_logs(step_logs)})
    details: dict[str, JsonValue] = {"pytest": run.pytest_summary}
    if status is not None:
        details["exit_status"] = status
    command = ".venv/bin/python benchmarks/ci_cold.py run WORKDIR" + (" --warm" if warm else "")
    if args.command == "run":
        command += " --warm-images" if args.warm_images else ""
        command += " --in-place" if args.in_place else ""
    command += " --demo" if demo else ""
    if args.command == "parse" and args.command_run:
        command = args.command_run
    if args.command == "run":
        machine = Machine.here(load, note=args.load_note)
    else:  # the load while the logged run ran is not in the log: say what the caller knows
        machine = Machine(cores=os.cpu_count() or 1, load=args.load_note or "not recorded")
    figures = figures_of(run)
    if disk is not None:
        figures |= disk_figures(disk)
    results = measured(
        name_of(args.results),
        command,
        figures,
        machine,
        details=details,
    )
    write_results(results, args.results)
    kind = ("warm" if warm else "cold") + (" demo" if demo else " CI")
    print(f"{kind}: {run.total_s} s ({run.total_s / 60:.0f} min) against {LIMIT_S} s; {run.phases}")
    return 0 if status in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())
