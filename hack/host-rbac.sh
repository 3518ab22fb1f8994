#!/usr/bin/env bash
# The Harvester-side identity of the CSI driver of one guest cluster, with exactly the access the driver's code
# uses, in the namespace of the guest cluster's VMs (and, for RWX volumes, Harvester's NetworkFilesystems in
# harvester-system). See docs/host-rbac.md for every rule and the call that
# needs it.
#
# Modes:
#   (default)   create or update the driver's own ServiceAccount and its grants on the Harvester cluster, issue
#               a token of bounded lifetime (TokenRequest) and write the kubeconfig the driver reads
#               (--output FILE and/or the guest Secret with --guest-kubeconfig). Re-running it is the rotation.
#   --rotate    only issue a new token and rewrite the kubeconfig; the grants are left alone.
#   --existing-service-account NAME
#               an identity someone else made, such as the one Rancher created for the guest cluster's cloud
#               provider: grant only what it lacks (e.g. virtualmachines/status); no token, no kubeconfig.
#   --storage-read
#               also grant the optional reads of the host storage path (PVs, Longhorn volumes and their
#               attachment tickets, Events in the VM namespace) behind ControllerGetVolume's volume condition and
#               diagnose's host storage findings.
#   --print     print the RBAC objects of the default mode and exit, without contacting any cluster.
#   --revoke    delete the identity: its ServiceAccount (its tokens die with it) and every binding and per-identity
#               role this script made for it, then the shared roles no binding uses any more; prints each deletion.
#
# Every object carries the label app.kubernetes.io/managed-by=harvester-csi-driver-host-rbac.
set -euo pipefail

usage() {
	cat <<'EOF'
usage: hack/host-rbac.sh --namespace NS [options]

  --namespace NS           Harvester namespace of the guest cluster's VMs (required)
  --host-kubeconfig FILE   kubeconfig of the Harvester cluster (default: $KUBECONFIG or ~/.kube/config)
  --host-context NAME      context in that kubeconfig (default: its current context)
  --service-account NAME   the driver's ServiceAccount (default: harvester-csi-driver)
  --token-duration DUR     lifetime of the token, e.g. 720h (default: 2160h, 90 days); the API server may
                           shorten it (--service-account-max-token-expiration)
  --server URL             Harvester API URL written into the kubeconfig (default: the host kubeconfig's)
  --output FILE            write the kubeconfig here (default: stdout, unless --guest-kubeconfig is given)
  --guest-kubeconfig FILE  also create/update the Secret in the guest cluster with this kubeconfig
  --guest-context NAME     context in the guest kubeconfig (default: its current context)
  --secret-name NAME       guest Secret name (default: harvester-cloud-config)
  --secret-namespace NS    guest Secret namespace (default: kube-system)
  --restart                after updating the guest Secret, restart the driver (rollout restart of
                           deploy/harvester-csi-driver-controllers and ds/harvester-csi-driver); without it the
                           driver takes the new token once the kubelet has updated the mounted Secret
  --kubevirt-read          also grant listing KubeVirt CRs (cluster-wide), for exact hotplug backend detection
  --storage-read           also grant reading the host storage path: PVs (cluster-wide), Longhorn volumes and
                           attachments (longhorn-system), Events (VM namespace), for the volume condition and diagnose
  --rotate                 only issue a new token and rewrite the kubeconfig / guest Secret
  --existing-service-account NAME
                           grant an existing identity (e.g. Rancher's) only what it lacks; no token
  --print                  print the RBAC objects and exit (no cluster needed)
  --revoke                 delete the ServiceAccount and every binding this script made for it (with
                           --existing-service-account NAME: only what the script granted, never the account)
EOF
}

namespace="" host_kubeconfig="${KUBECONFIG:-$HOME/.kube/config}" host_context="" sa="harvester-csi-driver"
duration="2160h" server="" output="" guest_kubeconfig="" guest_context="" secret_name="harvester-cloud-config"
secret_namespace="kube-system" restart=false kubevirt_read=false rotate=false existing="" print=false
revoke=false storage_read=false
while [ $# -gt 0 ]; do
	case "$1" in
	--namespace) namespace=$2; shift 2 ;;
	--host-kubeconfig) host_kubeconfig=$2; shift 2 ;;
	--host-context) host_context=$2; shift 2 ;;
	--service-account) sa=$2; shift 2 ;;
	--token-duration) duration=$2; shift 2 ;;
	--server) server=$2; shift 2 ;;
	--output) output=$2; shift 2 ;;
	--guest-kubeconfig) guest_kubeconfig=$2; shift 2 ;;
	--guest-context) guest_context=$2; shift 2 ;;
	--secret-name) secret_name=$2; shift 2 ;;
	--secret-namespace) secret_namespace=$2; shift 2 ;;
	--restart) restart=true; shift ;;
	--kubevirt-read) kubevirt_read=true; shift ;;
	--storage-read) storage_read=true; shift ;;
	--rotate) rotate=true; shift ;;
	--existing-service-account) existing=$2; shift 2 ;;
	--print) print=true; shift ;;
	--revoke) revoke=true; shift ;;
	-h | --help) usage; exit 0 ;;
	*) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
	esac
