#!/usr/bin/env bash
# lane: build
# what: KEDA's Go modules (about 1.7 GB from the Go module proxy), before the real node's tests start
# takes: ~15 s on a fast link, seconds warm
# Download every module the KEDA build (35-keda.sh) reads into Go's module cache (hack/build-cluster.sh,
# step keda-modules). It runs after 10-cluster and before 30-node in the build lane, so no download is in
# flight while the real node's tests (which wait for 30-node) run the kubelet, kube-proxy and kube-router
# and change the machine's network; 35-keda then builds with GOPROXY=off, beside the tests, offline.
# Idempotent: a warm run reads the module cache and takes seconds. `make demo` skips it (as it skips 35-keda).
#
# A failure exits non-zero naming what is missing; hack/provision.sh stops its lane there unless the
# caller opted out with KVFLEET_ALLOW_MISSING=1.
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() {
  echo "25-keda-modules: $* (KEDA is missing; provision it with hack/provision.d/25-keda-modules.sh)" >&2
  exit 1
}

command -v go >/dev/null || fail "Go (1.26) is required to fetch KEDA's modules"
start=$SECONDS
KVFLEET_BUILD_STEPS=keda-modules hack/build-cluster.sh || fail "hack/build-cluster.sh (step keda-modules) failed (exit $?)"
echo "25-keda-modules: KEDA's modules cached ($((SECONDS - start)) s)"
