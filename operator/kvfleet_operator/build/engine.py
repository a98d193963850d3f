"""Engine pool workloads: a StatefulSet of vLLM + LMCache pods and its headless Service. Pure.

Each replica is a pod whose one container runs ``kvfleet engine launch`` (the engine image): it builds
vLLM's and LMCache's command lines from the pool's settings in the tenant table (so the operator and the
local demo start them the same way) and supervises, in one process group:

* the LMCache server (CPU tier L1, NVMe tier L2 on the replica's volume, ``IsolatedLRU`` on L2), its ZMQ
  and HTTP ports (quotas, cache clear) bound to the pod's loopback;
* vLLM's OpenAI server on ``http``, for the gateway, with the tenant-aware block-pool plugin enabled;
* the quota sync, which keeps LMCache's per-tenant quotas in step with the table (its metrics on loopback).

The pod's one port for Prometheus is ``metrics`` (the plugin's server): it re-exports vLLM's, LMCache's and
the sync's series with the plugin's own and serves no inference API (``build/network.py`` admits scrapers
there only, and the gateway only on ``http``).

The ModelDeployment's ``spec.pool.podTemplate`` is merged over the pod built here (``_merge_template``):
its labels and annotations under the operator's, its env after the operator's, its resources over the
defaults with the LMCache CPU tier (and a CPU engine's KV space) added to memory so the scheduler sees
them, its node affinity combined with the operator's required terms (every user term also carries them).
Fields that carry isolation or security are refused by the CRD and by the API model; the builder checks
the same rules again (``check_pod_template``) before merging: a template that got past both is refused,
not merged.

A StatefulSet (not a Deployment) gives replicas stable DNS names, which the gateway's prefix affinity
hashes onto, and one NVMe volume per replica. Those volumes are deleted with the StatefulSet (so with the
ModelDeployment, or with the Tenant that owns a dedicated pool): cached KV never outlives its pool. A
host-path NVMe tier (only under a root the platform allows, ``build/guardrails.py``) cannot be cleaned that
way. Every engine runs as uid 10001, so the uid cannot keep pools apart: the mount does. A pool's pods mount
only ``<hostPath>/<namespace>/<modelDeployment>/<pool>`` (:func:`nvme_host_dir`), never the root, so no
other pool's files are in reach; each replica writes in its own ``<pod>`` folder inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_operator.api.modeldeployment import DEFAULT_GPU_RESOURCE, PodTemplate, check_pod_template
from kvfleet_operator.api.units import parse_quantity
from kvfleet_operator.build.common import (
    ANNOTATION_DRAIN,
    CONFIG_DIR,
    ENGINE_METRICS_PORT_NAME,
    ENGINE_PORT,
    KEY_FILE_KEY,
    KEYS_DIR,
    KV_EVENTS_PORT,
    LMCACHE_HTTP_PORT,
    LMCACHE_PORT,
    LMCACHE_SYNC_METRICS_PORT,
    MODEL_MOUNT,
    NVME_MOUNT,
    PLUGIN_METRICS_PORT,
    TENANT_TABLE_KEY,
    Obj,
    Owner,
    config_map_name,
    engine_name,
    keys_secret_name,
    metadata,
    object_labels,
    restricted_container_security,
    restricted_pod_security,
    selector_labels,
)

#: The pod name, from the downward API (the NVMe folder on a host path is named after it).
POD_NAME_ENV = "KVFLEET_POD_NAME"

#: How long an engine pod stays bound to a node that stopped reporting (``node.kubernetes.io/not-ready`` or
#: ``/unreachable``, NoExecute) before it is evicted. Without it the API server's DefaultTolerationSeconds
#: admission gives 300 s: five minutes in which the gateway's replica behind that name serves nothing. 30 s
#: is past the brief blips a node lifecycle controller already absorbs (its grace period, 50 s by default,
#: runs before the taint exists) and short next to an engine's own start (weights, KV cache).
NODE_LOSS_TOLERATION_SECONDS = 30
#: The node condition taints the lifecycle controller sets on a node that stopped reporting.
NODE_LOSS_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


@dataclass(frozen=True)
class NvmeVolume:
    """The per-replica L2 tier: a PVC per replica from a storage class, or a host path."""

    size: str
    storage_class: str | None = None
    host_path: str | None = None


@dataclass(frozen=True)
class ModelVolume:
    """Weights from a PVC, mounted read-only at ``/models``."""

    claim_name: str


#: Where a Hugging Face source's model cache is mounted (the init container writes it, the engine reads it).
MODEL_CACHE_MOUNT = "/model-cache"
#: Where a gs:// source's credentials Secret is mounted (GOOGLE_APPLICATION_CREDENTIALS names its key).
MODEL_CREDENTIALS_MOUNT = "/var/run/secrets/kvfleet/model-credentials"
#: The key of a gs:// credentials Secret: a service account key file.
GCS_CREDENTIALS_KEY = "credentials.json"
#: The keys of a credentials Secret that become environment variables, by source (docs/operations.md,
#: "Model sources"). Named one by one (optional secretKeyRefs), never the whole Secret as envFrom: a key
#: named LD_PRELOAD, PYTHONPATH or LMCACHE_* would reach the step that reads the weights, or the engine.
HF_CREDENTIAL_KEYS = ("HF_TOKEN", "HF_ENDPOINT")
S3_CREDENTIAL_KEYS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)


def credential_env(secret: str, keys: tuple[str, ...]) -> list[Obj]:
    """``keys`` of Secret ``secret`` as environment variables of the same names, each optional."""
    return [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
        for key in keys
    ]


@dataclass(frozen=True)
class ModelFetch:
    """A Hugging Face source: the ``fetch-model`` init container downloads the pool's model (the tenant
    table's ``model`` at its ``revision``) into the model cache before the engine starts."""

    #: A ReadWriteMany claim the pool's replicas share (one download for the pool); ``None``: an emptyDir
    #: per replica.
    cache_claim: str | None = None


