package kubevirtsim

import (
	"fmt"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// extraDisks are n empty disks, the VM's own besides its root disk.
func extraDisks(n int) ([]kubevirtv1.Volume, []kubevirtv1.Disk) {
	var vols []kubevirtv1.Volume
	var disks []kubevirtv1.Disk
	for i := range n {
		name := fmt.Sprintf("own-%03d", i)
		vols = append(vols, kubevirtv1.Volume{Name: name, VolumeSource: kubevirtv1.VolumeSource{
			EmptyDisk: &kubevirtv1.EmptyDiskSource{Capacity: resource.MustParse("1Mi")},
		}})
		disks = append(disks, kubevirtv1.Disk{Name: name, DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}}})
	}
	return vols, disks
}

// TestDiskLimit: as with KubeVirt's CRDs, the API server refuses a VM with a
// 257th disk or volume, at creation and when a hotplug adds it, with its
// own "Too many" message; 256 are fine.
func TestDiskLimit(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{Mode: ModeDeclarative})
	ctx := testCtx(t, 60*time.Second)
	vols, disks := extraDisks(MaxDisks) // with the root disk: 257
	_, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "too-many", Stopped: true, Volumes: vols, Disks: disks})
	if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "spec.template.spec.volumes: Too many: 257: must have at most 256 items") ||
		!strings.Contains(err.Error(), "spec.template.spec.domain.devices.disks: Too many: 257: must have at most 256 items") {
		t.Errorf("a VM of 257 disks: %v, want 422 Too many for disks and volumes", err)
	}

	if _, err := s.CreatePVC(ctx, ns, "pvc-257", "1Gi", false); err != nil {
		t.Fatal(err)
	}
	vols, disks = extraDisks(MaxDisks - 1)
	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: "full", Stopped: true, Volumes: vols, Disks: disks}); err != nil {
		t.Fatalf("a VM of 256 disks: %v", err)
	}
	err = patchVMVolumes(ctx, t, s, proxyKV(t, s), ns, "full", []string{"pvc-257"}, nil)
	if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "Too many: 257: must have at most 256 items") {
		t.Errorf("hot-plugging a 257th disk: %v, want 422 Too many", err)
	}
}
