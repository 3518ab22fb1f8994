package driver

import (
	"context"
	"errors"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

func TestControllerExpandVolume(t *testing.T) {
	ctx := context.Background()
	s, vols, _ := newTestController(ControllerOptions{})
	if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-a", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}}); err != nil {
		t.Fatal(err)
	}

	resp, err := s.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-a",
		CapacityRange: &csi.CapacityRange{RequiredBytes: 3<<30 + 1}, VolumeCapability: rwo})
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(3<<30 + 2<<20); resp.GetCapacityBytes() != want || !resp.GetNodeExpansionRequired() {
		t.Errorf("expanded to %d (node expansion %v), want %d rounded to 2 MiB and node expansion", resp.GetCapacityBytes(), resp.GetNodeExpansionRequired(), want)
	}
	// A smaller request than the current size is already satisfied.
	resp, err = s.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-a",
		CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}})
	if err != nil || resp.GetCapacityBytes() != 3<<30+2<<20 {
		t.Errorf("shrink request answered %v, %v; want OK with the current size", resp, err)
	}

	for _, tc := range []struct {
		name string
		req  *csi.ControllerExpandVolumeRequest
		host error
		want codes.Code
	}{
		{"no volume ID", &csi.ControllerExpandVolumeRequest{CapacityRange: &csi.CapacityRange{RequiredBytes: 1}}, nil, codes.InvalidArgument},
		{"no capacity", &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-a"}, nil, codes.InvalidArgument},
		{"unknown volume", &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-x", CapacityRange: &csi.CapacityRange{RequiredBytes: 1}}, nil, codes.NotFound},
		{"over the limit", &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-a", CapacityRange: &csi.CapacityRange{RequiredBytes: 5 << 30, LimitBytes: 4 << 30}}, nil, codes.OutOfRange},
		{"multi-node capability", &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-a", CapacityRange: &csi.CapacityRange{RequiredBytes: 5 << 30},
			VolumeCapability: capability(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, false)}, nil, codes.InvalidArgument},
		{"host class not expandable", &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-a", CapacityRange: &csi.CapacityRange{RequiredBytes: 5 << 30}},
			apierrors.NewForbidden(pvcGR, "pvc-a", errors.New("only dynamically provisioned pvc can be resized and the storageclass that provisions the pvc must support resize")), codes.FailedPrecondition},
		{"host slow to grow", &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-a", CapacityRange: &csi.CapacityRange{RequiredBytes: 5 << 30}},
			context.DeadlineExceeded, codes.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vols.expandErr = tc.host
			defer func() { vols.expandErr = nil }()
			if _, err := s.ControllerExpandVolume(ctx, tc.req); status.Code(err) != tc.want {
				t.Errorf("answered %v, want %v", err, tc.want)
			}
		})
	}
}

// harvester/harvester#11716: a guest claim of 1G gets a host PVC rounded up
// to Longhorn's 2 MiB steps, 1000341504 bytes (954Mi); upstream's driver
// recorded the guest PV at the requested 1000000000. A later request between
// the two is an expansion the host already covers: upstream answered it
// FailedPrecondition ("Volume shrink is not supported"), which the
// external-resizer reads as "only offline expansion" and repeats forever.
// Here it is OK with the host's capacity, nothing is written to the host,
// and node expansion is asked for (the guest filesystem may still be at the
// old size). A volume this driver provisions for 1G is recorded at the
// rounded size to begin with.
func TestExpansionInsideTheHostRounding(t *testing.T) {
	ctx := context.Background()
	const guestPV, hostPVC = int64(1_000_000_000), int64(1_000_341_504) // 1G, 477 × 2 MiB
	s, vols, _ := newTestController(ControllerOptions{})
	created, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-repro", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: guestPV}})
	if err != nil {
		t.Fatal(err)
	}
	if got := created.GetVolume().GetCapacityBytes(); got != hostPVC {
		t.Errorf("a 1G claim is recorded at %d bytes, want the host's rounded %d", got, hostPVC)
	}
	pvc := vols.pvcs["pvc-repro"]
	pvc.Status.Capacity = pvc.Spec.Resources.Requests.DeepCopy()
	for _, required := range []int64{guestPV + 1, 1_000_300_000, hostPVC} {
		resp, err := s.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-repro",
			CapacityRange: &csi.CapacityRange{RequiredBytes: required}, VolumeCapability: rwo})
		if err != nil {
			t.Fatalf("expansion to %d bytes, inside the host's rounding: %v", required, err)
		}
		if resp.GetCapacityBytes() != hostPVC || !resp.GetNodeExpansionRequired() {
			t.Errorf("expansion to %d answered %d bytes (node expansion %v), want %d and node expansion", required, resp.GetCapacityBytes(), resp.GetNodeExpansionRequired(), hostPVC)
		}
		if got := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; got.Value() != hostPVC {
			t.Fatalf("the host PVC's request became %s for an expansion it already covered", got.String())
		}
	}
	// One byte past it is a real expansion, to the next 2 MiB step.
	resp, err := s.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-repro",
		CapacityRange: &csi.CapacityRange{RequiredBytes: hostPVC + 1}, VolumeCapability: rwo})
	if err != nil || resp.GetCapacityBytes() != hostPVC+2<<20 {
		t.Errorf("expansion past the rounding: %v, %v; want %d bytes", resp, err, hostPVC+2<<20)
	}
}
