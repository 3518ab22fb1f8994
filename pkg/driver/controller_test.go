package driver

import (
	"context"
	"errors"
	"strings"
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
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

type fakeVolumes struct {
	pvcs    map[string]*corev1.PersistentVolumeClaim
	classes map[string]bool
	created []host.VolumeSpec
	// expandErr is what the host answers a resize with, if set.
	expandErr error
	// getErr, when set, is what every read of a PVC answers.
	getErr error
	snaps  map[string]*host.Snapshot
	// gets counts reads of a PVC.
	gets int
	// createPending leaves created PVCs unbound.
	createPending bool
	// deleteErr, when set, is what a deletion answers (nothing deleted).
	deleteErr error
}

var pvcGR = schema.GroupResource{Resource: "persistentvolumeclaims"}

func (f *fakeVolumes) CreateVolume(_ context.Context, spec host.VolumeSpec) (*corev1.PersistentVolumeClaim, error) {
	f.created = append(f.created, spec)
	if p, ok := f.pvcs[spec.Name]; ok {
		// As pkg/host: a clone may have grown past its source's size.
		if got := p.Spec.Resources.Requests[corev1.ResourceStorage]; got.Value() != spec.Bytes && (spec.FromVolume == "" || got.Value() < spec.Bytes) {
			return nil, &host.VolumeMismatchError{Name: spec.Name, Why: "size"}
		}
		return p, nil
	}
	p := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: spec.Name, Annotations: spec.Annotations}}
	p.Spec.Resources.Requests = corev1.ResourceList{corev1.ResourceStorage: *resource.NewQuantity(spec.Bytes, resource.BinarySI)}
	p.Spec.VolumeMode = &spec.Mode
	if spec.StorageClass != "" {
		p.Spec.StorageClassName = &spec.StorageClass
	}
	p.Status.Phase = corev1.ClaimBound
	if f.createPending {
		p.Status.Phase = corev1.ClaimPending
	}
	f.pvcs[spec.Name] = p
	return p, nil
}

func (f *fakeVolumes) GetVolume(_ context.Context, name string) (*corev1.PersistentVolumeClaim, error) {
	f.gets++
	if f.getErr != nil {
		return nil, f.getErr
	}
	if p, ok := f.pvcs[name]; ok {
		return p, nil
	}
	return nil, apierrors.NewNotFound(pvcGR, name)
}

func (f *fakeVolumes) DeleteVolume(_ context.Context, name string) error {
	if f.deleteErr != nil {
		return f.deleteErr
	}
	delete(f.pvcs, name)
	return nil
}

func (f *fakeVolumes) WaitBound(ctx context.Context, name string) (*corev1.PersistentVolumeClaim, error) {
	return f.GetVolume(ctx, name)
}

func (f *fakeVolumes) ListVolumes(context.Context) ([]corev1.PersistentVolumeClaim, error) {
	var out []corev1.PersistentVolumeClaim
	for _, p := range f.pvcs {
		out = append(out, *p)
	}
	return out, nil
}

func (f *fakeVolumes) ExpandVolume(_ context.Context, name string, bytes int64) (*corev1.PersistentVolumeClaim, error) {
	p, ok := f.pvcs[name]
	if !ok {
		return nil, apierrors.NewNotFound(pvcGR, name)
	}
	if f.expandErr != nil {
		return nil, f.expandErr
	}
	if cur := p.Spec.Resources.Requests[corev1.ResourceStorage]; cur.Value() < bytes {
		p.Spec.Resources.Requests[corev1.ResourceStorage] = *resource.NewQuantity(bytes, resource.BinarySI)
	}
	p.Status.Capacity = p.Spec.Resources.Requests.DeepCopy()
	return p, nil
}

func (f *fakeVolumes) CreateSnapshot(_ context.Context, name, volume string) (*host.Snapshot, error) {
	if sn, ok := f.snaps[name]; ok {
		if sn.SourceVolume != volume {
			return nil, &host.SnapshotMismatchError{Name: name, Source: sn.SourceVolume, Requested: volume}
		}
		return sn, nil
	}
	p, ok := f.pvcs[volume]
	if !ok {
		return nil, apierrors.NewNotFound(pvcGR, volume)
	}
	size := p.Spec.Resources.Requests[corev1.ResourceStorage]
	sn := &host.Snapshot{Name: name, SourceVolume: volume, ReadyToUse: true, RestoreBytes: size.Value(), VolumeMode: corev1.PersistentVolumeBlock}
	if f.snaps == nil {
		f.snaps = map[string]*host.Snapshot{}
	}
	f.snaps[name] = sn
	return sn, nil
}

