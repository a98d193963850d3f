#!/usr/bin/env bash
# Build the Gateway API Inference Extension's lightweight Endpoint Picker (cmd/lwepp, Go) for the gateway
# benchmark's `--gie-epp` row, from the Go module proxy at an exact version, outside the repository.
#
#   benchmarks/gateway/setup-bench-lwepp.sh           build unless this version is already there
#   benchmarks/gateway/setup-bench-lwepp.sh --force   rebuild
#
# Output: $KVFLEET_CACHE/bench-bin/gie-<version>/ (default ~/.cache/kvfleet): `lwepp` and the InferencePool
# CRD of the same release (inference.networking.k8s.io_inferencepools.yaml), which bench.py installs on its
# local API server. bench.py reads GIE_LWEPP_VERSION from this file.
#
# Why v1.6.0 and not hack/build-cluster.sh's GIE_VERSION (v1.5.0, for the InferencePool CRD the cluster
# tests install): cmd/lwepp first ships in v1.6.0 (v1.5.0 has only the full EPP, cmd/epp, which v1.6.0
# moved out to llm-d). The InferencePool API both serve is the same inference.networking.k8s.io/v1.
#
# Not `go install ...@version`: it also asks the proxy for the module's version list (to report a
# deprecation), which the proxy here refuses. Instead the module of that exact version is downloaded and its
# main package built inside it, with the release's own go.mod and go.sum (GOWORK=off: the module's go.work
# names a folder its module zip does not hold), which is what `go install pkg@version` builds too.
set -euo pipefail

GIE_LWEPP_VERSION=v1.6.0
MODULE=sigs.k8s.io/gateway-api-inference-extension
CACHE=${KVFLEET_CACHE:-$HOME/.cache/kvfleet}
OUT=$CACHE/bench-bin/gie-$GIE_LWEPP_VERSION
CRD=inference.networking.k8s.io_inferencepools.yaml

if [ "${1:-}" != "--force" ] && [ -x "$OUT/lwepp" ] && [ -f "$OUT/$CRD" ]; then
  echo "lwepp $GIE_LWEPP_VERSION already built: $OUT/lwepp"
  exit 0
fi
command -v go >/dev/null || { echo "go not found: lwepp is built with the Go toolchain" >&2; exit 1; }

started=$(date +%s)
info=$(go mod download -json "$MODULE@$GIE_LWEPP_VERSION")
src=$(jq -r '.Dir' <<<"$info")
commit=$(jq -r '.Origin.Hash // "unknown"' <<<"$info")
mkdir -p "$OUT"
tmp=$(mktemp -d "$OUT/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# The release's own build stamps (its Dockerfile sets the same two variables).
ldflags="-X $MODULE/version.CommitSHA=$commit -X $MODULE/version.BuildRef=$GIE_LWEPP_VERSION"
(cd "$src" && GOWORK=off GOFLAGS=-buildvcs=false go build -trimpath -ldflags "$ldflags" -o "$tmp/lwepp" ./cmd/lwepp)
install -m 0644 "$src/config/crd/bases/$CRD" "$tmp/$CRD"
mv -f "$tmp/lwepp" "$OUT/lwepp"
mv -f "$tmp/$CRD" "$OUT/$CRD"
echo "lwepp $GIE_LWEPP_VERSION (commit $commit) built in $(($(date +%s) - started)) s: $OUT/lwepp"
