#!/usr/bin/env bash
# Build kvfleet's container images with podman, from Debian's packages and PyPI only (no registry needed).
#
#   hack/images.sh                 base + kvfleet + engine (what `make images` runs; idempotent)
#   hack/images.sh kvfleet         only some of: base kvfleet engine
#   hack/images.sh --print         print "<name> <ref>" for each image as it would be tagged, build nothing
#   hack/images.sh --check-gpu-file  also build images/engine/Dockerfile.gpu on top of the CPU engine image
#                                  (proves the GPU flavour's build file still builds; the image is discarded)
#
# 1. base: a Debian bookworm root filesystem (mmdebstrap --variant=essential + images/base/packages.txt:
#    python3 3.11, python3-venv, no compilers), imported into podman as localhost/kvfleet-base:<hash>.
# 2. kvfleet (images/kvfleet/Dockerfile) and kvfleet-engine (images/engine/Dockerfile, CPU flavour),
#    multi-stage builds on that base.
#
# Tags come from the content: <version>-<hash of every input> (base, Dockerfile, the files copied in), e.g.
# ghcr.io/kvfleet/kvfleet:0.1.0-3f2a9c1d0b4e. Each image is also tagged <version> (0.1.0): the chart's
# default, so `helm install` with default values runs exactly what this script built. An image whose
# content tag exists already is not rebuilt; its earlier builds (other content tags) are removed. pip's
# downloads are cached across builds in $KVFLEET_CACHE/pip (default ~/.cache/kvfleet/pip), the base
# tarball in $KVFLEET_CACHE/images.
# Each build appends {"image", "seconds", "pip_cache_mb_before", ...} to $KVFLEET_CACHE/images/builds.jsonl
# and the refs built are written to $KVFLEET_CACHE/images/images.json (read by the real node tier).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
CACHE=${KVFLEET_CACHE:-$HOME/.cache/kvfleet}
IMAGES_CACHE=$CACHE/images
PIP_CACHE=$CACHE/pip
REGISTRY=${KVFLEET_IMAGE_REGISTRY:-ghcr.io/kvfleet}
SUITE=bookworm
MIRROR=${KVFLEET_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${KVFLEET_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# podman's default rlimits exceed this machine's hard limits (nofile 20,000); these fit everywhere.
ULIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
# Where egress goes through a TLS-inspecting proxy, pip inside the build needs the host's CA bundle: it is
# mounted for RUN steps only (build argument PIP_CERT), never copied into an image.
CA_BUNDLE=${KVFLEET_BUILD_CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
BUILD_MOUNTS=(-v "$PIP_CACHE:/var/cache/kvfleet-pip")
[ -f "$CA_BUNDLE" ] && BUILD_MOUNTS+=(-v "$CA_BUNDLE:/run/kvfleet-build/ca.crt:ro" --build-arg PIP_CERT=/run/kvfleet-build/ca.crt)

log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { echo "images: $*" >&2; exit 1; }

print_only=0 check_gpu=0 targets=()
for arg in "$@"; do
  case $arg in
    --print) print_only=1 ;;
    --check-gpu-file) check_gpu=1 ;;
    base | kvfleet | engine) targets+=("$arg") ;;
    -h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $arg (see --help)" ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(base kvfleet engine)

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
[ -n "$VERSION" ] || die "no version in pyproject.toml"

sha() { sha256sum | cut -c1-12; }

# The base: its tag hashes the package list and the exact mmdebstrap invocation.
base_packages() { sed 's/#.*//' images/base/packages.txt | tr -s ' \t' '\n' | sed '/^$/d' | sort -u | paste -sd, -; }
mmdebstrap_args() {
  printf '%s\n' --variant=essential --mode=root --format=tar "--include=$(base_packages)" \
    --dpkgopt=path-exclude=/usr/share/doc/* --dpkgopt=path-exclude=/usr/share/man/* \
    --dpkgopt=path-exclude=/usr/share/locale/* --dpkgopt=path-include=/usr/share/doc/*/copyright \
    "--customize-hook=rm -rf \"\$1\"/var/cache/apt/* \"\$1\"/var/lib/apt/lists/* \"\$1\"/var/log/*"
}
BASE_HASH=$({ mmdebstrap_args; echo "$SUITE $MIRROR $SECURITY_MIRROR"; } | sha)
BASE_REF=localhost/kvfleet-base:$SUITE-$BASE_HASH