@dataclass(frozen=True)
class PoolWorkload:
    """Everything the engine builders need for one pool, already resolved from the CRs."""

    namespace: str
    model_deployment: str
    pool: str
    owner: Owner
    replicas: int
    image: str
    #: What vLLM loads (a path under /models for PVC sources, else a Hugging Face id or URI).
    model: str
    gpus_per_replica: int
    gpu_resource: str = DEFAULT_GPU_RESOURCE
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Obj, ...] = ()
    #: Labels a node must carry (dedicated GPU groups): a required node affinity, not a preference.
    required_node_labels: dict[str, str] = field(default_factory=dict)
    #: Label keys a node must not carry (a shared pool whose tolerations would admit a dedicated group's
    #: taint): a required node affinity ``DoesNotExist``.
    excluded_node_labels: tuple[str, ...] = ()
    model_volume: ModelVolume | None = None
    #: A Hugging Face source, fetched before the engine starts (``None``: a PVC or object storage).
    model_fetch: ModelFetch | None = None
    #: ``spec.model.source.credentialsSecretRef``: environment of the step that reads the weights.
    credentials_secret: str | None = None
    nvme: NvmeVolume | None = None
    shm_size: str = "8Gi"
    cpu_request: str = "4"
    #: The engine process's own memory (vLLM, weights staging, activations on the host).
    memory_request: str = "32Gi"
    #: Memory the replica holds besides the engine's own: the LMCache CPU tier, and on a CPU engine the KV
    #: cache (``VLLM_CPU_KVCACHE_SPACE``). Added to the memory request (and to a memory limit), so a 256Gi
    #: CPU tier is visible to the scheduler.
    tier_memory_bytes: int = 0
    #: CPU engines only: ``VLLM_CPU_KVCACHE_SPACE`` in whole GiB (``spec.pool.cpuKvCacheSpace``).
    cpu_kv_cache_gib: int | None = None
    #: ``spec.pool.podTemplate``, merged over the pod.
    template: PodTemplate = field(default_factory=PodTemplate)
    #: Hosts whose http(s) media URLs vLLM may fetch (the chart's ``allowedMediaHosts``); empty: none.
    allowed_media_domains: tuple[str, ...] = ()
    #: While the pool drains replicas away (``reconcile/drain.py``): the replicas the StatefulSet keeps
    #: running (``replicas`` are those the tenant table lists) and its ``kvfleet.io/drain`` annotation.
    running_replicas: int | None = None
    drain: str | None = None


def _tolerates_forever_or_own(toleration: Obj, key: str) -> bool:
    """Whether ``toleration`` (the user's) already decides how long a pod stays on a node tainted ``key``
    with NoExecute: the shortest matching ``tolerationSeconds`` wins, so ours would override theirs."""
    matches_key = toleration.get("key") == key or (
        not toleration.get("key") and toleration.get("operator") == "Exists"
    )
    return matches_key and toleration.get("effect") in (None, "", "NoExecute")


