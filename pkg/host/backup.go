package host

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"
)

// Harvester's remote backup API (harvester/harvester, pkg/apis/harvesterhci.io/
// v1beta1/volumeremotebackup.go and the generated CRDs
// deploy/charts/harvester-crd/templates/harvesterhci.io_volumeremote{backups,
// restores}.yaml): both kinds are namespaced and have no status subresource;
// Harvester's controllers (pkg/controller/master/pvcbackup) fill the status.
//
// A VolumeRemoteBackup's spec.source names a PVC of its own namespace; the
// controller takes a VolumeSnapshot of it with the backup class of
// Harvester's csi-driver-config and, once that is done, sets
// status.success. A VolumeRemoteRestore's spec.from is "namespace/name" of a
// backup; the controller creates a PVC named after the restore, in its
// namespace and owned by it, from status.sourceSpec of the backup, and sets
// status.success once that PVC is bound.
var (
	BackupResource  = schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "volumeremotebackups"}
	RestoreResource = schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "volumeremoterestores"}
)

const (
	// BackupKind and RestoreKind are the kinds, as owner references name them.
	BackupKind  = "VolumeRemoteBackup"
	RestoreKind = "VolumeRemoteRestore"
	// backupTypeLonghorn is the only spec.type the CRDs accept ("lh").
	backupTypeLonghorn = "lh"
	// BackupSourceLabel names a backup's source volume on the backups the
	// upstream driver creates; this driver sets it too, so either driver
	// lists the other's backups.
	BackupSourceLabel = "harvesterhci.io/backupSourceVolume"
	// inProgressMessage is the Ready condition message Harvester's
	// controller writes while it works (pkg/volumeremotebackup/common/
	// operator.go, SetProcessing); any other message on a Ready=False
	// condition is the error that holds the backup or restore up.
	inProgressMessage = "Operation in progress"
)

// Backup is what the driver needs of a VolumeRemoteBackup.
type Backup struct {
	Namespace, Name string
	// SourceVolume is spec.source, the host PVC backed up.
	SourceVolume string
	CreationTime time.Time
	// Complete is status.success: the data is in the backup target.
	Complete bool
	// Bytes is the source PVC's storage request (status.sourceSpec),
	// known once the backup is complete.
	Bytes int64
	// Error is why Harvester has not completed it yet, if it said.
	Error    string
	Deleting bool
}

// Ref is the backup's "namespace/name", the form spec.from of a restore takes.
func (b *Backup) Ref() string { return b.Namespace + "/" + b.Name }

// Restore is what the driver needs of a VolumeRemoteRestore.
type Restore struct {
	Name string
	// From is spec.from, "namespace/name" of the backup.
	From     string
	Complete bool
	Error    string
	Deleting bool
}

// BackupMismatchError reports that a backup or restore name is taken by an
// object that is not what the request asks for, which CSI calls
// ALREADY_EXISTS.
type BackupMismatchError struct{ Kind, Name, Why string }

func (e *BackupMismatchError) Error() string {
	return fmt.Sprintf("%s %s already exists: %s", e.Kind, e.Name, e.Why)
}

// NotServedError says the host API has no such kind: a Harvester without
// remote backups.
type NotServedError struct {
	Kind string
	Err  error
}

func (e *NotServedError) Error() string {
	return fmt.Sprintf("the host does not serve %s (a Harvester without remote backups): %v", e.Kind, e.Err)
}

func (e *NotServedError) Unwrap() error { return e.Err }