done
[ -n "$namespace" ] || { echo "--namespace is required" >&2; usage >&2; exit 2; }
if [ -n "$existing" ] && { $rotate || $print || [ -n "$output" ] || [ -n "$guest_kubeconfig" ]; }; then
	echo "--existing-service-account only adds grants: it takes no --rotate, --print, --output or --guest-kubeconfig" >&2
	exit 2
fi
if $revoke && { $rotate || $print || $restart || [ -n "$output" ] || [ -n "$guest_kubeconfig" ]; }; then
	echo "--revoke only deletes: it takes no --rotate, --print, --restart, --output or --guest-kubeconfig" >&2
	exit 2
fi
$restart && [ -z "$guest_kubeconfig" ] && { echo "--restart needs --guest-kubeconfig" >&2; exit 2; }
[ -z "$existing" ] || sa=$existing

log() { echo "host-rbac: $*" >&2; }
managed=harvester-csi-driver-host-rbac
# Harvester's own namespace: networkfs-manager reads NetworkFilesystems only there.
hsns=harvester-system
# Longhorn's namespace on Harvester, where its Volumes and VolumeAttachments live.
lhns=longhorn-system

# What the driver calls on the host, one rule a line: scope (ns: the VM namespace, hs: harvester-system, where
# networkfs-manager's NetworkFilesystems live, cluster: cluster-wide; with --storage-read also nsstorage: the VM
# namespace, lh: longhorn-system and storage: cluster-wide, each a role of its own, so that identities with and
# without the option can share the namespace's Role),
# API group ("" is core), resource[/subresource], verbs, resource names ("-": any). docs/host-rbac.md lists the
# call behind each line and tests/rbac runs the driver with exactly these grants.
permissions() {
	cat <<'EOF'
ns      kubevirt.io               virtualmachines                      get,list,watch,patch   -
ns      kubevirt.io               virtualmachines/status               patch                  -
ns      kubevirt.io               virtualmachineinstances              get,list,watch         -
ns      subresources.kubevirt.io  virtualmachines/addvolume            update                 -
ns      subresources.kubevirt.io  virtualmachines/removevolume         update                 -
ns      subresources.kubevirt.io  virtualmachineinstances/removevolume update                 -
ns      ""                        persistentvolumeclaims               get,list,watch,create,update,delete -
ns      ""                        pods                                 list                   -
ns      snapshot.storage.k8s.io   volumesnapshots                      get,list,create,delete -
ns      harvesterhci.io           volumeremotebackups                  get,list,create,delete -
ns      harvesterhci.io           volumeremoterestores                 get,create,delete      -
hs      harvesterhci.io           networkfilesystems                   get,list,watch,create,update,delete -
cluster storage.k8s.io            storageclasses                       get                    -
cluster harvesterhci.io           settings                             get                    server-version,csi-driver-config
EOF
	if $kubevirt_read; then
		echo 'cluster kubevirt.io               kubevirts                            list                   -'
	fi
	if $storage_read; then
		cat <<'EOF'
nsstorage ""                      events                               list                   -
lh      longhorn.io               volumes                              get                    -
lh      longhorn.io               volumeattachments                    get                    -
storage ""                        persistentvolumes                    get                    -
EOF
	fi
}

