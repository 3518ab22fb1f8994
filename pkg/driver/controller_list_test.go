package driver

import (
	"context"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestListVolumesWithPublishedVMs(t *testing.T) {
	ctx := context.Background()
	s, vols, hp := newTestController(ControllerOptions{})
	for _, name := range []string{"pvc-c", "pvc-a", "pvc-b"} {
		if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{rwo}}); err != nil {
			t.Fatal(err)
		}
	}
	// pvc-up was attached by the upstream driver: not labelled, but attached.
	hp.published = map[string][]string{"pvc-b": {"vm1"}, "pvc-up": {"vm2"}}

	resp, err := s.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]string{}
	var order []string
	for _, e := range resp.GetEntries() {
		id := e.GetVolume().GetVolumeId()
		order = append(order, id)
		got[id] = e.GetStatus().GetPublishedNodeIds()
	}
	if want := []string{"pvc-a", "pvc-b", "pvc-c", "pvc-up"}; !slices.Equal(order, want) {
		t.Fatalf("listed %v, want %v", order, want)
	}
	if !slices.Equal(got["pvc-b"], []string{"vm1"}) || !slices.Equal(got["pvc-up"], []string{"vm2"}) || len(got["pvc-a"]) != 0 {
		t.Errorf("published nodes %v", got)
	}
	if resp.GetNextToken() != "" {
		t.Errorf("a single page ended with token %q", resp.GetNextToken())
	}
	if c := resp.GetEntries()[0].GetVolume().GetCapacityBytes(); c != minVolumeBytes {
		t.Errorf("pvc-a capacity %d, want %d", c, minVolumeBytes)
	}

	// Pages of two; a volume deleted and one created between pages neither
	// repeat nor hide the others.
	page1, err := s.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2})
	if err != nil {
		t.Fatal(err)
	}
	if len(page1.GetEntries()) != 2 || page1.GetNextToken() == "" {
		t.Fatalf("first page %v, token %q", page1.GetEntries(), page1.GetNextToken())
	}
	delete(vols.pvcs, "pvc-b")
	hp.published = map[string][]string{"pvc-up": {"vm2"}}
	if _, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-bb", VolumeCapabilities: []*csi.VolumeCapability{rwo}}); err != nil {
		t.Fatal(err)
	}
	page2, err := s.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: page1.GetNextToken()})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, e := range page2.GetEntries() {
		ids = append(ids, e.GetVolume().GetVolumeId())
	}
	if want := []string{"pvc-bb", "pvc-c"}; !slices.Equal(ids, want) {
		t.Errorf("second page %v, want %v", ids, want)
	}
	page3, err := s.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: page2.GetNextToken()})
	if err != nil {
		t.Fatal(err)
	}
	if len(page3.GetEntries()) != 1 || page3.GetEntries()[0].GetVolume().GetVolumeId() != "pvc-up" || page3.GetNextToken() != "" {
		t.Errorf("last page %v, token %q", page3.GetEntries(), page3.GetNextToken())
	}
}

func TestListVolumesBadInput(t *testing.T) {
	s, _, _ := newTestController(ControllerOptions{})
	for _, tc := range []struct {
		req  *csi.ListVolumesRequest
		want codes.Code
	}{
		{&csi.ListVolumesRequest{StartingToken: "invalid-token"}, codes.Aborted},
		{&csi.ListVolumesRequest{StartingToken: listTokenPrefix}, codes.Aborted},
		{&csi.ListVolumesRequest{MaxEntries: -1}, codes.InvalidArgument},
	} {
		if _, err := s.ListVolumes(context.Background(), tc.req); status.Code(err) != tc.want {
			t.Errorf("%+v answered %v, want %v", tc.req, err, tc.want)
		}
	}
}
