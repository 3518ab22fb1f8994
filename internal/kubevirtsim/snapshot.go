package kubevirtsim

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// The snapshot API of external-snapshotter. The simulator reads and writes it
// unstructured, so it works as well against the real CRDs.
const snapshotGroup = "snapshot.storage.k8s.io"

var (
	volumeSnapshotGVR        = schema.GroupVersionResource{Group: snapshotGroup, Version: "v1", Resource: "volumesnapshots"}
	volumeSnapshotContentGVR = schema.GroupVersionResource{Group: snapshotGroup, Version: "v1", Resource: "volumesnapshotcontents"}
	volumeSnapshotClassGVR   = schema.GroupVersionResource{Group: snapshotGroup, Version: "v1", Resource: "volumesnapshotclasses"}
)

// SnapshotClass is the VolumeSnapshotClass Install creates for Longhorn
// in-cluster snapshots (parameters type: snap), the one CSIDriverConfigSetting
// names for driver.longhorn.io.
const SnapshotClass = "longhorn-snapshot"

// CSIDriverConfigSetting is Harvester's setting that tells a guest CSI driver
// which VolumeSnapshotClass to use for each host provisioner.
const CSIDriverConfigSetting = "csi-driver-config"

// csiDriverConfig is Harvester's default value of CSIDriverConfigSetting; the
// backup class it names is BackupSnapshotClass.
const csiDriverConfig = `{"driver.longhorn.io":{"volumeSnapshotClassName":"longhorn-snapshot","backupVolumeSnapshotClassName":"longhorn"}}`

// snapshotBoundProtection is the snapshot controller's finalizer. The
// simulator puts it on a VolumeSnapshot before taking it, so a deletion always
// reaches SnapshotHook.DeleteSnapshot, even one that races the snapshot.
const snapshotBoundProtection = "snapshot.storage.kubernetes.io/volumesnapshot-bound-protection"

// snapshotter is the snapshot controller and Longhorn's CSI snapshotter in
// one.
type snapshotter struct {
	c     *cluster
	prov  *provisioner // restores wait for snapshots
	queue workQueue

	mu sync.Mutex
	// start is when each VolumeSnapshot could first be taken.
	start map[types.UID]time.Time
}

func newSnapshotter(c *cluster) *snapshotter {
	return &snapshotter{c: c, queue: newWorkQueue("snapshot", c.t.BackoffBase, c.t.HandlerPoll), start: map[types.UID]time.Time{}}
}

func (s *snapshotter) register() {
	_, _ = s.c.snapInf.AddEventHandler(onEvent(func(obj any) {
		if vs, ok := obj.(*unstructured.Unstructured); ok {
			s.queue.Add(vs.GetNamespace() + "/" + vs.GetName())
			s.prov.enqueueRestoresOf(vs.GetNamespace(), vs.GetName())
		}
	}))
	_, _ = s.c.snapInf.AddEventHandler(onDelete(func(obj any) {
		if vs, ok := obj.(*unstructured.Unstructured); ok {
			s.mu.Lock()
			delete(s.start, vs.GetUID())
			s.mu.Unlock()
		}
	}))
	_, _ = s.c.pvcInf.AddEventHandler(onEvent(func(obj any) {
		if pvc, ok := obj.(*corev1.PersistentVolumeClaim); ok {
			s.enqueueSnapshotsOf(pvc.Namespace, pvc.Name)
		}
	}))
}

func (s *snapshotter) run(ctx context.Context) { s.queue.run(ctx, s.c, 2, s.sync) }
func (s *snapshotter) shutdown()               { s.queue.ShutDown() }

