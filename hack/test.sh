#!/usr/bin/env bash
# The whole test suite: provisions every real component the tests need, then runs all tests.
# This is the README's test command (`make test`) and the only thing .ci/run calls.
#
# A real component that cannot be provisioned fails the run, naming the step that provisions it; the tests
# fail the same way for a component that is absent (tests/conftest.py: missing_component). The only way to
# run without one is to say so: KVFLEET_ALLOW_MISSING=1 continues past a failed step and lets the tests
# that need its component skip (`make unit` runs only the unit tests that way). CI never sets it.
#
# What it prints: hack/bootstrap.sh's line when it (re)installs .venv, then hack/provision.sh's (one line
# per step start and end, a progress line, each failed step's log), then pytest's report.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/bootstrap.sh

# The provisioning steps (hack/provision.d/*.sh) run in their lanes side by side, each lane in order,
# through hack/provision.sh (the same driver as `make demo`), and the static checks (hack/lint.sh: ruff,
# ruff format --check, mypy --strict, the import contracts) run as a third lane beside them, from the end
# of 20-engine on (mypy reads the vLLM and torch it installs). A failed step or check fails the run once
# every lane has ended, before pytest, with its log's last lines; KVFLEET_ALLOW_MISSING=1 goes on past a
# failed step, never past a failed check.
failures=$(mktemp)
trap 'rm -f "$failures"' EXIT
provisioned=0
hack/provision.sh --for "make test" --also hack/lint.sh --failures "$failures" || provisioned=$?
mapfile -t failed_steps <"$failures"
if [ "$provisioned" != 0 ]; then
  if [ "${KVFLEET_ALLOW_MISSING:-}" != 1 ] && grep -q '^hack/provision\.d/' "$failures"; then
    echo "make test: KVFLEET_ALLOW_MISSING=1 make test runs without what a failed step provisions," \
      "skipping the tests that need it." >&2
  fi
  exit 1
fi
echo "==> pytest"
# Two workers side by side, each heavy setup whole on one of them (tests/parallel_plugin.py), and every
# test's and fixture's durations into a results file (tests/durations_plugin.py; docs/benchmarks.md).
# KVFLEET_TEST_WORKERS=0 runs in one process.
workers=${KVFLEET_TEST_WORKERS:-2}
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
status=0
KVFLEET_DURATIONS_COMMAND="make test (pytest ${parallel[*]})" .venv/bin/pytest "${parallel[@]}" \
  --durations-results benchmarks/results/test_durations.json "$@" || status=$?
if [ ${#failed_steps[@]} -gt 0 ]; then
  echo "make test: not provisioned (KVFLEET_ALLOW_MISSING=1): ${failed_steps[*]}" >&2
fi
exit "$status"
