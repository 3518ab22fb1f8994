package driver

import (
	"context"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// listTokenPrefix starts every ListVolumes token; what follows is the last
// volume ID of the previous page. Pages resume after that ID in sorted order,
// so volumes created or deleted between pages neither repeat nor shift others.
const listTokenPrefix = "after:"

// ListVolumes lists the volumes this driver created and every volume attached
// to a VM, each with the VMs it is attached to (an RWX volume: the VMs of its
// attached guest VolumeAttachments while its export is enabled, rwxPublished).
// The external-attacher
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
	shares, err := s.listNetworkFS(ctx)
	if err != nil {
		return nil, err
	}
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
		nodes := published[id]
		if pvc := byID[id]; pvc != nil {
			capacity := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
			vol.CapacityBytes = capacity.Value()
			if fs := shares[pvc.Spec.VolumeName]; fs != nil && pvc.Spec.VolumeName != "" && !isBlock(pvc) {
				if nodes, err = s.rwxPublished(ctx, id, fs); err != nil {
					return nil, err
				}
			}
		}
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: vol,
			// VOLUME_CONDITION is offered, so every entry carries one.
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: nodes, VolumeCondition: s.condition(id, byID[id], nil)},
		})
	}
	return resp, nil
}

// listNetworkFS maps the host's NetworkFilesystems by name (the Longhorn
// volume, i.e. a host PVC's spec.volumeName); none when RWX is not served.
func (s *controllerService) listNetworkFS(ctx context.Context) (map[string]*host.NetworkFS, error) {
	if s.opts.NetworkFS == nil || s.opts.RWX == nil || !s.opts.RWX() {
		return nil, nil
	}
	ctx, cancel := context.WithTimeout(ctx, hostCallTimeout)
	defer cancel()
	list, err := s.opts.NetworkFS.ListNetworkFS(ctx)
	if err != nil {
		return nil, apiStatus(err, "list NetworkFilesystems in %s", host.NetworkFSNamespace)
	}
	out := make(map[string]*host.NetworkFS, len(list))
	for i := range list {
		out[list[i].Name] = &list[i]
	}
	return out, nil
}

func isBlock(pvc *corev1.PersistentVolumeClaim) bool {
	return pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock
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
