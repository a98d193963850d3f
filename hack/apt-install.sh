#!/usr/bin/env bash
# Install Debian packages for the provisioning steps: `hack/apt-install.sh PACKAGE...`.
#
# The steps of `make test` run in two lanes side by side (hack/test.sh), and more than one may need apt:
# every call takes one lock first (flock on /var/lock/kvfleet-apt.lock), so two never race for dpkg's.
# Packages are installed without recommends and without starting their services (a policy-rc.d that
# refuses, removed afterwards when this call created it): the tests start their own containerd,
# Prometheus, ... Needs root, or sudo.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: hack/apt-install.sh PACKAGE..." >&2; exit 2; }
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
lock_dir=/var/lock
[ -w "$lock_dir" ] || lock_dir=${TMPDIR:-/tmp}
exec 9>>"$lock_dir/kvfleet-apt.lock"
flock 9
missing=()
for p in "$@"; do dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p"); done
[ ${#missing[@]} -gt 0 ] || exit 0  # installed by the other lane meanwhile
policy=/usr/sbin/policy-rc.d created=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod +x "$policy" && created=1
fi
trap '[ "$created" = 0 ] || $sudo rm -f "$policy"' EXIT
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
