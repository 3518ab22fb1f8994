package driver

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// Backup snapshots (VolumeSnapshotClass parameter type: backup) are Harvester
// VolumeRemoteBackups: the data goes to Harvester's backup target, so it
// outlives the volume, the host snapshot and even the guest cluster. Their
// snapshot IDs are "backup:<host namespace>/<name>", upstream's form, so
// snapshots taken by either driver restore with the other.
const (
	snapshotTypeBackup = "backup"
	backupIDPrefix     = "backup:"
	// restoreWait bounds how long CreateVolume waits within one call for a
	// restore to complete before it answers "still in progress".
	restoreWait = 10 * time.Second
	restorePoll = 500 * time.Millisecond
)

// HostBackups is what backup snapshots need of the host (host.Client).
type HostBackups interface {
	CreateBackup(ctx context.Context, name, volume string) (*host.Backup, error)
	GetBackup(ctx context.Context, namespace, name string) (*host.Backup, error)
	DeleteBackup(ctx context.Context, namespace, name string) error
	ListBackups(ctx context.Context) ([]host.Backup, error)
	CreateRestore(ctx context.Context, name string, backup *host.Backup) (*host.Restore, error)
	GetRestore(ctx context.Context, name string) (*host.Restore, error)
	DeleteRestore(ctx context.Context, name string) error
	AdoptVolume(ctx context.Context, name string) (*corev1.PersistentVolumeClaim, error)
}

var _ HostBackups = (*host.Client)(nil)

// backups is the host's backup side, or an Unimplemented answer when the
// host client has none (test fakes of HostVolumes).
func (s *controllerService) backups() (HostBackups, error) {
	if b, ok := s.volumes.(HostBackups); ok {
		return b, nil
	}
	return nil, status.Error(codes.Unimplemented, "backup snapshots are not available with this host client")
}

func backupID(namespace, name string) string { return backupIDPrefix + namespace + "/" + name }

// isBackupID reports whether id is in the backup form at all (well formed or
// not): such an ID never names a host VolumeSnapshot.
func isBackupID(id string) bool { return strings.HasPrefix(id, backupIDPrefix) }

// parseBackupID splits a backup ID; ok is false when it cannot name a
// VolumeRemoteBackup.
func parseBackupID(id string) (namespace, name string, ok bool) {
	rest, found := strings.CutPrefix(id, backupIDPrefix)
	if !found {
		return "", "", false
	}
	namespace, name, found = strings.Cut(rest, "/")
	if !found || len(validation.IsDNS1123Label(namespace)) != 0 || !validObjectName(name) {
		return "", "", false
	}
	return namespace, name, true
}

// createBackup is CreateSnapshot for type: backup. The snapshotter calls
// again (or lists the ID) until the answer says ready.
func (s *controllerService) createBackup(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	hb, err := s.backups()
	if err != nil {
		return nil, err
	}
	name, vol := hostPVCName(req.GetName()), req.GetSourceVolumeId()
	b, err := hb.CreateBackup(ctx, name, vol)
	var mismatch *host.BackupMismatchError
	var notServed *host.NotServedError
	switch {
	case errors.As(err, &mismatch):
		return nil, status.Error(codes.AlreadyExists, err.Error())
	case errors.As(err, &notServed):
		return nil, status.Errorf(codes.FailedPrecondition, "back up volume %s as %s: %v", vol, name, err)
	case apierrors.IsNotFound(err):
		return nil, status.Errorf(codes.NotFound, "volume %s does not exist: %v", vol, err)
	case err != nil:
		return nil, apiStatus(err, "back up volume %s as %s", vol, name)
	case !b.Complete && b.Error != "":
		// An error, so it shows on the VolumeSnapshotContent; Harvester keeps
		// trying and the snapshotter asks again.
		return nil, status.Errorf(codes.Unavailable, "backup %s of volume %s is not complete: %s", b.Ref(), vol, b.Error)
	}
	klog.FromContext(ctx).V(2).Info("backup", "volume", vol, "backup", b.Ref(), "complete", b.Complete)
	return &csi.CreateSnapshotResponse{Snapshot: csiBackup(b)}, nil
}

