#!/usr/bin/env bash
# lane: build
# what: the real node: containerd (apt), kubelet, kube-proxy, CoreDNS, kube-router (Go)
# takes: ~11 min cold on 2 cores, seconds warm
# Provision the real node tier of the local cluster (hack/devcluster, `--tier node`):
#   * Debian's containerd 1.6 + runc, CNI plugins, ipset and conntrack (apt);
#   * kubelet and kube-proxy (same wrapper module and version as the control plane), the pause binary,
#     CoreDNS, kube-router and Prometheus with Kubernetes service discovery (prometheus-k8s: Debian's
#     build lacks it), built from the Go module proxy by `hack/build-cluster.sh` (step `node`).
# What runs on the node (kvfleet's images, the tiny model) is provisioned by 40-images.sh.
# Idempotent: stamps make a warm run take seconds. Binaries go to $KVFLEET_CACHE/bin (default
# ~/.cache/kvfleet/bin), never into the repository.
#
# A failure exits non-zero naming what is missing; hack/provision.sh stops its lane there unless the
# caller opted out with KVFLEET_ALLOW_MISSING=1. The node needs root (containerd, the kubelet, iptables).
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() {
  echo "30-node: $* (the real node tier is missing; provision it with hack/provision.d/30-node.sh)" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || fail "root is required (containerd, the kubelet and kube-router change the machine's network)"
command -v go >/dev/null || fail "Go (1.26) is required to build the kubelet, kube-proxy, CoreDNS and kube-router"
start=$SECONDS
KVFLEET_BUILD_STEPS=node hack/build-cluster.sh || fail "hack/build-cluster.sh (step node) failed (exit $?)"
# The last Go build of the lane: its build cache (8 GB) goes (hack/build-cluster.sh: drop-build-cache).
KVFLEET_BUILD_STEPS=drop-build-cache hack/build-cluster.sh || fail "dropping Go's build cache failed (exit $?)"
echo "30-node: node binaries ready ($((SECONDS - start)) s)"
