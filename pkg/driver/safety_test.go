package driver

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

func TestSizesNeverOverflow(t *testing.T) {
	c, _, _ := newTestController(ControllerOptions{})
	ctx := context.Background()
	caps := []*csi.VolumeCapability{capability(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, true)}
	for _, tc := range []struct {
		name     string
		req, lim int64
		want     codes.Code
	}{
		{"max int64 required", math.MaxInt64, 0, codes.OutOfRange},
		{"just over the maximum", maxVolumeBytes + 1, 0, codes.OutOfRange},
		{"negative required", -1, 0, codes.InvalidArgument},
		{"negative limit", 0, -5, codes.InvalidArgument},
		{"limit below the minimum", 0, 1 << 20, codes.OutOfRange},
		{"the maximum itself", maxVolumeBytes, 0, codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-size", VolumeCapabilities: caps,
				CapacityRange: &csi.CapacityRange{RequiredBytes: tc.req, LimitBytes: tc.lim}})
			if got := status.Code(err); got != tc.want {
				t.Fatalf("CreateVolume(%d, %d) = %v, want %v", tc.req, tc.lim, err, tc.want)
			}
			if err == nil && resp.GetVolume().GetCapacityBytes() < tc.req {
				t.Fatalf("capacity %d is smaller than the %d asked", resp.GetVolume().GetCapacityBytes(), tc.req)
			}
			if err != nil && strings.Contains(err.Error(), "-") && tc.req > 0 {
				t.Fatalf("message shows a negative size: %v", err)
			}
		})
	}
	if _, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-grow", VolumeCapabilities: caps}); err != nil {
		t.Fatal(err)
	}
	_, err := c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-grow", CapacityRange: &csi.CapacityRange{RequiredBytes: math.MaxInt64}})
	if status.Code(err) != codes.OutOfRange {
		t.Fatalf("expand to MaxInt64 = %v, want OutOfRange (never a silent OK)", err)
	}
}

func TestNamesMapToValidUniqueLabels(t *testing.T) {
	names := []string{"A0a. 0000", "a0a.-0000", "..", ".", "-", "ünïcödé", "名前", "with space", "a.b", "a-b",
		"UPPER", "upper", strings.Repeat("x.", 100), "pvc-0d2e6f4c-1b7a-4f0e-9d6b-2c1e5a7b9f00", "0", "-leading", "trailing-"}
	seen := map[string]string{}
	for _, n := range names {
		id := hostPVCName(n)
		if errs := validation.IsDNS1123Label(id); len(errs) > 0 {
			t.Errorf("hostPVCName(%q) = %q, not a DNS-1123 label: %v", n, id, errs)
		}
		if id != hostPVCName(n) {
			t.Errorf("hostPVCName(%q) is not deterministic", n)
		}
		if prev, ok := seen[id]; ok {
			t.Errorf("%q and %q both map to %q", prev, n, id)
		}
		seen[id] = n
	}
}

func FuzzHostPVCName(f *testing.F) {
	for _, s := range []string{"A0a. 0000", "pvc-1", "..", "ä"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		if id := hostPVCName(name); len(validation.IsDNS1123Label(id)) > 0 {
			t.Fatalf("hostPVCName(%q) = %q is not a valid label", name, id)
		}
	})
}

func TestInvalidIDsAreNotFoundOrNothingToDo(t *testing.T) {
	c, vols, _ := newTestController(ControllerOptions{})
	vols.getErr = errors.New("a request with this name must never reach the host")
	ctx := context.Background()
	vc := capability(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, true)
	for _, id := range []string{"../etc", "a/b", "UPPER", "a b", strings.Repeat("a", 300), "ü"} {
		_, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "vm1", VolumeCapability: vc})
		if status.Code(err) != codes.NotFound {
			t.Errorf("publish %q = %v, want NotFound", id, err)
		}
		if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("delete %q = %v, want OK", id, err)
		}
		if _, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "vm1"}); err != nil {
			t.Errorf("unpublish %q = %v, want OK", id, err)
		}
		_, err = c.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: id, VolumeCapabilities: []*csi.VolumeCapability{vc}})
		if status.Code(err) != codes.NotFound {
			t.Errorf("validate %q = %v, want NotFound", id, err)
		}
		_, err = c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
		if status.Code(err) != codes.NotFound {
			t.Errorf("expand %q = %v, want NotFound", id, err)
		}
		if _, err := c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
			t.Errorf("delete snapshot %q = %v, want OK", id, err)
		}
	}
	_, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-1", NodeId: "../vm", VolumeCapability: vc})
	if status.Code(err) != codes.NotFound {
		t.Errorf("publish to node ../vm = %v, want NotFound", err)
	}
}

