package kubevirtsim

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
)

// snapHookLog is a DiskHook that also implements SnapshotHook and records
// the snapshot calls; the first failSnapshot Snapshot calls fail.
type snapHookLog struct {
	mu           sync.Mutex
	calls        []string
	failSnapshot int
}

// The loop-device hook the node and end-to-end tests use keeps snapshots.
var (
	_ SnapshotHook = (*snapHookLog)(nil)
	_ SnapshotHook = (*loopdisk.LoopDisks)(nil)
)

func (h *snapHookLog) Plug(context.Context, string, string, string) error { return nil }
func (h *snapHookLog) Unplug(context.Context, string, string) error       { return nil }

func (h *snapHookLog) Snapshot(_ context.Context, claim, snapshot string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.failSnapshot > 0 {
		h.failSnapshot--
		h.calls = append(h.calls, fmt.Sprintf("snapshot-failed %s %s", claim, snapshot))
		return fmt.Errorf("simulated snapshot failure")
	}
	h.calls = append(h.calls, fmt.Sprintf("snapshot %s %s", claim, snapshot))
	return nil
}

func (h *snapHookLog) Restore(_ context.Context, snapshot, claim string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, fmt.Sprintf("restore %s %s", snapshot, claim))
	return nil
}

func (h *snapHookLog) DeleteSnapshot(_ context.Context, snapshot string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, "delete "+snapshot)
	return nil
}

func (h *snapHookLog) get() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.calls)
}

// before reports whether call a was logged, and before call b.
func before(calls []string, a, b string) bool {
	i, j := slices.Index(calls, a), slices.Index(calls, b)
	return i >= 0 && j > i
}

func newVolumeSnapshot(ns, name, claim string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1",
		"kind":       "VolumeSnapshot",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec": map[string]any{
			"volumeSnapshotClassName": SnapshotClass,
			"source":                  map[string]any{"persistentVolumeClaimName": claim},
		},
	}}
}

// restorePVC creates a claim of the provisioner's class restoring from
// snapshot, through dataSource or (ref) dataSourceRef.
func restorePVC(ctx context.Context, t *testing.T, s *Sim, ns, name, snapshot, size string, ref bool) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			VolumeMode:       ptr.To(corev1.PersistentVolumeBlock),
			StorageClassName: ptr.To(s.c.opts.StorageClass),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
		},
	}
	if ref {
		pvc.Spec.DataSourceRef = &corev1.TypedObjectReference{APIGroup: ptr.To(snapshotGroup), Kind: "VolumeSnapshot", Name: snapshot}
	} else {
		pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotGroup), Kind: "VolumeSnapshot", Name: snapshot}
	}
	out, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// waitChanged re-evaluates cond on every simulator event until it holds.
func waitChanged(ctx context.Context, t *testing.T, s *Sim, what string, cond func() (bool, string)) {
	t.Helper()
	for {
		ch := s.c.changed.wait()
		ok, state := cond()
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: %v (last state: %s)", what, context.Cause(ctx), state)
		case <-ch:
		case <-time.After(time.Second):
		}
	}
}

// waitSnapshot waits until the cached VolumeSnapshot satisfies cond (called
// with nil while it is not in the cache) and returns it.
func waitSnapshot(ctx context.Context, t *testing.T, s *Sim, ns, name string, cond func(*unstructured.Unstructured, snapshotStatus) bool) *unstructured.Unstructured {
	t.Helper()
	var vs *unstructured.Unstructured
	waitChanged(ctx, t, s, "snapshot "+name, func() (bool, string) {
		obj, ok, _ := s.c.snapInf.GetIndexer().GetByKey(ns + "/" + name)
		if !ok {
			return cond(nil, snapshotStatus{}), "absent"
		}
		vs = obj.(*unstructured.Unstructured).DeepCopy()
		st := statusOf(vs)
		return cond(vs, st), fmt.Sprintf("%+v", st)
	})
	return vs
}

