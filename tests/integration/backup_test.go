package integration

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

var backupParams = map[string]string{"type": "backup"}

var volumeSnapshots = schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshots"}

type backupSuite struct {
	h   *framework.Host
	c   csi.ControllerClient
	dyn dynamic.Interface
	// c2 is a second controller process on the same host.
	c2 csi.ControllerClient
}

// TestBackups runs backup snapshots and restores from them against the
// simulated Harvester (its VolumeRemoteBackup and -Restore controllers).
func TestBackups(t *testing.T) {
	h := framework.StartHost(t, kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Version: kubevirtsim.V1_7_0, Scale: scale})
	ctrl := h.StartController(t, framework.ControllerOptions{Backend: kubevirt.BackendAuto, Queue: queueConfig(),
		Driver: driver.ControllerOptions{HostStorageClass: kubevirtsim.DefaultStorageClass}})
	ctrl2 := h.StartController(t, framework.ControllerOptions{Backend: kubevirt.BackendAuto, Queue: queueConfig(),
		Driver: driver.ControllerOptions{HostStorageClass: kubevirtsim.DefaultStorageClass}})
	s := &backupSuite{h: h, c: ctrl.Client, c2: ctrl2.Client, dyn: dynamic.NewForConfigOrDie(h.Env.Config)}
	t.Run("BackupRestoreDelete", s.lifecycle)
	t.Run("Idempotency", s.idempotency)
	t.Run("BadInput", s.badInput)
	t.Run("NotReadyIsRetryable", s.notReady)
	t.Run("OneNameAsBackupAndSnapshotAtOnce", s.nameRace)
}

// nameRace asks for one name as a host snapshot and as a backup at the same
// time, through one controller and through two, many rounds: exactly one
// call wins, the other answers AlreadyExists, and only the winner's object
// stays on the host (no host snapshot a backup would take for its own).
func (s *backupSuite) nameRace(t *testing.T) {
	// A backup that loses waits for the host snapshot to withdraw first,
	// up to its bound, in some rounds.
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	vol, err := s.createVolume(ctx, t, "pvc-name-race", 32<<20, "")
	if err != nil {
		t.Fatal(err)
	}
	clients := []csi.ControllerClient{s.c, s.c2}
	const rounds = 12
	for i := range rounds {
		name := fmt.Sprintf("snapshot-race-%d", i)
		// Rounds alternate between one process and two, and which side
		// goes through which.
		snapC, backupC := clients[i%2], clients[(i/2)%2]
		var wg sync.WaitGroup
		var snapErr, backupErr error
		start := make(chan struct{})
		call := func(c csi.ControllerClient, params map[string]string, out *error) {
			defer wg.Done()
			<-start
			_, *out = untilFinal(ctx, t, func(ctx context.Context) error {
				_, err := c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: vol.GetVolumeId(), Parameters: params})
				return err
			})
		}
		wg.Add(2)
		go call(snapC, nil, &snapErr)
		go call(backupC, backupParams, &backupErr)
		close(start)
		wg.Wait()
		okSnap, okBackup := snapErr == nil, backupErr == nil
		if okSnap == okBackup || (!okSnap && status.Code(snapErr) != codes.AlreadyExists) || (!okBackup && status.Code(backupErr) != codes.AlreadyExists) {
			t.Fatalf("round %d: host snapshot answered %v, backup answered %v; want exactly one OK and the other AlreadyExists", i, snapErr, backupErr)
		}
		t.Logf("round %d (snapshot through controller %d, backup through %d): snapshot %v, backup %v", i, i%2, (i/2)%2, status.Code(snapErr), status.Code(backupErr))
		vs, vsErr := s.dyn.Resource(volumeSnapshots).Namespace(s.h.Namespace).Get(ctx, name, metav1.GetOptions{})
		vrb, vrbErr := s.dyn.Resource(host.BackupResource).Namespace(s.h.Namespace).Get(ctx, name, metav1.GetOptions{})
		liveBackup := vrbErr == nil && vrb.GetDeletionTimestamp() == nil
		foreignSnap := vsErr == nil && vs.GetDeletionTimestamp() == nil && metav1.GetControllerOf(vs) == nil
		if okBackup && (!liveBackup || foreignSnap) {
			t.Fatalf("round %d: the backup won, but on the host: backup %v (live %t), a host snapshot not the backup's: %t", i, vrbErr, liveBackup, foreignSnap)
		}
		if okSnap && (liveBackup || !foreignSnap) {
			t.Fatalf("round %d: the host snapshot won, but on the host: backup live %t, host snapshot %v (live %t)", i, liveBackup, vsErr, foreignSnap)
		}
	}
}

