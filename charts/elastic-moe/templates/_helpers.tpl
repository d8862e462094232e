{{- define "elastic-moe.labels" -}}
app.kubernetes.io/name: moe-operator
app.kubernetes.io/part-of: elastic-moe
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "elastic-moe.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default "moe-operator" -}}
{{- end -}}
