#!/usr/bin/env bash
# Provision the real local Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, kwok + stage configs, helm) and Prometheus/promtool for the cluster tests.
# Idempotent: a warm run only checks stamps (seconds). Binaries go to $KVFLEET_CACHE/bin
# (default ~/.cache/kvfleet/bin), never into the repository.
#
# With CI=true a failure fails the run; otherwise it is reported and the cluster tests skip, naming the
# missing component and this command.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${CI:-}" in 1 | true | TRUE | True | yes) in_ci=1 ;; *) in_ci=0 ;; esac

fail() {
  echo "10-cluster: $*" >&2
  if [ "$in_ci" = 1 ]; then exit 1; fi
  echo "10-cluster: continuing (not in CI); the cluster tests will skip" >&2
  exit 0
}

command -v go >/dev/null || fail "Go (1.26) is required to build the control plane"
hack/build-cluster.sh || fail "hack/build-cluster.sh failed (exit $?)"
