"""One real node for the local cluster: containerd + runc, kubelet, kube-proxy, CoreDNS and kube-router.

What it takes on this kind of machine (see DESIGN.md, "Running real pods locally"): cgroup v1 needs the
kubelet's ``failCgroupV1: false`` with the ``cgroupfs`` driver and ``failSwapOn: false``; containerd's CRI
plugin needs ``restrict_oom_score_adj = true`` (no CAP_SYS_RESOURCE); no registry is reachable, so the
pod sandbox image is built locally (``hack/cluster/pause``) and every image is imported with
``ctr -n k8s.io images import`` and never pulled; the kubelet's ``--node-ip`` is the machine's own
interface address, and the API server listens there too so that pods (the operator) reach it.

The builders (``build_*``) are pure; :func:`start_real_node` and :func:`stop_real_node` are the shell.
Everything the node changes on the machine is undone by :func:`stop_real_node`: pods are drained through
the kubelet (so CNI tears their networks down), processes are stopped, the bridge, leftover veths and
network namespaces, the iptables chains and ipsets of kube-proxy, kube-router and the CNI plugins are
removed, and the kernel settings the kubelet and kube-proxy change are restored to what they were.
containerd's image store lives in ``$KVFLEET_CACHE/node/containerd`` so multi-GB images are imported once.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import binaries
from .pki import Pki, sign_client_cert
from .processes import ManagedProcess, find_free_port, start_process, wait_until

NODE_NAME = "kvfleet-node"
#: Label on the real node (kwok's fake GPU nodes carry ``type=kwok``).
NODE_LABEL = "kvfleet.io/node"
#: Pods of the real node get addresses here: outside kwok's fake 10.244.0.0/16 and podman's 10.88.0.0/16.
POD_SUBNET = "10.245.0.0/24"
CLUSTER_POD_CIDR = "10.245.0.0/16"
BRIDGE = "kvfleet0"
CNI_NETWORK = "kvfleet"
CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
#: containerd's runtime state (sockets, shim state, mounts) on tmpfs, as upstream's /run/containerd.
CONTAINERD_STATE = Path("/run/kvfleet-containerd")
CONTAINERD_SOCKET = CONTAINERD_STATE / "containerd.sock"
CONTAINERD_NAMESPACE = "k8s.io"
#: The pod sandbox image, built locally from hack/cluster/pause; containerd's ``sandbox_image``.
PAUSE_IMAGE = "localhost/kvfleet/pause:1.0"
#: Kernel settings the kubelet and kube-proxy may change; recorded at start, restored at stop.
SYSCTLS = (
    "kernel/panic",
    "kernel/panic_on_oops",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/conf/all/route_localnet",
    "net/ipv4/ip_forward",
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
    "net/netfilter/nf_conntrack_max",
    "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
)
#: iptables chain prefixes of kube-proxy and kube-router (KUBE-ROUTER-* included). The CNI plugins remove
#: their own rules when the drained pods' networks are torn down; ``CNI-*`` chains may be podman's.
CHAIN_PREFIXES = ("KUBE-",)
#: Host binaries the node needs besides the cached Go builds (Debian packages, hack/build-cluster.sh node).
HOST_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ipset", "ip", "podman")
NODE_BINARIES = ("kubelet", "kube-proxy", "coredns", "kube-router", "pause")


def node_cache_dir() -> Path:
    return binaries.cache_dir() / "node"


def detect_node_ip() -> str:
    """The machine's own non-loopback IPv4 address: the source address of its default route, else the
    first global address that is not a container bridge's."""
    out = subprocess.run(
        ["ip", "-j", "-4", "route", "show", "default"], capture_output=True, text=True, check=True
    )
    routes = json.loads(out.stdout or "[]")
    if routes and routes[0].get("dev"):
        dev = routes[0]["dev"]
        addrs = json.loads(
            subprocess.run(
                ["ip", "-j", "-4", "addr", "show", "dev", dev], capture_output=True, text=True, check=True
            ).stdout
        )
        for link in addrs:
            for info in link.get("addr_info", []):
                if info.get("scope") == "global":
                    return str(info["local"])
    addrs = json.loads(
        subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    )
    for link in addrs:
        if link.get("ifname") in ("lo", BRIDGE, "cni-podman0", "docker0"):
            continue
        for info in link.get("addr_info", []):
            if info.get("scope") == "global":
                return str(info["local"])
    raise RuntimeError("no non-loopback IPv4 address on this machine; the real node needs one for --node-ip")


