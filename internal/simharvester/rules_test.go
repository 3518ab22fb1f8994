package simharvester

import (
	"net/http"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// fakeLookup is Harvester's caches for the rules alone.
type fakeLookup struct {
	list []*kubevirtv1.VirtualMachine
	pvcs map[string]*corev1.PersistentVolumeClaim
}

func (f *fakeLookup) vms(string) []*kubevirtv1.VirtualMachine { return f.list }

func (f *fakeLookup) pvc(_, name string) *corev1.PersistentVolumeClaim { return f.pvcs[name] }

func (f *fakeLookup) provisioner(*corev1.PersistentVolumeClaim) string { return longhornProvisioner }

func templateVM(name string, claims ...string) *kubevirtv1.VirtualMachine {
	vm := &kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name},
		Spec: kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{}}}
	for _, c := range claims {
		vm.Spec.Template.Spec.Volumes = append(vm.Spec.Template.Spec.Volumes, kubevirtv1.Volume{Name: c, VolumeSource: kubevirtv1.VolumeSource{
			PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: c}}}})
		vm.Spec.Template.Spec.Domain.Devices.Disks = append(vm.Spec.Template.Spec.Domain.Devices.Disks, kubevirtv1.Disk{Name: c})
	}
	return vm
}

// The PVC validator lets the garbage collector through, and a VM being
// deleted holds no claim.
func TestPVCDeleteExemptions(t *testing.T) {
	holder := templateVM("vm-a", "pvc-1")
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "pvc-1"}}
	l := &fakeLookup{list: []*kubevirtv1.VirtualMachine{holder}}
	for _, r := range []Release{V1_6, V1_7, V1_8} {
		d := pvcDelete(r, l, "admin", pvc)
		want := int32(http.StatusUnprocessableEntity)
		if r == V1_8 {
			want = http.StatusConflict
		}
		if d == nil || d.code != want || d.message != "can not delete the volume pvc-1 which is currently attached to VM: ns/vm-a" {
			t.Errorf("%s: delete of a claim in a template: %+v, want %d", r, d, want)
		}
		if d := pvcDelete(r, l, gcUser, pvc); d != nil {
			t.Errorf("%s: the garbage collector was refused: %s", r, d.message)
		}
	}
	holder.DeletionTimestamp = &metav1.Time{}
	if d := pvcDelete(V1_8, l, "admin", pvc); d != nil {
		t.Errorf("a VM being deleted still holds its claim: %s", d.message)
	}
}

// The mutator leaves a VM without a template, and one with a grace period,
// alone.
func TestGracePatch(t *testing.T) {
	if p := gracePatch(&kubevirtv1.VirtualMachine{}, 120); p != nil {
		t.Errorf("patched a VM without a template: %s", p)
	}
	vm := templateVM("vm")
	if p := gracePatch(vm, 120); string(p) != `[{"op": "replace", "path": "/spec/template/spec/terminationGracePeriodSeconds", "value": 120}]` {
		t.Errorf("patch %s", p)
	}
	vm.Spec.Template.Spec.TerminationGracePeriodSeconds = new(int64)
	if p := gracePatch(vm, 120); p != nil {
		t.Errorf("patched a set grace period (0): %s", p)
	}
}

// A volume without a disk is in no non-shareable index (1.7 on); the VM's
// own template never counts against it.
func TestOccupiedIndexes(t *testing.T) {
	other := templateVM("vm-b", "pvc-1")
	other.Spec.Template.Spec.Domain.Devices.Disks = nil
	self := templateVM("vm-a", "pvc-1")
	l := &fakeLookup{list: []*kubevirtv1.VirtualMachine{other, self}, pvcs: map[string]*corev1.PersistentVolumeClaim{
		"pvc-1": {Spec: corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}}}}}
	if d := occupied(V1_7, l, self); d != nil {
		t.Errorf("1.7 counted a claim without a disk: %s", d.message)
	}
	if d := occupied(V1_6, l, self); d == nil || d.message != "the volume pvc-1 is already used by VM ns/vm-b" {
		t.Errorf("1.6: %+v", d)
	}
	l.list = []*kubevirtv1.VirtualMachine{self}
	if d := occupied(V1_6, l, self); d != nil {
		t.Errorf("the VM's own template counted: %s", d.message)
	}
}