// ensureSnapshotConfig creates the VolumeSnapshotClass and the
// csi-driver-config setting when they are missing; existing ones are kept (a
// test may have changed them).
func (c *cluster) ensureSnapshotConfig(ctx context.Context) error {
	class := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion":     snapshotGroup + "/v1",
		"kind":           "VolumeSnapshotClass",
		"metadata":       map[string]any{"name": SnapshotClass},
		"driver":         LonghornProvisioner,
		"deletionPolicy": "Delete",
		"parameters":     map[string]any{"type": "snap"},
	}}
	backupClass := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion":     snapshotGroup + "/v1",
		"kind":           "VolumeSnapshotClass",
		"metadata":       map[string]any{"name": BackupSnapshotClass},
		"driver":         LonghornProvisioner,
		"deletionPolicy": "Delete",
		"parameters":     map[string]any{"type": "bak"},
	}}
	setting := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "harvesterhci.io/v1beta1",
		"kind":       "Setting",
		"metadata":   map[string]any{"name": CSIDriverConfigSetting},
		"default":    csiDriverConfig,
		"value":      csiDriverConfig,
	}}
	for _, w := range []struct {
		res dynamic.ResourceInterface
		obj *unstructured.Unstructured
	}{{c.dyn.Resource(volumeSnapshotClassGVR), class}, {c.dyn.Resource(volumeSnapshotClassGVR), backupClass}, {c.dyn.Resource(settingsGVR), setting}} {
		err := retryNotServed(ctx, func() error {
			_, err := w.res.Get(ctx, w.obj.GetName(), metav1.GetOptions{})
			if !apierrors.IsNotFound(err) {
				return err
			}
			if _, err := w.res.Create(ctx, w.obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return err
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("create %s %s: %w", w.obj.GetKind(), w.obj.GetName(), err)
		}
	}
	return nil
}

// snapshotHook is the DiskHook's SnapshotHook side, or nil.
func (c *cluster) snapshotHook() SnapshotHook {
	h, _ := c.opts.DiskHook.(SnapshotHook)
	return h
}

// snapshotSource is the claim a VolumeSnapshot takes a snapshot of ("" for a
// pre-provisioned snapshot, which is not simulated).
func snapshotSource(vs *unstructured.Unstructured) string {
	claim, _, _ := unstructured.NestedString(vs.Object, "spec", "source", "persistentVolumeClaimName")
	return claim
}

// snapshotStatus is what the simulator reads back from a VolumeSnapshot's
// status.
type snapshotStatus struct {
	ready       bool
	restoreSize string
	content     string
	errMessage  string
}

func statusOf(vs *unstructured.Unstructured) snapshotStatus {
	var st snapshotStatus
	st.ready, _, _ = unstructured.NestedBool(vs.Object, "status", "readyToUse")
	st.restoreSize, _, _ = unstructured.NestedString(vs.Object, "status", "restoreSize")
	st.content, _, _ = unstructured.NestedString(vs.Object, "status", "boundVolumeSnapshotContentName")
	st.errMessage, _, _ = unstructured.NestedString(vs.Object, "status", "error", "message")
	return st
}

// enqueueSnapshotsOf queues the VolumeSnapshots of claim (in ns), so a
// snapshot waiting for its claim is retried when the claim changes.
func (s *snapshotter) enqueueSnapshotsOf(ns, claim string) {
	objs, _ := s.c.snapInf.GetIndexer().ByIndex(cache.NamespaceIndex, ns)
	for _, o := range objs {
		if vs, ok := o.(*unstructured.Unstructured); ok && snapshotSource(vs) == claim {
			s.queue.Add(ns + "/" + vs.GetName())
		}
	}
}

// syncSnapshot is the snapshot controller and Longhorn's CSI snapshotter in
// one: once the source claim is bound and Timings.Snapshot has passed, it
// creates the VolumeSnapshotContent, takes the snapshot through the
// SnapshotHook and marks both ready. A snapshot that cannot be taken yet gets
// status.error and waits for its claim to change (PVC events requeue it);
// hook and API errors are retried with backoff.
func (s *snapshotter) sync(ctx context.Context, key string) (time.Duration, error) {
	obj, exists, err := s.c.snapInf.GetIndexer().GetByKey(key)
	if err != nil || !exists {
		return 0, err
	}
	vs := obj.(*unstructured.Unstructured)
	if vs.GetDeletionTimestamp() != nil {
		return 0, s.deleteSnapshot(ctx, vs)
	}
	st := statusOf(vs)
	claim := snapshotSource(vs)
	if st.ready || claim == "" {
		return 0, nil
	}
	ns, name := vs.GetNamespace(), vs.GetName()
	log := s.c.log.WithValues("volumeSnapshot", key)

	// The class decides the driver; a class of another driver has no
	// snapshotter here, as it would have none in Harvester.
	class, _, _ := unstructured.NestedString(vs.Object, "spec", "volumeSnapshotClassName")
	if class != "" {
		c, err := s.c.dyn.Resource(volumeSnapshotClassGVR).Get(ctx, class, metav1.GetOptions{})
		if err != nil {
			// No class informer: retry with backoff (the error return).
			s.snapshotError(ctx, vs, fmt.Sprintf("Failed to get snapshot class with error failed to retrieve snapshot class %s from the informer: %q", class, err.Error()))
			return 0, err
		}
		if driver, _, _ := unstructured.NestedString(c.Object, "driver"); driver != LonghornProvisioner {
			log.V(3).Info("snapshot of another driver left alone", "class", class, "driver", driver)
			return 0, nil
		}
	}

	// Messages as external-snapshotter's getClaimFromVolumeSnapshot.
	pvc, err := s.c.pvcLister.PersistentVolumeClaims(ns).Get(claim)
	switch {
	case apierrors.IsNotFound(err):
		return 0, s.snapshotError(ctx, vs, fmt.Sprintf("Failed to create snapshot content with error failed to retrieve PVC %s from the lister: %q", claim, err.Error()))
	case err != nil:
		return 0, err
	case pvc.Status.Phase != corev1.ClaimBound || pvc.Spec.VolumeName == "":
		return 0, s.snapshotError(ctx, vs, fmt.Sprintf("Failed to create snapshot content with error the PVC %s is not yet bound to a PV, will not attempt to take a snapshot", claim))
	}

	// Taking the snapshot takes Timings.Snapshot from the moment it can start.
	now := time.Now()
	s.mu.Lock()
	start, seen := s.start[vs.GetUID()]
	if !seen {
		start = now
		s.start[vs.GetUID()] = now
	}
	s.mu.Unlock()
	if at := start.Add(s.c.jit.d(s.c.t.Snapshot)); now.Before(at) {
		return at.Sub(now), nil
	}

	if !slices.Contains(vs.GetFinalizers(), snapshotBoundProtection) {
		next := vs.DeepCopy()
		next.SetFinalizers(append(next.GetFinalizers(), snapshotBoundProtection))
		if vs, err = s.c.dyn.Resource(volumeSnapshotGVR).Namespace(ns).Update(ctx, next, metav1.UpdateOptions{}); err != nil {
			return 0, err
		}
	}

	size := pvc.Status.Capacity[corev1.ResourceStorage]
	if size.IsZero() {
		size = pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	}
	content, err := s.ensureSnapshotContent(ctx, vs, pvc.Spec.VolumeName, class)
	if err != nil {
		return 0, err
	}
	// A ready content means the hook already ran (the VolumeSnapshot status
	// write failed after it): do not take the snapshot again.
	if ready, _, _ := unstructured.NestedBool(content.Object, "status", "readyToUse"); !ready {
		if h := s.c.snapshotHook(); h != nil {
			if err := h.Snapshot(ctx, claim, ns+"/"+name); err != nil {
				s.snapshotError(ctx, vs, fmt.Sprintf("Failed to check and update snapshot content: failed to take snapshot of the volume %s: %q", pvc.Spec.VolumeName, err.Error()))
				return 0, fmt.Errorf("snapshot hook: %w", err)
			}
		}
		content.Object["status"] = map[string]any{
			"creationTime":   now.UnixNano(),
			"readyToUse":     true,
			"restoreSize":    size.Value(),
			"snapshotHandle": "snap://" + pvc.Spec.VolumeName + "/snapshot-" + string(vs.GetUID()),
		}
		if _, err := s.c.dyn.Resource(volumeSnapshotContentGVR).UpdateStatus(ctx, content, metav1.UpdateOptions{}); err != nil {
			return 0, err
		}
	}

	next := vs.DeepCopy()
	next.Object["status"] = map[string]any{
		"boundVolumeSnapshotContentName": content.GetName(),
		"creationTime":                   now.UTC().Format(time.RFC3339),
		"readyToUse":                     true,
		"restoreSize":                    size.String(),
	}
	if _, err := s.c.dyn.Resource(volumeSnapshotGVR).Namespace(ns).UpdateStatus(ctx, next, metav1.UpdateOptions{}); err != nil {
		return 0, err
	}
	s.mu.Lock()
	delete(s.start, vs.GetUID())
	s.mu.Unlock()
	log.V(2).Info("snapshot ready", "claim", claim, "content", content.GetName(), "restoreSize", size.String())
	return 0, nil
}

// snapshotContentName is the content the snapshot controller creates for a
// dynamically provisioned snapshot.
func snapshotContentName(uid types.UID) string { return "snapcontent-" + string(uid) }

// ensureSnapshotContent creates (or returns) the VolumeSnapshotContent bound
// to vs, for the volume volumeHandle.
func (s *snapshotter) ensureSnapshotContent(ctx context.Context, vs *unstructured.Unstructured, volumeHandle, class string) (*unstructured.Unstructured, error) {
	res := s.c.dyn.Resource(volumeSnapshotContentGVR)
	spec := map[string]any{
		"driver":         LonghornProvisioner,
		"deletionPolicy": "Delete",
		"source":         map[string]any{"volumeHandle": volumeHandle},
		"volumeSnapshotRef": map[string]any{
			"apiVersion":      snapshotGroup + "/v1",
			"kind":            "VolumeSnapshot",
			"namespace":       vs.GetNamespace(),
			"name":            vs.GetName(),
			"uid":             string(vs.GetUID()),
			"resourceVersion": vs.GetResourceVersion(),
		},
	}
	if class != "" {
		spec["volumeSnapshotClassName"] = class
	}
	content := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": snapshotGroup + "/v1",
		"kind":       "VolumeSnapshotContent",
		"metadata":   map[string]any{"name": snapshotContentName(vs.GetUID())},
		"spec":       spec,
	}}
	created, err := res.Create(ctx, content, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return res.Get(ctx, content.GetName(), metav1.GetOptions{})
	}
	return created, err
}

