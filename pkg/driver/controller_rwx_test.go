package driver

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

type fakeNetworkFS struct{ fs map[string]*host.NetworkFS }

var nfsGR = schema.GroupResource{Group: "harvesterhci.io", Resource: "networkfilesystems"}

func (f *fakeNetworkFS) GetNetworkFS(_ context.Context, name string) (*host.NetworkFS, error) {
	if n, ok := f.fs[name]; ok {
		c := *n
		return &c, nil
	}
	return nil, apierrors.NewNotFound(nfsGR, name)
}

func (f *fakeNetworkFS) ListNetworkFS(context.Context) ([]host.NetworkFS, error) {
	var out []host.NetworkFS
	for _, n := range f.fs {
		out = append(out, *n)
	}
	return out, nil
}

func (f *fakeNetworkFS) CreateNetworkFS(_ context.Context, name, desired string) (*host.NetworkFS, error) {
	if n, ok := f.fs[name]; ok {
		return n, nil
	}
	n := &host.NetworkFS{Spec: host.NetworkFSSpec{NetworkFSName: name, DesiredState: desired}}
	n.Name = name
	f.fs[name] = n
	return n, nil
}

func (f *fakeNetworkFS) SetNetworkFSState(ctx context.Context, name, desired string) (*host.NetworkFS, error) {
	n, ok := f.fs[name]
	if !ok {
		return nil, apierrors.NewNotFound(nfsGR, name)
	}
	n.Spec.DesiredState = desired
	n.Status.State = desired
	if desired == host.NetworkFSEnabled {
		n.Status.Endpoint = "10.0.0.1"
	} else {
		n.Status.Endpoint = ""
	}
	return n, nil
}

func (f *fakeNetworkFS) WaitNetworkFS(ctx context.Context, name string, done func(*host.NetworkFS) bool) (*host.NetworkFS, error) {
	return f.GetNetworkFS(ctx, name)
}

func (f *fakeNetworkFS) DeleteNetworkFS(_ context.Context, name string) error {
	delete(f.fs, name)
	return nil
}

func (f *fakeNetworkFS) StorageClassProvisioner(context.Context, string) (string, bool, error) {
	return host.LonghornProvisioner, true, nil
}

// fakeGuest answers for the guest's pods and VolumeAttachments.
type fakeGuest struct {
	users map[string][]string
	atts  map[string][]guest.Attachment
}

func (g *fakeGuest) Users(_ context.Context, vol string, _ bool) ([]string, error) {
	return g.users[vol], nil
}

func (g *fakeGuest) Attachments(_ context.Context, vol string, _ bool) ([]guest.Attachment, error) {
	return g.atts[vol], nil
}

type fakeVMs map[string]bool

func (f fakeVMs) VMExists(_ context.Context, vm string) (bool, error) { return f[vm], nil }

var rwxCapability = capability(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, false)

// newRWXController serves RWX volumes with fakes; vol is created, bound to
// the Longhorn volume lh-<vol>, and published (its export enabled).
func newRWXController(t *testing.T, vol string) (*controllerService, *fakeNetworkFS, *fakeGuest) {
	t.Helper()
	nfs := &fakeNetworkFS{fs: map[string]*host.NetworkFS{}}
	g := &fakeGuest{users: map[string][]string{}, atts: map[string][]guest.Attachment{}}
	s, vols, _ := newTestController(ControllerOptions{NetworkFS: nfs, RWX: func() bool { return true },
		ClaimUsers: g, Attachments: g, VMs: fakeVMs{"vm-a": true, "vm-b": true}})
	mode := corev1.PersistentVolumeFilesystem
	if _, err := vols.CreateVolume(context.Background(), host.VolumeSpec{Name: vol, Bytes: 1 << 30, Mode: mode}); err != nil {
		t.Fatal(err)
	}
	vols.pvcs[vol].Spec.VolumeName = "lh-" + vol
	vols.pvcs[vol].Spec.VolumeMode = &mode
	if _, err := nfs.CreateNetworkFS(context.Background(), "lh-"+vol, host.NetworkFSDisabled); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "vm-a", VolumeCapability: rwxCapability}); err != nil {
		t.Fatal(err)
	}
	return s, nfs, g
}

func TestRWXUnpublishKeepsTheExportForOtherNodesAttachments(t *testing.T) {
	ctx := context.Background()
	s, nfs, g := newRWXController(t, "pvc-rwx")
	unpublish := func(vm string) string {
		t.Helper()
		if _, err := s.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "pvc-rwx", NodeId: vm}); err != nil {
			t.Fatal(err)
		}
		return nfs.fs["lh-pvc-rwx"].Spec.DesiredState
	}
	// No pod uses the claim; node-b's attachment is attached, node-a's is
	// being deleted (its own unpublish).
	g.atts["pvc-rwx"] = []guest.Attachment{
		{Name: "va-a", Node: "node-a", VM: "vm-a", Attached: true, Deleting: true},
		{Name: "va-b", Node: "node-b", VM: "vm-b", Attached: true},
	}
	if got := unpublish("vm-a"); got != host.NetworkFSEnabled {
		t.Fatalf("unpublish of vm-a while vm-b's attachment is attached: export %s, want Enabled", got)
	}
	// Another node's attachment being deleted does not keep it.
	g.atts["pvc-rwx"] = []guest.Attachment{{Name: "va-b", Node: "node-b", VM: "vm-b", Attached: true, Deleting: true}}
	if got := unpublish("vm-a"); got != host.NetworkFSDisabled {
		t.Fatalf("unpublish with only attachments being deleted: export %s, want Disabled", got)
	}
}

