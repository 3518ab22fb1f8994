{{/*
Base name of every object. It is the chart name (or nameOverride), NOT prefixed with the release name: the
upstream chart names its objects this way and `helm upgrade` from it must find the same objects.
*/}}
{{- define "hcsi.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hcsi.controllerName" -}}
{{- printf "%s-controllers" (include "hcsi.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hcsi.nodeServiceAccount" -}}
{{- printf "%s-node" (include "hcsi.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Selector labels. Deployment and DaemonSet selectors are immutable, so these are exactly upstream's:
app.kubernetes.io/name, app.kubernetes.io/instance, plus `component` per workload.
*/}}
{{- define "hcsi.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hcsi.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hcsi.controllerSelectorLabels" -}}
component: csi-controllers
{{ include "hcsi.selectorLabels" . }}
{{- end -}}

{{- define "hcsi.nodeSelectorLabels" -}}
component: csi-driver
{{ include "hcsi.selectorLabels" . }}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "hcsi.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "hcsi.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: harvester-csi-driver
{{- end -}}

{{/*
"<registry>/" for a repository when Rancher's system default registry is set and the repository does not name
a registry of its own. A repository names one when its first path component is a host, as container runtimes
read it: it contains "." or ":" or is "localhost" (registry.example.com/x, mirror:5000/x). Prefixing such a
repository again would give "<registry>/<registry>/...", which no runtime can pull.
Argument: list $ <repository>.
*/}}
{{- define "hcsi.registry" -}}
{{- $root := index . 0 -}}
{{- $repo := toString (index . 1) -}}
{{- $first := first (splitList "/" $repo) -}}
{{- $hasHost := and (contains "/" $repo) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) -}}
{{- with $root.Values.global.cattle.systemDefaultRegistry -}}
{{- if not $hasHost -}}{{ trimSuffix "/" . }}/{{- end -}}
{{- end -}}
{{- end -}}

{{/* Image reference of a {repository, tag} map: (list $ .Values.image.csi.attacher) */}}
{{- define "hcsi.image" -}}
{{- $root := index . 0 -}}
{{- $img := index . 1 -}}
{{- printf "%s%s:%s" (include "hcsi.registry" (list $root $img.repository)) $img.repository (toString ($img.tag | default $root.Chart.AppVersion)) -}}
{{- end -}}

{{- define "hcsi.driverImage" -}}
{{- include "hcsi.image" (list . .Values.image.harvester.csiDriver) -}}
{{- end -}}

{{/* imagePullSecrets from global.cattle.imagePullSecrets: plain names or {name: ...} objects, de-duplicated. */}}
{{- define "hcsi.imagePullSecrets" -}}
{{- $names := list -}}
{{- range .Values.global.cattle.imagePullSecrets -}}
{{- if kindIs "map" . -}}
{{- with .name }}{{ $names = append $names . }}{{ end -}}
{{- else if . -}}
{{- $names = append $names (toString .) -}}
{{- end -}}
{{- end -}}
{{- if $names -}}
imagePullSecrets:
{{- range uniq $names }}
  - name: {{ . | quote }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The path, inside the pods, of the host-cluster kubeconfig. */}}
{{- define "hcsi.cloudConfigFile" -}}/var/lib/harvester/cloud-provider-config{{- end -}}

{{/* The node plugin's socket directory on the host (upstream's path, kept so kubelet's registration stays valid). */}}
{{- define "hcsi.nodeSocketDir" -}}
{{- printf "%s/harvester-plugins/driver.harvesterhci.io" (trimSuffix "/" .Values.kubeletRootDir) -}}
{{- end -}}

{{/* Driver flags shared by both modes. */}}
{{- define "hcsi.commonDriverArgs" -}}
- --endpoint=unix:///csi/csi.sock
- --kubeconfig={{ include "hcsi.cloudConfigFile" . }}
{{- with .Values.hostStorageClass }}
- --host-storage-class={{ . }}
{{- end }}
- --kube-api-qps={{ .Values.kubeAPI.qps }}
- --kube-api-burst={{ .Values.kubeAPI.burst }}
{{- if .Values.metrics.enabled }}
- --metrics-address=:{{ .Values.metrics.port }}
{{- end }}
{{- if .Values.debug }}
- --debug
{{- end }}
{{- end -}}

