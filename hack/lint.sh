#!/usr/bin/env bash
# lane: lint
# what: ruff check, ruff format --check, mypy --strict, import contracts
# takes: ~1.5 min alone on 2 cores, longer beside the Go builds
# after: 20-engine
# The static checks: `make lint`, and `make test` runs them as a third lane beside provisioning
# (hack/provision.sh --also). They need .venv (hack/bootstrap.sh) and, for mypy to read the types of vLLM
# and torch, the engine install: in `make test` the lane starts once 20-engine has ended (`# after:`), since
# checking while pip writes those packages would give an answer that depends on timing. Each check runs
# even when one before it failed, so one run reports every problem; the exit status is non-zero when any
# failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
status=0
check() {
  echo "==> $*"
  "$@" || status=1
}
check .venv/bin/ruff check .
check .venv/bin/ruff format --check .
check .venv/bin/mypy
check .venv/bin/lint-imports  # the import contracts in pyproject.toml [tool.importlinter]
exit "$status"