// CreateBackup creates the VolumeRemoteBackup name of the host PVC volume, or
// returns the existing one when it backs up the same volume: the snapshotter
// calls again until the backup is complete. The name must not be taken by a
// host VolumeSnapshot of this driver either: Harvester's backup controller
// takes its snapshot under the backup's name and would adopt that one
// (settleNameRace says how a concurrent one is settled).
func (c *Client) CreateBackup(ctx context.Context, name, volume string) (*Backup, error) {
	backups := c.Dynamic.Resource(BackupResource).Namespace(c.Namespace)
	existing, err := backups.Get(ctx, name, metav1.GetOptions{})
	switch {
	case err == nil:
		b := backupFrom(existing)
		if b.SourceVolume != volume {
			return nil, &BackupMismatchError{Kind: BackupKind, Name: name, Why: fmt.Sprintf("it backs up volume %s, not %s", b.SourceVolume, volume)}
		}
		return b, nil
	case !apierrors.IsNotFound(err):
		return nil, err
	}
	if taken, err := c.foreignSnapshot(ctx, name); err != nil || taken {
		if err == nil {
			err = &BackupMismatchError{Kind: BackupKind, Name: name, Why: "a host snapshot (not a backup) has that name"}
		}
		return nil, err
	}
	if _, err := c.GetVolume(ctx, volume); err != nil {
		return nil, err
	}
	labels := map[string]string{VolumeLabel: VolumeLabelValue}
	if len(validation.IsValidLabelValue(volume)) == 0 {
		labels[BackupSourceLabel] = volume
	}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": BackupResource.GroupVersion().String(),
		"kind":       BackupKind,
		"metadata":   map[string]any{"name": name, "namespace": c.Namespace},
		"spec":       map[string]any{"type": backupTypeLonghorn, "source": volume},
	}}
	obj.SetLabels(labels)
	created, err := backups.Create(ctx, obj, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return c.CreateBackup(ctx, name, volume) // a retry of ourselves won
	}
	if apierrors.IsNotFound(err) {
		// The namespace exists (the PVC is in it): the kind does not.
		return nil, &NotServedError{Kind: "volumeremotebackups." + BackupResource.Group, Err: err}
	}
	if err != nil {
		return nil, err
	}
	if err := c.settleNameRace(ctx, name, created); err != nil {
		return nil, err
	}
	return backupFrom(created), nil
}

// nameRaceWait bounds how long a new backup waits for a host snapshot of the
// same name, created at the same time, to withdraw (settleNameRace).
const nameRaceWait = 10 * time.Second

// settleNameRace is the backup side's second check. A host snapshot and a
// backup share one namespace of names
// (Harvester's backup controller takes the VolumeSnapshot named after the
// backup for the backup's own: harvester/harvester pkg/volumeremotebackup/
// longhorn/backup.go, getVolumeSnapshotForRemoteBackup reads it by name and
// checks no owner). Two calls for one name, possibly from two controller
// processes, each check the other kind before creating their object and
// again after; the second check settles the race:
//
//   - the host snapshot side withdraws (deletes its snapshot, AlreadyExists)
//     whenever it sees a backup;
//   - the backup side, seeing a host snapshot, waits up to nameRaceWait for
//     it to withdraw; if it does not, it withdraws itself.
//
// Whichever of the two creates came first, exactly one object stays: if the
// snapshot side saw the backup, it withdraws, and the backup side sees that;
// if it did not, its check came before the backup existed, so it has
// answered already and its snapshot stays, and the backup side withdraws.
// Creation timestamps (whole seconds) cannot order two creates in one second,
// so they are not used. Only the call that created the object checks after
// creating; a retry that finds it keeps it. The snapshot side never waits,
// so the foreign snapshot a backup might be shown lasts as short as possible.
func (c *Client) settleNameRace(ctx context.Context, name string, created *unstructured.Unstructured) error {
	taken, err := c.foreignSnapshot(ctx, name)
	if err == nil && taken {
		// A read that fails inside the wait is asked again: near the
		// wait's bound the client's rate limiter refuses to wait past it
		// with an error that is no context error, and a refused read says
		// nothing about the snapshot. The verdict is the read after the
		// wait, under the caller's context.
		waitCtx, cancel := context.WithTimeout(ctx, nameRaceWait)
		_ = wait.PollUntilContextCancel(waitCtx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			taken, err := c.foreignSnapshot(ctx, name)
			return err == nil && !taken, nil
		})
		cancel()
		taken, err = c.foreignSnapshot(ctx, name)
	}
	if err == nil && !taken {
		return nil // there was none, or it withdrew
	}
	if derr := c.deleteOwn(ctx, BackupResource, created); derr != nil {
		return fmt.Errorf("backup %s/%s lost its name to a host snapshot and could not be deleted: %w", c.Namespace, name, derr)
	}
	if err != nil {
		return err
	}
	return &BackupMismatchError{Kind: BackupKind, Name: name, Why: "a host snapshot (not a backup) was created with that name at the same time"}
}

