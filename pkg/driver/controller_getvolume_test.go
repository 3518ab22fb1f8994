package driver

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynfake "k8s.io/client-go/dynamic/fake"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	kvfake "kubevirt.io/client-go/kubevirt/fake"

	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

func TestGetVolumeCapabilitiesAdvertised(t *testing.T) {
	s, _, _ := newTestController(ControllerOptions{})
	resp, err := s.ControllerGetCapabilities(context.Background(), &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []csi.ControllerServiceCapability_RPC_Type
	for _, c := range resp.GetCapabilities() {
		got = append(got, c.GetRpc().GetType())
	}
	for _, want := range []csi.ControllerServiceCapability_RPC_Type{csi.ControllerServiceCapability_RPC_GET_VOLUME, csi.ControllerServiceCapability_RPC_VOLUME_CONDITION} {
		if !slices.Contains(got, want) {
			t.Errorf("capability %s not advertised (%v)", want, got)
		}
	}
}

func TestControllerGetVolume(t *testing.T) {
	ctx := context.Background()
	s, vols, hp := newTestController(ControllerOptions{})
	for _, name := range []string{"pvc-ok", "pvc-lost", "pvc-going"} {
		if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwo}}); err != nil {
			t.Fatal(err)
		}
	}
	hp.published = map[string][]string{"pvc-ok": {"vm1"}, "pvc-gone": {"vm3"}}
	hp.holders = map[string][]string{"pvc-ok": {"vm1"}, "pvc-lost": {"vm2"}, "pvc-gone": {"vm3"}}
	hp.lost = map[string][]string{"pvc-lost": {"vm2"}}
	vols.pvcs["pvc-going"].DeletionTimestamp = &metav1.Time{Time: time.Now()}

	get := func(id string) (*csi.ControllerGetVolumeResponse, error) {
		return s.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id})
	}
	resp, err := get("pvc-ok")
	if err != nil {
		t.Fatal(err)
	}
	if st := resp.GetStatus(); !slices.Equal(st.GetPublishedNodeIds(), []string{"vm1"}) || st.GetVolumeCondition().GetAbnormal() || resp.GetVolume().GetCapacityBytes() == 0 {
		t.Errorf("healthy published volume: %+v", resp)
	}
	for id, want := range map[string][]string{
		"pvc-lost":  {"vm2", "lost the hotplug"},
		"pvc-going": {"pvc-going", "being deleted"},
		"pvc-gone":  {"pvc-gone", "does not exist", "vm3"},
	} {
		resp, err := get(id)
		if err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		cond := resp.GetStatus().GetVolumeCondition()
		if !cond.GetAbnormal() {
			t.Errorf("%s: condition %+v, want abnormal", id, cond)
		}
		for _, w := range want {
			if !strings.Contains(cond.GetMessage(), w) {
				t.Errorf("%s: message %q lacks %q", id, cond.GetMessage(), w)
			}
		}
	}
	for id, code := range map[string]codes.Code{"pvc-never": codes.NotFound, "": codes.InvalidArgument, "../x": codes.NotFound} {
		if _, err := get(id); status.Code(err) != code {
			t.Errorf("get %q = %v, want %s", id, err, code)
		}
	}
	vols.getErr = errors.New("dial tcp: connection refused")
	if _, err := get("pvc-ok"); status.Code(err) == codes.OK || status.Code(err) == codes.NotFound {
		t.Errorf("a host that does not answer must not look like a missing volume: %v", err)
	}
}

// ListVolumes carries a condition for every entry once VOLUME_CONDITION is
// offered.
func TestListVolumesCarriesConditions(t *testing.T) {
	ctx := context.Background()
	s, _, hp := newTestController(ControllerOptions{})
	if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-a", VolumeCapabilities: []*csi.VolumeCapability{rwo}}); err != nil {
		t.Fatal(err)
	}
	hp.lost = map[string][]string{"pvc-a": {"vm1"}}
	resp, err := s.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if e := resp.GetEntries(); len(e) != 1 || !e[0].GetStatus().GetVolumeCondition().GetAbnormal() {
		t.Errorf("entries %+v, want pvc-a abnormal", e)
	}
}

