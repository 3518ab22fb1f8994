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
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestControllerSidecarsAndExpansion runs the controller pod's attacher,
// resizer and snapshotter against the driver with the chart's leader election, as the chart
// deploys them: both must come up and stay up (a sidecar whose capability the
// driver lacks exits at start, and the pod never gets Ready). Then a guest PVC
// is grown: the real resizer calls ControllerExpandVolume, the host PVC grows,
// and the guest PV and PVC show the new size waiting for node expansion; and a
// VolumeSnapshotContent is cut by the real snapshotter into a host snapshot.
func TestControllerSidecarsAndExpansion(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeDeclarative, Version: kubevirtsim.V1_7_0, Scale: 0.05})
	vol := h.CreateVolumes(t, "pvc-grow", 1)[0]
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: "auto", Queue: hotplug.Config{BatchWindow: 100 * time.Millisecond}})

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	g := framework.StartGuest(t)
	guestEnv, guest := g.Env, g.Kube

	// What the provisioner and the PV controller would have left behind.
	const ns, claim = "default", "data"
	createBoundClaim(ctx, t, guest, ns, claim, vol, resource.MustParse("1Gi"))

	if err := kubevirtsim.InstallSnapshotCRDs(ctx, guestEnv.Config); err != nil {
		t.Fatal(err)
	}
	socket := strings.TrimPrefix(ctrl.Endpoint, "unix://")
	common := []string{"--csi-address=" + socket, "--kubeconfig=" + guestEnv.Kubeconfig, "--leader-election",
		"--leader-election-namespace=kube-system", "--v=2"}
	if err := guestEnv.Run("csi-attacher", append(common, "--timeout=2m", "--worker-threads=100")...); err != nil {
		t.Fatal(err)
	}
	if err := guestEnv.Run("csi-resizer", append(common, "--timeout=1m50s", "--workers=10")...); err != nil {
		t.Fatal(err)
	}
	if err := guestEnv.Run("csi-snapshotter", append(common, "--timeout=1m50s", "--worker-threads=10")...); err != nil {
		t.Fatal(err)
	}

	patch := []byte(`{"spec":{"resources":{"requests":{"storage":"3Gi"}}}}`)
	if _, err := guest.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, claim, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	want := resource.MustParse("3Gi")
	testwait.Until(ctx, t, "the host PVC grown", func() (bool, string) {
		if err := guestEnv.Exited(); err != nil {
			t.Fatal(err)
		}
		p, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, vol, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		got := p.Status.Capacity[corev1.ResourceStorage]
		return got.Cmp(want) >= 0, "host capacity " + got.String()
	})
	testwait.Until(ctx, t, "the guest PV grown and the PVC waiting for the node", func() (bool, string) {
		return resizedAndPending(ctx, guest, ns, claim, vol, want)
	})
	// A snapshot as the snapshot controller hands it to the sidecar: a
	// VolumeSnapshotContent to cut. The sidecar calls CreateSnapshot until
	// the host snapshot is ready and records its handle.
	snapshotAPI := func(resource string) schema.GroupVersionResource {
		return schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: resource}
	}
	guestDyn := dynamic.NewForConfigOrDie(guestEnv.Config)
	contents := guestDyn.Resource(snapshotAPI("volumesnapshotcontents"))
	content := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
		"metadata": map[string]any{"name": "snapcontent-e2e"},
		"spec": map[string]any{
			"deletionPolicy": "Delete", "driver": driver.Name, "source": map[string]any{"volumeHandle": vol},
			"volumeSnapshotClassName": "harvester-snapshot",
			"volumeSnapshotRef":       map[string]any{"kind": "VolumeSnapshot", "name": "backup", "namespace": ns, "uid": "0e3b6c1c-0000-4000-8000-000000000001"},
		},
	}}
	snapClass := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
		"metadata": map[string]any{"name": "harvester-snapshot"}, "driver": driver.Name, "deletionPolicy": "Delete",
	}}
	if _, err := guestDyn.Resource(snapshotAPI("volumesnapshotclasses")).Create(ctx, snapClass, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := contents.Create(ctx, content, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the snapshot cut by the real csi-snapshotter", func() (bool, string) {
		c, err := contents.Get(ctx, "snapcontent-e2e", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		handle, _, _ := unstructured.NestedString(c.Object, "status", "snapshotHandle")
		ready, _, _ := unstructured.NestedBool(c.Object, "status", "readyToUse")
		return handle != "" && ready, fmt.Sprintf("status %v", c.Object["status"])
	})
	c, _ := contents.Get(ctx, "snapcontent-e2e", metav1.GetOptions{})
	handle, _, _ := unstructured.NestedString(c.Object, "status", "snapshotHandle")
	hostSnap, err := dynamic.NewForConfigOrDie(h.Env.Config).Resource(snapshotAPI("volumesnapshots")).Namespace(h.Namespace).Get(ctx, handle, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("host snapshot %s behind the content: %v", handle, err)
	}
	if src, _, _ := unstructured.NestedString(hostSnap.Object, "spec", "source", "persistentVolumeClaimName"); src != vol {
		t.Errorf("host snapshot %s is of %q, want %s", handle, src, vol)
	}

	// A backup class (type: backup): the sidecar passes the parameter, keeps
	// asking until Harvester completes the backup and records its ID.
	backupClass := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
		"metadata": map[string]any{"name": "harvester-backup"}, "driver": driver.Name, "deletionPolicy": "Delete",
		"parameters": map[string]any{"type": "backup"},
	}}
	if _, err := guestDyn.Resource(snapshotAPI("volumesnapshotclasses")).Create(ctx, backupClass, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	backupContent := content.DeepCopy()
	backupContent.SetName("snapcontent-backup-e2e")
	_ = unstructured.SetNestedField(backupContent.Object, "harvester-backup", "spec", "volumeSnapshotClassName")
	_ = unstructured.SetNestedField(backupContent.Object, "0e3b6c1c-0000-4000-8000-000000000002", "spec", "volumeSnapshotRef", "uid")
	_ = unstructured.SetNestedField(backupContent.Object, "nightly", "spec", "volumeSnapshotRef", "name")
	if _, err := contents.Create(ctx, backupContent, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var backupHandle string
	testwait.Until(ctx, t, "the backup cut by the real csi-snapshotter", func() (bool, string) {
		c, err := contents.Get(ctx, "snapcontent-backup-e2e", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		backupHandle, _, _ = unstructured.NestedString(c.Object, "status", "snapshotHandle")
		ready, _, _ := unstructured.NestedBool(c.Object, "status", "readyToUse")
		return backupHandle != "" && ready, fmt.Sprintf("status %v", c.Object["status"])
	})
	backupName, ok := strings.CutPrefix(backupHandle, "backup:"+h.Namespace+"/")
	if !ok {
		t.Fatalf("backup content handle %q, want backup:%s/<name>", backupHandle, h.Namespace)
	}
	vrb, err := dynamic.NewForConfigOrDie(h.Env.Config).Resource(host.BackupResource).Namespace(h.Namespace).Get(ctx, backupName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("host backup %s behind the content: %v", backupName, err)
	}
	if src, _, _ := unstructured.NestedString(vrb.Object, "spec", "source"); src != vol {
		t.Errorf("host backup %s is of %q, want %s", backupName, src, vol)
	}

	// The sidecars still run after a while: no capability check made one exit.
	time.Sleep(3 * time.Second)
	if err := guestEnv.Exited(); err != nil {
		t.Fatal(err)
	}
}

// createBoundClaim leaves what the provisioner and the PV controller would
// have left for an expandable claim of size on volume vol: the StorageClass
// "harvester" allowing expansion, the claim and a guest PV of that size,
// bound to each other.
func createBoundClaim(ctx context.Context, t *testing.T, guest kubernetes.Interface, ns, claim, vol string, size resource.Quantity) {
	t.Helper()
	const class = "harvester"
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
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pvc.Status = corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, AccessModes: pvc.Spec.AccessModes,
		Capacity: corev1.ResourceList{corev1.ResourceStorage: size}}
	if _, err := guest.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pv := guestPV(vol)
	pv.Spec.Capacity = corev1.ResourceList{corev1.ResourceStorage: size}
	pv.Spec.StorageClassName = class
	pv.Spec.ClaimRef = &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: ns, Name: claim, UID: pvc.UID}
	if pv, err = guest.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pv.Status.Phase = corev1.VolumeBound
	if _, err := guest.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// resizedAndPending is a testwait condition: the guest PV of vol shows want
// and the claim waits for the node's filesystem step, which is where a
// controller expansion ends.
func resizedAndPending(ctx context.Context, guest kubernetes.Interface, ns, claim, vol string, want resource.Quantity) (bool, string) {
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
}
