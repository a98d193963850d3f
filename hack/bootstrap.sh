#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the dev extras.
# Idempotent: a second run only reinstalls when pyproject.toml changed. pip's output goes to
# ${KVFLEET_CACHE:-~/.cache/kvfleet}/logs/bootstrap.log: one line here, and that log's end if pip fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# A new checkout where an earlier one stood (a CI clone): the .venv this machine kept, when it matches.
hack/venv-cache.sh restore
stamp=.venv/.kvfleet-installed
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
  exit 0
fi
log=${KVFLEET_CACHE:-$HOME/.cache/kvfleet}/logs/bootstrap.log
mkdir -p "$(dirname "$log")"
echo "==> installing kvfleet[dev] into .venv (a minute or two the first time;" \
  "pip's output: ${log/#"$HOME"/\~})"
# (set -e does not apply inside an `if` condition: the commands are chained.)
if ! {
  { [ -x .venv/bin/python ] || "$PY" -m venv .venv; } &&
    .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip &&
    .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev]'
} >"$log" 2>&1; then
  tail -n 30 "$log" | sed 's/^/    | /' >&2
  echo "bootstrap: installing kvfleet[dev] into .venv failed; the last lines of pip's output are above," \
    "all of it in $log" >&2
  exit 1
fi
touch "$stamp"
