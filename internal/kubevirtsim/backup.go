package kubevirtsim

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// Harvester's remote backups (harvester/harvester master, CRDs
// deploy/charts/harvester-crd/templates/harvesterhci.io_volumeremote
// {backups,restores}.yaml, controllers pkg/controller/master/pvcbackup and
// pkg/volumeremotebackup/longhorn): a VolumeRemoteBackup takes a
// VolumeSnapshot of its source PVC, named after it and owned by it, with the
// backup class of csi-driver-config (Longhorn's type "bak", which uploads the
// data to the backup target); a VolumeRemoteRestore makes a pre-provisioned
// VolumeSnapshotContent and VolumeSnapshot from the backup's handle and a
// PVC from them, all named after it. Neither CRD has a status subresource:
// the controllers write status with a plain update.
var (
	volumeRemoteBackupGVR  = schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "volumeremotebackups"}
	volumeRemoteRestoreGVR = schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "volumeremoterestores"}
)

const (
	backupKind  = "VolumeRemoteBackup"
	restoreKind = "VolumeRemoteRestore"
	// BackupSnapshotClass is the VolumeSnapshotClass Install creates for
	// Longhorn backups (parameters type: bak), the one CSIDriverConfigSetting
	// names as driver.longhorn.io's backupVolumeSnapshotClassName.
	BackupSnapshotClass = "longhorn"
	// restoreRefAnnotation marks the snapshot objects of a restore
	// (pkg/volumeremotebackup/driver/driver.go AnnotationPVCRestoreRef).
	restoreRefAnnotation = "harvesterhci.io/pvcrestore-ref"
	// Ready condition messages of pkg/volumeremotebackup/common/operator.go.
	msgInProgress = "Operation in progress"
	msgComplete   = "Operation complete"
)

// remoteBackupCRDs are the two kinds with the spec schema of Harvester's
// CRDs (type is an enum defaulting to "lh"; source and from are required)
// and an open status, without a status subresource, as there.
func remoteBackupCRDs() []*apiextv1.CustomResourceDefinition {
	schemaWith := func(field string) *apiextv1.JSONSchemaProps {
		return &apiextv1.JSONSchemaProps{
			Type:     "object",
			Required: []string{"spec"},
			Properties: map[string]apiextv1.JSONSchemaProps{
				"spec": {
					Type:     "object",
					Required: []string{field, "type"},
					Properties: map[string]apiextv1.JSONSchemaProps{
						field: {Type: "string"},
						"type": {Type: "string", Default: &apiextv1.JSON{Raw: []byte(`"lh"`)},
							Enum: []apiextv1.JSON{{Raw: []byte(`"lh"`)}}},
					},
				},
				"status": {Type: "object", XPreserveUnknownFields: ptr.To(true)},
			},
		}
	}
	return []*apiextv1.CustomResourceDefinition{
		withoutStatus(crdDef("harvesterhci.io", "v1beta1", "volumeremotebackups", "volumeremotebackup", backupKind, true,
			[]string{"volumeremotebackup", "volumeremotebackups"}, schemaWith("source"))),
		withoutStatus(crdDef("harvesterhci.io", "v1beta1", "volumeremoterestores", "volumeremoterestore", restoreKind, true,
			[]string{"volumeremoterestore", "volumeremoterestores"}, schemaWith("from"))),
	}
}

// backupper is Harvester's VolumeRemoteBackup and VolumeRemoteRestore
// controllers, with the garbage collection of what they own (no
// kube-controller-manager runs here).
type backupper struct {
	c     *cluster
	queue workQueue

	mu sync.Mutex
	// done is when each backup's upload or restore's download ends.
	done deadlines
}

func newBackupper(c *cluster) *backupper {
	return &backupper{c: c, queue: newWorkQueue("backup", c.t.BackoffBase, c.t.HandlerPoll), done: deadlines{}}
}

