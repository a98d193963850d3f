#!/usr/bin/env bash
# The whole test suite: provisions every real component the tests need, then runs all tests.
# This is the README's test command (`make test`) and the only thing .ci/run calls.
#
# A real component that cannot be provisioned fails the run, naming the step that provisions it; the tests
# fail the same way for a component that is absent (tests/conftest.py: missing_component). The only way to
# run without one is to say so: KVFLEET_ALLOW_MISSING=1 continues past a failed step and lets the tests
# that need its component skip (`make unit` runs the light tiers, unit, tools and loopback, that way). CI never sets it.
#
# What it prints: hack/bootstrap.sh's line when it (re)installs .venv, then hack/provision.sh's (one line
# per step start and end, a progress line, each failed step's log), then pytest's report.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/bootstrap.sh

# The provisioning steps (hack/provision.d/*.sh) run in their lanes side by side, each lane in order,
# through hack/provision.sh (the same driver as `make demo`), and the static checks (hack/lint.sh: ruff,
# ruff format --check, mypy --strict, the import contracts) run as a third lane beside them, from the end
# of 20-engine on (mypy reads the vLLM and torch it installs).
#
# pytest starts as soon as what most tests need has ended (10-cluster, 20-engine), beside the checks;
# the steps only a few tests need (30-node, 40-images: the real node and the images, 17 minutes on a cold
# machine) go on beside the tests, and those tests wait for them (tests/provisioning_plugin.py reads the
# outcome each step leaves in $KVFLEET_PROVISION_STATE). A failed step that pytest starts after fails the
# run once every lane has ended, before pytest, with its log's last lines; a failed late step fails the
# tests that need it and the run; a failed check fails the run after pytest, with its log's last lines.
# KVFLEET_ALLOW_MISSING=1 goes on past a failed step (its tests skip), never past a failed check.
failures=$(mktemp)
KVFLEET_PROVISION_STATE=$(mktemp -d)
export KVFLEET_PROVISION_STATE
driver=""
cleanup() {
  [ -z "$driver" ] || kill "$driver" 2>/dev/null || true
  rm -rf "$failures" "$KVFLEET_PROVISION_STATE"
}
trap cleanup EXIT
hack/provision.sh --for "make test" --also hack/lint.sh --failures "$failures" &
driver=$!
ended() { [ -e "$KVFLEET_PROVISION_STATE/$1.done" ] || [ -e "$KVFLEET_PROVISION_STATE/$1.failed" ]; }
first_steps=(10-cluster 20-engine)
while kill -0 "$driver" 2>/dev/null; do
  waiting=0
  for step in "${first_steps[@]}"; do ended "$step" || waiting=1; done
  [ "$waiting" = 1 ] || break
  sleep 0.2
done
# A failed first step stops the run before pytest, unless the caller opted out. (The checks run beside
# pytest; a failed check fails the run at the end, opted out or not.)
early_failure=0
if [ "${KVFLEET_ALLOW_MISSING:-}" != 1 ]; then
  for step in 10-cluster 20-engine; do [ ! -e "$KVFLEET_PROVISION_STATE/$step.failed" ] || early_failure=1; done
fi
finish_provisioning() {  # the driver's exit status, once every lane has ended
  local status=0
  wait "$driver" || status=$?
  driver=""
  return "$status"
}
if [ "$early_failure" = 1 ] || ! kill -0 "$driver" 2>/dev/null; then
  provisioned=0
  finish_provisioning || provisioned=$?
  if [ "$provisioned" != 0 ]; then
    if [ "${KVFLEET_ALLOW_MISSING:-}" != 1 ] && grep -q '^hack/provision\.d/' "$failures"; then
      echo "make test: KVFLEET_ALLOW_MISSING=1 make test runs without what a failed step provisions," \
        "skipping the tests that need it." >&2
    fi
    exit 1
  fi
fi
# From here on the driver prints only its step lines (no running clock between pytest's lines).
touch "$KVFLEET_PROVISION_STATE/quiet"
[ ! -t 1 ] || printf '\r\033[K'
echo "==> pytest"
# Two workers side by side, each heavy setup whole on one of them (tests/parallel_plugin.py), and every
# test's and fixture's durations into a results file (tests/durations_plugin.py; docs/benchmarks.md).
# KVFLEET_TEST_WORKERS=0 runs in one process.
workers=${KVFLEET_TEST_WORKERS:-2}
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
status=0
# One token (`--opt=value`): pytest takes a separate value that names an existing file for a test path,
# and would then not load tests/conftest.py, where the option is defined, before parsing it.
KVFLEET_DURATIONS_COMMAND="make test (pytest ${parallel[*]})" .venv/bin/pytest "${parallel[@]}" \
  --durations-results=benchmarks/results/test_durations.json "$@" || status=$?
provisioned=0
[ -z "$driver" ] || finish_provisioning || provisioned=$?
mapfile -t failed_steps <"$failures"
if [ ${#failed_steps[@]} -gt 0 ] && [ "${KVFLEET_ALLOW_MISSING:-}" = 1 ]; then
  echo "make test: not provisioned (KVFLEET_ALLOW_MISSING=1): ${failed_steps[*]}" >&2
fi
[ "$provisioned" = 0 ] || exit 1
exit "$status"