// snapshotError writes status.error (and readyToUse false) unless the same
// message is there already, so a snapshot that keeps failing does not keep
// writing. Errors of the write are only logged: the caller retries anyway.
func (s *snapshotter) snapshotError(ctx context.Context, vs *unstructured.Unstructured, msg string) error {
	st := statusOf(vs)
	if st.errMessage == msg && !st.ready {
		return nil
	}
	next := vs.DeepCopy()
	status, _, _ := unstructured.NestedMap(next.Object, "status")
	if status == nil {
		status = map[string]any{}
	}
	status["readyToUse"] = false
	status["error"] = map[string]any{"message": msg, "time": time.Now().UTC().Format(time.RFC3339)}
	next.Object["status"] = status
	if _, err := s.c.dyn.Resource(volumeSnapshotGVR).Namespace(vs.GetNamespace()).UpdateStatus(ctx, next, metav1.UpdateOptions{}); err != nil {
		s.c.log.V(3).Info("snapshot error status not written", "volumeSnapshot", vs.GetNamespace()+"/"+vs.GetName(), "err", err)
		return err
	}
	s.c.log.V(2).Info("snapshot not taken", "volumeSnapshot", vs.GetNamespace()+"/"+vs.GetName(), "reason", msg)
	return nil
}

// deleteSnapshot finishes the deletion of a VolumeSnapshot the simulator took:
// with deletionPolicy Delete it deletes the snapshot (hook) and its content,
// then lifts the finalizer. A Retain content is kept with its snapshot.
func (s *snapshotter) deleteSnapshot(ctx context.Context, vs *unstructured.Unstructured) error {
	if !slices.Contains(vs.GetFinalizers(), snapshotBoundProtection) {
		return nil
	}
	ref := vs.GetNamespace() + "/" + vs.GetName()
	name := statusOf(vs).content
	if name == "" {
		name = snapshotContentName(vs.GetUID())
	}
	res := s.c.dyn.Resource(volumeSnapshotContentGVR)
	content, err := res.Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		content = nil
	case err != nil:
		return err
	}
	policy := "Delete"
	if content != nil {
		policy, _, _ = unstructured.NestedString(content.Object, "spec", "deletionPolicy")
	}
	if policy != "Retain" {
		if h := s.c.snapshotHook(); h != nil {
			if err := h.DeleteSnapshot(ctx, ref); err != nil {
				return fmt.Errorf("delete snapshot hook: %w", err)
			}
		}
		if content != nil {
			err := res.Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: ptr.To(content.GetUID())}})
			if err != nil && !apierrors.IsNotFound(err) {
				return err
			}
		}
	}
	if err := s.c.dropFinalizer(ctx, vs.GetFinalizers(), snapshotBoundProtection, func(patch []byte) error {
		_, err := s.c.dyn.Resource(volumeSnapshotGVR).Namespace(vs.GetNamespace()).Patch(ctx, vs.GetName(), types.JSONPatchType, patch, metav1.PatchOptions{})
		return err
	}); err != nil {
		return err
	}
	s.c.log.V(2).Info("snapshot deleted", "volumeSnapshot", ref, "content", name, "deletionPolicy", policy)
	return nil
}

