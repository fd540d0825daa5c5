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

{{/* The image's digest, first set wins: image.digest; none when image.tag is set; else
     image.releaseDigest, a released chart's own image (`make release` writes it). A chart from a
     checkout has none: it runs its appVersion's tag (hyperlight.imageTag). An all-zero digest (the
     kustomize base's unpullable placeholder) names no image and is refused in one line; matched by
     its shape, so that a released chart holds no copy of it (make release refuses one). */}}
{{- define "hyperlight.imageDigest" -}}
{{- $image := .Values.image }}
{{- $digest := $image.digest | default (ternary "" ($image.releaseDigest | default "") (ne ($image.tag | default "") "")) }}
{{- if regexMatch "^sha256:0{64}$" $digest }}
{{- fail "image: sha256:000…000 is the placeholder digest of a checkout, not an image: set image.digest to your image's digest (make image prints it), or image.tag" }}
{{- end }}
{{- $digest }}
{{- end }}

{{/* The image's tag: image.tag; else, with no digest either (a chart from a checkout), the chart's
     appVersion, the tag the release of this version pushes (packaging/release.py). */}}
{{- define "hyperlight.imageTag" -}}
{{- .Values.image.tag | default (ternary .Chart.AppVersion "" (eq (include "hyperlight.imageDigest" .) "")) }}
{{- end }}

{{/* repository[:tag][@digest]: the digest decides what runs; a tag beside it is for reading. */}}
{{- define "hyperlight.image" -}}
{{- .Values.image.repository }}{{ with include "hyperlight.imageTag" . }}:{{ . }}{{ end }}{{ with include "hyperlight.imageDigest" . }}@{{ . }}{{ end }}
{{- end }}

{{/* checkov's reasons for the checks that do not apply, shared by the DaemonSets. */}}
{{- define "hyperlight.checkovSkips" -}}
checkov.io/skip1: {{ printf "CKV_K8S_23=root (uid 0, no capabilities) is needed to create a socket in the kubelet's root-owned device-plugin directory%s" .cdi | quote }}
checkov.io/skip2: CKV_K8S_40=see CKV_K8S_23; a high uid cannot write the kubelet's directory
checkov.io/skip3: CKV_K8S_15=images are pinned by digest; IfNotPresent lets the plugin restart on a node that cannot reach the registry
{{- if not (include "hyperlight.imageDigest" .root) }}
checkov.io/skip4: CKV_K8S_43=no digest is set, so the image is referenced by tag (kind loads local images by tag; a chart from a checkout runs its appVersion's tag)
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

{{/* The most an agent's stop takes after its handover, in whole seconds: its side's close, then
     its helper's (agent.shutdown_bound_s; tests/test_helm.py checks this covers it). */}}
{{- define "hyperlight.stopSeconds" -}}
11
{{- end }}

{{/* Pod-level settings the DaemonSets share. */}}
{{- define "hyperlight.podSpec" -}}
{{- $least := add (int .Values.handoverSeconds) (int (include "hyperlight.stopSeconds" .)) }}
{{- if lt (int .Values.terminationGracePeriodSeconds) (int $least) }}
{{- fail (printf "terminationGracePeriodSeconds: %d is shorter than handoverSeconds (%d) plus the agent's own stop after it (%s s), so the kubelet would kill agents mid-stop: set it to %d or more, or lower handoverSeconds" (int .Values.terminationGracePeriodSeconds) (int .Values.handoverSeconds) (include "hyperlight.stopSeconds" .) (int $least)) }}
{{- end }}
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

{{/* Every agent's first settings: (dict "root" $ "mode" "plugin"). Its socket is named for its pod,
     so a successor registers beside it, and it serves on after SIGTERM until the successor is
     ready (handover.py). The mode is in the environment as well as the arguments: `kubectl exec
     POD -- hyperlight-agent --check` gets the container's environment, not its arguments, and
     checks what that mode needs. */}}
{{- define "hyperlight.agentEnv" -}}
- name: HYPERLIGHT_MODE
  value: {{ .mode }}
- name: HYPERLIGHT_INSTANCE
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: HYPERLIGHT_HANDOVER_SECONDS
  value: {{ .root.Values.handoverSeconds | quote }}
- name: HYPERLIGHT_LOG_LEVEL
  value: {{ .root.Values.logLevel | quote }}
- name: HYPERLIGHT_LOG_FORMAT
  value: {{ .root.Values.logFormat | quote }}
- name: HYPERLIGHT_PROBE_ADDRESS
  value: {{ printf "0.0.0.0:%d" (int .root.Values.probes.port) | quote }}
{{- end }}

{{/* The kubelet's probes: HTTP GETs the agent answers from its own state on the pod's IP (no
     process per probe: BENCHMARKS.md, "Probe cost"; readiness every 10 s, for the surge update's
     sake, and liveness every 60 s keep them at about a tenth of the idle agent's CPU). The exec form
     (hyperlight-agent --health-check=...) still works, for hosts and older manifests. */}}
{{- define "hyperlight.probes" -}}
{{- if eq (int .Values.probes.port) (int .Values.metrics.port) }}
{{- fail "probes.port: must differ from metrics.port (each is its own containerPort)" }}
{{- end }}
livenessProbe:
  httpGet:
    path: /livez
    port: probes
  initialDelaySeconds: 5
  # A hung agent fails readiness within 30 s; liveness restarts it after 3 minutes (rare: a
  # probe a minute keeps the probes' cost under a tenth of the idle agent's).
  periodSeconds: 60
  timeoutSeconds: 5
readinessProbe:
  httpGet:
    path: /readyz
    port: probes
  periodSeconds: 10
  timeoutSeconds: 5
{{- end }}

{{/* The agent's metrics endpoint (with metrics on): its env, and its port (named for the monitors). */}}
{{- define "hyperlight.metricsEnv" -}}
- name: HYPERLIGHT_METRICS_ADDRESS
  value: {{ printf "0.0.0.0:%d" (int .Values.metrics.port) | quote }}
{{- end }}
{{/* The container's ports: the probes' always, the metrics' with metrics on. */}}
{{- define "hyperlight.ports" -}}
ports:
  - name: probes
    containerPort: {{ .Values.probes.port }}
    protocol: TCP
{{- if .Values.metrics.enabled }}
  - name: metrics
    containerPort: {{ .Values.metrics.port }}
    protocol: TCP
{{- end }}
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

{{/* This release's documentation, where a user who installed the chart from its registry can read
     it: the project's repository at the release's tag. */}}
{{- define "hyperlight.docs" -}}
https://github.com/hyperlight-dev/hyperlight-agent/blob/v{{ .Chart.AppVersion }}/docs
{{- end }}
