package driver

import (
	"context"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
)

// listTokenPrefix starts every ListVolumes token; what follows is the last
// volume ID of the previous page. Pages resume after that ID in sorted order,
// so volumes created or deleted between pages neither repeat nor shift others.
const listTokenPrefix = "after:"

// ListVolumes lists the volumes this driver created and every volume attached
// to a VM, each with the VMs it is attached to. The external-attacher
// compares the published VMs with its VolumeAttachments and re-attaches
// where they drifted apart (a VMI that lost a hotplug volume, harvester 10588).
func (s *controllerService) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	after, err := pageStart(req.GetMaxEntries(), req.GetStartingToken())
	if err != nil {
		return nil, err
	}
	pvcs, err := s.volumes.ListVolumes(ctx)
	if err != nil {
		return nil, apiStatus(err, "list host PVCs")
	}
	published := s.hotplug.Published()
	byID := make(map[string]*corev1.PersistentVolumeClaim, len(pvcs))
	ids := make([]string, 0, len(pvcs)+len(published))
	for i := range pvcs {
		byID[pvcs[i].Name] = &pvcs[i]
		ids = append(ids, pvcs[i].Name)
	}
	for id := range published {
		if byID[id] == nil {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)

	start, end, next := page(ids, after, req.GetMaxEntries())
	resp := &csi.ListVolumesResponse{NextToken: next}
	for _, id := range ids[start:end] {
		vol := &csi.Volume{VolumeId: id}
		if pvc := byID[id]; pvc != nil {
			capacity := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
			vol.CapacityBytes = capacity.Value()
		}
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: vol,
			// VOLUME_CONDITION is offered, so every entry carries one.
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: published[id], VolumeCondition: s.condition(id, byID[id])},
		})
	}
	return resp, nil
}

// pageStart checks a list request's paging fields and returns the ID the page
// starts after.
func pageStart(maxEntries int32, tok string) (after string, err error) {
	if maxEntries < 0 {
		return "", status.Errorf(codes.InvalidArgument, "max_entries %d is negative", maxEntries)
	}
	if tok == "" {
		return "", nil
	}
	after, ok := strings.CutPrefix(tok, listTokenPrefix)
	if !ok || after == "" {
		return "", status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", tok)
	}
	return after, nil
}

// page picks the entries of sorted ids after the token's ID, at most max of
// them (0: all), and the token for the next page.
func page(ids []string, after string, max int32) (start, end int, next string) {
	start, _ = slices.BinarySearch(ids, after)
	if after != "" && start < len(ids) && ids[start] == after {
		start++
	}
	end = len(ids)
	if n := int(max); n > 0 && start+n < end {
		end = start + n
	}
	if end < len(ids) {
		next = listTokenPrefix + ids[end-1]
	}
	return start, end, next
}