type fakeGuard struct {
	allow   func(vm, vol string) error
	asked   []string
	doneFor []string
}

func (g *fakeGuard) Allow(_ context.Context, vm, vol string) error {
	g.asked = append(g.asked, vm+"/"+vol)
	return g.allow(vm, vol)
}

func (g *fakeGuard) Done(vm, vol string) { g.doneFor = append(g.doneFor, vm+"/"+vol) }

func TestUnpublishAsksTheDetachGuard(t *testing.T) {
	ctx := context.Background()
	g := &fakeGuard{allow: func(string, string) error { return nil }}
	s, _, hp := newTestController(ControllerOptions{DetachGuard: g})
	var detached []string
	hp.detach = func(_ context.Context, vm, vol string) error {
		detached = append(detached, vm+"/"+vol)
		return nil
	}
	hp.holders = map[string][]string{"pvc-a": {"vm1"}}
	unpublish := func(vm string) error {
		_, err := s.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "pvc-a", NodeId: vm})
		return err
	}

	// The guest still uses it: Aborted with the guard's message, no unplug.
	g.allow = func(vm, vol string) error {
		return &guest.InUseError{Volume: vol, VM: vm, Nodes: []string{"worker-1"}, Since: time.Now(), Until: time.Now().Add(time.Minute)}
	}
	err := unpublish("vm1")
	if status.Code(err) != codes.Aborted || !strings.Contains(err.Error(), "still in use by guest node worker-1") {
		t.Fatalf("unpublish while in use = %v, want Aborted saying the guest uses it", err)
	}
	if len(detached) != 0 || len(g.doneFor) != 0 {
		t.Fatalf("unplugged %v (done %v) while the guest uses it", detached, g.doneFor)
	}
	// The guard cannot tell: Unavailable.
	g.allow = func(string, string) error { return guest.ErrNotSynced }
	if err := unpublish("vm1"); status.Code(err) != codes.Unavailable {
		t.Fatalf("unpublish before the guest caches sync = %v, want Unavailable", err)
	}
	// A VM that does not hold the volume is not asked about.
	g.asked = nil
	if err := unpublish("vm2"); err != nil || len(g.asked) != 0 {
		t.Fatalf("unpublish from a VM without the volume = %v, guard asked %v", err, g.asked)
	}
	// Allowed: unplugged, and the guard's count ends.
	g.allow = func(string, string) error { return nil }
	if err := unpublish("vm1"); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(detached, "vm1/pvc-a") || !slices.Contains(g.doneFor, "vm1/pvc-a") {
		t.Fatalf("detached %v, done %v", detached, g.doneFor)
	}
	// A publish starts a new attachment: the guard's count ends too.
	g.doneFor = nil
	vols := s.volumes.(*fakeVolumes)
	vols.pvcs["pvc-a"] = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "pvc-a"}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound}}
	if _, err := s.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-a", NodeId: "vm1", VolumeCapability: rwo}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(g.doneFor, []string{"vm1/pvc-a"}) {
		t.Errorf("publish did not end the guard's count: %v", g.doneFor)
	}
}

type fakeHostStorage struct {
	issues  []host.StorageIssue
	err     error
	queries []host.StorageQuery
}

func (f *fakeHostStorage) Issues(_ context.Context, q host.StorageQuery) ([]host.StorageIssue, error) {
	f.queries = append(f.queries, q)
	return f.issues, f.err
}

