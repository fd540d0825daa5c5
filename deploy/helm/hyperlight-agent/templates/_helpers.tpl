{{/* "hyperlight", or nameOverride: app.kubernetes.io/part-of, and the names' prefix. */}}
{{- define "hyperlight.name" -}}
{{ .Values.nameOverride | default "hyperlight" }}
{{- end }}

{{/* The prefix of every object's name and of the component labels: fullnameOverride, else the name. */}}
{{- define "hyperlight.fullname" -}}
{{ .Values.fullnameOverride | default (include "hyperlight.name" .) }}
{{- end }}

{{/* The namespace of every namespaced object. */}}
{{- define "hyperlight.namespace" -}}
{{ .Values.namespaceOverride | default .Release.Namespace }}
{{- end }}

{{/* One component's name (object name and app.kubernetes.io/name): (dict "root" $ "component" "device-plugin"). */}}
{{- define "hyperlight.component" -}}
{{ printf "%s-%s" (include "hyperlight.fullname" .root) .component }}
{{- end }}

{{/* The DRA driver's service account. */}}
{{- define "hyperlight.draServiceAccount" -}}
{{ .Values.serviceAccount.name | default (include "hyperlight.component" (dict "root" . "component" "dra-driver")) }}
{{- end }}

{{/* Labels on every object: the kustomize base carries app.kubernetes.io/part-of too. */}}
{{- define "hyperlight.labels" -}}
app.kubernetes.io/part-of: {{ include "hyperlight.name" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* repository@digest, or repository:tag when no digest is given. */}}
{{- define "hyperlight.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
{{- end }}

{{/* checkov's reasons for the checks that do not apply, shared by the DaemonSets. */}}
{{- define "hyperlight.checkovSkips" -}}
checkov.io/skip1: {{ printf "CKV_K8S_23=root (uid 0, no capabilities) is needed to create a socket in the kubelet's root-owned device-plugin directory%s" .cdi | quote }}
checkov.io/skip2: CKV_K8S_40=see CKV_K8S_23; a high uid cannot write the kubelet's directory
checkov.io/skip3: CKV_K8S_15=images are pinned by digest; IfNotPresent lets the plugin restart on a node that cannot reach the registry
{{- if not .root.Values.image.digest }}
checkov.io/skip4: CKV_K8S_43=image.digest is empty, so the image is referenced by tag (kind loads local images by tag)
{{- end }}
{{- end }}

{{/* A DaemonSet's update strategy (the values say why the surge matters). */}}
{{- define "hyperlight.updateStrategy" -}}
{{- if eq .Values.updateStrategy.type "OnDelete" }}
type: OnDelete
{{- else }}
type: RollingUpdate
rollingUpdate:
  {{- toYaml .Values.updateStrategy.rollingUpdate | nindent 2 }}
{{- end }}
{{- end }}

{{/* A DaemonSet's pod labels and annotations: (dict "root" $ "component" "device-plugin"). */}}
{{- define "hyperlight.podMetadata" -}}
{{- range $key := list "app.kubernetes.io/name" "app.kubernetes.io/part-of" }}
{{- if hasKey $.root.Values.podLabels $key }}
{{- fail (printf "podLabels: %s is the chart's own label (it selects each DaemonSet's pods)" $key) }}
{{- end }}
{{- end }}
labels:
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  app.kubernetes.io/name: {{ include "hyperlight.component" . }}
  app.kubernetes.io/part-of: {{ include "hyperlight.name" .root }}
{{- with .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod-level settings the DaemonSets share. */}}
{{- define "hyperlight.podSpec" -}}
priorityClassName: {{ .Values.priorityClassName }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
enableServiceLinks: false
hostNetwork: false
hostPID: false
hostIPC: false
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
nodeSelector:
  {{- toYaml .Values.nodeSelector | nindent 2 }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- with .Values.podSecurityContext }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  runAsUser: 0
  runAsGroup: 0
  runAsNonRoot: false
  seccompProfile:
    type: RuntimeDefault
{{- end }}

{{/* The container security context: fixed, never a value. */}}
{{- define "hyperlight.containerSecurityContext" -}}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Every agent's first settings. Its socket is named for its pod, so a successor registers beside
     it, and it serves on after SIGTERM until the successor is ready (handover.py). */}}
{{- define "hyperlight.agentEnv" -}}
- name: HYPERLIGHT_INSTANCE
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: HYPERLIGHT_HANDOVER_SECONDS
  value: {{ .Values.handoverSeconds | quote }}
- name: HYPERLIGHT_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{- end }}

{{/* The agent's metrics endpoint (with metrics on): its env, and its port (named for the monitors). */}}
{{- define "hyperlight.metricsEnv" -}}
- name: HYPERLIGHT_METRICS_ADDRESS
  value: {{ printf "0.0.0.0:%d" (int .Values.metrics.port) | quote }}
{{- end }}
{{- define "hyperlight.metricsPort" -}}
ports:
  - name: metrics
    containerPort: {{ .Values.metrics.port }}
    protocol: TCP
{{- end }}

{{/* The kubelet's root directory: the DRA driver's kubelet directories follow it. */}}
{{- define "hyperlight.kubeletRootDir" -}}
{{ .Values.kubeletRootDir | trimSuffix "/" }}
{{- end }}

{{/* The DaemonSets this mode installs, as component names (device-access always). */}}
{{- define "hyperlight.components" -}}
{{- $components := list "device-access" }}
{{- if ne .Values.mode "dra" }}{{ $components = append $components "device-plugin" }}{{ end }}
{{- if ne .Values.mode "devicePlugin" }}{{ $components = append $components "dra-driver" }}{{ end }}
{{- join " " $components }}
{{- end }}

{{/* Whether prometheus-operator's API is served (its objects fail to install elsewhere). */}}
{{- define "hyperlight.monitoringServed" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- end }}

{{/* The scrape targets' job: the DaemonSet's name (app.kubernetes.io/name), whichever monitor. */}}
{{- define "hyperlight.jobRelabeling" -}}
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_name]
  targetLabel: job
{{- end }}
