package host

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var snapshotResource = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshots"}

// settingResource is Harvester's settings (csi-driver-config here).
var settingResource = schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "settings"}

// Labels on a host VolumeSnapshot that a restore reads back (upstream's
// names): the class and volume mode the restored host PVC must have.
const (
	SnapshotClassLabel = "harvesterhci.io/snapHostSC"
	SnapshotModeLabel  = "harvesterhci.io/snapHostVolumeMode"
)

// driverConfigSetting maps a host provisioner to the VolumeSnapshotClass its
// snapshots use (Harvester's csi-driver-config setting).
const driverConfigSetting = "csi-driver-config"

// Snapshot is what the driver needs of a host VolumeSnapshot.
type Snapshot struct {
	Name         string
	SourceVolume string
	CreationTime time.Time
	ReadyToUse   bool
	RestoreBytes int64
	// Error is the snapshot controller's last error, if any.
	Error string
	// StorageClass and VolumeMode are the source host PVC's, for restores.
	StorageClass string
	VolumeMode   corev1.PersistentVolumeMode
	Deleting     bool
}

// SnapshotMismatchError reports an existing host snapshot of another volume
// under the requested name, which CSI calls ALREADY_EXISTS.
type SnapshotMismatchError struct{ Name, Source, Requested string }

func (e *SnapshotMismatchError) Error() string {
	return fmt.Sprintf("host snapshot %s already exists for volume %s, not %s", e.Name, e.Source, e.Requested)
}

// CreateSnapshot creates the host VolumeSnapshot of a volume's host PVC, or
// returns the existing one of that name when it has the same source: the
// snapshotter retries CreateSnapshot until the snapshot is ready. The name
// must not be a backup's (settleNameRace in backup.go says how a concurrent
// one is settled).
func (c *Client) CreateSnapshot(ctx context.Context, name, volume string) (*Snapshot, error) {
	snaps := c.Dynamic.Resource(snapshotResource).Namespace(c.Namespace)
	if existing, err := snaps.Get(ctx, name, metav1.GetOptions{}); err == nil {
		if ownedBy(existing, BackupKind, name) {
			// Harvester's snapshot for the backup of that name.
			return nil, &BackupMismatchError{Kind: "host snapshot", Name: name, Why: "it belongs to the backup " + c.Namespace + "/" + name}
		}
		s := snapshotFrom(existing)
		if s.SourceVolume != volume {
			return nil, &SnapshotMismatchError{Name: name, Source: s.SourceVolume, Requested: volume}
		}
		return s, nil
	} else if !apierrors.IsNotFound(err) {
		return nil, err
	}
	if taken, err := c.liveBackup(ctx, name); err != nil || taken {
		if err == nil {
			err = &BackupMismatchError{Kind: "host snapshot", Name: name, Why: "a backup " + c.Namespace + "/" + name + " has that name"}
		}
		return nil, err
	}
	pvc, err := c.GetVolume(ctx, volume)
	if err != nil {
		return nil, err
	}
	labels := map[string]string{VolumeLabel: VolumeLabelValue}
	if pvc.Spec.StorageClassName != nil {
		labels[SnapshotClassLabel] = *pvc.Spec.StorageClassName
	}
	if pvc.Spec.VolumeMode != nil {
		labels[SnapshotModeLabel] = string(*pvc.Spec.VolumeMode)
	}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1",
		"kind":       "VolumeSnapshot",
		"metadata":   map[string]any{"name": name, "namespace": c.Namespace},
		"spec": map[string]any{
			"source": map[string]any{"persistentVolumeClaimName": volume},
		},
	}}
	obj.SetLabels(labels)
	class, err := c.snapshotClass(ctx, pvc)
	if err != nil {
		return nil, err
	}
	if class != "" {
		_ = unstructured.SetNestedField(obj.Object, class, "spec", "volumeSnapshotClassName")
	}
	created, err := snaps.Create(ctx, obj, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return c.CreateSnapshot(ctx, name, volume) // lost a race with a retry of ourselves
	}
	if err != nil {
		return nil, err
	}
	// A backup of the same name created since the check above wins: its
	// side may already have answered, and Harvester's backup controller
	// would take this snapshot for the backup's own.
	if taken, err := c.liveBackup(ctx, name); err != nil || taken {
		if derr := c.deleteOwn(ctx, snapshotResource, created); derr != nil {
			return nil, fmt.Errorf("host snapshot %s lost its name to a backup and could not be deleted: %w", name, derr)
		}
		if err == nil {
			err = &BackupMismatchError{Kind: "host snapshot", Name: name, Why: "a backup " + c.Namespace + "/" + name + " was created with that name at the same time"}
		}
		return nil, err
	}
	return snapshotFrom(created), nil
}

