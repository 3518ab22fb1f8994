package host

import (
	"context"
	"errors"
	"testing"

	corev1 "k8s.io/api/core/v1"
	kubefake "k8s.io/client-go/kubernetes/fake"
)

// A repeated CreateVolume (the provisioner retries a call that timed out
// waiting for the bind) is answered from the existing PVC without a create
// the API server would refuse with 409; a different request under the same
// name is a mismatch.
func TestCreateVolumeRepeatMakesNoConflictingCreate(t *testing.T) {
	kube := kubefake.NewClientset()
	c := &Client{Namespace: "guests", Kube: kube}
	ctx := context.Background()
	spec := VolumeSpec{Name: "pvc-a", Bytes: 1 << 30, Mode: corev1.PersistentVolumeBlock, StorageClass: "longhorn"}
	if _, err := c.CreateVolume(ctx, spec); err != nil {
		t.Fatal(err)
	}
	creates := func() int {
		n := 0
		for _, a := range kube.Actions() {
			if a.GetVerb() == "create" && a.GetResource().Resource == "persistentvolumeclaims" {
				n++
			}
		}
		return n
	}
	if n := creates(); n != 1 {
		t.Fatalf("first call: %d creates, want 1", n)
	}
	got, err := c.CreateVolume(ctx, spec)
	if err != nil || got.Name != "pvc-a" {
		t.Fatalf("repeat: %v, %v", got, err)
	}
	if n := creates(); n != 1 {
		t.Errorf("the repeat sent a create (%d in all): the API server answers it with 409", n)
	}
	other := spec
	other.Bytes = 2 << 30
	var mismatch *VolumeMismatchError
	if _, err := c.CreateVolume(ctx, other); !errors.As(err, &mismatch) {
		t.Errorf("another size under the same name: %v, want a VolumeMismatchError", err)
	}
}