func (f *fakeVolumes) GetSnapshot(_ context.Context, name string) (*host.Snapshot, error) {
	if sn, ok := f.snaps[name]; ok {
		return sn, nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Group: "snapshot.storage.k8s.io", Resource: "volumesnapshots"}, name)
}

func (f *fakeVolumes) DeleteSnapshot(_ context.Context, name string) error {
	delete(f.snaps, name)
	return nil
}

func (f *fakeVolumes) ListSnapshots(context.Context) ([]host.Snapshot, error) {
	var out []host.Snapshot
	for _, sn := range f.snaps {
		out = append(out, *sn)
	}
	return out, nil
}

func (f *fakeVolumes) StorageClassUsable(_ context.Context, name string) (bool, error) {
	return f.classes[name], nil
}

type fakeHotplug struct {
	attach, detach func(ctx context.Context, vm, vol string) error
	holders        map[string][]string
	published      map[string][]string
	lost           map[string][]string
}

func (f *fakeHotplug) Attach(ctx context.Context, vm, vol string, _ bool) error {
	return f.attach(ctx, vm, vol)
}

func (f *fakeHotplug) Detach(ctx context.Context, vm, vol string) error {
	return f.detach(ctx, vm, vol)
}

func (f *fakeHotplug) Holders(vol string) []string { return f.holders[vol] }

func (f *fakeHotplug) Published() map[string][]string { return f.published }

func (f *fakeHotplug) Lost(vol string) []string { return f.lost[vol] }

func newTestController(opts ControllerOptions) (*controllerService, *fakeVolumes, *fakeHotplug) {
	vols := &fakeVolumes{pvcs: map[string]*corev1.PersistentVolumeClaim{}, classes: map[string]bool{"longhorn": true, "fast": true}}
	hp := &fakeHotplug{
		attach:  func(context.Context, string, string) error { return nil },
		detach:  func(context.Context, string, string) error { return nil },
		holders: map[string][]string{},
	}
	return NewControllerService(opts, hp, vols).(*controllerService), vols, hp
}

func capability(mode csi.VolumeCapability_AccessMode_Mode, block bool) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if block {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}}
	}
	return c
}

var rwo = capability(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, false)

func TestCreateVolumeShape(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name      string
		opts      ControllerOptions
		params    map[string]string
		required  int64
		wantMode  corev1.PersistentVolumeMode
		wantClass string
		wantBytes int64
	}{
		{"defaults: block, host default class, 10 MiB minimum", ControllerOptions{}, nil, 0, corev1.PersistentVolumeBlock, "", 10 << 20},
		{"flag class", ControllerOptions{HostStorageClass: "longhorn"}, nil, 1 << 30, corev1.PersistentVolumeBlock, "longhorn", 1 << 30},
		{"parameter beats flag", ControllerOptions{HostStorageClass: "longhorn"}, map[string]string{"hostStorageClass": "fast"}, 1 << 30, corev1.PersistentVolumeBlock, "fast", 1 << 30},
		{"filesystem on request", ControllerOptions{}, map[string]string{"hostVolumeMode": "filesystem"}, 1 << 30, corev1.PersistentVolumeFilesystem, "", 1 << 30},
		{"rounded up to 2 MiB", ControllerOptions{}, nil, 11<<20 + 1, corev1.PersistentVolumeBlock, "", 12 << 20},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, vols, _ := newTestController(tc.opts)
			resp, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name: "pvc-1", Parameters: tc.params, VolumeCapabilities: []*csi.VolumeCapability{rwo},
				CapacityRange: &csi.CapacityRange{RequiredBytes: tc.required},
			})
			if err != nil {
				t.Fatal(err)
			}
			spec := vols.created[0]
			if spec.Name != "pvc-1" || resp.Volume.VolumeId != "pvc-1" {
				t.Errorf("volume ID %s / PVC %s, want the request name", resp.Volume.VolumeId, spec.Name)
			}
			if spec.Mode != tc.wantMode || spec.StorageClass != tc.wantClass || spec.Bytes != tc.wantBytes {
				t.Errorf("spec %+v, want mode %s class %q bytes %d", spec, tc.wantMode, tc.wantClass, tc.wantBytes)
			}
			if resp.Volume.CapacityBytes != tc.wantBytes {
				t.Errorf("capacity %d, want %d", resp.Volume.CapacityBytes, tc.wantBytes)
			}
		})
	}
}

