#!/usr/bin/env bash
# lane: fetch
# what: kvfleet's two images (podman), loaded into the node's containerd
# takes: ~17 min cold on 2 cores, seconds warm
# Provision what runs on the real node tier:
#   * podman and mmdebstrap (apt), then kvfleet's images (`hack/images.sh`: base from Debian's packages,
#     then kvfleet and kvfleet-engine), imported into the real node's containerd store ahead of its first
#     start (`python -m devcluster preload-images`; Debian's containerd, apt): minutes for the 7 GB engine
#     image, spent here while the build lane still compiles rather than in the tests;
#   * the tiny model in $KVFLEET_CACHE/models/tiny-llama (the engine pods read it from a PersistentVolume).
# Idempotent: content tags make a warm run take seconds. Images live in podman's store, pip downloads in
# $KVFLEET_CACHE/pip (default ~/.cache/kvfleet/pip); nothing goes into the repository.
#
# A failure exits non-zero naming what is missing; hack/provision.sh stops its lane there unless the
# caller opted out with KVFLEET_ALLOW_MISSING=1. podman builds as root here.
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() {
  echo "40-images: $* (kvfleet's images are missing; provision them with hack/provision.d/40-images.sh)" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || fail "root is required (podman builds and mmdebstrap --mode=root)"
start=$SECONDS
# A no-op when installed (hack/apt-install.sh checks each package first).
hack/apt-install.sh podman mmdebstrap uidmap containerd runc || fail "apt-get install podman mmdebstrap containerd failed"
hack/images.sh || fail "hack/images.sh failed (exit $?)"
echo "40-images: images ready ($((SECONDS - start)) s)"
if [ ! -x .venv/bin/python ]; then hack/bootstrap.sh; fi
.venv/bin/python -m kvfleet_runtime engine build-tiny-model || fail "building the tiny model failed"
PYTHONPATH=hack .venv/bin/python -m devcluster preload-images || fail "importing the images into the node's containerd failed"
echo "40-images: done in $((SECONDS - start)) s"
