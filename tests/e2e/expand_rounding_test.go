package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
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

	guestEnv, err := testenv.Start(ctx, testenv.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(guestEnv.Stop)
	guest := kubernetes.NewForConfigOrDie(guestEnv.Config)
	const class, ns, claim = "harvester", "default", "csi-resize-repro"
	oneG := resource.MustParse("1G")
	mustCreate(t, func() error {
		_, err := guest.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
			ObjectMeta: metav1.ObjectMeta{Name: class}, Provisioner: driver.Name, AllowVolumeExpansion: ptr.To(true),
		}, metav1.CreateOptions{})
		return err
	})
	pvc, err := guest.CoreV1().PersistentVolumeClaims(ns).Create(ctx, &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: claim, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, StorageClassName: ptr.To(class), VolumeName: vol,
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: oneG}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pvc.Status = corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, AccessModes: pvc.Spec.AccessModes,
		Capacity: corev1.ResourceList{corev1.ResourceStorage: oneG}}
	if _, err := guest.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pv := guestPV(vol)
	pv.Spec.Capacity = corev1.ResourceList{corev1.ResourceStorage: oneG}
	pv.Spec.StorageClassName = class
	pv.Spec.ClaimRef = &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: ns, Name: claim, UID: pvc.UID}
	if pv, err = guest.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pv.Status.Phase = corev1.VolumeBound
	if _, err := guest.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
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
		pv, err := guest.CoreV1().PersistentVolumes().Get(ctx, vol, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		pvc, err := guest.CoreV1().PersistentVolumeClaims(ns).Get(ctx, claim, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		size := pv.Spec.Capacity[corev1.ResourceStorage]
		pending := false
		for _, c := range pvc.Status.Conditions {
			pending = pending || (c.Type == corev1.PersistentVolumeClaimFileSystemResizePending && c.Status == corev1.ConditionTrue)
		}
		return size.Cmp(want) == 0 && pending, fmt.Sprintf("PV %s, PVC conditions %v", size.String(), pvc.Status.Conditions)
	})
	hostPVC, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, vol, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := hostPVC.Spec.Resources.Requests[corev1.ResourceStorage]; got.Cmp(want) != 0 {
		t.Errorf("the host PVC's request became %s for an expansion it already covered", got.String())
	}
}
