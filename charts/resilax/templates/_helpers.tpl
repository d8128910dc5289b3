{{/*
Names, labels and the RBAC rules of the Resilax chart.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "resilax.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The fully qualified app name (release-scoped), truncated to 63 characters (DNS names).
If the release name already contains the chart name it is used as is.
*/}}
{{- define "resilax.fullname" -}}
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

{{/* The operator's object names (Deployment, ClusterRole, Service ...). */}}
{{- define "resilax.operator.name" -}}
{{- printf "%s-operator" (include "resilax.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* chart label: name-version. */}}
{{- define "resilax.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels of every object. */}}
{{- define "resilax.labels" -}}
helm.sh/chart: {{ include "resilax.chart" . }}
{{ include "resilax.operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: resilax
{{- /* commonLabels, less the keys above (a duplicate key would replace the selector's labels). */}}
{{- with omit (.Values.commonLabels | default dict) "helm.sh/chart" "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" "app.kubernetes.io/version" "app.kubernetes.io/managed-by" "app.kubernetes.io/part-of" }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of the operator's pods (immutable in the Deployment: keep them stable). */}}
{{- define "resilax.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "resilax.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "resilax.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "resilax.operator.name" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: repository:tag (tag defaults to the chart's appVersion) or repository@digest. */}}
{{- define "resilax.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* The sidecar image the operator injects into worker pods (defaults to the operator's image). */}}
{{- define "resilax.sidecarImage" -}}
{{- if .Values.sidecar.image.repository }}
{{- printf "%s:%s" .Values.sidecar.image.repository (.Values.sidecar.image.tag | default .Chart.AppVersion) }}
{{- else }}
{{- include "resilax.image" . }}
{{- end }}
{{- end }}

{{/* The kopf peering object's name. */}}
{{- define "resilax.peeringName" -}}
{{- default (include "resilax.fullname" .) .Values.operator.leaderElection.peeringName }}
{{- end }}

{{/*
Whether the operator watches a list of namespaces ("true") or the whole cluster ("").
*/}}
{{/*
The spare slices' PriorityClass: spares.priorityClass.name, else `<fullname>-spare` (one per release:
two releases never fight over one cluster-scoped name).
*/}}
{{- define "resilax.sparePriorityClass" -}}
{{- .Values.spares.priorityClass.name | default (printf "%s-spare" (include "resilax.fullname" .)) -}}
{{- end -}}

{{- define "resilax.namespaced" -}}
{{- if .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
The operator's PolicyRules from files/operator-rules.yaml (the single source), as YAML.
Call with (dict "root" $ "scope" S), S one of:
  "all"        every rule (the ClusterRole when the operator watches all namespaces);
  "cluster"    the rules on cluster-scoped resources (the ClusterRole in namespaced mode), and node
               Leases (they live in kube-node-lease, never a watched namespace);
  "namespaced" the rules on namespaced resources (the Role per watched namespace).
A rule that mixes cluster-scoped and namespaced resources cannot be split and fails the render.
*/}}
{{- define "resilax.operatorRules" -}}
{{- $clusterScoped := list "nodes" "leases" "namespaces" "customresourcedefinitions" "clusterkopfpeerings" -}}
{{- $rules := .root.Files.Get "files/operator-rules.yaml" | fromYamlArray -}}
{{- $out := list -}}
{{- range $rule := $rules -}}
{{- if not (kindIs "map" $rule) -}}
{{- fail (printf "files/operator-rules.yaml: every item must be a PolicyRule mapping, found %v" $rule) -}}
{{- end -}}
{{- $n := 0 -}}
{{- range $r := $rule.resources -}}
{{- if has $r $clusterScoped }}{{ $n = add1 $n }}{{ end -}}
{{- end -}}
{{- if and (gt $n 0) (lt $n (len $rule.resources)) -}}
{{- fail (printf "files/operator-rules.yaml: rule on %v mixes cluster-scoped and namespaced resources; split it" $rule.resources) -}}
{{- end -}}
{{- if or (eq $.scope "all") (and (eq $.scope "cluster") (gt $n 0)) (and (eq $.scope "namespaced") (eq $n 0)) -}}
{{- $out = append $out $rule -}}
{{- end -}}
{{- end -}}
{{- toYaml $out }}
{{- end }}