// deleteBackup is DeleteSnapshot for a backup ID.
func (s *controllerService) deleteBackup(ctx context.Context, id string) (*csi.DeleteSnapshotResponse, error) {
	ns, name, ok := parseBackupID(id)
	if !ok {
		return &csi.DeleteSnapshotResponse{}, nil // no backup can have that ID
	}
	hb, err := s.backups()
	if err != nil {
		return nil, err
	}
	if err := hb.DeleteBackup(ctx, ns, name); err != nil {
		return nil, apiStatus(err, "delete backup %s/%s", ns, name)
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// listBackups returns the backups ListSnapshots reports: the one an ID names
// (in whatever namespace), or every backup of the host namespace. A host
// without the backup kind, or an identity that may not list it, has none to
// report: local snapshots are still listed.
func (s *controllerService) listBackups(ctx context.Context, id string) ([]*csi.Snapshot, error) {
	hb, err := s.backups()
	if err != nil {
		return nil, nil //nolint:nilerr // no backup side: nothing to list
	}
	if id != "" {
		ns, name, ok := parseBackupID(id)
		if !ok {
			return nil, nil
		}
		b, err := hb.GetBackup(ctx, ns, name)
		switch {
		case apierrors.IsNotFound(err):
			return nil, nil
		case err != nil:
			return nil, apiStatus(err, "read backup %s/%s", ns, name)
		case b.Deleting:
			return nil, nil
		}
		return []*csi.Snapshot{csiBackup(b)}, nil
	}
	list, err := hb.ListBackups(ctx)
	if apierrors.IsNotFound(err) || apierrors.IsForbidden(err) {
		klog.FromContext(ctx).V(2).Info("backups not listed", "err", err)
		return nil, nil
	}
	if err != nil {
		return nil, apiStatus(err, "list backups")
	}
	out := make([]*csi.Snapshot, 0, len(list))
	for i := range list {
		out = append(out, csiBackup(&list[i]))
	}
	return out, nil
}

func csiBackup(b *host.Backup) *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:     backupID(b.Namespace, b.Name),
		SourceVolumeId: b.SourceVolume,
		CreationTime:   timestamppb.New(b.CreationTime),
		ReadyToUse:     b.Complete,
		SizeBytes:      b.Bytes,
	}
}