func (s *backupSuite) ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func (s *backupSuite) createVolume(ctx context.Context, t *testing.T, name string, bytes int64, snapshot string) (*csi.Volume, error) {
	t.Helper()
	req := &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: bytes},
		VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}}}
	if snapshot != "" {
		req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapshot}}}
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	r, err := s.c.CreateVolume(cctx, req)
	return r.GetVolume(), err
}

// untilFinal repeats call while it answers a retryable code, as the
// provisioner and snapshotter do, and returns the last answer.
func untilFinal(ctx context.Context, t *testing.T, call func(ctx context.Context) error) (seen []codes.Code, err error) {
	t.Helper()
	if perr := testwait.Poll(ctx, "a final answer", func() (bool, string, error) {
		err = call(ctx)
		code := status.Code(err)
		seen = append(seen, code)
		return code != codes.Unavailable && code != codes.Aborted && code != codes.DeadlineExceeded, fmt.Sprint(err), nil
	}); perr != nil {
		return seen, errors.Join(err, perr)
	}
	return seen, err
}

// backupReady calls CreateSnapshot as the snapshotter does until the answer
// says ready, and returns the answers' ready flags and the snapshot.
func (s *backupSuite) backupReady(ctx context.Context, t *testing.T, name, vol string) (readyFlags []bool, snap *csi.Snapshot) {
	t.Helper()
	_, err := untilFinal(ctx, t, func(ctx context.Context) error {
		r, err := s.c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: vol, Parameters: backupParams})
		if err != nil {
			return err
		}
		snap = r.GetSnapshot()
		readyFlags = append(readyFlags, snap.GetReadyToUse())
		if !snap.GetReadyToUse() {
			return status.Error(codes.Unavailable, "not ready yet")
		}
		return nil
	})
	if err != nil {
		t.Fatalf("backup %s of %s: %v", name, vol, err)
	}
	return readyFlags, snap
}

func (s *backupSuite) restore(ctx context.Context, t *testing.T, name string, bytes int64, id string) *csi.Volume {
	t.Helper()
	var vol *csi.Volume
	if _, err := untilFinal(ctx, t, func(ctx context.Context) (err error) {
		vol, err = s.createVolume(ctx, t, name, bytes, id)
		return err
	}); err != nil {
		t.Fatalf("restore %s from %s: %v", name, id, err)
	}
	return vol
}

func (s *backupSuite) list(ctx context.Context, t *testing.T, req *csi.ListSnapshotsRequest) []string {
	t.Helper()
	r, err := s.c.ListSnapshots(ctx, req)
	if err != nil {
		t.Fatalf("ListSnapshots %v: %v", req, err)
	}
	var ids []string
	for _, e := range r.GetEntries() {
		ids = append(ids, e.GetSnapshot().GetSnapshotId())
	}
	return ids
}