func TestRWXPublishedNodesAndDelete(t *testing.T) {
	ctx := context.Background()
	s, nfs, g := newRWXController(t, "pvc-rwx")
	g.atts["pvc-rwx"] = []guest.Attachment{
		{Name: "va-b", Node: "node-b", VM: "vm-b", Attached: true},
		{Name: "va-a", Node: "node-a", VM: "vm-a", Attached: true},
		{Name: "va-c", Node: "node-c", VM: "vm-c"}, // still attaching
	}
	reported := func() (list, get []string) {
		t.Helper()
		l, err := s.ListVolumes(ctx, &csi.ListVolumesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range l.GetEntries() {
			if e.GetVolume().GetVolumeId() == "pvc-rwx" {
				list = e.GetStatus().GetPublishedNodeIds()
			}
		}
		r, err := s.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: "pvc-rwx"})
		if err != nil {
			t.Fatal(err)
		}
		return list, r.GetStatus().GetPublishedNodeIds()
	}
	want := []string{"vm-a", "vm-b"}
	if list, get := reported(); !slices.Equal(list, want) || !slices.Equal(get, want) {
		t.Errorf("export enabled: ListVolumes %v, ControllerGetVolume %v; want %v", list, get, want)
	}
	_, err := s.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "pvc-rwx"})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), "va-a") {
		t.Errorf("delete while published: %v, want FailedPrecondition naming va-a", err)
	}
	if nfs.fs["lh-pvc-rwx"] == nil {
		t.Fatal("delete while published removed the NetworkFilesystem")
	}
	nfs.fs["lh-pvc-rwx"].Spec.DesiredState = host.NetworkFSDisabled
	if list, get := reported(); len(list) > 0 || len(get) > 0 {
		t.Errorf("export disabled: ListVolumes %v, ControllerGetVolume %v; want none", list, get)
	}
	// Enabled, no attachment, but a pod uses the claim: still published.
	nfs.fs["lh-pvc-rwx"].Spec.DesiredState = host.NetworkFSEnabled
	g.atts["pvc-rwx"] = nil
	g.users["pvc-rwx"] = []string{"default/app on node-a"}
	if _, err := s.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "pvc-rwx"}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("delete with an enabled export that a pod uses: %v, want FailedPrecondition", err)
	}
	g.users["pvc-rwx"] = nil
	if _, err := s.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "pvc-rwx"}); err != nil {
		t.Errorf("delete once unpublished: %v", err)
	}
}

func TestRWXPublishToNoVM(t *testing.T) {
	s, nfs, _ := newRWXController(t, "pvc-rwx")
	if _, err := s.ControllerUnpublishVolume(context.Background(), &csi.ControllerUnpublishVolumeRequest{VolumeId: "pvc-rwx", NodeId: "vm-a"}); err != nil {
		t.Fatal(err)
	}
	_, err := s.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-rwx", NodeId: "vm-none", VolumeCapability: rwxCapability})
	msg := status.Convert(err).Message()
	if status.Code(err) != codes.NotFound || !strings.Contains(msg, "vm-none") || !strings.Contains(msg, "pvc-rwx") {
		t.Errorf("publish to a node ID that names no VM: %v, want NotFound naming vm-none and pvc-rwx", err)
	}
	if got := nfs.fs["lh-pvc-rwx"].Spec.DesiredState; got != host.NetworkFSDisabled {
		t.Errorf("a publish to no VM set the export %s", got)
	}
}

func TestRWXAndSingleNodeNamesDoNotCross(t *testing.T) {
	ctx := context.Background()
	nfs := &fakeNetworkFS{fs: map[string]*host.NetworkFS{}}
	s, vols, _ := newTestController(ControllerOptions{NetworkFS: nfs, RWX: func() bool { return true }})
	fsParams := map[string]string{paramHostVolumeMode: "filesystem"}
	single := func(name string) error {
		_, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwo}, Parameters: fsParams})
		return err
	}
	shared := func(name string) error {
		_, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwxCapability}})
		return err
	}
	if err := single("pvc-one"); err != nil {
		t.Fatal(err)
	}
	vols.pvcs["pvc-one"].Spec.VolumeName = "lh-one"
	if err := shared("pvc-one"); status.Code(err) != codes.AlreadyExists || !strings.Contains(status.Convert(err).Message(), "pvc-one") {
		t.Errorf("RWX under a single-node name: %v, want AlreadyExists naming pvc-one", err)
	}
	if len(nfs.fs) > 0 {
		t.Errorf("RWX under a single-node name made NetworkFilesystems %v", nfs.fs)
	}
	// Shared as this driver makes it (annotated), and as upstream leaves
	// it (a NetworkFilesystem only).
	if err := shared("pvc-two"); status.Code(err) != codes.Aborted { // not bound to a Longhorn volume yet
		t.Fatal(err)
	}
	vols.pvcs["pvc-two"].Spec.VolumeName = "lh-two"
	if err := shared("pvc-two"); err != nil {
		t.Fatal(err)
	}
	vols.pvcs["pvc-three"] = vols.pvcs["pvc-two"].DeepCopy()
	vols.pvcs["pvc-three"].Name = "pvc-three"
	vols.pvcs["pvc-three"].Annotations = nil
	vols.pvcs["pvc-three"].Spec.VolumeName = "lh-three"
	if _, err := nfs.CreateNetworkFS(ctx, "lh-three", host.NetworkFSDisabled); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"pvc-two", "pvc-three"} {
		if err := single(name); status.Code(err) != codes.AlreadyExists || !strings.Contains(status.Convert(err).Message(), name) {
			t.Errorf("single-node under the RWX name %s: %v, want AlreadyExists naming it", name, err)
		}
	}
}