def dns_service_ip(service_cidr: str) -> str:
    """The ClusterIP the kubelet hands pods as their resolver: the tenth address of the Service range
    (kubeadm's convention); a Service ``kube-dns`` with that ClusterIP fronts CoreDNS."""
    return str(ipaddress.ip_network(service_cidr)[10])


# --- pure builders -----------------------------------------------------------------------------------


def build_containerd_config(root: Path, state: Path, cni_conf_dir: Path) -> str:
    """containerd 1.6's config (version 2): its own root, state and socket, the CRI plugin with runc
    (cgroupfs), the local pause image and the OOM-score restriction this machine needs."""
    return f"""version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{state / "containerd.sock"}"
[ttrpc]
  address = "{state / "containerd.sock.ttrpc"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Without CAP_SYS_RESOURCE every sandbox fails ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  enable_cdi = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf_dir}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = ""
"""


def build_cni_conflist(ipam_dir: Path, subnet: str = POD_SUBNET) -> dict[str, Any]:
    """A bridge network with host-local addresses, masquerade to the outside, hairpin (a pod reaching
    itself through a Service) and port mappings."""
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def build_kubelet_config(
    *, node_ip: str, ca_cert: Path, cluster_dns: str, healthz_port: int, port: int
) -> dict[str, Any]:
    """The KubeletConfiguration for this machine (cgroup v1 + cgroupfs, swap tolerated, x509 + webhook
    auth so the API server's ``logs``/``exec`` work and nothing else does, eviction thresholds low enough
    for a shared development disk)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # kubelets since 1.35 refuse cgroup v1 without this
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "address": node_ip,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_cert)},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDomain": "cluster.local",
        "clusterDNS": [cluster_dns],
        "resolvConf": "/etc/resolv.conf",
        "registerNode": True,
        "serializeImagePulls": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "maxPods": 110,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        # Images are imported, never pulled: garbage-collecting one would make its pods unstartable.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "staticPodPath": "",
        "shutdownGracePeriod": "0s",
        "logging": {"verbosity": 1},
    }


def build_kubelet_args(
    kubelet: Path, *, config: Path, kubeconfig: Path, root_dir: Path, node_ip: str
) -> list[str]:
    return [
        str(kubelet),
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        f"--root-dir={root_dir}",
        f"--cert-dir={root_dir / 'pki'}",
        f"--node-ip={node_ip}",
        f"--hostname-override={NODE_NAME}",
        f"--node-labels={NODE_LABEL}=real",
    ]


def build_kube_proxy_config(
    *, kubeconfig: Path, healthz_port: int, metrics_port: int, mode: str = "iptables"
) -> dict[str, Any]:
    """kube-proxy in iptables mode for the node's pods; conntrack sysctls left alone (``maxPerCore: 0``),
    ``bindAddress`` unset (it works here; see DESIGN.md)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": mode,
        "clusterCIDR": CLUSTER_POD_CIDR,
        "hostnameOverride": NODE_NAME,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "conntrack": {"maxPerCore": 0},
    }


def build_corefile(*, node_ip: str, kubeconfig: Path, health_port: int, ready_port: int) -> str:
    """CoreDNS answering ``cluster.local`` (Services, headless StatefulSet pods) from the API server and
    forwarding everything else to the machine's resolver, on the node address only."""
    return f""".:53 {{
    bind {node_ip}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    forward . /etc/resolv.conf
    cache 30
}}
"""


def build_kube_dns_service(cluster_ip: str, node_ip: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``kube-system/kube-dns`` Service (the ClusterIP pods resolve through) and its EndpointSlice
    pointing at CoreDNS on the node address (CoreDNS runs as a host process, like the kubelet)."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
        "spec": {
            "clusterIP": cluster_ip,
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
            ],
        },
    }
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kube-dns-host",
            "namespace": "kube-system",
            "labels": {
                "kubernetes.io/service-name": "kube-dns",
                "endpointslice.kubernetes.io/managed-by": "kvfleet-devcluster",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [node_ip], "conditions": {"ready": True}, "nodeName": NODE_NAME}],
        "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ],
    }
    return service, slice_