func (s *backupSuite) lifecycle(t *testing.T) {
	ctx := s.ctx(t)
	ns := s.h.Namespace
	src, err := s.createVolume(ctx, t, "pvc-bk-src", 64<<20, "")
	if err != nil {
		t.Fatal(err)
	}
	flags, snap := s.backupReady(ctx, t, "snapshot-bk-1", src.GetVolumeId())
	if want := "backup:" + ns + "/snapshot-bk-1"; snap.GetSnapshotId() != want || snap.GetSourceVolumeId() != src.GetVolumeId() ||
		snap.GetSizeBytes() != 64<<20 || snap.GetCreationTime() == nil {
		t.Errorf("backup snapshot %+v, want ID %s of %s, 64 MiB", snap, want, src.GetVolumeId())
	}
	if flags[0] {
		t.Errorf("the first answer said ready before Harvester completed the backup: %v", flags)
	}
	vrb, err := s.dyn.Resource(host.BackupResource).Namespace(ns).Get(ctx, "snapshot-bk-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if vrb.GetLabels()[host.BackupSourceLabel] != src.GetVolumeId() || vrb.Object["spec"].(map[string]any)["type"] != "lh" {
		t.Errorf("VolumeRemoteBackup %v", vrb.Object)
	}

	// A host snapshot beside it: ListSnapshots covers both kinds.
	if _, err := untilFinal(ctx, t, func(ctx context.Context) error {
		_, err := s.c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-local-1", SourceVolumeId: src.GetVolumeId()})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	all := s.list(ctx, t, &csi.ListSnapshotsRequest{SourceVolumeId: src.GetVolumeId()})
	if !slices.Equal(all, []string{snap.GetSnapshotId(), "snapshot-local-1"}) {
		t.Errorf("snapshots of %s: %v", src.GetVolumeId(), all)
	}
	if got := s.list(ctx, t, &csi.ListSnapshotsRequest{SnapshotId: snap.GetSnapshotId()}); !slices.Equal(got, []string{snap.GetSnapshotId()}) {
		t.Errorf("by backup ID: %v", got)
	}
	if got := s.list(ctx, t, &csi.ListSnapshotsRequest{SnapshotId: "snapshot-local-1"}); !slices.Equal(got, []string{"snapshot-local-1"}) {
		t.Errorf("by local ID: %v", got)
	}
	first, err := s.c.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: src.GetVolumeId(), MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	second, err := s.c.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: src.GetVolumeId(), MaxEntries: 1, StartingToken: first.GetNextToken()})
	if err != nil || len(first.GetEntries()) != 1 || len(second.GetEntries()) != 1 || second.GetNextToken() != "" ||
		first.GetEntries()[0].GetSnapshot().GetSnapshotId() == second.GetEntries()[0].GetSnapshot().GetSnapshotId() {
		t.Errorf("pages %v then %v (%v)", first, second, err)
	}

	// Restore at the backup's size, and larger (the host PVC grows).
	restored := s.restore(ctx, t, "pvc-bk-restored", 64<<20, snap.GetSnapshotId())
	bigger := s.restore(ctx, t, "pvc-bk-bigger", 128<<20, snap.GetSnapshotId())
	for _, c := range []struct {
		vol   *csi.Volume
		bytes int64
	}{{restored, 64 << 20}, {bigger, 128 << 20}} {
		id := c.vol.GetVolumeId()
		if c.vol.GetCapacityBytes() != c.bytes || c.vol.GetContentSource().GetSnapshot().GetSnapshotId() != snap.GetSnapshotId() {
			t.Errorf("restored volume %+v, want %d bytes from %s", c.vol, c.bytes, snap.GetSnapshotId())
		}
		pvc, err := s.h.Kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, id, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		req := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
		if pvc.Status.Phase != corev1.ClaimBound || host.RestoreOwner(pvc) != id || pvc.Labels[host.VolumeLabel] != host.VolumeLabelValue || req.Value() != c.bytes {
			t.Errorf("host PVC %s: phase %s, restore owner %q, labels %v, request %s", id, pvc.Status.Phase, host.RestoreOwner(pvc), pvc.Labels, req.String())
		}
	}
	// A restored volume is a volume like any other: ListVolumes has it.
	lv, err := s.c.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	listed := false
	for _, e := range lv.GetEntries() {
		listed = listed || e.GetVolume().GetVolumeId() == restored.GetVolumeId()
	}
	if !listed {
		t.Errorf("ListVolumes does not list the restored volume %s", restored.GetVolumeId())
	}

	// DeleteVolume removes the restore and the PVC; DeleteSnapshot the backup.
	for _, v := range []*csi.Volume{restored, bigger} {
		if _, err := s.c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
			t.Fatalf("DeleteVolume %s: %v", v.GetVolumeId(), err)
		}
		if _, err := s.dyn.Resource(host.RestoreResource).Namespace(ns).Get(ctx, v.GetVolumeId(), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("restore %s after DeleteVolume: %v", v.GetVolumeId(), err)
		}
		if p, err := s.h.Kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, v.GetVolumeId(), metav1.GetOptions{}); err == nil && p.DeletionTimestamp == nil {
			t.Errorf("host PVC %s still there after DeleteVolume", v.GetVolumeId())
		}
		if _, err := s.c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
			t.Errorf("second DeleteVolume %s: %v", v.GetVolumeId(), err)
		}
	}
	for range 2 {
		if _, err := s.c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshotId()}); err != nil {
			t.Fatalf("DeleteSnapshot %s: %v", snap.GetSnapshotId(), err)
		}
	}
	if _, err := s.dyn.Resource(host.BackupResource).Namespace(ns).Get(ctx, "snapshot-bk-1", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("backup after DeleteSnapshot: %v", err)
	}
	if got := s.list(ctx, t, &csi.ListSnapshotsRequest{SourceVolumeId: src.GetVolumeId()}); !slices.Equal(got, []string{"snapshot-local-1"}) {
		t.Errorf("snapshots after the backup's deletion: %v", got)
	}
}

