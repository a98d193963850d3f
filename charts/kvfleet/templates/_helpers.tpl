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

{{- define "kvfleet.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{/* True when the Prometheus Operator's API is served (ServiceMonitor, PrometheusRule). */}}
{{- define "kvfleet.monitoringApi" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{/*
The namespaced rules of the operator: the kvfleet kinds it reconciles, the children it owns (created and
deleted by server-side apply, watched with a label selector), and Events. Shared by the ClusterRole (all
namespaces) and the per-namespace Roles (watchNamespaces).
*/}}
{{- define "kvfleet.namespacedRules" -}}
# ModelDeployments and Tenants: read, and patch (kopf adds and removes its finalizer on ModelDeployments).
- apiGroups: ["kvfleet.io"]
  resources: ["modeldeployments", "tenants"]
  verbs: ["get", "list", "watch", "patch", "update"]
# Their status subresource: written by server-side apply.
- apiGroups: ["kvfleet.io"]
  resources: ["modeldeployments/status", "tenants/status"]
  verbs: ["get", "patch"]
# Children of a ModelDeployment (tenant table, keys, gateway, engine pools) and the tenants' API-key
# Secrets the operator reads.
- apiGroups: [""]
  resources: ["configmaps", "secrets", "services", "serviceaccounts"]
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
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors", "podmonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end }}
# Events the operator and kopf post about the objects they handle.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