def build_node_loss_tolerations(user: tuple[Obj, ...]) -> list[Obj]:
    """The pool's tolerations: ``user`` (``spec.pool.tolerations``, in order), then a NoExecute toleration of
    :data:`NODE_LOSS_TOLERATION_SECONDS` for each of :data:`NODE_LOSS_TAINTS` that no user toleration
    already covers (a user's own ``tolerationSeconds``, or none meaning forever, is left to stand)."""
    added = [
        {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": NODE_LOSS_TOLERATION_SECONDS,
        }
        for key in NODE_LOSS_TAINTS
        if not any(_tolerates_forever_or_own(t, key) for t in user)
    ]
    return [*user, *added]


def _config_args(pool: str) -> list[str]:
    return [
        "--config",
        f"{CONFIG_DIR}/{TENANT_TABLE_KEY}",
        "--keys",
        f"{KEYS_DIR}/{KEY_FILE_KEY}",
        "--pool",
        pool,
    ]


def _config_mounts() -> list[Obj]:
    return [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},  # an emptyDir: the root filesystem is read-only
    ]


def _affinity(w: PoolWorkload) -> Obj | None:
    if not w.required_node_labels and not w.excluded_node_labels:
        return None
    expressions: list[Obj] = [
        {"key": key, "operator": "In", "values": [value]}
        for key, value in sorted(w.required_node_labels.items())
    ]
    expressions += [{"key": key, "operator": "DoesNotExist"} for key in sorted(w.excluded_node_labels)]
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": expressions}]
            }
        }
    }


def format_bytes(n: int) -> str:
    """A byte count as the shortest exact Kubernetes quantity: ``256Gi``, ``1536Mi``, ``1000``."""
    for suffix, unit in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def _with_tier(memory: str, w: PoolWorkload) -> str:
    return format_bytes(parse_quantity(memory) + w.tier_memory_bytes) if w.tier_memory_bytes else memory


def _resources(w: PoolWorkload) -> Obj:
    """Defaults, then the template's requests and limits, with the replica's tier memory added to memory;
    the GPU count is the pool's (the template may not name the GPU resource)."""
    gpu = str(w.gpus_per_replica)
    own = w.template.resources
    requests: dict[str, str] = {"cpu": w.cpu_request, "memory": w.memory_request, **own.requests}
    requests["memory"] = _with_tier(requests["memory"], w)
    limits: dict[str, str] = dict(own.limits)
    if "memory" in limits:
        limits["memory"] = _with_tier(limits["memory"], w)
    requests[w.gpu_resource] = limits[w.gpu_resource] = gpu
    return {"requests": dict(sorted(requests.items())), "limits": dict(sorted(limits.items()))}


def _merge_affinity(operator: Obj | None, w: PoolWorkload) -> Obj | None:
    """The template's affinity with the operator's required node terms in every required term (terms are
    ORed, expressions within one ANDed): no user term can lead off what the operator requires."""
    user = w.template.affinity
    if user is None:
        return operator
    merged: Obj = user.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True, mode="json")
    ours: list[Obj] = []
    if operator is not None:
        ours = operator["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ][0]["matchExpressions"]
    node = merged.setdefault("nodeAffinity", {})
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        if ours:
            node["requiredDuringSchedulingIgnoredDuringExecution"] = {
                "nodeSelectorTerms": [{"matchExpressions": list(ours)}]
            }
    else:
        for term in required["nodeSelectorTerms"]:
            term["matchExpressions"] = [*term.get("matchExpressions", []), *ours]
    if not node:
        del merged["nodeAffinity"]
    return merged or None


def _env(w: PoolWorkload) -> list[Obj]:
    """The operator's variables, then the template's; a template variable of the same name (``HOME``)
    replaces the operator's. The reserved ones (tenant table, plugin, LMCache) never get here."""
    own = [e.model_dump(by_alias=True, exclude_none=True, mode="json") for e in w.template.env]
    names = {e["name"] for e in own}
    operator: list[Obj] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "VLLM_PLUGINS", "value": "kvfleet"},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    return [e for e in operator if e["name"] not in names] + own


def _engine_args(w: PoolWorkload) -> list[str]:
    """The launcher's build: ``--gpu`` on GPUs (vLLM sizes its KV cache; any block size), else the CPU
    build's KV space in whole GiB (``spec.pool.cpuKvCacheSpace``; without it the launcher's default); and
    the media hosts vLLM may fetch from, when the platform allows any (else the launcher allows none)."""
    media = ["--allowed-media-domains", ",".join(w.allowed_media_domains)] if w.allowed_media_domains else []
    if w.gpus_per_replica > 0:
        return ["--gpu", *media]
    return [*(["--cpu-kv-gib", str(w.cpu_kv_cache_gib)] if w.cpu_kv_cache_gib is not None else []), *media]


