{{/* Labels on every object: the kustomize base carries app.kubernetes.io/part-of too. */}}
{{- define "hyperlight.labels" -}}
app.kubernetes.io/part-of: hyperlight
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

{{/* checkov's reasons for the checks that do not apply, shared by both DaemonSets. */}}
{{- define "hyperlight.checkovSkips" -}}
checkov.io/skip1: {{ printf "CKV_K8S_23=root (uid 0, no capabilities) is needed to create a socket in the kubelet's root-owned device-plugin directory%s" .cdi | quote }}
checkov.io/skip2: CKV_K8S_40=see CKV_K8S_23; a high uid cannot write the kubelet's directory
checkov.io/skip3: CKV_K8S_15=images are pinned by digest; IfNotPresent lets the plugin restart on a node that cannot reach the registry
{{- if not .root.Values.image.digest }}
checkov.io/skip4: CKV_K8S_43=image.digest is empty, so the image is referenced by tag (kind loads local images by tag)
{{- end }}
{{- end }}

{{/* Pod-level settings both DaemonSets share. */}}
{{- define "hyperlight.podSpec" -}}
priorityClassName: {{ .Values.priorityClassName }}
enableServiceLinks: false
hostNetwork: false
hostPID: false
hostIPC: false
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
nodeSelector:
  {{- toYaml .Values.nodeSelector | nindent 2 }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
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

{{/* Each agent's socket is named for its pod, so a successor registers beside it, and it serves on
     after SIGTERM until the successor is ready (handover.py). */}}
{{- define "hyperlight.handoverEnv" -}}
- name: HYPERLIGHT_INSTANCE
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: HYPERLIGHT_HANDOVER_SECONDS
  value: {{ .Values.handoverSeconds | quote }}
{{- end }}