{{/*
Whether the StorageClass `harvester` is marked default: isDefault, unless another StorageClass in the cluster
is already the default (a later choice of the admin that an upgrade must not undo). lookup returns nothing
in `helm template`, which then renders isDefault.
*/}}
{{- define "hcsi.storageClassIsDefault" -}}
{{- $default := .Values.storageClass.isDefault -}}
{{- if $default -}}
{{- $classes := lookup "storage.k8s.io/v1" "StorageClass" "" "" -}}
{{- range ($classes.items | default list) -}}
{{- if and (ne .metadata.name "harvester") (eq (index (.metadata.annotations | default dict) "storageclass.kubernetes.io/is-default-class") "true") -}}
{{- $default = false -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $default | toString -}}
{{- end -}}

{{/*
The parts every controller sidecar shares: socket, namespace for its lease, diagnostics port and a liveness
probe on its leader-election health check (a sidecar that lost its lease but did not exit gets restarted).
Argument: dict "root" $ "port" <int> "portName" <name, at most 15 characters>.
*/}}
{{- define "hcsi.sidecarCommon" -}}
{{- $root := .root -}}
env:
  - name: ADDRESS
    value: /csi/csi.sock
  - name: POD_NAMESPACE
    valueFrom:
      fieldRef:
        fieldPath: metadata.namespace
ports:
  - name: {{ .portName }}
    containerPort: {{ .port }}
livenessProbe:
  httpGet:
    path: /healthz/leader-election
    port: {{ .portName }}
  initialDelaySeconds: 10
  periodSeconds: 20
  timeoutSeconds: 10
  failureThreshold: 3
securityContext:
  {{- toYaml $root.Values.controller.containerSecurityContext | nindent 2 }}
resources:
  {{- toYaml $root.Values.controller.resources.sidecar | nindent 2 }}
volumeMounts:
  - name: socket-dir
    mountPath: /csi
{{- end -}}

{{/*
Stop early when the values cannot be this chart's:
- this chart's own values are missing: `helm upgrade --reuse-values` from the upstream chart renders with the
  upstream chart's values.yaml instead of this one's;
- the driver image is not this driver's: an image pinned for the upstream chart (rancher/harvester-csi-driver,
  or any tag below this fork's first release, 0.3.0) carried over by --reset-then-reuse-values would run the
  upstream binary with this chart's flags (--mode, --kube-api-qps, ...), which it does not know: a crash loop.
*/}}
{{- define "hcsi.validate" -}}
{{- range $key := list "hotplug" "kubeAPI" "metrics" "controller" "node" "storageClass" "volumeSnapshotClass" -}}
{{- if not (hasKey $.Values $key) -}}
{{- fail (printf "value %q is missing: upgrading from the upstream chart with --reuse-values keeps the old chart's defaults; use --reset-then-reuse-values or pass your values file instead" $key) -}}
{{- end -}}
{{- end -}}
{{- $img := .Values.image.harvester.csiDriver -}}
{{- $repo := trimSuffix "/" (toString $img.repository) -}}
{{- $ours := "harvester-csi/harvester-csi-driver" -}}
{{- $fix := printf "drop the override (--set image.harvester.csiDriver.repository=%s --set image.harvester.csiDriver.tag=) to get this chart's image" $ours -}}
{{- if not (or (eq $repo $ours) (hasSuffix (printf "/%s" $ours) $repo) $img.acceptRepository) -}}
{{- fail (printf "image.harvester.csiDriver.repository %q is not this driver's image (%s): with this chart's flags another driver, such as the upstream rancher/harvester-csi-driver, crash-loops. Values pinned for the upstream chart are carried over by --reset-then-reuse-values: %s. For this driver's image mirrored under another name, also set image.harvester.csiDriver.acceptRepository=true" $repo $ours $fix) -}}
{{- end -}}
{{- $tag := toString ($img.tag | default "") -}}
{{- if and (regexMatch "^v?[0-9]+\\.[0-9]+\\.[0-9]+" $tag) (semverCompare "< 0.3.0-0" (regexFind "^v?[0-9]+\\.[0-9]+\\.[0-9]+" $tag)) -}}
{{- fail (printf "image.harvester.csiDriver.tag %q is an upstream driver version (this driver starts at v0.3.0): %s" $tag $fix) -}}
{{- end -}}
{{- end -}}