// Queue keys: "b/<ns>/<name>" for a backup, "r/<ns>/<name>" for a restore.
func (b *backupper) register() {
	_, _ = b.c.vrbInf.AddEventHandler(onEvent(func(obj any) { b.queue.Add("b/" + objectKey(obj)) }))
	_, _ = b.c.vrrInf.AddEventHandler(onEvent(func(obj any) { b.queue.Add("r/" + objectKey(obj)) }))
	_, _ = b.c.snapInf.AddEventHandler(onEvent(func(obj any) {
		vs, ok := obj.(*unstructured.Unstructured)
		if !ok {
			return
		}
		if ref := metav1.GetControllerOf(vs); ref != nil && ref.Kind == backupKind {
			b.queue.Add("b/" + vs.GetNamespace() + "/" + ref.Name)
		}
		if ref := vs.GetAnnotations()[restoreRefAnnotation]; ref != "" {
			b.queue.Add("r/" + ref)
		}
	}))
	_, _ = b.c.pvcInf.AddEventHandler(onEvent(func(obj any) {
		pvc, ok := obj.(*corev1.PersistentVolumeClaim)
		if !ok {
			return
		}
		if ref := metav1.GetControllerOf(pvc); ref != nil && ref.Kind == restoreKind {
			b.queue.Add("r/" + pvc.Namespace + "/" + ref.Name)
		}
		for _, o := range b.c.vrbInf.GetStore().List() { // a backup waiting for its source
			if vrb := o.(*unstructured.Unstructured); vrb.GetNamespace() == pvc.Namespace && backupSource(vrb) == pvc.Name {
				b.queue.Add("b/" + objectKey(vrb))
			}
		}
	}))
}

func (b *backupper) run(ctx context.Context) { b.queue.run(ctx, b.c, 2, b.sync) }
func (b *backupper) shutdown()               { b.queue.ShutDown() }

func (b *backupper) sync(ctx context.Context, key string) (time.Duration, error) {
	kind, rest, _ := strings.Cut(key, "/")
	if kind == "b" {
		return b.syncBackup(ctx, rest)
	}
	return b.syncRestore(ctx, rest)
}

func backupSource(vrb *unstructured.Unstructured) string {
	s, _, _ := unstructured.NestedString(vrb.Object, "spec", "source")
	return s
}

func succeeded(obj *unstructured.Unstructured) bool {
	ok, _, _ := unstructured.NestedBool(obj.Object, "status", "success")
	return ok
}

// syncBackup: once the source PVC is bound, snapshot it with the backup
// class; Timings.Backup after that snapshot is ready (the upload), write
// handle, csiProvider, sourceSpec and success.
func (b *backupper) syncBackup(ctx context.Context, key string) (time.Duration, error) {
	obj, exists, err := b.c.vrbInf.GetStore().GetByKey(key)
	if err != nil {
		return 0, err
	}
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	if !exists {
		return 0, b.collect(ctx, ns, name, backupKind)
	}
	vrb := obj.(*unstructured.Unstructured)
	if vrb.GetDeletionTimestamp() != nil || succeeded(vrb) {
		return 0, nil
	}
	source := backupSource(vrb)
	pvc, err := b.c.pvcLister.PersistentVolumeClaims(ns).Get(source)
	if apierrors.IsNotFound(err) {
		return 0, b.setReady(ctx, volumeRemoteBackupGVR, vrb, false, err.Error(), nil)
	}
	if err != nil {
		return 0, err
	}
	snaps := b.c.dyn.Resource(volumeSnapshotGVR).Namespace(ns)
	vsObj, exists, _ := b.c.snapInf.GetStore().GetByKey(key)
	if !exists {
		vs := newVolumeSnapshotObject(ns, name, map[string]any{"persistentVolumeClaimName": source}, BackupSnapshotClass)
		vs.SetOwnerReferences([]metav1.OwnerReference{{APIVersion: volumeRemoteBackupGVR.GroupVersion().String(), Kind: backupKind,
			Name: name, UID: vrb.GetUID(), Controller: ptr.To(true)}})
		if _, err := snaps.Create(ctx, vs, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return 0, err
		}
		return 0, b.setReady(ctx, volumeRemoteBackupGVR, vrb, false, msgInProgress, nil)
	}
	vs := vsObj.(*unstructured.Unstructured)
	st := statusOf(vs)
	if !st.ready {
		msg := msgInProgress
		if st.errMessage != "" {
			msg = st.errMessage
		}
		return 0, b.setReady(ctx, volumeRemoteBackupGVR, vrb, false, msg, nil)
	}
	content, err := b.c.dyn.Resource(volumeSnapshotContentGVR).Get(ctx, st.content, metav1.GetOptions{})
	if err != nil {
		return 0, err
	}
	handle, _, _ := unstructured.NestedString(content.Object, "status", "snapshotHandle")
	now := time.Now()
	b.mu.Lock()
	at := b.done.at(string(vrb.GetUID()), now, b.c.t.Backup, b.c.jit)
	b.mu.Unlock()
	if now.Before(at) {
		return at.Sub(now), nil
	}
	spec, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&pvc.Spec)
	if err != nil {
		return 0, err
	}
	if err := b.setReady(ctx, volumeRemoteBackupGVR, vrb, true, msgComplete, map[string]any{
		"handle": handle, "csiProvider": LonghornProvisioner, "sourceSpec": spec, "success": true,
	}); err != nil {
		return 0, err
	}
	b.forget(vrb.GetUID())
	b.c.log.V(2).Info("backup complete", "volumeRemoteBackup", key, "source", source, "handle", handle)
	return 0, nil
}

