{{/* Names and labels. */}}
{{- define "rollout.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rollout.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "rollout.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "rollout.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rollout.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rollout.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rollout.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rollout.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rollout.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rollout.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The cluster-scoped RBAC objects carry the release namespace: two releases never clash. */}}
{{- define "rollout.clusterRoleName" -}}
{{- printf "%s-%s-worker" .Release.Namespace (include "rollout.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rollout.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "rollout.redisHost" -}}
{{- if .Values.hostNetwork -}}127.0.0.1{{- else -}}{{ include "rollout.fullname" . }}-redis{{- end -}}
{{- end -}}

{{/* The Secret holding ROLLOUT_REDIS_URL, and its key. */}}
{{- define "rollout.redisSecretName" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.existingSecret -}}
{{- .Values.externalRedis.existingSecret -}}
{{- else -}}
{{- include "rollout.fullname" . }}-redis-url
{{- end -}}
{{- end -}}

{{- define "rollout.redisSecretKey" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.existingSecret -}}
{{- .Values.externalRedis.existingSecretKey -}}
{{- else -}}url{{- end -}}
{{- end -}}

{{/* Placement of every Pod of the chart (workers, Flower, Redis, the test). */}}
{{- define "rollout.placement" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- end -}}

{{/* Environment of the workers, the test and Flower. */}}
{{- define "rollout.env" -}}
- name: ROLLOUT_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "rollout.redisSecretName" . }}
      key: {{ include "rollout.redisSecretKey" . }}
{{- with .Values.kubernetesApi.host }}
# The API server's address for the in-cluster configuration, when the Service address the
# kubelet injects is not reachable from Pods (see values.yaml: kubernetesApi).
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ required "kubernetesApi.port is required with kubernetesApi.host" $.Values.kubernetesApi.port | quote }}
{{- end }}
{{- range $name, $value := .Values.settings }}
{{- if ne (toString $value) "" }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "rollout.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "rollout.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "rollout.tlsVolume" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.tls.caSecret }}
- name: redis-tls
  secret:
    secretName: {{ .Values.externalRedis.tls.caSecret }}
{{- end }}
{{- end -}}

{{- define "rollout.tlsMount" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.tls.caSecret }}
- name: redis-tls
  mountPath: /etc/rollout/redis-tls
  readOnly: true
{{- end }}
{{- end -}}
