{{/*
Chart name, overridable with nameOverride. Kubernetes names are at most 63 characters.
*/}}
{{- define "tinybroker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's resources: RELEASE-CHART, or RELEASE alone when it
already contains the chart name ("tinybroker" for `helm install tinybroker`).
*/}}
{{- define "tinybroker.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "tinybroker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every resource.
*/}}
{{- define "tinybroker.labels" -}}
helm.sh/chart: {{ include "tinybroker.chart" . }}
{{ include "tinybroker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: tinybroker
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels that select the broker pod; they must never change between upgrades.
*/}}
{{- define "tinybroker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tinybroker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
ServiceAccount the broker runs as.
*/}}
{{- define "tinybroker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tinybroker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Broker image reference: repository@digest, or repository:tag (tag defaults to appVersion).
*/}}
{{- define "tinybroker.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Label that lets a pod through the NetworkPolicy to the gRPC port: <fullname>-client=true.
*/}}
{{- define "tinybroker.clientLabel" -}}
{{- printf "%s-client" (include "tinybroker.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{/*
Secret holding the auth token: the existing one, or the one this chart creates.
*/}}
{{- define "tinybroker.authSecretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else }}
{{- printf "%s-auth" (include "tinybroker.fullname" . | trunc 58 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{/*
Key of the token in that Secret.
*/}}
{{- define "tinybroker.authSecretKey" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecretKey }}
{{- else -}}
token
{{- end }}
{{- end }}

{{/*
Secret holding the TLS certificate and key.
*/}}
{{- define "tinybroker.tlsSecretName" -}}
{{- if .Values.tls.existingSecret }}
{{- .Values.tls.existingSecret }}
{{- else }}
{{- printf "%s-tls" (include "tinybroker.fullname" . | trunc 59 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{/*
Where the TLS Secret is mounted in the broker container.
*/}}
{{- define "tinybroker.tlsMountPath" -}}
/etc/tinybroker/tls
{{- end }}

{{/*
terminationGracePeriodSeconds: the broker's drain time plus a margin (at least
one second), so the drain always finishes before the kubelet sends SIGKILL.
*/}}
{{- define "tinybroker.terminationGracePeriodSeconds" -}}
{{- add (int .Values.config.shutdownGraceSeconds) (max 1 (int .Values.terminationGraceMarginSeconds)) }}
{{- end }}

{{/*
The auth token as an EnvVar read from the Secret, when auth is on.
*/}}
{{- define "tinybroker.authTokenEnv" -}}
{{- if .Values.auth.enabled }}
- name: TINYBROKER_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tinybroker.authSecretName" . }}
      key: {{ include "tinybroker.authSecretKey" . }}
{{- end }}
{{- end }}

{{/*
Fails rendering on value combinations that cannot work.
*/}}
{{- define "tinybroker.validateValues" -}}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) (not .Values.auth.token) }}
{{- fail "auth.enabled needs auth.existingSecret or auth.token" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) (or (not .Values.tls.cert) (not .Values.tls.key)) }}
{{- fail "tls.enabled needs tls.existingSecret, or both tls.cert and tls.key" }}
{{- end }}
{{- if and .Values.tls.enabled (eq .Values.probes.type "grpc") }}
{{- fail "tls.enabled needs probes.type=exec: kubelet's native gRPC probes cannot speak TLS" }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.nats.url) }}
{{- fail "replicaCount > 1 needs nats.url (cluster mode): without NATS the replicas would be separate in-memory brokers, each with some of the publishers and subscribers" }}
{{- end }}
{{- if and (not .Values.nats.url) (or .Values.nats.tokenSecret.name .Values.nats.credsSecret.name .Values.nats.caSecret.name) }}
{{- fail "nats.tokenSecret, nats.credsSecret and nats.caSecret need nats.url (cluster mode)" }}
{{- end }}
{{- end }}

{{/*
"true" in cluster mode (nats.url set: several replicas over a NATS cluster),
"" in single-node mode. Use as `if include "tinybroker.clusterMode" .`.
*/}}
{{- define "tinybroker.clusterMode" -}}
{{- if .Values.nats.url }}true{{ end }}
{{- end }}

{{/*
Where the NATS credentials file and CA certificate are mounted.
*/}}
{{- define "tinybroker.natsCredsPath" -}}
/etc/tinybroker/nats-creds/nats.creds
{{- end }}
{{- define "tinybroker.natsCaPath" -}}
/etc/tinybroker/nats-ca/ca.crt
{{- end }}

{{/*
Cluster mode's environment: TINYBROKER_NATS_* from nats.*, and the pod's name
as TINYBROKER_REPLICA_ID (downward API), so that Admin listings, logs and
forwarded calls name the replica by its pod.
*/}}
{{- define "tinybroker.clusterEnv" -}}
- name: TINYBROKER_NATS_URL
  value: {{ .Values.nats.url | quote }}
- name: TINYBROKER_NATS_PREFIX
  value: {{ .Values.nats.prefix | quote }}
- name: TINYBROKER_NATS_REPLICAS
  value: {{ .Values.nats.replicas | int64 | quote }}
- name: TINYBROKER_REPLICA_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- with .Values.nats.tokenSecret }}
{{- if .name }}
- name: TINYBROKER_NATS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- if .Values.nats.credsSecret.name }}
- name: TINYBROKER_NATS_CREDS
  value: {{ include "tinybroker.natsCredsPath" . }}
{{- end }}
{{- if .Values.nats.caSecret.name }}
- name: TINYBROKER_NATS_CA
  value: {{ include "tinybroker.natsCaPath" . }}
{{- end }}
{{- end }}

