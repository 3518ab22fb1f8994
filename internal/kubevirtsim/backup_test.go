package kubevirtsim

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
)

func newRemoteBackup(ns, name, source string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "harvesterhci.io/v1beta1",
		"kind":       backupKind,
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec":       map[string]any{"type": "lh", "source": source},
	}}
}

func newRemoteRestore(ns, name, from string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "harvesterhci.io/v1beta1",
		"kind":       restoreKind,
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec":       map[string]any{"type": "lh", "from": from},
	}}
}

// waitRemote waits until the cached backup (restores: restore=true)
// satisfies cond (nil while absent) and returns it.
func waitRemote(ctx context.Context, t *testing.T, s *Sim, restore bool, ns, name string, cond func(*unstructured.Unstructured) bool) *unstructured.Unstructured {
	t.Helper()
	inf := s.c.vrbInf
	if restore {
		inf = s.c.vrrInf
	}
	var out *unstructured.Unstructured
	waitChanged(ctx, t, s, "remote backup object "+name, func() (bool, string) {
		obj, ok, _ := inf.GetStore().GetByKey(ns + "/" + name)
		if !ok {
			return cond(nil), "absent"
		}
		out = obj.(*unstructured.Unstructured).DeepCopy()
		return cond(out), fmt.Sprintf("%v", out.Object["status"])
	})
	return out
}

func readyMessage(obj *unstructured.Unstructured) string {
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	for _, c := range conds {
		if m, _ := c.(map[string]any); m["type"] == "Ready" {
			return fmt.Sprint(m["status"], " ", m["message"])
		}
	}
	return ""
}

