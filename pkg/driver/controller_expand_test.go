package driver

import (
	"context"
	"errors"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
