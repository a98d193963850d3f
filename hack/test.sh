#!/usr/bin/env bash
# The whole test suite: provisions every real component the tests need, then runs all tests.
# This is the README's test command (`make test`) and the only thing .ci/run calls.
#
# A real component that cannot be provisioned fails the run, naming the step that provisions it; the tests
# fail the same way for a component that is absent (tests/conftest.py: missing_component). The only way to
# run without one is to say so: KVFLEET_ALLOW_MISSING=1 continues past a failed step and lets the tests
# that need its component skip (`make unit` runs only the unit tests that way). CI never sets it.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/bootstrap.sh

# The provisioning steps run in two lanes side by side, each lane's steps in order: `build` (the Go
# builds of the control plane and the node, CPU-bound) and `fetch` (downloads, pip installs and image
# builds, mostly network- and disk-bound). A step names its lane in a `# lane: NAME` line (default
# `build`). Each line of a step's output carries its lane; `==> STEP` and `<== STEP: ...` frame it.
lane_of() { sed -n 's/^# lane: *\([a-z]*\).*/\1/p' "$1" | head -1 | grep . || echo build; }
run_lane() {  # lane steps... ; writes each failed step to $failures
  local lane=$1 step started status; shift
  for step in "$@"; do
    echo "==> $step"
    started=$SECONDS status=0
    bash "$step" 2>&1 | sed -u "s/^/[$lane] /" || status=${PIPESTATUS[0]}
    if [ "$status" = 0 ]; then
      echo "<== $step: done in $((SECONDS - started)) s"
      continue
    fi
    echo "<== $step: failed (exit $status) after $((SECONDS - started)) s"
    echo "$step" >>"$failures"
    # A lane stops at its first failure unless the caller opted out: later steps may need what it makes.
    [ "${KVFLEET_ALLOW_MISSING:-}" = 1 ] || return 1
  done
}
failures=$(mktemp)
trap 'rm -f "$failures"' EXIT
declare -A lane_steps=()
for step in hack/provision.d/*.sh; do
  [ -e "$step" ] || continue
  lane=$(lane_of "$step")
  lane_steps[$lane]+="$step "
done
pids=()
for lane in "${!lane_steps[@]}"; do
  # shellcheck disable=SC2086  # step paths have no spaces
  run_lane "$lane" ${lane_steps[$lane]} &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || true; done
mapfile -t failed_steps <"$failures"
if [ ${#failed_steps[@]} -gt 0 ] && [ "${KVFLEET_ALLOW_MISSING:-}" != 1 ]; then
  for step in "${failed_steps[@]}"; do
    echo "make test: $step failed: the tests need what it provisions (see its message above)." >&2
    echo "make test: fix that and rerun (or run 'bash $step' alone); KVFLEET_ALLOW_MISSING=1 make test" \
      "runs without it, skipping the tests that need it." >&2
  done
  exit 1
fi
for step in "${failed_steps[@]}"; do
  echo "make test: $step failed; continuing because KVFLEET_ALLOW_MISSING=1 (the tests that need it skip)" >&2
done
echo "==> ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "==> mypy --strict"
.venv/bin/mypy
echo "==> import contracts (pyproject.toml [tool.importlinter])"
.venv/bin/lint-imports
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
