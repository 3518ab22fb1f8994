package integration

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/api/resource"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestPublishAtTheDiskLimit: on a VM whose own disks leave room for two
// volumes (KubeVirt allows 256 disks, root and cloud-init included), two
// publishes succeed, the third is ResourceExhausted naming the limit (no
// KubeVirt error string, nothing written), and goes through once a volume
// left the VM.
func TestPublishAtTheDiskLimit(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_8_2, Scale: scale})
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: kubevirt.BackendAuto, Queue: queueConfig(),
		Driver: driver.ControllerOptions{HostStorageClass: kubevirtsim.DefaultStorageClass}})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const own = kubevirtsim.MaxDisks - 2 // the root disk and 253 others
	vols, disks := ownDisks(own - 1)
	if _, err := h.Sim.CreateVM(ctx, kubevirtsim.VMSpec{Namespace: h.Namespace, Name: "vm-full", Volumes: vols, Disks: disks}); err != nil {
		t.Fatal(err)
	}
	claims := h.CreateVolumes(t, "pvc-limit", 3)
	a := newAttacher(func() csi.ControllerClient { return ctrl.Client })
	for _, c := range claims[:2] {
		if err := a.publish(ctx, "vm-full", c); err != nil {
			t.Fatalf("publish %s (room left): %v", c, err)
		}
	}
	_, err := ctrl.Client.ControllerPublishVolume(ctx, publishReq("vm-full", claims[2]))
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "at most 256") || strings.Contains(err.Error(), "Too many") {
		t.Fatalf("publish of a 257th disk: %v, want ResourceExhausted naming the limit of 256", err)
	}
	if vm, _ := h.Sim.VM(h.Namespace, "vm-full"); len(vm.Spec.Template.Spec.Volumes) != kubevirtsim.MaxDisks {
		t.Errorf("the VM has %d volumes, want %d: the refused one was written", len(vm.Spec.Template.Spec.Volumes), kubevirtsim.MaxDisks)
	}
	if err := a.unpublish(ctx, "vm-full", claims[0]); err != nil {
		t.Fatal(err)
	}
	if err := a.publish(ctx, "vm-full", claims[2]); err != nil {
		t.Fatalf("publish once a disk left: %v", err)
	}
}

// ownDisks are n empty disks of a VM's own, besides its root disk.
func ownDisks(n int) ([]kubevirtv1.Volume, []kubevirtv1.Disk) {
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

// TestKubeVirtAnswerOverTheDiskLimitIsVMFull: when a write does reach
// KubeVirt with a 257th disk (the queue's own count kept out of the way),
// the answer KubeVirt's API gives, the CRD schema's 422 "Too many", is
// read by the declarative backend as this volume's refusal for a full VM.
func TestKubeVirtAnswerOverTheDiskLimitIsVMFull(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: scale})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vols, disks := ownDisks(kubevirtsim.MaxDisks - 1) // with the root disk: 256
	if _, err := h.Sim.CreateVM(ctx, kubevirtsim.VMSpec{Namespace: h.Namespace, Name: "vm-full", Volumes: vols, Disks: disks}); err != nil {
		t.Fatal(err)
	}
	claims := h.CreateVolumes(t, "pvc-over", 1)
	hc, err := host.NewForConfig(h.ClientConfig(), h.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	out := kubevirt.NewDeclarative(hc, nil).Apply(ctx, "vm-full", []hotplug.Change{{Volume: claims[0], Op: hotplug.Attach}})
	if len(out) != 1 || out[0].Result != hotplug.Rejected || !errors.Is(out[0].Err, hotplug.ErrVMFull) || !strings.Contains(out[0].Err.Error(), "Too many") {
		t.Fatalf("adding a 257th disk: %+v, want Rejected wrapping ErrVMFull and KubeVirt's Too many", out)
	}
	if vm, _ := h.Sim.VM(h.Namespace, "vm-full"); len(vm.Spec.Template.Spec.Volumes) != kubevirtsim.MaxDisks {
		t.Errorf("the VM has %d volumes, want %d", len(vm.Spec.Template.Spec.Volumes), kubevirtsim.MaxDisks)
	}
}
