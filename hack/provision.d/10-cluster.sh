#!/usr/bin/env bash
# lane: build
# what: the local Kubernetes control plane, helm and Prometheus, built from source with Go; Redis (Debian's)
# takes: ~22 min cold on 2 cores, seconds warm
# Provision the real local Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, kwok + stage configs, helm), Prometheus/promtool for the cluster tests and
# redis-server for the gateway replicas' shared store.
# Idempotent: a warm run only checks stamps (seconds). Binaries go to $KVFLEET_CACHE/bin
# (default ~/.cache/kvfleet/bin), never into the repository.
#
# A failure exits non-zero naming what is missing; hack/provision.sh stops its lane there unless the
# caller opted out with KVFLEET_ALLOW_MISSING=1.
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() {
  echo "10-cluster: $* (the control plane, helm and Prometheus/promtool are missing; provision them with" \
    "hack/provision.d/10-cluster.sh)" >&2
  exit 1
}

command -v go >/dev/null || fail "Go (1.26) is required to build the control plane"
hack/build-cluster.sh || fail "hack/build-cluster.sh failed (exit $?)"