// createFromBackup is CreateVolume from a backup ID: a VolumeRemoteRestore
// named after the volume, whose host PVC Harvester creates (same class, mode
// and size as the backed-up volume) and binds once the data is back. The
// volume is answered when the restore is complete; until then the answer is
// Unavailable, and the provisioner's retry finds the same restore.
func (s *controllerService) createFromBackup(ctx context.Context, req *csi.CreateVolumeRequest, spec host.VolumeSpec) (*csi.CreateVolumeResponse, error) {
	id := req.GetVolumeContentSource().GetSnapshot().GetSnapshotId()
	ns, name, ok := parseBackupID(id)
	if !ok {
		return nil, status.Errorf(codes.NotFound, "snapshot %q does not exist: not a valid backup ID (backup:<namespace>/<name>)", id)
	}
	hb, err := s.backups()
	if err != nil {
		return nil, err
	}
	log := klog.FromContext(ctx).WithValues("volume", spec.Name, "backup", ns+"/"+name)
	b, err := hb.GetBackup(ctx, ns, name)
	switch {
	case apierrors.IsNotFound(err):
		return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist: no backup %s/%s on the host", id, ns, name)
	case err != nil:
		return nil, apiStatus(err, "read backup %s/%s", ns, name)
	case b.Deleting:
		return nil, status.Errorf(codes.NotFound, "snapshot %s is being deleted", id)
	case !b.Complete:
		return nil, status.Errorf(codes.Unavailable, "backup %s is not complete yet%s", b.Ref(), suffix(b.Error))
	}
	want := spec.Bytes
	if b.Bytes > want {
		limit := req.GetCapacityRange().GetLimitBytes()
		if limit > 0 && b.Bytes > limit {
			return nil, status.Errorf(codes.OutOfRange, "backup %s holds %d bytes, more than the limit of %d bytes", b.Ref(), b.Bytes, limit)
		}
		want = b.Bytes
	}

	r, err := hb.CreateRestore(ctx, spec.Name, b)
	var mismatch *host.BackupMismatchError
	var notServed *host.NotServedError
	switch {
	case errors.As(err, &mismatch):
		return nil, status.Error(codes.AlreadyExists, err.Error())
	case errors.As(err, &notServed):
		return nil, status.Errorf(codes.FailedPrecondition, "restore volume %s from backup %s: %v", spec.Name, b.Ref(), err)
	case err != nil:
		return nil, apiStatus(err, "restore volume %s from backup %s", spec.Name, b.Ref())
	}
	if !r.Complete {
		if r, err = s.waitRestore(ctx, hb, spec.Name); err != nil {
			return nil, err
		}
	}
	if !r.Complete {
		return nil, status.Errorf(codes.Unavailable, "volume %s: the restore from backup %s is in progress%s", spec.Name, b.Ref(), suffix(r.Error))
	}

	pvc, err := hb.AdoptVolume(ctx, spec.Name)
	if err != nil {
		// Complete means Harvester saw the PVC bound: it shows up soon.
		return nil, apiStatus(err, "volume %s: host PVC of the completed restore from %s", spec.Name, b.Ref())
	}
	capacity := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if capacity.Value() < want {
		// Harvester restores at the backup's size; the claim asked for more.
		ectx, cancel := context.WithTimeout(ctx, bindWait)
		grown, err := s.volumes.ExpandVolume(ectx, spec.Name, want)
		cancel()
		if err != nil {
			// The request stays raised: the retry waits for the capacity.
			return nil, apiStatus(err, "volume %s: grow the restored host PVC to %d bytes", spec.Name, want)
		}
		pvc = grown
		capacity = pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	}
	log.Info("volume restored from backup", "bytes", capacity.Value())
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{
		VolumeId:      pvc.Name,
		CapacityBytes: capacity.Value(),
		VolumeContext: req.GetParameters(),
		ContentSource: req.GetVolumeContentSource(),
	}}, nil
}

// waitRestore polls a restore until it completes, restoreWait passes or ctx
// is nearly over; it returns the last state it read.
func (s *controllerService) waitRestore(ctx context.Context, hb HostBackups, name string) (*host.Restore, error) {
	wctx, cancel := s.withMargin(ctx)
	defer cancel()
	var last *host.Restore
	err := wait.PollUntilContextTimeout(wctx, restorePoll, restoreWait, false, func(ctx context.Context) (bool, error) {
		r, err := hb.GetRestore(ctx, name)
		if err != nil {
			return false, err
		}
		last = r
		return r.Complete, nil
	})
	switch {
	case last != nil:
		return last, nil
	case err != nil && !wait.Interrupted(err):
		return nil, apiStatus(err, "read restore %s", name)
	}
	return &host.Restore{Name: name}, nil
}

// deleteRestore removes the VolumeRemoteRestore of a volume, if there is one,
// before its host PVC is deleted: while the restore exists Harvester would
// make the PVC again. An identity that may not delete restores may not create
// them either, so a refusal means there is none.
func (s *controllerService) deleteRestore(ctx context.Context, vol string) error {
	hb, ok := s.volumes.(HostBackups)
	if !ok {
		return nil
	}
	err := hb.DeleteRestore(ctx, vol)
	switch {
	case err == nil:
		return nil
	case apierrors.IsForbidden(err):
		klog.FromContext(ctx).V(2).Info("restore not deleted: the host identity has no grant for restores", "volume", vol, "err", err)
		return nil
	}
	return apiStatus(err, "delete the restore of volume %s", vol)
}

func suffix(msg string) string {
	if msg == "" {
		return ""
	}
	return ": " + msg
}