// syncRestore: make the snapshot content, snapshot and PVC of the restore;
// Timings.Restore after the restore was first seen (the download) mark the
// snapshot ready, so the provisioner restores and binds the PVC; once it is
// bound, write success.
func (b *backupper) syncRestore(ctx context.Context, key string) (time.Duration, error) {
	obj, exists, err := b.c.vrrInf.GetStore().GetByKey(key)
	if err != nil {
		return 0, err
	}
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	if !exists {
		return 0, b.collect(ctx, ns, name, restoreKind)
	}
	vrr := obj.(*unstructured.Unstructured)
	if vrr.GetDeletionTimestamp() != nil || succeeded(vrr) {
		return 0, nil
	}
	from, _, _ := unstructured.NestedString(vrr.Object, "spec", "from")
	bns, bname, found := strings.Cut(from, "/")
	if !found {
		bns, bname = ns, from
	}
	vrb, err := b.c.dyn.Resource(volumeRemoteBackupGVR).Namespace(bns).Get(ctx, bname, metav1.GetOptions{})
	if err != nil {
		return 0, b.setReady(ctx, volumeRemoteRestoreGVR, vrr, false, err.Error(), nil)
	}
	handle, _, _ := unstructured.NestedString(vrb.Object, "status", "handle")
	if handle == "" {
		return 0, b.setReady(ctx, volumeRemoteRestoreGVR, vrr, false, fmt.Sprintf("source RemoteBackup %s/%s has no handle", bns, bname), nil)
	}
	sourceSpec, _, _ := unstructured.NestedMap(vrb.Object, "status", "sourceSpec")
	var spec corev1.PersistentVolumeClaimSpec
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(sourceSpec, &spec); err != nil {
		return 0, err
	}
	size := spec.Resources.Requests[corev1.ResourceStorage]
	if err := b.ensureRestoreObjects(ctx, vrr, handle, spec); err != nil {
		return 0, err
	}

	now := time.Now()
	b.mu.Lock()
	at := b.done.at(string(vrr.GetUID()), now, b.c.t.Restore, b.c.jit)
	b.mu.Unlock()
	if now.Before(at) {
		return at.Sub(now), b.setReady(ctx, volumeRemoteRestoreGVR, vrr, false, msgInProgress, nil)
	}
	if err := b.markRestoreSnapshotReady(ctx, ns, name, handle, size); err != nil {
		return 0, err
	}
	pvc, err := b.c.pvcLister.PersistentVolumeClaims(ns).Get(name)
	if err != nil || pvc.Status.Phase != corev1.ClaimBound {
		return 0, b.setReady(ctx, volumeRemoteRestoreGVR, vrr, false, msgInProgress, nil) // PVC events requeue it
	}
	if err := b.setReady(ctx, volumeRemoteRestoreGVR, vrr, true, msgComplete, map[string]any{"success": true}); err != nil {
		return 0, err
	}
	b.forget(vrr.GetUID())
	b.c.log.V(2).Info("restore complete", "volumeRemoteRestore", key, "from", from)
	return 0, nil
}

