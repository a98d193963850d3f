{{/* The release's full name, used for every object the chart creates (63 characters at most). */}}
{{- define "kvfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- end -}}

{{/* Labels that select the operator pod (never change them: Deployment selectors are immutable). */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the operator's salt master key (created by the operator on first start). */}}
{{- define "kvfleet.saltSecretName" -}}
{{- printf "%s-salt-master" (include "kvfleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The operator's leader-election Lease in the release namespace (one replica leads, the rest stand by). */}}
{{- define "kvfleet.leaseName" -}}
{{- printf "%s-leader" (include "kvfleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfleet.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{/* True when the Prometheus Operator's API is served (ServiceMonitor, PrometheusRule). */}}
{{- define "kvfleet.monitoringApi" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{/* The namespaces the operator watches (a YAML list): operator.watchNamespaces, or the release's. */}}
{{- define "kvfleet.watchNamespaces" -}}
{{- toYaml (.Values.operator.watchNamespaces | default (list .Release.Namespace)) -}}
{{- end -}}

{{/* The user the operator's requests carry: its ServiceAccount. */}}
{{- define "kvfleet.operatorUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "kvfleet.serviceAccountName" .) -}}
{{- end -}}

{{/*
The namespaced rules of the operator: exactly the verbs its code uses (tests/unit/test_rbac.py derives the
allowlist from the operator's API calls and fails on anything more). Shared by the per-namespace Roles
(the default) and the ClusterRole (operator.watchAllNamespaces). Server-side apply that creates an object
is authorized as create, so the applied kinds need create and patch; no kind needs update.
*/}}
{{- define "kvfleet.namespacedRules" -}}
# ModelDeployments: read by the reconcile, listed and watched by kopf, patched by kopf for its finalizer.
- apiGroups: ["kvfleet.io"]
  resources: ["modeldeployments"]
  verbs: ["get", "list", "watch", "patch"]
# Tenants: listed and watched, never written (only their status is).
- apiGroups: ["kvfleet.io"]
  resources: ["tenants"]
  verbs: ["list", "watch"]
# Status of both: server-side apply.
- apiGroups: ["kvfleet.io"]
  resources: ["modeldeployments/status", "tenants/status"]
  verbs: ["patch"]
# Children of a ModelDeployment (tenant table, gateway and engine pools, disruption budgets, network
# policies): listed and watched by the operator's label, applied, and pruned when no longer desired; get:
# an object of a child's name that is not listed as a child is read before any write, to see whose it is
# (the operator never writes over an object it does not control: NameInUse).
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- if .Values.rbac.monitoring }}
# (Not watched: an optional API, so the periodic reconcile covers them.)
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors", "podmonitors"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.ingress }}
# Ingresses exposing a gateway (spec.gateway.exposure.ingress); not watched: the periodic reconcile covers
# them.
- apiGroups: ["networking.k8s.io"]
  resources: ["ingresses"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.httpRoute }}
# Gateway API HTTPRoutes exposing a gateway (spec.gateway.exposure.httpRoute); not watched either.
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.inferencePool }}
# Gateway API Inference Extension InferencePools, one per engine pool (spec.gateway.inferencePool); not
# watched either.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.keda }}
# KEDA ScaledObjects scaling the shared pool (spec.pool.autoscaling); not watched either.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
# Engine pods: listed (by the engine label) to read each ready one's KV blocks on its metrics port, and
# deleted (grace period 0, uid precondition) only when one was evicted from a lost node and is stuck
# Terminating (spec.pool.nodeLoss; never a pod whose node is Ready).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "delete"]
# Secrets: the keys Secret (a child) and the tenants' API-key Secrets, which the operator lists only with
# the label selector kvfleet.io/tenant (RBAC cannot restrict a list by label: the selector limits what it
# reads, not what this rule allows); get: a generated key Secret created meanwhile.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Events the operator and kopf post about the objects they handle.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{/* The exposure kinds the operator may manage (KVFLEET_EXPOSURE_KINDS): the switches of its RBAC rules
(with rbac.create=false, whoever grants the rights sets the same switches). */}}
{{- define "kvfleet.exposureKinds" -}}
{{- $kinds := list -}}
{{- if .Values.rbac.ingress }}{{ $kinds = append $kinds "Ingress" }}{{ end -}}
{{- if .Values.rbac.httpRoute }}{{ $kinds = append $kinds "HTTPRoute" }}{{ end -}}
{{- if .Values.rbac.inferencePool }}{{ $kinds = append $kinds "InferencePool" }}{{ end -}}
{{- if .Values.rbac.keda }}{{ $kinds = append $kinds "ScaledObject" }}{{ end -}}
{{- join "," $kinds -}}
{{- end -}}

{{/*
The gateways' shared store as the operator reads it (KVFLEET_GATEWAY_SHARED_STORE, JSON): its URL, the
release namespace, and the Secrets that are named.
*/}}
{{- define "kvfleet.gatewaySharedStore" -}}
{{- $s := .Values.gatewaySharedStore -}}
{{- $out := dict "url" $s.url "namespace" .Release.Namespace -}}
{{- if $s.install.enabled -}}
{{- $url := printf "redis://%s.%s.svc:%d/0" (include "kvfleet.gatewayStoreName" .) .Release.Namespace (int $s.install.port) -}}
{{- $out = dict "url" $url "namespace" .Release.Namespace "passwordSecret" (dict "name" (include "kvfleet.gatewayStoreName" .) "key" "password") -}}
{{- else -}}
{{- if $s.passwordSecret.name }}{{- $_ := set $out "passwordSecret" $s.passwordSecret -}}{{- end -}}
{{- if $s.caSecret.name }}{{- $_ := set $out "caSecret" $s.caSecret -}}{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Whether the gateways have a shared store: one the platform runs (a URL) or the release's own. */}}
{{- define "kvfleet.hasGatewaySharedStore" -}}
{{- if or .Values.gatewaySharedStore.url .Values.gatewaySharedStore.install.enabled -}}true{{- end -}}
{{- end -}}

{{/* The release's own shared store (gatewaySharedStore.install): its Secret, Deployment and Service. */}}
{{- define "kvfleet.gatewayStoreName" -}}
{{- printf "%s-gateway-store" (include "kvfleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The Secrets of the gateways' shared store the operator may read (a JSON list; empty without a store).
*/}}
{{- define "kvfleet.gatewaySharedStoreSecrets" -}}
{{- $s := .Values.gatewaySharedStore -}}
{{- $names := list -}}
{{- if $s.install.enabled -}}
{{- $names = append $names (include "kvfleet.gatewayStoreName" .) -}}
{{- else if $s.url -}}
{{- if $s.passwordSecret.name }}{{- $names = append $names $s.passwordSecret.name -}}{{- end -}}
{{- if $s.caSecret.name }}{{- $names = append $names $s.caSecret.name -}}{{- end -}}
{{- end -}}
{{- $names | uniq | toJson -}}
{{- end -}}
