#!/usr/bin/env bash
# The whole test suite: provisions every real component the tests need, then runs all tests.
# This is the README's test command (`make test`) and the only thing .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/bootstrap.sh
for step in hack/provision.d/*.sh; do
  [ -e "$step" ] || continue
  echo "==> $step"
  bash "$step"
done
echo "==> ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "==> mypy --strict"
.venv/bin/mypy
echo "==> import contracts (pyproject.toml [tool.importlinter])"
.venv/bin/lint-imports
echo "==> pytest"
exec .venv/bin/pytest "$@"
