#!/usr/bin/env bash
# The one provisioning driver, for `make test` (hack/test.sh) and `make demo` (hack/demo.sh): runs the steps
# hack/provision.d/*.sh in lanes side by side, each lane's steps in order, and tells where it stands.
#
#   hack/provision.sh [--for NAME] [--also SCRIPT]... [--may-fail STEP]... [--may-fail-note TEXT]
#                     [--skip STEP]... [--failures FILE]
#
#   --for NAME         who runs it, in its messages (`make test`, `make demo`)
#   --also SCRIPT      one more lane beside the steps, e.g. hack/lint.sh; its failure fails the run even
#                      under KVFLEET_ALLOW_MISSING=1 (it provisions nothing a test could skip without)
#   --may-fail STEP    (e.g. 30-node) a failure of that step is reported but fails nothing;
#                      --may-fail-note says what happens instead
#   --skip STEP        (e.g. 35-keda) a step the caller never needs: not run, not listed
#   --failures FILE    every failed step, one per line, for the caller's own report
#
# Lanes: a step names its lane in a `# lane: NAME` line (default `build`): `build` (10-cluster, 30-node: Go
# builds, CPU-bound) and `fetch` (20-engine, 40-images: downloads, pip installs and image builds, mostly
# network and disk). A step says what it does in a `# what:` line and how long it usually takes on a 2-core
# machine like CI's in a `# takes:` line. A `# after: STEP` line (hack/lint.sh: after 20-engine) holds a
# step back until that step of another lane has ended, whatever its result.
#
# Output: one line when a step starts (`==> STEP [lane] what (takes)`) and one when it ends
# (`<== STEP: done in N s` or `<== STEP: failed (exit N) after N s`: benchmarks/ci_cold.py reads both).
# A step's own output (pip, go, apt, podman) goes to $KVFLEET_CACHE/logs/provision/STEP.log (default
# ~/.cache/kvfleet); when a step fails, its log's path and last 30 lines are printed once every lane has
# ended. While steps run: on a terminal, one line rewritten in place (the time so far and what runs); in a
# log (stdout not a terminal, e.g. CI), a progress line every KVFLEET_PROGRESS_INTERVAL seconds (300: a
# cold provisioning of half an hour adds six lines). The steps' own timing lines (`[build-cluster HH:MM:SS]
# GROUP: done in N s`) stay in their logs, where benchmarks/ci_cold.py reads them.
#
# With KVFLEET_PROVISION_STATE set, each step's outcome is written into that folder as it ends: `STEP.done`
# or `STEP.failed` (also for the steps a failure skipped), for whoever waits on a step; a file `quiet`
# there (hack/test.sh, once pytest prints) stops the running clock and its progress lines.
#
# Failures: a lane stops at its first failed step (later steps may need what it makes) unless
# KVFLEET_ALLOW_MISSING=1, which goes on past it; the run waits for every lane, lists each failed step
# with the command that reruns it, and exits 1 (0 under KVFLEET_ALLOW_MISSING=1, unless an --also lane
# failed; a --may-fail step never fails it).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '4,5p' "$0" | sed 's/^# *//' >&2; exit 2; }
who=hack/provision.sh may_fail_note="" failures_out=""
also=() may_fail=() skip=()
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || usage
  case $1 in
    --for) who=$2 ;;
    --also) also+=("$2") ;;
    --may-fail) may_fail+=("$2") ;;
    --may-fail-note) may_fail_note=$2 ;;
    --skip) skip+=("$2") ;;
    --failures) failures_out=$2 ;;
    *) usage ;;
  esac
  shift 2
done