def nvme_host_dir(w: PoolWorkload) -> str:
    """The node folder a host-path pool mounts: ``<hostPath>/<namespace>/<modelDeployment>/<pool>``. The
    names are DNS labels (no ``/``, no ``..``), so two pools never get the same folder or one inside the
    other, and no pool reaches the root or another pool's files."""
    if w.nvme is None or w.nvme.host_path is None:
        raise ValueError("nvme_host_dir: the pool has no host-path NVMe tier")
    return f"{w.nvme.host_path.rstrip('/')}/{w.namespace}/{w.model_deployment}/{w.pool}"


def _nvme_dir(w: PoolWorkload) -> str:
    """The replica's NVMe folder. On a host path, ``<pod>`` inside the pool's folder (the container expands
    ``$(KVFLEET_POD_NAME)``): two replicas of a pool on one node never share LMCache's files."""
    if w.nvme is not None and w.nvme.host_path is not None:
        return f"{NVME_MOUNT}/$({POD_NAME_ENV})"
    return NVME_MOUNT


def _add_model_source(w: PoolWorkload, engine: Obj, volumes: list[Obj]) -> list[Obj]:
    """Wire the model source into the pod; return its init containers.

    Hugging Face: ``kvfleet engine fetch-model`` downloads into the model cache (the shared claim or an
    emptyDir) with the credentials Secret's HF_TOKEN and HF_ENDPOINT as its environment; the engine mounts
    the cache read-only and loads the fetched folder offline. Object storage: the engine itself reads the
    Secret (s3://: its AWS_* keys as environment; gs://: a key file), since vLLM streams the weights at
    load. Only those keys, by name: the Secret's other keys never become environment.
    """
    secret = w.credentials_secret
    if w.model_fetch is None:
        if secret is not None and w.model.startswith("gs://"):
            volumes.append({"name": "model-credentials", "secret": {"secretName": secret}})
            engine["volumeMounts"].append(
                {"name": "model-credentials", "mountPath": MODEL_CREDENTIALS_MOUNT, "readOnly": True}
            )
            engine["env"].append(
                {
                    "name": "GOOGLE_APPLICATION_CREDENTIALS",
                    "value": f"{MODEL_CREDENTIALS_MOUNT}/{GCS_CREDENTIALS_KEY}",
                }
            )
        elif secret is not None:
            engine["env"].extend(credential_env(secret, S3_CREDENTIAL_KEYS))
        return []
    claim = w.model_fetch.cache_claim
    volumes.append(
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}}
        if claim is not None
        else {"name": "model-cache", "emptyDir": {}}
    )
    engine["volumeMounts"].append({"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT, "readOnly": True})
    fetch: Obj = {
        "name": "fetch-model",
        "image": w.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "kvfleet",
            "engine",
            "fetch-model",
            *_config_args(w.pool),
            "--model-cache",
            MODEL_CACHE_MOUNT,
        ],
        "env": [{"name": "HOME", "value": "/tmp"}],
        # Downloading is network and disk, not compute: small requests, no GPU.
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": restricted_container_security(),
        "volumeMounts": [*_config_mounts(), {"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT}],
    }
    if secret is not None:
        fetch["env"].extend(credential_env(secret, HF_CREDENTIAL_KEYS))
    return [fetch]


def build_engine_statefulset(w: PoolWorkload) -> Obj:
    """The pool's StatefulSet. Raises ``ValueError`` when the pod template sets a field that carries
    isolation or security (the CRD and the API model refuse it first; this is the last line)."""
    problems = check_pod_template(w.template)
    if problems:
        raise ValueError("; ".join(problems))
    name = engine_name(w.model_deployment, w.pool)
    labels = object_labels(w.model_deployment, "engine", w.pool)
    selector = selector_labels(w.model_deployment, "engine", w.pool)
    template = w.template
    engine: Obj = {
        "name": "engine",
        "image": w.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "kvfleet",
            "engine",
            "launch",
            *_config_args(w.pool),
            "--model",
            w.model,
            # vLLM's bind address (the gateway dials the pod IP); LMCache, the sync's metrics and the
            # plugin's debug endpoint bind loopback whatever it says (the launcher).
            "--host",
            "0.0.0.0",
            "--port",
            str(ENGINE_PORT),
            "--lmcache-port",
            str(LMCACHE_PORT),
            "--lmcache-http-port",
            str(LMCACHE_HTTP_PORT),
            "--kv-events-port",
            str(KV_EVENTS_PORT),
            "--metrics-port",
            str(LMCACHE_SYNC_METRICS_PORT),
            "--plugin-metrics-port",
            str(PLUGIN_METRICS_PORT),
            "--state-dir",
            "/tmp/kvfleet",
            *_engine_args(w),
            *(["--nvme-dir", _nvme_dir(w)] if w.nvme is not None else []),
            *(["--model-cache", MODEL_CACHE_MOUNT] if w.model_fetch is not None else []),
        ],
        "env": _env(w),
        "ports": [
            {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
            {"name": ENGINE_METRICS_PORT_NAME, "containerPort": PLUGIN_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": _resources(w),
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 180,  # large models take up to 30 minutes to load
        },
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "securityContext": restricted_container_security(),
        "volumeMounts": [*_config_mounts(), {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": config_map_name(w.model_deployment)}},
        {"name": "keys", "secret": {"secretName": keys_secret_name(w.model_deployment)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": w.shm_size}},
    ]
    if w.model_volume is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": w.model_volume.claim_name, "readOnly": True},
            }
        )
        engine["volumeMounts"].append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    init_containers = _add_model_source(w, engine, volumes)
    claim_templates: list[Obj] = []
    if w.nvme is not None:
        engine["volumeMounts"].append({"name": "nvme", "mountPath": NVME_MOUNT})
        if w.nvme.host_path is not None:
            # The pool's own folder, never the root: the engines of every namespace run as uid 10001, and
            # only the mount keeps one pool's KV files out of another's reach. The kubelet creates the
            # folder (root's, mode 0755); the platform's root carries a default ACL that lets uid 10001
            # write in what is created below it (docs/operations.md). LMCache creates the replica's folder.
            volumes.append(
                {"name": "nvme", "hostPath": {"path": nvme_host_dir(w), "type": "DirectoryOrCreate"}}
            )
        else:
            pvc_spec: Obj = {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": w.nvme.size}},
            }
            if w.nvme.storage_class is not None:
                pvc_spec["storageClassName"] = w.nvme.storage_class
            claim_templates.append({"metadata": {"name": "nvme"}, "spec": pvc_spec})

    pod_spec: Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": restricted_pod_security(),
        "terminationGracePeriodSeconds": 60,
        "containers": [engine],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if template.env_from:
        engine["envFrom"] = [
            *engine.get("envFrom", []),
            *(e.model_dump(by_alias=True, exclude_none=True, mode="json") for e in template.env_from),
        ]
    if w.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(w.node_selector.items()))
    tolerations = build_node_loss_tolerations(w.tolerations)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    affinity = _merge_affinity(_affinity(w), w)
    if affinity is not None:
        pod_spec["affinity"] = affinity
    if template.runtime_class_name:
        pod_spec["runtimeClassName"] = template.runtime_class_name
    if template.priority_class_name:
        pod_spec["priorityClassName"] = template.priority_class_name
    if template.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in template.image_pull_secrets]
    pod_meta: Obj = {"labels": {**template.labels, **labels}}  # the operator's labels win
    if template.annotations:
        pod_meta["annotations"] = dict(sorted(template.annotations.items()))
    spec: Obj = {
        "replicas": w.replicas if w.running_replicas is None else w.running_replicas,
        "serviceName": name,
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector},
        "template": {"metadata": pod_meta, "spec": pod_spec},
    }
    if claim_templates:
        spec["volumeClaimTemplates"] = claim_templates
        # The replicas' NVMe volumes (cached KV) go with the StatefulSet. A replica scaled away keeps its
        # volume until the pool goes (Retain): deleting it would block a quick scale back up while the
        # claim terminates (seen when drift repair restores replicas), and it holds only this pool's KV.
        spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(
            name, w.namespace, labels, w.owner, {ANNOTATION_DRAIN: w.drain} if w.drain else None
        ),
        "spec": spec,
    }


def build_engine_service(w: PoolWorkload) -> Obj:
    """Headless: the gateway addresses each replica by its stable DNS name."""
    name = engine_name(w.model_deployment, w.pool)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, w.namespace, object_labels(w.model_deployment, "engine", w.pool), w.owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector_labels(w.model_deployment, "engine", w.pool),
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": ENGINE_METRICS_PORT_NAME,
                    "port": PLUGIN_METRICS_PORT,
                    "targetPort": ENGINE_METRICS_PORT_NAME,
                    "protocol": "TCP",
                },
            ],
        },
    }


def replica_endpoints(w: PoolWorkload, port: int) -> list[str]:
    """Base URLs of each replica through the headless Service (``<pod>.<svc>.<ns>.svc``)."""
    name = engine_name(w.model_deployment, w.pool)
    return [f"http://{name}-{i}.{name}.{w.namespace}.svc:{port}" for i in range(w.replicas)]