func (s *backupSuite) idempotency(t *testing.T) {
	ctx := s.ctx(t)
	a, err := s.createVolume(ctx, t, "pvc-idem-a", 32<<20, "")
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.createVolume(ctx, t, "pvc-idem-b", 32<<20, "")
	if err != nil {
		t.Fatal(err)
	}
	_, snap := s.backupReady(ctx, t, "snapshot-idem", a.GetVolumeId())
	_, again := s.backupReady(ctx, t, "snapshot-idem", a.GetVolumeId())
	if again.GetSnapshotId() != snap.GetSnapshotId() || !again.GetCreationTime().AsTime().Equal(snap.GetCreationTime().AsTime()) {
		t.Errorf("the same request again answered %+v, want %+v", again, snap)
	}
	expectCode := func(what string, err error, code codes.Code, names ...string) {
		t.Helper()
		if status.Code(err) != code {
			t.Errorf("%s: %v, want %s", what, err, code)
			return
		}
		for _, n := range names {
			if !strings.Contains(status.Convert(err).Message(), n) {
				t.Errorf("%s: message %q does not name %s", what, status.Convert(err).Message(), n)
			}
		}
	}
	_, err = s.c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-idem", SourceVolumeId: b.GetVolumeId(), Parameters: backupParams})
	expectCode("same backup name, other volume", err, codes.AlreadyExists, "snapshot-idem", b.GetVolumeId())
	_, err = s.c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-idem", SourceVolumeId: a.GetVolumeId()})
	expectCode("a host snapshot named like the backup", err, codes.AlreadyExists, "snapshot-idem")
	if _, err := untilFinal(ctx, t, func(ctx context.Context) error {
		_, err := s.c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-idem-local", SourceVolumeId: a.GetVolumeId()})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	_, err = s.c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-idem-local", SourceVolumeId: a.GetVolumeId(), Parameters: backupParams})
	expectCode("a backup named like a host snapshot", err, codes.AlreadyExists, "snapshot-idem-local")

	_, other := s.backupReady(ctx, t, "snapshot-idem-other", b.GetVolumeId())
	first := s.restore(ctx, t, "pvc-idem-restored", 32<<20, snap.GetSnapshotId())
	second := s.restore(ctx, t, "pvc-idem-restored", 32<<20, snap.GetSnapshotId())
	if first.GetVolumeId() != second.GetVolumeId() || first.GetCapacityBytes() != second.GetCapacityBytes() {
		t.Errorf("the same restore again answered %+v, want %+v", second, first)
	}
	_, err = s.createVolume(ctx, t, "pvc-idem-restored", 32<<20, other.GetSnapshotId())
	expectCode("same volume name, other backup", err, codes.AlreadyExists, "pvc-idem-restored", other.GetSnapshotId()[len("backup:"):])
	_, err = s.createVolume(ctx, t, a.GetVolumeId(), 32<<20, snap.GetSnapshotId())
	expectCode("a restore named like an existing volume", err, codes.AlreadyExists, a.GetVolumeId())
	if _, err := s.dyn.Resource(host.RestoreResource).Namespace(s.h.Namespace).Get(ctx, a.GetVolumeId(), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("a restore was created over the existing volume %s: %v", a.GetVolumeId(), err)
	}
}

