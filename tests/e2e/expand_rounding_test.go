package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestRealResizerInsideTheHostRounding is harvester/harvester#11716 with the
// real csi-resizer: the guest claim csi-resize-repro of 1G, as upstream's
// driver provisioned it (guest PV recorded at the requested 1G, host PVC
// rounded up to 2 MiB steps: 954Mi, 1000341504 bytes), is grown to a size
// between the two. The resizer gets an OK with the host's capacity: the
// guest PV shows 954Mi, the claim waits for the node's filesystem step, no
// VolumeResizeFailed Event ("only supports offline expansion", which
// upstream's FailedPrecondition caused), and the host PVC is not written.
func TestRealResizerInsideTheHostRounding(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05})
	const vol, hostSize = "pvc-resize-repro", "954Mi"
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if _, err := h.Sim.CreatePVC(ctx, h.Namespace, vol, hostSize, false); err != nil {
		t.Fatal(err)
	}
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 100 * time.Millisecond}})

	g := framework.StartGuest(t)
	guestEnv, guest := g.Env, g.Kube
	const ns, claim = "default", "csi-resize-repro"
	createBoundClaim(ctx, t, guest, ns, claim, vol, resource.MustParse("1G"))
	socket := strings.TrimPrefix(ctrl.Endpoint, "unix://")
	if err := guestEnv.Run("csi-resizer", "--csi-address="+socket, "--kubeconfig="+guestEnv.Kubeconfig, "--leader-election=false",
		"--timeout=1m50s", "--v=2"); err != nil {
		t.Fatal(err)
	}

	// 1000300000 bytes: more than the guest PV's 1G, less than the host's
	// 954Mi.
	patch := []byte(`{"spec":{"resources":{"requests":{"storage":"1000300k"}}}}`)
	if _, err := guest.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, claim, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	want := resource.MustParse(hostSize)
	testwait.Until(ctx, t, "the guest PV at the host's size and the claim waiting for the node", func() (bool, string) {
		if err := guestEnv.Exited(); err != nil {
			t.Fatal(err)
		}
		if evs, err := guest.CoreV1().Events(ns).List(ctx, metav1.ListOptions{}); err == nil {
			for _, e := range evs.Items {
				if e.InvolvedObject.Name == claim && e.Type == corev1.EventTypeWarning {
					t.Fatalf("the resizer reports %s: %s", e.Reason, e.Message)
				}
			}
		}
		return resizedAndPending(ctx, guest, ns, claim, vol, want)
	})
	hostPVC, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, vol, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := hostPVC.Spec.Resources.Requests[corev1.ResourceStorage]; got.Cmp(want) != 0 {
		t.Errorf("the host PVC's request became %s for an expansion it already covered", got.String())
	}
}
