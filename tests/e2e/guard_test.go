package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	guestpkg "github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestDetachGuardWithRealAttacher: the real external-attacher deletes two
// VolumeAttachments of one guest node; the guest still lists one volume in
// volumesInUse (kubelet has not unmounted it yet). That one stays on
// the VM, its VolumeAttachment keeps its finalizer and shows the guard's
// refusal as detachError, and the attacher keeps retrying; the other detaches
// at once. When the guest stops listing the volume, the attacher's next
// retry detaches it.
func TestDetachGuardWithRealAttacher(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05, BindClasslessPVCs: true})
	vm, nodeName := "guest-node-1", "rke2-worker-1"
	// vaName is the name the attach/detach controller gives a VolumeAttachment.
	vaName := func(vol string) string { return guestpkg.AttachmentName(vol, driver.Name, nodeName) }
	h.CreateVMs(t, vm)
	vols := h.CreateVolumes(t, "pvc-guard", 2)
	g := framework.StartGuest(t)
	g.AddNode(t, nodeName, vm)
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 100 * time.Millisecond, MaxHold: 1500 * time.Millisecond},
		Guest: g.Env.Config, DetachGuardTimeout: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	guestKube := g.Kube
	createGuestPVs(ctx, t, guestKube, vols)
	runAttacher(t, g.Env, ctrl.Endpoint, "--timeout=20s", "--leader-election=false", "--retry-interval-max=2s", "--v=2")
	for _, vol := range vols {
		createAttachment(ctx, t, guestKube, vol, nodeName)
	}
	testwait.Until(ctx, t, "both VolumeAttachments attached", func() (bool, string) {
		n := 0
		for _, vol := range vols {
			if va, err := guestKube.StorageV1().VolumeAttachments().Get(ctx, vaName(vol), metav1.GetOptions{}); err == nil && va.Status.Attached {
				n++
			}
		}
		return n == len(vols), fmt.Sprintf("%d attached", n)
	})

	// Kubelet still has the first volume mounted.
	inUse, free := vols[0], vols[1]
	g.SetMounted(t, nodeName, inUse)
	testwait.Until(ctx, t, "the controller's guest cache to show the volume in use", func() (bool, string) {
		n, ok := ctrl.Driver.GuestNodes().Node(nodeName)
		return ok && len(n.Status.VolumesInUse) == 1 && n.Status.VolumesInUse[0] == guestpkg.UniqueVolumeName(driver.Name, inUse), fmt.Sprint(n)
	})
	for _, vol := range vols {
		if err := guestKube.StorageV1().VolumeAttachments().Delete(ctx, vaName(vol), metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	testwait.Until(ctx, t, "the free volume's VolumeAttachment gone", func() (bool, string) {
		_, err := guestKube.StorageV1().VolumeAttachments().Get(ctx, vaName(free), metav1.GetOptions{})
		return err != nil, fmt.Sprint(err)
	})
	if err := h.Sim.WaitVolumeDetached(ctx, h.Namespace, vm, free); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the guard's refusal on the in-use VolumeAttachment", func() (bool, string) {
		va, err := guestKube.StorageV1().VolumeAttachments().Get(ctx, vaName(inUse), metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		if va.Status.DetachError == nil {
			return false, "no detach error yet"
		}
		msg := va.Status.DetachError.Message
		return strings.Contains(msg, "still in use by guest node "+nodeName) && strings.Contains(msg, inUse) && va.Status.Attached, msg
	})
	// The same reason is on the VolumeAttachment as an Event, where
	// `kubectl describe volumeattachment` shows it.
	testwait.Until(ctx, t, "an Event on the in-use VolumeAttachment saying the guest still uses it", func() (bool, string) {
		list, err := guestKube.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		var seen []string
		for _, e := range list.Items {
			if e.InvolvedObject.Kind == "VolumeAttachment" && e.InvolvedObject.Name == vaName(inUse) {
				if e.Reason == "VolumeStillInUse" && strings.Contains(e.Message, nodeName) {
					return true, ""
				}
				seen = append(seen, e.Reason+": "+e.Message)
			}
		}
		return false, fmt.Sprint(seen)
	})
	_, vmi := h.Sim.VM(h.Namespace, vm)
	if e, ok := kubevirtsim.FindVolumeStatus(vmi, inUse); !ok || e.Phase != kubevirtv1.VolumeReady {
		t.Fatalf("the in-use volume left the VM while the guest uses it: %+v", e)
	}

	// Kubelet unmounts it: the attacher's next retry detaches it.
	g.SetMounted(t, nodeName)
	testwait.Until(ctx, t, "the in-use volume's VolumeAttachment gone", func() (bool, string) {
		_, err := guestKube.StorageV1().VolumeAttachments().Get(ctx, vaName(inUse), metav1.GetOptions{})
		return err != nil, fmt.Sprint(err)
	})
	if err := h.Sim.WaitVolumeDetached(ctx, h.Namespace, vm, inUse); err != nil {
		t.Fatal(err)
	}
}
