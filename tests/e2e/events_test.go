package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestWaitsExplainedOnVolumeAttachments: the real external-attacher publishes
// through the driver while a publish cannot finish, and the guest
// VolumeAttachment carries an Event that says why, where `kubectl describe`
// shows it: a volume another VM holds names that VM, a hotplug whose
// attachment pod does not start says it is waiting for KubeVirt. When the
// cause goes, the same VolumeAttachments attach.
func TestWaitsExplainedOnVolumeAttachments(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Version: kubevirtsim.V1_6_3, Scale: 0.05, BindClasslessPVCs: true})
	vmA, vmB := "ev-a", "ev-b"
	nodeA, nodeB := "rke2-ev-a", "rke2-ev-b"
	h.CreateVMs(t, vmA, vmB)
	vols := h.CreateVolumes(t, "pvc-ev", 2)
	held, waiting := vols[0], vols[1]
	g := framework.StartGuest(t)
	g.AddNode(t, nodeA, vmA)
	g.AddNode(t, nodeB, vmB)
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 100 * time.Millisecond, MaxHold: 1500 * time.Millisecond},
		Guest: g.Env.Config})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	createGuestPVs(ctx, t, g.Kube, vols)
	runAttacher(t, g.Env, ctrl.Endpoint, "--timeout=5s", "--leader-election=false", "--retry-interval-max=2s", "--v=2")
	attached := func(name string) func() (bool, string) {
		return func() (bool, string) {
			va, err := g.Kube.StorageV1().VolumeAttachments().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			return va.Status.Attached, fmt.Sprintf("%+v", va.Status)
		}
	}
	eventOn := func(va, reason string, mentions ...string) func() (bool, string) {
		return func() (bool, string) {
			var seen []string
			for _, e := range g.ObjectEvents(t, "VolumeAttachment", va) {
				ok := e.Reason == reason
				for _, m := range mentions {
					ok = ok && strings.Contains(e.Message, m)
				}
				if ok {
					return true, ""
				}
				seen = append(seen, e.Reason+": "+e.Message)
			}
			return false, fmt.Sprint(seen)
		}
	}

	// An RWO volume attached to one node, then asked for on the other: the
	// second VolumeAttachment says which VM holds the volume.
	heldOnA := createAttachment(ctx, t, g.Kube, held, nodeA)
	testwait.Until(ctx, t, "the held volume attached to "+vmA, attached(heldOnA))
	heldOnB := createAttachment(ctx, t, g.Kube, held, nodeB)
	testwait.Until(ctx, t, "an Event naming the holder on "+heldOnB, eventOn(heldOnB, "VolumeHeldByAnotherVM", held, vmA))

	// KubeVirt's attachment pod for the other VM does not start: the publish
	// waits, and its VolumeAttachment says so.
	h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, vmB, true)
	waitingOnB := createAttachment(ctx, t, g.Kube, waiting, nodeB)
	testwait.Until(ctx, t, "an Event saying the hotplug waits on "+waitingOnB, eventOn(waitingOnB, "HotplugWaiting", waiting))
	if ok, state := attached(waitingOnB)(); ok {
		t.Fatalf("attached while its attachment pod cannot start: %s", state)
	}

	// The causes go: the pod starts, the holder lets go; both attach.
	h.Sim.Faults().SetAttachmentPodsStuck(h.Namespace, vmB, false)
	testwait.Until(ctx, t, "the waiting volume attached once the pod starts", attached(waitingOnB))
	if err := g.Kube.StorageV1().VolumeAttachments().Delete(ctx, heldOnA, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the held volume attached to "+vmB+" once "+vmA+" let go", attached(heldOnB))
}