func TestCreateVolumeErrors(t *testing.T) {
	ctx := context.Background()
	s, _, _ := newTestController(ControllerOptions{})
	rwx := capability(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, false)
	for name, tc := range map[string]struct {
		req  *csi.CreateVolumeRequest
		want codes.Code
	}{
		"no name":          {&csi.CreateVolumeRequest{VolumeCapabilities: []*csi.VolumeCapability{rwo}}, codes.InvalidArgument},
		"no capabilities":  {&csi.CreateVolumeRequest{Name: "a"}, codes.InvalidArgument},
		"multi-node":       {&csi.CreateVolumeRequest{Name: "a", VolumeCapabilities: []*csi.VolumeCapability{rwx}}, codes.InvalidArgument},
		"unknown class":    {&csi.CreateVolumeRequest{Name: "a", VolumeCapabilities: []*csi.VolumeCapability{rwo}, Parameters: map[string]string{"hostStorageClass": "nope"}}, codes.InvalidArgument},
		"limit below size": {&csi.CreateVolumeRequest{Name: "a", VolumeCapabilities: []*csi.VolumeCapability{rwo}, CapacityRange: &csi.CapacityRange{RequiredBytes: 5 << 20, LimitBytes: 6 << 20}}, codes.OutOfRange},
	} {
		if _, err := s.CreateVolume(ctx, tc.req); status.Code(err) != tc.want {
			t.Errorf("%s: got %v, want %s", name, err, tc.want)
		}
	}
	// Idempotent: same request twice is OK, a different size is AlreadyExists.
	req := &csi.CreateVolumeRequest{Name: "pvc-2", VolumeCapabilities: []*csi.VolumeCapability{rwo}, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}}
	for range 2 {
		if _, err := s.CreateVolume(ctx, req); err != nil {
			t.Fatalf("repeated create: %v", err)
		}
	}
	req.CapacityRange.RequiredBytes = 2 << 30
	if _, err := s.CreateVolume(ctx, req); status.Code(err) != codes.AlreadyExists {
		t.Errorf("create with another size: %v, want AlreadyExists", err)
	}
	if _, err := s.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "pvc-2", VolumeCapabilities: []*csi.VolumeCapability{rwx}}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("validate multi-node: %v, want InvalidArgument", err)
	}
}

func TestInvalidNamesMapToStableValidIDs(t *testing.T) {
	a, b := hostPVCName("Sanity-Volume-ABC"), hostPVCName("sanity-volume-abc-other")
	if a == hostPVCName("sanity-volume-abc") || a != hostPVCName("Sanity-Volume-ABC") || a == b {
		t.Errorf("mapping not stable or not distinct: %s %s", a, b)
	}
	if hostPVCName("pvc-0d2e6f4c-1b7a-4f0e-9d6b-2c1e5a7b9f00") != "pvc-0d2e6f4c-1b7a-4f0e-9d6b-2c1e5a7b9f00" {
		t.Error("a provisioner name must be used unchanged (upstream volume IDs)")
	}
	if long := hostPVCName(strings.Repeat("X", 128)); len(long) > 63 {
		t.Errorf("mapped name %q too long", long)
	}
}

func TestPublishErrorsAndCodes(t *testing.T) {
	ctx := context.Background()
	s, vols, hp := newTestController(ControllerOptions{})
	vols.pvcs["bound"] = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "bound"}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound}}
	vols.pvcs["pending"] = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "pending"}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimPending}}
	pub := func(vol, vm string) error {
		_, err := s.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: vm, VolumeCapability: rwo})
		return err
	}
	for _, tc := range []struct {
		name    string
		vol, vm string
		attach  error
		want    codes.Code
	}{
		{"ok", "bound", "vm1", nil, codes.OK},
		{"missing PVC", "nope", "vm1", &hotplug.ClaimNotReadyError{Volume: "nope", VM: "vm1"}, codes.NotFound},
		{"pending PVC", "pending", "vm1", &hotplug.ClaimNotReadyError{Volume: "pending", VM: "vm1", Phase: corev1.ClaimPending}, codes.Aborted},
		{"unknown VM", "bound", "vm1", hotplug.ErrVMNotFound, codes.NotFound},
		{"held elsewhere", "bound", "vm1", &hotplug.HeldError{Volume: "bound", VM: "vm0", State: "attached"}, codes.FailedPrecondition},
		{"superseded", "bound", "vm1", &hotplug.SupersededError{Volume: "bound", VM: "vm1", By: hotplug.Detach}, codes.Aborted},
		{"rejected", "bound", "vm1", &hotplug.RejectedError{Volume: "bound", VM: "vm1", Err: errors.New("denied")}, codes.FailedPrecondition},
		{"in flight at deadline", "bound", "vm1", context.DeadlineExceeded, codes.DeadlineExceeded},
		{"controller stopping", "bound", "vm1", hotplug.ErrStopped, codes.Unavailable},
		{"no volume", "", "vm1", nil, codes.InvalidArgument},
		{"no node", "bound", "", nil, codes.InvalidArgument},
	} {
		hp.attach = func(context.Context, string, string) error { return tc.attach }
		if err := pub(tc.vol, tc.vm); status.Code(err) != tc.want {
			t.Errorf("%s: got %v, want %s", tc.name, err, tc.want)
		}
	}
	held := &hotplug.HeldError{Volume: "bound", VM: "vm0", State: "attached"}
	hp.attach = func(context.Context, string, string) error { return held }
	if err := pub("bound", "vm1"); !strings.Contains(err.Error(), "vm0") {
		t.Errorf("FailedPrecondition must name the holder: %v", err)
	}
}

