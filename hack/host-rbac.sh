#!/usr/bin/env bash
# Creates the Harvester-side identity of the CSI driver for a guest cluster and writes the kubeconfig the
# driver reads (/var/lib/harvester/cloud-provider-config), for installs where Rancher did not provide one.
# See docs/host-rbac.md for what the identity is granted and why.
#
# On the Harvester (host) cluster it creates, idempotently:
#   ServiceAccount      <sa> in <namespace>                       (the namespace of the guest cluster's VMs)
#   RoleBinding         <sa> in <namespace> -> ClusterRole harvesterhci.io:cloudprovider
#   ClusterRoleBinding  <namespace>-<sa>-csi-driver -> ClusterRole harvesterhci.io:csi-driver
#   Role/RoleBinding    harvester-csi-driver:hotplug-requests: patch virtualmachines/status in <namespace>
#   Secret              <sa>-token in <namespace>: a long-lived token of the ServiceAccount
#   (with --kubevirt-read) ClusterRole harvester-csi-driver:kubevirt-reader and its binding
# and writes a kubeconfig whose context namespace is <namespace>. With --guest-kubeconfig it also stores the
# kubeconfig in the guest cluster as Secret <secret-name> (key cloud-provider-config), ready for the chart's
# cloudConfig.secretName.
set -euo pipefail

usage() {
	cat <<'EOF'
usage: hack/host-rbac.sh --namespace NS [options]

  --namespace NS           Harvester namespace of the guest cluster's VMs (required)
  --host-kubeconfig FILE   kubeconfig of the Harvester cluster (default: $KUBECONFIG or ~/.kube/config)
  --host-context NAME      context in that kubeconfig (default: its current context)
  --service-account NAME   ServiceAccount to create (default: harvester-csi-driver)
  --server URL             Harvester API URL written into the kubeconfig (default: the host kubeconfig's)
  --output FILE            write the kubeconfig here (default: stdout, unless --guest-kubeconfig is given)
  --guest-kubeconfig FILE  also create/update the Secret in the guest cluster with this kubeconfig
  --secret-name NAME       guest Secret name (default: harvester-cloud-config)
  --secret-namespace NS    guest Secret namespace (default: kube-system)
  --kubevirt-read          also grant reading KubeVirt CRs, for exact hotplug backend detection
  --timeout SECONDS        how long to wait for the token (default: 60)
EOF
}

namespace="" host_kubeconfig="${KUBECONFIG:-$HOME/.kube/config}" host_context="" sa="harvester-csi-driver"
server="" output="" guest_kubeconfig="" secret_name="harvester-cloud-config" secret_namespace="kube-system"
kubevirt_read=false timeout=60
while [ $# -gt 0 ]; do
	case "$1" in
	--namespace) namespace=$2; shift 2 ;;
	--host-kubeconfig) host_kubeconfig=$2; shift 2 ;;
	--host-context) host_context=$2; shift 2 ;;
	--service-account) sa=$2; shift 2 ;;
	--server) server=$2; shift 2 ;;
	--output) output=$2; shift 2 ;;
	--guest-kubeconfig) guest_kubeconfig=$2; shift 2 ;;
	--secret-name) secret_name=$2; shift 2 ;;
	--secret-namespace) secret_namespace=$2; shift 2 ;;
	--kubevirt-read) kubevirt_read=true; shift ;;
	--timeout) timeout=$2; shift 2 ;;
	-h | --help) usage; exit 0 ;;
	*) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
	esac
done
[ -n "$namespace" ] || { echo "--namespace is required" >&2; usage >&2; exit 2; }
command -v kubectl >/dev/null || { echo "kubectl is required" >&2; exit 1; }

host=(kubectl --kubeconfig "$host_kubeconfig")
[ -z "$host_context" ] || host+=(--context "$host_context")
log() { echo "host-rbac: $*" >&2; }

"${host[@]}" get namespace "$namespace" >/dev/null ||
	{ log "namespace $namespace does not exist on the Harvester cluster"; exit 1; }
for role in harvesterhci.io:cloudprovider harvesterhci.io:csi-driver; do
	"${host[@]}" get clusterrole "$role" >/dev/null 2>&1 ||
		{ log "ClusterRole $role does not exist: is this a Harvester cluster (v1.2 or later)?"; exit 1; }
done