func TestReadonlyPublishMismatchIsAlreadyExists(t *testing.T) {
	c, vols, hp := newTestController(ControllerOptions{})
	ctx := context.Background()
	vc := capability(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, true)
	if _, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-ro", VolumeCapabilities: []*csi.VolumeCapability{vc}}); err != nil {
		t.Fatal(err)
	}
	_ = vols
	if _, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-ro", NodeId: "vm1", VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	hp.published = map[string][]string{"pvc-ro": {"vm1"}}
	_, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-ro", NodeId: "vm1", VolumeCapability: vc, Readonly: true})
	if status.Code(err) != codes.AlreadyExists {
		t.Fatalf("read-only publish of a volume published read-write = %v, want AlreadyExists", err)
	}
	_, err = c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-ro", NodeId: "vm2", VolumeCapability: vc, Readonly: true})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("read-only publish without PUBLISH_READONLY = %v, want InvalidArgument", err)
	}
	if _, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-ro", NodeId: "vm1", VolumeCapability: vc}); err != nil {
		t.Fatalf("the same read-write publish again = %v, want OK", err)
	}
}

func TestHostFailuresKeepTheirCause(t *testing.T) {
	forbidden := apierrors.NewForbidden(schema.GroupResource{Group: "kubevirt.io", Resource: "virtualmachines"}, "vm1", errors.New("cannot patch virtualmachines"))
	for _, tc := range []struct {
		err  error
		want codes.Code
	}{
		{&hotplug.StalledError{Volume: "v", VM: "vm1", Cause: forbidden}, codes.PermissionDenied},
		{&hotplug.StalledError{Volume: "v", VM: "vm1", Cause: &net.OpError{Op: "dial", Err: errors.New("connection refused")}}, codes.Unavailable},
		{hotplug.ErrNotReady, codes.Unavailable},
		{&hotplug.ClaimNotReadyError{Volume: "v", VM: "vm1"}, codes.NotFound},
		{&hotplug.ClaimNotReadyError{Volume: "v", VM: "vm1", Phase: "Pending"}, codes.Aborted},
		{fmt.Errorf("wrapped: %w", &hotplug.HeldError{Volume: "v", VM: "vm2", State: "attached"}), codes.FailedPrecondition},
	} {
		err := hotplugStatus(tc.err)
		if status.Code(err) != tc.want {
			t.Errorf("hotplugStatus(%v) = %v, want %v", tc.err, status.Code(err), tc.want)
		}
		if !strings.Contains(status.Convert(err).Message(), tc.err.Error()) {
			t.Errorf("answer %q lost the cause %q", status.Convert(err).Message(), tc.err)
		}
	}
	if got := status.Code(apiStatus(&net.OpError{Op: "dial", Err: errors.New("connection refused")}, "get")); got != codes.Unavailable {
		t.Errorf("unreachable host = %v, want Unavailable", got)
	}
}

// panicky is a controller service whose handler panics.
type panicky struct {
	csi.UnimplementedControllerServer
}

func (panicky) ControllerPublishVolume(context.Context, *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	var m map[string]int
	m["boom"]++ // a nil map write: a real panic
	return nil, nil
}

// serveTest serves d on a unix socket and returns a client connection.
func serveTest(t *testing.T, d *Driver) *grpc.ClientConn {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	dir := t.TempDir()
	endpoint := "unix://" + dir + "/csi.sock"
	done := make(chan error, 1)
	go func() { done <- d.Serve(ctx, endpoint) }()
	t.Cleanup(func() { cancel(); <-done })
	listening, cancelListening := context.WithTimeout(ctx, 10*time.Second)
	defer cancelListening()
	testwait.Until(listening, t, "the driver to listen", func() (bool, string) {
		_, err := os.Stat(dir + "/csi.sock")
		return err == nil, fmt.Sprint(err)
	})
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestPanicInAHandlerAnswersInternalAndTheServerLives(t *testing.T) {
	d := &Driver{controller: panicky{}, ready: func() error { return nil }}
	d.identity = &identityService{version: "test", controller: true, ready: d.ready}
	conn := serveTest(t, d)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range 2 {
		_, err := csi.NewControllerClient(conn).ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "v", NodeId: "n"})
		if status.Code(err) != codes.Internal {
			t.Fatalf("call %d: %v, want Internal", i, err)
		}
	}
	if _, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{}); err != nil {
		t.Fatalf("server gone after a panic: %v", err)
	}
}