func newVolumeSnapshotObject(ns, name string, source map[string]any, class string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": snapshotGroup + "/v1",
		"kind":       "VolumeSnapshot",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec":       map[string]any{"source": source, "volumeSnapshotClassName": class},
	}}
}

// ensureRestoreObjects creates what a restore makes, each unless it exists.
func (b *backupper) ensureRestoreObjects(ctx context.Context, vrr *unstructured.Unstructured, handle string, spec corev1.PersistentVolumeClaimSpec) error {
	ns, name := vrr.GetNamespace(), vrr.GetName()
	ref := map[string]string{restoreRefAnnotation: ns + "/" + name}
	content := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": snapshotGroup + "/v1",
		"kind":       "VolumeSnapshotContent",
		"metadata":   map[string]any{"name": name},
		"spec": map[string]any{
			"deletionPolicy":          "Delete",
			"driver":                  LonghornProvisioner,
			"source":                  map[string]any{"snapshotHandle": handle},
			"volumeSnapshotRef":       map[string]any{"name": name, "namespace": ns},
			"volumeSnapshotClassName": BackupSnapshotClass,
		},
	}}
	content.SetAnnotations(ref)
	if _, err := b.c.dyn.Resource(volumeSnapshotContentGVR).Create(ctx, content, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	vs := newVolumeSnapshotObject(ns, name, map[string]any{"volumeSnapshotContentName": name}, BackupSnapshotClass)
	vs.SetAnnotations(ref)
	if _, err := b.c.dyn.Resource(volumeSnapshotGVR).Namespace(ns).Create(ctx, vs, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, OwnerReferences: []metav1.OwnerReference{{
			APIVersion: volumeRemoteRestoreGVR.GroupVersion().String(), Kind: restoreKind, Name: name, UID: vrr.GetUID(), Controller: ptr.To(true),
		}}},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: spec.AccessModes, Resources: spec.Resources, StorageClassName: spec.StorageClassName, VolumeMode: spec.VolumeMode,
			DataSource: &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotGroup), Kind: "VolumeSnapshot", Name: name},
		},
	}
	if _, err := b.c.kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// markRestoreSnapshotReady does the snapshot controller's part for the
// pre-provisioned snapshot of a restore: content and snapshot ready.
func (b *backupper) markRestoreSnapshotReady(ctx context.Context, ns, name, handle string, size resource.Quantity) error {
	if obj, ok, _ := b.c.snapInf.GetStore().GetByKey(ns + "/" + name); ok && statusOf(obj.(*unstructured.Unstructured)).ready {
		return nil
	}
	contents := b.c.dyn.Resource(volumeSnapshotContentGVR)
	content, err := contents.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	now := time.Now()
	content.Object["status"] = map[string]any{"creationTime": now.UnixNano(), "readyToUse": true, "restoreSize": size.Value(), "snapshotHandle": handle}
	if _, err := contents.UpdateStatus(ctx, content, metav1.UpdateOptions{}); err != nil {
		return err
	}
	snaps := b.c.dyn.Resource(volumeSnapshotGVR).Namespace(ns)
	vs, err := snaps.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	vs.Object["status"] = map[string]any{
		"boundVolumeSnapshotContentName": name,
		"creationTime":                   now.UTC().Format(time.RFC3339),
		"readyToUse":                     true,
		"restoreSize":                    size.String(),
	}
	_, err = snaps.UpdateStatus(ctx, vs, metav1.UpdateOptions{})
	return err
}