# rules SCOPE [KEYS]: the RBAC rules (YAML list items) of the permissions of SCOPE; with KEYS (a list of
# "group|resource|verb" lines), only those verbs.
rules() {
	local scope=$1 keys=${2-} s group resource verbs names v keep
	while read -r s group resource verbs names; do
		[ "$s" = "$scope" ] || continue
		[ "$group" = '""' ] && group=""
		if [ -n "$keys" ] || [ $# -gt 1 ]; then
			keep=""
			for v in ${verbs//,/ }; do
				grep -qxF "$group|$resource|$v" <<<"$keys" && keep+="${keep:+,}$v"
			done
			[ -n "$keep" ] || continue
			verbs=$keep
		fi
		printf '  - apiGroups: ["%s"]\n    resources: ["%s"]\n    verbs: ["%s"]\n' "$group" "$resource" "${verbs//,/\", \"}"
		[ "$names" = "-" ] || printf '    resourceNames: ["%s"]\n' "${names//,/\", \"}"
	done < <(permissions)
}

labels() {
	printf '  labels:\n    app.kubernetes.io/managed-by: %s\n' "$managed"
	[ -z "${1-}" ] || printf '    app.kubernetes.io/instance: %s\n' "$1"
}

# binding KIND NAME NAMESPACE ROLEKIND ROLE (NAMESPACE "" for a ClusterRoleBinding)
binding() {
	local kind=$1 name=$2 ns=$3 rolekind=$4 role=$5
	cat <<EOF
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ${kind}
metadata:
  name: ${name}${ns:+
  namespace: ${ns}}
$(labels "${namespace}.${sa}")
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ${rolekind}
  name: ${role}
subjects:
  - kind: ServiceAccount
    name: ${sa}
    namespace: ${namespace}
EOF
}

# granted KIND NAME NAMESPACE RULES (NAMESPACE "" for a ClusterRole): the role of what an identity lacked, annotated
# with every grant added, and its binding; nothing when RULES is empty.
granted() {
	local kind=$1 name=$2 ns=$3 rules=$4
	[ -n "$rules" ] || return 0
	cat <<EOF
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ${kind}
metadata:
  name: ${name}${ns:+
  namespace: ${ns}}
$(labels "${namespace}.${sa}")
  annotations:
    ${annotation}: "${grants}"
rules:
${rules}
EOF
	binding "${kind}Binding" "$name" "$ns" "$kind" "$name"
}

# The objects of the default mode. The Role is per namespace, the ClusterRole shared by every guest cluster.
manifests() {
	cat <<EOF
apiVersion: v1
kind: ServiceAccount
metadata:
  name: ${sa}
  namespace: ${namespace}
$(labels "${namespace}.${sa}")
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: harvester-csi-driver
  namespace: ${namespace}
$(labels)
rules:
$(rules ns)
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: harvester-csi-driver:host-reads
$(labels)
rules:
$(kubevirt_read=false rules cluster)
EOF
	cat <<EOF
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: harvester-csi-driver:networkfilesystems
  namespace: ${hsns}
$(labels)
rules:
$(rules hs)
EOF
	binding RoleBinding "${sa}" "$namespace" Role harvester-csi-driver
	binding RoleBinding "${namespace}-${sa}-networkfilesystems" "$hsns" Role harvester-csi-driver:networkfilesystems
	binding ClusterRoleBinding "${namespace}-${sa}-host-reads" "" ClusterRole harvester-csi-driver:host-reads
	if $kubevirt_read; then
		cat <<EOF
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: harvester-csi-driver:kubevirt-reader
$(labels)
rules:
  - apiGroups: ["kubevirt.io"]
    resources: ["kubevirts"]
    verbs: ["list"]
EOF
		binding ClusterRoleBinding "${namespace}-${sa}-kubevirt-reader" "" ClusterRole harvester-csi-driver:kubevirt-reader
	fi
	if $storage_read; then
		cat <<EOF
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: harvester-csi-driver:storage-reader
  namespace: ${namespace}
$(labels)
rules:
$(rules nsstorage)
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: harvester-csi-driver:longhorn-reader
  namespace: ${lhns}
$(labels)
rules:
$(rules lh)
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: harvester-csi-driver:pv-reader
$(labels)
rules:
$(rules storage)
EOF
		binding RoleBinding "${sa}-storage-reader" "$namespace" Role harvester-csi-driver:storage-reader
		binding RoleBinding "${namespace}-${sa}-longhorn-reader" "$lhns" Role harvester-csi-driver:longhorn-reader
		binding ClusterRoleBinding "${namespace}-${sa}-pv-reader" "" ClusterRole harvester-csi-driver:pv-reader
	fi
}

if $print; then
	manifests
	exit 0
fi

command -v kubectl >/dev/null || { echo "kubectl is required" >&2; exit 1; }
host=(kubectl --kubeconfig "$host_kubeconfig")
[ -z "$host_context" ] || host+=(--context "$host_context")

# deleted WHAT: says what was deleted, on stdout for --revoke (its whole output), else in the log.
deleted() {
	if $revoke; then echo "deleted $*"; else log "deleted $*"; fi
}

# ours RESOURCE NAME [NS]: whether the object exists and carries this script's managed-by label.
ours() {
	local where=()
	[ -z "${3-}" ] || where=(-n "$3")
	[ "$("${host[@]}" "${where[@]}" get "$1" "$2" -o 'jsonpath={.metadata.labels.app\.kubernetes\.io/managed-by}' 2>/dev/null || true)" = "$managed" ]
}

# remove_legacy: what earlier versions of this script made for $namespace/$sa (Harvester's roles bound, a token
# that never expires); only objects carrying this script's label. Those versions set no instance label, so the
# names, which carry the namespace and the account, say whose they are.
remove_legacy() {
	if ours clusterrolebinding "${namespace}-${sa}-csi-driver"; then
		"${host[@]}" delete clusterrolebinding "${namespace}-${sa}-csi-driver" >/dev/null
		deleted "clusterrolebinding/${namespace}-${sa}-csi-driver"
	fi
	if ours rolebinding "${sa}-hotplug-requests" "$namespace"; then
		"${host[@]}" -n "$namespace" delete rolebinding "${sa}-hotplug-requests" >/dev/null
		deleted "rolebinding/${sa}-hotplug-requests in $namespace"
	fi
	if ours secret "${sa}-token" "$namespace"; then
		"${host[@]}" -n "$namespace" delete secret "${sa}-token" >/dev/null
		deleted "secret/${sa}-token in $namespace"
	fi
	delete_if_unused role harvester-csi-driver:hotplug-requests "$namespace"
}

# delete_labelled RESOURCE NS: delete every RESOURCE in NS ("": cluster-wide) that this script made for
# $namespace/$sa (its managed-by label and the identity's instance label).
delete_labelled() {
	local resource=$1 ns=$2 objs obj where=()
	[ -z "$ns" ] || where=(-n "$ns")
	objs=$("${host[@]}" "${where[@]}" get "$resource" -o name \
		-l "app.kubernetes.io/managed-by=${managed},app.kubernetes.io/instance=${namespace}.${sa}")
	for obj in $objs; do
		"${host[@]}" "${where[@]}" delete "$obj" --ignore-not-found >/dev/null
		deleted "${obj}${ns:+ in $ns}"
	done
}

# delete_if_unused KIND NAME [NS]: delete a role this script made and shares between identities (the Role of a
# namespace, the ClusterRoles every guest cluster binds) once no binding refers to it any more: as long as one
# does, another identity still needs it.
delete_if_unused() {
	local kind=$1 name=$2 ns=${3-} refs where=()
	[ -z "$ns" ] || where=(-n "$ns")
	ours "$kind" "$name" "$ns" || return 0
	if [ "$kind" = role ]; then
		refs=$("${host[@]}" -n "$ns" get rolebindings -o 'jsonpath={range .items[?(@.roleRef.kind=="Role")]}{.roleRef.name}{"\n"}{end}')
	else
		refs=$("${host[@]}" get clusterrolebindings,rolebindings -A -o 'jsonpath={range .items[?(@.roleRef.kind=="ClusterRole")]}{.roleRef.name}{"\n"}{end}')
	fi
	if grep -qxF "$name" <<<"$refs"; then
		log "kept $kind/$name${ns:+ in $ns}: other bindings still use it"
		return 0
	fi
	"${host[@]}" "${where[@]}" delete "$kind" "$name" --ignore-not-found >/dev/null
	deleted "$kind/$name${ns:+ in $ns}"
}

if $revoke; then
	# Bindings first: without them the identity can do nothing, even while its ServiceAccount still exists.
	# The namespace may be gone already; the bindings in harvester-system and the cluster-wide ones are not.
	log "revoking $namespace/$sa"
	delete_labelled rolebindings "$namespace"
	delete_labelled rolebindings "$hsns"
	delete_labelled rolebindings "$lhns"
	delete_labelled clusterrolebindings ""
	remove_legacy
	delete_labelled serviceaccounts "$namespace"
	# Roles made for this identity alone (--existing-service-account), then the shared ones.
	delete_labelled roles "$namespace"
	delete_labelled roles "$hsns"
	delete_labelled roles "$lhns"
	delete_labelled clusterroles ""
	delete_if_unused role harvester-csi-driver "$namespace"
	delete_if_unused role harvester-csi-driver:networkfilesystems "$hsns"
	delete_if_unused clusterrole harvester-csi-driver:host-reads
	delete_if_unused clusterrole harvester-csi-driver:kubevirt-reader
	delete_if_unused role harvester-csi-driver:storage-reader "$namespace"
	delete_if_unused role harvester-csi-driver:longhorn-reader "$lhns"
	delete_if_unused clusterrole harvester-csi-driver:pv-reader
	log "revoked $namespace/$sa; the guest's kubeconfig Secret, if any, holds a token that no longer authenticates"
	exit 0
fi

"${host[@]}" get namespace "$namespace" >/dev/null ||
	{ log "namespace $namespace does not exist on the Harvester cluster"; exit 1; }

# allowed VERB GROUP RESOURCE[/SUB] NAME: whether the ServiceAccount may, by a SubjectAccessReview (needs no
# impersonation rights, and counts the groups every ServiceAccount is in).
allowed() {
	local verb=$1 group=$2 resource=${3%%/*} sub="" name=$4 ns=$5
	[ "$3" = "$resource" ] || sub=${3#*/}
	"${host[@]}" create -o 'jsonpath={.status.allowed}' -f - <<EOF
apiVersion: authorization.k8s.io/v1
kind: SubjectAccessReview
spec:
  user: system:serviceaccount:${namespace}:${sa}
  groups: ["system:serviceaccounts", "system:serviceaccounts:${namespace}", "system:authenticated"]
  resourceAttributes:
    namespace: "${ns}"
    verb: ${verb}
    group: "${group}"
    resource: ${resource}
    subresource: "${sub}"
    name: "${name}"
EOF
}

if [ -n "$existing" ]; then
	"${host[@]}" -n "$namespace" get serviceaccount "$sa" >/dev/null ||
		{ log "ServiceAccount $namespace/$sa does not exist"; exit 1; }
	role="${sa}-harvester-csi-driver"
	clusterrole="harvester-csi-driver:${namespace}:${sa}"
	annotation=harvester-csi-driver-grants
	# Grants made by an earlier run stay: they are why the review now says "allowed".
	earlier=$({ "${host[@]}" -n "$namespace" get role "$role" -o "jsonpath={.metadata.annotations.${annotation}}" 2>/dev/null || true
		echo
		"${host[@]}" -n "$hsns" get role "${namespace}-${role}" -o "jsonpath={.metadata.annotations.${annotation}}" 2>/dev/null || true
		echo
		"${host[@]}" -n "$lhns" get role "${namespace}-${role}" -o "jsonpath={.metadata.annotations.${annotation}}" 2>/dev/null || true
		echo
		"${host[@]}" get clusterrole "$clusterrole" -o "jsonpath={.metadata.annotations.${annotation}}" 2>/dev/null || true; } | tr ' ' '\n')
	missing=""
	while read -r scope group resource verbs names; do
		[ "$group" = '""' ] && group=""
		case $scope in
		ns | nsstorage) ns=$namespace ;;
		hs) ns=$hsns ;;
		lh) ns=$lhns ;;
		*) ns="" ;;
		esac
		for verb in ${verbs//,/ }; do
			key="$group|$resource|$verb"
			if grep -qxF "$key" <<<"$earlier"; then
				missing+="$key"$'\n'
				continue
			fi
			ok=true
			for name in ${names//,/ }; do
				[ "$name" = "-" ] && name=""
				[ "$(allowed "$verb" "$group" "$resource" "$name" "$ns")" = true ] || ok=false
			done
			if ! $ok; then
				log "$sa lacks: $verb ${group:-core}/$resource${ns:+ in $ns}"
				missing+="$key"$'\n'
			fi
		done
	done < <(permissions)
	nsrules=$(rules ns "$missing"; rules nsstorage "$missing")
	hsrules=$(rules hs "$missing")
	lhrules=$(rules lh "$missing")
	clrules=$(rules cluster "$missing"; rules storage "$missing")
	grants=$(grep -v '^$' <<<"$missing" | tr '\n' ' ' | sed 's/ $//' || true)
	if [ -z "$nsrules" ] && [ -z "$hsrules" ] && [ -z "$lhrules" ] && [ -z "$clrules" ]; then
		log "$namespace/$sa already has every grant the driver needs"
		exit 0
	fi
	{
		granted Role "$role" "$namespace" "$nsrules"
		granted Role "${namespace}-${role}" "$hsns" "$hsrules"
		granted Role "${namespace}-${role}" "$lhns" "$lhrules"
		granted ClusterRole "$clusterrole" "" "$clrules"
	} | "${host[@]}" apply -f - >&2
	log "granted $namespace/$sa what it lacked (Role/ClusterRole ${role}, ${clusterrole})"
	exit 0
fi

if $rotate; then
	"${host[@]}" -n "$namespace" get serviceaccount "$sa" >/dev/null ||
		{ log "ServiceAccount $namespace/$sa does not exist: run without --rotate first"; exit 1; }
else
	# Earlier versions of this script bound Harvester's roles (csi-driver cluster-wide) and stored a token that
	# never expires; remove what they made (only objects carrying this script's label). The RoleBinding of the
	# same name goes first: its roleRef cannot change in place.
	if [ "$("${host[@]}" -n "$namespace" get rolebinding "$sa" -o 'jsonpath={.metadata.labels.app\.kubernetes\.io/managed-by}/{.roleRef.name}' 2>/dev/null || true)" = "$managed/harvesterhci.io:cloudprovider" ]; then
		"${host[@]}" -n "$namespace" delete rolebinding "$sa" >&2
	fi
	log "creating ServiceAccount $namespace/$sa and its grants"
	manifests | "${host[@]}" apply -f - >&2
	remove_legacy
fi

log "issuing a token of $namespace/$sa for $duration"
token=$("${host[@]}" -n "$namespace" create token "$sa" --duration="$duration")
# The expiry the API server granted (it may shorten the request), from the token's claims.
claims=$(cut -d. -f2 <<<"$token" | tr '_-' '/+')
while [ $((${#claims} % 4)) -ne 0 ]; do claims+="="; done
exp=$(base64 -d <<<"$claims" 2>/dev/null | grep -o '"exp":[0-9]*' | cut -d: -f2 || true)
if [ -n "$exp" ]; then
	when=$(date -u -d "@$exp" '+%Y-%m-%dT%H:%M:%SZ' 2>/dev/null || date -u -r "$exp" '+%Y-%m-%dT%H:%M:%SZ' 2>/dev/null || echo "at unix time $exp")
	log "the token expires $when: rotate it before then (hack/host-rbac.sh --rotate ...)"
fi

# Server URL and CA: the host kubeconfig's, else the namespace's kube-root-ca.crt.
[ -n "$server" ] || server=$("${host[@]}" config view --minify -o 'jsonpath={.clusters[0].cluster.server}')
[ -n "$server" ] || { log "no server URL: pass --server"; exit 1; }
ca=$("${host[@]}" config view --minify --raw -o 'jsonpath={.clusters[0].cluster.certificate-authority-data}')
if [ -z "$ca" ]; then
	cafile=$("${host[@]}" config view --minify --raw -o 'jsonpath={.clusters[0].cluster.certificate-authority}')
	if [ -n "$cafile" ] && [ -r "$cafile" ]; then
		ca=$(base64 <"$cafile" | tr -d '\n')
	else
		ca=$("${host[@]}" -n "$namespace" get configmap kube-root-ca.crt -o 'jsonpath={.data.ca\.crt}' 2>/dev/null | base64 | tr -d '\n' || true)
	fi
fi

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
	[ -z "$guest_context" ] || guest+=(--context "$guest_context")
	"${guest[@]}" -n "$secret_namespace" create secret generic "$secret_name" \
		--from-file=cloud-provider-config="$kc" --dry-run=client -o yaml | "${guest[@]}" apply -f - >&2
	log "stored the kubeconfig in the guest cluster as Secret $secret_namespace/$secret_name"
	if $restart; then
		for w in deploy/harvester-csi-driver-controllers ds/harvester-csi-driver; do
			if "${guest[@]}" -n "$secret_namespace" get "$w" >/dev/null 2>&1; then
				"${guest[@]}" -n "$secret_namespace" rollout restart "$w" >&2
			fi
		done
	else
		log "the driver reads the new token once the kubelet has updated the mounted Secret (a minute or two); --restart restarts it at once"
	fi
	$rotate || log "install the chart with: --set cloudConfig.secretName=$secret_name (namespace $secret_namespace)"
fi