cache=${KVFLEET_CACHE:-$HOME/.cache/kvfleet}
logs=$cache/logs/provision
mkdir -p "$logs"
# What the project keeps on a machine, and needs besides while a cold run provisions (docs/benchmarks.md,
# "Disk": the sizes `du` read of each cache).
DISK_NEED="a new machine needs about 45 GB while it provisions, 30 GB once provisioned"
disk_free() { df -h --output=avail "$cache" | tail -1 | tr -d ' '; }
interval=${KVFLEET_PROGRESS_INTERVAL:-300}
tty=0
[ -t 1 ] && tty=1
state=$(mktemp -d)
if [ -n "${KVFLEET_PROVISION_STATE:-}" ]; then
  mkdir -p "$KVFLEET_PROVISION_STATE"
  rm -f "$KVFLEET_PROVISION_STATE"/*.done "$KVFLEET_PROVISION_STATE"/*.failed "$KVFLEET_PROVISION_STATE/quiet"
fi
started_at=$EPOCHSECONDS

shown() { case $1 in "$HOME"/*) echo "~${1#"$HOME"}" ;; *) echo "$1" ;; esac; }
clock() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }
# Quiet: someone else prints now (hack/test.sh's pytest, started beside the late steps); no running clock.
quiet() { [ -n "${KVFLEET_PROVISION_STATE:-}" ] && [ -e "$KVFLEET_PROVISION_STATE/quiet" ]; }
# One line of the driver's own, whole (on a terminal it first wipes the running clock's line).
say() { if [ "$tty" = 1 ] && ! quiet; then printf '\r\033[K%s\n' "$*"; else printf '%s\n' "$*"; fi; }
field() { sed -n "s/^# $2: *//p" "$1" | head -1; }
lane_of() { sed -n 's/^# lane: *\([a-z]*\).*/\1/p' "$1" | head -1 | grep . || echo "${2:-build}"; }
outcome() {  # step done|failed
  [ -z "${KVFLEET_PROVISION_STATE:-}" ] || touch "$KVFLEET_PROVISION_STATE/$1.$2"
}
is_may_fail() { local s; for s in "${may_fail[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
is_skipped() { local s; for s in "${skip[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

start_line() {  # step lane
  local what takes last="" line seconds
  what=$(field "$1" what) takes=$(field "$1" takes) seconds=$logs/$(basename "$1" .sh).seconds
  [ ! -f "$seconds" ] || last="last time here $(<"$seconds") s"
  line="==> $1 [$2]"
  [ -z "$what" ] || line+=" $what"
  if [ -n "$takes" ] && [ -n "$last" ]; then line+=" ($takes; $last)"
  elif [ -n "$takes$last" ]; then line+=" ($takes$last)"
  fi
  echo "$line"
}

run_lane() {  # lane strict steps... (strict: a failure fails the run even under KVFLEET_ALLOW_MISSING=1)
  local lane=$1 strict=$2 step name log after started status
  shift 2
  for step in "$@"; do
    name=$(basename "$step" .sh)
    log=$logs/$name.log
    after=$(field "$step" after)
    while [ -n "$after" ] && [ -e "$state/planned.$after" ] && [ ! -e "$state/ended.$after" ]; do
      sleep 0.2
    done
    echo "$name $EPOCHSECONDS" >"$state/lane.$lane"
    say "$(start_line "$step" "$lane")"
    started=$SECONDS status=0
    bash "$step" >"$log" 2>&1 </dev/null || status=$?
    touch "$state/ended.$name"
    if [ "$status" = 0 ]; then outcome "$name" "done"; else outcome "$name" failed; fi
    if [ "$status" = 0 ]; then
      echo $((SECONDS - started)) >"$logs/$name.seconds"
      say "<== $step: done in $((SECONDS - started)) s"
      continue
    fi
    say "<== $step: failed (exit $status) after $((SECONDS - started)) s"
    echo "$step" >>"$state/failed"
    if is_may_fail "$name"; then
      echo "$step" >>"$state/tolerated"
      say "    $name failed${may_fail_note:+: $may_fail_note}; its output: $(shown "$log"), ending:"
      say "    | $(tail -n 1 "$log")"
      continue
    fi
    echo "$step" >>"$state/reported"
    say "    its output: $(shown "$log") (the last lines follow when every lane has ended)"
    if [ "$strict" = 0 ] && [ "${KVFLEET_ALLOW_MISSING:-}" = 1 ]; then continue; fi
    echo "$step" >>"$state/fatal"
    break
  done
  rm -f "$state/lane.$lane"
  for step in "$@"; do  # the steps a failure skipped
    name=$(basename "$step" .sh)
    [ ! -e "$state/ended.$name" ] || continue
    touch "$state/ended.$name"
    outcome "$name" failed
    say "    $step: not run (its lane stopped at the failure above)"
  done
}

progress() {  # on a terminal the line rewritten in place every second, else a line every $interval s
  local now line f name since
  while :; do
    sleep "$([ "$tty" = 1 ] && echo 1 || echo "$interval")"
    now=$EPOCHSECONDS line=""
    for f in "$state"/lane.*; do
      [ -e "$f" ] || continue
      read -r name since <"$f" || continue
      line+="${line:+, }$name ($(clock $((now - since))))"
    done
    [ -n "$line" ] || continue
    ! quiet || continue
    line="[$(clock $((now - started_at)))] running: $line"
    if [ "$tty" = 1 ]; then
      printf '\r\033[K%s' "${line:0:$(($(tput cols 2>/dev/null || echo 80) - 1))}"
    else
      echo "$line"
    fi
  done
}

kill_tree() {  # pid: it and every process it started (SIGTERM)
  local child
  for child in $(pgrep -P "$1" || true); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
pids=() clock_pid=""
stop() {
  [ -z "$clock_pid" ] || kill_tree "$clock_pid"  # its sleep too, which holds stdout open
  clock_pid=""
  [ "$tty" = 0 ] || printf '\r\033[K'
}
trap 'stop; rm -rf "$state"' EXIT
# Background lanes ignore SIGINT (no job control): on Ctrl-C or SIGTERM, end them and what they started.
interrupted() {
  local pid
  trap - EXIT
  stop
  for pid in "${pids[@]}"; do kill_tree "$pid"; done
  rm -rf "$state"
  exit 130
}
trap interrupted INT TERM

declare -A lane_steps=()
lanes=() count=0
for step in hack/provision.d/*.sh; do
  [ -e "$step" ] || continue
  ! is_skipped "$(basename "$step" .sh)" || continue
  lane=$(lane_of "$step")
  [ -n "${lane_steps[$lane]:-}" ] || lanes+=("$lane")
  lane_steps[$lane]+="$step "
  touch "$state/planned.$(basename "$step" .sh)"
  count=$((count + 1))
done
summary=""
for lane in "${lanes[@]}"; do
  names=$(for s in ${lane_steps[$lane]}; do basename "$s" .sh; done | paste -sd, - | sed 's/,/, /g')
  summary+="${summary:+; }$lane: $names"
done
extra=""
for script in "${also[@]}"; do
  extra+=", and $(lane_of "$script" "$(basename "$script" .sh)") beside them"
done
say "provisioning: $count steps in ${#lanes[@]} lanes side by side ($summary)$extra;" \
  "each step's output goes to $(shown "$logs")/STEP.log"
say "disk: $(disk_free) free where kvfleet's caches live ($(shown "$cache")); $DISK_NEED"
for lane in "${lanes[@]}"; do
  # shellcheck disable=SC2086  # step paths have no spaces
  run_lane "$lane" 0 ${lane_steps[$lane]} &
  pids+=($!)
done
for script in "${also[@]}"; do
  run_lane "$(lane_of "$script" "$(basename "$script" .sh)")" 1 "$script" &
  pids+=($!)
done
# Its stderr nowhere: stopping it kills its sleep first, and bash would report that as "Terminated".
progress 2>/dev/null &
clock_pid=$!
for pid in "${pids[@]}"; do wait "$pid" || true; done
stop

touch "$state/failed" "$state/reported" "$state/fatal" "$state/tolerated"
[ -z "$failures_out" ] || cp "$state/failed" "$failures_out"
mapfile -t reported <"$state/reported"
for step in "${reported[@]}"; do
  log=$logs/$(basename "$step" .sh).log
  {
    echo "$who: $step failed; the last 30 lines of its output ($(shown "$log")):"
    tail -n 30 "$log" | sed 's/^/    | /'
    if grep -q 'No space left on device' "$log"; then
      echo "$who: the disk is full ($(disk_free) free now where the caches live, $(shown "$cache")):" \
        "$DISK_NEED. Free some room, or point KVFLEET_CACHE at a bigger disk."
    fi
    if grep -qxF "$step" "$state/fatal"; then
      echo "$who: fix that and rerun, or run 'bash $step' alone."
    else
      echo "$who: continuing without it because KVFLEET_ALLOW_MISSING=1."
    fi
  } >&2
done
elapsed=$(clock $((EPOCHSECONDS - started_at)))
if [ -s "$state/fatal" ]; then
  say "provisioning failed after $elapsed: $(paste -sd' ' "$state/fatal")" >&2
  exit 1
fi
without=$(cat "$state/reported" "$state/tolerated" | paste -sd' ' -)
say "provisioning: done in $elapsed${without:+ (without $without)}"