// snapshotClass reads which VolumeSnapshotClass the host provisioner of pvc
// uses from Harvester's csi-driver-config; none configured means the host's
// default class.
func (c *Client) snapshotClass(ctx context.Context, pvc *corev1.PersistentVolumeClaim) (string, error) {
	provisioner := pvc.Annotations["volume.kubernetes.io/storage-provisioner"]
	if provisioner == "" {
		provisioner = pvc.Annotations["volume.beta.kubernetes.io/storage-provisioner"]
	}
	setting, err := c.Dynamic.Resource(settingResource).Get(ctx, driverConfigSetting, metav1.GetOptions{})
	if apierrors.IsNotFound(err) || apierrors.IsForbidden(err) || provisioner == "" {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	value, _, _ := unstructured.NestedString(setting.Object, "value")
	if value == "" {
		value, _, _ = unstructured.NestedString(setting.Object, "default")
	}
	var config map[string]struct {
		VolumeSnapshotClassName string `json:"volumeSnapshotClassName"`
	}
	if value == "" {
		return "", nil
	}
	if err := json.Unmarshal([]byte(value), &config); err != nil {
		return "", fmt.Errorf("setting %s is not valid JSON: %w", driverConfigSetting, err)
	}
	return config[provisioner].VolumeSnapshotClassName, nil
}

// GetSnapshot returns a host snapshot.
func (c *Client) GetSnapshot(ctx context.Context, name string) (*Snapshot, error) {
	obj, err := c.Dynamic.Resource(snapshotResource).Namespace(c.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return snapshotFrom(obj), nil
}

// DeleteSnapshot deletes a host snapshot; a missing one is not an error.
func (c *Client) DeleteSnapshot(ctx context.Context, name string) error {
	return c.deleteObject(ctx, snapshotResource, c.Namespace, name)
}

// deleteObject deletes a namespaced object of a custom resource; one that is
// already gone is not an error (deletes are retried, and a repeat must
// succeed).
func (c *Client) deleteObject(ctx context.Context, gvr schema.GroupVersionResource, namespace, name string) error {
	err := c.Dynamic.Resource(gvr).Namespace(namespace).Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// ListSnapshots returns the host snapshots this driver created that are not
// being deleted.
func (c *Client) ListSnapshots(ctx context.Context) ([]Snapshot, error) {
	list, err := c.Dynamic.Resource(snapshotResource).Namespace(c.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: VolumeLabel + "=" + VolumeLabelValue,
	})
	if err != nil {
		return nil, err
	}
	out := make([]Snapshot, 0, len(list.Items))
	for i := range list.Items {
		if s := snapshotFrom(&list.Items[i]); !s.Deleting {
			out = append(out, *s)
		}
	}
	return out, nil
}

func snapshotFrom(obj *unstructured.Unstructured) *Snapshot {
	s := &Snapshot{Name: obj.GetName(), Deleting: obj.GetDeletionTimestamp() != nil}
	s.SourceVolume, _, _ = unstructured.NestedString(obj.Object, "spec", "source", "persistentVolumeClaimName")
	s.ReadyToUse, _, _ = unstructured.NestedBool(obj.Object, "status", "readyToUse")
	s.Error, _, _ = unstructured.NestedString(obj.Object, "status", "error", "message")
	if v, ok, _ := unstructured.NestedString(obj.Object, "status", "creationTime"); ok {
		s.CreationTime, _ = time.Parse(time.RFC3339, v)
	}
	if s.CreationTime.IsZero() {
		s.CreationTime = obj.GetCreationTimestamp().Time
	}
	if v, ok, _ := unstructured.NestedFieldNoCopy(obj.Object, "status", "restoreSize"); ok {
		if q, err := resource.ParseQuantity(fmt.Sprint(v)); err == nil {
			s.RestoreBytes = q.Value()
		}
	}
	labels := obj.GetLabels()
	s.StorageClass = labels[SnapshotClassLabel]
	s.VolumeMode = corev1.PersistentVolumeMode(labels[SnapshotModeLabel])
	return s
}