# Exactly what an image's build context holds: these paths, as git sees them (tracked plus untracked files
# that are not ignored), so a clean clone and a working tree with the same files hash the same.
CONTEXT_PATHS=(pyproject.toml README.md images/requirements.py runtime operator)
context_files() { git ls-files -co --exclude-standard -- "${CONTEXT_PATHS[@]}" | sort -u; }
inputs_hash() {  # $1: Dockerfile
  { echo "$BASE_REF"; echo "$1"; sha256sum "$1"; context_files | while read -r f; do
      [ -f "$f" ] && sha256sum "$f"; done; } | sha256sum | cut -d' ' -f1
}

image_ref() {  # name dockerfile -> <registry>/<name>:<version>-<hash12>
  local h
  h=$(inputs_hash "$2")
  echo "$REGISTRY/$1:$VERSION-${h:0:12}"
}

declare -A DOCKERFILE=([kvfleet]=images/kvfleet/Dockerfile [engine]=images/engine/Dockerfile)
declare -A REPO_NAME=([kvfleet]=kvfleet [engine]=kvfleet-engine)
# The content ref each image got in this run (the tree may change while a long build runs).
declare -A BUILT_REF=()

if [ "$print_only" = 1 ]; then
  echo "base $BASE_REF"
  for t in kvfleet engine; do echo "$t $(image_ref "${REPO_NAME[$t]}" "${DOCKERFILE[$t]}")"; done
  exit 0
fi

command -v podman >/dev/null || die "podman is missing: apt-get install podman mmdebstrap"
command -v mmdebstrap >/dev/null || die "mmdebstrap is missing: apt-get install mmdebstrap"
mkdir -p "$IMAGES_CACHE" "$PIP_CACHE"

exists() { podman image exists "$1"; }
mb() { du -sm "$1" 2>/dev/null | cut -f1; }
record() {  # image ref seconds cached pip-cache-MB-before
  printf '{"image": "%s", "ref": "%s", "seconds": %s, "cached": %s, "pip_cache_mb_before": %s, "pip_cache_mb": %s, "date": "%s"}\n' \
    "$1" "$2" "$3" "$4" "$5" "$(mb "$PIP_CACHE")" "$(date -u +%FT%TZ)" >>"$IMAGES_CACHE/builds.jsonl"
}

build_base() {
  if exists "$BASE_REF"; then
    log "base: $BASE_REF exists"
    return
  fi
  local tarball=$IMAGES_CACHE/base-$SUITE-$BASE_HASH.tar start=$SECONDS pip_before
  pip_before=$(mb "$PIP_CACHE")
  if [ ! -s "$tarball" ]; then
    log "base: mmdebstrap $SUITE ($(base_packages))"
    local args
    mapfile -t args < <(mmdebstrap_args)
    mmdebstrap "${args[@]}" "$SUITE" "$tarball.tmp" \
      "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY_MIRROR $SUITE-security main"
    mv "$tarball.tmp" "$tarball"
  fi
  log "base: podman import -> $BASE_REF"
  podman import --quiet \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
    --message "Debian $SUITE essential + $(base_packages)" "$tarball" "$BASE_REF" >/dev/null
  podman tag "$BASE_REF" localhost/kvfleet-base:latest
  log "base: done in $((SECONDS - start)) s"
  record base "$BASE_REF" $((SECONDS - start)) false "$pip_before"
}

# Copy exactly the context files into a fresh folder: the build sees nothing else (no .venv, no caches).
stage_context() {
  local dir=$1
  rm -rf "$dir" && mkdir -p "$dir"
  context_files | while read -r f; do [ -f "$f" ] && install -D -m 0644 "$f" "$dir/$f"; done
  install -D -m 0644 images/kvfleet/Dockerfile "$dir/images/kvfleet/Dockerfile"
  install -D -m 0644 images/engine/Dockerfile "$dir/images/engine/Dockerfile"
  install -D -m 0644 images/engine/Dockerfile.gpu "$dir/images/engine/Dockerfile.gpu"
  # Each image's dependency list, resolved here from pyproject.toml's extras: the deps stages COPY these
  # lists, not pyproject.toml, so a change elsewhere in it (a dev tool, a test setting) keeps podman's
  # cached deps layers (the engine's is 6.5 GB and takes minutes to build and to import into the node).
  local py=python3 extra
  [ ! -x .venv/bin/python ] || py=.venv/bin/python
  for extra in operator engine; do
    "$py" images/requirements.py project pyproject.toml "$extra" >"$dir/images/requirements-$extra.txt"
  done
}

# Earlier builds of an image (its other content tags) leave podman's store: each engine build that changed
# its dependencies holds 7 GB. Shared layers stay while the current build uses them.
drop_earlier_builds() {  # name current-ref
  local name=$1 current=$2 ref
  podman images --format '{{.Repository}}:{{.Tag}}' "$REGISTRY/$name" | while read -r ref; do
    case $ref in
      "$current" | "$REGISTRY/$name:$VERSION") ;;
      "$REGISTRY/$name:$VERSION-"*)
        if podman rmi "$ref" >/dev/null 2>&1; then log "$name: dropped $ref (an earlier build)"
        else log "$name: kept $ref (an earlier build still in use: podman rmi $ref)"; fi ;;
    esac
  done
}

