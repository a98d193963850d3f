#!/usr/bin/env bash
# Provision the real node tier of the local cluster (hack/devcluster, `--tier node`) and what runs on it:
#   * Debian's containerd 1.6 + runc, CNI plugins, ipset, conntrack, podman and mmdebstrap (apt);
#   * kubelet and kube-proxy (same wrapper module and version as the control plane), the pause binary,
#     CoreDNS and kube-router, built from the Go module proxy by `hack/build-cluster.sh` (step `node`);
#   * kvfleet's images (`hack/images.sh`: base from Debian's packages, then kvfleet and kvfleet-engine);
#   * the tiny model in $KVFLEET_CACHE/models/tiny-llama (the engine pods read it from a PersistentVolume).
# Idempotent: stamps and content tags make a warm run take seconds. Everything is cached in $KVFLEET_CACHE
# (default ~/.cache/kvfleet): binaries in bin/, images in podman's store and the node's containerd store
# (node/containerd), pip downloads in pip/; nothing goes into the repository.
#
# A failure exits non-zero naming what is missing; hack/test.sh stops there unless the caller opted out
# with KVFLEET_ALLOW_MISSING=1. The node needs root (containerd, the kubelet, iptables).
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() {
  echo "30-node: $* (the real node tier is missing; provision it with hack/provision.d/30-node.sh)" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || fail "root is required (containerd, the kubelet and kube-router change the machine's network)"
command -v go >/dev/null || fail "Go (1.26) is required to build the kubelet, kube-proxy, CoreDNS and kube-router"
start=$SECONDS
if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null; then
  echo "30-node: apt-get install podman mmdebstrap"
  policy=/usr/sbin/policy-rc.d created=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get update -q || fail "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends podman mmdebstrap uidmap ||
    fail "apt-get install podman mmdebstrap failed"
  [ "$created" = 0 ] || rm -f "$policy"
fi
KVFLEET_BUILD_STEPS=node hack/build-cluster.sh || fail "hack/build-cluster.sh (step node) failed (exit $?)"
echo "30-node: node binaries ready ($((SECONDS - start)) s)"
hack/images.sh || fail "hack/images.sh failed (exit $?)"
echo "30-node: images ready ($((SECONDS - start)) s)"
if [ ! -x .venv/bin/python ]; then hack/bootstrap.sh; fi
.venv/bin/python -m kvfleet_runtime engine build-tiny-model || fail "building the tiny model failed"
echo "30-node: done in $((SECONDS - start)) s"
