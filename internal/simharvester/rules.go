// Package simharvester models Harvester's admission webhooks on the
// simulated host: the VM validator (every template PVC checked against every
// other VM, on virtualmachines and virtualmachines/status), the PVC
// validator's refusal to delete a claim a VM template names, and the VM
// mutator's default termination grace period. It serves them over TLS and
// registers them with the host kube-apiserver as Harvester does, so the
// KubeVirt simulator (internal/kubevirtsim) and KubeVirt's own control
// plane (internal/realkubevirt) meet them alike, their own status writes
// included.
//
// They are modelled, not built: harvester/harvester's go.mod pins
// github.com/rancher/rancher to a pseudo-version the checksum database does
// not know, so its packages do not build from the module proxy, and its
// validators are wired to wrangler caches of a dozen kinds (Harvester's own
// CRDs among them) that only its whole controller factory provides. Only the
// rules a hotplug meets are modelled; docs/architecture.md lists them with
// their sources.
package simharvester

import (
	"fmt"
	"net/http"
	"slices"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Release selects the rules and messages of a Harvester release line.
type Release string

const (
	// V1_6 is harvester v1.6.0 and v1.6.1: every PVC volume of the template
	// counts, whatever its access mode or disk.
	V1_6 Release = "v1.6"
	// V1_7 is harvester v1.7.0 to v1.7.3: only non-shareable disks of
	// claims that are not RWX outside Longhorn count.
	V1_7 Release = "v1.7"
	// V1_8 is harvester v1.8.0 to v1.8.2 (and, until it is read, 1.9): the
	// 1.7 VM rules; the PVC validator answers 409 instead of 422.
	V1_8 Release = "v1.8"
)

// Names of the webhooks and their configurations (harvester v1.8.2
// pkg/webhook/types.go:4-5, pkg/webhook/server/server.go:165,189).
const (
	ValidatorName        = "validator.harvesterhci.io"
	MutatorName          = "mutator.harvesterhci.io"
	ValidatingConfigName = "harvester-validator"
	MutatingConfigName   = "harvester-mutator"
)

// DefaultTerminationGracePeriod is Harvester's setting
// default-vm-termination-grace-period-seconds (harvester v1.6.0
// pkg/settings/settings.go:52), which its VM mutator writes into a VM
// template that has none; KubeVirt's own default is 30 s.
const DefaultTerminationGracePeriod = 120

// longhornProvisioner is the one provisioner whose RWX claims still count
// as non-shareable for a VM (harvester v1.7.0
// pkg/util/virtualmachine/virtualmachine.go volumeSupportRWXForVM).
const longhornProvisioner = "driver.longhorn.io"

// gcUser is the user whose deletions the PVC validator lets through
// (harvester v1.8.2 cmd/webhook/main.go:57, types/request.go:36).
const gcUser = "system:serviceaccount:kube-system:generic-garbage-collector"

func (r Release) valid() bool { return r == V1_6 || r == V1_7 || r == V1_8 }

// denial is the admission answer of a refused request, as harvester's
// pkg/webhook/error AdmitError.AsResult builds it.
type denial struct {
	code    int32
	reason  metav1.StatusReason
	message string
	field   string
}

func (d *denial) status() *metav1.Status {
	st := &metav1.Status{Status: metav1.StatusFailure, Code: d.code, Reason: d.reason, Message: d.message}
	if d.reason == metav1.StatusReasonInvalid {
		st.Details = &metav1.StatusDetails{Causes: []metav1.StatusCause{{Type: metav1.CauseTypeFieldValueInvalid, Message: d.message, Field: d.field}}}
	}
	return st
}

func invalid(field, format string, args ...any) *denial {
	return &denial{code: http.StatusUnprocessableEntity, reason: metav1.StatusReasonInvalid, message: fmt.Sprintf(format, args...), field: field}
}

// lookup is what the rules read from Harvester's caches.
type lookup interface {
	// vms are the VMs of the namespace.
	vms(namespace string) []*kubevirtv1.VirtualMachine
	// pvc is the claim, nil when the cache has none.
	pvc(namespace, name string) *corev1.PersistentVolumeClaim
	// provisioner is the claim's provisioner: its annotation, else its
	// class's (harvester v1.7.0 pkg/util/volume.go GetProvisionedPVCProvisioner).
	provisioner(pvc *corev1.PersistentVolumeClaim) string
}

// occupied is the VM validator's checkOccupiedPVCs, run on CREATE and UPDATE
// of a VM and of its status alike (the validator's Update starts with
// checkVMSpec whatever changed). The first template claim another VM also
// names is refused.
func occupied(r Release, l lookup, vm *kubevirtv1.VirtualMachine) *denial {
	if vm.Spec.Template == nil {
		return nil
	}
	for _, v := range vm.Spec.Template.Spec.Volumes {
		if v.PersistentVolumeClaim == nil || v.PersistentVolumeClaim.ClaimName == "" {
			continue
		}
		claim := v.PersistentVolumeClaim.ClaimName
		if r == V1_6 {
			// harvester v1.6.0 validator.go:464-481: index VMByPVC, every
			// PVC volume of every VM.
			if other := otherVM(l, vm, claim, false); other != nil {
				return invalid("spec.templates.spec.volumes", "the volume %s is already used by VM %s/%s", claim, other.Namespace, other.Name)
			}
			continue
		}
		// harvester v1.7.0 validator.go:517-539 and
		// pkg/util/virtualmachine CheckBlockRWXVolumeForVM: a claim not in
		// the cache passes (created with the VM), an RWX claim outside
		// Longhorn passes, and only other VMs' non-shareable disks count
		// (index VMByNonShareablePVC).
		pvc := l.pvc(vm.Namespace, claim)
		if pvc == nil {
			continue
		}
		if slices.Contains(pvc.Spec.AccessModes, corev1.ReadWriteMany) && l.provisioner(pvc) != longhornProvisioner {
			continue
		}
		if otherVM(l, vm, claim, true) != nil {
			return invalid("spec.templates.spec.volumes", "PVC %s/%s is already used by other VM, please use a shareable RWX volume.", vm.Namespace, claim)
		}
	}
	return nil
}

// otherVM is a VM other than vm whose template names claim (only on a
// non-shareable disk with nonShareable).
func otherVM(l lookup, vm *kubevirtv1.VirtualMachine, claim string, nonShareable bool) *kubevirtv1.VirtualMachine {
	for _, o := range l.vms(vm.Namespace) {
		if o.Name == vm.Name {
			continue
		}
		if slices.Contains(templateClaims(o, nonShareable), claim) {
			return o
		}
	}
	return nil
}

// templateClaims are the claims of a VM's template volumes (harvester
// pkg/util/indexeres VMByPVC), or with nonShareable only those whose disk is
// not marked shareable (VMByNonShareablePVC, v1.7.0 and later).
func templateClaims(vm *kubevirtv1.VirtualMachine, nonShareable bool) []string {
	if vm.Spec.Template == nil {
		return nil
	}
	shared := map[string]bool{}
	listed := map[string]bool{}
	for _, d := range vm.Spec.Template.Spec.Domain.Devices.Disks {
		listed[d.Name] = true
		shared[d.Name] = d.Shareable != nil && *d.Shareable
	}
	var out []string
	for _, v := range vm.Spec.Template.Spec.Volumes {
		if v.PersistentVolumeClaim == nil || v.PersistentVolumeClaim.ClaimName == "" {
			continue
		}
		if nonShareable && (!listed[v.Name] || shared[v.Name]) {
			continue
		}
		out = append(out, v.PersistentVolumeClaim.ClaimName)
	}
	return out
}

// pvcDelete is the PVC validator's refusal to delete a claim that a VM
// template names (harvester v1.6.0 and v1.7.0
// pkg/webhook/resources/persistentvolumeclaim/validator.go:100-110, 422;
// v1.8.0 and v1.8.2 :107-108, 409). The garbage collector's deletions pass;
// a VM being deleted does not hold its claims.
func pvcDelete(r Release, l lookup, user string, pvc *corev1.PersistentVolumeClaim) *denial {
	if user == gcUser {
		return nil
	}
	for _, vm := range l.vms(pvc.Namespace) {
		if vm.DeletionTimestamp != nil || !slices.Contains(templateClaims(vm, false), pvc.Name) {
			continue
		}
		msg := fmt.Sprintf("can not delete the volume %s which is currently attached to VM: %s/%s", pvc.Name, vm.Namespace, vm.Name)
		if r == V1_8 {
			return &denial{code: http.StatusConflict, reason: metav1.StatusReasonConflict, message: msg}
		}
		return invalid("", "%s", msg)
	}
	return nil
}

// gracePatch is the VM mutator's default of the template's termination
// grace period (harvester v1.6.0 mutator.go:521-542, v1.8.2 :601-622), as
// the JSON patch it answers.
func gracePatch(vm *kubevirtv1.VirtualMachine, seconds int64) []byte {
	if vm.Spec.Template == nil || vm.Spec.Template.Spec.TerminationGracePeriodSeconds != nil {
		return nil
	}
	return fmt.Appendf(nil, `[{"op": "replace", "path": "/spec/template/spec/terminationGracePeriodSeconds", "value": %d}]`, seconds)
}