// TestPublishBoundsTheQueuesWait: the queue gets the caller's deadline less
// the margin (so the answer beats the caller's own timeout), or at most the
// publish wait when that is shorter (an "in progress" answer the caller
// retries, freeing its worker).
func TestPublishBoundsTheQueuesWait(t *testing.T) {
	for _, tc := range []struct {
		name     string
		opts     ControllerOptions
		call     time.Duration
		maxQueue time.Duration
	}{
		{"margin before the deadline", ControllerOptions{PublishMargin: 300 * time.Millisecond}, time.Second, 750 * time.Millisecond},
		{"publish wait shorter than the call", ControllerOptions{PublishMargin: 300 * time.Millisecond, PublishWait: 200 * time.Millisecond}, time.Minute, 200 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, vols, hp := newTestController(tc.opts)
			vols.pvcs["bound"] = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "bound"}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound}}
			var left time.Duration
			hp.attach = func(ctx context.Context, _, _ string) error {
				d, _ := ctx.Deadline()
				left = time.Until(d)
				<-ctx.Done()
				return ctx.Err()
			}
			ctx, cancel := context.WithTimeout(context.Background(), tc.call)
			defer cancel()
			_, err := s.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "bound", NodeId: "vm1", VolumeCapability: rwo})
			if status.Code(err) != codes.DeadlineExceeded {
				t.Fatalf("got %v, want DeadlineExceeded (in progress, retry)", err)
			}
			if ctx.Err() != nil {
				t.Error("the answer came after the caller's own deadline")
			}
			if left > tc.maxQueue {
				t.Errorf("queue got %v of a %v call, want at most %v", left, tc.call, tc.maxQueue)
			}
		})
	}
}

func TestUnpublish(t *testing.T) {
	ctx := context.Background()
	s, _, hp := newTestController(ControllerOptions{})
	var detached []string
	hp.detach = func(_ context.Context, vm, _ string) error { detached = append(detached, vm); return nil }
	hp.holders["vol"] = []string{"vm1", "vm2"}
	if _, err := s.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "vol"}); err != nil {
		t.Fatal(err)
	}
	if strings.Join(detached, ",") != "vm1,vm2" {
		t.Errorf("unpublish without a node detached from %v, want every holder", detached)
	}
	// A missing host PVC must not wedge a detach: unpublish never looks it up.
	if _, err := s.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "gone-pvc", NodeId: "vm1"}); err != nil {
		t.Errorf("unpublish of a volume whose PVC is gone: %v", err)
	}
	if _, err := s.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("no volume ID: %v", err)
	}
	hp.holders["held"] = []string{"vm1"}
	if _, err := s.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "held"}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("delete of an attached volume: %v, want FailedPrecondition", err)
	}
	if _, err := s.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "never-existed"}); err != nil {
		t.Errorf("delete of a missing volume: %v, want OK", err)
	}
}

