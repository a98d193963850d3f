#!/usr/bin/env bash
# The project's .venv, kept on a provisioned machine for the next checkout at the same place (CI clones
# main into the same folder for every run, and each clone's .venv took 3 minutes: bootstrap, then the
# engine's 4.7 GB of torch, vLLM and LMCache installed again from the wheelhouse).
#
#   hack/venv-cache.sh restore   a missing .venv becomes the saved copy, when there is one for this key
#                                (hack/bootstrap.sh runs it first)
#   hack/venv-cache.sh save      keep .venv once the engine is installed (hack/provision.d/20-engine.sh)
#
# A copy is hard links (cp -al: seconds, and no room while the .venv it came from lives). pip replaces
# files, never rewrites them, so an install into the .venv later leaves the copy as it was. The key: the
# .venv's absolute path (its scripts and the editable install name it), the Python that makes it, and the
# files that decide what goes in (pyproject.toml, hack/bootstrap.sh, hack/install-engine.sh). Only the
# newest copy is kept: $KVFLEET_CACHE/venvs (default ~/.cache/kvfleet/venvs). Where the copy cannot be made
# (the cache on another filesystem), nothing is kept and bootstrap installs as before.
# KVFLEET_VENV_CACHE=0: neither restore nor save.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${KVFLEET_CACHE:-$HOME/.cache/kvfleet}/venvs
PY=${PYTHON:-python3}

[ "${KVFLEET_VENV_CACHE:-1}" != 0 ] || exit 0
key() {
  { realpath -m .venv; "$PY" -c 'import sys; print(sys.executable, sys.version)'
    sha256sum pyproject.toml hack/bootstrap.sh hack/install-engine.sh | cut -d' ' -f1; } | sha256sum | cut -c1-16
}
# What a complete .venv holds: bootstrap's stamp and the engine's (hack/install-engine.sh).
complete() { [ -x "$1/bin/python" ] && [ -f "$1/.kvfleet-installed" ] && [ -f "$1/.kvfleet-engine-installed" ]; }

case ${1:-} in
  restore)
    [ ! -e .venv ] || exit 0
    saved=$CACHE/$(key)
    complete "$saved" || exit 0
    rm -rf .venv.restoring
    if cp -al "$saved" .venv.restoring 2>/dev/null; then
      mv .venv.restoring .venv
      # bootstrap compares its stamp with pyproject.toml's time; the key already says they match.
      touch .venv/.kvfleet-installed
      echo "==> .venv: the copy this machine saved (${saved/#"$HOME"/\~}; hack/venv-cache.sh)"
    else
      rm -rf .venv.restoring
      echo "==> .venv: the saved copy (${saved/#"$HOME"/\~}) cannot be linked here; installing" >&2
    fi
    ;;
  save)
    complete .venv || { echo "venv-cache: .venv is not complete (bootstrap and the engine first)" >&2; exit 1; }
    k=$(key)
    mkdir -p "$CACHE"
    if [ ! -d "$CACHE/$k" ]; then
      rm -rf "$CACHE/$k.saving"
      if cp -al .venv "$CACHE/$k.saving" 2>/dev/null; then
        mv "$CACHE/$k.saving" "$CACHE/$k"
      else
        rm -rf "$CACHE/$k.saving"
        echo "venv-cache: .venv cannot be linked into ${CACHE/#"$HOME"/\~} (another filesystem?); not kept"
        exit 0
      fi
    fi
    for old in "$CACHE"/*; do [ "$old" = "$CACHE/$k" ] || rm -rf "$old"; done
    echo "venv-cache: .venv kept for the next checkout here (${CACHE/#"$HOME"/\~}/$k)"
    ;;
  *) sed -n '6,7p' "$0" | sed 's/^# *//' >&2; exit 2 ;;
esac