crb="${namespace}-${sa}-csi-driver"
log "creating ServiceAccount $namespace/$sa and its bindings"
"${host[@]}" apply -f - >&2 <<EOF
apiVersion: v1
kind: ServiceAccount
metadata:
  name: ${sa}
  namespace: ${namespace}
  labels:
    app.kubernetes.io/managed-by: harvester-csi-driver-host-rbac
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: ${sa}
  namespace: ${namespace}
  labels:
    app.kubernetes.io/managed-by: harvester-csi-driver-host-rbac
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: harvesterhci.io:cloudprovider
subjects:
  - kind: ServiceAccount
    name: ${sa}
    namespace: ${namespace}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: ${crb}
  labels:
    app.kubernetes.io/managed-by: harvester-csi-driver-host-rbac
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: harvesterhci.io:csi-driver
subjects:
  - kind: ServiceAccount
    name: ${sa}
    namespace: ${namespace}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: harvester-csi-driver:hotplug-requests
  namespace: ${namespace}
  labels:
    app.kubernetes.io/managed-by: harvester-csi-driver-host-rbac
rules:
  # Withdraw a legacy add request that a webhook refused: it blocks every later hotplug on the VM.
  - apiGroups: ["kubevirt.io"]
    resources: ["virtualmachines/status"]
    verbs: ["patch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: ${sa}-hotplug-requests
  namespace: ${namespace}
  labels:
    app.kubernetes.io/managed-by: harvester-csi-driver-host-rbac
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: harvester-csi-driver:hotplug-requests
subjects:
  - kind: ServiceAccount
    name: ${sa}
    namespace: ${namespace}
---
apiVersion: v1
kind: Secret
type: kubernetes.io/service-account-token
metadata:
  name: ${sa}-token
  namespace: ${namespace}
  labels:
    app.kubernetes.io/managed-by: harvester-csi-driver-host-rbac
  annotations:
    kubernetes.io/service-account.name: ${sa}
EOF

if $kubevirt_read; then
	log "granting read access to KubeVirt CRs"
	"${host[@]}" apply -f - >&2 <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: harvester-csi-driver:kubevirt-reader
  labels:
    app.kubernetes.io/managed-by: harvester-csi-driver-host-rbac
rules:
  - apiGroups: ["kubevirt.io"]
    resources: ["kubevirts"]
    verbs: ["get", "list"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: ${namespace}-${sa}-kubevirt-reader
  labels:
    app.kubernetes.io/managed-by: harvester-csi-driver-host-rbac
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: harvester-csi-driver:kubevirt-reader
subjects:
  - kind: ServiceAccount
    name: ${sa}
    namespace: ${namespace}
EOF
fi

log "waiting for the token of $namespace/$sa"
token=""
for ((i = 0; i < timeout; i++)); do
	token=$("${host[@]}" -n "$namespace" get secret "${sa}-token" -o 'jsonpath={.data.token}' 2>/dev/null || true)
	[ -n "$token" ] && break
	sleep 1
done
[ -n "$token" ] || { log "the token controller did not fill Secret $namespace/${sa}-token within ${timeout}s"; exit 1; }
token=$(printf '%s' "$token" | base64 -d)
ca=$("${host[@]}" -n "$namespace" get secret "${sa}-token" -o 'jsonpath={.data.ca\.crt}')

# Server URL and, when the token Secret has no CA, the CA of the host kubeconfig's current cluster.
[ -n "$server" ] || server=$("${host[@]}" config view --minify -o 'jsonpath={.clusters[0].cluster.server}')
if [ -z "$ca" ]; then
	ca=$("${host[@]}" config view --minify --raw -o 'jsonpath={.clusters[0].cluster.certificate-authority-data}')
fi
[ -n "$server" ] || { log "no server URL: pass --server"; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
kc="$tmp/cloud-provider-config"
kcfg=(kubectl --kubeconfig "$kc")
name=harvester
"${kcfg[@]}" config set-cluster "$name" --server="$server" >/dev/null
if [ -n "$ca" ]; then
	"${kcfg[@]}" config set "clusters.${name}.certificate-authority-data" "$ca" >/dev/null
fi
"${kcfg[@]}" config set-credentials "${sa}" --token="$token" >/dev/null
"${kcfg[@]}" config set-context "${sa}@${name}" --cluster="$name" --user="${sa}" --namespace="$namespace" >/dev/null
"${kcfg[@]}" config use-context "${sa}@${name}" >/dev/null
chmod 0600 "$kc"

if [ -n "$output" ]; then
	install -m 0600 "$kc" "$output"
	log "wrote $output"
elif [ -z "$guest_kubeconfig" ]; then
	cat "$kc"
fi

if [ -n "$guest_kubeconfig" ]; then
	guest=(kubectl --kubeconfig "$guest_kubeconfig")
	"${guest[@]}" -n "$secret_namespace" create secret generic "$secret_name" \
		--from-file=cloud-provider-config="$kc" --dry-run=client -o yaml | "${guest[@]}" apply -f - >&2
	log "stored the kubeconfig in the guest cluster as Secret $secret_namespace/$secret_name"
	log "install the chart with: --set cloudConfig.secretName=$secret_name (namespace $secret_namespace)"
fi