// A first publish reads its claim (a missing one is NotFound at once, without
// queueing); a retry for a volume already on that VM does not, since the
// queue reads the claim before any write it makes.
func TestPublishReadsTheClaimOnlyWhenNotYetOnTheVM(t *testing.T) {
	s, vols, hp := newTestController(ControllerOptions{})
	vols.pvcs["bound"] = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "bound"}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound}}
	queued := 0
	hp.attach = func(context.Context, string, string) error { queued++; return nil }
	pub := func(vol string) error {
		_, err := s.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "vm1", VolumeCapability: rwo})
		return err
	}
	if err := pub("nope"); status.Code(err) != codes.NotFound || queued != 0 {
		t.Fatalf("missing claim: %v after %d queue calls, want NotFound before queueing", err, queued)
	}
	vols.gets = 0
	if err := pub("bound"); err != nil || vols.gets != 1 {
		t.Fatalf("first publish: %v with %d reads, want OK after one read", err, vols.gets)
	}
	hp.holders["bound"] = []string{"vm1"}
	if err := pub("bound"); err != nil || vols.gets != 1 {
		t.Errorf("retry of a volume already on the VM: %v, %d reads in all, want no new read", err, vols.gets)
	}
	hp.holders["bound"] = []string{"vm2"}
	if err := pub("bound"); err != nil || vols.gets != 2 {
		t.Errorf("volume on another VM: %v, %d reads in all, want a read", err, vols.gets)
	}
}

type cachedClaims map[string]bool

func (c cachedClaims) ShowsBound(name string) bool { return c[name] }

// TestPublishSkipsTheClaimReadTheCacheAnswers: a claim the host cache shows
// Bound needs no read before queueing; one it does not show (missing,
// pending, not seen yet) is read, so a missing claim still answers NotFound
// at once.
func TestPublishSkipsTheClaimReadTheCacheAnswers(t *testing.T) {
	cache := cachedClaims{"bound": true}
	s, vols, hp := newTestController(ControllerOptions{Claims: cache})
	vols.pvcs["bound"] = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "bound"}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound}}
	vols.pvcs["pending"] = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "pending"}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimPending}}
	queued := 0
	hp.attach = func(context.Context, string, string) error { queued++; return nil }
	pub := func(vol string) error {
		_, err := s.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "vm1", VolumeCapability: rwo})
		return err
	}
	vols.gets = 0
	if err := pub("bound"); err != nil || vols.gets != 0 || queued != 1 {
		t.Fatalf("publish of a claim the cache shows Bound: %v with %d reads and %d queue calls, want OK, no read, queued", err, vols.gets, queued)
	}
	if err := pub("nope"); status.Code(err) != codes.NotFound || vols.gets != 1 || queued != 1 {
		t.Fatalf("missing claim: %v after %d reads and %d queue calls, want NotFound from one read, not queued", err, vols.gets, queued)
	}
	if err := pub("pending"); status.Code(err) != codes.Aborted || vols.gets != 2 || queued != 1 {
		t.Fatalf("claim not bound: %v after %d reads and %d queue calls, want Aborted from a read, not queued", err, vols.gets, queued)
	}
}

func TestVMUIDsReadsTheHostCache(t *testing.T) {
	store := cache.NewStore(cache.MetaNamespaceKeyFunc)
	if err := store.Add(&kubevirtv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: "guests", Name: "vm-1", UID: "uid-1"}}); err != nil {
		t.Fatal(err)
	}
	uids := vmUIDs(store, "guests")
	if uid, ok := uids("vm-1"); !ok || uid != "uid-1" {
		t.Errorf("UID of vm-1 = %q, %v; want uid-1", uid, ok)
	}
	if uid, ok := uids("vm-2"); ok {
		t.Errorf("UID of a VM not in the cache = %q, want none", uid)
	}
}

// Harvester's PVC validator refuses deleting a claim a VM template names
// (422 up to 1.7, 409 from 1.8), and its cache can still show a VM that let
// go: the deletion answers FailedPrecondition, CSI's "volume in use", which
// the external-provisioner retries, whatever code the release uses.
func TestDeleteVolumeInUseOnTheHost(t *testing.T) {
	ctx := context.Background()
	msg := `admission webhook "validator.harvesterhci.io" denied the request: can not delete the volume pvc-x which is currently attached to VM: guests/vm-a`
	for name, err := range map[string]error{
		"1.6 and 1.7": &apierrors.StatusError{ErrStatus: metav1.Status{Status: metav1.StatusFailure, Code: 422, Reason: metav1.StatusReasonInvalid, Message: msg}},
		"1.8":         &apierrors.StatusError{ErrStatus: metav1.Status{Status: metav1.StatusFailure, Code: 409, Reason: metav1.StatusReasonConflict, Message: msg}},
	} {
		s, vols, _ := newTestController(ControllerOptions{})
		vols.deleteErr = err
		_, got := s.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "pvc-x"})
		if status.Code(got) != codes.FailedPrecondition || !strings.Contains(got.Error(), "guests/vm-a") {
			t.Errorf("%s: delete refused by Harvester answered %v, want FailedPrecondition naming the VM", name, got)
		}
	}
}