func (s *backupSuite) badInput(t *testing.T) {
	ctx := s.ctx(t)
	ns := s.h.Namespace
	vol, err := s.createVolume(ctx, t, "pvc-bad-src", 32<<20, "")
	if err != nil {
		t.Fatal(err)
	}
	_, snap := s.backupReady(ctx, t, "snapshot-bad", vol.GetVolumeId())
	check := func(what string, err error, code codes.Code, name string) {
		t.Helper()
		if status.Code(err) != code || !strings.Contains(status.Convert(err).Message(), name) {
			t.Errorf("%s: %v, want %s naming %q", what, err, code, name)
		}
	}
	_, err = s.c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-x", SourceVolumeId: vol.GetVolumeId(), Parameters: map[string]string{"type": "bak"}})
	check("unknown snapshot type", err, codes.InvalidArgument, "bak")
	_, err = s.c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-x", SourceVolumeId: "pvc-nope", Parameters: backupParams})
	check("backup of a missing volume", err, codes.NotFound, "pvc-nope")
	if _, err := s.dyn.Resource(host.BackupResource).Namespace(ns).Get(ctx, "snapshot-x", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("a backup of a missing volume was created: %v", err)
	}
	for _, id := range []string{"backup:" + ns, "backup:/x", "backup:" + ns + "/", "backup:Bad_NS/x", "backup:" + ns + "/nope"} {
		_, err = s.createVolume(ctx, t, "pvc-bad-restore", 32<<20, id)
		check("restore from "+id, err, codes.NotFound, id)
		if _, err := s.c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
			t.Errorf("DeleteSnapshot %s: %v, want OK (nothing to delete)", id, err)
		}
		if got := s.list(ctx, t, &csi.ListSnapshotsRequest{SnapshotId: id}); len(got) != 0 {
			t.Errorf("ListSnapshots %s: %v", id, got)
		}
	}
	_, err = s.c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-bad-limit",
		CapacityRange:       &csi.CapacityRange{RequiredBytes: 16 << 20, LimitBytes: 16 << 20},
		VolumeCapabilities:  []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshotId()}}},
	})
	check("restore over the limit", err, codes.OutOfRange, "snapshot-bad")
	for _, name := range []string{"pvc-bad-restore", "pvc-bad-limit"} {
		if _, err := s.dyn.Resource(host.RestoreResource).Namespace(ns).Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("bad input created restore %s: %v", name, err)
		}
	}
}