def build_kube_router_args(
    kube_router: Path, *, kubeconfig: Path, health_port: int, service_cidr: str
) -> list[str]:
    """kube-router with only its NetworkPolicy firewall (iptables + ipset); routing and service proxy are
    the bridge's and kube-proxy's."""
    return [
        str(kube_router),
        f"--kubeconfig={kubeconfig}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        f"--service-cluster-ip-range={service_cidr}",
        f"--hostname-override={NODE_NAME}",
        f"--health-port={health_port}",
        "--metrics-port=0",
        "--enable-ipv6=false",
        "--v=1",
    ]


def build_node_kubeconfig(server: str, pki: Pki, cert: Path, key: Path, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(pki.ca_cert)}}
        ],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }


# --- the shell ---------------------------------------------------------------------------------------


@dataclass
class RealNode:
    """A started real node: where its state lives and what it changed on the machine."""

    workdir: Path
    node_ip: str
    sysctls: dict[str, str] = field(default_factory=dict)
    containerd_root: Path = field(default_factory=lambda: node_cache_dir() / "containerd")
    started_in: dict[str, float] = field(default_factory=dict)

    def to_state(self) -> dict[str, Any]:
        return {
            "workdir": str(self.workdir),
            "node_ip": self.node_ip,
            "sysctls": self.sysctls,
            "containerd_root": str(self.containerd_root),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> RealNode:
        return cls(
            workdir=Path(state["workdir"]),
            node_ip=state["node_ip"],
            sysctls=dict(state.get("sysctls", {})),
            containerd_root=Path(state["containerd_root"]),
        )


def missing_node_components() -> list[str]:
    """Binaries and host tools the node needs that are not there (empty: the node can start)."""
    missing = binaries.missing_binaries(NODE_BINARIES)
    missing += [tool for tool in HOST_TOOLS if shutil.which(tool) is None]
    missing += [
        f"CNI plugin {p}"
        for p in ("bridge", "host-local", "portmap", "loopback")
        if not (CNI_BIN_DIR / p).is_file()
    ]
    if os.geteuid() != 0:
        missing.append("root (containerd, the kubelet and kube-router need it)")
    return missing


def read_sysctls() -> dict[str, str]:
    out = {}
    for key in SYSCTLS:
        with contextlib.suppress(OSError):
            out[key] = (Path("/proc/sys") / key).read_text().strip()
    return out


def restore_sysctls(values: Mapping[str, str]) -> None:
    for key, value in values.items():
        path = Path("/proc/sys") / key
        with contextlib.suppress(OSError):
            if path.read_text().strip() != value:
                path.write_text(value)


def _run(
    *argv: str, check: bool = True, input_: bytes | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(argv), check=check, capture_output=True, input=input_, timeout=timeout)


def ctr(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[bytes]:
    """``ctr`` against the node's containerd, in the Kubernetes namespace."""
    return _run(
        "ctr",
        "--address",
        str(CONTAINERD_SOCKET),
        "-n",
        CONTAINERD_NAMESPACE,
        *args,
        check=check,
        timeout=timeout,
    )


def containerd_answers() -> bool:
    """Whether the node's containerd answers on its socket. Without a socket file, no: ``ctr`` would
    spend its 10 s default connect timeout finding that out (once per poll of a starting containerd)."""
    if not CONTAINERD_SOCKET.is_socket():
        return False
    return ctr("--connect-timeout", "2s", "version", check=False).returncode == 0


def image_present(ref: str) -> bool:
    out = ctr("images", "ls", "-q", f"name=={ref}", check=False)
    return out.returncode == 0 and ref in out.stdout.decode().split()


def image_digest(ref: str) -> str | None:
    """The manifest digest containerd has under ``ref``, or ``None``."""
    out = ctr("images", "ls", f"name=={ref}", check=False)
    for line in out.stdout.decode().splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == ref:
            return next((f for f in fields if f.startswith("sha256:")), None)
    return None


def image_config_digest(manifest_digest: str) -> str | None:
    """The config digest (what the kubelet reports as a container's ``imageID``) of the image whose
    manifest, or index of manifests, containerd stores under ``manifest_digest``."""
    out = ctr("content", "get", manifest_digest, check=False)
    if out.returncode != 0:
        return None
    doc = json.loads(out.stdout)
    if "config" in doc:
        return str(doc["config"]["digest"])
    manifests = doc.get("manifests") or []
    return image_config_digest(str(manifests[0]["digest"])) if len(manifests) == 1 else None


def import_podman_image(refs: list[str], image_id: str | None = None) -> bool:
    """``podman save`` one image under all of ``refs`` (the first: its content tag) into
    ``ctr -n k8s.io images import``, unless containerd has every ref on one image already, and that image
    is ``image_id`` (podman's image ID, when given): a content tag names the inputs, not the build, so an
    image rebuilt from the same inputs (a new podman store, say) is imported again. Whether it imported."""
    digests = {ref: image_digest(ref) for ref in refs}
    manifest = digests[refs[0]] if len(set(digests.values())) == 1 else None
    if manifest is not None and (image_id is None or image_config_digest(manifest) == f"sha256:{image_id}"):
        return False
    # `ctr images import` leaves an existing name where it points: drop the names first, so the version tag
    # (the chart's default) moves to this build.
    for ref in refs:
        ctr("images", "rm", ref, check=False)
    missing = list(refs)
    with subprocess.Popen(
        ["podman", "save", "--format", "docker-archive", "-m", *missing], stdout=subprocess.PIPE
    ) as save:
        imported = subprocess.run(
            [
                "ctr",
                "--address",
                str(CONTAINERD_SOCKET),
                "-n",
                CONTAINERD_NAMESPACE,
                "images",
                "import",
                "--all-platforms",
                "-",
            ],
            stdin=save.stdout,
            capture_output=True,
            check=False,
        )
    if save.returncode != 0 or imported.returncode != 0:
        raise RuntimeError(
            f"importing {missing} failed: podman save {save.returncode}; ctr: {imported.stderr.decode()}"
        )
    return True


def preload_images(workdir: Path, timeout: float = 60.0) -> dict[str, float]:
    """Import the images ``hack/images.sh`` built last into the node's containerd store ahead of the node's
    first start, so that start (in the tests) does not pay for it: ``make test``'s fetch lane runs this
    while the build lane still compiles. Through the node's containerd when one answers already; else a
    containerd of the node's own configuration runs for the import only. Seconds per image; an image
    already there costs nothing."""
    missing = [tool for tool in ("containerd", "ctr", "podman") if shutil.which(tool) is None]
    if missing:
        raise FileNotFoundError(f"preloading the node's images needs: {', '.join(missing)}")
    images = _built_images()
    if not images:
        raise FileNotFoundError(f"no images built yet ({binaries.cache_dir() / 'images' / 'images.json'})")
    containerd: ManagedProcess | None = None
    if not containerd_answers():
        containerd = _start_containerd(node_cache_dir() / "containerd", workdir, workdir / "logs", timeout)
    try:
        return _import_built_images(images)
    finally:
        if containerd is not None:
            containerd.stop()


def _start_containerd(root: Path, workdir: Path, logs: Path, timeout: float = 60.0) -> ManagedProcess:
    """The node's containerd (store ``root``, its config and CNI network in ``workdir``), answering."""
    root.mkdir(parents=True, exist_ok=True)
    cni_dir = workdir / "cni"
    cni_dir.mkdir(parents=True, exist_ok=True)
    (cni_dir / "10-kvfleet.conflist").write_text(
        json.dumps(build_cni_conflist(workdir / "cni-ipam"), indent=2)
    )
    config = workdir / "containerd.toml"
    config.write_text(build_containerd_config(root, CONTAINERD_STATE, cni_dir))
    containerd = start_process("containerd", ["containerd", f"--config={config}"], logs)
    try:
        wait_until(
            containerd_answers,
            timeout=timeout,
            what="containerd",
            watch=[containerd],
        )
    except BaseException:
        containerd.stop()  # the caller never got it to stop
        raise
    return containerd


def _import_built_images(images: Mapping[str, tuple[list[str], str | None]]) -> dict[str, float]:
    """Import each of ``images`` (``_built_images()``) unless containerd has that build; after an import,
    the store keeps only what runs. Seconds each (``drop_what_no_pod_runs``: ``"store"``)."""
    seconds: dict[str, float] = {}
    imported = False
    for name, (refs, image_id) in images.items():
        started = time.monotonic()
        imported |= import_podman_image(refs, image_id)
        seconds[name] = time.monotonic() - started
    if imported:
        started = time.monotonic()
        drop_what_no_pod_runs([refs for refs, _ in images.values()])
        seconds["store"] = time.monotonic() - started
    return seconds


def stale_refs(present: Iterable[str], current: Sequence[Sequence[str]]) -> list[str]:
    """The refs in ``present`` that name an earlier build of an image in ``current`` (each image's refs):
    same repository, a tag none of its current refs has. Other repositories' refs are never stale."""
    keep = {ref for refs in current for ref in refs}
    repositories = {ref.rsplit(":", 1)[0] for refs in current for ref in refs}
    return sorted(
        ref for ref in present if ref not in keep and ref.rsplit(":", 1)[0] in repositories and ":" in ref
    )


def drop_what_no_pod_runs(current: Sequence[Sequence[str]]) -> None:
    """Keep the node's containerd store to what its pods run (the engine image alone is 7 GB, and every
    change to the runtime builds it again under a new content tag):

    * earlier builds of ``current``'s images lose their names (``ctr images rm``), so the collector
      drops their snapshots and blobs;
    * the layer blobs of every unpacked image are let go (``ctr content prune references``: what the CRI
      plugin's ``discard_unpacked_layers`` does for a pull): containers start from the unpacked snapshots,
      so the blobs only doubled the store. An import writes a new build's layers again, and unpacks only
      those whose snapshot is missing."""
    listed = ctr("images", "ls", "-q", check=False)
    if listed.returncode == 0:
        for ref in stale_refs(listed.stdout.decode().split(), current):
            ctr("images", "rm", ref, check=False)
    ctr("content", "prune", "references", check=False)


def ensure_pause_image(workdir: Path) -> None:
    """Build the sandbox image from the cached ``pause`` binary (``FROM scratch``) and import it."""
    if image_present(PAUSE_IMAGE):
        return
    ctx = workdir / "pause-image"
    ctx.mkdir(parents=True, exist_ok=True)
    shutil.copy2(binaries.require_binary("pause"), ctx / "pause")
    (ctx / "Containerfile").write_text(
        'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n'
    )
    _run("podman", "build", "--quiet", "-t", PAUSE_IMAGE, str(ctx))
    import_podman_image([PAUSE_IMAGE])


def kvfleet_images() -> dict[str, list[str]]:
    """What ``hack/images.sh`` built last (``$KVFLEET_CACHE/images/images.json``): image -> its refs."""
    return {name: refs for name, (refs, _) in _built_images().items()}


def _built_images() -> dict[str, tuple[list[str], str | None]]:
    """``images.json``: image -> (its refs, podman's image ID when recorded)."""
    path = binaries.cache_dir() / "images" / "images.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {
        name: ([v["ref"], v["version_ref"]], v.get("id")) for name, v in data.items() if "version_ref" in v
    }


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def start_real_node(
    plane: Any,
    *,
    node_ip: str,
    service_cidr: str,
    timeout: float = 180.0,
    images: bool = True,
) -> RealNode:
    """Start containerd, the kubelet, kube-proxy, CoreDNS and kube-router for ``plane`` (a ControlPlane
    whose API server listens on ``node_ip``); their processes join ``plane.processes``. Returns once the
    Node is Ready, DNS answers and the firewall runs. ``images``: import kvfleet's images
    (``images.json``)."""
    missing = missing_node_components()
    if missing:
        raise FileNotFoundError(f"the real node needs: {', '.join(missing)}; run hack/provision.d/30-node.sh")
    workdir: Path = plane.workdir / "node"
    workdir.mkdir(parents=True, exist_ok=True)
    node = RealNode(workdir=workdir, node_ip=node_ip, sysctls=read_sysctls())
    (workdir / "sysctls.json").write_text(json.dumps(node.sysctls))
    before = len(plane.processes)
    try:
        _start(plane, node, service_cidr=service_cidr, timeout=timeout, images=images)
    except BaseException:
        # Undo what the half-started node changed, so a failed start leaves the machine as it was.
        started_here = plane.processes[before:]
        del plane.processes[before:]
        stop_real_node(plane, node, started_here)
        raise
    return node


def _start(plane: Any, node: RealNode, *, service_cidr: str, timeout: float, images: bool) -> None:
    started = time.monotonic()
    workdir, node_ip = node.workdir, node.node_ip
    logs = plane.workdir / "logs"
    pki: Pki = plane.pki

    # containerd
    containerd = _start_containerd(node.containerd_root, workdir, logs)
    plane.processes.append(containerd)
    ensure_pause_image(workdir)
    if images:
        _import_built_images(_built_images())
    node.started_in["containerd+images"] = time.monotonic() - started

    # kubelet
    kubelet_cert, kubelet_key = sign_client_cert(
        pki, "kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}"
    )
    kubelet_kubeconfig = workdir / "kubelet.kubeconfig"
    kubelet_kubeconfig.write_text(
        yaml.safe_dump(build_node_kubeconfig(plane.server, pki, kubelet_cert, kubelet_key, "kubelet"))
    )
    healthz = find_free_port()
    kubelet_config = workdir / "kubelet.yaml"
    cluster_dns = dns_service_ip(service_cidr)
    kubelet_config.write_text(
        yaml.safe_dump(
            build_kubelet_config(
                node_ip=node_ip,
                ca_cert=pki.ca_cert,
                cluster_dns=cluster_dns,
                healthz_port=healthz,
                port=10250,
            )
        )
    )
    kubelet = start_process(
        "kubelet",
        build_kubelet_args(
            binaries.require_binary("kubelet"),
            config=kubelet_config,
            kubeconfig=kubelet_kubeconfig,
            root_dir=workdir / "kubelet",
            node_ip=node_ip,
        ),
        logs,
    )
    plane.processes.append(kubelet)

    # kube-proxy
    proxy_cert, proxy_key = sign_client_cert(pki, "kube-proxy", "/CN=system:kube-proxy")
    proxy_kubeconfig = workdir / "kube-proxy.kubeconfig"
    proxy_kubeconfig.write_text(
        yaml.safe_dump(build_node_kubeconfig(plane.server, pki, proxy_cert, proxy_key, "kube-proxy"))
    )
    proxy_healthz = find_free_port()
    proxy_config = workdir / "kube-proxy.yaml"
    proxy_config.write_text(
        yaml.safe_dump(
            build_kube_proxy_config(
                kubeconfig=proxy_kubeconfig, healthz_port=proxy_healthz, metrics_port=find_free_port()
            )
        )
    )
    proxy = start_process(
        "kube-proxy", [str(binaries.require_binary("kube-proxy")), f"--config={proxy_config}"], logs
    )
    plane.processes.append(proxy)

    # DNS: CoreDNS on the node address behind the kube-dns Service
    service, slice_ = build_kube_dns_service(cluster_dns, node_ip)
    for path, body in (
        ("/api/v1/namespaces/kube-system/services", service),
        ("/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices", slice_),
    ):
        status, answer = plane.request("POST", path, body)
        if status not in (201, 409):
            raise RuntimeError(f"creating {body['kind']} kube-dns failed ({status}): {answer}")
    dns_health, dns_ready = find_free_port(), find_free_port()
    corefile = workdir / "Corefile"
    corefile.write_text(
        build_corefile(
            node_ip=node_ip, kubeconfig=plane.kubeconfig, health_port=dns_health, ready_port=dns_ready
        )
    )
    coredns = start_process(
        "coredns", [str(binaries.require_binary("coredns")), "-conf", str(corefile)], logs
    )
    plane.processes.append(coredns)

    for check, what in (
        (lambda: http_ok(f"http://127.0.0.1:{healthz}/healthz"), "kubelet /healthz"),
        (lambda: node_ready(plane), f"node {NODE_NAME} Ready"),
    ):
        wait_until(check, timeout=timeout, what=what, watch=plane.processes)

    # NetworkPolicy: kube-router's firewall (it finds its Node object at start: after registration)
    router_health = find_free_port()
    router = start_process(
        "kube-router",
        build_kube_router_args(
            binaries.require_binary("kube-router"),
            kubeconfig=plane.kubeconfig,
            health_port=router_health,
            service_cidr=service_cidr,
        ),
        logs,
    )
    plane.processes.append(router)

    checks = (
        (lambda: http_ok(f"http://127.0.0.1:{proxy_healthz}/healthz"), "kube-proxy /healthz"),
        (lambda: http_ok(f"http://127.0.0.1:{dns_ready}/ready"), "CoreDNS /ready"),
        (lambda: http_ok(f"http://127.0.0.1:{router_health}/healthz"), "kube-router /healthz"),
    )
    for check, what in checks:
        wait_until(check, timeout=timeout, what=what, watch=plane.processes)
    node.started_in["node"] = time.monotonic() - started


def node_ready(plane: Any) -> bool:
    try:
        status, body = plane.request("GET", f"/api/v1/nodes/{NODE_NAME}")
    except OSError:
        return False
    if status != 200:
        return False
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def drain_node(plane: Any, timeout: float = 60.0) -> None:
    """Cordon the node (controllers' replacement pods stay Pending), delete every pod bound to it (grace
    0) and wait until containerd runs no task: the kubelet stops them through the CRI, so CNI removes their
    veths and addresses. Tasks still running after ``timeout`` are killed through containerd."""
    with contextlib.suppress(OSError):
        plane.request(
            "PATCH",
            f"/api/v1/nodes/{NODE_NAME}",
            {"spec": {"unschedulable": True}},
            content_type="application/merge-patch+json",
        )
    with contextlib.suppress(OSError):
        status, body = plane.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName={NODE_NAME}")
        if status == 200:
            for pod in body.get("items", []):
                meta = pod["metadata"]
                plane.request(
                    "DELETE",
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                    {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
                )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = ctr("tasks", "ls", "-q", check=False)
        if out.returncode != 0 or not out.stdout.strip():
            return
        time.sleep(1)
    for task in ctr("tasks", "ls", "-q", check=False).stdout.decode().split():
        ctr("tasks", "kill", "--all", "--signal", "SIGKILL", task, check=False)
        time.sleep(0.5)
        ctr("tasks", "delete", "--force", task, check=False)


def _iptables_cleanup() -> None:
    """Remove the chains kube-proxy, kube-router and the CNI plugins made (rules jumping to them first)."""
    for binary in ("iptables", "ip6tables"):
        if shutil.which(binary) is None:
            continue
        for table in ("filter", "nat", "mangle", "raw"):
            out = _run(binary, "-w", "-t", table, "-S", check=False).stdout.decode()
            chains = [
                line.split()[1]
                for line in out.splitlines()
                if line.startswith("-N ") and line.split()[1].startswith(CHAIN_PREFIXES)
            ]
            for line in out.splitlines():
                parts = shlex.split(line)  # comments are quoted
                if line.startswith("-A ") and "-j" in parts and parts[parts.index("-j") + 1] in chains:
                    _run(binary, "-w", "-t", table, "-D", *parts[1:], check=False)
            for chain in chains:
                _run(binary, "-w", "-t", table, "-F", chain, check=False)
            for chain in chains:
                _run(binary, "-w", "-t", table, "-X", chain, check=False)
    if shutil.which("ipset"):
        names = _run("ipset", "list", "-n", check=False).stdout.decode().split()
        for name in names:
            if name.startswith(("KUBE-", "kube-router", "inet6:KUBE-")):
                _run("ipset", "destroy", name, check=False)


def _unmount_under(path: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(str(path))), key=len, reverse=True):
        _run("umount", "-l", mount, check=False)


def stop_real_node(plane: Any, node: RealNode, processes: list[ManagedProcess]) -> None:
    """Drain, stop the node's processes (last started first), and undo what they changed on the machine."""
    if any(p.name == "kubelet" and p.alive() for p in processes):
        drain_node(plane)
    for proc in reversed(processes):
        proc.stop()
    # Sandboxes the drain missed (a kubelet that had died): their tasks are gone with containerd's shims.
    for netns in Path("/var/run/netns").glob("cni-*"):
        _run("ip", "netns", "delete", netns.name, check=False)
    # veths of sandboxes whose network CNI never tore down (their netns outlived a killed kubelet).
    enslaved = _run("ip", "-j", "link", "show", "master", BRIDGE, check=False).stdout.decode() or "[]"
    for link in json.loads(enslaved):
        _run("ip", "link", "delete", str(link["ifname"]), check=False)
    _run("ip", "link", "delete", BRIDGE, check=False)
    _iptables_cleanup()
    _unmount_under(node.workdir)
    _unmount_under(CONTAINERD_STATE)
    shutil.rmtree(CONTAINERD_STATE, ignore_errors=True)
    restore_sysctls(node.sysctls)