func TestControllerCallsWaitForReadiness(t *testing.T) {
	ready := errors.New("controller not ready: waiting for the host's VM and VMI caches to sync")
	c, _, hp := newTestController(ControllerOptions{})
	detached := false
	hp.detach = func(context.Context, string, string) error { detached = true; return nil }
	d := &Driver{controller: c, ready: func() error { return ready }}
	d.identity = &identityService{version: "test", controller: true, ready: func() error { return ready }}
	conn := serveTest(t, d)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	probe, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
	if err != nil || probe.GetReady().GetValue() {
		t.Fatalf("Probe = %v, %v; want ready=false", probe, err)
	}
	cc := csi.NewControllerClient(conn)
	_, err = cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "pvc-1", NodeId: "vm1"})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "sync") {
		t.Fatalf("unpublish before ready = %v, want Unavailable saying why", err)
	}
	if detached {
		t.Fatal("the unpublish reached the queue before the caches synced")
	}
	if _, err := cc.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{}); err != nil {
		t.Fatalf("capabilities are static and must be served before ready: %v", err)
	}
	ready = nil
	if _, err := cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "pvc-1", NodeId: "vm1"}); err != nil || !detached {
		t.Fatalf("unpublish once ready = %v (reached queue: %v)", err, detached)
	}
}

type recordedEvent struct{ volume, vm, eventType, reason, message string }

type fakeEvents struct{ got []recordedEvent }

func (f *fakeEvents) Record(_ context.Context, volume, vm, eventType, reason, message string) {
	f.got = append(f.got, recordedEvent{volume, vm, eventType, reason, message})
}

func TestWhyAPublishWaitsGoesOnTheVolumeAttachment(t *testing.T) {
	ev := &fakeEvents{}
	c, vols, hp := newTestController(ControllerOptions{Events: ev})
	vc := capability(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, true)
	if _, err := c.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "pvc-ev", VolumeCapabilities: []*csi.VolumeCapability{vc}}); err != nil {
		t.Fatal(err)
	}
	_ = vols
	for _, tc := range []struct {
		err             error
		eventType, why  string
		messageContains string
	}{
		{fmt.Errorf("attach of volume pvc-ev on VM vm1 still in progress, waiting for KubeVirt to plug the volume into the VM (VMI phase Bound) for 12s: %w", context.DeadlineExceeded),
			"Normal", "HotplugWaiting", "waiting for KubeVirt to plug"},
		{&hotplug.HeldError{Volume: "pvc-ev", VM: "vm2", State: "attached"}, "Warning", "VolumeHeldByAnotherVM", "on VM vm2"},
		{&hotplug.StalledError{Volume: "pvc-ev", VM: "vm1", Cause: errors.New("forbidden")}, "Warning", "HostRefusedOrUnreachable", "forbidden"},
	} {
		hp.attach = func(context.Context, string, string) error { return tc.err }
		ev.got = nil
		_, _ = c.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-ev", NodeId: "vm1", VolumeCapability: vc})
		if len(ev.got) != 1 {
			t.Fatalf("%v: %d events, want 1", tc.err, len(ev.got))
		}
		e := ev.got[0]
		if e.volume != "pvc-ev" || e.vm != "vm1" || e.eventType != tc.eventType || e.reason != tc.why || !strings.Contains(e.message, tc.messageContains) {
			t.Errorf("%v: event %+v, want %s %s mentioning %q", tc.err, e, tc.eventType, tc.why, tc.messageContains)
		}
	}
	hp.attach = func(context.Context, string, string) error {
		return &hotplug.SupersededError{Volume: "pvc-ev", VM: "vm1", By: hotplug.Detach}
	}
	ev.got = nil
	_, _ = c.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-ev", NodeId: "vm1", VolumeCapability: vc})
	if len(ev.got) != 0 {
		t.Errorf("a superseded publish needs no Event: %+v", ev.got)
	}
}