// waitRestoreGate waits until the provisioner holds the claim back with a
// reason containing want.
func waitRestoreGate(ctx context.Context, t *testing.T, s *Sim, pvc *corev1.PersistentVolumeClaim, want string) {
	t.Helper()
	waitChanged(ctx, t, s, "restore gate of "+pvc.Name, func() (bool, string) {
		if cur, err := s.c.pvcLister.PersistentVolumeClaims(pvc.Namespace).Get(pvc.Name); err == nil && cur.Spec.VolumeName != "" {
			t.Fatalf("claim %s was provisioned (%s) instead of waiting for %q", pvc.Name, cur.Spec.VolumeName, want)
		}
		why := s.prov.restoreWaitOf(pvc.UID)
		return strings.Contains(why, want), why
	})
	cur, err := s.c.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Get(ctx, pvc.Name, metav1.GetOptions{})
	if err != nil || cur.Status.Phase != corev1.ClaimPending || cur.Spec.VolumeName != "" {
		t.Fatalf("claim %s held back by %q is not Pending: %v %+v", pvc.Name, want, err, cur)
	}
}

func waitBound(ctx context.Context, t *testing.T, s *Sim, ns, name string) *corev1.PersistentVolumeClaim {
	t.Helper()
	var pvc *corev1.PersistentVolumeClaim
	waitChanged(ctx, t, s, "claim "+name+" bound", func() (bool, string) {
		cur, err := s.c.pvcLister.PersistentVolumeClaims(ns).Get(name)
		if err != nil {
			return false, err.Error()
		}
		pvc = cur.DeepCopy()
		return cur.Status.Phase == corev1.ClaimBound, string(cur.Status.Phase)
	})
	return pvc
}

func TestSnapshotCRDs(t *testing.T) {
	want := map[string]struct {
		kind       string
		scope      apiextv1.ResourceScope
		shortNames []string
		status     bool
	}{
		"volumesnapshots.snapshot.storage.k8s.io":        {"VolumeSnapshot", apiextv1.NamespaceScoped, []string{"vs"}, true},
		"volumesnapshotcontents.snapshot.storage.k8s.io": {"VolumeSnapshotContent", apiextv1.ClusterScoped, []string{"vsc", "vscs"}, true},
		"volumesnapshotclasses.snapshot.storage.k8s.io":  {"VolumeSnapshotClass", apiextv1.ClusterScoped, []string{"vsclass", "vsclasses"}, false},
	}
	found := 0
	for _, c := range crds() {
		w, ok := want[c.Name]
		if !ok {
			continue
		}
		found++
		v := c.Spec.Versions[0]
		hasStatus := v.Subresources != nil && v.Subresources.Status != nil
		if c.Spec.Names.Kind != w.kind || c.Spec.Scope != w.scope || !slices.Equal(c.Spec.Names.ShortNames, w.shortNames) || hasStatus != w.status ||
			v.Name != "v1" || !v.Served || !v.Storage || !ptr.Deref(v.Schema.OpenAPIV3Schema.XPreserveUnknownFields, false) {
			t.Errorf("%s: %+v %+v", c.Name, c.Spec.Names, v)
		}
	}
	if found != len(want) {
		t.Errorf("found %d of the %d snapshot CRDs", found, len(want))
	}
}

