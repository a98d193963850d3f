#!/usr/bin/env bash
# Build the pinned real Kubernetes control plane for tests and the demo into a cache outside the repo.
#
#   hack/build-cluster.sh            build whatever is missing or out of date (idempotent; warm run ~seconds)
#   hack/build-cluster.sh --force    rebuild everything
#   KVFLEET_BUILD_STEPS="node drop-build-cache" hack/build-cluster.sh   some steps (the list is at the end)
#
# Output: $KVFLEET_CACHE/bin (default ~/.cache/kvfleet/bin): kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, kwok, helm; $KVFLEET_CACHE/gateway-api: the Gateway API's standard CRDs
# (HTTPRoute for the exposure tests); $KVFLEET_CACHE/gateway-api-inference-extension: GIE's InferencePool
# CRD (the InferencePool tests); $KVFLEET_CACHE/kwok-stages: kwok's stage configs copied from
# its module; prometheus and promtool come from Debian's `prometheus` package (apt).
#
# The real node (step `node`, run by hack/provision.d/30-node.sh, not by default): kubelet and kube-proxy
# (same wrapper module and version as the control plane), pause (the pod sandbox, hack/cluster/pause),
# coredns (hack/cluster/coredns: CoreDNS with the plugins a cluster DNS needs), kube-router (its
# NetworkPolicy firewall), prometheus-k8s and promtool-k8s (hack/cluster/prometheus: Prometheus with
# Kubernetes service discovery, which Debian's build lacks), plus Debian's containerd, runc, CNI plugins,
# ipset and conntrack (apt).
#
# KEDA (steps `keda-modules` and `keda`, run by hack/provision.d/25-keda-modules.sh and 35-keda.sh, not by
# default): keda-operator and keda-adapter (its metrics API server) from hack/cluster/keda, and its CRDs in
# $KVFLEET_CACHE/keda-crds, for the autoscaling tests (hack/devcluster/keda.py starts them on demand).
#
# Every Go binary is built through the Go module proxy from a small wrapper module under hack/cluster/.
# The k8s.io/* staging modules that k8s.io/kubernetes replaces with ./staging paths are read from that
# release's own go.mod and replaced by their published v0.X.Y tags in hack/cluster/kubernetes/go.mod.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KVFLEET_CACHE:-$HOME/.cache/kvfleet}
BIN=$CACHE/bin
STAMPS=$CACHE/stamps
JOBS=${KVFLEET_BUILD_JOBS:-2}

# Pinned versions (newest served by the Go proxy that build with Go 1.26 when this was written).
K8S_VERSION=v1.37.2
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0
COREDNS_VERSION=v1.15.0
KUBE_ROUTER_VERSION=v2.1.0
# Prometheus 3.x's Go module (v0.316.0 = Prometheus 3.6-era), built with only Kubernetes service discovery:
# Debian's package (2.42) is built without it, and the node tier's scrape test discovers pods.
PROMETHEUS_MODULE_VERSION=v0.316.0
# The Gateway API release whose standard CRDs (config/crd/standard in its Go module; v1.7 needs Go 1.27) the
# exposure tests install: they create HTTPRoutes on the real API server with the real CRD's validation.
GATEWAY_API_VERSION=v1.6.3
# The Gateway API Inference Extension release whose InferencePool CRD (inference.networking.k8s.io/v1, in its
# Go module's config/crd/bases) the InferencePool tests install; an exact version (the proxy refuses @latest).
GIE_VERSION=v1.5.0
# KEDA (operator + metrics API server) for the autoscaling tests (step `keda`): ScaledObjects drive the
# HPA of kube-controller-manager through external.metrics.k8s.io.
KEDA_VERSION=v2.21.0

FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

mkdir -p "$BIN" "$STAMPS"
export GOFLAGS="-buildvcs=false"
# kvfleet's own Go build cache, not the user's: 8 GB once every binary is built, and a warm run builds
# nothing, so the step drop-build-cache (the last of 30-node.sh) deletes it. A later rebuild (a version
# bump) starts from an empty cache, as on a new machine. Go's module cache stays where Go keeps it: warm
# runs read modules from it (module_commit, module_dir), 4 GB.
export GOCACHE=$CACHE/go-build