// snapshotRef names the VolumeSnapshot a claim restores from.
type snapshotRef struct{ namespace, name string }

// restoreSource returns the VolumeSnapshot pvc restores from, from
// dataSourceRef or dataSource (the API server mirrors one into the other).
func restoreSource(pvc *corev1.PersistentVolumeClaim) (snapshotRef, bool) {
	if r := pvc.Spec.DataSourceRef; r != nil {
		if ptr.Deref(r.APIGroup, "") == snapshotGroup && r.Kind == "VolumeSnapshot" {
			ns := ptr.Deref(r.Namespace, "")
			if ns == "" {
				ns = pvc.Namespace
			}
			return snapshotRef{ns, r.Name}, true
		}
		return snapshotRef{}, false
	}
	if r := pvc.Spec.DataSource; r != nil && ptr.Deref(r.APIGroup, "") == snapshotGroup && r.Kind == "VolumeSnapshot" {
		return snapshotRef{pvc.Namespace, r.Name}, true
	}
	return snapshotRef{}, false
}

// restoreBlocked says why pvc cannot be provisioned from src yet ("" when it
// can). Messages as external-provisioner's.
func (s *snapshotter) restoreBlocked(pvc *corev1.PersistentVolumeClaim, src snapshotRef) string {
	if src.namespace != pvc.Namespace {
		return fmt.Sprintf("cross-namespace data source %s/%s is not simulated", src.namespace, src.name)
	}
	obj, exists, _ := s.c.snapInf.GetIndexer().GetByKey(src.namespace + "/" + src.name)
	if !exists {
		return fmt.Sprintf("error getting snapshot %s from api server: volumesnapshots.snapshot.storage.k8s.io %q not found", src.name, src.name)
	}
	vs := obj.(*unstructured.Unstructured)
	if vs.GetDeletionTimestamp() != nil {
		return fmt.Sprintf("snapshot %s is currently being deleted", src.name)
	}
	st := statusOf(vs)
	if !st.ready {
		return fmt.Sprintf("snapshot %s is not Ready", src.name)
	}
	want := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if have, err := resource.ParseQuantity(st.restoreSize); err == nil && want.Cmp(have) < 0 {
		return fmt.Sprintf("requested volume size %d is less than the size %d for the source snapshot %s", want.Value(), have.Value(), src.name)
	}
	return ""
}
