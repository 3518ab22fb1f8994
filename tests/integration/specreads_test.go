package integration

import (
	"context"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
)

// specReadOnlyWhenMoved (declarative backend): a batch on a VM whose spec
// has not moved since the queue's own last patch takes the VM's lists from
// that patch's answer, so it costs one request (the patch), not two. A spec
// another writer changed meanwhile is read again, or, when the informer has
// not shown the change yet, fails the patch's `test` guard and is retried
// after a read: either way the other writer's change is kept.
func (s *suite) specReadOnlyWhenMoved(t *testing.T) {
	if s.f.backend != kubevirt.BackendDeclarative {
		t.Skip("the subresource backend does not read the VM spec")
	}
	s.simOnly(t, "request counters")
	vm := "sr-vm"
	vols := s.scene(t, "sr", 3, vm)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	if err := a.publish(ctx, vm, vols[0]); err != nil {
		t.Fatal(err)
	}
	vmGets := func(st kubevirtsim.Stats) int {
		n := 0
		for k, c := range st.Requests {
			if k.Verb == "get" && k.Resource == "virtualmachines" && k.Subresource == "" {
				n += c
			}
		}
		return n
	}

	s.host.Sim.ResetStats()
	if err := a.publish(ctx, vm, vols[1]); err != nil {
		t.Fatal(err)
	}
	st := s.host.Sim.Stats()
	if got := vmGets(st); got != 0 || st.VMSpecWrites != 1 {
		t.Errorf("second batch on an unchanged VM: %d VM reads and %d spec writes, want 0 and 1", got, st.VMSpecWrites)
	}

	// Another writer adds a disk of its own to the VM.
	vmObj, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	patch := []byte(`[{"op":"add","path":"/spec/template/spec/volumes/-","value":{"name":"outsider","emptyDisk":{"capacity":"1Gi"}}},` +
		`{"op":"add","path":"/spec/template/spec/domain/devices/disks/-","value":{"name":"outsider","disk":{"bus":"virtio"}}}]`)
	if _, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).Patch(ctx, vm, types.JSONPatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	s.host.Sim.ResetStats()
	if err := a.publish(ctx, vm, vols[2]); err != nil {
		t.Fatal(err)
	}
	st = s.host.Sim.Stats()
	if st.Conflicts+st.Unprocessable > 1 {
		t.Errorf("%d conflicts after another writer's change, want at most the one failed guard", st.Conflicts+st.Unprocessable)
	}
	if got := vmGets(st); got != 1 {
		t.Errorf("%d VM reads after another writer changed the spec, want 1", got)
	}
	after, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	has := func(name string) bool {
		for _, v := range after.Spec.Template.Spec.Volumes {
			if v.Name == name {
				return true
			}
		}
		return false
	}
	for _, name := range append([]string{"outsider"}, vols...) {
		if !has(name) {
			t.Errorf("volume %s missing from the VM spec: %v", name, volumeNames(after.Spec.Template.Spec.Volumes))
		}
	}
	if after.Generation == vmObj.Generation {
		t.Errorf("generation %d did not move with the spec", after.Generation)
	}
	for _, vol := range vols {
		if err := a.unpublish(ctx, vm, vol); err != nil {
			t.Errorf("unpublish %s: %v", vol, err)
		}
	}
}

func volumeNames(vs []kubevirtv1.Volume) []string {
	out := make([]string, len(vs))
	for i, v := range vs {
		out[i] = v.Name
	}
	return out
}