// setReady writes the Ready condition (and extra status fields) unless they
// are there already, with a plain update: the CRDs have no status
// subresource.
func (b *backupper) setReady(ctx context.Context, gvr schema.GroupVersionResource, obj *unstructured.Unstructured, ready bool, msg string, extra map[string]any) error {
	status, _, _ := unstructured.NestedMap(obj.Object, "status")
	if status == nil {
		status = map[string]any{}
	}
	condStatus := string(corev1.ConditionFalse)
	if ready {
		condStatus = string(corev1.ConditionTrue)
	}
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	same := len(extra) == 0
	for _, c := range conds {
		if m, _ := c.(map[string]any); m["type"] == "Ready" && (m["status"] != condStatus || m["message"] != msg) {
			same = false
		}
	}
	if same && len(conds) > 0 {
		return nil
	}
	for k, v := range extra {
		status[k] = v
	}
	status["conditions"] = []any{map[string]any{
		"type": "Ready", "status": condStatus, "message": msg, "reason": "",
		"lastTransitionTime": time.Now().UTC().Format(time.RFC3339),
	}}
	next := obj.DeepCopy()
	next.Object["status"] = status
	_, err := b.c.dyn.Resource(gvr).Namespace(obj.GetNamespace()).Update(ctx, next, metav1.UpdateOptions{})
	return err
}

// collect is the garbage collector (and the restore controller's removal)
// for an owner that is gone: the backup's snapshot; the restore's PVC,
// snapshot and snapshot content.
func (b *backupper) collect(ctx context.Context, ns, name, kind string) error {
	snaps := b.c.dyn.Resource(volumeSnapshotGVR).Namespace(ns)
	if obj, ok, _ := b.c.snapInf.GetStore().GetByKey(ns + "/" + name); ok {
		vs := obj.(*unstructured.Unstructured)
		ref := metav1.GetControllerOf(vs)
		if (ref != nil && ref.Kind == kind) || (kind == restoreKind && vs.GetAnnotations()[restoreRefAnnotation] == ns+"/"+name) {
			if err := snaps.Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: ptr.To(vs.GetUID())}}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
				return err
			}
		}
	}
	if kind != restoreKind {
		return nil
	}
	if pvc, err := b.c.pvcLister.PersistentVolumeClaims(ns).Get(name); err == nil {
		if ref := metav1.GetControllerOf(pvc); ref != nil && ref.Kind == restoreKind && pvc.DeletionTimestamp == nil {
			err := b.c.kube.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: ptr.To(pvc.UID)}})
			if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
				return err
			}
		}
	}
	contents := b.c.dyn.Resource(volumeSnapshotContentGVR)
	if content, err := contents.Get(ctx, name, metav1.GetOptions{}); err == nil && content.GetAnnotations()[restoreRefAnnotation] == ns+"/"+name {
		if err := contents.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	return nil
}

func (b *backupper) forget(uid types.UID) {
	b.mu.Lock()
	delete(b.done, string(uid))
	b.mu.Unlock()
}

// dataKey is the snapshot whose data a restore from src reads: src itself,
// or, for a pre-provisioned snapshot (a backup restore), the snapshot whose
// content has the same handle, the one SnapshotHook.Snapshot saved.
func (s *snapshotter) dataKey(ctx context.Context, src snapshotRef) string {
	key := src.namespace + "/" + src.name
	obj, ok, _ := s.c.snapInf.GetStore().GetByKey(key)
	if !ok {
		return key
	}
	contentName, _, _ := unstructured.NestedString(obj.(*unstructured.Unstructured).Object, "spec", "source", "volumeSnapshotContentName")
	if contentName == "" {
		return key
	}
	content, err := s.c.dyn.Resource(volumeSnapshotContentGVR).Get(ctx, contentName, metav1.GetOptions{})
	if err != nil {
		return key
	}
	handle, _, _ := unstructured.NestedString(content.Object, "spec", "source", "snapshotHandle")
	// The simulator's handles end in "snapshot-<uid of the VolumeSnapshot>".
	_, uid, _ := strings.Cut(handle[strings.LastIndex(handle, "/")+1:], "snapshot-")
	for _, o := range s.c.snapInf.GetStore().List() {
		if vs := o.(*unstructured.Unstructured); uid != "" && string(vs.GetUID()) == uid {
			return vs.GetNamespace() + "/" + vs.GetName()
		}
	}
	return key
}