// The host storage path joins the condition: each issue's message makes it
// abnormal, next to the driver's own cases; the attachment pods are asked
// about only for holders whose hotplug is not done; a failed read never
// fails the call.
func TestControllerGetVolumeHostStorage(t *testing.T) {
	ctx := context.Background()
	hs := &fakeHostStorage{}
	s, _, hp := newTestController(ControllerOptions{HostStorage: hs})
	if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-a", VolumeCapabilities: []*csi.VolumeCapability{rwo}}); err != nil {
		t.Fatal(err)
	}
	hp.holders = map[string][]string{"pvc-a": {"vm1", "vm2"}}
	hp.published = map[string][]string{"pvc-a": {"vm1"}}
	hp.lost = map[string][]string{"pvc-a": {"vm1"}}
	get := func() *csi.VolumeCondition {
		t.Helper()
		resp, err := s.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: "pvc-a"})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetStatus().GetVolumeCondition()
	}

	hs.issues = []host.StorageIssue{
		{Kind: host.LonghornNotReady, Message: "Longhorn volume pv-a is not ready for workloads: faulted"},
		{Kind: host.AttachmentPodUnschedulable, VM: "vm2", Message: "attachment pod hp-volume-x of VM vm2 is Pending, not scheduled"},
	}
	cond := get()
	for _, w := range []string{"lost the hotplug", "not ready for workloads: faulted", "hp-volume-x of VM vm2 is Pending"} {
		if !cond.GetAbnormal() || !strings.Contains(cond.GetMessage(), w) {
			t.Errorf("condition %+v, want abnormal saying %q", cond, w)
		}
	}
	if len(hs.queries) == 0 {
		t.Fatal("ControllerGetVolume did not ask the host storage path")
	}
	q := hs.queries[len(hs.queries)-1]
	if q.Claim == nil || q.Claim.Name != "pvc-a" || !slices.Equal(q.Holders, []string{"vm1", "vm2"}) || !slices.Equal(q.Waiting, []string{"vm2"}) {
		t.Errorf("asked the host storage path %+v, want claim pvc-a, holders vm1 vm2, waiting vm2", q)
	}

	hp.lost = nil
	hs.issues, hs.err = nil, errors.New("read Longhorn volume pv-a: the server was unable to return a response in the time allotted")
	if cond := get(); cond.GetAbnormal() {
		t.Errorf("a host storage read that failed: condition %+v, want normal", cond)
	}
}

// Against the host's objects (fake API): a faulted Longhorn volume makes the
// condition abnormal; the same volume with the Longhorn read refused, and a
// host without Longhorn, leave it normal.
func TestControllerGetVolumeLonghornThroughTheHost(t *testing.T) {
	ctx := context.Background()
	faulted := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "longhorn.io/v1beta2", "kind": "Volume",
		"metadata": map[string]any{"name": "pv-a", "namespace": host.LonghornNamespace},
		"status":   map[string]any{"state": "detached", "robustness": "faulted"},
	}}
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-a"}, Spec: corev1.PersistentVolumeSpec{
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: host.LonghornProvisioner, VolumeHandle: "pv-a"}}}}
	for _, c := range []struct {
		name     string
		lh       []runtime.Object
		refuse   bool
		abnormal bool
	}{
		{"faulted", []runtime.Object{faulted}, false, true},
		{"Longhorn read refused", []runtime.Object{faulted}, true, false},
		{"no Longhorn", nil, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dyn := dynfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
				host.LonghornVolumeResource: "VolumeList", host.LonghornAttachmentResource: "VolumeAttachmentList"}, c.lh...)
			if c.refuse {
				dyn.PrependReactor("get", "volumes", func(k8stesting.Action) (bool, runtime.Object, error) {
					return true, nil, apierrors.NewForbidden(schema.GroupResource{Group: "longhorn.io", Resource: "volumes"}, "pv-a", nil)
				})
			}
			hc := &host.Client{Namespace: "guests", Kube: kubefake.NewClientset(pv), KubeVirt: kvfake.NewSimpleClientset(), Dynamic: dyn}
			s, vols, hp := newTestController(ControllerOptions{HostStorage: host.NewStorageReader(hc)})
			if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-a", VolumeCapabilities: []*csi.VolumeCapability{rwo}}); err != nil {
				t.Fatal(err)
			}
			vols.pvcs["pvc-a"].Spec.VolumeName = "pv-a"
			hp.holders = map[string][]string{"pvc-a": {"vm1"}}
			resp, err := s.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: "pvc-a"})
			if err != nil {
				t.Fatal(err)
			}
			cond := resp.GetStatus().GetVolumeCondition()
			if cond.GetAbnormal() != c.abnormal || (c.abnormal && !strings.Contains(cond.GetMessage(), "Longhorn volume pv-a is not ready for workloads")) {
				t.Errorf("condition %+v, want abnormal=%v", cond, c.abnormal)
			}
		})
	}
}