// TestSnapshots is the snapshot contract: a snapshot of a bound claim becomes
// ready with a bound content; one of a missing claim reports an error until
// the claim appears; a claim restoring from a snapshot stays Pending until
// the snapshot is ready and fits; the hook sees Snapshot, Restore and
// DeleteSnapshot in order.
func TestSnapshots(t *testing.T) {
	t.Parallel()
	hook := &snapHookLog{failSnapshot: 1}
	s, ns := testSim(t, Options{DiskHook: hook})
	ctx := testCtx(t, 60*time.Second)
	// Through the front proxy, as the driver talks.
	dyn, err := dynamic.NewForConfig(s.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	snaps := dyn.Resource(volumeSnapshotGVR).Namespace(ns)
	contents := dyn.Resource(volumeSnapshotContentGVR)

	// Install wrote the class and the setting that names it.
	class, err := dyn.Resource(volumeSnapshotClassGVR).Get(ctx, SnapshotClass, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if class.Object["driver"] != LonghornProvisioner || class.Object["deletionPolicy"] != "Delete" || class.Object["parameters"].(map[string]any)["type"] != "snap" {
		t.Errorf("class %v", class.Object)
	}
	setting, err := dyn.Resource(settingsGVR).Get(ctx, CSIDriverConfigSetting, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]map[string]string
	if v, _ := setting.Object["value"].(string); json.Unmarshal([]byte(v), &cfg) != nil ||
		cfg[LonghornProvisioner]["volumeSnapshotClassName"] != SnapshotClass || cfg[LonghornProvisioner]["backupVolumeSnapshotClassName"] != "longhorn" {
		t.Errorf("setting %v", setting.Object)
	}

	// A snapshot of a bound claim: the first hook call fails and is retried.
	src, err := s.CreatePVC(ctx, ns, "src", "2Gi", false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := snaps.Create(ctx, newVolumeSnapshot(ns, "snap-1", "src"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	vs := waitSnapshot(ctx, t, s, ns, "snap-1", func(_ *unstructured.Unstructured, st snapshotStatus) bool { return st.ready })
	st := statusOf(vs)
	created, _, _ := unstructured.NestedString(vs.Object, "status", "creationTime")
	if _, err := time.Parse(time.RFC3339, created); err != nil {
		t.Errorf("creationTime %q: %v", created, err)
	}
	if st.content != "snapcontent-"+string(vs.GetUID()) || st.restoreSize != "2Gi" || st.errMessage != "" {
		t.Errorf("status %+v", st)
	}
	if !slices.Contains(vs.GetFinalizers(), snapshotBoundProtection) {
		t.Errorf("finalizers %v", vs.GetFinalizers())
	}
	content, err := contents.Get(ctx, st.content, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	str := func(fields ...string) string {
		v, _, _ := unstructured.NestedString(content.Object, fields...)
		return v
	}
	if str("spec", "driver") != LonghornProvisioner || str("spec", "deletionPolicy") != "Delete" ||
		str("spec", "source", "volumeHandle") != src.Spec.VolumeName || str("spec", "volumeSnapshotClassName") != SnapshotClass ||
		str("spec", "volumeSnapshotRef", "name") != "snap-1" || str("spec", "volumeSnapshotRef", "namespace") != ns ||
		str("spec", "volumeSnapshotRef", "uid") != string(vs.GetUID()) {
		t.Errorf("content spec %v", content.Object["spec"])
	}
	if ready, _, _ := unstructured.NestedBool(content.Object, "status", "readyToUse"); !ready {
		t.Errorf("content status %v", content.Object["status"])
	}
	if size, _, _ := unstructured.NestedInt64(content.Object, "status", "restoreSize"); size != 2<<30 {
		t.Errorf("content restoreSize %d", size)
	}
	if got, want := hook.get(), []string{"snapshot-failed src " + ns + "/snap-1", "snapshot src " + ns + "/snap-1"}; !slices.Equal(got, want) {
		t.Errorf("hook calls %q, want %q", got, want)
	}

	// A snapshot of a claim that does not exist yet reports it...
	if _, err := snaps.Create(ctx, newVolumeSnapshot(ns, "snap-2", "later"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSnapshot(ctx, t, s, ns, "snap-2", func(vs *unstructured.Unstructured, st snapshotStatus) bool {
		if vs == nil {
			return false
		}
		ready, found, _ := unstructured.NestedBool(vs.Object, "status", "readyToUse")
		return strings.Contains(st.errMessage, "failed to retrieve PVC later from the lister") && found && !ready
	})
	// ...and a claim restoring from it stays Pending at the gate.
	restored := restorePVC(ctx, t, s, ns, "restored", "snap-2", "1Gi", false)
	waitRestoreGate(ctx, t, s, restored, "snapshot snap-2 is not Ready")
	// Claims from a snapshot too large for them, or from none, wait too.
	small := restorePVC(ctx, t, s, ns, "small", "snap-1", "1Gi", true)
	waitRestoreGate(ctx, t, s, small, "requested volume size 1073741824 is less than the size 2147483648 for the source snapshot snap-1")
	orphan := restorePVC(ctx, t, s, ns, "orphan", "nope", "1Gi", false)
	waitRestoreGate(ctx, t, s, orphan, `"nope" not found`)

	// The claim appears: the snapshot is taken, then the claim restored.
	if _, err := s.CreatePVC(ctx, ns, "later", "1Gi", false); err != nil {
		t.Fatal(err)
	}
	vs2 := waitSnapshot(ctx, t, s, ns, "snap-2", func(_ *unstructured.Unstructured, st snapshotStatus) bool { return st.ready })
	if st := statusOf(vs2); st.restoreSize != "1Gi" || st.errMessage != "" {
		t.Errorf("snap-2 status %+v", st)
	}
	bound := waitBound(ctx, t, s, ns, "restored")
	if q := bound.Status.Capacity[corev1.ResourceStorage]; q.String() != "1Gi" {
		t.Errorf("restored capacity %s", q.String())
	}
	calls := hook.get()
	if !before(calls, "snapshot later "+ns+"/snap-2", "restore "+ns+"/snap-2 restored") {
		t.Errorf("hook calls %q: want the snapshot of later before the restore", calls)
	}
	if slices.ContainsFunc(calls, func(c string) bool { return strings.Contains(c, " small") || strings.Contains(c, " orphan") }) {
		t.Errorf("held-back claims were restored: %q", calls)
	}

	// Deleting a snapshot deletes its content and the hook's snapshot.
	if err := snaps.Delete(ctx, "snap-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSnapshot(ctx, t, s, ns, "snap-1", func(vs *unstructured.Unstructured, _ snapshotStatus) bool { return vs == nil })
	if _, err := contents.Get(ctx, st.content, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("content of a deleted snapshot: %v", err)
	}
	if calls := hook.get(); !before(calls, "snapshot src "+ns+"/snap-1", "delete "+ns+"/snap-1") {
		t.Errorf("hook calls %q: want the delete after the snapshot", calls)
	}
	// The claim that waited for it now waits for a missing snapshot.
	waitRestoreGate(ctx, t, s, small, `"snap-1" not found`)

	// The restored claim outlives its snapshot.
	if err := snaps.Delete(ctx, "snap-2", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSnapshot(ctx, t, s, ns, "snap-2", func(vs *unstructured.Unstructured, _ snapshotStatus) bool { return vs == nil })
	want := []string{
		"snapshot-failed src " + ns + "/snap-1",
		"snapshot src " + ns + "/snap-1",
		"snapshot later " + ns + "/snap-2",
		"restore " + ns + "/snap-2 restored",
		"delete " + ns + "/snap-1",
		"delete " + ns + "/snap-2",
	}
	// DeleteSnapshot may be repeated (a pass on a stale cache); the others
	// are not.
	var got []string
	for _, c := range hook.get() {
		if !strings.HasPrefix(c, "delete ") || !slices.Contains(got, c) {
			got = append(got, c)
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("hook calls\n got %q\nwant %q", hook.get(), want)
	}
	if cur, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "restored", metav1.GetOptions{}); err != nil || cur.Status.Phase != corev1.ClaimBound {
		t.Errorf("restored claim after its snapshot's deletion: %v %v", err, cur.Status.Phase)
	}
}

// TestSnapshotWithoutHook: a DiskHook without SnapshotHook (and none at all)
// still gets snapshots and restores; a missing class is reported.
func TestSnapshotWithoutHook(t *testing.T) {
	t.Parallel()
	s, ns := testSim(t, Options{DiskHook: &hookLog{}})
	ctx := testCtx(t, 60*time.Second)
	snaps := s.c.dyn.Resource(volumeSnapshotGVR).Namespace(ns)
	if _, err := s.CreatePVC(ctx, ns, "src", "1Gi", false); err != nil {
		t.Fatal(err)
	}
	if _, err := snaps.Create(ctx, newVolumeSnapshot(ns, "snap", "src"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	missing := newVolumeSnapshot(ns, "no-class", "src")
	_ = unstructured.SetNestedField(missing.Object, "no-such-class", "spec", "volumeSnapshotClassName")
	if _, err := snaps.Create(ctx, missing, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSnapshot(ctx, t, s, ns, "snap", func(_ *unstructured.Unstructured, st snapshotStatus) bool { return st.ready })
	waitSnapshot(ctx, t, s, ns, "no-class", func(_ *unstructured.Unstructured, st snapshotStatus) bool {
		return strings.Contains(st.errMessage, "failed to retrieve snapshot class no-such-class") && !st.ready
	})
	restorePVC(ctx, t, s, ns, "copy", "snap", "1Gi", false)
	waitBound(ctx, t, s, ns, "copy")
}