// TestRemoteBackupCRDs: the kinds as Harvester's CRDs define them: namespaced,
// no status subresource, spec.type an enum defaulting to "lh", the source
// (from) required.
func TestRemoteBackupCRDs(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{})
	ctx := testCtx(t, 30*time.Second)
	dyn, err := dynamic.NewForConfig(s.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range remoteBackupCRDs() {
		v := c.Spec.Versions[0]
		if c.Spec.Group != "harvesterhci.io" || v.Name != "v1beta1" || c.Spec.Scope != "Namespaced" || v.Subresources != nil {
			t.Errorf("%s: %+v %+v", c.Name, c.Spec.Names, v)
		}
	}
	vrb := newRemoteBackup(ns, "defaulted", "src")
	unstructured.RemoveNestedField(vrb.Object, "spec", "type")
	created, err := dyn.Resource(volumeRemoteBackupGVR).Namespace(ns).Create(ctx, vrb, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if typ, _, _ := unstructured.NestedString(created.Object, "spec", "type"); typ != "lh" {
		t.Errorf("spec.type defaulted to %q, want lh", typ)
	}
	bad := newRemoteBackup(ns, "bad-type", "src")
	_ = unstructured.SetNestedField(bad.Object, "nfs", "spec", "type")
	if _, err := dyn.Resource(volumeRemoteBackupGVR).Namespace(ns).Create(ctx, bad, metav1.CreateOptions{}); !apierrors.IsInvalid(err) {
		t.Errorf("spec.type nfs: %v, want Invalid", err)
	}
	noFrom := newRemoteRestore(ns, "no-from", "")
	unstructured.RemoveNestedField(noFrom.Object, "spec", "from")
	if _, err := dyn.Resource(volumeRemoteRestoreGVR).Namespace(ns).Create(ctx, noFrom, metav1.CreateOptions{}); !apierrors.IsInvalid(err) {
		t.Errorf("restore without spec.from: %v, want Invalid", err)
	}
	// A backup of a claim that does not exist says so in its Ready condition.
	waitRemote(ctx, t, s, false, ns, "defaulted", func(o *unstructured.Unstructured) bool {
		return o != nil && strings.Contains(readyMessage(o), `"src" not found`)
	})
}

// TestRemoteBackupAndRestore is the remote backup contract: a backup
// snapshots its source with the backup class and succeeds Timings.Backup
// after that snapshot is ready, with handle, provider and the source's spec;
// a restore makes content, snapshot and a PVC (owned by it) from that spec,
// whose data comes from the backup's snapshot (SnapshotHook.Restore gets the
// backup snapshot's name), and succeeds once the PVC is bound; deleting the
// restore removes what it made, deleting the backup its snapshot (the data).
func TestRemoteBackupAndRestore(t *testing.T) {
	t.Parallel()
	hook := &snapHookLog{}
	s, ns := testSim(t, Options{DiskHook: hook})
	ctx := testCtx(t, 60*time.Second)
	dyn, err := dynamic.NewForConfig(s.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	backups := dyn.Resource(volumeRemoteBackupGVR).Namespace(ns)
	restores := dyn.Resource(volumeRemoteRestoreGVR).Namespace(ns)

	class, err := dyn.Resource(volumeSnapshotClassGVR).Get(ctx, BackupSnapshotClass, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if class.Object["driver"] != LonghornProvisioner || class.Object["parameters"].(map[string]any)["type"] != "bak" {
		t.Errorf("backup class %v", class.Object)
	}

	src, err := s.CreatePVC(ctx, ns, "src", "64Mi", false)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := backups.Create(ctx, newRemoteBackup(ns, "bk", "src"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// While it works, Ready is False "Operation in progress".
	waitRemote(ctx, t, s, false, ns, "bk", func(o *unstructured.Unstructured) bool {
		return o != nil && (readyMessage(o) == "False "+msgInProgress || succeeded(o))
	})
	vrb := waitRemote(ctx, t, s, false, ns, "bk", func(o *unstructured.Unstructured) bool { return o != nil && succeeded(o) })
	if took, min := time.Since(start), s.c.t.Snapshot+s.c.t.Backup; took < min*3/4 {
		t.Errorf("backup succeeded after %v, before the snapshot and upload time %v", took, min)
	}
	handle, _, _ := unstructured.NestedString(vrb.Object, "status", "handle")
	provider, _, _ := unstructured.NestedString(vrb.Object, "status", "csiProvider")
	size, _, _ := unstructured.NestedString(vrb.Object, "status", "sourceSpec", "resources", "requests", "storage")
	if handle == "" || provider != LonghornProvisioner || size != "64Mi" || readyMessage(vrb) != "True "+msgComplete {
		t.Errorf("backup status %v", vrb.Object["status"])
	}
	vs := waitSnapshot(ctx, t, s, ns, "bk", func(vs *unstructured.Unstructured, st snapshotStatus) bool { return st.ready })
	if ref := metav1.GetControllerOf(vs); ref == nil || ref.Kind != backupKind || ref.UID != vrb.GetUID() {
		t.Errorf("backup snapshot owner %v", vs.GetOwnerReferences())
	}
	if c, _, _ := unstructured.NestedString(vs.Object, "spec", "volumeSnapshotClassName"); c != BackupSnapshotClass {
		t.Errorf("backup snapshot class %q", c)
	}
	if !slices.Contains(hook.get(), "snapshot src "+ns+"/bk") {
		t.Errorf("hook calls %v", hook.get())
	}

	// A restore of a backup that does not exist says so and makes nothing.
	if _, err := restores.Create(ctx, newRemoteRestore(ns, "orphan", ns+"/nope"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitRemote(ctx, t, s, true, ns, "orphan", func(o *unstructured.Unstructured) bool {
		return o != nil && strings.Contains(readyMessage(o), "not found")
	})
	if _, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "orphan", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("PVC of a restore without backup: %v", err)
	}

	start = time.Now()
	vrr, err := restores.Create(ctx, newRemoteRestore(ns, "rs", ns+"/bk"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitRemote(ctx, t, s, true, ns, "rs", func(o *unstructured.Unstructured) bool { return o != nil && succeeded(o) })
	if took := time.Since(start); took < s.c.t.Restore*3/4 {
		t.Errorf("restore succeeded after %v, before the download time %v", took, s.c.t.Restore)
	}
	pvc := waitBound(ctx, t, s, ns, "rs")
	if ref := metav1.GetControllerOf(pvc); ref == nil || ref.Kind != restoreKind || ref.UID != vrr.GetUID() {
		t.Errorf("restored PVC owner %v", pvc.OwnerReferences)
	}
	got := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if got.String() != "64Mi" || *pvc.Spec.VolumeMode != *src.Spec.VolumeMode || *pvc.Spec.StorageClassName != *src.Spec.StorageClassName ||
		pvc.Spec.DataSource == nil || pvc.Spec.DataSource.Name != "rs" {
		t.Errorf("restored PVC spec %+v", pvc.Spec)
	}
	content, err := dyn.Resource(volumeSnapshotContentGVR).Get(ctx, "rs", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h, _, _ := unstructured.NestedString(content.Object, "spec", "source", "snapshotHandle"); h != handle {
		t.Errorf("restore content handle %q, want the backup's %q", h, handle)
	}
	// The data comes from the backup's snapshot, not from the restore's own.
	if !slices.Contains(hook.get(), "restore "+ns+"/bk rs") {
		t.Errorf("hook calls %v, want a restore of %s/bk into rs", hook.get(), ns)
	}

	// Deleting the restore removes its PVC, snapshot and content.
	if err := restores.Delete(ctx, "rs", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitChanged(ctx, t, s, "restore objects gone", func() (bool, string) {
		p, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "rs", metav1.GetOptions{})
		pvcGone := apierrors.IsNotFound(err) || (err == nil && p.DeletionTimestamp != nil)
		_, vsLeft, _ := s.c.snapInf.GetStore().GetByKey(ns + "/rs")
		_, err = dyn.Resource(volumeSnapshotContentGVR).Get(ctx, "rs", metav1.GetOptions{})
		return pvcGone && !vsLeft && apierrors.IsNotFound(err), fmt.Sprintf("pvc gone %v, snapshot left %v, content %v", pvcGone, vsLeft, err)
	})

	// Deleting the backup deletes its snapshot, and so the data.
	if err := backups.Delete(ctx, "bk", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSnapshot(ctx, t, s, ns, "bk", func(vs *unstructured.Unstructured, _ snapshotStatus) bool { return vs == nil })
	if !slices.Contains(hook.get(), "delete "+ns+"/bk") {
		t.Errorf("hook calls %v, want the backup's data deleted", hook.get())
	}
}
