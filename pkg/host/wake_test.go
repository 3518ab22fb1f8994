package host

import (
	"context"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	kvfake "kubevirt.io/client-go/kubevirt/fake"
)

// A wake changes the VM's annotation and nothing of its spec or status, so
// that KubeVirt's VM controller gets an event and nothing else changes.
func TestWakeVMTouchesOnlyAnAnnotation(t *testing.T) {
	vm := &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Name: "vm1", Namespace: "guests", Annotations: map[string]string{"keep": "me"}},
		Spec:       kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{}},
		Status: kubevirtv1.VirtualMachineStatus{VolumeRequests: []kubevirtv1.VirtualMachineVolumeRequest{
			{RemoveVolumeOptions: &kubevirtv1.RemoveVolumeOptions{Name: "pvc-a"}},
		}},
	}
	c := &Client{Namespace: "guests", KubeVirt: kvfake.NewSimpleClientset(vm)}
	ctx := context.Background()
	at := time.Date(2026, 12, 7, 22, 0, 0, 0, time.UTC)
	if err := c.WakeVM(ctx, "vm1", at); err != nil {
		t.Fatal(err)
	}
	got, err := c.KubeVirt.KubevirtV1().VirtualMachines("guests").Get(ctx, "vm1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Annotations[WokenAtAnnotation] != "2026-12-07T22:00:00Z" || got.Annotations["keep"] != "me" {
		t.Errorf("annotations %v", got.Annotations)
	}
	if len(got.Status.VolumeRequests) != 1 {
		t.Errorf("requests %+v, want the one queued", got.Status.VolumeRequests)
	}
	if err := c.WakeVM(ctx, "gone", at); err == nil {
		t.Error("wake of a missing VM answered nil")
	}
}
