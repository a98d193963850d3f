#!/usr/bin/env bash
# lane: build
# what: KEDA's operator and metrics API server (Go), for the autoscaling tests
# takes: ~9 min cold on an idle 2-core machine (more beside the tests), seconds warm
# Provision KEDA (github.com/kedacore/keda/v2, its operator and metrics API server) from the Go module
# proxy through hack/cluster/keda, plus its CRDs copied from the module (hack/build-cluster.sh, step keda).
# The local cluster starts it only for the tests that scale (hack/devcluster/keda.py; the `keda` fixture).
# After the node's step: only those tests wait for it (tests/provisioning_plugin.py), while the rest run.
# Idempotent: a stamp makes a warm run take seconds. Binaries go to $KVFLEET_CACHE/bin (default
# ~/.cache/kvfleet/bin), never into the repository.
#
# A failure exits non-zero naming what is missing; hack/provision.sh stops its lane there unless the
# caller opted out with KVFLEET_ALLOW_MISSING=1.
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() {
  echo "35-keda: $* (KEDA is missing; provision it with hack/provision.d/35-keda.sh)" >&2
  exit 1
}

command -v go >/dev/null || fail "Go (1.26) is required to build KEDA"
start=$SECONDS
# Niced: under `make test` this build runs beside the tests (on 2 cores), which have engines to start and
# deadlines to meet; the build takes what CPU they leave, and its tests start last (tests/parallel_plugin.py).
# Offline (GOPROXY=off): 25-keda-modules fetched every module before the real node's tests could start;
# a module missing now fails at once, naming it, instead of a download hanging beside those tests.
GOPROXY=off KVFLEET_BUILD_STEPS=keda nice -n 15 hack/build-cluster.sh || fail "hack/build-cluster.sh (step keda) failed (exit $?)"
# The last Go build of the lane now (after 30-node's): its build cache goes too (drop-build-cache).
KVFLEET_BUILD_STEPS=drop-build-cache hack/build-cluster.sh || fail "dropping Go's build cache failed (exit $?)"
echo "35-keda: KEDA ready ($((SECONDS - start)) s)"