// foreignSnapshot reports whether a host VolumeSnapshot name exists that is
// not Harvester's for the backup of that name, and is not being deleted.
func (c *Client) foreignSnapshot(ctx context.Context, name string) (bool, error) {
	snap, err := c.Dynamic.Resource(snapshotResource).Namespace(c.Namespace).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, err
	}
	return snap.GetDeletionTimestamp() == nil && !ownedBy(snap, BackupKind, name), nil
}

// liveBackup reports whether a VolumeRemoteBackup name exists and is not
// being deleted. A host without the kind, or an identity that may not read
// it, has none of this driver's.
func (c *Client) liveBackup(ctx context.Context, name string) (bool, error) {
	b, err := c.Dynamic.Resource(BackupResource).Namespace(c.Namespace).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err), apierrors.IsForbidden(err):
		return false, nil
	case err != nil:
		return false, err
	}
	return b.GetDeletionTimestamp() == nil, nil
}

// deleteOwn deletes the object this call created, and no other of its name
// (a UID precondition).
func (c *Client) deleteOwn(ctx context.Context, gvr schema.GroupVersionResource, obj *unstructured.Unstructured) error {
	uid := obj.GetUID()
	err := c.Dynamic.Resource(gvr).Namespace(obj.GetNamespace()).Delete(ctx, obj.GetName(), metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
	if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
		return nil
	}
	return err
}

// GetBackup returns a VolumeRemoteBackup of any namespace (a restore may
// name another guest cluster's backup; the identity may not read it there).
func (c *Client) GetBackup(ctx context.Context, namespace, name string) (*Backup, error) {
	obj, err := c.Dynamic.Resource(BackupResource).Namespace(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return backupFrom(obj), nil
}

// DeleteBackup deletes a VolumeRemoteBackup; a missing one is not an error.
// Harvester deletes its snapshot (and with it the data in the backup target)
// through the owner reference.
func (c *Client) DeleteBackup(ctx context.Context, namespace, name string) error {
	return c.deleteObject(ctx, BackupResource, namespace, name)
}

// ListBackups returns the backups of the host namespace that a guest CSI
// driver made (this one or upstream's: both label the source volume) and that
// are not being deleted.
func (c *Client) ListBackups(ctx context.Context) ([]Backup, error) {
	list, err := c.Dynamic.Resource(BackupResource).Namespace(c.Namespace).List(ctx, metav1.ListOptions{LabelSelector: BackupSourceLabel})
	if err != nil {
		return nil, err
	}
	out := make([]Backup, 0, len(list.Items))
	for i := range list.Items {
		if b := backupFrom(&list.Items[i]); !b.Deleting {
			out = append(out, *b)
		}
	}
	return out, nil
}

// CreateRestore creates the VolumeRemoteRestore name from backup, or returns
// the existing one when it restores the same backup. Harvester's controller
// creates the host PVC of the same name, and adopts a PVC that already has
// it, so a name taken by a host PVC is refused here.
func (c *Client) CreateRestore(ctx context.Context, name string, backup *Backup) (*Restore, error) {
	restores := c.Dynamic.Resource(RestoreResource).Namespace(c.Namespace)
	existing, err := restores.Get(ctx, name, metav1.GetOptions{})
	switch {
	case err == nil:
		r := restoreFrom(existing)
		if r.From != backup.Ref() {
			return nil, &BackupMismatchError{Kind: RestoreKind, Name: name, Why: fmt.Sprintf("it restores backup %s, not %s", r.From, backup.Ref())}
		}
		return r, nil
	case !apierrors.IsNotFound(err):
		return nil, err
	}
	pvc, err := c.GetVolume(ctx, name)
	switch {
	case err == nil && RestoreOwner(pvc) != name:
		return nil, &BackupMismatchError{Kind: RestoreKind, Name: name, Why: "a host PVC that is not a restore has that name"}
	case err != nil && !apierrors.IsNotFound(err):
		return nil, err
	}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": RestoreResource.GroupVersion().String(),
		"kind":       RestoreKind,
		"metadata":   map[string]any{"name": name, "namespace": c.Namespace},
		"spec":       map[string]any{"type": backupTypeLonghorn, "from": backup.Ref()},
	}}
	obj.SetLabels(map[string]string{VolumeLabel: VolumeLabelValue})
	created, err := restores.Create(ctx, obj, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return c.CreateRestore(ctx, name, backup)
	}
	if apierrors.IsNotFound(err) {
		return nil, &NotServedError{Kind: "volumeremoterestores." + RestoreResource.Group, Err: err}
	}
	if err != nil {
		return nil, err
	}
	return restoreFrom(created), nil
}

