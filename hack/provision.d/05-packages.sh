#!/usr/bin/env bash
# lane: fetch
# what: the Debian packages of the other steps (podman, containerd, Prometheus, ...), in one apt run
# takes: ~2 min cold on 2 cores, a second warm
# Every Debian package a later step installs (10-cluster: prometheus, redis-server; 30-node: containerd, runc, the CNI
# plugins, ipset, conntrack, iptables; 40-images: podman, mmdebstrap, uidmap), installed in one apt
# transaction at the start of the fetch lane: one `apt-get update`, one dpkg run and one round of
# triggers instead of three, and none of it in the build lane, whose Go builds are the longest path.
# Each later step still installs what it needs itself (hack/apt-install.sh: a no-op when installed), so it
# runs alone as before.
#
# Without root (and without passwordless sudo) nothing is installed here: the steps that need the
# packages say so themselves (the node and the images need root anyway).
set -euo pipefail
cd "$(dirname "$0")/../.."

packages=(prometheus redis-server containerd runc containernetworking-plugins ipset conntrack iptables podman mmdebstrap uidmap)
if [ "$(id -u)" != 0 ] && ! sudo -n true 2>/dev/null; then
  echo "05-packages: not root and no passwordless sudo: installing nothing here (the steps that need" \
    "${packages[*]} say so)"
  exit 0
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
start=$SECONDS
hack/apt-install.sh "${packages[@]}" || {
  echo "05-packages: apt-get install ${packages[*]} failed (provision them with hack/provision.d/05-packages.sh)" >&2
  exit 1
}
# Installed as packages, never started as services: the tests start their own (hack/apt-install.sh
# refuses service starts); a unit an earlier install enabled is stopped here, as the later steps do.
if command -v systemctl >/dev/null; then
  for unit in prometheus redis-server containerd; do
    if systemctl is-active --quiet "$unit" 2>/dev/null; then
      $sudo systemctl stop "$unit" && $sudo systemctl disable "$unit" || true
    fi
  done
fi
echo "05-packages: done in $((SECONDS - start)) s"