{{/*
Cluster mode's topologySpreadConstraints: the replicas of one revision spread
over nodes and zones (matchLabelKeys pod-template-hash: during a rollout the
new ReplicaSet's pods spread among themselves, not counted against the old
ones that are about to go).
*/}}
{{- define "tinybroker.topologySpread" -}}
{{- $root := . }}
{{- range $key, $when := dict "kubernetes.io/hostname" .Values.topologySpread.hostname "topology.kubernetes.io/zone" .Values.topologySpread.zone }}
- maxSkew: 1
  topologyKey: {{ $key }}
  whenUnsatisfiable: {{ $when }}
  labelSelector:
    matchLabels:
      {{- include "tinybroker.selectorLabels" $root | nindent 6 }}
  matchLabelKeys:
    - pod-template-hash
{{- end }}
{{- end }}

{{/*
One health probe against grpc.health.v1.Health on the gRPC port. Takes a dict:
root (the chart context), service (health service name), probe (timing values).
probes.type=grpc uses kubelet's native gRPC probe; exec runs grpc_health_probe
from the image, which also works with TLS.
*/}}
{{- define "tinybroker.probe" -}}
{{- $root := .root }}
{{- if eq $root.Values.probes.type "exec" }}
exec:
  command:
    - /usr/local/bin/grpc_health_probe
    - -addr={{ if contains ":" $root.Values.config.bindAddress }}[::1]{{ else }}127.0.0.1{{ end }}:{{ $root.Values.ports.grpc }}
    {{- if .service }}
    - -service={{ .service }}
    {{- end }}
    - -connect-timeout={{ .probe.timeoutSeconds }}s
    - -rpc-timeout={{ .probe.timeoutSeconds }}s
    {{- if $root.Values.tls.enabled }}
    - -tls
    - -tls-no-verify
    {{- end }}
{{- else }}
grpc:
  port: {{ $root.Values.ports.grpc }}
  service: {{ .service | quote }}
{{- end }}
initialDelaySeconds: {{ .probe.initialDelaySeconds }}
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end }}

{{/*
Restricted container securityContext (Pod Security Standard "restricted").
*/}}
{{- define "tinybroker.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}