log() { printf '[build-cluster %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# The fingerprint of one build: inputs that change the binary. A matching stamp + present binaries = skip.
fingerprint() {
  local dir=$1 ldflags=$2
  { go version; echo "$ldflags"; cat "$dir"/go.mod; cat "$dir"/go.sum 2>/dev/null || true
    cat "$dir"/*.go 2>/dev/null || true; } |
    sha256sum | cut -d' ' -f1
}

up_to_date() {
  local name=$1 fp=$2; shift 2
  [ "$FORCE" = 0 ] || return 1
  [ -f "$STAMPS/$name" ] && [ "$(cat "$STAMPS/$name")" = "$fp" ] || return 1
  local b
  for b in "$@"; do [ -x "$BIN/$b" ] || return 1; done
}

# The VCS commit the proxy recorded for a module version (empty when it has none).
module_commit() {
  go mod download -json "$1" | jq -r '.Origin.Hash // ""'
}

module_dir() {
  go mod download -json "$1" | jq -r '.Dir'
}

# go build several main packages of one wrapper module into $BIN.
build_group() {
  local name=$1 dir=$2 ldflags=$3; shift 3
  local pkgs=("$@") bins=() p
  for p in "${pkgs[@]}"; do bins+=("$(basename "$p")"); done
  local fp
  fp=$(fingerprint "$dir" "$ldflags")
  if up_to_date "$name" "$fp" "${bins[@]}"; then
    log "$name: up to date (${bins[*]})"
    return
  fi
  log "$name: building ${bins[*]} (go build -p $JOBS; this is slow on a cold cache)"
  local start=$SECONDS
  (cd "$dir" && go build -p "$JOBS" -trimpath -ldflags "-s -w $ldflags" -o "$BIN/" "${pkgs[@]}")
  echo "$fp" > "$STAMPS/$name"
  log "$name: done in $((SECONDS - start)) s"
}

# Make hack/cluster/kubernetes/go.mod require k8s.io/kubernetes@$K8S_VERSION and replace every staging
# module listed in that release's go.mod with its published tag. Runs `go mod tidy` only on change.
sync_kubernetes_module() {
  local dir=$ROOT/hack/cluster/kubernetes
  local gomod staging_version
  log "kubernetes: reading staging modules from k8s.io/kubernetes@$K8S_VERSION's go.mod"
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | jq -r '.GoMod')
  # v1.37.2 -> v0.37.2: staging modules are tagged v0.<minor>.<patch> alongside each release.
  staging_version="v0.${K8S_VERSION#v1.}"
  mapfile -t staging < <(go mod edit -json "$gomod" |
    jq -r '.Replace[] | select(.New.Path | startswith("./staging/")) | .Old.Path')
  log "kubernetes: ${#staging[@]} staging modules -> $staging_version"
  local before after args=()
  before=$(cat "$dir/go.mod" 2>/dev/null || true)
  [ -f "$dir/go.mod" ] || (cd "$dir" && go mod init kvfleet.dev/hack/cluster/kubernetes >/dev/null 2>&1)
  args+=("-go=1.26.0" "-require=k8s.io/kubernetes@$K8S_VERSION")
  local m
  for m in "${staging[@]}"; do args+=("-replace=$m=$m@$staging_version"); done
  for m in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do
    args+=("-tool=k8s.io/kubernetes/cmd/$m")
  done
  (cd "$dir" && go mod edit "${args[@]}")
  after=$(cat "$dir/go.mod")
  if [ "$before" != "$after" ] || [ ! -f "$dir/go.sum" ]; then
    log "kubernetes: go.mod changed; go mod tidy (downloads the dependency graph)"
    (cd "$dir" && go mod tidy)
  fi
}

# Same for a plain wrapper module: require one module at a version (+ optional tool packages, and go mod edit
# flags such as -replace=… or -exclude=… given as they are), tidy on change.
sync_module() {
  local dir=$1 module=$2 version=$3; shift 3
  local before after args=("-go=1.26.0" "-require=$module@$version") t
  before=$(cat "$dir/go.mod" 2>/dev/null || true)
  [ -f "$dir/go.mod" ] || (cd "$dir" && go mod init "kvfleet.dev/hack/cluster/$(basename "$dir")" >/dev/null 2>&1)
  for t in "$@"; do
    case $t in -*) args+=("$t") ;; *) args+=("-tool=$t") ;; esac
  done
  (cd "$dir" && go mod edit "${args[@]}")
  after=$(cat "$dir/go.mod")
  if [ "$before" != "$after" ] || [ ! -f "$dir/go.sum" ]; then
    log "$(basename "$dir"): go.mod changed; go mod tidy"
    (cd "$dir" && go mod tidy)
  fi
}

build_etcd() {
  local dir=$ROOT/hack/cluster/etcd
  sync_module "$dir" go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
  local commit
  commit=$(module_commit "go.etcd.io/etcd/server/v3@$ETCD_VERSION")
  # etcd reports its version from api/version.Version (a constant); GitSHA is the only ldflag it reads.
  build_group etcd "$dir" "-X go.etcd.io/etcd/api/v3/version.GitSHA=${commit:0:7}" kvfleet.dev/hack/cluster/etcd
}

# The same ldflags as kubernetes' hack/lib/version.sh (kube::version::ldflags).
kubernetes_ldflags() {
  local commit minor info date ldflags="" pkg
  commit=$(module_commit "k8s.io/kubernetes@$K8S_VERSION")
  info=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION")
  date=$(echo "$info" | jq -r '.Time')
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitCommit=$commit -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
  done
  echo "$ldflags"
}

build_kubernetes() {
  local dir=$ROOT/hack/cluster/kubernetes ldflags
  sync_kubernetes_module
  ldflags=$(kubernetes_ldflags)
  build_group kubernetes "$dir" "$ldflags" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
}

# kubelet and kube-proxy: the same module, version and ldflags as the control plane (one go.mod lists them
# as tools), in their own group so the control plane is not relinked when only these are missing.
build_kubelet() {
  local dir=$ROOT/hack/cluster/kubernetes ldflags
  sync_kubernetes_module
  ldflags=$(kubernetes_ldflags)
  build_group kubernetes-node "$dir" "$ldflags" k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
}

# The pod sandbox binary; hack/devcluster packs it into the image containerd's sandbox_image names.
build_pause() {
  CGO_ENABLED=0 build_group pause "$ROOT/hack/cluster/pause" "" kvfleet.dev/hack/cluster/pause
}

build_coredns() {
  local dir=$ROOT/hack/cluster/coredns commit
  sync_module "$dir" github.com/coredns/coredns "$COREDNS_VERSION"
  commit=$(module_commit "github.com/coredns/coredns@$COREDNS_VERSION")
  # coredns' Makefile stamps the commit the same way.
  build_group coredns "$dir" "-X github.com/coredns/coredns/coremain.GitCommit=${commit:0:7}" \
    kvfleet.dev/hack/cluster/coredns
}

build_kube_router() {
  local dir=$ROOT/hack/cluster/kube-router
  sync_module "$dir" github.com/cloudnativelabs/kube-router/v2 "$KUBE_ROUTER_VERSION" \
    github.com/cloudnativelabs/kube-router/v2/cmd/kube-router
  # kube-router's Makefile: pkg/version.Version (and BuildDate, left empty for a reproducible binary).
  CGO_ENABLED=0 build_group kube-router "$dir" \
    "-X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION" \
    github.com/cloudnativelabs/kube-router/v2/cmd/kube-router
}

# Prometheus with Kubernetes service discovery (role: pod) for the node tier, as prometheus-k8s and
# promtool-k8s: the plain names stay Debian's package, which every other test uses. Build tags keep every
# other discovery plugin (cloud SDKs) out: Prometheus' plugins/ files honour remove_all_sd + enable_*_sd.
build_prometheus_k8s() {
  local dir=$ROOT/hack/cluster/prometheus tags=remove_all_sd,enable_kubernetes_sd
  sync_module "$dir" github.com/prometheus/prometheus "$PROMETHEUS_MODULE_VERSION" \
    github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool
  local fp
  fp=$(fingerprint "$dir" "$tags")
  if up_to_date prometheus-k8s "$fp" prometheus-k8s promtool-k8s; then
    log "prometheus-k8s: up to date (prometheus-k8s promtool-k8s)"
    return
  fi
  log "prometheus-k8s: building prometheus and promtool (tags $tags; go build -p $JOBS)"
  local start=$SECONDS out
  out=$(mktemp -d)
  (cd "$dir" && go build -p "$JOBS" -tags "$tags" -trimpath -ldflags "-s -w" -o "$out/" \
    github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool)
  mv "$out/prometheus" "$BIN/prometheus-k8s" && mv "$out/promtool" "$BIN/promtool-k8s" && rmdir "$out"
  echo "$fp" > "$STAMPS/prometheus-k8s"
  log "prometheus-k8s: done in $((SECONDS - start)) s"
}

# KEDA's operator and metrics API server (its adapter) as keda-operator and keda-adapter, in one go build
# (they share most of the graph: every scaler's SDK); its CRDs copied from the module's config/crd/bases
# into $CACHE/keda-crds. The admission webhooks (cmd/webhooks) are not built: they only refuse a bad
# ScaledObject early (KEDA's operator reports the same problems in its conditions), and a third binary
# would add its link time to every cold CI run (plus a ValidatingWebhookConfiguration to register) for
# nothing the tests read.
# KEDA's go.mod replace and exclude directives apply only in its own module: copied into the wrapper's.
KEDA_DIR=$ROOT/hack/cluster/keda
KEDA_MODULE=github.com/kedacore/keda/v2
sync_keda_module() {
  local module=$KEDA_MODULE
  sync_module "$KEDA_DIR" "$module" "$KEDA_VERSION" "$module/cmd/operator" "$module/cmd/adapter" \
    -replace=github.com/nexus-rpc/nexus-proto-annotations@v0.1.0=github.com/nexus-rpc/nexus-proto-annotations@v0.1.1-0.20260629224316-835bd8d49cb4 \
    -exclude=github.com/go-chi/chi/v5@v5.2.3
}

# Step `keda-modules` (hack/provision.d/25-keda-modules.sh): every module the KEDA build reads, into Go's
# module cache (about 1.7 GB), before the real node's tests can start; the build (step `keda`, beside the
# tests) then runs with GOPROXY=off and needs no network while the node changes the machine's.
fetch_keda_modules() {
  local start=$SECONDS
  sync_keda_module
  module_commit "$KEDA_MODULE@$KEDA_VERSION" >/dev/null
  module_dir "$KEDA_MODULE@$KEDA_VERSION" >/dev/null
  (cd "$KEDA_DIR" && go list -deps "$KEDA_MODULE/cmd/operator" "$KEDA_MODULE/cmd/adapter" >/dev/null)
  log "keda-modules: in Go's module cache ($((SECONDS - start)) s)"
}

build_keda() {
  local dir=$KEDA_DIR module=$KEDA_MODULE
  sync_keda_module
  local commit ldflags fp src
  commit=$(module_commit "$module@$KEDA_VERSION")
  # KEDA's Makefile: version.Version (the tag without its v in release builds) and version.GitCommit.
  ldflags="-X $module/version.Version=${KEDA_VERSION#v} -X $module/version.GitCommit=$commit"
  src=$(module_dir "$module@$KEDA_VERSION")
  rm -rf "$CACHE/keda-crds" && mkdir -p "$CACHE/keda-crds"
  install -m 0644 "$src"/config/crd/bases/*.yaml "$CACHE/keda-crds/"
  log "keda: $KEDA_VERSION CRDs in $CACHE/keda-crds"
  fp=$(fingerprint "$dir" "$ldflags")
  if up_to_date keda "$fp" keda-operator keda-adapter; then
    log "keda: up to date (keda-operator keda-adapter)"
    return
  fi
  log "keda: building operator and adapter (go build -p $JOBS; this is slow on a cold cache)"
  local start=$SECONDS out
  out=$(mktemp -d)
  # CGO off as in KEDA's Makefile (CGO ?= 0): static binaries, no C toolchain in the build. -v names each
  # package as it is compiled (about 3,700), so the step's log shows how far a slow build has come.
  (cd "$dir" && CGO_ENABLED=0 go build -v -p "$JOBS" -trimpath -ldflags "-s -w $ldflags" -o "$out/" \
    "$module/cmd/operator" "$module/cmd/adapter")
  mv "$out/operator" "$BIN/keda-operator" && mv "$out/adapter" "$BIN/keda-adapter" && rmdir "$out"
  echo "$fp" > "$STAMPS/keda"
  log "keda: done in $((SECONDS - start)) s"
}

# Debian's container runtime and network tools for the real node (containerd 1.6 + runc, CNI plugins in
# /usr/lib/cni, ipset/conntrack/iptables for kube-proxy and kube-router).
install_node_packages() {
  local want=(containerd runc containernetworking-plugins ipset conntrack iptables) missing=() p
  for p in "${want[@]}"; do dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p"); done
  if [ ${#missing[@]} = 0 ]; then
    log "node packages: installed (containerd $(containerd --version | awk '{print $3}'), $(runc --version | head -1))"
    return
  fi
  log "node packages: apt-get install ${missing[*]}"
  "$ROOT/hack/apt-install.sh" "${missing[@]}"
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  # The devcluster starts its own containerd with its own config and socket; never the system service.
  if command -v systemctl >/dev/null && systemctl is-active --quiet containerd 2>/dev/null; then
    $sudo systemctl stop containerd && $sudo systemctl disable containerd || true
  fi
}

build_kwok() {
  local dir=$ROOT/hack/cluster/kwok
  sync_module "$dir" sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok
  local src
  src=$(module_dir "sigs.k8s.io/kwok@$KWOK_VERSION")
  # kwok's release builds stamp the version without the leading v.
  build_group kwok "$dir" "-X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}" sigs.k8s.io/kwok/cmd/kwok
  # kwok needs stage configs (node/pod lifecycles) to do anything; they ship in its module
  # (kustomize/stage/<kind>/<profile>/*.yaml). Copy the YAMLs, not the module's Go files and test data.
  rm -rf "$CACHE/kwok-stages" && mkdir -p "$CACHE/kwok-stages"
  (cd "$src/kustomize/stage" && find . -name '*.yaml' -not -path '*/testdata/*' -not -name kustomization.yaml) |
    while read -r f; do install -D -m 0644 "$src/kustomize/stage/$f" "$CACHE/kwok-stages/$f"; done
  log "kwok: stage configs in $CACHE/kwok-stages ($(find "$CACHE/kwok-stages" -name '*.yaml' | wc -l) files)"
}

copy_gateway_api_crds() {
  local src
  src=$(module_dir "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION")
  rm -rf "$CACHE/gateway-api" && mkdir -p "$CACHE/gateway-api"
  install -m 0644 "$src"/config/crd/standard/gateway.networking.k8s.io_*.yaml "$CACHE/gateway-api/"
  log "gateway-api: $GATEWAY_API_VERSION standard CRDs in $CACHE/gateway-api"
  # Part of the same step (no Go build, no stamp): a copy of one file from the module cache, seconds.
  src=$(module_dir "sigs.k8s.io/gateway-api-inference-extension@$GIE_VERSION")
  rm -rf "$CACHE/gateway-api-inference-extension" && mkdir -p "$CACHE/gateway-api-inference-extension"
  install -m 0644 "$src"/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml \
    "$CACHE/gateway-api-inference-extension/"
  log "gateway-api: inference extension $GIE_VERSION InferencePool CRD in $CACHE/gateway-api-inference-extension"
}

build_helm() {
  local dir=$ROOT/hack/cluster/helm
  sync_module "$dir" helm.sh/helm/v3 "$HELM_VERSION" helm.sh/helm/v3/cmd/helm
  local commit kver kmaj kmin
  commit=$(module_commit "helm.sh/helm/v3@$HELM_VERSION")
  kver=$(cd "$dir" && go list -m -f '{{.Version}}' k8s.io/client-go)   # v0.37.0 -> k8s 1.37
  kmaj=1; kmin=${kver#v0.}; kmin=${kmin%%.*}
  # The same ldflags as helm's Makefile.
  local ldflags="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  ldflags+=" -X helm.sh/helm/v3/internal/version.metadata= -X helm.sh/helm/v3/internal/version.gitCommit=$commit"
  ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  ldflags+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$kmaj -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$kmin"
  ldflags+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$kmaj -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$kmin"
  build_group helm "$dir" "$ldflags" helm.sh/helm/v3/cmd/helm
}

install_prometheus() {
  if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    log "prometheus: installed ($(prometheus --version 2>&1 | head -1))"
    return
  fi
  log "prometheus: apt-get install prometheus (Debian package)"
  # Not started as a system service (hack/apt-install.sh): tests start their own Prometheus on a free port.
  "$ROOT/hack/apt-install.sh" prometheus
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
    $sudo systemctl stop prometheus && $sudo systemctl disable prometheus || true
  fi
  log "prometheus: $(prometheus --version 2>&1 | head -1)"
}

install_shared_store() {
  # The gateway replicas' shared store in tests and benchmarks (hack/devcluster/shared_store.py starts
  # its own on a free port; the package's service is never started).
  if command -v redis-server >/dev/null; then
    log "redis-server: installed ($(redis-server --version | cut -d' ' -f3))"
    return
  fi
  log "redis-server: apt-get install redis-server (Debian package)"
  "$ROOT/hack/apt-install.sh" redis-server
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
    $sudo systemctl stop redis-server && $sudo systemctl disable redis-server || true
  fi
  log "redis-server: $(redis-server --version | cut -d' ' -f3)"
}

drop_build_cache() {
  local size legacy
  if [ -d "$GOCACHE" ]; then
    size=$(du -sh "$GOCACHE" | cut -f1)
    rm -rf "$GOCACHE"
    log "go build cache: dropped $GOCACHE ($size; every binary is built)"
  else
    log "go build cache: none to drop"
  fi
  # Before kvfleet had a build cache of its own, its builds filled Go's default one (8 GB), where nothing
  # tells its entries from others': emptied once (`go clean -cache`: Go builds again what it needs).
  legacy=$(env -u GOCACHE go env GOCACHE)
  if [ ! -f "$STAMPS/go-default-cache-emptied" ] && [ -d "$legacy" ] && [ "$legacy" != "$GOCACHE" ]; then
    size=$(du -sh "$legacy" | cut -f1)
    GOCACHE=$legacy go clean -cache
    log "go build cache: emptied Go's default one, $legacy ($size), which kvfleet's builds filled before"
  fi
  touch "$STAMPS/go-default-cache-emptied"
}

steps=${KVFLEET_BUILD_STEPS:-"etcd kubernetes kwok helm prometheus shared-store gateway-api"}
total_start=$SECONDS
for step in $steps; do
  case $step in
    etcd) build_etcd ;;
    kubernetes) build_kubernetes ;;
    kwok) build_kwok ;;
    helm) build_helm ;;
    prometheus) install_prometheus ;;
    shared-store) install_shared_store ;;
    gateway-api) copy_gateway_api_crds ;;
    keda-modules) fetch_keda_modules ;;
    keda) build_keda ;;
    node) install_node_packages; build_kubelet; build_pause; build_coredns; build_kube_router; build_prometheus_k8s ;;
    node-packages) install_node_packages ;;
    kubelet) build_kubelet ;;
    pause) build_pause ;;
    coredns) build_coredns ;;
    kube-router) build_kube_router ;;
    prometheus-k8s) build_prometheus_k8s ;;
    drop-build-cache) drop_build_cache ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
  esac
done
log "all done in $((SECONDS - total_start)) s; binaries in $BIN"