build_image() {  # kvfleet|engine
  local t=$1 name=${REPO_NAME[$1]} file=${DOCKERFILE[$1]} ref hash start=$SECONDS pip_before
  pip_before=$(mb "$PIP_CACHE")
  exists "$BASE_REF" || die "base image $BASE_REF missing: hack/images.sh base"
  hash=$(inputs_hash "$file")
  ref=$REGISTRY/$name:$VERSION-${hash:0:12}
  if exists "$ref"; then
    log "$t: $ref exists (inputs unchanged)"
    podman tag "$ref" "$REGISTRY/$name:$VERSION"
    record "$t" "$ref" 0 true "$pip_before"
    BUILT_REF[$t]=$ref
    return
  fi
  local ctx=$IMAGES_CACHE/context-$t
  stage_context "$ctx"
  log "$t: podman build -f $file -> $ref (pip cache $PIP_CACHE: $(mb "$PIP_CACHE") MB)"
  podman build "${ULIMITS[@]}" --layers --format oci \
    "${BUILD_MOUNTS[@]}" --build-arg "BASE_IMAGE=$BASE_REF" --build-arg "VERSION=$VERSION" --build-arg "INPUTS_SHA256=$hash" \
    -f "$ctx/$file" -t "$ref" -t "$REGISTRY/$name:$VERSION" "$ctx"
  log "$t: done in $((SECONDS - start)) s; $(podman image inspect --format '{{.Size}}' "$ref" | numfmt --to=iec) "
  record "$t" "$ref" $((SECONDS - start)) false "$pip_before"
  BUILT_REF[$t]=$ref
}

check_gpu_file() {
  local engine_ref ctx=$IMAGES_CACHE/context-engine start=$SECONDS
  engine_ref=$(image_ref kvfleet-engine images/engine/Dockerfile)
  exists "$engine_ref" || die "build the CPU engine image first"
  stage_context "$ctx"
  log "gpu file: podman build -f images/engine/Dockerfile.gpu --build-arg BASE_IMAGE=$engine_ref"
  podman build "${ULIMITS[@]}" --layers "${BUILD_MOUNTS[@]}" \
    --build-arg "BASE_IMAGE=$engine_ref" --build-arg "VERSION=$VERSION" \
    -f "$ctx/images/engine/Dockerfile.gpu" -t localhost/kvfleet-engine-gpu-check:latest "$ctx"
  podman rmi localhost/kvfleet-engine-gpu-check:latest >/dev/null
  log "gpu file: builds ($((SECONDS - start)) s)"
}

total=$SECONDS
for t in "${targets[@]}"; do
  case $t in
    base) build_base ;;
    *) build_base; build_image "$t"; drop_earlier_builds "${REPO_NAME[$t]}" "${BUILT_REF[$t]}" ;;
  esac
done
[ "$check_gpu" = 0 ] || check_gpu_file

# What was built, for the node tier and the tests: name -> content ref, version ref, size. Images not
# built in this run keep their entry from the previous images.json when it still exists.
previous=$IMAGES_CACHE/images.json
for t in kvfleet engine; do
  if [ -z "${BUILT_REF[$t]:-}" ] && [ -f "$previous" ]; then
    old=$(jq -r --arg t "$t" '.[$t].ref // empty' "$previous")
    [ -n "$old" ] && exists "$old" && BUILT_REF[$t]=$old
  fi
done
{
  echo "{"
  sep=""
  for t in kvfleet engine; do
    ref=${BUILT_REF[$t]:-}
    [ -n "$ref" ] || continue
    printf '%s  "%s": {"ref": "%s", "version_ref": "%s", "id": "%s", "size_bytes": %s}' "$sep" "$t" "$ref" \
      "$REGISTRY/${REPO_NAME[$t]}:$VERSION" "$(podman image inspect --format '{{.Id}}' "$ref")" \
      "$(podman image inspect --format '{{.Size}}' "$ref")"
    sep=$',\n'
  done
  printf '%s  "base": {"ref": "%s"}\n}\n' "$sep" "$BASE_REF"
} >"$IMAGES_CACHE/images.json.tmp"
mv "$IMAGES_CACHE/images.json.tmp" "$IMAGES_CACHE/images.json"
log "all done in $((SECONDS - total)) s; refs in $IMAGES_CACHE/images.json"