// GetRestore returns a VolumeRemoteRestore of the host namespace.
func (c *Client) GetRestore(ctx context.Context, name string) (*Restore, error) {
	obj, err := c.Dynamic.Resource(RestoreResource).Namespace(c.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return restoreFrom(obj), nil
}

// DeleteRestore deletes a VolumeRemoteRestore; a missing one (or a host
// without the kind) is not an error.
func (c *Client) DeleteRestore(ctx context.Context, name string) error {
	return c.deleteObject(ctx, RestoreResource, c.Namespace, name)
}

// AdoptVolume puts this driver's label on a host PVC that Harvester created
// (a restore), so ListVolumes reports it like the PVCs CreateVolume makes.
func (c *Client) AdoptVolume(ctx context.Context, name string) (*corev1.PersistentVolumeClaim, error) {
	pvcs := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace)
	var out *corev1.PersistentVolumeClaim
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pvc, err := pvcs.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if pvc.Labels[VolumeLabel] == VolumeLabelValue {
			out = pvc
			return nil
		}
		if pvc.Labels == nil {
			pvc.Labels = map[string]string{}
		}
		pvc.Labels[VolumeLabel] = VolumeLabelValue
		out, err = pvcs.Update(ctx, pvc, metav1.UpdateOptions{})
		return err
	})
	return out, err
}

// RestoreOwner is the VolumeRemoteRestore that controls pvc, or "".
func RestoreOwner(pvc *corev1.PersistentVolumeClaim) string {
	if ref := metav1.GetControllerOf(pvc); ref != nil && ref.Kind == RestoreKind && strings.HasPrefix(ref.APIVersion, RestoreResource.Group+"/") {
		return ref.Name
	}
	return ""
}

func ownedBy(obj *unstructured.Unstructured, kind, name string) bool {
	for _, ref := range obj.GetOwnerReferences() {
		if ref.Kind == kind && ref.Name == name {
			return true
		}
	}
	return false
}

func backupFrom(obj *unstructured.Unstructured) *Backup {
	b := &Backup{Namespace: obj.GetNamespace(), Name: obj.GetName(), CreationTime: obj.GetCreationTimestamp().Time, Deleting: obj.GetDeletionTimestamp() != nil}
	b.SourceVolume, _, _ = unstructured.NestedString(obj.Object, "spec", "source")
	b.Complete, _, _ = unstructured.NestedBool(obj.Object, "status", "success")
	if v, ok, _ := unstructured.NestedFieldNoCopy(obj.Object, "status", "sourceSpec", "resources", "requests", "storage"); ok {
		if q, err := resource.ParseQuantity(fmt.Sprint(v)); err == nil {
			b.Bytes = q.Value()
		}
	}
	if !b.Complete {
		b.Error = readyError(obj)
	}
	return b
}

func restoreFrom(obj *unstructured.Unstructured) *Restore {
	r := &Restore{Name: obj.GetName(), Deleting: obj.GetDeletionTimestamp() != nil}
	r.From, _, _ = unstructured.NestedString(obj.Object, "spec", "from")
	r.Complete, _, _ = unstructured.NestedBool(obj.Object, "status", "success")
	if !r.Complete {
		r.Error = readyError(obj)
	}
	return r
}

// readyError is the message of a Ready=False condition that is not
// Harvester's "in progress".
func readyError(obj *unstructured.Unstructured) string {
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] != "Ready" || m["status"] != string(corev1.ConditionFalse) {
			continue
		}
		if msg, _ := m["message"].(string); msg != inProgressMessage {
			return msg
		}
	}
	return ""
}