// notReady: a backup Harvester cannot take yet, a restore from it, and a
// restore whose PVC does not bind yet answer Unavailable (retryable) with the
// reason, never Internal; each goes through once the host catches up.
func (s *backupSuite) notReady(t *testing.T) {
	ctx := s.ctx(t)
	ns := s.h.Namespace
	// A host PVC of a class nothing provisions: it stays Pending until the
	// test binds it, and Harvester cannot snapshot it meanwhile.
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "pvc-unbound", Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			StorageClassName: new(string), VolumeMode: ptr.To(corev1.PersistentVolumeBlock),
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: *resource.NewQuantity(32<<20, resource.BinarySI)}}}}
	if _, err := s.h.Kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	backup := func(ctx context.Context) (*csi.Snapshot, error) {
		r, err := s.c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snapshot-unbound", SourceVolumeId: "pvc-unbound", Parameters: backupParams})
		return r.GetSnapshot(), err
	}
	var codesSeen []codes.Code
	var last error
	testwait.Until(ctx, t, "backup of an unbound PVC says why it waits", testwait.Bool(func() bool {
		snap, err := backup(ctx)
		codesSeen, last = append(codesSeen, status.Code(err)), err
		if err == nil && snap.GetReadyToUse() {
			t.Fatalf("backup of an unbound PVC is ready: %+v", snap)
		}
		return status.Code(err) == codes.Unavailable
	}))
	if msg := status.Convert(last).Message(); !strings.Contains(msg, "not yet bound") || !strings.Contains(msg, "snapshot-unbound") {
		t.Errorf("backup of an unbound PVC: %v", last)
	}
	id := "backup:" + ns + "/snapshot-unbound"
	_, err := s.createVolume(ctx, t, "pvc-from-unbound", 32<<20, id)
	if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), "not complete") {
		t.Errorf("restore from an incomplete backup: %v, want Unavailable", err)
	}
	codesSeen = append(codesSeen, status.Code(err))

	// The host binds it: the backup completes.
	s.bind(ctx, t, "pvc-unbound")
	testwait.Until(ctx, t, "backup ready once the PVC is bound", testwait.Bool(func() bool {
		snap, err := backup(ctx)
		codesSeen = append(codesSeen, status.Code(err))
		return err == nil && snap.GetReadyToUse()
	}))

	// The restored PVC has the source's class, which nothing provisions: the
	// restore stays in progress until the test binds it.
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = s.createVolume(short, t, "pvc-from-unbound", 32<<20, id)
	cancel()
	if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), "in progress") || !strings.Contains(status.Convert(err).Message(), "pvc-from-unbound") {
		t.Errorf("restore whose PVC is not bound: %v, want Unavailable in progress", err)
	}
	codesSeen = append(codesSeen, status.Code(err))
	testwait.Until(ctx, t, "restored PVC created", testwait.Bool(func() bool {
		_, err := s.h.Kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "pvc-from-unbound", metav1.GetOptions{})
		return err == nil
	}))
	s.bind(ctx, t, "pvc-from-unbound")
	if _, err := untilFinal(ctx, t, func(ctx context.Context) error {
		_, err := s.createVolume(ctx, t, "pvc-from-unbound", 32<<20, id)
		codesSeen = append(codesSeen, status.Code(err))
		return err
	}); err != nil {
		t.Errorf("restore once bound: %v", err)
	}
	if slices.Contains(codesSeen, codes.Internal) {
		t.Errorf("answers %v include Internal", codesSeen)
	}
}

// bind does the host provisioner's work for a claim of a class nobody
// provisions: a PV for it and the claim Bound.
func (s *backupSuite) bind(ctx context.Context, t *testing.T, name string) {
	t.Helper()
	pvcs := s.h.Kube.CoreV1().PersistentVolumeClaims(s.h.Namespace)
	pvc, err := pvcs.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-" + name},
		Spec: corev1.PersistentVolumeSpec{Capacity: pvc.Spec.Resources.Requests, AccessModes: pvc.Spec.AccessModes, VolumeMode: pvc.Spec.VolumeMode,
			ClaimRef:               &corev1.ObjectReference{Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: kubevirtsim.LonghornProvisioner, VolumeHandle: "pv-" + name}}}}
	if _, err := s.h.Kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pvc.Spec.VolumeName = pv.Name
	if pvc, err = pvcs.Update(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pvc.Status.Phase, pvc.Status.Capacity = corev1.ClaimBound, pvc.Spec.Resources.Requests
	if _, err := pvcs.UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}
