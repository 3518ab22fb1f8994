package driver

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
)

func fromVolume(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
}

// A clone is a host PVC cloned from the source's host PVC with the source's
// class, mode and size (Longhorn clones only at the source's size), grown to
// the request afterwards.
func TestCloneVolume(t *testing.T) {
	ctx := context.Background()
	s, vols, _ := newTestController(ControllerOptions{})
	if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-src", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
		Parameters:    map[string]string{paramHostStorageClass: "fast", paramHostVolumeMode: "filesystem"}}); err != nil {
		t.Fatal(err)
	}
	clone := &csi.CreateVolumeRequest{Name: "pvc-clone", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange:       &csi.CapacityRange{RequiredBytes: 2 << 30},
		Parameters:          map[string]string{paramHostStorageClass: "longhorn"},
		VolumeContentSource: fromVolume("pvc-src")}
	for attempt := range 2 { // the second is the provisioner's retry
		resp, err := s.CreateVolume(ctx, clone)
		if err != nil {
			t.Fatalf("attempt %d: %v", attempt, err)
		}
		spec := vols.created[len(vols.created)-1]
		if spec.FromVolume != "pvc-src" || spec.FromSnapshot != "" || spec.StorageClass != "fast" || spec.Mode != corev1.PersistentVolumeFilesystem || spec.Bytes != 1<<30 {
			t.Errorf("attempt %d: clone spec %+v, want a 1 GiB filesystem clone of pvc-src on class fast", attempt, spec)
		}
		if got := resp.GetVolume(); got.GetCapacityBytes() != 2<<30 || got.GetContentSource().GetVolume().GetVolumeId() != "pvc-src" {
			t.Errorf("attempt %d: answer %v, want 2 GiB with the source volume", attempt, got)
		}
	}
	if got := vols.pvcs["pvc-clone"].Spec.Resources.Requests[corev1.ResourceStorage]; got.Value() != 2<<30 {
		t.Errorf("host clone requests %s, want 2Gi", got.String())
	}

	caps, err := s.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	advertised := false
	for _, c := range caps.GetCapabilities() {
		advertised = advertised || c.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_CLONE_VOLUME
	}
	if !advertised {
		t.Error("CLONE_VOLUME is not advertised")
	}
}

func TestCloneVolumeErrors(t *testing.T) {
	ctx := context.Background()
	s, vols, _ := newTestController(ControllerOptions{})
	if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-src", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		req   *csi.CreateVolumeRequest
		setup func()
		want  codes.Code
	}{
		{"missing source", &csi.CreateVolumeRequest{Name: "c1", VolumeContentSource: fromVolume("pvc-gone")}, nil, codes.NotFound},
		{"source ID that names no host PVC", &csi.CreateVolumeRequest{Name: "c2", VolumeContentSource: fromVolume("Not/A_PVC")}, nil, codes.NotFound},
		{"no source ID", &csi.CreateVolumeRequest{Name: "c3", VolumeContentSource: fromVolume("")}, nil, codes.InvalidArgument},
		{"limit below the source's size", &csi.CreateVolumeRequest{Name: "c4", VolumeContentSource: fromVolume("pvc-src"),
			CapacityRange: &csi.CapacityRange{LimitBytes: 512 << 20}}, nil, codes.OutOfRange},
		{"shared", &csi.CreateVolumeRequest{Name: "c5", VolumeContentSource: fromVolume("pvc-src"),
			VolumeCapabilities: []*csi.VolumeCapability{capability(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, false)}}, nil, codes.InvalidArgument},
		// Kubernetes resizes only bound claims: the retry grows it.
		{"larger clone not bound yet", &csi.CreateVolumeRequest{Name: "c6", VolumeContentSource: fromVolume("pvc-src"),
			CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}}, func() { vols.createPending = true }, codes.Unavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.setup != nil {
				tc.setup()
			}
			if tc.req.VolumeCapabilities == nil {
				tc.req.VolumeCapabilities = []*csi.VolumeCapability{rwo}
			}
			_, err := s.CreateVolume(ctx, tc.req)
			if status.Code(err) != tc.want {
				t.Errorf("got %v, want %s", err, tc.want)
			}
		})
	}
}
